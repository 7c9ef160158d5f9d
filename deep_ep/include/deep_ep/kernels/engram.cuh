// Entry points of the Engram module: the fetch's gather and engram_write's store into this rank's
// window (impls/engram.cuh; EP_TRANSPORT_NCCL as in kernels/dispatch.cuh). Launched on the caller's
// stream; neither waits for a peer.
#pragma once

#include "../comm/transport.cuh"
#include "../impls/engram.cuh"

extern "C" __global__ void __launch_bounds__(deep_ep::kEngramThreads) deep_ep_engram_gather(
        deep_ep::comm::TransportArgs transport, deep_ep::EngramArgs args) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::engram_gather_impl(tr, args);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kEngramThreads) deep_ep_engram_store(
        deep_ep::comm::TransportArgs transport, int64_t offset, const uint8_t* src, int64_t num_bytes) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::engram_store_impl(tr, offset, src, num_bytes);
}
