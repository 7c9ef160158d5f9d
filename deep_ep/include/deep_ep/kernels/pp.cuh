// Entry points of the PP module: pipeline send/recv and pp_set_config's flush steps
// (impls/pp.cuh; EP_TRANSPORT_NCCL as in kernels/dispatch.cuh). Launched on the caller's stream.
#pragma once

#include "../comm/transport.cuh"
#include "../impls/pp.cuh"

extern "C" __global__ void __launch_bounds__(deep_ep::kPpThreads, 1) deep_ep_pp_send(
        deep_ep::comm::TransportArgs transport, deep_ep::PpArgs args) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::pp_send_impl(tr, args);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kPpThreads, 1) deep_ep_pp_recv(
        deep_ep::comm::TransportArgs transport, deep_ep::PpArgs args) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::pp_recv_impl(tr, args);
}

extern "C" __global__ void __launch_bounds__(deep_ep::kPpThreads, 1) deep_ep_pp_flush(
        deep_ep::comm::TransportArgs transport, deep_ep::PpArgs args, int step, int valid) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::pp_flush_impl(tr, args, step, valid);
}
