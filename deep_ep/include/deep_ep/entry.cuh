// Kernel entry points. The host runtime (deep_ep/backends/gpu.py) compiles this file once per
// structural configuration, passing it as -D defines:
//   dispatch module: EP_DISPATCH, EP_DATA_BYTES (bytes of one token row), EP_NUM_SF (4-byte scale
//                    factors per row, 0 for BF16), EP_TOPK, EP_EXPAND (0/1)
//   combine module:  EP_COMBINE, EP_HIDDEN, EP_TOPK, EP_EXPAND
// Token counts, rank counts and buffer sizes are run-time arguments: a new batch size never compiles.
#pragma once

#include "combine.cuh"
#include "dispatch.cuh"
#include "layout.cuh"

#ifndef EP_THREADS
#define EP_THREADS 512
#endif

#ifdef EP_DISPATCH
extern "C" __global__ void __launch_bounds__(512) deep_ep_notify(const int64_t* topk_idx, int num_tokens,
                                                                   int num_experts, int num_ranks, int rank,
                                                                   uint8_t* const* peers, int64_t counts_offset,
                                                                   int* pos_tok, int* pos_pair) {
    deep_ep::notify_impl<EP_TOPK, EP_EXPAND != 0>(topk_idx, num_tokens, num_experts, num_ranks, rank, peers,
                                                  counts_offset, pos_tok, pos_pair);
}

extern "C" __global__ void __launch_bounds__(512, 1) deep_ep_layout(uint8_t* const* peers, int rank, int num_ranks,
                                                                   int num_experts, int alignment,
                                                                   int64_t counts_offset, int* layout,
                                                                   int* cumulative_stats, int out_capacity,
                                                                   int tok_capacity, uint64_t timeout_ns) {
    deep_ep::layout_impl(peers, rank, num_ranks, num_experts, alignment, counts_offset, EP_EXPAND != 0, layout,
                         cumulative_stats, out_capacity, tok_capacity, timeout_ns);
}

// One kernel per data stage: the send phase, then the receive phase. Blocks that finish sending
// wait in the receive phase for every peer's signal, including this rank's own, which the last
// sending block raises. The two phases count finished blocks on separate words (last_block), so a
// block that leaves its wait early (after a recorded error) cannot disturb the send phase's count.
// Blocks depend on other blocks of the same kernel, so all must be resident at once: num_sms <= SMs
// (emulated ranks: the sum over ranks, checked on the host) and nothing else holding SMs forever.
// The host launches them cooperatively (gpu.COOPERATIVE; not emulated ranks, whose grids share the
// device): the driver then refuses a grid that cannot be resident instead of letting it stall.
extern "C" __global__ void __launch_bounds__(EP_THREADS, 1) deep_ep_dispatch(deep_ep::DispatchArgs a, int zero_padding) {
    deep_ep::dispatch_send_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, false>(a);
    deep_ep::dispatch_recv_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, false>(a, zero_padding != 0);
}

extern "C" __global__ void __launch_bounds__(EP_THREADS, 1) deep_ep_dispatch_cached(deep_ep::DispatchArgs a, int zero_padding) {
    deep_ep::dispatch_send_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, true>(a);
    deep_ep::dispatch_recv_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, true>(a, zero_padding != 0);
}
#endif

#ifdef EP_COMBINE
extern "C" __global__ void __launch_bounds__(EP_THREADS, 1) deep_ep_combine(deep_ep::CombineArgs a) {
    deep_ep::combine_send_impl<EP_HIDDEN, EP_TOPK, EP_EXPAND != 0>(a);
    deep_ep::combine_recv_impl<EP_HIDDEN, EP_TOPK, EP_EXPAND != 0>(a);
}
#endif
