// Warp-wide moves of a row of 16-byte vectors, chunk by chunk (the data path of every kernel).
#pragma once

#include "ptx.cuh"

namespace deep_ep {

// ---- tunables (defaults; tools/tune_gpu.py builds variants) ------------------------------------
// 16-byte vectors per lane per chunk when moving a dispatched row (at most; 8 = 4 KiB per warp),
// and the same for the rows a combine sums (fp32 accumulators: 8 per vector). 0 = balanced: the
// fewest chunks of at most 8 vectors (combine: 7, or 4 where more would spill registers, see
// impls/combine_recv.cuh; a token with one source row and no bias: EP_COMBINE_SINGLE_UNROLL below),
// all of equal size (see row_unroll).
#ifndef EP_SEND_UNROLL
#define EP_SEND_UNROLL 0
#endif
#ifndef EP_COMBINE_UNROLL
#define EP_COMBINE_UNROLL 0
#endif
// 1: combine finds a token's contributing sources once per token (impls/combine_recv.cuh), and each
// chunk walks only those; 0: each chunk walks all top-k slots. The same sums in the same order.
#ifndef EP_COMBINE_COMPACT
#define EP_COMBINE_COMPACT 1
#endif
// With EP_COMBINE_COMPACT: vectors per lane per chunk (at most; evened out) for a token whose sum
// has one source row and no biases, which needs no accumulators across sources, so more of its
// loads can be in flight at once; 0 = such tokens take the path of every token. 8 (the default)
// measured on the H200 at EP=1: hidden 4096 22.4 -> 21.6 us per 4096 tokens (chunks of 8, not 4),
// hidden 7168 unchanged (chunks of 7 either way; 14 was no faster).
#ifndef EP_COMBINE_SINGLE_UNROLL
#define EP_COMBINE_SINGLE_UNROLL 8
#endif

// Vectors per lane per chunk for a row of kVecs 16-byte vectors: kTunable if it is not 0, else
// the fewest chunks of at most kMax each, evened out (e.g. 28 vectors per lane and kMax 8: four
// chunks of 7 rather than 8 + 8 + 8 + 4).
template <int kVecs, int kTunable, int kMax>
__host__ __device__ constexpr int row_unroll() {
    constexpr int per_lane = (kVecs + 31) / 32;
    constexpr int chunks = (per_lane + kMax - 1) / kMax;
    return kTunable != 0 ? kTunable : (per_lane + chunks - 1) / chunks;
}

// A warp moves a row of kVecs 16-byte vectors in chunks of 32 * kUnroll vectors: lane l handles
// vectors base + u * 32 + l (u < kUnroll) that exist. Loads of a chunk are all issued before use.
// kCoherent: the row may have been written by another GPU or kernel (L1 bypassed), else the
// read-only path (ld_nc, tunable EP_LOAD_NO_L1).
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

}  // namespace deep_ep
