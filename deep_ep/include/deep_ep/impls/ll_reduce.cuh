// The two kernels of DeepEP's V1 low-latency combine around its pair combine (host:
// deep_ep/legacy/ll_reduce.py), bit for bit as their torch specifications there:
//  - ll_gather_impl: the rows the pair combine sends, gathered from the per-expert layout: expanded
//    row r (below the received pairs, the last expert's end) is layout row (row_expert[r],
//    row_slot[r]), or zeros where row_kept[r] is 0 (a masked rank's pair); rows past the received
//    pairs are not written (the pair combine does not read them);
//  - ll_reduce_impl: the weighted top-k sum: per token and channel, acc = +0.0f; for each top-k slot
//    in order, when the slot is selected (expert id >= 0, the expert's rank not masked), acc = acc +
//    (w * y) with the product rounded to float32 first (no FMA); the result rounded once to bf16,
//    nearest-even (NaN as torch's).
#pragma once

#include "../common/types.cuh"

namespace deep_ep {

constexpr int kLlReduceThreads = 256;
constexpr int kLlReduceChannels = 8;     // bf16 channels per thread: one 16-byte load per slot
constexpr int kLlGatherThreads = 256;    // threads per block of the gather: a warp per row
constexpr int kLlGatherWarps = kLlGatherThreads / 32;
constexpr int kLlGatherUnroll = 4;       // 16-byte loads a lane keeps in flight

// One warp per expanded row, rows strided over the grid; the row count is read on the device (the
// last expert's end of the pair dispatch), so the grid is sized for the worst case.
__device__ __forceinline__ void ll_gather_impl(const uint4* __restrict__ source, int64_t expert_stride,
                                               int64_t row_stride, int row_chunks, const int32_t* __restrict__ ends,
                                               int num_local_experts, const int64_t* __restrict__ row_expert,
                                               const int64_t* __restrict__ row_slot,
                                               const uint8_t* __restrict__ row_kept, uint4* __restrict__ out,
                                               int num_rows) {
    const int lane = threadIdx.x % 32;
    const int num_received = min(__ldg(ends + num_local_experts - 1), num_rows);
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kLlGatherWarps;
    for (int64_t row = static_cast<int64_t>(blockIdx.x) * kLlGatherWarps + threadIdx.x / 32; row < num_received;
         row += warps) {
        uint4* to = out + row * row_chunks;
        if (__ldg(row_kept + row) == 0) {
            for (int chunk = lane; chunk < row_chunks; chunk += 32)
                to[chunk] = make_uint4(0u, 0u, 0u, 0u);
            continue;
        }
        const uint4* from = source + __ldg(row_expert + row) * expert_stride + __ldg(row_slot + row) * row_stride;
        int chunk = lane;
        for (; chunk + 32 * (kLlGatherUnroll - 1) < row_chunks; chunk += 32 * kLlGatherUnroll) {
            uint4 values[kLlGatherUnroll];
#pragma unroll
            for (int i = 0; i < kLlGatherUnroll; ++i)
                values[i] = __ldg(from + chunk + 32 * i);
#pragma unroll
            for (int i = 0; i < kLlGatherUnroll; ++i)
                to[chunk + 32 * i] = values[i];
        }
        for (; chunk < row_chunks; chunk += 32)
            to[chunk] = __ldg(from + chunk);
    }
}

__device__ __forceinline__ uint16_t ll_reduce_to_bf16_bits(float value) {
    // torch rounds every NaN to 0x7FC0; __float2bfloat16_rn keeps others nearest-even as torch does
    if (value != value)
        return 0x7FC0;
    const __nv_bfloat16 rounded = __float2bfloat16_rn(value);
    return *reinterpret_cast<const uint16_t*>(&rounded);
}

// acc[i] += weight * channel i of a chunk of 8 bf16 channels, the product rounded to float32 first
// (no FMA).
__device__ __forceinline__ void ll_reduce_add(float (&acc)[kLlReduceChannels], const uint4& packed, float weight) {
    const __nv_bfloat16* values = reinterpret_cast<const __nv_bfloat16*>(&packed);
#pragma unroll
    for (int i = 0; i < kLlReduceChannels; ++i)
        acc[i] = __fadd_rn(acc[i], __fmul_rn(__bfloat162float(values[i]), weight));
}

// The weighted top-k sum's loop: every 8-channel chunk (token, column) of `num_tokens` rows of
// `hidden` bf16 channels, strided over the grid. `sum_slots(token, column, acc)` adds the token's
// selected slots to `acc` (+0.0f) in slot order (ll_reduce_add); each sum is rounded once to bf16
// into `out`.
template <typename SumSlots>
__device__ __forceinline__ void ll_reduce_chunks(uint4* __restrict__ out, int num_tokens, int hidden,
                                                 const SumSlots& sum_slots) {
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
        sum_slots(token, column, acc);
        uint4 result;
        uint16_t* bits = reinterpret_cast<uint16_t*>(&result);
#pragma unroll
        for (int i = 0; i < kLlReduceChannels; ++i)
            bits[i] = ll_reduce_to_bf16_bits(acc[i]);
        out[token * chunks_per_row + column] = result;
    }
}

__device__ __forceinline__ void ll_reduce_impl(const uint4* __restrict__ pairs, const int64_t* __restrict__ topk_idx,
                                               const float* __restrict__ topk_weights,
                                               const int32_t* __restrict__ rank_mask, uint4* __restrict__ out,
                                               int num_tokens, int num_topk, int hidden, int num_local_experts,
                                               int num_ranks) {
    const int64_t chunks_per_row = hidden / kLlReduceChannels;
    ll_reduce_chunks(out, num_tokens, hidden, [&](int64_t token, int64_t column, float (&acc)[kLlReduceChannels]) {
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
            ll_reduce_add(acc, __ldg(pairs + (token * num_topk + slot) * chunks_per_row + column), weight);
        }
    });
}

}  // namespace deep_ep
