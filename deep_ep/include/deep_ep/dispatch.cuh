// Dispatch data stage.
//
// dispatch_send (num_sms blocks) on source rank s: one warp per token. The token's data row is read
// once into registers, chunk by chunk, and stored to every destination: rows for a peer go into
// the receive half of that peer's window (with a small metadata trailer); rows for this rank go
// straight into the output tensors (expanded: once per local expert). The last block signals.
// dispatch_recv (num_sms blocks) on destination d: waits for every peer, then copies the window
// rows that came from peers into the output tensors (expanded: scattering each row to its experts'
// rows), fills padding rows and marks rows past the true count.
//
// Window row (row_stride bytes): [data: kDataBytes][scale factors: kNumSF * 4]
//   [meta at kMetaOffset: int src_token, int out_row[K], int local_idx[K], float weight[K]]
#pragma once

#include "common.cuh"
#include "layout.cuh"

namespace deep_ep {

template <int kDataBytes, int kNumSF, int K>
struct DispatchRow {
    static_assert(kDataBytes % 16 == 0, "row bytes must be a multiple of 16");
    static constexpr int kVecs = kDataBytes / 16;
    static constexpr int kMetaOffset = ((kDataBytes + kNumSF * 4) + 15) / 16 * 16;
    static constexpr int kMetaBytes = 4 + 12 * K;
};

struct DispatchArgs {
    // inputs (this rank as a source)
    const uint8_t* x;              // [T, kDataBytes]
    const int* sf;                 // [T, kNumSF] or null
    const int64_t* topk_idx;       // [T, K]
    const float* topk_weights;     // [T, K] or null
    int num_tokens;
    // handle (this rank as a source): local numbering in, absolute rows out (non-cached)
    int* pos_tok;                  // [T, R]
    int* pos_pair;                 // [T, K] (expanded)
    // outputs (this rank as a destination)
    uint8_t* out_x;                // [rows, kDataBytes]
    int* out_sf;                   // row-major [rows, kNumSF] or column-major [kNumSF, sf_ld]
    int sf_ld;                     // 0: row-major; else leading dimension of the column-major layout
    int64_t* out_topk_idx;         // non-expanded [rows, K]; expanded [rows]
    float* out_weights;            // non-expanded [rows, K]; expanded [rows]; may be null (non-expanded)
    int* out_src_rank;             // [rows]
    int* out_src_token;            // [rows]
    int* row_map;                  // expanded: [tok_rows capacity, K] output rows of each token row
    int out_capacity;              // rows allocated in the outputs
    const int* layout;             // LayoutIndex words
    // transport
    uint8_t* const* peers;
    int rank, num_ranks, num_experts, alignment;
    int64_t recv_offset, half_bytes;   // receive region: two halves of half_bytes
    int row_stride;
    uint64_t timeout_ns;
    uint32_t* err_host;            // mapped host memory for the error record (finish_wait), or null
};

template <int kDataBytes, int kNumSF>
__device__ __forceinline__ void store_sf(const DispatchArgs& a, int row, int i, int v) {
    if (a.sf_ld == 0) a.out_sf[static_cast<int64_t>(row) * kNumSF + i] = v;
    else a.out_sf[static_cast<int64_t>(i) * a.sf_ld + row] = v;
}

// Test-only defects (EP_TEST_DEFECT, common.cuh); each folds away in a normal build.
__device__ __forceinline__ bool defect_drops_row(int row) { return EP_TEST_DEFECT == kDefectDroppedRow && (row & 63) == 63; }
__device__ __forceinline__ int defect_row(int row) {
    return (EP_TEST_DEFECT == kDefectWrongRow && row % 61 == 7) ? (row ^ 1) : row;  // odd rows: row - 1 stays in bounds
}
__device__ __forceinline__ float defect_weight(float w, int lane) {
    return (EP_TEST_DEFECT == kDefectScaledWeight && lane == 0) ? 2.0f * w : w;
}
template <bool kCached>
__device__ __forceinline__ bool defect_stale_sf(int row) { return kCached && EP_TEST_DEFECT == kDefectStaleScale && (row & 7) == 3; }
__device__ __forceinline__ bool defect_skips_expert(int local_expert) {
    return EP_TEST_DEFECT == kDefectSkippedExpert && local_expert == 1;
}

// What a warp loads to start moving a token (lane-wise): the row's first chunk (kUnroll vectors),
// scale factors lane, lane + 32, ... (FP8), the top-k expert id (lanes < K), the row at rank
// ``lane`` (lanes < num_ranks; ranks >= 32 are read where used) and the pair's row (expanded).
template <int kUnroll, int kSFPerLane>
struct TokenLoads {
    int4 v[kUnroll];
    int sf[kSFPerLane > 0 ? kSFPerLane : 1];
    int64_t expert;
    int row, pair;
};

// Issue token t's loads (none past the last token; the values are then unused).
template <int kVecs, int kNumSF, int K, bool kExpand, int kUnroll, int kSFPerLane>
__device__ __forceinline__ void fetch_token(const DispatchArgs& a, int t, int lane, TokenLoads<kUnroll, kSFPerLane>& o) {
    if (t >= a.num_tokens) return;
    load_chunk<kUnroll, kVecs, false>(reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * (kVecs * 16)), 0, lane, o.v);
#pragma unroll
    for (int j = 0; j < kSFPerLane; ++j) {
        const int i = lane + 32 * j;
        o.sf[j] = i < kNumSF ? a.sf[static_cast<int64_t>(t) * kNumSF + i] : 0;
    }
    o.expert = lane < K ? a.topk_idx[static_cast<int64_t>(t) * K + lane] : -1;
    o.row = lane < a.num_ranks ? a.pos_tok[static_cast<int64_t>(t) * a.num_ranks + lane] : -1;
    o.pair = (kExpand && lane < K) ? a.pos_pair[static_cast<int64_t>(t) * K + lane] : -1;
}

template <int kDataBytes, int kNumSF, int K, bool kExpand, bool kCached>
__device__ __forceinline__ void dispatch_send_impl(const DispatchArgs& a) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    constexpr int kUnroll = row_unroll<Row::kVecs, EP_SEND_UNROLL, 8>();
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = a.num_ranks, L = a.num_experts / a.num_ranks, rank = a.rank;
    const LayoutIndex ix{R, L, a.num_experts};
    constexpr int kSFPerLane = (kNumSF + 31) / 32;
    // Everything a token's moves start from is loaded one token ahead (TokenLoads): the first
    // chunk of the row, its scale factors and its routing for the warp's next token are requested
    // while the current token's last chunk is stored, so a warp never waits for a routing or
    // first-chunk load between tokens. The warp's first token is requested before the control
    // words are read.
    TokenLoads<kUnroll, kSFPerLane> cur, next;
    fetch_token<Row::kVecs, kNumSF, K, kExpand>(a, global_warp, lane, cur);
    uint8_t* my_window = a.peers[rank];
    const int half = current_half(my_window);
    // After a timeout the layout is void: move nothing, but still signal so epochs stay in step.
    const int num_tokens = has_error(my_window) ? 0 : a.num_tokens;

    for (int t = global_warp; t < num_tokens; t += num_warps) {
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

        // ---- data: read once, store to every destination ----
        for (int base = 0; base < Row::kVecs; base += 32 * kUnroll) {
            if (base > 0) load_chunk<kUnroll, Row::kVecs, false>(src, base, lane, v);
            if (base + 32 * kUnroll >= Row::kVecs)  // last chunk: the next token's loads go out before its stores
                fetch_token<Row::kVecs, kNumSF, K, kExpand>(a, t + num_warps, lane, next);
            for (int d = 0; d < R; ++d) {
                const int row = d < 32 ? __shfl_sync(0xffffffffu, my_row, d)
                                       : a.pos_tok[static_cast<int64_t>(t) * R + d];
                if (row < 0) continue;
                if (d != rank) {
                    int4* dst = reinterpret_cast<int4*>(window_row(a.peers[d], a, half, row));
                    store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                } else if (!kExpand) {
                    if (defect_drops_row(row)) continue;
                    int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(defect_row(row)) * kDataBytes);
                    store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                } else {
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        const int e = __shfl_sync(0xffffffffu, my_expert, k);
                        const int out = __shfl_sync(0xffffffffu, my_pair_row, k);
                        if (e < 0 || e / L != rank || out < 0 || defect_skips_expert(e - rank * L)) continue;
                        int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(out) * kDataBytes);
                        store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                    }
                }
            }
        }

        // ---- scale factors and metadata ----
        for (int d = 0; d < R; ++d) {
            const int row = d < 32 ? __shfl_sync(0xffffffffu, my_row, d) : a.pos_tok[static_cast<int64_t>(t) * R + d];
            if (row < 0) continue;
            if (d != rank) {
                uint8_t* dst = window_row(a.peers[d], a, half, row);
                int* dst_sf = reinterpret_cast<int*>(dst + kDataBytes);
#pragma unroll
                for (int j = 0; j < kSFPerLane; ++j)
                    if (lane + 32 * j < kNumSF) dst_sf[lane + 32 * j] = my_sf[j];
                if (!kCached) {
                    int* meta = reinterpret_cast<int*>(dst + Row::kMetaOffset);
                    if (lane == 0) meta[0] = t;
                    if (lane < K) {
                        const bool local = my_expert >= 0 && my_expert / L == d;
                        meta[1 + lane] = (kExpand && local) ? my_pair_row : -1;
                        meta[1 + K + lane] = local ? static_cast<int>(my_expert - d * L) : -1;
                        reinterpret_cast<float*>(meta)[1 + 2 * K + lane] =
                            local ? (a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(t) * K + lane] : 1.0f) : 0.0f;
                    }
                }
            } else if (!kExpand) {
#pragma unroll
                for (int j = 0; j < kSFPerLane; ++j)
                    if (lane + 32 * j < kNumSF && !defect_stale_sf<kCached>(row)) store_sf<kDataBytes, kNumSF>(a, row, lane + 32 * j, my_sf[j]);
                if (!kCached) {
                    if (lane < K) {
                        const bool local = my_expert >= 0 && my_expert / L == rank;
                        a.out_topk_idx[static_cast<int64_t>(row) * K + lane] = local ? my_expert - rank * L : -1;
                        if (a.out_weights != nullptr)
                            a.out_weights[static_cast<int64_t>(row) * K + lane] =
                                local ? defect_weight(a.topk_weights[static_cast<int64_t>(t) * K + lane], lane) : 0.0f;
                    }
                    if (lane == 0) { a.out_src_rank[row] = rank; a.out_src_token[row] = t; }
                }
            } else {
                for (int k = 0; k < K; ++k) {
                    const int e = __shfl_sync(0xffffffffu, my_expert, k);
                    const int out = __shfl_sync(0xffffffffu, my_pair_row, k);
                    if (e < 0 || e / L != rank || out < 0) continue;
#pragma unroll
                    for (int j = 0; j < kSFPerLane; ++j)
                        if (lane + 32 * j < kNumSF) store_sf<kDataBytes, kNumSF>(a, out, lane + 32 * j, my_sf[j]);
                }
                if (!kCached && lane < K) {
                    const bool local = my_expert >= 0 && my_expert / L == rank;
                    a.row_map[static_cast<int64_t>(row) * K + lane] = local ? my_pair_row : -1;
                    if (local) {
                        a.out_topk_idx[my_pair_row] = my_expert - rank * L;
                        a.out_weights[my_pair_row] = defect_weight(a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(t) * K + lane] : 1.0f, lane);
                        a.out_src_rank[my_pair_row] = rank;
                        a.out_src_token[my_pair_row] = t;
                    }
                }
            }
        }
        cur = next;  // after a warp's last token, values never loaded: the loop ends before any use
    }
    if (last_block(my_window)) signal_all_peers(a.peers, rank, R);
}

template <int kDataBytes, int kNumSF, int K, bool kExpand, bool kCached>
__device__ __forceinline__ void dispatch_recv_impl(const DispatchArgs& a, bool zero_padding) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    constexpr int kUnroll = row_unroll<Row::kVecs, EP_SEND_UNROLL, 8>();
    uint8_t* my_window = a.peers[a.rank];
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = a.num_ranks, L = a.num_experts / a.num_ranks, rank = a.rank;
    const LayoutIndex ix{R, L, a.num_experts};
    // The layout was written before this kernel (layout kernel or handle): read during the wait.
    const int num_tok_rows = a.layout[ix.num_tok_rows()];
    const int self_begin = rank == 0 ? 0 : a.layout[ix.tok_prefix() + rank - 1];
    const int self_end = a.layout[ix.tok_prefix() + rank];
    const bool ok = wait_all_peers(my_window, a.rank, a.num_ranks, kPhaseDispatch, a.timeout_ns);
    const int half = current_half(my_window);

    if (ok) {
        for (int j = global_warp; j < num_tok_rows; j += num_warps) {
            if (j >= self_begin && j < self_end) continue;  // written by dispatch_send
            int s = 0;
            while (s < R - 1 && j >= a.layout[ix.tok_prefix() + s]) ++s;
            const uint8_t* row = window_row(my_window, a, half, j);
            const int* meta = reinterpret_cast<const int*>(row + Row::kMetaOffset);
            int out_row = -1;
            if (kExpand && lane < K) out_row = kCached ? a.row_map[static_cast<int64_t>(j) * K + lane] : __ldcg(meta + 1 + lane);
            const int defect_expert = (EP_TEST_DEFECT == kDefectSkippedExpert && !kCached && lane < K) ? __ldcg(meta + 1 + K + lane) : -1;
            const int4* src = reinterpret_cast<const int4*>(row);
            for (int base = 0; base < Row::kVecs; base += 32 * kUnroll) {
                int4 v[kUnroll];
                load_chunk<kUnroll, Row::kVecs, true>(src, base, lane, v);
                if (!kExpand) {
                    int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(defect_row(j)) * kDataBytes);
                    if (!defect_drops_row(j)) store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                } else {
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        const int out = __shfl_sync(0xffffffffu, out_row, k);
                        if (EP_TEST_DEFECT == kDefectSkippedExpert && defect_skips_expert(__shfl_sync(0xffffffffu, defect_expert, k))) continue;
                        if (out < 0) continue;
                        int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(out) * kDataBytes);
                        store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                    }
                }
            }
            const int* row_sf = reinterpret_cast<const int*>(row + kDataBytes);
            if (!kExpand) {
                if (!defect_stale_sf<kCached>(j))
                    for (int i = lane; i < kNumSF; i += 32) store_sf<kDataBytes, kNumSF>(a, j, i, __ldcg(row_sf + i));
            } else {
                for (int k = 0; k < K; ++k) {
                    const int out = __shfl_sync(0xffffffffu, out_row, k);
                    if (out < 0) continue;
                    for (int i = lane; i < kNumSF; i += 32) store_sf<kDataBytes, kNumSF>(a, out, i, __ldcg(row_sf + i));
                }
            }
            if (!kCached) {
                const int src_token = __ldcg(meta);
                if (!kExpand) {
                    if (lane < K) {
                        a.out_topk_idx[static_cast<int64_t>(j) * K + lane] = __ldcg(meta + 1 + K + lane);
                        if (a.out_weights != nullptr)
                            a.out_weights[static_cast<int64_t>(j) * K + lane] = defect_weight(__ldcg(reinterpret_cast<const float*>(meta) + 1 + 2 * K + lane), lane);
                    }
                    if (lane == 0) { a.out_src_rank[j] = s; a.out_src_token[j] = src_token; }
                } else if (lane < K) {
                    a.row_map[static_cast<int64_t>(j) * K + lane] = out_row;
                    if (out_row >= 0) {
                        a.out_topk_idx[out_row] = __ldcg(meta + 1 + K + lane);
                        a.out_weights[out_row] = defect_weight(__ldcg(reinterpret_cast<const float*>(meta) + 1 + 2 * K + lane), lane);
                        a.out_src_rank[out_row] = s;
                        a.out_src_token[out_row] = src_token;
                    }
                }
            }
        }
        // Expanded: padding rows of every local expert.
        if (kExpand) {
            const int A = a.alignment;
            for (int idx = global_warp; idx < L * A; idx += num_warps) {
                const int e = idx / A, i = idx % A;
                const int row = a.layout[ix.expert_start() + e] + a.layout[ix.raw_counts() + e] + i;
                if (row >= a.layout[ix.expert_start() + e] + a.layout[ix.padded_counts() + e]) continue;
                if (zero_padding) {
                    int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(row) * kDataBytes);
                    for (int v = lane; v < Row::kVecs; v += 32) dst[v] = make_int4(0, 0, 0, 0);
                    for (int q = lane; q < kNumSF; q += 32) store_sf<kDataBytes, kNumSF>(a, row, q, 0);
                }
                if (!kCached && lane == 0) {
                    a.out_topk_idx[row] = -1;
                    a.out_weights[row] = 0.0f;
                    a.out_src_rank[row] = -1;
                    a.out_src_token[row] = -1;
                }
            }
        }
        // Rows past the true count (outputs sized for the worst case): metadata only.
        if (!kCached) {
            const int num_out_rows = a.layout[ix.num_out_rows()];
            const int tid = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;
            for (int r = num_out_rows + tid; r < a.out_capacity; r += nthreads) {
                if (kExpand) {
                    a.out_topk_idx[r] = -1;
                    a.out_weights[r] = 0.0f;
                } else {
                    for (int k = 0; k < K; ++k) a.out_topk_idx[static_cast<int64_t>(r) * K + k] = -1;
                    if (a.out_weights != nullptr)
                        for (int k = 0; k < K; ++k) a.out_weights[static_cast<int64_t>(r) * K + k] = 0.0f;
                }
                a.out_src_rank[r] = -1;
                a.out_src_token[r] = -1;
            }
        }
    }
    finish_wait(my_window, true, a.err_host);
}

}  // namespace deep_ep
