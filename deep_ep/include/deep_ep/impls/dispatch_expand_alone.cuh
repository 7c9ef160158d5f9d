// A rank alone's cached dispatch in the expanded layout (EP_EXPAND_ALONE_CACHED): its send phase
// with the work cut finer, in a kernel of more threads.
//
// Alone, a cached expanded dispatch only fans each token row out to its experts' rows, which the
// handle already holds (pos_pair): 470 MB written for 59 MB read at DeepSeek-V3 shapes, bound by
// HBM's mix of reads and writes. The send phase (impls/dispatch_send.cuh) gives each warp whole
// tokens and runs 16 warps per SM (its registers allow no more); here every (token, chunk of the
// row) is a work item of its own and the kernel runs 32 warps per SM (EP_ALONE_THREADS), so more
// row loads are in flight while the stores drain. On the H200 a minimal kernel of each shape
// (tools/expand_floor.py) took 148.6 us (whole tokens, 16 warps per SM) against 141.4 (chunks, 32);
// this kernel 143.1 us against the cached data kernel's 148.3 (tools/tune_gpu.py --expand,
// docs/performance.md).
// The warp of a token's first chunk also writes its scale factors and weights; then the padding
// rows and the rows past the count, as the receive phase ends (dispatch_recv_tail), without the
// receive phase's loop over peer rows (a rank alone has none, and its registers would not fit
// 1024 threads). The rows and values written are the cached data kernel's, bit for bit.
#pragma once

#include "../comm/lsa.cuh"
#include "../common/grid.cuh"
#include "dispatch_args.cuh"
#include "dispatch_recv.cuh"

// EP_EXPAND_ALONE_CACHED (build-time tunable): 1 = a rank alone's cached expanded dispatch is the
// kernel deep_ep_dispatch_cached_alone (the default), 0 = the cached data kernel of every rank count.
// The host reads the same default (`deep_ep.backends.gpu.modules.EXPAND_ALONE_CACHED_DEFAULT`; a test
// holds the two equal) and chooses the kernel by it.
#ifndef EP_EXPAND_ALONE_CACHED
#define EP_EXPAND_ALONE_CACHED 1
#endif
// Threads per block of that kernel (the host passes the same number: `modules.ALONE_THREADS`).
#ifndef EP_ALONE_THREADS
#define EP_ALONE_THREADS 1024
#endif

namespace deep_ep {

// Every thread of the grid; ``a.pos_pair``: the handle's final row of each (token, slot).
template <int kDataBytes, int kNumSF, int K>
__device__ __forceinline__ void dispatch_expand_alone_cached(const DispatchArgs& a, bool zero_padding,
                                                             const comm::LsaTransport& tr) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    // The send phase's chunks, but never more than 8 vectors per lane (EP_SEND_UNROLL may ask for
    // more: 1024 threads leave 64 registers each).
    constexpr int kUnroll = row_unroll<Row::kVecs, (EP_SEND_UNROLL > 8 ? 8 : EP_SEND_UNROLL), 8>();
    constexpr int kChunk = 32 * kUnroll;
    constexpr int kChunks = (Row::kVecs + kChunk - 1) / kChunk;
    const WarpGrid wg;
    const int lane = wg.lane;
    // After a timeout the layout is void: move nothing (as the send phase).
    if (comm::has_error(tr.local())) return;
    const int64_t items = static_cast<int64_t>(a.num_tokens) * kChunks;
    const bool with_weights = a.out_weights != nullptr;
    for (int64_t item = wg.warp; item < items; item += wg.num_warps) {
        const int t = static_cast<int>(item / kChunks), base = static_cast<int>(item % kChunks) * kChunk;
        const int4* src = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * kDataBytes);
        int4 v[kUnroll];
        load_chunk<kUnroll, Row::kVecs, false>(src, base, lane, v);
        // Lanes < K: the slot's expert (out of range: masked, as the send phase) and its row, both
        // loaded at once (no load waits for another before the stores).
        int my_expert = -1, my_row = -1;
        if (lane < K) {
            const int64_t e = a.topk_idx[static_cast<int64_t>(t) * K + lane];
            const int row = a.pos_pair[static_cast<int64_t>(t) * K + lane];
            if (e >= 0 && e < a.num_experts) {
                my_expert = static_cast<int>(e);
                my_row = row;
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int e = __shfl_sync(0xffffffffu, my_expert, k);
            const int out = __shfl_sync(0xffffffffu, my_row, k);
            if (e < 0 || out < 0 || defect_skips_expert(e)) continue;
            store_chunk<kUnroll, Row::kVecs>(reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(out) * kDataBytes),
                                             base, lane, v);
        }
        if (base != 0) continue;
        // ---- the token's scale factors and weights (the warp of its first chunk)
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
            a.out_weights[my_row] = defect_weight(w, lane);
        }
    }
    const LayoutIndex ix{1, a.num_experts, a.num_experts};
    dispatch_recv_tail<kDataBytes, kNumSF, K, true, true>(a, zero_padding, a.num_experts, ix, a.layout[ix.num_tok_rows()]);
}

}  // namespace deep_ep
