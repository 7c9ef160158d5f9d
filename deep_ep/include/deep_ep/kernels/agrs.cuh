// Entry point of the AGRS module: the peers' window addresses for the host's copy-engine transfers
// (impls/agrs.cuh; EP_TRANSPORT_NCCL as in kernels/dispatch.cuh). One block, once per configuration.
#pragma once

#include "../comm/transport.cuh"
#include "../impls/agrs.cuh"

extern "C" __global__ void __launch_bounds__(deep_ep::kAgrsThreads, 1) deep_ep_agrs_peers(
        deep_ep::comm::TransportArgs transport, uint64_t* out) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::agrs_peers_impl(tr, out);
}
