// Combine of an expanded handle with single reduction (a buffer with allow_multiple_reduction=False):
// no rank pre-reduces its slots of a token; every (token, slot) row reaches the source as it is, and
// the source adds the K rows in slot order onto the biases, each addition rounded to fp32, the sum
// rounded once to bf16 (step 3 of deep_ep.reference). Room: every token row a destination holds has
// K staged rows, one per slot: row `index * K + k` where `index` is the token's row there (pulled
// from the destination's window), or its index among the rows the destination holds from that source
// (pushed into the source's window, `pushed_row_offset`). The host checks the window holds K rows per
// token of every rank. With apply_weights a staged row carries its dispatch weight in the first word
// of its trailer: the source multiplies (the product is fp32, not a bf16 row).
#pragma once

#include "../comm/lsa.cuh"
#include "../comm/push.cuh"
#include "../common/grid.cuh"
#include "combine_reduce.cuh"

namespace deep_ep {

// Offset of the staged row of slot `slot` of the token at `index` (see above) at owner rank `owner`,
// in the window the source reads it from.
template <int K, typename Transport>
__device__ __forceinline__ int64_t single_row_offset(const CombineArgs& a, int half, int num_ranks, int owner,
                                                     int index, int slot) {
    if constexpr (comm::kPushes<Transport>)
        return pushed_row_offset(a, half, num_ranks, owner, index * K + slot);
    else
        return comm::row_offset(a, half, index * K + slot);
}

// Send phase on destination d: for every token row j from a peer, the rows of its local slots, each
// copied to its own staged row.
template <int kHidden, int K, typename Transport>
__device__ __forceinline__ void combine_send_single(const CombineArgs& a, const Transport& tr) {
    using Row = CombineRow<kHidden, K, true>;
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = tr.num_ranks, L = a.num_experts / tr.num_ranks, rank = tr.rank;
    const LayoutIndex ix{R, L, a.num_experts};
    uint8_t* my_window = tr.local();
    const int half = comm::current_half(my_window);
    const int num_tok_rows = comm::has_error(my_window) ? 0 : a.layout[ix.num_tok_rows()];
    const int self_begin = rank == 0 ? 0 : a.layout[ix.tok_prefix() + rank - 1];
    const int self_end = a.layout[ix.tok_prefix() + rank];
    const int row_bytes = Row::kWeightOffset + (a.apply_weights ? 4 : 0);

    for (int j = global_warp; j < num_tok_rows; j += num_warps) {
        if (j >= self_begin && j < self_end) continue;
        int source = 0, index = j;
        if constexpr (comm::kPushes<Transport>) {
            while (source < R - 1 && j >= a.layout[ix.tok_prefix() + source]) ++source;
            index = j - (source == 0 ? 0 : a.layout[ix.tok_prefix() + source - 1]);
        }
        const int my_out = lane < K ? a.src_meta[static_cast<int64_t>(j) * (K + 2) + 2 + lane] : -1;
        const float my_w = (a.apply_weights && my_out >= 0) ? a.recv_weights[my_out] : 0.0f;
#pragma unroll 1
        for (int k = 0; k < K; ++k) {
            const int out = __shfl_sync(0xffffffffu, my_out, k);
            const float w = __shfl_sync(0xffffffffu, my_w, k);
            if (out < 0) continue;  // warp-uniform: not a local slot
            const int64_t offset = single_row_offset<K, Transport>(a, half, R, rank, index, k);
            uint8_t* dst;
            if constexpr (comm::kPushes<Transport>) dst = tr.row_target(source, offset);
            else dst = my_window + offset;
            const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(out) * kHidden);
            int4* d4 = reinterpret_cast<int4*>(dst);
#pragma unroll 4
            for (int i = lane; i < Row::kVecs; i += 32) st_cg(d4 + i, ld_nc(src + i));
            if (a.apply_weights && lane == 0) *reinterpret_cast<float*>(dst + Row::kWeightOffset) = w;
            if constexpr (comm::kPushes<Transport>) tr.end_row(source, offset, row_bytes, lane);
        }
    }
    if (comm::last_block(my_window)) tr.signal_all(a.tag);
}

// Receive phase on source s, token t (or piece `piece` of `pieces` of its row): lanes < K hold slot
// lane's owner rank (`owner`, -1 masked), the token's row at that owner (`row_at_owner`) and, where
// the owner is s itself, the slot's row in s's expert outputs (`pair`).
template <int kHidden, int K, int kUnroll, typename Transport>
__device__ __forceinline__ void combine_recv_single(const CombineArgs& a, const Transport& tr, int half, int t,
                                                    int piece, int pieces, int lane, int owner, int row_at_owner,
                                                    int pair) {
    using Row = CombineRow<kHidden, K, true>;
    constexpr int kChunks = (Row::kVecs + 32 * kUnroll - 1) / (32 * kUnroll);
    const int R = tr.num_ranks, rank = tr.rank, L = a.num_experts / R;
    const LayoutIndex ix{R, L, a.num_experts};
    // Lane k < K: where slot k's row is read (s's expert outputs: its row there; a peer: the offset
    // of the staged row), its dispatch weight, and whether it exists.
    int64_t where = -1;
    if (owner == rank) {
        where = pair;
    } else if (owner >= 0 && row_at_owner >= 0) {
        int index = row_at_owner;
        if constexpr (comm::kPushes<Transport>) index -= a.layout[ix.send_base() + owner];
        where = single_row_offset<K, Transport>(a, half, R, owner, index, lane);
    }
    float weight = 1.0f;
    if (a.apply_weights && where >= 0)
        weight = owner == rank ? a.recv_weights[where] : tr.template get<float>(owner, where + Row::kWeightOffset);
    const unsigned present = __ballot_sync(0xffffffffu, lane < K && where >= 0);
    const bool silent_slot = __popc(present) < K;

    auto sum_chunk = [&](const int base) {
        float acc[kUnroll][8];
        init_from_biases<kHidden, kUnroll, Row::kVecs>(a, t, base, lane, acc);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (((present >> k) & 1u) == 0) continue;  // warp-uniform
            const int d = __shfl_sync(0xffffffffu, owner, k);
            const int64_t at = __shfl_sync(0xffffffffu, where, k);
            const float w = __shfl_sync(0xffffffffu, weight, k);
            int4 v[kUnroll];
            if (d == rank)
                load_chunk<kUnroll, Row::kVecs, false>(reinterpret_cast<const int4*>(a.y + at * kHidden), base, lane, v);
            else
                tr.template get_chunk<kUnroll, Row::kVecs>(d, at, base, lane, v);
            if (a.apply_weights) add_weighted_bf16_chunk(v, w, acc);
            else add_bf16_chunk(v, acc);
        }
        finish_and_store<kHidden, kUnroll, Row::kVecs>(a, t, base, lane, silent_slot, acc);
    };
    if (pieces == 1) {
        for (int base = 0; base < Row::kVecs; base += 32 * kUnroll) sum_chunk(base);
    } else {
        const int c0 = piece * kChunks / pieces, c1 = (piece + 1) * kChunks / pieces;
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
            if (c >= c0 && c < c1) sum_chunk(c * 32 * kUnroll);
    }
}

}  // namespace deep_ep
