// The notify stage of a rank alone in the non-expanded layout (EP_NOTIFY_TOKEN_SCAN): a token scan
// and an expert histogram, with no grid barrier.
//
// A rank alone sends every token to itself, so of what impls/notify.cuh computes it needs only:
//   pos_tok[t]   t's index among the tokens that select at least one expert (-1: none), an
//                exclusive scan over the tokens of one flag each;
//   counts       the count row [1 + E]: those tokens, then the pairs of each expert (a histogram:
//                no order within an expert matters in this layout), then the first out-of-range
//                id (flat index and value), as impls/notify.cuh publishes it.
// Each block takes a consecutive token range and each thread a consecutive run of it (the first 32
// tokens noted as a bit each in a register; past them, read again to number them). One pass over the ids counts, copies them for the handle and
// checks their range; a block scan of the threads' token counts gives every thread its first row
// within the block. The block publishes its token total (plus one: zero means not yet) in its
// slot of the scratch, and adds its histogram (shared memory) to the grid's (global atomics); then
// it sums the totals of the blocks before it (a look-back over aggregates: every block publishes
// before it looks, all blocks are resident, so no block waits for one that waits), numbers its
// tokens, and counts itself done. The block that finishes last writes the count row from the grid's
// histogram, leaves the scratch words as it found them (zero; the bad index INT_MAX) and runs the
// layout stage and the host's report (impls/layout_alone.cuh). A grid of one block keeps its
// histogram in shared memory and touches no scratch word but the bad index.
// The outputs are the words impls/notify.cuh writes for a rank alone without the expanded layout,
// so either kernel serves a handle (tools/sweep_notify.py compares them bit for bit).
#pragma once

#include "layout_alone.cuh"
#include "notify.cuh"

// EP_NOTIFY_TOKEN_SCAN (build-time tunable, timed by tools/sweep_notify.py --variants): 1 = a rank
// alone in the non-expanded layout takes this kernel (kernels/dispatch.cuh; the default); 0 = the
// general numbering of impls/notify.cuh. The host reads the same default to size its grid
// (`deep_ep.backends.gpu.modules.NOTIFY_TOKEN_SCAN_DEFAULT`; a test holds the two equal).
#ifndef EP_NOTIFY_TOKEN_SCAN
#define EP_NOTIFY_TOKEN_SCAN 1
#endif

namespace deep_ep {

// Whether token ``t`` selects an expert (an id in [0, E)). ``kCount``: also count its pairs into
// ``hist`` (shared memory), note the flat index of an out-of-range id (one outside [-1, E)) and copy
// its ids for the handle. The ids are loaded 16 at a time (a top-k of up to 256 without spills).
template <int K, bool kCount>
__device__ __forceinline__ bool notify_alone_token(const NotifyArgs& a, int E, int t, int* hist) {
    constexpr int kChunk = K < 16 ? K : 16;
    const int64_t p0 = static_cast<int64_t>(t) * K;
    bool any = false;
#pragma unroll 1
    for (int k0 = 0; k0 < K; k0 += kChunk) {
        int64_t ids[kChunk];
#pragma unroll
        for (int k = 0; k < kChunk; ++k) ids[k] = k0 + k < K ? __ldg(a.topk_idx + p0 + k0 + k) : -1;
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
            const int64_t e = ids[k];
            const bool in_range = e >= 0 && e < E;
            any |= in_range;
            if (kCount && k0 + k < K) {
                if (in_range) atomicAdd(hist + e, 1);
                else if (e != -1) atomicMin(a.scratch + kNotifyBadIndex, static_cast<int>(p0 + k0 + k));
                if (a.topk_copy != nullptr) a.topk_copy[p0 + k0 + k] = e;
            }
        }
    }
    return any;
}

// The consecutive token range [first, end) of this block: ``a.tokens_per_group`` tokens a block
// (the host's grid: `dispatch.notify_scan_grid`, or `dispatch_plan.alone_tokens_per_block` for impls/dispatch_alone.cuh).
struct AloneTokens {
    int first, end;
    __device__ __forceinline__ explicit AloneTokens(const NotifyArgs& a)
        : first(min(a.num_tokens, static_cast<int>(blockIdx.x) * a.tokens_per_group)),
          end(min(a.num_tokens, first + a.tokens_per_group)) {}
};

// Every thread of every numbering block: count, copy and check the block's tokens, number them
// (pos_tok) and, with ``publish``, add the block's histogram and total to the grid's in the scratch
// words (without, a grid of one block keeps its histogram in ``hist`` for `notify_alone_finish`).
// ``hist``: [E] ints of shared memory. Returns the block's token total (the tokens that select an
// expert) in every thread; pos_tok is written when it returns (the block has met).
template <int K>
__device__ __forceinline__ int notify_alone_number(const NotifyArgs& a, const comm::LsaTransport& tr, int* hist,
                                                   bool publish) {
    const int E = a.num_experts;
    const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
    const int block = static_cast<int>(blockIdx.x);
    const AloneTokens range(a);
    const int per_thread = (range.end - range.first + nthreads - 1) / nthreads;   // past 32: see notify_alone_token
    const int t0 = min(range.end, range.first + tid * per_thread), t1 = min(range.end, t0 + per_thread);
    int* const scratch = a.scratch;
    __shared__ int s_before;   // tokens of the blocks before this one
    for (int e = tid; e < E; e += nthreads) hist[e] = 0;
    __syncthreads();

    // ---- count, copy, check: one pass over the thread's tokens
    uint32_t sent = 0u;   // bit j: token t0 + j selects an expert (the first 32 of the run)
    int my_tokens = 0;    // the run's tokens that select an expert
    for (int t = t0; t < t1; ++t) {
        const bool any = notify_alone_token<K, true>(a, E, t, hist);
        if (t - t0 < 32) sent |= static_cast<uint32_t>(any) << (t - t0);
        my_tokens += any;
    }
    int block_tokens;
    const int first_row = block_exclusive_scan(my_tokens, &block_tokens);   // meets: hist is complete

    // ---- publish the block's total and histogram; sum the totals before it
    bool ok = true;
    if (publish) {
        if (tid == 0) atomicExch(scratch + kNotifyScanTotals + block, block_tokens + 1);
        for (int e = tid; e < E; e += nthreads) {
            const int v = hist[e];
            if (v != 0) atomicAdd(scratch + kNotifyScanHist + e, v);
        }
        if (tid < 32) {
            int before = 0;
            const uint64_t start = global_timer_ns();
            for (int b = tid; ok && b < block; b += 32) {
                const uint32_t* slot = reinterpret_cast<const uint32_t*>(scratch + kNotifyScanTotals + b);
                uint32_t v;
                while ((v = ld_volatile(slot)) == 0u) {
                    if (global_timer_ns() - start > a.timeout_ns) { ok = false; break; }
                }
                if (ok) before += static_cast<int>(v) - 1;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) before += __shfl_xor_sync(0xffffffffu, before, o);
            ok = __all_sync(0xffffffffu, ok);
            if (tid == 0) {
                s_before = before;
                if (!ok) comm::record_error(tr.local(), kErrTimeout, tr.rank, tr.rank, kPhaseNotify);
            }
        }
    } else if (tid == 0) {
        s_before = 0;
    }
    __syncthreads();

    // ---- number the thread's tokens (past 32 of them, reading their ids again)
    int row = s_before + first_row;
    for (int t = t0; t < t1; ++t) {
        const bool s = t - t0 < 32 ? ((sent >> (t - t0)) & 1u) != 0u : notify_alone_token<K, false>(a, E, t, hist);
        a.pos_tok[t] = s ? row : -1;
        row += s;
    }
    __syncthreads();   // the block's rows are written (impls/dispatch_alone.cuh reads them next)
    return block_tokens;
}

// Every thread of one block, once every numbering block has numbered (and published): write the
// count row from the grid's histogram and the totals of the ``num_blocks`` numbering blocks (or,
// ``single``: of the one block that runs this, unpublished: its token total ``block_tokens`` and
// its histogram in ``smem``), leave the scratch words as found, then run the layout stage and the
// host's report (impls/layout_alone.cuh). ``smem``: at least 2 E ints. Returns the tokens that
// select an expert (the received rows), in every thread.
__device__ __forceinline__ int notify_alone_finish(const NotifyArgs& a, const LayoutArgs& la,
                                                   const comm::LsaTransport& tr, int* smem, bool single,
                                                   int num_blocks, int block_tokens) {
    const int E = a.num_experts;
    const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
    int* const hist = smem;
    int* const scratch = a.scratch;
    __shared__ int s_total;
    if (!single && tid == 0) __threadfence();   // the blocks' count of arrivals is the release half only
    __syncthreads();
    int* C = reinterpret_cast<int*>(tr.local() + la.counts_offset);   // rank 0's row: [1 + E + 2]
    for (int e = tid; e < E; e += nthreads) {
        int v = hist[e];
        if (!single) {
            v = __ldcg(scratch + kNotifyScanHist + e);
            scratch[kNotifyScanHist + e] = 0;
        }
        C[1 + e] = v;
    }
    if (tid < 32) {
        int total = single && tid == 0 ? block_tokens : 0;   // summed over the warp below
        for (int b = tid; !single && b < num_blocks; b += 32) {
            total += __ldcg(scratch + kNotifyScanTotals + b) - 1;
            scratch[kNotifyScanTotals + b] = 0;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        if (tid == 0) {
            const int bad = static_cast<int>(ld_volatile(reinterpret_cast<const uint32_t*>(scratch + kNotifyBadIndex)));
            const bool any = bad != 0x7fffffff;
            int value = 0;
            if (any) {
                const int64_t e = __ldg(a.topk_idx + bad);
                value = static_cast<int>(max(static_cast<int64_t>(-0x7fffffff), min(e, static_cast<int64_t>(0x7fffffff))));
            }
            C[0] = total;
            C[1 + E] = any ? bad : -1;
            C[2 + E] = value;
            scratch[kNotifyBadIndex] = 0x7fffffff;   // for the next call
            s_total = total;
        }
    }
    __syncthreads();   // the row is written; hist is dead (the layout stage reuses smem)
    const int total = s_total;
    layout_alone(la, false, tr, smem);
    layout_alone_report(la, tr);
    return total;
}

// The notify kernel of a rank alone in the non-expanded layout: every thread of every block.
// ``smem``: the kernel's dynamic shared memory, at least 2 E ints (the histogram, then the layout
// stage's arrays).
template <int K>
__device__ __forceinline__ void notify_alone_scan(const NotifyArgs& a, const LayoutArgs& la,
                                                  const comm::LsaTransport& tr, int* smem) {
    const bool single = gridDim.x == 1;
    const int block_tokens = notify_alone_number<K>(a, tr, smem, !single);
    if (!single && !comm::last_block(tr.local(), kCtrlDone, false)) return;
    notify_alone_finish(a, la, tr, smem, single, static_cast<int>(gridDim.x), block_tokens);
}

}  // namespace deep_ep
