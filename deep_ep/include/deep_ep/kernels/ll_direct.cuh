// Kernel entry points of DeepEP's V1 low-latency dispatch and combine sent straight into the
// peers' windows (impls/ll_direct.cuh; host: deep_ep/legacy/ll_direct.py): one kernel per call kind,
// launched for its send phase, then for its receive phase (`phase`), so that a receive hook launches
// the receive alone and nothing holds an SM in between; a call without a hook launches both phases
// at once (kLlDirectBothPhases: each block sends, then receives, waiting on the same flags as a
// receive launch; every block is resident, as every rank's are for emulated ranks). A launch of one
// phase reads only that phase's arguments (the others may be null). With a Buffer's enable_shrink
// (else all null): `rank_view`, the dispatch's copy of the mask (int32 [R], 1 = masked);
// `rank_state` (int32 [2R]), the Buffer's mask then the peers taken as failed, where a timed-out
// peer is marked; `present` (int32 [R], 1 = in), the dispatch receive's decisions about its
// sources, which its combine follows. EP_TRANSPORT_NCCL as in
// kernels/dispatch.cuh; no other define: one module serves every shape. C++ kernels in namespace deep_ep, one name per call: DeepEP's V1
// test times a call's phases by the profiler names "...::dispatch..." and "...::combine..."
// (tests/test_kernel_names.py), one line each in the profiler's table.
#pragma once

#include "../comm/transport.cuh"
#include "../impls/ll_direct.cuh"

namespace deep_ep {

__global__ void __launch_bounds__(kLlDirectThreads, 1) dispatch_ll_direct(
        comm::TransportArgs transport, int phase, int half, LlDirectRegions regions, const uint4* x,
        const int64_t* topk_idx, int num_tokens, int hidden, int num_topk, int num_experts, int num_local_experts,
        int num_slots, int use_fp8, int round_scale, int use_ue8m0, uint4* data_out,
        float* scales_out, int32_t* recv_count, int32_t* src_info, int64_t* layout_range, int32_t* stats,
        int32_t* routes, const int32_t* rank_view, int32_t* rank_state, int32_t* present, uint32_t fingerprint,
        uint64_t timeout_ns, uint32_t* err_host) {
    EP_TRANSPORT_TABLE(peers);
    const comm::LsaTransport tr = comm::make_transport(transport, peers);
    if (phase & kLlDirectSendPhase)
        ll_direct_dispatch_send_impl(tr, half, regions, x, topk_idx, num_tokens, hidden, num_topk, num_experts,
                                     num_local_experts, num_slots, use_fp8, round_scale, rank_view, fingerprint);
    if (phase & kLlDirectReceivePhase)
        ll_direct_dispatch_recv_impl(tr, half, regions, data_out, scales_out, recv_count, src_info, layout_range,
                                     stats, routes, num_local_experts, num_slots, num_topk, hidden, use_fp8,
                                     use_ue8m0, rank_view, rank_state, present, fingerprint, timeout_ns, err_host);
}

__global__ void __launch_bounds__(kLlDirectThreads, 1) combine_ll_direct(
        comm::TransportArgs transport, int phase, int half, LlDirectRegions regions, const uint4* x,
        int64_t expert_stride, int64_t row_stride, const int32_t* recv_count, const int32_t* routes,
        int num_local_experts, int num_slots, int num_topk, int hidden, const int64_t* topk_idx,
        const float* topk_weights, uint4* out, int num_tokens, int32_t* rank_state, const int32_t* present,
        uint32_t fingerprint, uint64_t timeout_ns, uint32_t* err_host) {
    EP_TRANSPORT_TABLE(peers);
    const comm::LsaTransport tr = comm::make_transport(transport, peers);
    if (phase & kLlDirectSendPhase)
        ll_direct_combine_send_impl(tr, half, regions, x, expert_stride, row_stride, recv_count, routes,
                                    num_local_experts, num_slots, num_topk, hidden, present, rank_state, fingerprint);
    if (phase & kLlDirectReceivePhase)
        ll_direct_combine_recv_impl(tr, half, regions, topk_idx, topk_weights, out, num_tokens, num_topk, hidden,
                                    num_local_experts, rank_state, present, fingerprint, timeout_ns, err_host);
}

}  // namespace deep_ep
