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

// One block. counts matrix C[s][R + E] (int32) sits at counts_offset of this rank's window.
__device__ __forceinline__ void layout_impl(uint8_t* const* __restrict__ peers, int rank, int num_ranks,
                                            int num_experts, int alignment, int64_t counts_offset,
                                            bool expand, int* __restrict__ layout,
                                            int* __restrict__ cumulative_stats, int out_capacity,
                                            int tok_capacity, uint64_t timeout_ns) {
    uint8_t* my_window = peers[rank];
    const bool ok = wait_all_peers(my_window, rank, num_ranks, kPhaseNotify, timeout_ns);
    const int R = num_ranks, E = num_experts, L = E / R;
    const LayoutIndex ix{R, L, E};
    const int row = R + E;
    const int* C = reinterpret_cast<const int*>(my_window + counts_offset);
    if (ok) {
        // Per-source quantities for this rank as destination (thread 0: R and L are small).
        if (threadIdx.x == 0) {
            int tok = 0, pairs = 0;
            for (int s = 0; s < R; ++s) {
                tok += __ldcg(C + s * row + rank);
                layout[ix.tok_prefix() + s] = tok;
                for (int e = 0; e < L; ++e) pairs += __ldcg(C + s * row + R + rank * L + e);
                layout[ix.rank_prefix_sum() + s] = expand ? pairs : tok;
            }
            layout[ix.num_tok_rows()] = tok;
            int start = 0;
            for (int e = 0; e < L; ++e) {
                int raw = 0;
                for (int s = 0; s < R; ++s) raw += __ldcg(C + s * row + R + rank * L + e);
                const int padded = (raw + alignment - 1) / alignment * alignment;
                layout[ix.raw_counts() + e] = raw;
                layout[ix.padded_counts() + e] = padded;
                layout[ix.expert_start() + e] = start;
                start += padded;
                if (cumulative_stats != nullptr) cumulative_stats[e] += raw;
            }
            layout[ix.num_out_rows()] = expand ? start : tok;
        }
        // This rank as a source: first token row at each destination.
        for (int d = threadIdx.x; d < R; d += blockDim.x) {
            int base = 0;
            for (int s = 0; s < rank; ++s) base += __ldcg(C + s * row + d);
            layout[ix.send_base() + d] = base;
        }
        // Expanded: first output row of this source's pairs for every global expert g (owner d).
        if (expand) {
            for (int d = threadIdx.x; d < R; d += blockDim.x) {
                int start = 0;
                for (int e = 0; e < L; ++e) {
                    const int g = d * L + e;
                    int raw = 0, before = 0;
                    for (int s = 0; s < R; ++s) {
                        const int c = __ldcg(C + s * row + R + g);
                        raw += c;
                        if (s < rank) before += c;
                    }
                    layout[ix.out_base() + g] = start + before;
                    start += (raw + alignment - 1) / alignment * alignment;
                }
            }
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
