// Entry points of the AGRS module (impls/agrs.cuh; EP_TRANSPORT_NCCL as in kernels/dispatch.cuh): the
// peers' window addresses for the host's copy-engine transfers (one block, once per configuration),
// and what emulated ranks queue instead of driver operations: a copy, a row of flags, a wait.
#pragma once

#include "../comm/transport.cuh"
#include "../impls/agrs.cuh"

extern "C" __global__ void __launch_bounds__(deep_ep::kAgrsThreads, 1) deep_ep_agrs_peers(
        deep_ep::comm::TransportArgs transport, uint64_t* out) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::agrs_peers_impl(tr, out);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kAgrsThreads, 1) deep_ep_agrs_wait(
        deep_ep::comm::TransportArgs transport, deep_ep::AgrsWaitArgs args) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::agrs_wait_impl(tr, args);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kAgrsThreads, 1) deep_ep_agrs_flags(
        deep_ep::comm::TransportArgs transport, deep_ep::AgrsFlagArgs args) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::agrs_flags_impl(tr, args);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kAgrsCopyThreads) deep_ep_agrs_copy(
        deep_ep::comm::TransportArgs transport, uint8_t* dst, const uint8_t* src, int64_t num_bytes) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::agrs_copy_impl(tr, dst, src, num_bytes);
}
