// Dispatch, receive phase on destination d: waits for every peer, then copies the rows that came from
// peers into the outputs (expanded: one per local expert), fills padding and marks rows past the count.
#pragma once

#include "../comm/lsa.cuh"
#include "../common/grid.cuh"
#include "dispatch_args.cuh"

namespace deep_ep {

// After the rows (every thread of the grid): expanded, the local experts' padding rows (zeroed with
// ``zero_padding``, weights 0); then rows past the true count (ids -1, weights 0) and
// recv_src_metadata past the ``num_tok_rows`` received tokens (-1).
template <int kDataBytes, int kNumSF, int K, bool kExpand, bool kCached>
__device__ __forceinline__ void dispatch_recv_tail(const DispatchArgs& a, bool zero_padding, int L, const LayoutIndex& ix,
                                                   int num_tok_rows) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    const WarpGrid wg;
    const int lane = wg.lane;
    if (kExpand) {
        const int A = a.alignment;
        for (int idx = wg.warp; idx < L * A; idx += wg.num_warps) {
            const int e = idx / A, i = idx % A;
            const int row = a.layout[ix.expert_start() + e] + a.layout[ix.raw_counts() + e] + i;
            if (row >= a.layout[ix.expert_start() + e] + a.layout[ix.padded_counts() + e]) continue;
            if (zero_padding) {
                int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(row) * kDataBytes);
                for (int v = lane; v < Row::kVecs; v += 32) dst[v] = make_int4(0, 0, 0, 0);
                for (int q = lane; q < kNumSF; q += 32) store_sf<kDataBytes, kNumSF>(a, row, q, 0);
            }
            if (a.out_weights != nullptr && lane == 0) a.out_weights[row] = 0.0f;
        }
    }
    const int tid = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;
    const int num_out_rows = a.layout[ix.num_out_rows()];
    for (int r = num_out_rows + tid; r < a.out_capacity; r += nthreads) {
        if (!kCached && !kExpand)
            for (int k = 0; k < K; ++k) a.out_topk_idx[static_cast<int64_t>(r) * K + k] = -1;
        if (a.out_weights != nullptr) {
            if (kExpand) a.out_weights[r] = 0.0f;
            else for (int k = 0; k < K; ++k) a.out_weights[static_cast<int64_t>(r) * K + k] = 0.0f;
        }
    }
    if (!kCached)
        for (int64_t i = static_cast<int64_t>(num_tok_rows) * (K + 2) + tid; i < static_cast<int64_t>(a.tok_capacity) * (K + 2); i += nthreads)
            a.src_meta[i] = -1;
}

template <int kDataBytes, int kNumSF, int K, bool kExpand, bool kCached, typename Transport>
__device__ __forceinline__ void dispatch_recv_impl(const DispatchArgs& a, bool zero_padding, const Transport& tr) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    constexpr int kUnroll = row_unroll<Row::kVecs, EP_SEND_UNROLL, 8>();
    uint8_t* my_window = tr.local();
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = tr.num_ranks, L = a.num_experts / tr.num_ranks, rank = tr.rank;
    const LayoutIndex ix{R, L, a.num_experts};
    // The layout was written before this kernel (the notify kernel's layout stage, or the handle): read during the wait.
    const int num_tok_rows = a.layout[ix.num_tok_rows()];
    const int self_begin = rank == 0 ? 0 : a.layout[ix.tok_prefix() + rank - 1];
    const int self_end = a.layout[ix.tok_prefix() + rank];
    // A rank alone has no peer rows to wait for (LsaTransport::exchanges): only an earlier error voids the call.
    const bool ok = tr.exchanges() ? tr.wait_all(kPhaseDispatch, a.timeout_ns) && comm::check_tags(my_window, rank, R, a.tag)
                                   : __syncthreads_and(!comm::has_error(my_window)) != 0;  // block-uniform, as wait_all's
    const int half = comm::current_half(my_window);

    if (ok) {
        for (int j = global_warp; j < num_tok_rows; j += num_warps) {
            if (j >= self_begin && j < self_end) continue;  // written by dispatch_send
            int s = 0;
            while (s < R - 1 && j >= a.layout[ix.tok_prefix() + s]) ++s;
            const uint8_t* row = my_window + comm::row_offset(a, half, j);
            const int* meta = reinterpret_cast<const int*>(row + Row::kMetaOffset);
            int out_row = -1;
            if (kExpand && lane < K) out_row = kCached ? a.src_meta[static_cast<int64_t>(j) * (K + 2) + 2 + lane] : __ldcg(meta + 1 + lane);
            const int4* src = reinterpret_cast<const int4*>(row);
            for (int base = 0; base < Row::kVecs; base += 32 * kUnroll) {
                int4 v[kUnroll];
                load_chunk<kUnroll, Row::kVecs, true>(src, base, lane, v);
                if (!kExpand) {
                    int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(j) * kDataBytes);
                    store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                } else {
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        const int out = __shfl_sync(0xffffffffu, out_row, k);
                        if (out < 0) continue;
                        int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(out) * kDataBytes);
                        store_chunk<kUnroll, Row::kVecs>(dst, base, lane, v);
                    }
                }
            }
            const int* row_sf = reinterpret_cast<const int*>(row + kDataBytes);
            if (!kExpand) {
                for (int i = lane; i < kNumSF; i += 32) store_sf<kDataBytes, kNumSF>(a, j, i, __ldcg(row_sf + i));
            } else {
                for (int k = 0; k < K; ++k) {
                    const int out = __shfl_sync(0xffffffffu, out_row, k);
                    if (out < 0) continue;
                    for (int i = lane; i < kNumSF; i += 32) store_sf<kDataBytes, kNumSF>(a, out, i, __ldcg(row_sf + i));
                }
            }
            const float weight = (a.out_weights != nullptr && lane < K) ? __ldcg(reinterpret_cast<const float*>(meta) + 1 + 2 * K + lane) : 0.0f;
            if (!kExpand) {
                if (!kCached && lane < K) a.out_topk_idx[static_cast<int64_t>(j) * K + lane] = __ldcg(meta + 1 + K + lane);
                if (a.out_weights != nullptr && lane < K) a.out_weights[static_cast<int64_t>(j) * K + lane] = weight;
            } else if (a.out_weights != nullptr && out_row >= 0) {
                a.out_weights[out_row] = weight;
            }
            if (!kCached) {
                const bool local = lane < K && __ldcg(meta + 1 + K + lane) >= 0;
                write_src_meta<K>(a, j, s, __ldcg(meta), __ballot_sync(0xffffffffu, local), out_row, lane);
            }
        }
        dispatch_recv_tail<kDataBytes, kNumSF, K, kExpand, kCached>(a, zero_padding, L, ix, num_tok_rows);
    }
    if (tr.exchanges()) comm::finish_wait(my_window, true, a.err_host);
}

}  // namespace deep_ep
