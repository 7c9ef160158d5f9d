// Entry point of a combine module, compiled per EP_HIDDEN, EP_TOPK, EP_EXPAND, EP_THREADS and
// EP_TRANSPORT_NCCL (conventions of kernels/dispatch.cuh).
#pragma once

#include "../comm/transport.cuh"
#include "../impls/combine_recv.cuh"
#include "../impls/combine_send.cuh"

// Stage the rows that came from peers and signal, then pull and sum every token's rows; all blocks
// resident at once, as in the dispatch data kernels.
extern "C" __global__ void __launch_bounds__(EP_THREADS, 1)
deep_ep_combine_impl_with_combine_reduce_epilogue_impl(
        deep_ep::CombineArgs a, deep_ep::comm::TransportArgs transport) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::DataTransport tr = deep_ep::comm::make_data_transport(transport, peers);
    if (tr.exchanges()) deep_ep::combine_send_impl<EP_HIDDEN, EP_TOPK, EP_EXPAND != 0>(a, tr);
    deep_ep::combine_recv_impl<EP_HIDDEN, EP_TOPK, EP_EXPAND != 0>(a, tr);
    deep_ep::comm::end_data_block(tr);
}
