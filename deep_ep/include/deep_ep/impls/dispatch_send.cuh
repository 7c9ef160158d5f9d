// Dispatch, send phase on source rank s: one warp per token reads its row once, chunk by chunk, and
// stores it to every destination: a peer's receive half (with the trailer of dispatch_args.cuh), or
// this rank's output tensors directly (expanded: once per local expert). The last block signals.
#pragma once

#include "../comm/lsa.cuh"
#include "../comm/push.cuh"
#include "../common/grid.cuh"
#include "dispatch_args.cuh"

namespace deep_ep {

// What a warp loads to start a token, lane-wise: the row's first chunk, scale factors lane, lane + 32,
// ..., expert id (lanes < K), row at rank ``lane`` (ranks >= 32 are read where used), pair's row.
template <int kUnroll, int kSFPerLane>
struct TokenLoads {
    int4 v[kUnroll];
    int sf[kSFPerLane > 0 ? kSFPerLane : 1];
    int64_t expert;
    int row, pair;
};

template <int kVecs, int kNumSF, int K, bool kExpand, int kUnroll, int kSFPerLane>
__device__ __forceinline__ void fetch_token(const DispatchArgs& a, int num_ranks, int t, int end, int lane,
                                            TokenLoads<kUnroll, kSFPerLane>& o) {
    if (t >= end) return;
    load_chunk<kUnroll, kVecs, false>(reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * (kVecs * 16)), 0, lane, o.v);
#pragma unroll
    for (int j = 0; j < kSFPerLane; ++j) {
        const int i = lane + 32 * j;
        o.sf[j] = i < kNumSF ? a.sf[static_cast<int64_t>(t) * kNumSF + i] : 0;
    }
    o.expert = lane < K ? a.topk_idx[static_cast<int64_t>(t) * K + lane] : -1;
    o.row = lane < num_ranks ? a.pos_tok[static_cast<int64_t>(t) * num_ranks + lane] : -1;
    o.pair = (kExpand && lane < K) ? a.pos_pair[static_cast<int64_t>(t) * K + lane] : -1;
}

// Warps stride over the tokens (WarpGrid). A fresh dispatch adds where this rank's rows start at
// each destination (send_base) to the notify kernel's numbering and writes the sums back.
template <int kDataBytes, int kNumSF, int K, bool kExpand, bool kCached, typename Transport>
__device__ __forceinline__ void dispatch_send_impl(const DispatchArgs& a, const Transport& tr) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    constexpr int kUnroll = row_unroll<Row::kVecs, EP_SEND_UNROLL, 8>();
    const WarpGrid wg;
    const int lane = wg.lane, num_warps = wg.num_warps, num_tokens = a.num_tokens;
    const int R = tr.num_ranks, L = a.num_experts / tr.num_ranks, rank = tr.rank;
    const LayoutIndex ix{R, L, a.num_experts};
    constexpr int kSFPerLane = (kNumSF + 31) / 32;
    // TokenLoads of the next token are requested while the current token's last chunk is stored, so a
    // warp never waits on a routing or first-chunk load between tokens.
    TokenLoads<kUnroll, kSFPerLane> cur, next;
    fetch_token<Row::kVecs, kNumSF, K, kExpand>(a, R, wg.warp, num_tokens, lane, cur);
    uint8_t* my_window = tr.local();
    const int half = comm::current_half(my_window);
    // After a timeout the layout is void: move nothing, but still signal so epochs stay in step.
    const int end = comm::has_error(my_window) ? 0 : num_tokens;

    for (int t = wg.warp; t < end; t += num_warps) {
        const int4* src = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * kDataBytes);
        int4 (&v)[kUnroll] = cur.v;
        const int (&my_sf)[kSFPerLane > 0 ? kSFPerLane : 1] = cur.sf;

        // Destination rows of this token (lanes < R hold rank lane's row; lanes < K the pair's row).
        int my_row = -1, my_pair_row = -1;
        int my_expert = -1;  // int32: 64-bit division would be a call
        if (lane < K) my_expert = static_cast<int>(max(static_cast<int64_t>(-1), min(cur.expert, static_cast<int64_t>(a.num_experts))));
        if (my_expert >= a.num_experts) my_expert = -1;  // out-of-range ids are treated as masked
        for (int d = lane; d < R; d += 32) {
            int v = d == lane ? cur.row : a.pos_tok[static_cast<int64_t>(t) * R + d];
            if (!kCached && v >= 0) {
                v += a.layout[ix.send_base() + d];
                a.pos_tok[static_cast<int64_t>(t) * R + d] = v;
            }
            if (d == lane) my_row = v;
        }
        if (kExpand && lane < K) {
            int v = cur.pair;
            if (!kCached && v >= 0 && my_expert >= 0) {
                v += a.layout[ix.out_base() + static_cast<int>(my_expert)];
                a.pos_pair[static_cast<int64_t>(t) * K + lane] = v;
            }
            my_pair_row = my_expert >= 0 ? v : -1;
        }
        __syncwarp();  // rows of ranks >= 32 are re-read from pos_tok below

        for (int base = 0; base < Row::kVecs; base += 32 * kUnroll) {
            if (base > 0) load_chunk<kUnroll, Row::kVecs, false>(src, base, lane, v);
            if (base + 32 * kUnroll >= Row::kVecs)  // last chunk: the next token's loads go out before its stores
                fetch_token<Row::kVecs, kNumSF, K, kExpand>(a, R, t + num_warps, num_tokens, lane, next);
            for (int d = 0; d < R; ++d) {
                const int row = d < 32 ? __shfl_sync(0xffffffffu, my_row, d)
                                       : a.pos_tok[static_cast<int64_t>(t) * R + d];
                if (row < 0) continue;
                if (d != rank) {
                    tr.template put_chunk<kUnroll, Row::kVecs>(d, comm::row_offset(a, half, row), base, lane, v);
                } else if (!kExpand) {
                    int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(row) * kDataBytes);
                    store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                } else {
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        const int e = __shfl_sync(0xffffffffu, my_expert, k);
                        const int out = __shfl_sync(0xffffffffu, my_pair_row, k);
                        if (e < 0 || e / L != rank || out < 0) continue;
                        int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(out) * kDataBytes);
                        store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                    }
                }
            }
        }

        const bool with_weights = a.topk_weights != nullptr;
        const float my_weight = (with_weights && lane < K) ? a.topk_weights[static_cast<int64_t>(t) * K + lane] : 0.0f;
        for (int d = 0; d < R; ++d) {
            const int row = d < 32 ? __shfl_sync(0xffffffffu, my_row, d) : a.pos_tok[static_cast<int64_t>(t) * R + d];
            if (row < 0) continue;
            const bool local = lane < K && my_expert >= 0 && my_expert / L == d;
            if (d != rank) {
                const int64_t dst = comm::row_offset(a, half, row);
#pragma unroll
                for (int j = 0; j < kSFPerLane; ++j)
                    if (lane + 32 * j < kNumSF) tr.template put<int>(d, dst + kDataBytes + 4 * (lane + 32 * j), my_sf[j]);
                const int64_t meta = dst + Row::kMetaOffset;  // int src_token, out_row[K], local_idx[K]; float weight[K]
                if (!kCached) {
                    if (lane == 0) tr.template put<int>(d, meta, t);
                    if (lane < K) {
                        tr.template put<int>(d, meta + 4 * (1 + lane), (kExpand && local) ? my_pair_row : -1);
                        tr.template put<int>(d, meta + 4 * (1 + K + lane), local ? static_cast<int>(my_expert - d * L) : -1);
                    }
                }
                if ((!kCached || with_weights) && lane < K)
                    tr.template put<float>(d, meta + 4 * (1 + 2 * K + lane), local ? my_weight : 0.0f);
                if constexpr (comm::kPushes<Transport>) tr.end_row(d, dst, Row::kMetaOffset + Row::kMetaBytes, lane);
            } else if (!kExpand) {
#pragma unroll
                for (int j = 0; j < kSFPerLane; ++j)
                    if (lane + 32 * j < kNumSF) store_sf<kDataBytes, kNumSF>(a, row, lane + 32 * j, my_sf[j]);
                if (!kCached && lane < K)
                    a.out_topk_idx[static_cast<int64_t>(row) * K + lane] = local ? my_expert - rank * L : -1;
                if (a.out_weights != nullptr && lane < K)
                    a.out_weights[static_cast<int64_t>(row) * K + lane] = local ? my_weight : 0.0f;
                if (!kCached) write_src_meta<K>(a, row, rank, t, __ballot_sync(0xffffffffu, local), -1, lane);
            } else {
                for (int k = 0; k < K; ++k) {
                    const int e = __shfl_sync(0xffffffffu, my_expert, k);
                    const int out = __shfl_sync(0xffffffffu, my_pair_row, k);
                    if (e < 0 || e / L != rank || out < 0) continue;
#pragma unroll
                    for (int j = 0; j < kSFPerLane; ++j)
                        if (lane + 32 * j < kNumSF) store_sf<kDataBytes, kNumSF>(a, out, lane + 32 * j, my_sf[j]);
                }
                if (a.out_weights != nullptr && local) a.out_weights[my_pair_row] = my_weight;
                if (!kCached) write_src_meta<K>(a, row, rank, t, __ballot_sync(0xffffffffu, local), local ? my_pair_row : -1, lane);
            }
        }
        cur = next;  // after a warp's last token, values never loaded: the loop ends before any use
    }
    if (tr.exchanges() && comm::last_block(my_window)) tr.signal_all(a.tag);
}

}  // namespace deep_ep
