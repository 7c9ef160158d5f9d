// Kernel entry points of the V1 low-latency dispatch's layouts (impls/ll_layout.cuh; host:
// deep_ep/legacy/ll_layout.py): the cast of the pairs; with a rank mask the counts then the placement
// of the received rows (two launches: the placement needs every count), without one both in one
// launch. No build-time defines: one module serves every shape. Launched on the caller's stream; they
// read only local tensors.
#pragma once

#include "../impls/ll_layout.cuh"

extern "C" __global__ void __launch_bounds__(deep_ep::kLlLayoutThreads) deep_ep_ll_cast_pairs(
        const uint4* x, uint4* out_bf16, uint2* out_fp8, float* out_scales, const int64_t* topk_idx,
        const int32_t* rank_mask, int64_t* pairs_topk, int num_tokens, int hidden, int num_topk, int round_scale,
        int num_local_experts, int num_ranks, int32_t* scratch, int scratch_words) {
    deep_ep::ll_cast_pairs_impl(x, out_bf16, out_fp8, out_scales, topk_idx, rank_mask, pairs_topk, num_tokens, hidden,
                                num_topk, round_scale, num_local_experts, num_ranks, scratch, scratch_words);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kLlCountThreads) deep_ep_ll_count(
        const int32_t* metadata, int metadata_stride, int num_metadata_rows, const int32_t* ends,
        const int32_t* rank_mask, int32_t* recv_count, int64_t* layout_range, int32_t* slot_shift, int32_t* stats,
        int num_ranks, int num_local_experts, int max_pairs) {
    deep_ep::ll_count_impl(metadata, metadata_stride, num_metadata_rows, ends, rank_mask, recv_count, layout_range,
                           slot_shift, stats, num_ranks, num_local_experts, max_pairs);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kLlLayoutThreads) deep_ep_ll_place(
        const int32_t* metadata, int metadata_stride, int num_metadata_rows, const int32_t* ends,
        const int32_t* unaligned, const int32_t* rank_mask, const int32_t* slot_shift, const int32_t* recv_count,
        const uint4* rows, int64_t row_stride, int row_chunks, const float* scales, int64_t scale_row_stride,
        int64_t scale_column_stride, int num_scales, int use_ue8m0, uint4* data_out, float* scales_out,
        int32_t* src_info, int64_t* row_expert, int64_t* row_slot, uint8_t* row_kept, int num_expanded, int num_ranks,
        int num_local_experts, int num_slots, int num_topk, int max_pairs) {
    deep_ep::ll_place_impl(metadata, metadata_stride, num_metadata_rows, ends, unaligned, rank_mask, slot_shift,
                           recv_count, rows, row_stride, row_chunks, scales, scale_row_stride, scale_column_stride,
                           num_scales, use_ue8m0, data_out, scales_out, src_info, row_expert, row_slot, row_kept,
                           num_expanded, num_ranks, num_local_experts, num_slots, num_topk, max_pairs, nullptr);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kLlLayoutThreads) deep_ep_ll_place_counted(
        const int32_t* metadata, int metadata_stride, int num_metadata_rows, const int32_t* ends,
        const int32_t* unaligned, int32_t* counts, int32_t* recv_count, int64_t* layout_range, int32_t* stats,
        const uint4* rows, int64_t row_stride, int row_chunks, const float* scales, int64_t scale_row_stride,
        int64_t scale_column_stride, int num_scales, int use_ue8m0, uint4* data_out, float* scales_out,
        int32_t* src_info, int64_t* row_expert, int64_t* row_slot, uint8_t* row_kept, int num_expanded, int num_ranks,
        int num_local_experts, int num_slots, int num_topk, int max_pairs) {
    deep_ep::ll_place_impl(metadata, metadata_stride, num_metadata_rows, ends, unaligned, nullptr, nullptr, nullptr,
                           rows, row_stride, row_chunks, scales, scale_row_stride, scale_column_stride, num_scales,
                           use_ue8m0, data_out, scales_out, src_info, row_expert, row_slot, row_kept, num_expanded,
                           num_ranks, num_local_experts, num_slots, num_topk, max_pairs, counts);
    deep_ep::ll_finish_counts(counts, recv_count, layout_range, stats, num_ranks, num_local_experts);
}
