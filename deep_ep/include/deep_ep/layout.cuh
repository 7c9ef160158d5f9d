// Layout ("notify") stage of a dispatch: count what goes where, exchange the counts with every peer,
// and derive the receive layout, the send offsets and the handle's metadata.
//
// notify_kernel (grid: R rank-columns [+ E expert-columns when expanding]) on every source rank s:
//   rank-column d scans s's tokens in order and numbers those going to rank d (pos_tok[t, d]), and
//   counts s's (token, expert) pairs for each expert of d; expert-column g numbers the tokens
//   selecting expert g (pos_pair[t, k]). The counts row of s ([R] tokens per rank, [E] pairs per
//   expert) is written into counts[s] of every peer's window; the last block signals the peers.
// layout_kernel (one block) waits for every peer's counts and computes, from the full count matrix,
//   this rank's receive layout and, as a source, where its rows start at every destination.
#pragma once

#include "common.cuh"

namespace deep_ep {

// Offsets (int32 words) inside a handle's layout tensor.
struct LayoutIndex {
    int R, L, E;
    __host__ __device__ int num_out_rows() const { return 0; }
    __host__ __device__ int num_tok_rows() const { return 1; }
    __host__ __device__ int tok_prefix() const { return 2; }                     // [R] inclusive, token rows per source
    __host__ __device__ int rank_prefix_sum() const { return 2 + R; }            // [R] inclusive (design.md)
    __host__ __device__ int raw_counts() const { return 2 + 2 * R; }             // [L] pairs per local expert
    __host__ __device__ int padded_counts() const { return 2 + 2 * R + L; }      // [L] padded to the alignment
    __host__ __device__ int expert_start() const { return 2 + 2 * R + 2 * L; }   // [L] first output row of each expert
    __host__ __device__ int send_base() const { return 2 + 2 * R + 3 * L; }      // [R] first token row at each destination
    __host__ __device__ int out_base() const { return 2 + 3 * R + 3 * L; }       // [E] first output row per global expert
    __host__ __device__ int size() const { return 2 + 3 * R + 3 * L + E; }
};

// Exclusive scan of one int per thread across the block; returns the block total in *total.
__device__ __forceinline__ int block_exclusive_scan(int v, int* total) {
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int w = lane < num_warps ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int warp_prefix = warp == 0 ? 0 : warp_sums[warp - 1];
    *total = warp_sums[num_warps - 1];
    __syncthreads();
    return warp_prefix + inc - v;
}

template <int K, bool kExpand>
__device__ __forceinline__ void notify_impl(const int64_t* __restrict__ topk_idx, int num_tokens, int num_experts,
                                            int num_ranks, int rank, uint8_t* const* __restrict__ peers,
                                            int64_t counts_offset, int* __restrict__ pos_tok,
                                            int* __restrict__ pos_pair) {
    const int L = num_experts / num_ranks;
    const int column = blockIdx.x;
    const bool is_rank_column = column < num_ranks;
    const int lo = is_rank_column ? column * L : column - num_ranks;   // first expert of the column
    const int hi = is_rank_column ? lo + L : lo + 1;

    extern __shared__ int pair_counts[];  // [L] for a rank column
    if (is_rank_column)
        for (int i = threadIdx.x; i < L; i += blockDim.x) pair_counts[i] = 0;
    __syncthreads();

    // Each thread owns a contiguous chunk of tokens, so numbering follows token order.
    const int chunk = (num_tokens + blockDim.x - 1) / blockDim.x;
    const int t0 = min(num_tokens, static_cast<int>(threadIdx.x) * chunk), t1 = min(num_tokens, t0 + chunk);
    // A rank column numbers tokens (a token goes to a rank once); an expert column numbers pairs
    // (a token that picks the same expert twice makes two pairs, in k order, as the reference does).
    int mine = 0;
    for (int t = t0; t < t1; ++t) {
        int matches = 0;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t e = topk_idx[static_cast<int64_t>(t) * K + k];
            if (e >= lo && e < hi) {
                ++matches;
                if (is_rank_column) atomicAdd(&pair_counts[e - lo], 1);
            }
        }
        mine += is_rank_column ? (matches > 0) : matches;
    }
    int total;
    int pos = block_exclusive_scan(mine, &total);
    for (int t = t0; t < t1; ++t) {
        if (is_rank_column) {
            bool hit = false;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int64_t e = topk_idx[static_cast<int64_t>(t) * K + k];
                hit |= (e >= lo && e < hi);
            }
            pos_tok[static_cast<int64_t>(t) * num_ranks + column] = hit ? pos : -1;
            pos += hit;
        } else if (kExpand) {
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (topk_idx[static_cast<int64_t>(t) * K + k] == lo) pos_pair[static_cast<int64_t>(t) * K + k] = pos++;
        }
    }
    if (kExpand && !is_rank_column) {
        // Masked (-1) and out-of-range slots get -1 once, from the first expert column.
        if (column == num_ranks)
            for (int t = threadIdx.x; t < num_tokens; t += blockDim.x)
#pragma unroll
                for (int k = 0; k < K; ++k)
                    if (topk_idx[static_cast<int64_t>(t) * K + k] < 0 || topk_idx[static_cast<int64_t>(t) * K + k] >= num_experts) pos_pair[static_cast<int64_t>(t) * K + k] = -1;
    }
    __syncthreads();

    // Publish this column's counts in counts[rank] of every peer.
    if (is_rank_column) {
        const int row = num_ranks + num_experts;
        for (int p = 0; p < num_ranks; ++p) {
            int* dst = reinterpret_cast<int*>(peers[p] + counts_offset) + static_cast<int64_t>(rank) * row;
            if (threadIdx.x == 0) dst[column] = total;
            for (int i = threadIdx.x; i < L; i += blockDim.x) dst[num_ranks + lo + i] = pair_counts[i];
        }
    }
    if (last_block(peers[rank])) signal_all_peers(peers, rank, num_ranks);
}

// Prefix sums of vals[0, n) in shared memory, in place, any n (chunks of blockDim with a carry);
// inclusive or exclusive. Returns the total. Every thread of the block must call it.
__device__ __forceinline__ int block_scan_in_place(int* vals, int n, bool inclusive) {
    int carry = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + static_cast<int>(threadIdx.x);
        const int v = i < n ? vals[i] : 0;
        int total;
        const int ex = block_exclusive_scan(v, &total);
        if (i < n) vals[i] = carry + ex + (inclusive ? v : 0);
        carry += total;
    }
    __syncthreads();
    return carry;
}

// One block. counts matrix C[s][R + E] (int32) sits at counts_offset of this rank's window.
// Every sum over the matrix is spread over the block's threads (shared-memory atomics, then block
// scans): a single thread walking the matrix costs one L2 round trip per entry (~90 us at E = 256).
__device__ __forceinline__ void layout_impl(uint8_t* const* __restrict__ peers, int rank, int num_ranks,
                                            int num_experts, int alignment, int64_t counts_offset,
                                            bool expand, int* __restrict__ layout,
                                            int* __restrict__ cumulative_stats, int out_capacity,
                                            int tok_capacity, uint64_t timeout_ns) {
    __shared__ int s_tok[kMaxRanks];       // tokens from each source -> inclusive prefix
    __shared__ int s_pairs[kMaxRanks];     // pairs for this rank's experts from each source -> inclusive prefix
    __shared__ int s_send[kMaxRanks];      // this rank's first token row at each destination
    __shared__ int s_local[kMaxExperts];   // pairs per local expert -> padded -> exclusive prefix
    __shared__ int s_global[kMaxExperts];  // expanded: pairs per global expert -> padded -> exclusive prefix
    __shared__ int s_before[kMaxExperts];  // expanded: pairs per global expert from sources before this rank
    uint8_t* my_window = peers[rank];
    const bool ok = wait_all_peers(my_window, rank, num_ranks, kPhaseNotify, timeout_ns);
    const int R = num_ranks, E = num_experts, L = E / R;
    const LayoutIndex ix{R, L, E};
    const int row = R + E;
    const int* C = reinterpret_cast<const int*>(my_window + counts_offset);
    const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
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
            if (cumulative_stats != nullptr) cumulative_stats[e] += raw;
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
        for (int e = tid; e < L; e += nthreads) layout[ix.expert_start() + e] = s_local[e];
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
    // More rows than the outputs allocated for the worst case hold (a peer used a larger
    // num_max_tokens_per_rank): refuse rather than write past them.
    const bool overflow = ok && (layout[ix.num_out_rows()] > out_capacity || layout[ix.num_tok_rows()] > tok_capacity);
    if (overflow && threadIdx.x == 0) record_error(my_window, kErrCapacity, rank, -1, kPhaseNotify);
    if (!ok || overflow) {
        // Every word defined (no rows, zero offsets), so that kernels launched after this one
        // (without a host check in between) index nothing out of bounds.
        __syncthreads();
        for (int i = threadIdx.x; i < ix.size(); i += blockDim.x) layout[i] = 0;
    }
    finish_wait(my_window, false);
}

}  // namespace deep_ep
