// Small arithmetic helpers and bf16 <-> fp32 conversions of 16-byte vectors.
#pragma once

#include "types.cuh"

namespace deep_ep {

template <typename T>
__host__ __device__ __forceinline__ T ceil_div(T a, T b) { return (a + b - 1) / b; }

// Build-time tunable (tools/tune_gpu.py): how bf16 values are widened to fp32. A bf16 is the top
// half of the fp32 of the same value (NaN payloads included), so a widening is a move of bits:
// __bfloat1622float2 (cvt.f32.bf16) costs ptxas three integer instructions per pair on sm_90 (a
// byte permute splits the pair, then one shift each); stating the moves, w << 16 and
// w & 0xffff0000, costs two. 0: the intrinsic everywhere; 1: the moves in the single-source chunks
// of combine (impls/combine_reduce.cuh) only; 2: everywhere, which at hidden 7168 spills 16 bytes in
// the sum of several sources (chunks of 7 vectors: the cheaper widenings are scheduled earlier and
// hold more registers).
#ifndef EP_BF16_SHIFT
#define EP_BF16_SHIFT 0
#endif

// The 8 bf16 values of a 16-byte vector as fp32, in order, by moving their bits.
__device__ __forceinline__ void bf16x8_to_f32_by_shifts(const int4& v, float* f) {
    const unsigned w[4] = {static_cast<unsigned>(v.x), static_cast<unsigned>(v.y), static_cast<unsigned>(v.z),
                           static_cast<unsigned>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);              // the low half: the first value
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);  // the high half: the second
    }
}

// The 8 bf16 values of a 16-byte vector as fp32, in order.
__device__ __forceinline__ void bf16x8_to_f32(const int4& v, float* f) {
#if EP_BF16_SHIFT >= 2
    bf16x8_to_f32_by_shifts(v, f);
#else
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
#endif
}

// The two bf16 values of w, each x * 1.0 + (+0.0) in bf16 (one rounding, of an exact result):
// x, but +0.0 for -0.0 and the canonical NaN for a NaN.
__device__ __forceinline__ int bf16x2_plus_zero(int w) {
    int r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(w), "r"(0x3f803f80), "r"(0));
    return r;
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
