// The arithmetic of combine: how a token's rows are summed, in fp32, and rounded once to bf16.
// Summation order (what the results' bits depend on): the rows of destination ranks d = 0, 1, ...
// in order, then bias 0, then bias 1; expanded rows are staged by each destination as the fp32 sum
// of its weighted pairs.
#pragma once

#include "../common/copy.cuh"
#include "../common/math.cuh"
#include "combine_args.cuh"

namespace deep_ep {

// acc[u][q] += the 8 bf16 values of v[u] (fp32, in this order: the reference's summation).
template <int kUnroll>
__device__ __forceinline__ void add_bf16_chunk(const int4 (&v)[kUnroll], float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        float f[8];
        bf16x8_to_f32(v[u], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] += f[q];
    }
}

// acc[u][q] += fp32 staged values (an expanded destination's partial sum: 8 floats per vector).
template <int kUnroll>
__device__ __forceinline__ void add_f32_chunk(const float4 (&lo)[kUnroll], const float4 (&hi)[kUnroll], float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        acc[u][0] += lo[u].x; acc[u][1] += lo[u].y; acc[u][2] += lo[u].z; acc[u][3] += lo[u].w;
        acc[u][4] += hi[u].x; acc[u][5] += hi[u].y; acc[u][6] += hi[u].z; acc[u][7] += hi[u].w;
    }
}

// acc[u][q] = fma(w, bf16 value, acc[u][q]): a weighted expanded row.
template <int kUnroll>
__device__ __forceinline__ void add_weighted_bf16_chunk(const int4 (&v)[kUnroll], float w, float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        float f[8];
        bf16x8_to_f32(v[u], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = fmaf(w, f[q], acc[u][q]);
    }
}

// The end of a token's sum, chunk by chunk: add bias 0 and bias 1 (when given) in fp32 and store the
// row rounded to bf16.
template <int kHidden, int kUnroll, int kVecs>
__device__ __forceinline__ void add_biases_and_store(const CombineArgs& a, int t, int base, int lane, float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kVecs) continue;
        float f[8];
        if (a.bias0 != nullptr && EP_TEST_DEFECT != kDefectMissingBias) {
            bf16x8_to_f32(ld_nc(reinterpret_cast<const int4*>(a.bias0 + static_cast<int64_t>(t) * kHidden) + i), f);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] += f[q];
        }
        if (a.bias1 != nullptr) {
            bf16x8_to_f32(ld_nc(reinterpret_cast<const int4*>(a.bias1 + static_cast<int64_t>(t) * kHidden) + i), f);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] += f[q];
        }
        store_row_vec(reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * kHidden) + i, f32_to_bf16x8(acc[u]));
    }
}

}  // namespace deep_ep
