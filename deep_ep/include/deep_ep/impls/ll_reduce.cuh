// The weighted top-k sum of DeepEP's V1 low-latency combine (host: deep_ep/legacy/ll_reduce.py), bit
// for bit as its torch loop: per token and channel, acc = +0.0f; for each top-k slot in order, when the
// slot is selected (expert id >= 0, the expert's rank not masked), acc = acc + (w * y) with the product
// rounded to float32 first (no FMA); the result rounded once to bf16, nearest-even (NaN as torch's).
#pragma once

#include "../common/types.cuh"

namespace deep_ep {

constexpr int kLlReduceThreads = 256;
constexpr int kLlReduceChannels = 8;     // bf16 channels per thread: one 16-byte load per slot

__device__ __forceinline__ uint16_t ll_reduce_to_bf16_bits(float value) {
    // torch rounds every NaN to 0x7FC0; __float2bfloat16_rn keeps others nearest-even as torch does
    if (value != value)
        return 0x7FC0;
    const __nv_bfloat16 rounded = __float2bfloat16_rn(value);
    return *reinterpret_cast<const uint16_t*>(&rounded);
}

__device__ __forceinline__ void ll_reduce_impl(const uint4* __restrict__ pairs, const int64_t* __restrict__ topk_idx,
                                               const float* __restrict__ topk_weights,
                                               const int32_t* __restrict__ rank_mask, uint4* __restrict__ out,
                                               int num_tokens, int num_topk, int hidden, int num_local_experts,
                                               int num_ranks) {
    const int64_t chunks_per_row = hidden / kLlReduceChannels;
    const int64_t num_chunks = static_cast<int64_t>(num_tokens) * chunks_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; chunk < num_chunks;
         chunk += stride) {
        const int64_t token = chunk / chunks_per_row;
        const int64_t column = chunk % chunks_per_row;
        float acc[kLlReduceChannels];
#pragma unroll
        for (int i = 0; i < kLlReduceChannels; ++i)
            acc[i] = 0.0f;
        for (int slot = 0; slot < num_topk; ++slot) {
            const int64_t expert = __ldg(topk_idx + token * num_topk + slot);
            if (expert < 0)
                continue;
            if (rank_mask != nullptr) {
                const int64_t rank = expert / num_local_experts;
                if (rank < num_ranks && __ldg(rank_mask + rank) != 0)
                    continue;
            }
            const float weight = __ldg(topk_weights + token * num_topk + slot);
            const uint4 packed = __ldg(pairs + (token * num_topk + slot) * chunks_per_row + column);
            const __nv_bfloat16* values = reinterpret_cast<const __nv_bfloat16*>(&packed);
#pragma unroll
            for (int i = 0; i < kLlReduceChannels; ++i)
                acc[i] = __fadd_rn(acc[i], __fmul_rn(__bfloat162float(values[i]), weight));
        }
        uint4 result;
        uint16_t* bits = reinterpret_cast<uint16_t*>(&result);
#pragma unroll
        for (int i = 0; i < kLlReduceChannels; ++i)
            bits[i] = ll_reduce_to_bf16_bits(acc[i]);
        out[token * chunks_per_row + column] = result;
    }
}

}  // namespace deep_ep
