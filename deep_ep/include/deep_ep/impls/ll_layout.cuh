// The layouts of DeepEP's V1 low-latency dispatch around its expanded pair dispatch (host:
// deep_ep/legacy/ll_layout.py; the torch ops of deep_ep/legacy/layouts.py are the specification, bit
// for bit):
//  - ll_cast_pairs_impl: every token's row repeated top-k times, as bf16 or FP8 (per token and 128
//    channels: amax at least 1e-4, scale_inv = amax / 448 or its power of two at or above, data
//    x / scale_inv rounded to nearest even, saturated to +-448) with its scales repeated alike, and
//    with a rank mask the pairs' expert ids, -1 for experts of masked ranks;
//  - ll_count_impl (one block): received pairs per (local expert, source rank) from the pair
//    dispatch's metadata, the rank mask applied: recv_count, layout_range, the statistics, and how
//    far each (expert, rank)'s rows move up past the masked ranks before it;
//  - ll_place_impl: every received row (and its scales) to its place in the per-expert layout,
//    src_info and each expanded row's place; src_info past the count -1, rows without a pair zeros;
//  - without a rank mask, the counts and the placement in one launch (deep_ep_ll_place_counted): the
//    placement then needs no count (no rows move up), it adds each row to its (expert, source rank)
//    count in a scratch the cast zeroed, and the last block to finish (a ticket in the scratch) writes
//    recv_count, layout_range and the statistics from those counts (ll_finish_counts).
#pragma once

#include "../common/types.cuh"

namespace deep_ep {

constexpr int kLlLayoutThreads = 256;       // threads per block of the cast and the placement
constexpr int kLlCountThreads = 1024;       // the one block of the counts
constexpr int kLlCastChannels = 8;          // bf16 channels per thread of the cast: one 16-byte load
constexpr int kLlScaleChannels = 128;       // channels of one FP8 scale
constexpr int kLlLayoutWarps = kLlLayoutThreads / 32;
constexpr int kLlPlaceUnroll = 4;          // 16-byte loads a lane of the placement keeps in flight

__device__ __forceinline__ bool ll_is_nan(float value) { return value != value; }

// torch's float -> float8_e4m3fn of a value in [-448, 448] or NaN: round to nearest even, the sign
// kept (NaN -> 0x7F with its sign).
__device__ __forceinline__ uint32_t ll_to_e4m3(float value) {
    const uint32_t bits = __float_as_uint(value);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u)
        return 0x7Fu | sign;
    uint32_t code;
    if (magnitude < (121u << 23)) {
        // below 2^-6, the smallest normal: multiples of 2^-9 (scaling by 2^9 is exact)
        code = static_cast<uint32_t>(__float2int_rn(__fmul_rn(__uint_as_float(magnitude), 512.0f)));
    } else {
        // keep 3 mantissa bits, nearest even, then move the exponent bias from 127 to 7
        const uint32_t rounded = magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u);
        code = (rounded >> 20) - (120u << 3);
    }
    return (code & 0xFFu) | sign;
}

// The largest magnitude, NaN winning (torch's amax propagates NaN).
__device__ __forceinline__ float ll_nan_max(float current, float candidate) {
    return (candidate > current || ll_is_nan(candidate)) ? candidate : current;
}

// The multiplier and scale_inv of a group of channels whose largest magnitude is `amax`.
__device__ __forceinline__ void ll_scales_of(float amax, int round_scale, float& scale, float& scale_inv) {
    if (!ll_is_nan(amax) && amax < 1e-4f)
        amax = 1e-4f;
    const float inverse_max = static_cast<float>(1.0 / 448.0);
    if (round_scale) {
        // the power of two at or above amax / 448, from its bits
        const uint32_t bits = __float_as_uint(__fmul_rn(amax, inverse_max));
        const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xFFu) - 127 + ((bits & 0x7FFFFFu) != 0);
        scale = __uint_as_float(static_cast<uint32_t>(127 - exponent) << 23);
        scale_inv = __uint_as_float(static_cast<uint32_t>(exponent + 127) << 23);
    } else {
        scale = __fdiv_rn(448.0f, amax);
        scale_inv = __fmul_rn(amax, inverse_max);
    }
}

// One channel's FP8 code: value * scale saturated to +-448 (NaN kept, as torch's clamp).
__device__ __forceinline__ uint32_t ll_cast_value(float value, float scale) {
    float scaled = __fmul_rn(value, scale);
    if (!ll_is_nan(scaled))
        scaled = fminf(fmaxf(scaled, -448.0f), 448.0f);
    return ll_to_e4m3(scaled);
}

// The UE8M0 byte of a power-of-two scale (its float32 bits): the biased exponent.
__device__ __forceinline__ uint32_t ll_ue8m0_of(uint32_t scale_bits) { return (scale_bits >> 23) & 0xFFu; }

// One 8-channel chunk of a row (packed bf16) as FP8 codes and, in `scale_inv`, the scale of its 128
// channels: the amax is shared by the kLlScaleChannels / kLlCastChannels consecutive lanes of one warp
// that hold the scale's chunks, so those lanes call this together, all in or all out (hidden a multiple
// of 128, blocks of whole warps).
__device__ __forceinline__ uint2 ll_cast_chunk(const uint4& packed, int round_scale, float& scale_inv) {
    constexpr int chunks_per_scale = kLlScaleChannels / kLlCastChannels;
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t group_mask = ((1u << chunks_per_scale) - 1u) << (lane / chunks_per_scale * chunks_per_scale);
    const __nv_bfloat16* values = reinterpret_cast<const __nv_bfloat16*>(&packed);
    float channels[kLlCastChannels];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kLlCastChannels; ++i) {
        channels[i] = __bfloat162float(values[i]);
        amax = ll_nan_max(amax, fabsf(channels[i]));
    }
#pragma unroll
    for (int offset = chunks_per_scale / 2; offset > 0; offset /= 2)
        amax = ll_nan_max(amax, __shfl_xor_sync(group_mask, amax, offset, chunks_per_scale));
    float scale;
    ll_scales_of(amax, round_scale, scale, scale_inv);
    uint2 codes = make_uint2(0u, 0u);
#pragma unroll
    for (int i = 0; i < kLlCastChannels; ++i) {
        const uint32_t code = ll_cast_value(channels[i], scale) << (8 * (i % 4));
        if (i < 4)
            codes.x |= code;
        else
            codes.y |= code;
    }
    return codes;
}

__device__ __forceinline__ void ll_cast_pairs_impl(const uint4* __restrict__ x, uint4* __restrict__ out_bf16,
                                                   uint2* __restrict__ out_fp8, float* __restrict__ out_scales,
                                                   const int64_t* __restrict__ topk_idx,
                                                   const int32_t* __restrict__ rank_mask,
                                                   int64_t* __restrict__ pairs_topk, int num_tokens, int hidden,
                                                   int num_topk, int round_scale, int num_local_experts,
                                                   int num_ranks, int32_t* __restrict__ scratch,
                                                   int scratch_words) {
    const int64_t chunks_per_row = hidden / kLlCastChannels;
    const int64_t num_chunks = static_cast<int64_t>(num_tokens) * chunks_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    // the counts (and ticket) of the receive layout that runs after the pair dispatch
    for (int64_t word = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; word < scratch_words;
         word += stride)
        scratch[word] = 0;
    if (rank_mask != nullptr) {
        // the pairs' routing: nothing goes to a masked rank (ids past the experts are left to the dispatch)
        const int64_t num_pairs = static_cast<int64_t>(num_tokens) * num_topk;
        for (int64_t pair = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; pair < num_pairs;
             pair += stride) {
            const int64_t expert = __ldg(topk_idx + pair);
            const int64_t owner = expert / num_local_experts;
            const bool masked = expert >= 0 && owner < num_ranks && __ldg(rank_mask + owner) != 0;
            pairs_topk[pair] = masked ? -1 : expert;
        }
    }
    constexpr int kChunksPerScale = kLlScaleChannels / kLlCastChannels;
    const int num_scales = hidden / kLlScaleChannels;
    // the chunks of one scale are kChunksPerScale consecutive lanes of one warp, all in or all out of
    // the loop together (ll_cast_chunk)
    for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; chunk < num_chunks;
         chunk += stride) {
        const int64_t token = chunk / chunks_per_row;
        const int64_t column = chunk % chunks_per_row;
        const uint4 packed = __ldg(x + chunk);
        if (out_bf16 != nullptr) {
            for (int slot = 0; slot < num_topk; ++slot)
                out_bf16[(token * num_topk + slot) * chunks_per_row + column] = packed;
            continue;
        }
        float scale_inv;
        const uint2 codes = ll_cast_chunk(packed, round_scale, scale_inv);
        for (int slot = 0; slot < num_topk; ++slot)
            out_fp8[(token * num_topk + slot) * chunks_per_row + column] = codes;
        if (column % kChunksPerScale == 0) {
            const int64_t scale_column = column / kChunksPerScale;
            for (int slot = 0; slot < num_topk; ++slot)
                out_scales[(token * num_topk + slot) * num_scales + scale_column] = scale_inv;
        }
    }
}

// The local expert of expanded row `row`: how many experts end at or before it (searchsorted, right),
// at most the last expert.
__device__ __forceinline__ int ll_expert_of(const int32_t* ends, int num_local_experts, int64_t row) {
    int low = 0, high = num_local_experts;
    const int64_t target = row < 0 ? 0 : row;
    while (low < high) {
        const int middle = (low + high) / 2;
        if (ends[middle] <= target)
            low = middle + 1;
        else
            high = middle;
    }
    return low < num_local_experts ? low : num_local_experts - 1;
}

__device__ __forceinline__ void ll_count_impl(const int32_t* __restrict__ metadata, int metadata_stride,
                                              int num_metadata_rows, const int32_t* __restrict__ ends,
                                              const int32_t* __restrict__ rank_mask, int32_t* __restrict__ recv_count,
                                              int64_t* __restrict__ layout_range, int32_t* __restrict__ slot_shift,
                                              int32_t* __restrict__ stats, int num_ranks, int num_local_experts,
                                              int max_pairs) {
    extern __shared__ int32_t ll_count_shared[];
    int32_t* counts = ll_count_shared;                                  // [L, R]
    int32_t* shared_ends = ll_count_shared + num_local_experts * num_ranks;   // [L]
    for (int i = threadIdx.x; i < num_local_experts * num_ranks; i += blockDim.x)
        counts[i] = 0;
    for (int i = threadIdx.x; i < num_local_experts; i += blockDim.x)
        shared_ends[i] = ends[i];
    __syncthreads();
    for (int row = threadIdx.x; row < num_metadata_rows; row += blockDim.x) {
        const int32_t source = metadata[static_cast<int64_t>(row) * metadata_stride];
        if (source < 0)
            continue;
        const int32_t expanded_row = metadata[static_cast<int64_t>(row) * metadata_stride + 2];
        const int expert = ll_expert_of(shared_ends, num_local_experts, expanded_row);
        atomicAdd(counts + expert * num_ranks + source / max_pairs, 1);
    }
    __syncthreads();
    for (int expert = threadIdx.x; expert < num_local_experts; expert += blockDim.x) {
        int32_t begin = 0, dropped = 0;
        for (int rank = 0; rank < num_ranks; ++rank) {
            int32_t count = counts[expert * num_ranks + rank];
            slot_shift[expert * num_ranks + rank] = dropped;
            if (rank_mask != nullptr && rank_mask[rank] != 0) {
                dropped += count;
                count = 0;
            }
            layout_range[expert * num_ranks + rank] = (static_cast<int64_t>(begin) << 32) | count;
            begin += count;
        }
        recv_count[expert] = begin;
        if (stats != nullptr)
            stats[expert] = static_cast<int32_t>(static_cast<uint32_t>(stats[expert]) + static_cast<uint32_t>(begin));
    }
}

// One warp per metadata row: the row's place, its data (16-byte chunks) and scales (float32, or
// UE8M0 exponent bytes four to a word, column-major); then every thread fills what no row writes.
__device__ __forceinline__ void ll_place_impl(
        const int32_t* __restrict__ metadata, int metadata_stride, int num_metadata_rows,
        const int32_t* __restrict__ ends, const int32_t* __restrict__ unaligned, const int32_t* __restrict__ rank_mask,
        const int32_t* __restrict__ slot_shift, const int32_t* __restrict__ recv_count,
        const uint4* __restrict__ rows, int64_t row_stride, int row_chunks, const float* __restrict__ scales,
        int64_t scale_row_stride, int64_t scale_column_stride, int num_scales, int use_ue8m0,
        uint4* __restrict__ data_out, float* __restrict__ scales_out, int32_t* __restrict__ src_info,
        int64_t* __restrict__ row_expert, int64_t* __restrict__ row_slot, uint8_t* __restrict__ row_kept,
        int num_expanded, int num_ranks, int num_local_experts, int num_slots, int num_topk, int max_pairs,
        int32_t* __restrict__ counts) {
    // counts (no rank mask: recv_count is then the unaligned counts, slot_shift all zero): each kept
    // row is added to its (expert, source rank) count there; otherwise recv_count and slot_shift come
    // from ll_count_impl
    const int lane = threadIdx.x % 32;
    const int64_t num_rows = static_cast<int64_t>(num_ranks) * num_slots;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kLlLayoutWarps;
    for (int64_t row = static_cast<int64_t>(blockIdx.x) * kLlLayoutWarps + threadIdx.x / 32;
         row < num_metadata_rows; row += warps) {
        const int32_t source = __ldg(metadata + row * metadata_stride);
        if (source < 0)
            continue;
        const int32_t source_rank = source / max_pairs;
        const int32_t token = source % max_pairs / num_topk;
        const int64_t expanded_row = __ldg(metadata + row * metadata_stride + 2);
        const int expert = ll_expert_of(ends, num_local_experts, expanded_row);
        int64_t slot = expanded_row - (__ldg(ends + expert) - __ldg(unaligned + expert));
        const bool kept = rank_mask == nullptr || __ldg(rank_mask + source_rank) == 0;
        if (kept && slot_shift != nullptr)
            slot -= __ldg(slot_shift + expert * num_ranks + source_rank);
        if (lane == 0) {
            row_expert[expanded_row] = kept ? expert : 0;
            row_slot[expanded_row] = kept ? slot : 0;
            row_kept[expanded_row] = kept ? 1 : 0;
            if (kept)
                src_info[expert * num_rows + slot] = token;
            if (kept && counts != nullptr)
                atomicAdd(counts + expert * num_ranks + source_rank, 1);
        }
        if (!kept)
            continue;
        const int64_t target = expert * num_rows + slot;
        const uint4* from = rows + expanded_row * row_stride;
        uint4* to = data_out + target * row_chunks;
        // a warp per row leaves most of an SM idle: each lane keeps several loads in flight
        for (int chunk = lane; chunk < row_chunks; chunk += 32 * kLlPlaceUnroll) {
            uint4 values[kLlPlaceUnroll];
#pragma unroll
            for (int i = 0; i < kLlPlaceUnroll; ++i)
                if (chunk + 32 * i < row_chunks) values[i] = __ldg(from + chunk + 32 * i);
#pragma unroll
            for (int i = 0; i < kLlPlaceUnroll; ++i)
                if (chunk + 32 * i < row_chunks) to[chunk + 32 * i] = values[i];
        }
        if (scales == nullptr)
            continue;
        const float* row_scales = scales + expanded_row * scale_row_stride;
        if (use_ue8m0) {
            uint32_t* words = reinterpret_cast<uint32_t*>(scales_out);
            const int num_words = num_scales / 4;
            for (int word = lane; word < num_words; word += 32) {
                uint32_t packed = 0;
#pragma unroll
                for (int byte = 0; byte < 4; ++byte) {
                    const uint32_t bits = __float_as_uint(__ldg(row_scales + (4 * word + byte) * scale_column_stride));
                    packed |= ll_ue8m0_of(bits) << (8 * byte);
                }
                words[(expert * num_words + word) * num_rows + slot] = packed;
            }
        } else {
            for (int column = lane; column < num_scales; column += 32)
                scales_out[(expert * num_scales + column) * num_rows + slot] =
                        __ldg(row_scales + column * scale_column_stride);
        }
    }
    // what no row writes: src_info past each expert's count, the places of expanded rows past the
    // received pairs (alignment 1: the received pairs are the rows before the last expert's end)
    // (32-bit indices: the host keeps the layout's rows and the expanded rows below 2^31)
    const int stride = gridDim.x * blockDim.x;
    const int first = blockIdx.x * blockDim.x + threadIdx.x;
    const int layout_rows = num_ranks * num_slots;
    const int32_t* limits = counts != nullptr ? unaligned : recv_count;
    for (int index = first; index < num_local_experts * layout_rows; index += stride) {
        if (index % layout_rows >= __ldg(limits + index / layout_rows))
            src_info[index] = -1;
    }
    for (int index = __ldg(ends + num_local_experts - 1) + first; index < num_expanded; index += stride) {
        row_expert[index] = 0;
        row_slot[index] = 0;
        row_kept[index] = 0;
    }
}

// After ll_place_impl with counts (every block): the last block to finish writes the layout's counts.
// The other blocks' atomics are visible to it (each block fences before taking its ticket); it reads
// them past L1 (which is not coherent).
__device__ __forceinline__ void ll_finish_counts(int32_t* __restrict__ counts, int32_t* __restrict__ recv_count,
                                                 int64_t* __restrict__ layout_range, int32_t* __restrict__ stats,
                                                 int num_ranks, int num_local_experts) {
    __shared__ int ll_last_block;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        ll_last_block = atomicAdd(counts + num_local_experts * num_ranks, 1) == static_cast<int>(gridDim.x) - 1;
    __syncthreads();
    if (!ll_last_block)
        return;
    __threadfence();
    for (int expert = threadIdx.x; expert < num_local_experts; expert += blockDim.x) {
        int32_t begin = 0;
        for (int rank = 0; rank < num_ranks; ++rank) {
            const int32_t count = __ldcg(counts + expert * num_ranks + rank);
            layout_range[expert * num_ranks + rank] = (static_cast<int64_t>(begin) << 32) | count;
            begin += count;
        }
        recv_count[expert] = begin;
        if (stats != nullptr)
            stats[expert] = static_cast<int32_t>(static_cast<uint32_t>(stats[expert]) + static_cast<uint32_t>(begin));
    }
}

}  // namespace deep_ep
