// Warp-wide moves of a row of 16-byte vectors, chunk by chunk (the data path of every kernel).
#pragma once

#include "ptx.cuh"
#include "tunables.cuh"

namespace deep_ep {

// Vectors per lane per chunk for a row of kVecs 16-byte vectors: kTunable if not 0, else the fewest
// chunks of at most kMax, evened out (28 per lane, kMax 8: four chunks of 7, not 8 + 8 + 8 + 4).
template <int kVecs, int kTunable, int kMax>
__host__ __device__ constexpr int row_unroll() {
    constexpr int per_lane = (kVecs + 31) / 32;
    constexpr int chunks = (per_lane + kMax - 1) / kMax;
    return kTunable != 0 ? kTunable : (per_lane + chunks - 1) / chunks;
}

// A warp moves a row in chunks of 32 * kUnroll vectors, lane l the vectors base + u * 32 + l, all
// loads of a chunk issued before use. kCoherent: the row may have been written by another GPU or
// kernel (L1 bypassed); else the read-only path (ld_nc).
template <int kUnroll, int kVecs, bool kCoherent>
__device__ __forceinline__ void load_chunk(const int4* src, int base, int lane, int4 (&v)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < kVecs) v[u] = kCoherent ? __ldcg(src + i) : ld_nc(src + i);
    }
}

template <int kUnroll, int kVecs>
__device__ __forceinline__ void store_chunk(int4* dst, int base, int lane, const int4 (&v)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < kVecs) store_row_vec(dst + i, v[u]);
    }
}

// Every thread of the grid: copy num_bytes, kUnroll 16-byte loads in flight per thread where both
// ends are 16-byte aligned, else byte by byte (the primitives' copies: pipeline slots, AGRS rows).
template <int kUnroll>
__device__ __forceinline__ void grid_copy_bytes(uint8_t* dst, const uint8_t* src, int64_t num_bytes) {
    const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    int64_t done = 0;
    if (((reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src)) & 15u) == 0) {
        const int64_t num_vecs = num_bytes >> 4;
        const int4* src_vecs = reinterpret_cast<const int4*>(src);
        int4* dst_vecs = reinterpret_cast<int4*>(dst);
        for (int64_t base = thread; base < num_vecs; base += kUnroll * num_threads) {
            int4 values[kUnroll];
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) {
                const int64_t index = base + k * num_threads;
                if (index < num_vecs) values[k] = ld_cg(src_vecs + index);
            }
#pragma unroll
            for (int k = 0; k < kUnroll; ++k) {
                const int64_t index = base + k * num_threads;
                if (index < num_vecs) st_cg(dst_vecs + index, values[k]);
            }
        }
        done = num_vecs << 4;
    }
    for (int64_t index = done + thread; index < num_bytes; index += num_threads) dst[index] = __ldcg(src + index);
}

}  // namespace deep_ep
