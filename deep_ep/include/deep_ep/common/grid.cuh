// How a kernel's threads share work: warps striding over items, and block-wide prefix sums.
#pragma once

#include "ptx.cuh"

namespace deep_ep {

// Lane, global warp index and warp count of a kernel whose warps stride over work items. Warp
// indices go round the blocks first (warp w of block b is w * gridDim + b): a small batch (decode,
// fewer items than warps) is spread over every SM instead of filling the first few blocks.
struct WarpGrid {
    int lane, warp, num_warps;
    __device__ __forceinline__ WarpGrid()
        : lane(static_cast<int>(threadIdx.x & 31)),
          warp(static_cast<int>((threadIdx.x >> 5) * gridDim.x + blockIdx.x)),
          num_warps(static_cast<int>(gridDim.x * (blockDim.x >> 5))) {}
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

// A barrier across every block of the grid; all of them must be resident at once (a cooperative
// launch, or a grid the host keeps small enough). ``count`` and ``generation`` are two int32 words
// of global memory, zero at first use and left ready for the next barrier. Returns false (in every
// thread of the block) when the other blocks did not all arrive within ``timeout_ns``.
__device__ __forceinline__ bool grid_barrier(int* count, int* generation, uint64_t timeout_ns) {
    __shared__ int arrived;
    __syncthreads();
    if (threadIdx.x == 0) {
        arrived = 1;
        const uint32_t gen = ld_volatile(reinterpret_cast<const uint32_t*>(generation));
        __threadfence();  // this block's writes before its arrival
        if (atomicAdd(count, 1) == static_cast<int>(gridDim.x) - 1) {
            atomicExch(count, 0);          // reset before anyone can leave and arrive again
            __threadfence();
            atomicAdd(generation, 1);
        } else {
            const uint64_t start = global_timer_ns();
            while (ld_volatile(reinterpret_cast<const uint32_t*>(generation)) == gen) {
                if (global_timer_ns() - start > timeout_ns) { arrived = 0; break; }
            }
        }
        __threadfence();  // the other blocks' writes before theirs
    }
    __syncthreads();
    return arrived != 0;
}

}  // namespace deep_ep
