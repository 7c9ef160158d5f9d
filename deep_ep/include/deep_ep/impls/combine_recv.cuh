// Combine, receive phase on source s: one warp per token (or piece of its row) pulls the rows every
// peer staged for it and its own, sums them with the biases (combine_reduce.cuh) and writes bf16.
// With kSingleReduction (expanded layout, single reduction) the token's K slot rows instead
// (combine_single.cuh).
#pragma once

#include "../comm/lsa.cuh"
#include "../comm/push.cuh"
#include "../common/grid.cuh"
#include "combine_reduce.cuh"
#include "combine_single.cuh"

namespace deep_ep {

// Token t's routing as one warp holds it: lane d < min(R, 32) its row at rank d, lanes < K its
// expert id and (expanded) its pair's row at its owner; -1 where absent or t is past the end.
template <int K, bool kExpand>
__device__ __forceinline__ void fetch_token_routing(const CombineArgs& a, int num_ranks, int t, int lane, int& row,
                                                    int64_t& expert, int& pair) {
    const bool live = t < a.num_tokens;
    row = (live && lane < num_ranks) ? a.pos_tok[static_cast<int64_t>(t) * num_ranks + lane] : -1;
    expert = (live && lane < K) ? a.topk_idx[static_cast<int64_t>(t) * K + lane] : -1;
    pair = (kExpand && live && lane < K) ? a.pos_pair[static_cast<int64_t>(t) * K + lane] : -1;
}

template <int kHidden, int K, bool kExpand, bool kSingleReduction, typename Transport>
__device__ __forceinline__ void combine_recv_impl(const CombineArgs& a, const Transport& tr) {
    static_assert(kExpand || !kSingleReduction, "single reduction is a combine of the expanded layout");
    using Row = CombineRow<kHidden, K, kExpand>;
    uint8_t* my_window = tr.local();
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = tr.num_ranks, L = a.num_experts / tr.num_ranks, rank = tr.rank;
    const LayoutIndex ix{R, L, a.num_experts};

    // Up to 7 vectors per lane per chunk for plain rows of whole 512-byte steps in equal chunks; else 4
    // to fit the registers (expanded rows hold a second set of accumulators, ragged ones bounds checks).
    constexpr int kWide = row_unroll<Row::kVecs, 0, 7>();
    constexpr bool kWideFits = !kExpand && Row::kVecs % 32 == 0 && (Row::kVecs / 32) % kWide == 0;
    constexpr int kUnroll = row_unroll<Row::kVecs, EP_COMBINE_UNROLL, kWideFits ? 7 : 4>();
    constexpr int kChunks = (Row::kVecs + 32 * kUnroll - 1) / (32 * kUnroll);
    // Fewer tokens than warps (decode): a token's chunks are split over up to kChunks warps so that its
    // loads are in flight at once; item i is piece i % pieces of token i / pieces, summed as by one warp.
    const int pieces = min(kChunks, max(1, num_warps / max(1, a.num_tokens)));
    const int num_items = a.num_tokens * pieces;

    // The next token's routing, which the row addresses depend on, is loaded while the current one is
    // summed; the first token's during the wait (this kernel does not write the routing).
    int next_row = -1, next_pair = -1;
    int64_t next_expert = -1;
    fetch_token_routing<K, kExpand>(a, R, global_warp / pieces, lane, next_row, next_expert, next_pair);
    // A rank alone sums its own rows only, with no wait: only an earlier error voids the call.
    const bool ok = tr.exchanges() ? tr.wait_all(kPhaseCombine, a.timeout_ns) && comm::check_tags(my_window, rank, R, a.tag)
                                   : __syncthreads_and(!comm::has_error(my_window)) != 0;  // block-uniform, as wait_all's
    const int half = comm::current_half(my_window);
    const int first = ok ? global_warp : num_items;
    for (int item = first; item < num_items; item += num_warps) {
        const int t = item / pieces, piece = item - t * pieces;
        const int my_row = next_row;
        int my_expert = static_cast<int>(max(static_cast<int64_t>(-1), min(next_expert, static_cast<int64_t>(a.num_experts))));
        if (my_expert >= a.num_experts) my_expert = -1;  // int32: 64-bit division would be a call
        const int pair = next_pair;
        fetch_token_routing<K, kExpand>(a, R, (item + num_warps) / pieces, lane, next_row, next_expert, next_pair);
        // Lanes < K: slot lane's owner rank (-1: masked) and whether it is that rank's last slot.
        const int owner = (lane < K && my_expert >= 0) ? my_expert / L : -1;
        if constexpr (kSingleReduction) {
            const int at_owner = __shfl_sync(0xffffffffu, my_row, owner >= 0 && owner < 32 ? owner : 0);
            const int row_at_owner = owner < 0 ? -1 : owner < 32 ? at_owner : a.pos_tok[static_cast<int64_t>(t) * R + owner];
            combine_recv_single<kHidden, K, kUnroll, Transport>(a, tr, half, t, piece, pieces, lane, owner,
                                                                row_at_owner, pair);
            continue;   // no reduced weights: they need multiple reduction (the host refuses them)
        }
        const unsigned same_owner = __match_any_sync(0xffffffffu, lane < K ? owner : -2 - lane);
        const bool last = owner >= 0 && 31 - __clz(same_owner) == lane;
        const bool silent_slot = __popc(__ballot_sync(0xffffffffu, last)) < K;
        int my_pair = -1;
        float my_pair_w = 1.0f;
        if (kExpand && owner == rank) {
            my_pair = pair;
            if (a.apply_weights && my_pair >= 0) my_pair_w = a.recv_weights[my_pair];
        }
        // The token's sources in slot order (the order of the sum), once for all chunks: slots that are
        // the last of their owner rank and whose row there exists. Lane j < num_sources holds the j-th.
        const int row_at_owner = __shfl_sync(0xffffffffu, my_row, owner >= 0 && owner < 32 ? owner : 0);
        const int slot_row = !last ? -1 : owner < 32 ? row_at_owner : a.pos_tok[static_cast<int64_t>(t) * R + owner];
        const unsigned sources = __ballot_sync(0xffffffffu, slot_row >= 0);
        const int num_sources = __popc(sources);
        int source_slot = 0;
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (((sources >> k) & 1u) != 0 && __popc(sources & ((1u << k) - 1u)) == lane) source_slot = k;
        const int source_rank = __shfl_sync(0xffffffffu, owner, source_slot);
        const int source_row = __shfl_sync(0xffffffffu, slot_row, source_slot);
        // Where rank d's row for this token (`row` in d's numbering) is read: d's window, or this
        // rank's own where the transport pushes.
        auto staged = [&](const int d, const int row) -> int64_t {
            if constexpr (comm::kPushes<Transport>)
                return pushed_row_offset(a, half, R, d, row - a.layout[ix.send_base() + d]);
            else
                return comm::row_offset(a, half, row);
        };
        // acc += chunk `base` of the partial of rank d, whose row for this token is `row` (>= 0).
        auto add_source = [&](const int d, const int row, const int base, float (&acc)[kUnroll][8]) {
            if (d == rank && !kExpand) {
                const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(row) * kHidden);
                int4 v[kUnroll];
                load_chunk<kUnroll, Row::kVecs, false>(src, base, lane, v);
                add_bf16_chunk(v, acc);
            } else if (d == rank) {
                // This rank's partial: its slots' rows summed in slot order from +0.0, rounded to bf16.
                float part[kUnroll][8];
                zero_chunk(part);
#pragma unroll
                for (int kk = 0; kk < K; ++kk) {
                    const int out = __shfl_sync(0xffffffffu, my_pair, kk);
                    const float w = __shfl_sync(0xffffffffu, my_pair_w, kk);
                    if (out < 0) continue;
                    const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(out) * kHidden);
                    int4 v[kUnroll];
                    load_chunk<kUnroll, Row::kVecs, false>(src, base, lane, v);
                    if (a.apply_weights) add_weighted_bf16_chunk(v, w, part);
                    else add_bf16_chunk(v, part);
                }
                add_rounded_chunk(part, acc);
            } else {
                int4 v[kUnroll];
                tr.template get_chunk<kUnroll, Row::kVecs>(d, staged(d, row), base, lane, v);
                add_bf16_chunk(v, acc);
            }
        };
        auto sum_chunk = [&](const int base) {
            float acc[kUnroll][8];
            init_from_biases<kHidden, kUnroll, Row::kVecs>(a, t, base, lane, acc);
#pragma unroll
            for (int j = 0; j < K; ++j) {
                if (j >= num_sources) break;
                add_source(__shfl_sync(0xffffffffu, source_rank, j), __shfl_sync(0xffffffffu, source_row, j), base, acc);
            }
            finish_and_store<kHidden, kUnroll, Row::kVecs>(a, t, base, lane, silent_slot, acc);
        };
#if EP_COMBINE_SINGLE_UNROLL > 0
        // One source row and no biases: wider chunks (store_single_source_chunk). Not expanded: those
        // kernels have no registers to spare.
        const bool single = !kExpand && pieces == 1 && num_sources == 1 && a.bias1 == nullptr &&
                            a.bias0 == nullptr;
        if (single) {
            const int single_rank = __shfl_sync(0xffffffffu, source_rank, 0);
            const int single_row = __shfl_sync(0xffffffffu, source_row, 0);
            constexpr int kSingle = row_unroll<Row::kVecs, 0, EP_COMBINE_SINGLE_UNROLL>();
            const int4* local = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(single_row) * kHidden);
#pragma unroll
            for (int base = 0; base < Row::kVecs; base += 32 * kSingle) {
                int4 v[kSingle];
                if (single_rank == rank) load_chunk<kSingle, Row::kVecs, false>(local, base, lane, v);
                else tr.template get_chunk<kSingle, Row::kVecs>(single_rank, staged(single_rank, single_row), base, lane, v);
                store_single_source_chunk<kHidden, kSingle, Row::kVecs>(a, t, base, lane, silent_slot, v);
            }
        } else
#endif
        if (pieces == 1) {
            for (int base = 0; base < Row::kVecs; base += 32 * kUnroll) sum_chunk(base);
        } else {
            // This piece's chunks, over compile-time chunk indices (each chunk's bounds known).
            const int c0 = piece * kChunks / pieces, c1 = (piece + 1) * kChunks / pieces;
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
                if (c >= c0 && c < c1) sum_chunk(c * 32 * kUnroll);
        }
        if (a.out_weights != nullptr && piece == 0) {
            // Slot k's weight is its owner's (0 where masked).
            float w = 0.0f;
            const int d = owner;
            const int row_at_d = __shfl_sync(0xffffffffu, my_row, d >= 0 && d < 32 ? d : 0);
            if (d >= 0) {
                const int row = d < 32 ? row_at_d : a.pos_tok[static_cast<int64_t>(t) * R + d];
                if (row >= 0) {
                    if (d == rank) w = kExpand ? (my_pair >= 0 ? a.weights_in[my_pair] : 0.0f)
                                               : a.weights_in[static_cast<int64_t>(row) * K + lane];
                    else w = tr.template get<float>(d, staged(d, row) + Row::kWeightOffset + 4 * lane);
                }
            }
            if (lane < K) a.out_weights[static_cast<int64_t>(t) * K + lane] = w;
        }
    }
    if (tr.exchanges()) comm::finish_wait(my_window, true, a.err_host);
}

}  // namespace deep_ep
