// Kernel entry point of the V1 low-latency combine's weighted top-k sum (impls/ll_reduce.cuh; host:
// deep_ep/legacy/ll_reduce.py). No build-time defines: one module serves every shape. Launched on the
// caller's stream; it reads only local tensors.
#pragma once

#include "../impls/ll_reduce.cuh"

extern "C" __global__ void __launch_bounds__(deep_ep::kLlReduceThreads) deep_ep_ll_reduce(
        const uint4* pairs, const int64_t* topk_idx, const float* topk_weights, const int32_t* rank_mask, uint4* out,
        int num_tokens, int num_topk, int hidden, int num_local_experts, int num_ranks) {
    deep_ep::ll_reduce_impl(pairs, topk_idx, topk_weights, rank_mask, out, num_tokens, num_topk, hidden,
                            num_local_experts, num_ranks);
}
