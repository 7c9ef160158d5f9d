// Combine: the reverse of dispatch, pulling expert outputs back to the token's source rank.
//
// combine_send (num_sms blocks) on destination d: rows that came from peers are staged in d's own
// window at the row index they arrived at (non-expanded: the bf16 row; expanded: the fp32 sum of the
// token's rows for d's experts, weighted by the dispatch weights), with the top-k weights to reduce
// in a trailer. Rows from d itself stay in the caller's tensor. The last block signals every peer.
// combine_recv (num_sms blocks) on source s: one warp per token sums, in fp32, the staged rows of
// every peer (read over NVLink / LSA) and its own rows, adds the biases and writes bf16.
//
// Window row: [values: kHidden bf16 (non-expanded) or kHidden fp32 (expanded)][float weight[K] at kWeightOffset]
#pragma once

#include "common.cuh"
#include "layout.cuh"

namespace deep_ep {

template <int kHidden, int K, bool kExpand>
struct CombineRow {
    static_assert(kHidden % 8 == 0, "hidden must be a multiple of 8");
    static constexpr int kVecs = kHidden / 8;                      // 8 elements per 16-byte bf16 vector
    static constexpr int kValueBytes = kExpand ? kHidden * 4 : kHidden * 2;
    static constexpr int kWeightOffset = (kValueBytes + 15) / 16 * 16;
};

struct CombineArgs {
    const __nv_bfloat16* y;           // [rows, H] expert outputs on this rank (as a destination)
    const float* weights_in;          // non-expanded [rows, K]; expanded [rows]; or null
    const float* recv_weights;        // expanded: [rows] dispatch weights of the handle
    const int* row_map;               // expanded: [tok rows, K]
    const int* layout;                // this rank's layout words (as a destination)
    // this rank as the source
    const int* pos_tok;               // [T, R] absolute token rows at each destination
    const int* pos_pair;              // [T, K] absolute output rows (expanded)
    const int64_t* topk_idx;          // [T, K]
    int num_tokens;
    const __nv_bfloat16* bias0;       // [T, H] or null
    const __nv_bfloat16* bias1;       // [T, H] or null
    __nv_bfloat16* out;               // [T, H]
    float* out_weights;               // [T, K] or null
    uint8_t* const* peers;
    int rank, num_ranks, num_experts;
    int64_t recv_offset, half_bytes;
    int row_stride;
    uint64_t timeout_ns;
    uint32_t* err_host;               // mapped host memory for the error record (finish_wait), or null
};

// acc[u][q] += the 8 bf16 values of v[u] (fp32, in this order: the reference's summation).
template <int kUnroll>
__device__ __forceinline__ void add_bf16_chunk(const int4 (&v)[kUnroll], float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        float f[8];
        bf16x8_to_f32(v[u], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] += f[q];
    }
}

template <int kHidden, int K, bool kExpand>
__device__ __forceinline__ void combine_send_impl(const CombineArgs& a) {
    using Row = CombineRow<kHidden, K, kExpand>;
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = a.num_ranks, L = a.num_experts / a.num_ranks, rank = a.rank;
    const LayoutIndex ix{R, L, a.num_experts};
    uint8_t* my_window = a.peers[rank];
    const int half = current_half(my_window);
    const int num_tok_rows = has_error(my_window) ? 0 : a.layout[ix.num_tok_rows()];
    const int self_begin = rank == 0 ? 0 : a.layout[ix.tok_prefix() + rank - 1];
    const int self_end = a.layout[ix.tok_prefix() + rank];

    for (int j = global_warp; j < num_tok_rows; j += num_warps) {
        if (j >= self_begin && j < self_end) continue;
        uint8_t* dst = window_row(my_window, a, half, j);
        float* dst_w = reinterpret_cast<float*>(dst + Row::kWeightOffset);
        if (!kExpand) {
            const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(j) * kHidden);
            int4* d4 = reinterpret_cast<int4*>(dst);
#pragma unroll 4
            for (int i = lane; i < Row::kVecs; i += 32) st_cg(d4 + i, ld_nc(src + i));
            if (lane < K) dst_w[lane] = a.weights_in != nullptr ? a.weights_in[static_cast<int64_t>(j) * K + lane] : 0.0f;
        } else {
            const int my_out = lane < K ? a.row_map[static_cast<int64_t>(j) * K + lane] : -1;
            const float my_w = my_out >= 0 ? a.recv_weights[my_out] : 0.0f;
            float4* d4 = reinterpret_cast<float4*>(dst);
            // All lanes iterate together (the shuffles need the whole warp); lanes past the row idle.
            for (int base = 0; base < Row::kVecs; base += 32) {
                const int i = base + lane;
                const bool active = i < Row::kVecs;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
                for (int k = 0; k < K; ++k) {
                    const int out = __shfl_sync(0xffffffffu, my_out, k);
                    const float w = __shfl_sync(0xffffffffu, my_w, k);
                    if (out < 0 || !active) continue;
                    float f[8];
                    bf16x8_to_f32(ld_nc(reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(out) * kHidden) + i), f);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[q] = fmaf(w, f[q], acc[q]);
                }
                if (!active) continue;
                __stcg(d4 + 2 * i, make_float4(acc[0], acc[1], acc[2], acc[3]));
                __stcg(d4 + 2 * i + 1, make_float4(acc[4], acc[5], acc[6], acc[7]));
            }
            if (lane < K) dst_w[lane] = (a.weights_in != nullptr && my_out >= 0) ? a.weights_in[my_out] : 0.0f;
        }
    }
    if (last_block(my_window)) signal_all_peers(a.peers, rank, R);
}

// Token t's routing as one warp holds it: lane d < min(R, 32) its row at rank d, lanes < K its
// expert id and (expanded) its pair's row at its owner; -1 where absent or t is past the end.
template <int K, bool kExpand>
__device__ __forceinline__ void fetch_token_routing(const CombineArgs& a, int t, int lane, int& row,
                                                    int64_t& expert, int& pair) {
    const bool live = t < a.num_tokens;
    row = (live && lane < a.num_ranks) ? a.pos_tok[static_cast<int64_t>(t) * a.num_ranks + lane] : -1;
    expert = (live && lane < K) ? a.topk_idx[static_cast<int64_t>(t) * K + lane] : -1;
    pair = (kExpand && live && lane < K) ? a.pos_pair[static_cast<int64_t>(t) * K + lane] : -1;
}

template <int kHidden, int K, bool kExpand>
__device__ __forceinline__ void combine_recv_impl(const CombineArgs& a) {
    using Row = CombineRow<kHidden, K, kExpand>;
    uint8_t* my_window = a.peers[a.rank];
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = a.num_ranks, L = a.num_experts / a.num_ranks, rank = a.rank;

    // The routing of a warp's next token is loaded while it sums the current one (the row
    // addresses depend on it: without the prefetch every token starts with a dependent load);
    // the first token's during the wait (the handle's routing is not written by this kernel).
    int next_row = -1, next_pair = -1;
    int64_t next_expert = -1;
    fetch_token_routing<K, kExpand>(a, global_warp, lane, next_row, next_expert, next_pair);
    const bool ok = wait_all_peers(my_window, a.rank, a.num_ranks, kPhaseCombine, a.timeout_ns);
    const int half = current_half(my_window);
    const int first = ok ? global_warp : a.num_tokens;
    for (int t = first; t < a.num_tokens; t += num_warps) {
        int my_row = next_row;
        int my_expert = static_cast<int>(max(static_cast<int64_t>(-1), min(next_expert, static_cast<int64_t>(a.num_experts))));
        if (my_expert >= a.num_experts) my_expert = -1;  // int32: 64-bit division would be a call
        const int pair = next_pair;
        fetch_token_routing<K, kExpand>(a, t + num_warps, lane, next_row, next_expert, next_pair);
        int my_pair = -1;
        float my_pair_w = 0.0f;
        if (kExpand && lane < K && my_expert >= 0 && my_expert / L == rank) {
            my_pair = pair;
            if (my_pair >= 0) my_pair_w = a.recv_weights[my_pair];
        }
        // kUnroll vectors per lane per step: several independent 16-byte loads in flight per source.
        constexpr int kUnroll = row_unroll<Row::kVecs, EP_COMBINE_UNROLL, 4>();
        for (int base = 0; base < Row::kVecs; base += 32 * kUnroll) {
            float acc[kUnroll][8];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int q = 0; q < 8; ++q) acc[u][q] = 0.0f;
            for (int d = 0; d < R; ++d) {
                const int row = d < 32 ? __shfl_sync(0xffffffffu, my_row, d) : a.pos_tok[static_cast<int64_t>(t) * R + d];
                if (row < 0) continue;
                if (d == rank && !kExpand) {
                    const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(row) * kHidden);
                    int4 v[kUnroll];
                    load_chunk<kUnroll, Row::kVecs, false>(src, base, lane, v);
                    add_bf16_chunk(v, acc);
                } else if (d == rank) {
                    // This rank's own pairs, weighted, straight into the sum (expanded results match
                    // the reference within rounding: the order differs from its k = 0..K-1 sum).
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        const int out = __shfl_sync(0xffffffffu, my_pair, k);
                        const float w = __shfl_sync(0xffffffffu, my_pair_w, k);
                        if (out < 0) continue;
                        const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(out) * kHidden);
                        int4 v[kUnroll];
                        load_chunk<kUnroll, Row::kVecs, false>(src, base, lane, v);
#pragma unroll
                        for (int u = 0; u < kUnroll; ++u) {
                            float f[8];
                            bf16x8_to_f32(v[u], f);
#pragma unroll
                            for (int q = 0; q < 8; ++q) acc[u][q] = fmaf(w, f[q], acc[u][q]);
                        }
                    }
                } else if (!kExpand) {
                    const int4* src = reinterpret_cast<const int4*>(window_row(a.peers[d], a, half, row));
                    int4 v[kUnroll];
                    load_chunk<kUnroll, Row::kVecs, true>(src, base, lane, v);
                    add_bf16_chunk(v, acc);
                } else {
                    const float4* src = reinterpret_cast<const float4*>(window_row(a.peers[d], a, half, row));
                    float4 lo[kUnroll], hi[kUnroll];
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int i = base + u * 32 + lane;
                        if (i < Row::kVecs) { lo[u] = __ldcg(src + 2 * i); hi[u] = __ldcg(src + 2 * i + 1); }
                    }
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        acc[u][0] += lo[u].x; acc[u][1] += lo[u].y; acc[u][2] += lo[u].z; acc[u][3] += lo[u].w;
                        acc[u][4] += hi[u].x; acc[u][5] += hi[u].y; acc[u][6] += hi[u].z; acc[u][7] += hi[u].w;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i >= Row::kVecs) continue;
                float f[8];
                if (a.bias0 != nullptr && EP_TEST_DEFECT != kDefectMissingBias) {
                    bf16x8_to_f32(ld_nc(reinterpret_cast<const int4*>(a.bias0 + static_cast<int64_t>(t) * kHidden) + i), f);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[u][q] += f[q];
                }
                if (a.bias1 != nullptr) {
                    bf16x8_to_f32(ld_nc(reinterpret_cast<const int4*>(a.bias1 + static_cast<int64_t>(t) * kHidden) + i), f);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[u][q] += f[q];
                }
                store_row_vec(reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * kHidden) + i, f32_to_bf16x8(acc[u]));
            }
        }
        if (a.out_weights != nullptr) {
            float w = 0.0f;
            for (int d = 0; d < R; ++d) {
                const int row = d < 32 ? __shfl_sync(0xffffffffu, my_row, d) : a.pos_tok[static_cast<int64_t>(t) * R + d];
                if (row < 0 || lane >= K) continue;
                if (kExpand) {
                    const bool mine = my_expert >= 0 && my_expert / L == d;
                    if (!mine) continue;
                    if (d == rank) w += my_pair >= 0 ? a.weights_in[my_pair] : 0.0f;
                    else w += __ldcg(reinterpret_cast<const float*>(window_row(a.peers[d], a, half, row) + Row::kWeightOffset) + lane);
                } else if (d == rank) {
                    w += a.weights_in[static_cast<int64_t>(row) * K + lane];
                } else {
                    w += __ldcg(reinterpret_cast<const float*>(window_row(a.peers[d], a, half, row) + Row::kWeightOffset) + lane);
                }
            }
            if (lane < K) a.out_weights[static_cast<int64_t>(t) * K + lane] = w;
        }
    }
    finish_wait(my_window, true, a.err_host);
}

}  // namespace deep_ep
