// The hybrid-mode scale-out transport: a rank reaches the ranks of its own node (`node_ranks`
// consecutive ranks) by loads and stores, and through GIN only its rail peers (the rank of the same
// local index on every other node). A dispatched row crosses the network once per destination node,
// into the forwarding area of the rail peer there, which stores it over NVLink into the receive half
// of each destination of its node (impls/dispatch_forward.cuh). What the generic phases call
// (LsaTransport's names, comm/lsa.cuh):
//   - put / put_chunk reach the node's ranks only (rows for other nodes are forwarded instead);
//   - signal_all does nothing: the hybrid dispatch signals its node once it has forwarded
//     (`signal_node`), so that a node peer's arrival covers the rows forwarded through it;
//   - wait_all waits for the node's ranks (this rank included).
// Forwarding area: `forward_offset` from every window (the emulation keeps it in an allocation of its
// own), two halves of `half_bytes` as the receive region, each a region of `node_bytes()` per source
// node: dispatch puts a 16-byte header (tokens of the source, call mark), then a slot per token;
// combine's owners store a rank partial per (token, rank of the node) there (impls/combine_forward.cuh).
// Inbox (combine only): `inbox_offset`, the same halves and node regions: a node partial per token,
// put by the rail peer of that node. Rail signals are [epoch parity][source rank], reset by
// `end_block` as comm/gin_direct.cuh does. Headers, slots and entries carry the call mark
// (`call_mark`) and the call tag's fingerprint: they tell this call's from an earlier one's.
#pragma once

#include "../common/copy.cuh"
#include "gin.cuh"
#include "lsa.cuh"
#include "push.cuh"

namespace deep_ep::comm {

template <typename Gin>
struct GinHybridTransport {
    LsaTransport lsa;      // the windows of this rank and its node
    Gin gin;
    int rank, num_ranks;
    int num_contexts;
    int max_put_bytes;     // the largest single put (the emulated NIC's staging slot)
    int node_ranks;        // ranks of a node
    int64_t recv_offset, half_bytes, stage_offset, forward_offset, inbox_offset;
    uint32_t* done;        // [2] user blocks that ended, NIC warps that ended (the emulated NIC's stop;
                           // over NCCL's GIN the last block zeroes the first)

    __device__ __forceinline__ uint8_t* local() const { return lsa.local(); }
    __device__ __forceinline__ bool exchanges() const { return num_ranks > 1; }
    __device__ __forceinline__ int num_nodes() const { return num_ranks / node_ranks; }
    __device__ __forceinline__ int node() const { return rank / node_ranks; }
    __device__ __forceinline__ bool in_node(int peer) const { return peer / node_ranks == node(); }
    // This rank's rail peer on node `to_node`.
    __device__ __forceinline__ int rail_peer(int to_node) const { return to_node * node_ranks + rank % node_ranks; }

    template <typename T>
    __device__ __forceinline__ void put(int peer, int64_t offset, T value) const {
        if (in_node(peer)) lsa.put<T>(peer, offset, value);
    }
    template <typename T>
    __device__ __forceinline__ T get(int peer, int64_t offset) const {
        return lsa.get<T>(peer, offset);
    }
    template <int kUnroll, int kVecs>
    __device__ __forceinline__ void put_chunk(int peer, int64_t offset, int base, int lane, const int4 (&v)[kUnroll]) const {
        if (in_node(peer)) lsa.put_chunk<kUnroll, kVecs>(peer, offset, base, lane, v);
    }
    template <int kUnroll, int kVecs>
    __device__ __forceinline__ void get_chunk(int peer, int64_t offset, int base, int lane, int4 (&v)[kUnroll]) const {
        lsa.get_chunk<kUnroll, kVecs>(peer, offset, base, lane, v);
    }
    __device__ __forceinline__ void signal_all(CallTag) const {}

    // What marks a header, slot or entry as this call's: this rank's epoch, read on the device. Every
    // rank has the same epoch during the same call (each wait pairs them) and it advances at every
    // wait of a data or control kernel, after every block has read it, so it also tells calls apart in
    // the replays of a CUDA graph, which repeat the captured call tag (the tag's number is a host count).
    __device__ __forceinline__ uint32_t call_mark() const { return ld_volatile(ctrl_of(local()) + kCtrlEpoch); }

    // This rank's own bytes at an offset of its window (staging, forwarding area).
    __device__ __forceinline__ uint8_t* at(int64_t offset) const { return local() + offset; }
    __device__ __forceinline__ int64_t node_bytes() const { return half_bytes / num_nodes() / 16 * 16; }
    // Header and slot `token` (of `slot_bytes`) of source node `from_node` in a forwarding area's half.
    __device__ __forceinline__ int64_t forward_header(int half, int from_node) const {
        return forward_offset + half * half_bytes + from_node * node_bytes();
    }
    __device__ __forceinline__ int64_t forward_slot(int half, int from_node, int token, int slot_bytes) const {
        return forward_header(half, from_node) + 16 + static_cast<int64_t>(token) * slot_bytes;
    }
    // Combine: entry `index` (of `entry_bytes`) of source node `from_node` in a forwarding area's half,
    // and the node partial slot `token` (of `slot_bytes`) of node `from_node` in an inbox's half.
    __device__ __forceinline__ int64_t combine_entry(int half, int from_node, int index, int entry_bytes) const {
        return forward_offset + half * half_bytes + from_node * node_bytes() + static_cast<int64_t>(index) * entry_bytes;
    }
    __device__ __forceinline__ int64_t inbox_slot(int half, int from_node, int token, int slot_bytes) const {
        return inbox_offset + half * half_bytes + from_node * node_bytes() + static_cast<int64_t>(token) * slot_bytes;
    }
    // Where this rank stages the header and the slots it puts to rail peer `forwarder`.
    __device__ __forceinline__ int64_t stage_header(int forwarder) const { return stage_offset + forwarder * half_bytes; }
    __device__ __forceinline__ int64_t stage_row(int peer, int index, int row_bytes) const {
        return stage_header(peer) + static_cast<int64_t>(index) * row_bytes;
    }
    __device__ __forceinline__ int64_t stage_slot(int forwarder, int token, int slot_bytes) const {
        return stage_header(forwarder) + 16 + static_cast<int64_t>(token) * slot_bytes;
    }

    // Every lane of a warp, after its stores of `bytes` staged at `src` (an offset of this window) for
    // rail peer `peer`: they are put at `dst` of the peer's window, on the warp's context.
    __device__ __forceinline__ void put_staged(int peer, int64_t src, int64_t dst, int bytes, int lane) const {
        __threadfence();  // this lane's stores before lane 0's puts, which the NIC reads later
        __syncwarp();
        if (lane == 0) {
            const int context = gin.context_of((blockIdx.x * blockDim.x + threadIdx.x) / 32);
            for (int done_bytes = 0; done_bytes < bytes; done_bytes += max_put_bytes) {
                const int piece = min(max_put_bytes, bytes - done_bytes);
                gin.put(context, peer, dst + done_bytes, src + done_bytes, static_cast<uint64_t>(piece));
            }
        }
        __syncwarp();
    }
    // Dispatch: the staged slot `token` for rail peer `forwarder`, into its forwarding area.
    __device__ __forceinline__ void put_slot(int forwarder, int half, int token, int slot_bytes, int lane) const {
        put_staged(forwarder, stage_slot(forwarder, token, slot_bytes), forward_slot(half, node(), token, slot_bytes),
                   slot_bytes, lane);
    }

    // Every thread of the last block of a rail stage: to each rail peer, for a dispatch (`num_tokens`
    // >= 0) the header (`num_tokens`, the call mark, the tag's fingerprint) and this rank's tag, for a
    // combine the tags of this rank's node (its ranks signalled them here); then a strong signal per
    // context; then flush, so that staging may be rewritten by the next call.
    __device__ __forceinline__ void signal_rails(CallTag tag, int half, int num_tokens) const {
        uint8_t* mine = local();
        int slot;
        const int64_t tag_offset = gin_publish_tag(mine, rank, tag, false, slot);
        for (int to_node = threadIdx.x; to_node < num_nodes(); to_node += blockDim.x) {
            if (to_node == node()) continue;
            const int peer = rail_peer(to_node);
            // a dispatch's header, then this rank's tag; a combine's node tags instead
            int64_t tags = tag_offset;
            uint64_t tag_bytes = 8;
            if (num_tokens >= 0) {
                int* header = reinterpret_cast<int*>(at(stage_header(peer)));
                header[0] = num_tokens;
                header[1] = static_cast<int>(call_mark());
                header[2] = static_cast<int>(tag.fingerprint);
                gin.put(0, peer, forward_header(half, node()), stage_header(peer), 16);
            } else {
                tags = reinterpret_cast<uint8_t*>(tag_words(mine, slot, node() * node_ranks)) - mine;
                tag_bytes = static_cast<uint64_t>(8 * node_ranks);
            }
            gin_put_signal(gin, peer, tags, tag_bytes, slot * num_ranks + rank, num_contexts);
        }
        gin_flush_contexts(gin, num_contexts);
    }

    // Every thread of every block of the forwarding stage: each rail peer's signal on every context
    // (a strong signal lands after every earlier put of its context). False after a timeout.
    __device__ __forceinline__ bool wait_rails(int phase, uint64_t timeout_ns) const {
        __shared__ int ok_flag;
        if (threadIdx.x == 0) ok_flag = 1;
        __syncthreads();
        const int slot = static_cast<int>(ld_volatile(ctrl_of(local()) + kCtrlEpoch) & 1u);
        for (int from_node = threadIdx.x; from_node < num_nodes(); from_node += blockDim.x) {
            if (from_node == node()) continue;
            const int peer = rail_peer(from_node);
            for (int c = 0; c < num_contexts; ++c) {
                if (!gin.wait_signal(c, slot * num_ranks + peer, 1, peer, phase, timeout_ns)) {
                    ok_flag = 0;
                    break;
                }
            }
        }
        __syncthreads();
        __threadfence();  // reads after the wait see what the signals covered
        return ok_flag != 0;
    }

    // Every thread of the last block of a stage that stored to the node: to each rank of the node
    // (this one included) this rank's tag, with `with_rails` its rail peers' too (forwarded), then an
    // arrival.
    __device__ __forceinline__ void signal_node(CallTag tag, bool with_rails) const {
        __threadfence_system();
        uint8_t* mine = local();
        const int slot = static_cast<int>(ld_volatile(ctrl_of(mine) + kCtrlEpoch) & 1u);
        for (int j = threadIdx.x; j < node_ranks; j += blockDim.x) {
            const int peer = node() * node_ranks + j;
            for (int from_node = 0; from_node < num_nodes(); ++from_node) {
                const int source = rail_peer(from_node);
                if (!with_rails && source != rank) continue;
                uint32_t* to = tag_words(lsa.bases[peer], slot, source);
                const uint32_t* from = tag_words(mine, slot, source);
                to[0] = source == rank ? tag.seq : ld_volatile(from);
                to[1] = source == rank ? tag.fingerprint : ld_volatile(from + 1);
            }
            red_release_sys_add(ctrl_of(lsa.bases[peer]) + kCtrlArrive + rank, 1u);
        }
    }

    // Every thread of a block: each node rank's arrival (epoch + 1), as LsaTransport::wait_all.
    __device__ __forceinline__ bool wait_all(int phase, uint64_t timeout_ns) const {
        uint8_t* mine = local();
        uint32_t* ctrl = ctrl_of(mine);
        __shared__ int ok_flag;
        if (threadIdx.x == 0) ok_flag = 1;
        __syncthreads();
        const uint32_t target = wait_target(mine);
        for (int j = threadIdx.x; j < node_ranks; j += blockDim.x) {
            const int peer = node() * node_ranks + j;
            const uint64_t start = global_timer_ns();
            while (static_cast<int32_t>(ld_acquire_sys(ctrl + kCtrlArrive + peer) - target) < 0) {
                if (global_timer_ns() - start > timeout_ns) {
                    record_error(mine, kErrTimeout, rank, peer, phase);
                    ok_flag = 0;
                    break;
                }
                if (ld_volatile(ctrl + kCtrlError) != 0u) { ok_flag = 0; break; }
            }
        }
        __syncthreads();
        __threadfence();
        return ok_flag != 0;
    }

    // Every thread of every block, at the end of a data kernel (after its wait ended the phase): the
    // last block resets the rail signals of the phase that ended (the control kernels reach the other
    // nodes through comm/gin_control.cuh).
    __device__ __forceinline__ void end_block() const {
        __syncthreads();
        if (threadIdx.x != 0) return;
        __threadfence();
        const uint32_t before = atomicAdd(done, 1u);
        if (before != gridDim.x - 1) return;
        __threadfence();
        if constexpr (!Gin::kNicCountsBlocks) *done = 0u;   // no NIC zeroes it: ready for the next launch
        uint32_t* ctrl = ctrl_of(local());
        const int slot = static_cast<int>((ld_volatile(ctrl + kCtrlEpoch) - 1u) & 1u);
        for (int p = 0; p < num_ranks; ++p) {
            if (in_node(p)) continue;
            for (int c = 0; c < num_contexts; ++c) gin.reset_signal(c, slot * num_ranks + p);
        }
    }
};

}  // namespace deep_ep::comm
