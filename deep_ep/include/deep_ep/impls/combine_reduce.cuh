// The arithmetic of combine: the order of fp32 additions a token's result depends on, bit for bit
// that of deep_ep.reference (DeepEP V2's):
//   acc = fp32(bias 0) + fp32(bias 1)            (or fp32(bias 0), or +0.0 without biases);
//   for each top-k slot k in order: if k is the last slot of its rank d, acc += fp32(partial of d),
//   where a rank's partial is its row (non-expanded) or bf16(the fp32 sum, from +0.0, of its slots'
//   rows in slot order) (expanded); a slot that contributes nothing adds +0.0;
//   result = bf16(acc), rounded to nearest even.
// Adding +0.0 only changes a running -0.0, and a running value that is not -0.0 never becomes -0.0
// again, so the kernels add it once, at the end, when any slot was silent. Weighted rows add the
// product rounded to fp32: no fused multiply-add, which would round once instead of twice.
#pragma once

#include "../common/copy.cuh"
#include "../common/math.cuh"
#include "combine_args.cuh"

namespace deep_ep {

template <int kUnroll>
__device__ __forceinline__ void add_bf16_chunk(const int4 (&v)[kUnroll], float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        float f[8];
        bf16x8_to_f32(v[u], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = __fadd_rn(acc[u][q], f[q]);
    }
}

// acc[u][q] += w * value, the product rounded first.
template <int kUnroll>
__device__ __forceinline__ void add_weighted_bf16_chunk(const int4 (&v)[kUnroll], float w, float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        float f[8];
        bf16x8_to_f32(v[u], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = __fadd_rn(acc[u][q], __fmul_rn(w, f[q]));
    }
}

template <int kUnroll>
__device__ __forceinline__ void zero_chunk(float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = 0.0f;
}

// acc += fp32(bf16(part)): a partial rounded to bf16, as it would travel, then added.
template <int kUnroll>
__device__ __forceinline__ void add_rounded_chunk(const float (&part)[kUnroll][8], float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        float f[8];
        bf16x8_to_f32(f32_to_bf16x8(part[u]), f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = __fadd_rn(acc[u][q], f[q]);
    }
}

// acc = the biases' fp32 sum for token t (chunk ``base`` of its row), or +0.0.
template <int kHidden, int kUnroll, int kVecs>
__device__ __forceinline__ void init_from_biases(const CombineArgs& a, int t, int base, int lane, float (&acc)[kUnroll][8]) {
    const __nv_bfloat16* b0 = a.bias0;
    // Which biases exist is fixed for the call: one test per chunk, not per value. A single bias is
    // fp32(it), whichever of the two it is.
    const __nv_bfloat16* first = b0 != nullptr ? b0 : a.bias1;
    const __nv_bfloat16* second = b0 != nullptr ? a.bias1 : nullptr;
    zero_chunk(acc);
    if (first == nullptr) return;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kVecs) continue;
        bf16x8_to_f32(ld_nc(reinterpret_cast<const int4*>(first + static_cast<int64_t>(t) * kHidden) + i), acc[u]);
        if (second != nullptr) {
            float f[8];
            bf16x8_to_f32(ld_nc(reinterpret_cast<const int4*>(second + static_cast<int64_t>(t) * kHidden) + i), f);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = __fadd_rn(acc[u][q], f[q]);
        }
    }
}

// The end of a token's sum, chunk by chunk: the +0.0 of silent slots, then the row rounded to bf16.
template <int kHidden, int kUnroll, int kVecs>
__device__ __forceinline__ void finish_and_store(const CombineArgs& a, int t, int base, int lane, bool silent_slot,
                                                 float (&acc)[kUnroll][8]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kVecs) continue;
        if (silent_slot)
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = __fadd_rn(acc[u][q], 0.0f);
        store_row_vec(reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * kHidden) + i, f32_to_bf16x8(acc[u]));
    }
}

// A token with one source row and no biases (chunk ``base``, loaded in v): per value the additions of
// the general path (+0.0, the value, the +0.0 of silent slots), one vector at a time, so that only
// the chunk's loads occupy registers across it.
template <int kHidden, int kUnroll, int kVecs>
__device__ __forceinline__ void store_single_source_chunk(const CombineArgs& a, int t, int base, int lane, bool silent_slot,
                                                          const int4 (&v)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= kVecs) continue;
        float f[8];
        bf16x8_to_f32(v[u], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            f[q] = __fadd_rn(0.0f, f[q]);
            if (silent_slot) f[q] = __fadd_rn(f[q], 0.0f);
        }
        store_row_vec(reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * kHidden) + i, f32_to_bf16x8(f));
    }
}

}  // namespace deep_ep
