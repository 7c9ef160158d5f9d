// A rank alone's fresh dispatch in the non-expanded layout, as one kernel (EP_DISPATCH_ALONE_FUSED):
// the token scan of impls/notify_alone.cuh, its count row and layout stage (with CPU sync, the
// host's report too), and the send phase of impls/dispatch_send.cuh, with no kernel boundary and
// one launch instead of two.
//
// Alone, a token's row depends only on the tokens before it (an exclusive scan of one flag per
// token), and a rank alone's rows start at 0 (send_base), so a block can move its tokens as soon
// as it has numbered them. All blocks are resident (a cooperative launch). Every block but the
// last (the numbering blocks; a grid of one block does everything itself, in turn)
//   1. numbers one consecutive token range (AloneTokens; notify_alone_number: counts, the handle's
//      copy of the ids, the range check, the look-back over the totals of the blocks before it),
//      writing each token's final row to pos_tok, publishes its histogram and total, and counts
//      itself done;
//   2. moves its tokens (dispatch_send_impl over the block's range, its warps striding over it).
// The last block (the layout block) waits until every numbering block is done, then writes the
// count row, the layout words and any error record (notify_alone_finish), and marks the output rows
// between the received count and T (tokens that select no expert): ids -1, weights 0,
// recv_src_metadata -1. It moves no rows: the layout stage is a chain of dependent steps that
// runs slowly while every other SM streams rows through memory, and off the rows' critical path
// it costs the copy one SM of many (the host adds the block when the device has a spare SM).
// Every block marks the rows from T on when the outputs are sized for the worst case (without CPU
// sync; with it they have T rows, cut by the host to the reported count), as the receive phase
// marks rows past the count (impls/dispatch_recv.cuh).
// Its outputs and handle words are those of the notify kernel followed by the data kernel, bit for
// bit (tools/sweep_notify.py --variants ";DISPATCH_ALONE_FUSED=0" compares the two).
#pragma once

#include "dispatch_send.cuh"
#include "notify_alone.cuh"

// EP_DISPATCH_ALONE_FUSED (build-time tunable): 1 = a rank alone's non-expanded fresh dispatch
// without CPU sync is this one kernel (the default), 2 = with CPU sync too (its outputs are then
// allocated for T rows before the counts, as the two kernels' are, and cut to the reported rows;
// not with column-major scale factors, whose layout needs the exact rows: two kernels there);
// 0 = the notify kernel, then the data kernel. The host reads the same default
// (`deep_ep.backends.gpu.modules.DISPATCH_ALONE_FUSED_DEFAULT`; a test holds the two equal) and
// chooses the kernels by it.
#ifndef EP_DISPATCH_ALONE_FUSED
#define EP_DISPATCH_ALONE_FUSED 1
#endif

namespace deep_ep {

// Output rows [row0, row1) and recv_src_metadata rows [tok0, tok1) past the received count, marked
// by the threads ``tid`` of ``nthreads``: top-k ids -1, weights 0, metadata -1 (as the receive phase
// marks them, impls/dispatch_recv.cuh).
template <int K>
__device__ __forceinline__ void mark_rows_past_count(const DispatchArgs& a, int row0, int row1, int tok0, int tok1,
                                                     int tid, int nthreads) {
    for (int64_t i = static_cast<int64_t>(row0) * K + tid; i < static_cast<int64_t>(row1) * K; i += nthreads) {
        a.out_topk_idx[i] = -1;
        if (a.out_weights != nullptr) a.out_weights[i] = 0.0f;
    }
    for (int64_t i = static_cast<int64_t>(tok0) * (K + 2) + tid; i < static_cast<int64_t>(tok1) * (K + 2); i += nthreads)
        a.src_meta[i] = -1;
}

// Every thread of the block that writes the layout (`notify_alone_finish`, whose arguments
// ``single``, ``num_blocks`` and ``block_tokens`` it takes), then marks the rows between the
// received count and T (tokens that select no expert).
template <int K>
__device__ __forceinline__ void dispatch_alone_layout(const NotifyArgs& na, const LayoutArgs& la, const DispatchArgs& a,
                                                      const comm::LsaTransport& tr, int* smem, bool single,
                                                      int num_blocks, int block_tokens) {
    const int T = a.num_tokens;
    const int count = notify_alone_finish(na, la, tr, smem, single, num_blocks, block_tokens);
    if (count < T)
        mark_rows_past_count<K>(a, count, min(T, a.out_capacity), count, min(T, a.tok_capacity),
                                static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

// Every thread of every block. ``na.tokens_per_group``: the tokens of one numbering block;
// ``smem``: at least 2 E ints of dynamic shared memory.
template <int kDataBytes, int kNumSF, int K>
__device__ __forceinline__ void dispatch_alone_impl(const NotifyArgs& na, const LayoutArgs& la, const DispatchArgs& a,
                                                    const comm::LsaTransport& tr, int* smem) {
    const int T = a.num_tokens;
    const int num_blocks = static_cast<int>(gridDim.x);
    const bool single = num_blocks == 1;
    const int num_numbering = single ? 1 : num_blocks - 1;
    uint32_t* const done = comm::ctrl_of(tr.local()) + kCtrlDone;   // numbering blocks done
    if (!single && static_cast<int>(blockIdx.x) == num_blocks - 1) {
        // ---- the layout block: wait for every numbering block, then the count row and layout
        __shared__ int s_ok;
        if (threadIdx.x == 0) {
            s_ok = 1;
            const uint64_t start = global_timer_ns();
            while (ld_volatile(done) < static_cast<uint32_t>(num_numbering)) {
                if (global_timer_ns() - start > na.timeout_ns) {
                    comm::record_error(tr.local(), kErrTimeout, tr.rank, tr.rank, kPhaseNotify);
                    s_ok = 0;
                    break;
                }
            }
            if (s_ok) atomicSub(done, static_cast<uint32_t>(num_numbering));   // as the next kernel expects it
        }
        __syncthreads();
        if (!s_ok) {
            // The layout is void: every word defined (zero, as layout_alone leaves a refused call's),
            // and the error copied to the host's record, which the next call raises (the buffer is
            // then unusable: late blocks may still count themselves done).
            const LayoutIndex ix{1, na.num_experts, na.num_experts};
            for (int i = static_cast<int>(threadIdx.x); i < ix.size(); i += static_cast<int>(blockDim.x)) la.layout[i] = 0;
            if (threadIdx.x == 0) {
                const volatile uint32_t* err = comm::ctrl_of(tr.local()) + kCtrlError;
                comm::error_to_host(err, err[0], la.err_host);
            }
            return;
        }
        dispatch_alone_layout<K>(na, la, a, tr, smem, false, num_numbering, 0);
    } else {
        // ---- a numbering block: number, count itself done, move its tokens
        const int block_tokens = notify_alone_number<K>(na, tr, smem, !single);
        if (single) {
            dispatch_alone_layout<K>(na, la, a, tr, smem, true, 1, block_tokens);
        } else if (threadIdx.x == 0) {
            __threadfence();   // the block's rows, total and histogram before its arrival
            atomicAdd(done, 1u);
        }
        const AloneTokens range(na);
        const int warp = static_cast<int>(threadIdx.x >> 5), warps = static_cast<int>(blockDim.x >> 5);
        dispatch_send_impl<kDataBytes, kNumSF, K, false, false, true>(a, tr, TokenRange{range.first + warp, range.end, warps});
    }
    const int tid = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    mark_rows_past_count<K>(a, T, a.out_capacity, T, a.tok_capacity, tid, static_cast<int>(gridDim.x * blockDim.x));
}

}  // namespace deep_ep
