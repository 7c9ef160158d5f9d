// Kernel entry points of the V1 low-latency combine (impls/ll_reduce.cuh; host:
// deep_ep/legacy/ll_reduce.py): the gather of the rows its pair combine sends, and the weighted top-k
// sum of the rows that come back. No build-time defines: one module serves every shape. Launched on
// the caller's stream; they read only local tensors.
#pragma once

#include "../impls/ll_reduce.cuh"

extern "C" __global__ void __launch_bounds__(deep_ep::kLlReduceThreads) deep_ep_ll_reduce(
        const uint4* pairs, const int64_t* topk_idx, const float* topk_weights, const int32_t* rank_mask, uint4* out,
        int num_tokens, int num_topk, int hidden, int num_local_experts, int num_ranks) {
    deep_ep::ll_reduce_impl(pairs, topk_idx, topk_weights, rank_mask, out, num_tokens, num_topk, hidden,
                            num_local_experts, num_ranks);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kLlGatherThreads) deep_ep_ll_gather(
        const uint4* source, int64_t expert_stride, int64_t row_stride, int row_chunks, const int32_t* ends,
        int num_local_experts, const int64_t* row_expert, const int64_t* row_slot, const uint8_t* row_kept,
        uint4* out, int num_rows) {
    deep_ep::ll_gather_impl(source, expert_stride, row_stride, row_chunks, ends, num_local_experts, row_expert,
                            row_slot, row_kept, out, num_rows);
}
