// Layout stage of a dispatch (one block: the notify kernel's last, kernels/dispatch.cuh): wait for
// every peer's counts and derive, from the full count matrix, this rank's receive layout and, as a
// source, where its rows start at every destination (the handle's layout words, common/abi.cuh).
#pragma once

#include "../comm/lsa.cuh"
#include "../common/grid.cuh"

namespace deep_ep {

// Every sum over the count matrix C[s][R + E] is spread over the block's threads (shared-memory
// atomics, then block scans): a single thread walking it would pay one L2 round trip per entry.
struct LayoutArgs {
    int num_experts, alignment;
    int64_t counts_offset;      // byte offset of the count matrix in every window
    int* layout;                // out: the handle's layout words (common/abi.cuh)
    int* cumulative_stats;      // [L] incremented by the received pairs, or null
    int out_capacity, tok_capacity;  // rows the outputs hold (do_cpu_sync=False: the worst case)
    uint64_t timeout_ns;
    int* host_out;              // mapped host memory for the kReadback* words, or null (no host sync)
    int seq;                    // this call's readback sequence number, written last to host_out
    uint32_t* err_host;         // mapped host error record (an out-of-range expert id is reported there)
    comm::CallTag tag;          // this call's number and fingerprint, compared with every peer's
};

// The first source whose notify found an out-of-range expert id (-1: none), with its index and id.
__device__ __forceinline__ int first_bad_source(const int* C, int R, int row, int cols, int& index, int& value) {
    __shared__ int s_bad;
    if (threadIdx.x == 0) s_bad = 0x7fffffff;
    __syncthreads();
    for (int s = threadIdx.x; s < R; s += blockDim.x)
        if (__ldcg(C + s * row + cols) >= 0) atomicMin(&s_bad, s);
    __syncthreads();
    const int src = s_bad == 0x7fffffff ? -1 : s_bad;
    index = src >= 0 ? __ldcg(C + src * row + cols) : -1;
    value = src >= 0 ? __ldcg(C + src * row + cols + 1) : 0;
    return src;
}

// ``scratch``: 3 R + L + 2 E ints of shared memory that no other thread of the block uses any more.
// `Transport`: the notify stage's (impls/notify.cuh).
template <typename Transport>
__device__ __forceinline__ void layout_impl(const LayoutArgs& a, bool expand, const Transport& tr, int* scratch) {
    const int rank = tr.rank, num_ranks = tr.num_ranks, num_experts = a.num_experts, alignment = a.alignment;
    int* __restrict__ layout = a.layout;
    int* __restrict__ cumulative_stats = a.cumulative_stats;
    int* s_tok = scratch;                        // [R] tokens from each source -> inclusive prefix
    int* s_pairs = s_tok + num_ranks;            // [R] pairs for this rank's experts from each source -> inclusive prefix
    int* s_send = s_pairs + num_ranks;           // [R] this rank's first token row at each destination
    int* s_local = s_send + num_ranks;           // [L] pairs per local expert -> padded -> exclusive prefix
    int* s_global = s_local + num_experts / num_ranks;  // [E] expanded: pairs per global expert -> padded -> exclusive prefix
    int* s_before = s_global + num_experts;      // [E] expanded: pairs per global expert from sources before this rank
    uint8_t* my_window = tr.local();
    // A peer at another call, or disagreeing on this one: recorded as an error on every rank (each
    // sees a differing tag), nothing moves, and the buffer is no longer usable.
    const bool arrived = tr.wait_all(kPhaseNotify, a.timeout_ns) && comm::check_tags(my_window, rank, num_ranks, a.tag);
    const int R = num_ranks, E = num_experts, L = E / R;
    const LayoutIndex ix{R, L, E};
    const int row = R + E + kCountsExtraWords;
    const int* C = reinterpret_cast<const int*>(my_window + a.counts_offset);
    const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
    // Every rank sees the same count matrix, so every rank finds the same bad source and voids the
    // call: nothing moves anywhere, the epochs stay in step, and the buffer remains usable.
    int bad_index = -1, bad_value = 0;
    const int bad_src = arrived ? first_bad_source(C, R, row, R + E, bad_index, bad_value) : -1;
    const bool ok = arrived && bad_src < 0;
    if (ok) {
        for (int s = tid; s < R; s += nthreads) {
            s_tok[s] = __ldcg(C + s * row + rank);
            s_pairs[s] = 0;
            s_send[s] = 0;
        }
        for (int e = tid; e < L; e += nthreads) s_local[e] = 0;
        if (expand)
            for (int g = tid; g < E; g += nthreads) s_global[g] = s_before[g] = 0;
        __syncthreads();
        for (int i = tid; i < R * L; i += nthreads) {
            const int s = i / L, e = i - s * L;
            const int c = __ldcg(C + s * row + R + rank * L + e);
            if (c != 0) {
                atomicAdd(&s_local[e], c);
                atomicAdd(&s_pairs[s], c);
            }
        }
        for (int i = tid; i < rank * R; i += nthreads) {  // sources before this rank, every destination
            const int s = i / R, d = i - s * R;
            const int c = __ldcg(C + s * row + d);
            if (c != 0) atomicAdd(&s_send[d], c);
        }
        if (expand) {
            for (int i = tid; i < R * E; i += nthreads) {
                const int s = i / E, g = i - s * E;
                const int c = __ldcg(C + s * row + R + g);
                if (c != 0) {
                    atomicAdd(&s_global[g], c);
                    if (s < rank) atomicAdd(&s_before[g], c);
                }
            }
        }
        __syncthreads();
        for (int e = tid; e < L; e += nthreads) {
            const int raw = s_local[e];
            const int padded = (raw + alignment - 1) / alignment * alignment;
            layout[ix.raw_counts() + e] = raw;
            layout[ix.padded_counts() + e] = padded;
            s_local[e] = padded;
        }
        for (int d = tid; d < R; d += nthreads) layout[ix.send_base() + d] = s_send[d];
        if (expand)
            for (int g = tid; g < E; g += nthreads) s_global[g] = (s_global[g] + alignment - 1) / alignment * alignment;
        __syncthreads();
        const int num_tok_rows = block_scan_in_place(s_tok, R, true);
        block_scan_in_place(s_pairs, R, true);
        const int num_out_rows = block_scan_in_place(s_local, L, false);
        if (expand) block_scan_in_place(s_global, E, false);
        for (int s = tid; s < R; s += nthreads) {
            layout[ix.tok_prefix() + s] = s_tok[s];
            layout[ix.rank_prefix_sum() + s] = expand ? s_pairs[s] : s_tok[s];
        }
        for (int e = tid; e < L; e += nthreads) {
            layout[ix.expert_start() + e] = s_local[e];
            // non-expanded: inclusive prefix of the padded counts; expanded: start plus unpadded count
            layout[ix.psum_expert() + e] = s_local[e] + (expand ? layout[ix.raw_counts() + e] : layout[ix.padded_counts() + e]);
        }
        // Expanded: first output row of this source's pairs for every global expert g (owner d).
        if (expand)
            for (int g = tid; g < E; g += nthreads) {
                const int d = g / L;
                layout[ix.out_base() + g] = s_global[g] - s_global[d * L] + s_before[g];
            }
        if (tid == 0) {
            layout[ix.num_tok_rows()] = num_tok_rows;
            layout[ix.num_out_rows()] = expand ? num_out_rows : num_tok_rows;
        }
    }
    __syncthreads();
    // More rows than the outputs hold (a peer used a larger num_max_tokens_per_rank): refuse rather
    // than write past them.
    const bool overflow = ok && (layout[ix.num_out_rows()] > a.out_capacity || layout[ix.num_tok_rows()] > a.tok_capacity);
    if (overflow && threadIdx.x == 0) comm::record_error(my_window, kErrCapacity, rank, -1, kPhaseNotify);
    if (!ok || overflow) {
        // Every word defined, so that kernels launched without a host check index nothing out of bounds.
        __syncthreads();
        for (int i = threadIdx.x; i < ix.size(); i += blockDim.x) layout[i] = 0;
    }
    __syncthreads();
    // Only a call that moves its rows counts them (a voided or refused one leaves the stats alone).
    if (ok && !overflow && cumulative_stats != nullptr)
        for (int e = tid; e < L; e += nthreads) cumulative_stats[e] += layout[ix.raw_counts() + e];
    if (a.host_out != nullptr) {
        // The host waits for these words (do_cpu_sync): counts first, the sequence number last.
        volatile int* out = a.host_out;
        for (int e = tid; e < L; e += nthreads) out[kReadbackCounts + e] = layout[ix.padded_counts() + e];
        if (tid == 0) {
            const volatile uint32_t* err = comm::ctrl_of(my_window) + kCtrlError;
            out[kReadbackStatus] = bad_src >= 0 ? kErrBadExpert : static_cast<int>(err[0]);
            out[kReadbackRank] = bad_src >= 0 ? rank : static_cast<int>(err[1]);
            out[kReadbackPeer] = bad_src >= 0 ? bad_src : static_cast<int>(err[2]);
            out[kReadbackDetail] = bad_src >= 0 ? bad_index : static_cast<int>(err[3]);
            out[kReadbackValue] = bad_value;
            out[kReadbackOutRows] = layout[ix.num_out_rows()];
            out[kReadbackTokRows] = layout[ix.num_tok_rows()];
        }
        __syncthreads();
        if (tid == 0) {
            __threadfence_system();
            out[kReadbackSeq] = a.seq;
            __threadfence_system();
        }
    } else if (bad_src >= 0 && a.err_host != nullptr && tid == 0) {
        // No host sync: reported at the buffer's next call, from the mapped error record (code last).
        volatile uint32_t* dst = a.err_host;
        dst[1] = bad_src;
        dst[2] = bad_index;
        dst[3] = bad_value;
        __threadfence_system();
        dst[0] = kErrBadExpert;
        __threadfence_system();
    }
    // Copy the error record to the host here too: a rank alone has no data-kernel wait that would.
    comm::finish_wait_one_block(my_window, false, a.err_host);
}

}  // namespace deep_ep
