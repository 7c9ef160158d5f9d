// Notify stage of a dispatch: count what goes where and publish the counts in every peer's window.
//
// notify (grid: R rank-columns [+ E expert-columns when expanding]) on every source rank s:
//   rank-column d scans s's tokens in order and numbers those going to rank d (pos_tok[t, d]), and
//   counts s's (token, expert) pairs for each expert of d; expert-column g numbers the tokens
//   selecting expert g (pos_pair[t, k]). The counts row of s ([R] tokens per rank, [E] pairs per
//   expert) is written into counts[s] of every peer's window; the last block signals the peers.
#pragma once

#include "../comm/lsa.cuh"
#include "../common/grid.cuh"

namespace deep_ep {

template <int K, bool kExpand>
__device__ __forceinline__ void notify_impl(const int64_t* __restrict__ topk_idx, int num_tokens, int num_experts,
                                            int64_t counts_offset, int* __restrict__ pos_tok,
                                            int* __restrict__ pos_pair, const comm::LsaTransport& tr) {
    const int num_ranks = tr.num_ranks, rank = tr.rank;
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
        const int64_t my_row = counts_offset + static_cast<int64_t>(rank) * row * 4;
        for (int p = 0; p < num_ranks; ++p) {
            if (threadIdx.x == 0) tr.put<int>(p, my_row + 4 * column, total);
            for (int i = threadIdx.x; i < L; i += blockDim.x) tr.put<int>(p, my_row + 4 * (num_ranks + lo + i), pair_counts[i]);
        }
    }
    if (comm::last_block(tr.local())) tr.signal_all();
}

}  // namespace deep_ep
