// The notify kernel's end for a rank alone (EP_NOTIFY_SINGLE_RANK, a rank count of 1; the general
// end is impls/layout.cuh after a signal to every peer).
//
// Alone, the count matrix is the one row this rank's phase B wrote into its own window, complete
// once the blocks have met at the second grid barrier. So nothing is signalled or waited for: no
// system-scope fence, no tag check, no epoch advance. The arrival count and the epoch both stay
// untouched, as the data kernels of a rank alone leave them (LsaTransport::exchanges), so the
// buffer's barrier, the only other exchange, still finds them equal; the tag slots are written
// only by that barrier, just before it checks them. Outputs are the same words as layout_impl's at
// R = 1 (sources before this rank: none; every expert is local).
//
// The work is split in two, so that the layout does not wait for the slowest block's numbering:
//   layout_alone          the grid's last block (the fewest tokens: groups take tokens in order),
//                         right after its own phase C: the handle's layout words, the cumulative
//                         stats, a capacity error; it runs while the other blocks still number;
//   layout_alone_report   the block that finishes last (last_block, device scope: nothing goes to
//                         a peer): the host's readback and the error record's copy to mapped host
//                         memory. Only there are every block's records in (a grid barrier's timeout,
//                         the capacity error), as the general end reads them after every block too.
#pragma once

#include "layout.cuh"

// EP_NOTIFY_SINGLE_RANK (build-time tunable, timed by tools/sweep_notify.py --variants): 1 = a rank
// alone takes this end (kernels/dispatch.cuh; the default); 0 = it signals and waits on itself
// like any rank. The host reads the same default
// (`deep_ep.backends.gpu.modules.NOTIFY_SINGLE_RANK_DEFAULT`; a test holds the two equal).
#ifndef EP_NOTIFY_SINGLE_RANK
#define EP_NOTIFY_SINGLE_RANK 1
#endif

namespace deep_ep {

// Rank 0's count row: [1] tokens to this rank, [E] pairs per expert, then the bad id's flat index
// (-1: none) and the id (impls/notify.cuh).
__device__ __forceinline__ const int* alone_counts(const LayoutArgs& a, const comm::LsaTransport& tr) {
    return reinterpret_cast<const int*>(tr.local() + a.counts_offset);
}

// Every thread of one block. ``scratch``: 2 E ints of the kernel's dynamic shared memory (the
// notify kernel's [kNotifyWarps][1 + E] ints, or the one-kernel dispatch's 2 E, impls/dispatch_alone.cuh),
// dead once every warp of the block has numbered its tokens.
__device__ __forceinline__ void layout_alone(const LayoutArgs& a, bool expand, const comm::LsaTransport& tr,
                                             int* scratch) {
    const int E = a.num_experts, alignment = a.alignment;
    const LayoutIndex ix{1, E, E};
    int* __restrict__ layout = a.layout;
    const int* C = alone_counts(a, tr);
    const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
    int* s_start = scratch;      // [E] padded pairs per expert -> exclusive prefix
    int* s_raw = scratch + E;    // [E] pairs per expert
    __shared__ int s_pairs;      // expanded: pairs received (the one source's rank_prefix_sum)
    if (tid == 0) s_pairs = 0;
    __syncthreads();  // the block's warps are done with their counts in shared memory
    // An out-of-range id voids the call (every word zero, no stats), as layout_impl does. The word
    // is the same for every thread: the branches below are block-uniform.
    const bool ok = __ldcg(C + 1 + E) < 0;
    const int num_tok_rows = ok ? __ldcg(C) : 0;
    int num_out_rows = num_tok_rows;
    if (ok) {
        for (int e = tid; e < E; e += nthreads) {
            const int raw = __ldcg(C + 1 + e);
            const int padded = (raw + alignment - 1) / alignment * alignment;
            layout[ix.raw_counts() + e] = raw;
            layout[ix.padded_counts() + e] = padded;
            s_raw[e] = raw;
            s_start[e] = padded;
            if (expand && raw != 0) atomicAdd(&s_pairs, raw);
        }
        __syncthreads();
        const int padded_rows = block_scan_in_place(s_start, E, false);
        if (expand) num_out_rows = padded_rows;
        for (int e = tid; e < E; e += nthreads) {
            const int start = s_start[e], raw = s_raw[e];
            layout[ix.expert_start() + e] = start;
            // non-expanded: inclusive prefix of the padded counts; expanded: start plus unpadded count
            layout[ix.psum_expert() + e] = start + (expand ? raw : (raw + alignment - 1) / alignment * alignment);
            // Expanded: this rank's first output row for expert e is its start (no source before it).
            if (expand) layout[ix.out_base() + e] = start;
        }
        if (tid == 0) {
            layout[ix.send_base()] = 0;
            layout[ix.tok_prefix()] = num_tok_rows;
            layout[ix.rank_prefix_sum()] = expand ? s_pairs : num_tok_rows;
            layout[ix.num_tok_rows()] = num_tok_rows;
            layout[ix.num_out_rows()] = num_out_rows;
        }
    }
    // More rows than the outputs hold: refuse (kErrCapacity), every word defined (layout_impl).
    const bool overflow = ok && (num_out_rows > a.out_capacity || num_tok_rows > a.tok_capacity);
    if (overflow && tid == 0) comm::record_error(tr.local(), kErrCapacity, tr.rank, -1, kPhaseNotify);
    if (!ok || overflow) {
        __syncthreads();  // no thread still writes a word of the layout
        for (int i = tid; i < ix.size(); i += nthreads) layout[i] = 0;
    } else if (a.cumulative_stats != nullptr) {
        for (int e = tid; e < E; e += nthreads) a.cumulative_stats[e] += s_raw[e];
    }
}

// Every thread of the block that finished last (or of the only block, after layout_alone): what
// layout_impl reports after its layout, read back from the words layout_alone wrote.
__device__ __forceinline__ void layout_alone_report(const LayoutArgs& a, const comm::LsaTransport& tr) {
    const int E = a.num_experts;
    const LayoutIndex ix{1, E, E};
    const int* C = alone_counts(a, tr);
    const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
    const volatile uint32_t* err = comm::ctrl_of(tr.local()) + kCtrlError;
    // last_block's count has no acquire half: fence, then the block meets, before any thread reads
    // what the other blocks wrote (the layout block's words, every block's error record).
    if (tid == 0) __threadfence();
    __syncthreads();
    const int bad_index = __ldcg(C + 1 + E);  // -1: every id in range
    const bool bad = bad_index >= 0;
    if (a.host_out != nullptr) {
        // The host waits for these words (do_cpu_sync): counts first, the sequence number last.
        volatile int* out = a.host_out;
        for (int e = tid; e < E; e += nthreads) out[kReadbackCounts + e] = __ldcg(a.layout + ix.padded_counts() + e);
        if (tid == 0) {
            out[kReadbackStatus] = bad ? kErrBadExpert : static_cast<int>(err[0]);
            out[kReadbackRank] = bad ? tr.rank : static_cast<int>(err[1]);
            out[kReadbackPeer] = bad ? 0 : static_cast<int>(err[2]);  // the bad id's source: the one rank
            out[kReadbackDetail] = bad ? bad_index : static_cast<int>(err[3]);
            out[kReadbackValue] = bad ? __ldcg(C + 2 + E) : 0;
            out[kReadbackOutRows] = __ldcg(a.layout + ix.num_out_rows());
            out[kReadbackTokRows] = __ldcg(a.layout + ix.num_tok_rows());
        }
        __syncthreads();
        if (tid == 0) {
            __threadfence_system();
            out[kReadbackSeq] = a.seq;
            __threadfence_system();
        }
    } else if (bad && a.err_host != nullptr && tid == 0) {
        // No host sync: reported at the buffer's next call, from the mapped error record (code last).
        volatile uint32_t* dst = a.err_host;
        dst[1] = 0;  // the source rank
        dst[2] = bad_index;
        dst[3] = __ldcg(C + 2 + E);
        __threadfence_system();
        dst[0] = kErrBadExpert;
        __threadfence_system();
    }
    // As end_wait copies it, without the epoch's advance (nothing was waited for).
    if (tid == 0) comm::error_to_host(err, err[0], a.err_host);
}

// The end of the notify kernel of a rank alone, after notify_impl<..., true> (every block).
__device__ __forceinline__ void notify_alone_end(const LayoutArgs& a, bool expand, const comm::LsaTransport& tr,
                                                 int* scratch) {
    const bool single = gridDim.x == 1;
    if (blockIdx.x == gridDim.x - 1) layout_alone(a, expand, tr, scratch);
    if (single || comm::last_block(tr.local(), kCtrlDone, false)) layout_alone_report(a, tr);
}

}  // namespace deep_ep
