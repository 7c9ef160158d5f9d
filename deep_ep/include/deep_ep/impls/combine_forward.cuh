// Combine in hybrid mode across nodes (a transport with `kForwards`, comm/gin_hybrid.cuh), in one
// launch on every rank, in DeepEP's hybrid order (combine_hybrid_reduce.cuh):
//   A. each owner d computes its rank partial of every token row it received (its row, or expanded
//      the bf16 of the fp32 sum of its slots) and stores it over NVLink: for a source of its own node
//      into its own window at the row's index (the source pulls it, as on one node); for a source s of
//      another node into the forwarding area of f = node(d) * S + local(s), entry (token, local(d)),
//      with the call mark, d's last top-k slot of the token and d's K weights; the last block
//      signals the node;
//   B. after the node's arrivals, each forwarder sums the entries of every token of its rail peers in
//      ascending order of their last slots, from +0.0, rounds to bf16 and puts ONE slot per token to
//      the source's inbox (the node partial, the call mark, which entries there were, their
//      weights); the last block puts the node's tags and signals every rail peer;
//   C. after the rail signals, each source adds per token the biases and each node's partial at the
//      node's last slot (its own node's computed from pulled rows, as B computes it).
// An entry (owner to forwarder) and a node slot (forwarder to source): [values: kHidden bf16] then at
// CombineRow::kWeightOffset the call mark and the call tag's fingerprint (they mark it as this call's,
// also in a CUDA graph's replays: comm/gin_hybrid.cuh), int last slot (entry) or mask of entries
// (node slot), a pad word, float weight[K] (entry) or weight[S][K] (node slot).
#pragma once

#include "../comm/lsa.cuh"
#include "../comm/push.cuh"
#include "../common/grid.cuh"
#include "combine_hybrid_reduce.cuh"
#include "combine_hybrid_single.cuh"

namespace deep_ep {

// Stage A: rank partials to the source's node (in this window) or to the forwarders of this node.
template <int kHidden, int K, bool kExpand, typename Transport>
__device__ __forceinline__ void combine_stage_partials(const CombineArgs& a, const Transport& tr) {
    using Row = CombineRow<kHidden, K, kExpand>;
    const WarpGrid wg;
    const int lane = wg.lane, R = tr.num_ranks, L = a.num_experts / R, rank = tr.rank, S = tr.node_ranks;
    const LayoutIndex ix{R, L, a.num_experts};
    uint8_t* my_window = tr.local();
    const int half = comm::current_half(my_window);
    const int num_tok_rows = comm::has_error(my_window) ? 0 : a.layout[ix.num_tok_rows()];
    const int self_begin = rank == 0 ? 0 : a.layout[ix.tok_prefix() + rank - 1];
    const int self_end = a.layout[ix.tok_prefix() + rank];
    const int entry_bytes = hybrid_entry_bytes<kHidden, K>();
    const int mark = static_cast<int>(tr.call_mark());
    for (int j = wg.warp; j < num_tok_rows; j += wg.num_warps) {
        if (j >= self_begin && j < self_end) continue;  // the source is this rank: summed there
        int source = 0;
        while (source < R - 1 && j >= a.layout[ix.tok_prefix() + source]) ++source;
        const int* meta = a.src_meta + static_cast<int64_t>(j) * (K + 2);
        int peer = rank;
        int64_t dst = comm::row_offset(a, half, j);
        int64_t weights_at = dst + Row::kWeightOffset;
        if (source / S != tr.node()) {
            const int token = meta[0] - source * a.max_tokens;  // (M = 0: column 0 is the token)
            peer = tr.node() * S + source % S;  // the forwarder: this node's rank of the source's local index
            dst = tr.combine_entry(half, source / S, token * S + rank % S, entry_bytes);
            weights_at = dst + Row::kWeightOffset + 16;
            if (lane == 0) {
                tr.template put<int>(peer, dst + Row::kWeightOffset, mark);
                tr.template put<int>(peer, dst + Row::kWeightOffset + 4, static_cast<int>(a.tag.fingerprint));
                tr.template put<int>(peer, dst + Row::kWeightOffset + 8, meta[1] - source * K);
            }
        }
        if (!kExpand) {
            const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(j) * kHidden);
            for (int i = lane; i < Row::kVecs; i += 32) tr.template put<int4>(peer, dst + 16 * i, ld_nc(src + i));
            if (lane < K)
                tr.template put<float>(peer, weights_at + 4 * lane,
                                       a.weights_in != nullptr ? a.weights_in[static_cast<int64_t>(j) * K + lane] : 0.0f);
        } else {
            const int my_out = lane < K ? meta[2 + lane] : -1;
            const float my_w = (a.apply_weights && my_out >= 0) ? a.recv_weights[my_out] : 1.0f;
            for (int base = 0; base < Row::kVecs; base += 32) {
                const int i = base + lane;
                const bool active = i < Row::kVecs;
                float part[1][8] = {{0, 0, 0, 0, 0, 0, 0, 0}};
#pragma unroll
                for (int k = 0; k < K; ++k) {
                    const int out = __shfl_sync(0xffffffffu, my_out, k);
                    const float w = __shfl_sync(0xffffffffu, my_w, k);
                    if (out < 0 || !active) continue;
                    const int4 v[1] = {ld_nc(reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(out) * kHidden) + i)};
                    if (a.apply_weights) add_weighted_bf16_chunk(v, w, part);
                    else add_bf16_chunk(v, part);
                }
                if (active) tr.template put<int4>(peer, dst + 16 * i, f32_to_bf16x8(part[0]));
            }
            if (lane < K)
                tr.template put<float>(peer, weights_at + 4 * lane,
                                       (a.weights_in != nullptr && my_out >= 0) ? a.weights_in[my_out] : 0.0f);
        }
    }
    if (comm::last_block(my_window)) tr.signal_node(a.tag, false);
}

// Stage B (`ok`: the node's arrivals came): node partials of the rail peers' tokens, one put each.
template <int kHidden, int K, bool kExpand, typename Transport>
__device__ __forceinline__ void combine_forward_impl(const CombineArgs& a, const Transport& tr, bool ok) {
    using Row = CombineRow<kHidden, K, kExpand>;
    const WarpGrid wg;
    const int lane = wg.lane, S = tr.node_ranks;
    const int half = comm::current_half(tr.local());
    const int call = static_cast<int>(tr.call_mark()), fingerprint = static_cast<int>(a.tag.fingerprint);
    const int entry_bytes = hybrid_entry_bytes<kHidden, K>(), slot_bytes = hybrid_node_slot_bytes<kHidden, K>(S);
    // Tokens a source may have: M, or (M = 0: no limit was given) what a node region holds.
    const int64_t fit = tr.node_bytes() / (static_cast<int64_t>(S) * entry_bytes);
    const int max_tokens = !ok ? 0 : a.max_tokens > 0 ? a.max_tokens : static_cast<int>(fit);
    for (int from_node = 0; from_node < tr.num_nodes(); ++from_node) {
        if (from_node == tr.node()) continue;
        const int source = tr.rail_peer(from_node);
        for (int t = wg.warp; t < max_tokens; t += wg.num_warps) {
            // lane e < S: entry e (this node's rank e), its last slot (-1: no entry of this call)
            int last = -1;
            if (lane < S) {
                const int* e = reinterpret_cast<const int*>(
                    tr.at(tr.combine_entry(half, from_node, t * S + lane, entry_bytes) + Row::kWeightOffset));
                if (__ldcg(e) == call && __ldcg(e + 1) == fingerprint) last = __ldcg(e + 2);
            }
            const unsigned present = __ballot_sync(0xffffffffu, last >= 0);
            if (present == 0u) continue;  // the token reaches no rank of this node
            // lane p < count: the entry whose last slot is the p-th smallest
            int order = 0;
            for (int q = 0; q < S; ++q) {
                const int other = __shfl_sync(0xffffffffu, last, q);
                if (other >= 0 && other < last) ++order;
            }
            int entry_of = -1;
            for (int q = 0; q < S; ++q) {
                const int q_order = __shfl_sync(0xffffffffu, order, q);
                if (((present >> q) & 1u) != 0u && q_order == lane) entry_of = q;
            }
            const int count = __popc(present);
            const int64_t staged = tr.stage_row(source, t, slot_bytes);
            uint8_t* out = tr.at(staged);
            for (int base = 0; base < Row::kVecs; base += 32) {
                const int i = base + lane;
                float acc[1][8] = {{0, 0, 0, 0, 0, 0, 0, 0}};
                for (int p = 0; p < count; ++p) {
                    const int e = __shfl_sync(0xffffffffu, entry_of, p);
                    if (i >= Row::kVecs) continue;
                    const int4* src = reinterpret_cast<const int4*>(tr.at(tr.combine_entry(half, from_node, t * S + e, entry_bytes)));
                    const int4 v[1] = {__ldcg(src + i)};
                    add_bf16_chunk(v, acc);
                }
                if (i < Row::kVecs) reinterpret_cast<int4*>(out)[i] = f32_to_bf16x8(acc[0]);
            }
            int* trailer = reinterpret_cast<int*>(out + Row::kWeightOffset);
            if (lane == 0) {
                trailer[0] = call;
                trailer[1] = fingerprint;
                trailer[2] = static_cast<int>(present);
            }
            for (int idx = lane; idx < S * K; idx += 32) {
                const int e = idx / K;
                const float* w = reinterpret_cast<const float*>(
                    tr.at(tr.combine_entry(half, from_node, t * S + e, entry_bytes) + Row::kWeightOffset + 16));
                reinterpret_cast<float*>(trailer)[4 + idx] = ((present >> e) & 1u) != 0u ? __ldcg(w + idx % K) : 0.0f;
            }
            tr.put_staged(source, staged, tr.inbox_slot(half, tr.node(), t, slot_bytes), slot_bytes, lane);
        }
    }
    if (comm::last_block(tr.local(), comm::kCtrlRailDone)) tr.signal_rails(a.tag, half, -1);
}

// The whole hybrid combine (A to C above; with kUnreduced, a buffer without multiple reduction, the
// stages of combine_hybrid_single.cuh, which pass rows on unreduced and sum in the flat order).
// Blocks wait for other blocks and for peers: all resident.
template <int kHidden, int K, bool kExpand, bool kUnreduced, typename Transport>
__device__ __forceinline__ void combine_hybrid_impl(const CombineArgs& a, const Transport& tr) {
    uint8_t* my_window = tr.local();
    if constexpr (kUnreduced && kExpand) combine_stage_slots<kHidden, K>(a, tr);
    else combine_stage_partials<kHidden, K, kExpand>(a, tr);   // a non-expanded row is its rank's partial
    const bool node_ok = tr.wait_all(kPhaseCombine, a.timeout_ns);
    if constexpr (kUnreduced) combine_forward_rows<kHidden, K, kExpand>(a, tr, node_ok);
    else combine_forward_impl<kHidden, K, kExpand>(a, tr, node_ok);
    const bool rails_ok = tr.wait_rails(kPhaseCombineRail, a.timeout_ns);
    const bool ok = node_ok && rails_ok && comm::check_tags(my_window, tr.rank, tr.num_ranks, a.tag);
    if constexpr (kUnreduced) combine_hybrid_reduce_flat<kHidden, K, kExpand>(a, tr, ok);
    else combine_hybrid_reduce_impl<kHidden, K, kExpand>(a, tr, ok);
    comm::finish_wait(my_window, true, a.err_host);
}

}  // namespace deep_ep
