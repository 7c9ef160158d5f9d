// Entry points of a dispatch module. The host (deep_ep/backends/gpu/modules.py) compiles this file
// once per structural configuration, passing it as -D defines: EP_DATA_BYTES (bytes of one token
// row), EP_NUM_SF (4-byte scale factors per row, 0 for BF16), EP_TOPK, EP_EXPAND (0/1),
// EP_THREADS (block size), EP_ALONE_THREADS (block size of a rank alone's expanded dispatch kernels)
// and EP_TRANSPORT_NCCL (comm/transport.cuh); build-time tunables (modules.TUNABLES) may come too.
// Token counts, rank counts and buffer sizes are run-time arguments: a new batch size never compiles.
#pragma once

#include "../comm/transport.cuh"
#include "../impls/dispatch_alone.cuh"
#include "../impls/dispatch_expand_alone.cuh"
#include "../impls/dispatch_recv.cuh"
#include "../impls/dispatch_send.cuh"
#include "../impls/layout.cuh"
#include "../impls/layout_alone.cuh"
#include "../impls/notify.cuh"
#include "../impls/notify_alone.cuh"

// kNotifyWarps warps (groups) per block, a few warps per SM at most: the blocks meet at grid
// barriers (impls/notify.cuh). The block that finishes last signals the peers, then waits for
// theirs and writes the layout (impls/layout.cuh) while the other blocks have exited. A rank alone
// (EP_NOTIFY_SINGLE_RANK) exchanges nothing: its layout is written by the grid's last block while
// the others still number, and its host report by the block that finishes last (impls/layout_alone.cuh);
// in the non-expanded layout (EP_NOTIFY_TOKEN_SCAN) it only scans its tokens (impls/notify_alone.cuh).
extern "C" __global__ void __launch_bounds__(deep_ep::kNotifyWarps * 32, 1) deep_ep_notify(
        deep_ep::NotifyArgs a, deep_ep::LayoutArgs layout, deep_ep::comm::TransportArgs transport) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    // The layout stage's arrays reuse the notify stage's dynamic shared memory ([kNotifyWarps][R + E]
    // ints, more than the 3 R + L + 2 E it needs): its counts are dead once the block has numbered its tokens.
    extern __shared__ int smem[];
#if EP_NOTIFY_SINGLE_RANK
    if (tr.num_ranks == 1) {
#if EP_NOTIFY_TOKEN_SCAN && !EP_EXPAND
        deep_ep::notify_alone_scan<EP_TOPK>(a, layout, tr, smem);
        return;
#endif
        deep_ep::notify_impl<EP_TOPK, EP_EXPAND != 0, true>(a, tr);
        deep_ep::notify_alone_end(layout, EP_EXPAND != 0, tr, smem);
        return;
    }
#endif
    if (deep_ep::notify_impl<EP_TOPK, EP_EXPAND != 0>(a, tr)) deep_ep::layout_impl(layout, EP_EXPAND != 0, tr, smem);
}

// One kernel per data stage: the send phase, then the receive phase. Blocks that finish sending
// wait in the receive phase for every peer's signal, including this rank's own, which the last
// sending block raises (a rank alone skips both: LsaTransport::exchanges). The two phases count finished blocks on separate words (last_block), so a
// block that leaves its wait early (after a recorded error) cannot disturb the send phase's count.
// Blocks depend on other blocks of the same kernel, so all must be resident at once: num_sms <= SMs
// (emulated ranks: the sum over ranks, checked on the host) and nothing else holding SMs forever.
// The host launches them cooperatively (not for emulated ranks, whose grids share the device): the
// driver then refuses a grid that cannot be resident instead of letting it stall.
extern "C" __global__ void __launch_bounds__(EP_THREADS, 1) deep_ep_dispatch(
        deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport, int zero_padding) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    const deep_ep::WarpGrid wg;
    deep_ep::dispatch_send_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, false>(
        a, tr, deep_ep::TokenRange{wg.warp, a.num_tokens, wg.num_warps});
    deep_ep::dispatch_recv_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, false>(a, zero_padding != 0, tr);
}

extern "C" __global__ void __launch_bounds__(EP_THREADS, 1) deep_ep_dispatch_cached(
        deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport, int zero_padding) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    const deep_ep::WarpGrid wg;
    deep_ep::dispatch_send_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, true>(
        a, tr, deep_ep::TokenRange{wg.warp, a.num_tokens, wg.num_warps});
    deep_ep::dispatch_recv_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, EP_EXPAND != 0, true>(a, zero_padding != 0, tr);
}

#if EP_EXPAND && EP_EXPAND_ALONE_CACHED
// A rank alone's cached dispatch in the expanded layout (impls/dispatch_expand_alone.cuh): its rows
// fanned out by (token, chunk) work items on EP_ALONE_THREADS threads per block, then its padding
// rows and the rows past the count. No block waits for another: a plain launch.
extern "C" __global__ void __launch_bounds__(EP_ALONE_THREADS, 1) deep_ep_dispatch_cached_alone(
        deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport, int zero_padding) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::dispatch_expand_alone<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, false>(a, zero_padding != 0, tr, nullptr);
}
#endif

#if EP_EXPAND && EP_EXPAND_ALONE_FRESH
// A rank alone's fresh dispatch in the expanded layout, after the notify kernel (the same
// impls/dispatch_expand_alone.cuh): ``pair_rank`` [T, K], the notify kernel's index of each pair
// among its expert's pairs; the final rows go to a.pos_pair. A plain launch, as the cached one.
extern "C" __global__ void __launch_bounds__(EP_ALONE_THREADS, 1) deep_ep_dispatch_fresh_alone(
        deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport, int zero_padding, const int* pair_rank) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    deep_ep::dispatch_expand_alone<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK, true>(a, zero_padding != 0, tr, pair_rank);
}
#endif

#if EP_DISPATCH_ALONE_FUSED && EP_NOTIFY_TOKEN_SCAN && EP_NOTIFY_SINGLE_RANK && !EP_EXPAND
// A rank alone's non-expanded fresh dispatch in one kernel (impls/dispatch_alone.cuh; with CPU
// sync only where EP_DISPATCH_ALONE_FUSED=2): blocks that each number and then move one consecutive
// token range, and a last block that writes the layout once they have numbered. Dynamic shared
// memory: 2 E ints. Launched cooperatively, as the data kernels (its blocks wait for each other).
extern "C" __global__ void __launch_bounds__(EP_THREADS, 1) deep_ep_dispatch_alone(
        deep_ep::NotifyArgs na, deep_ep::LayoutArgs la, deep_ep::DispatchArgs a, deep_ep::comm::TransportArgs transport) {
    EP_TRANSPORT_TABLE(peers);
    const deep_ep::comm::LsaTransport tr = deep_ep::comm::make_transport(transport, peers);
    extern __shared__ int smem[];
    deep_ep::dispatch_alone_impl<EP_DATA_BYTES, EP_NUM_SF, EP_TOPK>(na, la, a, tr, smem);
}
#endif
