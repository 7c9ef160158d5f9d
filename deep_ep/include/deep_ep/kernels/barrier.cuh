// Entry point of the control module: the GPU barrier of `ElasticBuffer.barrier` (EP_TRANSPORT_NCCL
// and EP_TRANSPORT_GIN as in kernels/dispatch.cuh: on emulated nodes the ranks of other nodes are
// reached through GIN, comm/gin_control.cuh, with the rank's NIC kernel launched beside it).
#pragma once

#include "../comm/transport.cuh"
#include "../impls/barrier.cuh"

extern "C" __global__ void __launch_bounds__(128, 1) deep_ep_barrier(
        deep_ep::comm::TransportArgs transport, uint64_t timeout_ns, uint32_t* err_host, deep_ep::comm::CallTag tag) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::ControlTransport tr = deep_ep::comm::make_control_transport(transport, peers);
    deep_ep::barrier_impl(tr, timeout_ns, err_host, tag);
    deep_ep::comm::end_control_block(tr);
}
