// Combine in hybrid mode across nodes on a buffer without multiple reduction (EP_SINGLE_REDUCTION=1):
// the stages of combine_forward.cuh, but nothing is summed before the source, which adds in
// deep_ep.reference's flat order (the hybrid order's node partials need multiple reduction):
//   non-expanded: each owner's row of the token (its rank partial) reaches the source as it is and is
//     added at the owner's last top-k slot;
//   expanded: every (token, slot) row reaches the source as it is (combine_single.cuh's sum: biases,
//     then each slot's row in slot order, times its dispatch weight with apply_weights).
// A: owners store rows for sources of their own node in their own window (non-expanded at the row's
//    index, as combine_forward.cuh; expanded row `index * K + slot`, as combine_single.cuh), and for a
//    source of another node into the forwarding area of this node's rail peer of the source: entries
//    per (token, rank of the node) as combine_forward.cuh (non-expanded), or per (token, slot)
//    (expanded: [values][call mark, fingerprint, slot, dispatch weight]);
// B: forwarders pass each token's entries on in ONE put per token: a rows slot of the source's inbox,
//    [trailer: call mark, fingerprint, mask of entries, pad, weights][the entries' values, in
//    ascending entry order, packed]; the put carries the trailer and the rows present only;
// C: the source sums, reading another node's rows from its inbox at their packed position (it knows
//    from its routing which entries its token has there).
// Room (window.check_hybrid_combine with unreduced=True): per source node M * S entries (non-expanded)
// or M * K (expanded) in the forwarding area, M rows slots in the inbox.
#pragma once

#include "../comm/lsa.cuh"
#include "../comm/push.cuh"
#include "../common/grid.cuh"
#include "combine_hybrid_reduce.cuh"
#include "combine_single.cuh"

namespace deep_ep {

// Entries per token at a forwarder: one per rank of the node, or one per slot.
template <int K, bool kExpand>
__device__ __forceinline__ int unreduced_entries(int node_ranks) {
    return kExpand ? K : node_ranks;
}
// Bytes of an expanded entry: the row's values, then call mark, fingerprint, slot, dispatch weight.
template <int kHidden, int K>
__device__ __forceinline__ int hybrid_slot_entry_bytes() {
    return CombineRow<kHidden, K, true>::kWeightOffset + 16;
}
template <int kHidden, int K, bool kExpand>
__device__ __forceinline__ int unreduced_entry_bytes() {
    return kExpand ? hybrid_slot_entry_bytes<kHidden, K>() : hybrid_entry_bytes<kHidden, K>();
}
// A rows slot's trailer (call mark, fingerprint, mask, pad, then float weight[K] expanded, the
// dispatch weights by slot, or weight[S][K] non-expanded, each rank's top-k weights) and whole size.
template <int K, bool kExpand>
__device__ __forceinline__ int rows_trailer_bytes(int node_ranks) {
    return (16 + 4 * K * (kExpand ? 1 : node_ranks) + 15) / 16 * 16;
}
template <int kHidden, int K, bool kExpand>
__device__ __forceinline__ int rows_slot_bytes(int node_ranks) {
    return rows_trailer_bytes<K, kExpand>(node_ranks) +
           unreduced_entries<K, kExpand>(node_ranks) * CombineRow<kHidden, K, kExpand>::kWeightOffset;
}

// Stage A, expanded: every local slot's row, as it is, to the source's node.
template <int kHidden, int K, typename Transport>
__device__ __forceinline__ void combine_stage_slots(const CombineArgs& a, const Transport& tr) {
    using Row = CombineRow<kHidden, K, true>;
    const WarpGrid wg;
    const int lane = wg.lane, R = tr.num_ranks, L = a.num_experts / R, rank = tr.rank, S = tr.node_ranks;
    const LayoutIndex ix{R, L, a.num_experts};
    uint8_t* my_window = tr.local();
    const int half = comm::current_half(my_window);
    const int num_tok_rows = comm::has_error(my_window) ? 0 : a.layout[ix.num_tok_rows()];
    const int self_begin = rank == 0 ? 0 : a.layout[ix.tok_prefix() + rank - 1];
    const int self_end = a.layout[ix.tok_prefix() + rank];
    const int entry_bytes = hybrid_slot_entry_bytes<kHidden, K>();
    const int mark = static_cast<int>(tr.call_mark());
    for (int j = wg.warp; j < num_tok_rows; j += wg.num_warps) {
        if (j >= self_begin && j < self_end) continue;  // the source is this rank: summed there
        int source = 0;
        while (source < R - 1 && j >= a.layout[ix.tok_prefix() + source]) ++source;
        const int* meta = a.src_meta + static_cast<int64_t>(j) * (K + 2);
        const bool remote = source / S != tr.node();
        const int token = meta[0] - source * a.max_tokens;
        const int peer = remote ? tr.node() * S + source % S : rank;  // the forwarder, or this window
        const int my_out = lane < K ? meta[2 + lane] : -1;
        const float my_w = (a.apply_weights && my_out >= 0) ? a.recv_weights[my_out] : 0.0f;
#pragma unroll 1
        for (int k = 0; k < K; ++k) {
            const int out = __shfl_sync(0xffffffffu, my_out, k);
            const float w = __shfl_sync(0xffffffffu, my_w, k);
            if (out < 0) continue;  // warp-uniform: not a local slot
            const int64_t dst = remote ? tr.combine_entry(half, source / S, token * K + k, entry_bytes)
                                       : single_row_offset<K, Transport>(a, half, R, rank, j, k);
            const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(out) * kHidden);
            for (int i = lane; i < Row::kVecs; i += 32) tr.template put<int4>(peer, dst + 16 * i, ld_nc(src + i));
            if (lane == 0 && remote) {
                tr.template put<int>(peer, dst + Row::kWeightOffset, mark);
                tr.template put<int>(peer, dst + Row::kWeightOffset + 4, static_cast<int>(a.tag.fingerprint));
                tr.template put<int>(peer, dst + Row::kWeightOffset + 8, k);
                tr.template put<float>(peer, dst + Row::kWeightOffset + 12, w);
            } else if (lane == 0 && a.apply_weights) {
                tr.template put<float>(peer, dst + Row::kWeightOffset, w);  // combine_single.cuh's place
            }
        }
    }
    if (comm::last_block(my_window)) tr.signal_node(a.tag, false);
}

// Stage B (`ok`: the node's arrivals came): each token's entries of the rail peers, packed, one put.
template <int kHidden, int K, bool kExpand, typename Transport>
__device__ __forceinline__ void combine_forward_rows(const CombineArgs& a, const Transport& tr, bool ok) {
    static_assert(K <= 32, "a lane per slot");
    using Row = CombineRow<kHidden, K, kExpand>;
    const WarpGrid wg;
    const int lane = wg.lane, S = tr.node_ranks;
    const int half = comm::current_half(tr.local());
    const int call = static_cast<int>(tr.call_mark()), fingerprint = static_cast<int>(a.tag.fingerprint);
    const int per_token = unreduced_entries<K, kExpand>(S);
    const int entry_bytes = unreduced_entry_bytes<kHidden, K, kExpand>();
    const int trailer_bytes = rows_trailer_bytes<K, kExpand>(S), slot_bytes = rows_slot_bytes<kHidden, K, kExpand>(S);
    // Tokens a source may have: M, or (M = 0: no limit was given) what a node region holds.
    const int64_t fit = tr.node_bytes() / (static_cast<int64_t>(per_token) * entry_bytes);
    const int max_tokens = !ok ? 0 : a.max_tokens > 0 ? a.max_tokens : static_cast<int>(fit);
    for (int from_node = 0; from_node < tr.num_nodes(); ++from_node) {
        if (from_node == tr.node()) continue;
        const int source = tr.rail_peer(from_node);
        for (int t = wg.warp; t < max_tokens; t += wg.num_warps) {
            auto entry = [&](const int e) -> int64_t {
                return tr.combine_entry(half, from_node, t * per_token + e, entry_bytes);
            };
            bool here = false;
            if (lane < per_token) {
                const int* e = reinterpret_cast<const int*>(tr.at(entry(lane) + Row::kWeightOffset));
                here = __ldcg(e) == call && __ldcg(e + 1) == fingerprint;
            }
            const unsigned present = __ballot_sync(0xffffffffu, here);
            if (present == 0u) continue;  // the token reaches no rank of this node
            const int64_t staged = tr.stage_row(source, t, slot_bytes);
            uint8_t* out = tr.at(staged);
            int packed = 0;
            for (int e = 0; e < per_token; ++e) {  // warp-uniform
                if (((present >> e) & 1u) == 0u) continue;
                const int4* src = reinterpret_cast<const int4*>(tr.at(entry(e)));
                int4* dst = reinterpret_cast<int4*>(out + trailer_bytes + static_cast<int64_t>(packed) * Row::kWeightOffset);
                for (int i = lane; i < Row::kVecs; i += 32) dst[i] = __ldcg(src + i);
                ++packed;
            }
            int* trailer = reinterpret_cast<int*>(out);
            if (lane == 0) {
                trailer[0] = call;
                trailer[1] = fingerprint;
                trailer[2] = static_cast<int>(present);
                trailer[3] = 0;
            }
            float* weights = reinterpret_cast<float*>(trailer + 4);
            if constexpr (kExpand) {
                if (lane < K)
                    weights[lane] = here ? __ldcg(reinterpret_cast<const float*>(tr.at(entry(lane) + Row::kWeightOffset + 12)))
                                         : 0.0f;
            } else {
                for (int idx = lane; idx < S * K; idx += 32) {
                    const int e = idx / K;
                    const float* w = reinterpret_cast<const float*>(tr.at(entry(e) + Row::kWeightOffset + 16));
                    weights[idx] = ((present >> e) & 1u) != 0u ? __ldcg(w + idx % K) : 0.0f;
                }
            }
            tr.put_staged(source, staged, tr.inbox_slot(half, tr.node(), t, slot_bytes),
                          trailer_bytes + packed * Row::kWeightOffset, lane);
        }
    }
    if (comm::last_block(tr.local(), comm::kCtrlRailDone)) tr.signal_rails(a.tag, half, -1);
}

// Stage C: every warp strides over this rank's tokens (`ok`: every wait succeeded, the tags match).
template <int kHidden, int K, bool kExpand, typename Transport>
__device__ __forceinline__ void combine_hybrid_reduce_flat(const CombineArgs& a, const Transport& tr, bool ok) {
    using Row = CombineRow<kHidden, K, kExpand>;
    const WarpGrid wg;
    const int lane = wg.lane, R = tr.num_ranks, L = a.num_experts / R, rank = tr.rank, S = tr.node_ranks;
    const int my_node = tr.node();
    const int half = comm::current_half(tr.local());
    const int trailer_bytes = rows_trailer_bytes<K, kExpand>(S), slot_bytes = rows_slot_bytes<kHidden, K, kExpand>(S);
    const int first = ok ? wg.warp : a.num_tokens;
    for (int t = first; t < a.num_tokens; t += wg.num_warps) {
        int expert = -1;
        if (lane < K) {
            const int64_t id = a.topk_idx[static_cast<int64_t>(t) * K + lane];
            expert = (id >= 0 && id < a.num_experts) ? static_cast<int>(id) : -1;
        }
        // Lanes < K: slot lane's owner rank and node, the token's row at the owner, and (expanded,
        // owned here) the pair's row.
        const int owner = expert >= 0 ? expert / L : -1;
        const int node = owner >= 0 ? owner / S : -1;
        const int row_at_owner = owner >= 0 ? a.pos_tok[static_cast<int64_t>(t) * R + owner] : -1;
        const int my_pair = (kExpand && owner == rank) ? a.pos_pair[static_cast<int64_t>(t) * K + lane] : -1;
        // Whether slot lane adds a row: expanded each slot with a row, non-expanded the last slot of
        // each owner (its rank partial).
        bool adds;
        if constexpr (kExpand) {
            adds = owner == rank ? my_pair >= 0 : owner >= 0 && row_at_owner >= 0;
        } else {
            const unsigned same_owner = __match_any_sync(0xffffffffu, lane < K ? owner : -2 - lane);
            adds = owner >= 0 && row_at_owner >= 0 && 31 - __clz(same_owner) == lane;
        }
        const unsigned adding = __ballot_sync(0xffffffffu, lane < K && adds);
        const bool silent_slot = __popc(adding) < K;
        // Another node's row: its packed place in the node's rows slot, among the entries of that
        // node the token has (expanded by slot, non-expanded by the owner's local index).
        int packed = 0;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int other = __shfl_sync(0xffffffffu, owner, k);
            const bool before = kExpand ? k < lane : other % S < owner % S;
            if (((adding >> k) & 1u) != 0u && other / S == node && before) ++packed;
        }
        // Lane k < K: where slot k's row is read (kind 0: this rank's expert outputs, 1: a node
        // peer's window, 2: this rank's inbox) and its dispatch weight (expanded, apply_weights).
        int kind = 0;
        int64_t where = -1;
        float weight = 1.0f;
        if (lane < K && adds) {
            if (owner == rank) {
                where = kExpand ? my_pair : row_at_owner;
                if (kExpand && a.apply_weights) weight = a.recv_weights[where];
            } else if (node == my_node) {
                kind = 1;
                where = kExpand ? single_row_offset<K, Transport>(a, half, R, owner, row_at_owner, lane)
                                : comm::row_offset(a, half, row_at_owner);
                if (kExpand && a.apply_weights) weight = tr.template get<float>(owner, where + Row::kWeightOffset);
            } else {
                kind = 2;
                const int64_t slot = tr.inbox_slot(half, node, t, slot_bytes);
                where = slot + trailer_bytes + static_cast<int64_t>(packed) * Row::kWeightOffset;
                if (kExpand && a.apply_weights) weight = __ldcg(reinterpret_cast<const float*>(tr.at(slot + 16)) + lane);
            }
        }
        for (int base = 0; base < Row::kVecs; base += 32) {
            float acc[1][8];
            init_from_biases<kHidden, 1, Row::kVecs>(a, t, base, lane, acc);
            for (int k = 0; k < K; ++k) {
                if (((adding >> k) & 1u) == 0u) continue;  // warp-uniform
                const int d = __shfl_sync(0xffffffffu, owner, k);
                const int how = __shfl_sync(0xffffffffu, kind, k);
                const int64_t at = __shfl_sync(0xffffffffu, where, k);
                const float w = __shfl_sync(0xffffffffu, weight, k);
                int4 v[1];
                if (how == 0)
                    load_chunk<1, Row::kVecs, false>(reinterpret_cast<const int4*>(a.y + at * kHidden), base, lane, v);
                else if (how == 1)
                    tr.template get_chunk<1, Row::kVecs>(d, at, base, lane, v);
                else
                    load_chunk<1, Row::kVecs, true>(reinterpret_cast<const int4*>(tr.at(at)), base, lane, v);
                if (kExpand && a.apply_weights) add_weighted_bf16_chunk(v, w, acc);
                else add_bf16_chunk(v, acc);
            }
            finish_and_store<kHidden, 1, Row::kVecs>(a, t, base, lane, silent_slot, acc);
        }
        // Top-k weights (non-expanded; expanded ones need multiple reduction): slot k's from its owner.
        if (!kExpand && a.out_weights != nullptr && lane < K) {
            float w = 0.0f;
            if (owner >= 0 && row_at_owner >= 0) {
                if (owner == rank) {
                    w = a.weights_in[static_cast<int64_t>(row_at_owner) * K + lane];
                } else if (node == my_node) {
                    w = tr.template get<float>(owner, comm::row_offset(a, half, row_at_owner) + Row::kWeightOffset + 4 * lane);
                } else {
                    const float* slot = reinterpret_cast<const float*>(tr.at(tr.inbox_slot(half, node, t, slot_bytes) + 16));
                    w = __ldcg(slot + (owner % S) * K + lane);
                }
            }
            a.out_weights[static_cast<int64_t>(t) * K + lane] = w;
        }
    }
}

}  // namespace deep_ep
