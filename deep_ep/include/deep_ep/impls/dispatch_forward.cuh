// Dispatch in hybrid mode across nodes (a transport with `kForwards`, comm/gin_hybrid.cuh), in one
// launch on every rank:
//   1. the generic send phase (dispatch_send.cuh): rows for this rank and the ranks of its node;
//   2. rail stage: for each token and each other node it reaches, one slot (the row, its scale
//      factors and the trailer below) is put into the forwarding area of the rail peer there; the
//      last block puts the header and the tag and signals every rail peer;
//   3. forwarding stage: every block waits for the rail peers' signals, then the slots of this call
//      are stored over NVLink into each destination's receive half, exactly as a direct store of the
//      source would have written them (row, scale factors, dispatch_args.cuh's metadata); the last
//      block sends the node its tags (its own and its rail peers') and an arrival;
//   4. the generic receive phase (dispatch_recv.cuh), which waits for the node's arrivals.
// The received layout is the one-node layout bit for bit. A slot: [data][scale factors] as a row,
// then at kMetaOffset the trailer int token, the call mark and the call tag's fingerprint (they mark
// the slot as this call's, also in a CUDA graph's replays: comm/gin_hybrid.cuh), a pad word, int
// expert[K] (-1: masked), float weight[K], int pair row[K] (expanded: the absolute output row at the
// expert's owner; -1 otherwise), int token row[S] at each rank of the destination node (-1: none).
#pragma once

#include "../comm/lsa.cuh"
#include "../comm/push.cuh"
#include "../common/grid.cuh"
#include "dispatch_recv.cuh"
#include "dispatch_send.cuh"

namespace deep_ep {

// Bytes of a forwarding slot for nodes of `node_ranks` ranks (deep_ep/backends/gpu/window.py mirrors it).
template <int kDataBytes, int kNumSF, int K>
__device__ __forceinline__ int forward_slot_bytes(int node_ranks) {
    return DispatchRow<kDataBytes, kNumSF, K>::kMetaOffset + (16 + 12 * K + 4 * node_ranks + 15) / 16 * 16;
}

// The rail stage (2. above), warps over tokens as in dispatch_send_impl: the same warp reads the
// absolute rows that phase wrote back for a fresh dispatch.
template <int kDataBytes, int kNumSF, int K, bool kExpand, typename Transport>
__device__ __forceinline__ void dispatch_rail_send_impl(const DispatchArgs& a, const Transport& tr) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    const WarpGrid wg;
    const int lane = wg.lane, R = tr.num_ranks, S = tr.node_ranks;
    const int slot_bytes = forward_slot_bytes<kDataBytes, kNumSF, K>(S);
    uint8_t* my_window = tr.local();
    const int half = comm::current_half(my_window);
    const int end = comm::has_error(my_window) ? 0 : a.num_tokens;
    const int mark = static_cast<int>(tr.call_mark());
    __syncwarp();
    for (int t = wg.warp; t < end; t += wg.num_warps) {
        int expert = -1, pair = -1;
        float weight = 0.0f;
        if (lane < K) {
            const int64_t id = a.topk_idx[static_cast<int64_t>(t) * K + lane];
            expert = (id >= 0 && id < a.num_experts) ? static_cast<int>(id) : -1;  // out of range: masked
            if (a.topk_weights != nullptr) weight = a.topk_weights[static_cast<int64_t>(t) * K + lane];
            if (kExpand && expert >= 0) pair = a.pos_pair[static_cast<int64_t>(t) * K + lane];
        }
        for (int to_node = 0; to_node < tr.num_nodes(); ++to_node) {
            if (to_node == tr.node()) continue;
            const int row = lane < S ? a.pos_tok[static_cast<int64_t>(t) * R + to_node * S + lane] : -1;
            if (__ballot_sync(0xffffffffu, row >= 0) == 0u) continue;
            const int forwarder = tr.rail_peer(to_node);
            uint8_t* slot = tr.at(tr.stage_slot(forwarder, t, slot_bytes));
            const int4* src = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * kDataBytes);
            for (int v = lane; v < Row::kVecs; v += 32) reinterpret_cast<int4*>(slot)[v] = ld_nc(src + v);
            for (int i = lane; i < kNumSF; i += 32)
                reinterpret_cast<int*>(slot + kDataBytes)[i] = a.sf[static_cast<int64_t>(t) * kNumSF + i];
            int* trailer = reinterpret_cast<int*>(slot + Row::kMetaOffset);
            if (lane == 0) {
                trailer[0] = t;
                trailer[1] = mark;
                trailer[2] = static_cast<int>(a.tag.fingerprint);
            }
            if (lane < K) {
                trailer[4 + lane] = expert;
                reinterpret_cast<float*>(trailer)[4 + K + lane] = weight;
                trailer[4 + 2 * K + lane] = pair;
            }
            if (lane < S) trailer[4 + 3 * K + lane] = row;
            tr.put_slot(forwarder, half, t, slot_bytes, lane);
        }
    }
}

// The forwarding stage (3. above) after the rail wait (`ok`: it succeeded).
template <int kDataBytes, int kNumSF, int K, bool kExpand, typename Transport>
__device__ __forceinline__ void dispatch_forward_impl(const DispatchArgs& a, const Transport& tr, bool ok) {
    using Row = DispatchRow<kDataBytes, kNumSF, K>;
    if (!ok) return;
    const WarpGrid wg;
    const int lane = wg.lane, S = tr.node_ranks, L = a.num_experts / tr.num_ranks;
    const int slot_bytes = forward_slot_bytes<kDataBytes, kNumSF, K>(S);
    const int half = comm::current_half(tr.local());
    const int call = static_cast<int>(tr.call_mark()), fingerprint = static_cast<int>(a.tag.fingerprint);
    for (int from_node = 0; from_node < tr.num_nodes(); ++from_node) {
        if (from_node == tr.node()) continue;
        const int* header = reinterpret_cast<const int*>(tr.at(tr.forward_header(half, from_node)));
        const int num_tokens = (__ldcg(header + 1) == call && __ldcg(header + 2) == fingerprint) ? __ldcg(header) : 0;
        for (int t = wg.warp; t < num_tokens; t += wg.num_warps) {
            const uint8_t* slot = tr.at(tr.forward_slot(half, from_node, t, slot_bytes));
            const int* trailer = reinterpret_cast<const int*>(slot + Row::kMetaOffset);
            if (__ldcg(trailer + 1) != call || __ldcg(trailer + 2) != fingerprint) continue;  // reaches no rank here
            const int token = __ldcg(trailer);
            int expert = -1, pair = -1;
            float weight = 0.0f;
            if (lane < K) {
                expert = __ldcg(trailer + 4 + lane);
                weight = __ldcg(reinterpret_cast<const float*>(trailer) + 4 + K + lane);
                pair = __ldcg(trailer + 4 + 2 * K + lane);
            }
            const int my_row = lane < S ? __ldcg(trailer + 4 + 3 * K + lane) : -1;
            const int4* src = reinterpret_cast<const int4*>(slot);
            const int* src_sf = reinterpret_cast<const int*>(slot + kDataBytes);
            for (int j = 0; j < S; ++j) {
                const int row = __shfl_sync(0xffffffffu, my_row, j);
                if (row < 0) continue;
                const int d = tr.node() * S + j;
                const int64_t dst = comm::row_offset(a, half, row);
                for (int v = lane; v < Row::kVecs; v += 32) tr.template put<int4>(d, dst + 16 * v, __ldcg(src + v));
                for (int i = lane; i < kNumSF; i += 32) tr.template put<int>(d, dst + kDataBytes + 4 * i, __ldcg(src_sf + i));
                const bool local = lane < K && expert >= 0 && expert / L == d;
                const int64_t meta = dst + Row::kMetaOffset;  // int src_token, out_row[K], local_idx[K]; float weight[K]
                if (lane == 0) tr.template put<int>(d, meta, token);
                if (lane < K) {
                    tr.template put<int>(d, meta + 4 * (1 + lane), (kExpand && local) ? pair : -1);
                    tr.template put<int>(d, meta + 4 * (1 + K + lane), local ? expert - d * L : -1);
                    tr.template put<float>(d, meta + 4 * (1 + 2 * K + lane), local ? weight : 0.0f);
                }
            }
        }
    }
}

// The whole hybrid dispatch (1. to 4. above). Blocks wait for other blocks and for peers: all resident.
template <int kDataBytes, int kNumSF, int K, bool kExpand, bool kCached, typename Transport>
__device__ __forceinline__ void dispatch_hybrid_impl(const DispatchArgs& a, bool zero_padding, const Transport& tr) {
    uint8_t* my_window = tr.local();
    dispatch_send_impl<kDataBytes, kNumSF, K, kExpand, kCached>(a, tr);
    dispatch_rail_send_impl<kDataBytes, kNumSF, K, kExpand>(a, tr);
    if (comm::last_block(my_window, comm::kCtrlRailDone)) tr.signal_rails(a.tag, comm::current_half(my_window), a.num_tokens);
    const bool ok = tr.wait_rails(kPhaseDispatchRail, a.timeout_ns);
    dispatch_forward_impl<kDataBytes, kNumSF, K, kExpand>(a, tr, ok);
    if (comm::last_block(my_window, comm::kCtrlForwardDone)) tr.signal_node(a.tag, true);
    dispatch_recv_impl<kDataBytes, kNumSF, K, kExpand, kCached>(a, zero_padding, tr);
}

}  // namespace deep_ep
