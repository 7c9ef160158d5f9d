// Expert load balancing: map logical expert ids (a token's top-k) to physical replica slots.
//
// The host side is deep_ep/eplb/replica_map.py, whose CPU path is the specification this code
// must match bit for bit: the replica of logical expert e chosen for token t is
//   logical_to_physical[e][hash(t + token_offset, e) % logical_count[e]],
// with the 32-bit hash below. Ids outside [0, num_experts) (including -1) map to -1: kernels
// cannot raise, and dispatch treats -1 as "no expert".
#pragma once

#include "../common/types.cuh"

namespace deep_ep {

// Spreads the tokens of one expert evenly over its replicas; must stay identical to
// deep_ep.eplb.replica_map.replica_hash. Unsigned 32-bit arithmetic wraps, as the host side's
// masking reproduces.
__device__ __forceinline__ uint32_t eplb_replica_hash(uint32_t token, uint32_t expert) {
    uint32_t h = token * 0x9E3779B1u ^ (expert + 1u) * 0x85EBCA77u;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    return h;
}

// One thread per (token, top-k slot) element, grid-stride. The tables are small (E x R int32) and
// read through the read-only path; every element is read once and written once.
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
