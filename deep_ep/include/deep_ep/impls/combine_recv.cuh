// Combine, receive phase (num_sms blocks) on source s: one warp per token pulls the rows staged
// for it by every peer (over the transport) and its own rows, sums them (combine_reduce.cuh), adds
// the biases and writes bf16; with weights, it also reduces the top-k weights.
#pragma once

#include "../comm/lsa.cuh"
#include "../common/grid.cuh"
#include "combine_reduce.cuh"

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

template <int kHidden, int K, bool kExpand>
__device__ __forceinline__ void combine_recv_impl(const CombineArgs& a, const comm::LsaTransport& tr) {
    using Row = CombineRow<kHidden, K, kExpand>;
    uint8_t* my_window = tr.local();
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = tr.num_ranks, L = a.num_experts / tr.num_ranks, rank = tr.rank;

    // The routing of a warp's next token is loaded while it sums the current one (the row
    // addresses depend on it: without the prefetch every token starts with a dependent load);
    // the first token's during the wait (the handle's routing is not written by this kernel).
    int next_row = -1, next_pair = -1;
    int64_t next_expert = -1;
    fetch_token_routing<K, kExpand>(a, R, global_warp, lane, next_row, next_expert, next_pair);
    const bool ok = tr.wait_all(kPhaseCombine, a.timeout_ns);
    const int half = comm::current_half(my_window);
    const int first = ok ? global_warp : a.num_tokens;
    for (int t = first; t < a.num_tokens; t += num_warps) {
        int my_row = next_row;
        int my_expert = static_cast<int>(max(static_cast<int64_t>(-1), min(next_expert, static_cast<int64_t>(a.num_experts))));
        if (my_expert >= a.num_experts) my_expert = -1;  // int32: 64-bit division would be a call
        const int pair = next_pair;
        fetch_token_routing<K, kExpand>(a, R, t + num_warps, lane, next_row, next_expert, next_pair);
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
                        add_weighted_bf16_chunk(v, w, acc);
                    }
                } else if (!kExpand) {
                    int4 v[kUnroll];
                    tr.get_chunk<kUnroll, Row::kVecs>(d, comm::row_offset(a, half, row), base, lane, v);
                    add_bf16_chunk(v, acc);
                } else {
                    const int64_t src = comm::row_offset(a, half, row);
                    float4 lo[kUnroll], hi[kUnroll];
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int i = base + u * 32 + lane;
                        if (i < Row::kVecs) {
                            lo[u] = tr.get<float4>(d, src + 32 * static_cast<int64_t>(i));
                            hi[u] = tr.get<float4>(d, src + 32 * static_cast<int64_t>(i) + 16);
                        }
                    }
                    add_f32_chunk(lo, hi, acc);
                }
            }
            add_biases_and_store<kHidden, kUnroll, Row::kVecs>(a, t, base, lane, acc);
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
                    else w += tr.get<float>(d, comm::row_offset(a, half, row) + Row::kWeightOffset + 4 * lane);
                } else if (d == rank) {
                    w += a.weights_in[static_cast<int64_t>(row) * K + lane];
                } else {
                    w += tr.get<float>(d, comm::row_offset(a, half, row) + Row::kWeightOffset + 4 * lane);
                }
            }
            if (lane < K) a.out_weights[static_cast<int64_t>(t) * K + lane] = w;
        }
    }
    comm::finish_wait(my_window, true, a.err_host);
}

}  // namespace deep_ep
