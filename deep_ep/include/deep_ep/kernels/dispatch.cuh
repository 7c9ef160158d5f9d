// Entry points of a dispatch module, compiled by deep_ep/backends/gpu/modules.py once per structure
// from -D defines: EP_DATA_BYTES (bytes per token row), EP_NUM_SF (4-byte scale factors per row, 0
// for BF16), EP_TOPK, EP_EXPAND (0/1), EP_DATA_PHASES (the data kernels' phases, below), EP_THREADS,
// EP_TRANSPORT_NCCL and any common/tunables.cuh.
// Token and rank counts and buffer sizes are run-time arguments, so a new batch size never compiles.
// The data kernels' names hold DeepEP's profiler substrings (modules.DISPATCH_KERNEL).
#pragma once

#include "../comm/transport.cuh"
#include "../impls/dispatch_forward.cuh"
#include "../impls/dispatch_recv.cuh"
#include "../impls/dispatch_send.cuh"
#include "../impls/layout.cuh"
#include "../impls/notify.cuh"

// Both phases in one launch unless modules.py asks for a half (it passes the define only then, so the
// usual modules keep their names and cache keys).
#ifndef EP_DATA_PHASES
#define EP_DATA_PHASES 3
#endif

// Notify and layout in one launch; all blocks resident, as they meet at grid barriers
// (impls/notify.cuh). The block that finishes last signals the peers, then waits for theirs and
// writes the layout (impls/layout.cuh) after the other blocks have exited. On emulated nodes the
// ranks of other nodes are reached through GIN (comm/gin_control.cuh), a NIC kernel beside it.
extern "C" __global__ void __launch_bounds__(deep_ep::kNotifyWarps * 32, 1) deep_ep_notify(
        deep_ep::NotifyArgs a, deep_ep::LayoutArgs layout, deep_ep::comm::TransportArgs transport) {
    EP_TRANSPORT_TABLE(peers);
    deep_ep::comm::ControlTransport tr = deep_ep::comm::make_control_transport(transport, peers);
    const int row_bytes = 4 * (tr.num_ranks + a.num_experts + deep_ep::kCountsExtraWords);   // a count row
    deep_ep::comm::set_control_region(tr, a.counts_offset, row_bytes, row_bytes);
    // The layout stage reuses the notify stage's dynamic shared memory ([kNotifyWarps][R + E] ints, more
    // than the 3 R + L + 2 E it needs), whose counts are dead once the block has numbered its tokens.
    extern __shared__ int smem[];
    if (deep_ep::notify_impl<EP_TOPK, EP_EXPAND != 0>(a, tr)) deep_ep::layout_impl(layout, EP_EXPAND != 0, tr, smem);
    deep_ep::comm::end_control_block(tr);
}

namespace deep_ep {

// The phases a data kernel runs, a bit mask (modules.py names the values): 1 the send phase (rows
// out, then the last block signals; it never waits), 2 the receive phase (the wait, rows in, then
// finish_wait), 3 both in one launch. A receive hook (deep_ep/legacy/low_latency.py) launches the
// halves apart: the window sees the same signal, wait and epoch steps in the same order either way,
// and the send and receive count their blocks on separate words (kCtrlDone, kCtrlDoneWait).
template <int kPhases, bool kCached, typename Transport>
__device__ __forceinline__ void dispatch_phases(const DispatchArgs& a, const Transport& tr, bool zero_padding) {
    static_assert(kPhases >= 1 && kPhases <= 3, "EP_DATA_PHASES is 1, 2 or 3");
    if constexpr (comm::kForwards<Transport>) {
        // hybrid mode across nodes: forwarding waits between the halves (impls/dispatch_forward.cuh)
        static_assert(kPhases == 3, "the hybrid dispatch runs both phases in one launch");
        dispatch_hybrid_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, kCached>(a, zero_padding, tr);
    } else {
        if constexpr ((kPhases & 1) != 0) dispatch_send_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, kCached>(a, tr);
        if constexpr ((kPhases & 2) != 0)
            dispatch_recv_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, kCached>(a, zero_padding, tr);
    }
}

}  // namespace deep_ep

// One kernel per data stage: send, then receive, whose wait includes this rank's own signal, raised
// by the last sending block (a rank alone neither signals nor waits). Blocks wait for other blocks,
// so all must be resident (num_sms <= SMs, summed over emulated ranks; checked on the host). The host
// launches cooperatively (but for emulated ranks, whose grids share the device), so the driver
// refuses a grid that cannot be resident instead of letting it stall.
// The data kernels have C++ linkage in namespace deep_ep: profilers show them as
// "deep_ep::dispatch_impl_with_...", which DeepEP's tests match by substring ("dispatch_impl",
// "::dispatch"); the host finds them by that qualified name (jit.Module.function).
namespace deep_ep {

__global__ void __launch_bounds__(EP_THREADS, 1)
dispatch_impl_with_dispatch_copy_epilogue_impl(
        deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport, int zero_padding) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::DataTransport tr = deep_ep::comm::make_data_transport(transport, peers);
    deep_ep::dispatch_phases<EP_DATA_PHASES, false>(a, tr, zero_padding != 0);
    deep_ep::comm::end_data_block(tr);
}

// The same for a cached dispatch: the handle's layout, no numbering.
__global__ void __launch_bounds__(EP_THREADS, 1)
cached_dispatch_impl_with_dispatch_copy_epilogue_impl(
        deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport, int zero_padding) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::DataTransport tr = deep_ep::comm::make_data_transport(transport, peers);
    deep_ep::dispatch_phases<EP_DATA_PHASES, true>(a, tr, zero_padding != 0);
    deep_ep::comm::end_data_block(tr);
}

}  // namespace deep_ep
