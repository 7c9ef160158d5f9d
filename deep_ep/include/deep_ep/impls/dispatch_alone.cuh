// A rank alone's fresh dispatch in the non-expanded layout as one kernel (EP_DISPATCH_ALONE_FUSED):
// the token scan of impls/notify_alone.cuh, its count row and layout stage, and the send phase of
// impls/dispatch_send.cuh, with no kernel boundary and one launch instead of two.
//
// Alone, a token's row depends only on the tokens before it (an exclusive scan of one flag per
// token), and a rank alone's rows start at 0 (send_base), so a block can move its tokens as soon
// as it has numbered them. Each block (num_sms of them, all resident: a cooperative launch) takes
// one consecutive token range (AloneTokens) and
//   1. numbers it (notify_alone_number: counts, the handle's copy of the ids, the range check, the
//      look-back over the totals of the blocks before it), writing each token's final row to pos_tok;
//   2. if it is the last block to finish numbering, writes the count row, the layout words and the
//      host's report (notify_alone_finish), before its own rows: a host that waits for the counts
//      (do_cpu_sync) reads them while the other blocks still move theirs;
//   3. moves its tokens (dispatch_send_impl over the block's range, its warps striding over it);
//   4. marks the output rows past the received count (outputs sized for more rows than arrive): ids
//      -1, weights 0, recv_src_metadata -1; rows from T on by every block, rows between the count and
//      T (tokens that select no expert) by the block of step 2, the only one that knows the count.
// Its outputs and handle words are those of the notify kernel followed by the data kernel, bit for
// bit (tools/sweep_notify.py --variants ";DISPATCH_ALONE_FUSED=0" compares the two).
#pragma once

#include "dispatch_send.cuh"
#include "notify_alone.cuh"

// EP_DISPATCH_ALONE_FUSED (build-time tunable): 1 = a rank alone's non-expanded fresh dispatch is
// this one kernel when its outputs can be allocated before the counts are known (the default);
// 0 = the notify kernel, then the data kernel. The host reads the same default
// (`deep_ep.backends.gpu.modules.DISPATCH_ALONE_FUSED_DEFAULT`; a test holds the two equal).
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

// Every thread of every block. ``na.tokens_per_group``: the tokens of one block; ``smem``: at least
// 2 E ints of dynamic shared memory.
template <int kDataBytes, int kNumSF, int K>
__device__ __forceinline__ void dispatch_alone_impl(const NotifyArgs& na, const LayoutArgs& la, const DispatchArgs& a,
                                                    const comm::LsaTransport& tr, int* smem) {
    const int block_tokens = notify_alone_number<K>(na, tr, smem);
    const bool finisher = gridDim.x == 1 || comm::last_block(tr.local(), kCtrlDone, false);
    const int T = a.num_tokens;
    int count = T;
    if (finisher) count = notify_alone_finish(na, la, tr, smem, block_tokens);

    const AloneTokens range(na);
    const int warp = static_cast<int>(threadIdx.x >> 5), warps = static_cast<int>(blockDim.x >> 5);
    dispatch_send_impl<kDataBytes, kNumSF, K, false, false, true>(a, tr, TokenRange{range.first + warp, range.end, warps});

    const int tid = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    const int nthreads = static_cast<int>(gridDim.x * blockDim.x);
    mark_rows_past_count<K>(a, T, a.out_capacity, T, a.tok_capacity, tid, nthreads);
    if (finisher && count < T)
        mark_rows_past_count<K>(a, count, min(T, a.out_capacity), count, min(T, a.tok_capacity),
                                static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

}  // namespace deep_ep
