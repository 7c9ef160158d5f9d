// The source's sum of a hybrid combine across nodes (impls/combine_forward.cuh, stage C), in
// deep_ep.reference's hybrid order (docs/scaleout.md, "Combine order across nodes"):
//   p_d = the rank partial of rank d (its row, or the bf16 of the fp32 sum of its slots);
//   q_n = bf16(+0.0 + p_d + ...) over the ranks d of node n the token reached, in ascending order of
//         each rank's last top-k slot (another node's comes in this rank's inbox, rounded there;
//         this rank's node's is computed here from its own rows and the rows its node peers staged);
//   acc = the biases (combine_reduce.cuh), then for k = 0 .. K-1: += q_n at the last slot of each
//         node n, +0.0 elsewhere; out = bf16(acc).
// Top-k weights: slot k's comes from its owner (its staged row, or the inbox's entry of its node).
#pragma once

#include "../comm/lsa.cuh"
#include "../common/grid.cuh"
#include "combine_reduce.cuh"

namespace deep_ep {

// Bytes of an owner's entry at a forwarder and of a node slot in a source's inbox (nodes of `node_ranks`).
template <int kHidden, int K>
__device__ __forceinline__ int hybrid_entry_bytes() {
    return CombineRow<kHidden, K, false>::kWeightOffset + (16 + 4 * K + 15) / 16 * 16;
}
template <int kHidden, int K>
__device__ __forceinline__ int hybrid_node_slot_bytes(int node_ranks) {
    return CombineRow<kHidden, K, false>::kWeightOffset + (16 + 4 * K * node_ranks + 15) / 16 * 16;
}

// Every warp strides over this rank's tokens (`ok`: every wait succeeded and the tags match).
template <int kHidden, int K, bool kExpand, typename Transport>
__device__ __forceinline__ void combine_hybrid_reduce_impl(const CombineArgs& a, const Transport& tr, bool ok) {
    using Row = CombineRow<kHidden, K, kExpand>;
    const WarpGrid wg;
    const int lane = wg.lane, R = tr.num_ranks, L = a.num_experts / R, rank = tr.rank, S = tr.node_ranks;
    const int my_node = tr.node();
    const int half = comm::current_half(tr.local());
    const int slot_bytes = hybrid_node_slot_bytes<kHidden, K>(S);
    const int first = ok ? wg.warp : a.num_tokens;
    for (int t = first; t < a.num_tokens; t += wg.num_warps) {
        int expert = -1;
        if (lane < K) {
            const int64_t id = a.topk_idx[static_cast<int64_t>(t) * K + lane];
            expert = (id >= 0 && id < a.num_experts) ? static_cast<int>(id) : -1;
        }
        // Lanes < K: slot lane's owner rank and node, whether it is the last slot of each, the row
        // at the owner, and (expanded, owned here) the pair's row and dispatch weight.
        const int owner = expert >= 0 ? expert / L : -1;
        const int node = owner >= 0 ? owner / S : -1;
        const unsigned same_owner = __match_any_sync(0xffffffffu, lane < K ? owner : -2 - lane);
        const unsigned same_node = __match_any_sync(0xffffffffu, lane < K ? node : -2 - lane);
        const bool last_of_rank = owner >= 0 && 31 - __clz(same_owner) == lane;
        const bool last_of_node = node >= 0 && 31 - __clz(same_node) == lane;
        const bool silent_slot = __popc(__ballot_sync(0xffffffffu, last_of_node)) < K;
        const unsigned node_slots = __ballot_sync(0xffffffffu, last_of_node);
        const unsigned own_node_ranks = __ballot_sync(0xffffffffu, last_of_rank && node == my_node);
        const int row_at_owner = owner >= 0 ? a.pos_tok[static_cast<int64_t>(t) * R + owner] : -1;
        int my_pair = -1;
        float my_pair_w = 1.0f;
        if (kExpand && owner == rank && lane < K) {
            my_pair = a.pos_pair[static_cast<int64_t>(t) * K + lane];
            if (a.apply_weights && my_pair >= 0) my_pair_w = a.recv_weights[my_pair];
        }
        for (int base = 0; base < Row::kVecs; base += 32) {
            float acc[1][8];
            init_from_biases<kHidden, 1, Row::kVecs>(a, t, base, lane, acc);
            for (int k = 0; k < K; ++k) {
                if (((node_slots >> k) & 1u) == 0u) continue;
                const int n = __shfl_sync(0xffffffffu, node, k);
                if (n != my_node) {
                    // another node's partial, rounded at its forwarder
                    const int4* src = reinterpret_cast<const int4*>(tr.at(tr.inbox_slot(half, n, t, slot_bytes)));
                    int4 v[1];
                    load_chunk<1, Row::kVecs, true>(src, base, lane, v);
                    add_bf16_chunk(v, acc);
                    continue;
                }
                float part[1][8];
                zero_chunk(part);
                for (int k2 = 0; k2 < K; ++k2) {
                    if (((own_node_ranks >> k2) & 1u) == 0u) continue;
                    const int d = __shfl_sync(0xffffffffu, owner, k2);
                    const int row = __shfl_sync(0xffffffffu, row_at_owner, k2);
                    if (d == rank && !kExpand) {
                        int4 v[1];
                        load_chunk<1, Row::kVecs, false>(reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(row) * kHidden),
                                                         base, lane, v);
                        add_bf16_chunk(v, part);
                    } else if (d == rank) {
                        float mine[1][8];
                        zero_chunk(mine);
                        for (int kk = 0; kk < K; ++kk) {
                            const int out = __shfl_sync(0xffffffffu, my_pair, kk);
                            const float w = __shfl_sync(0xffffffffu, my_pair_w, kk);
                            if (out < 0) continue;
                            int4 v[1];
                            load_chunk<1, Row::kVecs, false>(reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(out) * kHidden),
                                                             base, lane, v);
                            if (a.apply_weights) add_weighted_bf16_chunk(v, w, mine);
                            else add_bf16_chunk(v, mine);
                        }
                        add_rounded_chunk(mine, part);
                    } else {
                        int4 v[1];
                        tr.template get_chunk<1, Row::kVecs>(d, comm::row_offset(a, half, row), base, lane, v);
                        add_bf16_chunk(v, part);
                    }
                }
                add_rounded_chunk(part, acc);
            }
            finish_and_store<kHidden, 1, Row::kVecs>(a, t, base, lane, silent_slot, acc);
        }
        if (a.out_weights != nullptr && lane < K) {
            float w = 0.0f;
            if (owner >= 0 && row_at_owner >= 0) {
                if (owner == rank) {
                    w = kExpand ? (my_pair >= 0 ? a.weights_in[my_pair] : 0.0f)
                                : a.weights_in[static_cast<int64_t>(row_at_owner) * K + lane];
                } else if (node == my_node) {
                    w = tr.template get<float>(owner, comm::row_offset(a, half, row_at_owner) + Row::kWeightOffset + 4 * lane);
                } else {
                    const float* slot = reinterpret_cast<const float*>(
                        tr.at(tr.inbox_slot(half, node, t, slot_bytes) + Row::kWeightOffset + 16));
                    w = __ldcg(slot + (owner % S) * K + lane);
                }
            }
            a.out_weights[static_cast<int64_t>(t) * K + lane] = w;
        }
    }
}

}  // namespace deep_ep
