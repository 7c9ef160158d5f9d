// Small arithmetic helpers and bf16 <-> fp32 conversions of 16-byte vectors.
#pragma once

#include "types.cuh"

namespace deep_ep {

template <typename T>
__host__ __device__ __forceinline__ T ceil_div(T a, T b) { return (a + b - 1) / b; }

__device__ __forceinline__ void bf16x8_to_f32(const int4& v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

// 8 fp32 values rounded to bf16 (round to nearest even) in one 16-byte vector.
__device__ __forceinline__ int4 f32_to_bf16x8(const float* f) {
    int4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
}

}  // namespace deep_ep
