// Entry point of a combine module, compiled per EP_HIDDEN, EP_TOPK, EP_EXPAND, EP_SINGLE_REDUCTION,
// EP_DATA_PHASES, EP_THREADS and EP_TRANSPORT_NCCL (conventions of kernels/dispatch.cuh).
#pragma once

#include "../comm/transport.cuh"
#include "../impls/combine_forward.cuh"
#include "../impls/combine_recv.cuh"
#include "../impls/combine_send.cuh"

// Both phases in one launch unless modules.py asks for a half (it passes the define only then, so the
// usual modules keep their names and cache keys).
#ifndef EP_DATA_PHASES
#define EP_DATA_PHASES 3
#endif
// 1: a combine on a buffer without multiple reduction: an expanded handle's (impls/combine_single.cuh),
// or in hybrid mode across nodes either layout's (impls/combine_hybrid_single.cuh: with EP_EXPAND=0
// the forwarders pass each rank's row on unreduced); named by modules.py only then.
#ifndef EP_SINGLE_REDUCTION
#define EP_SINGLE_REDUCTION 0
#endif

namespace deep_ep {

// EP_DATA_PHASES as in kernels/dispatch.cuh: 1 stage and signal (no wait), 2 wait, pull and sum, 3 both.
template <int kPhases, typename Transport>
__device__ __forceinline__ void combine_phases(const CombineArgs& a, const Transport& tr) {
    static_assert(kPhases >= 1 && kPhases <= 3, "EP_DATA_PHASES is 1, 2 or 3");
    if constexpr (comm::kForwards<Transport>) {
        // hybrid mode across nodes: node partials at the forwarders (impls/combine_forward.cuh), or
        // without multiple reduction every rank's (non-expanded) or slot's (expanded) row passed on
        // unreduced (impls/combine_hybrid_single.cuh)
        static_assert(kPhases == 3, "the hybrid combine runs both phases in one launch");
        combine_hybrid_impl<EP_HIDDEN, EP_TOPK, EP_EXPAND != 0, EP_SINGLE_REDUCTION != 0>(a, tr);
    } else {
        if constexpr ((kPhases & 1) != 0)
            if (tr.exchanges()) combine_send_impl<EP_HIDDEN, EP_TOPK, EP_EXPAND != 0, EP_SINGLE_REDUCTION != 0>(a, tr);
        if constexpr ((kPhases & 2) != 0)
            combine_recv_impl<EP_HIDDEN, EP_TOPK, EP_EXPAND != 0, EP_SINGLE_REDUCTION != 0>(a, tr);
    }
}

}  // namespace deep_ep

// Stage the rows that came from peers and signal, then pull and sum every token's rows; all blocks
// resident at once, as in the dispatch data kernels.
// C++ linkage in namespace deep_ep, as the dispatch data kernels (kernels/dispatch.cuh says why).
namespace deep_ep {

__global__ void __launch_bounds__(EP_THREADS, 1)
combine_impl_with_combine_reduce_epilogue_impl(
        deep_ep::CombineArgs a, deep_ep::comm::TransportArgs transport) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::DataTransport tr = deep_ep::comm::make_data_transport(transport, peers);
    deep_ep::combine_phases<EP_DATA_PHASES>(a, tr);
    deep_ep::comm::end_data_block(tr);
}

}  // namespace deep_ep
