// The sum a reduce-scatter's handle makes of the chunks it received (host: deep_ep/backends/gpu/agrs_reduce.py),
// bit for bit as the CPU backend's torch formula: per element, acc = float(chunk 0); for ranks 1 .. R-1
// in order, acc = acc + float(chunk r), each sum rounded to float32; with `average`, acc = acc / R (a true
// division); then one rounding to the output dtype (bf16: nearest-even, NaN as torch's 0x7FC0).
// Reads only local memory (the received chunks in this rank's window); the host reads these constants.
#pragma once

#include "../common/types.cuh"

namespace deep_ep {

constexpr int kAgrsReduceThreads = 256;
constexpr int kAgrsReduceVectorBytes = 16;   // one 16-byte load per rank and thread when aligned

__device__ __forceinline__ float agrs_reduce_load(const __nv_bfloat16& value) { return __bfloat162float(value); }
__device__ __forceinline__ float agrs_reduce_load(const float& value) { return value; }

__device__ __forceinline__ void agrs_reduce_store(float value, float& out) { out = value; }
__device__ __forceinline__ void agrs_reduce_store(float value, __nv_bfloat16& out) {
    if (value != value) {   // torch rounds every NaN to the one quiet NaN 0x7FC0
        *reinterpret_cast<uint16_t*>(&out) = 0x7FC0;
        return;
    }
    out = __float2bfloat16_rn(value);
}

// `Pack` elements of type T per thread and step: a uint4 of them (16 bytes) or one element.
template <typename T, typename Pack>
__device__ __forceinline__ void agrs_reduce_impl(const Pack* __restrict__ received, Pack* __restrict__ out,
                                                 int64_t num_packs, int num_ranks, bool average) {
    constexpr int per_pack = sizeof(Pack) / sizeof(T);
    const float divisor = static_cast<float>(num_ranks);
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < num_packs;
         index += stride) {
        float acc[per_pack];
        Pack packed = received[index];
        const T* values = reinterpret_cast<const T*>(&packed);
#pragma unroll
        for (int i = 0; i < per_pack; ++i)
            acc[i] = agrs_reduce_load(values[i]);
        for (int rank = 1; rank < num_ranks; ++rank) {
            packed = received[rank * num_packs + index];
#pragma unroll
            for (int i = 0; i < per_pack; ++i)
                acc[i] = __fadd_rn(acc[i], agrs_reduce_load(values[i]));
        }
        if (average) {
#pragma unroll
            for (int i = 0; i < per_pack; ++i)
                acc[i] = __fdiv_rn(acc[i], divisor);
        }
        Pack result;
        T* results = reinterpret_cast<T*>(&result);
#pragma unroll
        for (int i = 0; i < per_pack; ++i)
            agrs_reduce_store(acc[i], results[i]);
        out[index] = result;
    }
}

}  // namespace deep_ep
