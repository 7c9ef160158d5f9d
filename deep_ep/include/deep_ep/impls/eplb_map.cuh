// Expert load balancing: map logical expert ids to physical replica slots, bit for bit as the CPU
// path of deep_ep/eplb/replica_map.py: expert e of token t goes to replica
//   logical_to_physical[e][hash(t + token_offset, e) % logical_count[e]].
// Ids outside [0, num_experts) map to -1: kernels cannot raise, and dispatch treats -1 as no expert.
#pragma once

#include "../common/types.cuh"

namespace deep_ep {

// Must stay identical to deep_ep.eplb.replica_map.replica_hash (whose masking reproduces the
// wrapping of unsigned 32-bit arithmetic).
__device__ __forceinline__ uint32_t eplb_replica_hash(uint32_t token, uint32_t expert) {
    uint32_t h = token * 0x9E3779B1u ^ (expert + 1u) * 0x85EBCA77u;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    return h;
}

__device__ __forceinline__ void eplb_map_impl(const int64_t* __restrict__ topk_idx, int64_t* __restrict__ out,
                                              int64_t num_elements, int num_topk, int64_t token_offset,
                                              const int32_t* __restrict__ logical_to_physical,
                                              const int32_t* __restrict__ logical_count, int num_experts,
                                              int max_replicas) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_elements; i += stride) {
        const int64_t expert = __ldg(topk_idx + i);
        int64_t physical = -1;
        if (expert >= 0 && expert < num_experts) {
            const uint32_t token = static_cast<uint32_t>(i / num_topk + token_offset);
            const uint32_t count = static_cast<uint32_t>(__ldg(logical_count + expert));
            const uint32_t replica = eplb_replica_hash(token, static_cast<uint32_t>(expert)) % count;
            physical = __ldg(logical_to_physical + expert * max_replicas + replica);
        }
        out[i] = physical;
    }
}

}  // namespace deep_ep
