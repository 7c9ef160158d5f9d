// Entry points of a dispatch module, the same for every rank count. The host
// (deep_ep/backends/gpu/modules.py) compiles this file once per structural configuration, passing
// it as -D defines: EP_DATA_BYTES (bytes of one token row), EP_NUM_SF (4-byte scale factors per row,
// 0 for BF16), EP_TOPK, EP_EXPAND (0/1), EP_THREADS (block size) and EP_TRANSPORT_NCCL
// (comm/transport.cuh); the tunables of common/tunables.cuh may come too. Token counts, rank counts
// and buffer sizes are run-time arguments: a new batch size never compiles. The data kernels' names
// hold DeepEP's profiler substrings (modules.DISPATCH_KERNEL).
#pragma once

#include "../comm/transport.cuh"
#include "../impls/dispatch_recv.cuh"
#include "../impls/dispatch_send.cuh"
#include "../impls/layout.cuh"
#include "../impls/notify.cuh"

// Notify and layout in one launch: kNotifyWarps warps (groups) per block, a few warps per SM at
// most, since the blocks meet at grid barriers (impls/notify.cuh). The block that finishes last
// signals the peers, then waits for theirs and writes the layout (impls/layout.cuh) while the other
// blocks have exited. A rank alone signals and waits on itself.
extern "C" __global__ void __launch_bounds__(deep_ep::kNotifyWarps * 32, 1) deep_ep_notify(
        deep_ep::NotifyArgs a, deep_ep::LayoutArgs layout, deep_ep::comm::TransportArgs transport) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    // The layout stage's arrays reuse the notify stage's dynamic shared memory ([kNotifyWarps][R + E]
    // ints, more than the 3 R + L + 2 E it needs): its counts are dead once the block has numbered its tokens.
    extern __shared__ int smem[];
    if (deep_ep::notify_impl<EP_TOPK, EP_EXPAND != 0>(a, tr)) deep_ep::layout_impl(layout, EP_EXPAND != 0, tr, smem);
}

// One kernel per data stage: the send phase, then the receive phase. Blocks that finish sending
// wait in the receive phase for every peer's signal, including this rank's own, which the last
// sending block raises (a rank alone skips both: LsaTransport::exchanges). The two phases count
// finished blocks on separate words (last_block), so a block that leaves its wait early (after a
// recorded error) cannot disturb the send phase's count. Blocks depend on other blocks of the same
// kernel, so all must be resident at once: num_sms <= SMs (emulated ranks: the sum over ranks,
// checked on the host). The host launches them cooperatively (not for emulated ranks, whose grids
// share the device): the driver then refuses a grid that cannot be resident instead of letting it stall.
extern "C" __global__ void __launch_bounds__(EP_THREADS, 1)
deep_ep_dispatch_impl_with_dispatch_copy_epilogue_impl(
        deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport, int zero_padding) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::dispatch_send_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, false>(a, tr);
    deep_ep::dispatch_recv_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, false>(a, zero_padding != 0, tr);
}

// The same for a cached dispatch: the handle's layout, no numbering.
extern "C" __global__ void __launch_bounds__(EP_THREADS, 1)
deep_ep_cached_dispatch_impl_with_dispatch_copy_epilogue_impl(
        deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport, int zero_padding) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::dispatch_send_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, true>(a, tr);
    deep_ep::dispatch_recv_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, true>(a, zero_padding != 0, tr);
}
