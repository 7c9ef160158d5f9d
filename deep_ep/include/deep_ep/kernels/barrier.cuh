// Entry point of the control module: the GPU barrier of `ElasticBuffer.barrier` (EP_TRANSPORT_NCCL
// as in kernels/dispatch.cuh).
#pragma once

#include "../comm/transport.cuh"
#include "../impls/barrier.cuh"

extern "C" __global__ void __launch_bounds__(128, 1) deep_ep_barrier(
        deep_ep::comm::TransportArgs transport, uint64_t timeout_ns, uint32_t* err_host, deep_ep::comm::CallTag tag) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::barrier_impl(tr, timeout_ns, err_host, tag);
}
