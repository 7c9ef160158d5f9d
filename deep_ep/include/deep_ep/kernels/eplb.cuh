// Kernel entry point of expert load balancing (host: deep_ep/eplb/replica_map.py). No build-time
// defines: one module serves every shape.
#pragma once

#include "../impls/eplb_map.cuh"

extern "C" __global__ void __launch_bounds__(256) deep_ep_eplb_map(const int64_t* topk_idx, int64_t* out,
                                                                    int64_t num_elements, int num_topk,
                                                                    int64_t token_offset,
                                                                    const int32_t* logical_to_physical,
                                                                    const int32_t* logical_count, int num_experts,
                                                                    int max_replicas) {
    deep_ep::eplb_map_impl(topk_idx, out, num_elements, num_topk, token_offset, logical_to_physical, logical_count,
                           num_experts, max_replicas);
}
