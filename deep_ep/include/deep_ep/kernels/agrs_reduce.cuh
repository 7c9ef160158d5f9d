// Kernel entry point of a reduce-scatter's sum (impls/agrs_reduce.cuh; host: deep_ep/backends/gpu/agrs_reduce.py).
// No build-time defines: one module serves every shape and both dtypes. `received` holds num_ranks
// chunks of num_elements each, back to back; `vector` (chunks and pointers 16-byte aligned) picks
// 16-byte loads. Launched on the stream of the reduce-scatter's handle.
#pragma once

#include "../impls/agrs_reduce.cuh"

extern "C" __global__ void __launch_bounds__(deep_ep::kAgrsReduceThreads) deep_ep_agrs_reduce(
        const void* received, void* out, int64_t num_elements, int num_ranks, int is_bf16, int average, int vector) {
    using deep_ep::agrs_reduce_impl;
    const int bytes = is_bf16 ? 2 : 4;
    if (vector) {
        const int64_t num_packs = num_elements * bytes / deep_ep::kAgrsReduceVectorBytes;
        if (is_bf16)
            agrs_reduce_impl<__nv_bfloat16>(static_cast<const uint4*>(received), static_cast<uint4*>(out), num_packs,
                                            num_ranks, average != 0);
        else
            agrs_reduce_impl<float>(static_cast<const uint4*>(received), static_cast<uint4*>(out), num_packs,
                                    num_ranks, average != 0);
    } else if (is_bf16) {
        agrs_reduce_impl<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(received), static_cast<__nv_bfloat16*>(out),
                                        num_elements, num_ranks, average != 0);
    } else {
        agrs_reduce_impl<float>(static_cast<const float*>(received), static_cast<float*>(out), num_elements, num_ranks,
                                average != 0);
    }
}
