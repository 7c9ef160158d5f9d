// A rank alone's dispatch in the expanded layout, cached (EP_EXPAND_ALONE_CACHED) and fresh
// (EP_EXPAND_ALONE_FRESH): its send phase with the work cut finer, in a kernel of more threads.
//
// Alone, an expanded dispatch fans each token row out to its experts' rows: 470 MB written for
// 59 MB read at DeepSeek-V3 shapes, bound by HBM's mix of reads and writes. The send phase
// (impls/dispatch_send.cuh) gives each warp whole tokens and runs 16 warps per SM (its registers
// allow no more); here every (token, chunk of the row) is a work item of its own and the kernel
// runs 32 warps per SM (EP_ALONE_THREADS), so more row loads are in flight while the stores drain.
// On the H200 a minimal kernel of each shape (tools/expand_floor.py) took 148.6 us (whole tokens,
// 16 warps per SM) against 141.4 (chunks, 32); the cached kernel 143.1 us against the cached data
// kernel's 148.3 (tools/tune_gpu.py --expand, docs/performance.md).
//
// A cached dispatch reads each pair's final row from the handle (pos_pair). A fresh one adds where
// the pair's expert starts (the layout stage's out_base) to the pair's index among the expert's
// pairs, which the notify kernel wrote to a piece of its own (``pair_rank``, not pos_pair: the
// warps of a token's other chunks read it while the first chunk's warp writes the final rows to
// pos_pair for the handle, so the two cannot be one array).
// The warp of a token's first chunk also writes its scale factors and weights (a fresh dispatch:
// also its final rows and its recv_src_metadata row); then the padding rows and the rows past the
// count, as the receive phase ends (dispatch_recv_tail), without the receive phase's loop over peer
// rows (a rank alone has none, and its registers would not fit 1024 threads). The rows and values
// written are the data kernels' (cached, fresh), bit for bit.
#pragma once

#include "../comm/lsa.cuh"
#include "../common/grid.cuh"
#include "dispatch_args.cuh"
#include "dispatch_recv.cuh"

// EP_EXPAND_ALONE_CACHED / EP_EXPAND_ALONE_FRESH (build-time tunables): 1 = a rank alone's cached /
// fresh expanded dispatch is the kernel deep_ep_dispatch_cached_alone / deep_ep_dispatch_fresh_alone
// (the defaults), 0 = the data kernel of every rank count. The host reads the same defaults
// (`deep_ep.backends.gpu.modules.EXPAND_ALONE_CACHED_DEFAULT` / `EXPAND_ALONE_FRESH_DEFAULT`; a test
// holds them equal) and chooses the kernels by them.
#ifndef EP_EXPAND_ALONE_CACHED
#define EP_EXPAND_ALONE_CACHED 1
#endif
#ifndef EP_EXPAND_ALONE_FRESH
#define EP_EXPAND_ALONE_FRESH 1
#endif
// Threads per block of those kernels (the host passes the same number: `modules.ALONE_THREADS`).
#ifndef EP_ALONE_THREADS
#define EP_ALONE_THREADS 1024
#endif

namespace deep_ep {

// Every thread of the grid. ``kFresh``: ``pair_rank`` holds each (token, slot)'s index among its
// expert's pairs (the notify kernel's), and the final rows go to ``a.pos_pair``; otherwise
// ``a.pos_pair`` holds the handle's final rows and ``pair_rank`` is unused.
template <int kDataBytes, int kNumSF, int K, bool kFresh>
__device__ __forceinline__ void dispatch_expand_alone(const DispatchArgs& a, bool zero_padding,
                                                      const comm::LsaTransport& tr, const int* pair_rank) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    // The send phase's chunks, but never more than 8 vectors per lane (EP_SEND_UNROLL may ask for
    // more: 1024 threads leave 64 registers each).
    constexpr int kUnroll = row_unroll<Row::kVecs, (EP_SEND_UNROLL > 8 ? 8 : EP_SEND_UNROLL), 8>();
    constexpr int kChunk = 32 * kUnroll;
    constexpr int kChunks = (Row::kVecs + kChunk - 1) / kChunk;
    const WarpGrid wg;
    const int lane = wg.lane;
    // After a timeout or a refused receive the layout is void: move nothing (as the send phase).
    // (An out-of-range id reaches the host's record only: rows move as the data kernel moves them,
    // into outputs the call then voids.)
    if (comm::has_error(tr.local())) {
        // A fresh dispatch leaves the handle's rows as the notify kernel numbered them, as the data
        // kernel does when it moves nothing.
        if (kFresh)
            for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
                 i < static_cast<int64_t>(a.num_tokens) * K; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
                a.pos_pair[i] = pair_rank[i];
        return;
    }
    const int64_t items = static_cast<int64_t>(a.num_tokens) * kChunks;
    const bool with_weights = a.out_weights != nullptr;
    for (int64_t item = wg.warp; item < items; item += wg.num_warps) {
        const int t = static_cast<int>(item / kChunks), base = static_cast<int>(item % kChunks) * kChunk;
        const int4* src = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * kDataBytes);
        int4 v[kUnroll];
        load_chunk<kUnroll, Row::kVecs, false>(src, base, lane, v);
        // Lanes < K: the slot's expert (out of range: masked, as the send phase) and its row, both
        // loaded at once (no load waits for another before the stores); fresh: the row is the
        // expert's start plus the pair's index.
        int my_expert = -1, my_row = -1, final_row = -1;
        if (lane < K) {
            const int64_t e = a.topk_idx[static_cast<int64_t>(t) * K + lane];
            const int row = (kFresh ? pair_rank : a.pos_pair)[static_cast<int64_t>(t) * K + lane];
            if (kFresh) final_row = row;
            if (e >= 0 && e < a.num_experts) {
                my_expert = static_cast<int>(e);
                if (kFresh && row >= 0) final_row = row + a.layout[LayoutIndex{1, a.num_experts, a.num_experts}.out_base() + my_expert];
                my_row = kFresh ? final_row : row;
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int e = __shfl_sync(0xffffffffu, my_expert, k);
            const int out = __shfl_sync(0xffffffffu, my_row, k);
            if (e < 0 || out < 0) continue;
            store_chunk<kUnroll, Row::kVecs>(reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(out) * kDataBytes),
                                             base, lane, v);
        }
        if (base != 0) continue;
        // ---- the token's scale factors and weights (the warp of its first chunk); fresh: its
        // final rows and its recv_src_metadata row (at the token's row: a rank alone's start at 0)
        int token_row = 0;
        if (kFresh) {
            if (lane < K) a.pos_pair[static_cast<int64_t>(t) * K + lane] = final_row;
            token_row = a.pos_tok[t];
            if (token_row < 0) continue;   // selects no expert: nothing of it is received
        }
        if (kNumSF > 0) {
            for (int k = 0; k < K; ++k) {
                const int e = __shfl_sync(0xffffffffu, my_expert, k);
                const int out = __shfl_sync(0xffffffffu, my_row, k);
                if (e < 0 || out < 0) continue;
                for (int i = lane; i < kNumSF; i += 32)
                    store_sf<kDataBytes, kNumSF>(a, out, i, a.sf[static_cast<int64_t>(t) * kNumSF + i]);
            }
        }
        if (with_weights && my_row >= 0) {
            const float w = a.topk_weights != nullptr ? a.topk_weights[static_cast<int64_t>(t) * K + lane] : 0.0f;
            a.out_weights[my_row] = w;
        }
        if (kFresh) {
            const bool local = lane < K && my_expert >= 0;
            write_src_meta<K>(a, token_row, 0, t, __ballot_sync(0xffffffffu, local), local ? my_row : -1, lane);
        }
    }
    const LayoutIndex ix{1, a.num_experts, a.num_experts};
    dispatch_recv_tail<kDataBytes, kNumSF, K, true, !kFresh>(a, zero_padding, a.num_experts, ix, a.layout[ix.num_tok_rows()]);
}

}  // namespace deep_ep
