// The transport of the control kernels (a dispatch's notify and layout stages, the GPU barrier) when
// the buffer spans several nodes: the ranks of this rank's node by loads and stores, as LsaTransport
// reaches them, the ranks of other nodes only by GIN puts and signals, as over a real network. The
// control kernels are templates over LsaTransport (one node) and this type, whose member functions
// have LsaTransport's names (comm/lsa.cuh). An exchange carries each rank's *region* (its bytes at
// `region_offset + rank * region_stride` of its window: a dispatch's count row; none for the barrier)
// to the same offset of every window, with the call tag:
//   - put<T> stores into a rank of the node; the region reaches the others whole, from signal_all;
//   - signal_all (every thread of the one block that ends the producer phase), direct mode
//     (GinDirectTransport): the region and the tag are put to every GIN peer on context 0, then a
//     strong signal; the node's ranks get the tag and an arrival by stores. Hybrid mode
//     (GinHybridTransport, DeepEP's scale-out then scale-up order): the same to the rail peers only;
//   - wait_all (every thread of one block): direct mode waits for each GIN peer's signal on context 0
//     and the node's arrivals. Hybrid mode waits for the rail peers' signals, stores their regions
//     into every rank of its node (forwarding), passes the node its own tag and its rail peers' with an
//     arrival (`signal_node`), then waits for the node's arrivals: a rank of the node arrives only
//     once it has forwarded its rail peers', so after the wait every rank's region and tag are here;
//   - end_block (every block, at the kernel's end): counts the block in the emulated NIC's `done`
//     word, so the NIC launched beside the kernel (deep_ep/backends/gpu/modules.py) ends with it.
// Signals are the data phases' [epoch parity][source rank] ones, on context 0: a wait resets the slot
// it consumed (a peer signals that slot again two phases later, after this rank's next signal). Every
// wait gives up after the timeout and records the rank, the peer and the phase, as the data waits do.
#pragma once

#include "gin_direct.cuh"
#include "gin_hybrid.cuh"

namespace deep_ep::comm {

template <typename Scaleout>
struct GinControlTransport {
    Scaleout net;              // GinDirectTransport<Gin> or GinHybridTransport<Gin>
    int rank, num_ranks;
    int64_t region_offset = 0, region_stride = 0;
    int region_bytes = 0;      // a multiple of 4

    static constexpr bool kRails = kForwards<Scaleout>;

    __device__ __forceinline__ uint8_t* local() const { return net.local(); }
    __device__ __forceinline__ bool exchanges() const { return num_ranks > 1; }
    // Whether `peer` is reached by loads and stores (else through GIN, in hybrid mode as a rail peer's
    // forwarded region).
    __device__ __forceinline__ bool by_stores(int peer) const {
        if constexpr (kRails) return net.in_node(peer);
        else return net.by_lsa(peer);
    }
    // Whether this rank waits for `peer`'s GIN signal (direct: every peer of another node; hybrid: the
    // rail peers).
    __device__ __forceinline__ bool signals_by_gin(int peer) const {
        if constexpr (kRails) return !net.in_node(peer) && peer % net.node_ranks == rank % net.node_ranks;
        else return !net.by_lsa(peer);
    }

    template <typename T>
    __device__ __forceinline__ void put(int peer, int64_t offset, T value) const {
        if (by_stores(peer)) *reinterpret_cast<T*>(net.lsa.bases[peer] + offset) = value;
    }

    // One thread: this rank's region and tag (at `tag_offset`) to `peer`, then a strong signal, all on
    // context 0, so that the signal lands after both.
    __device__ __forceinline__ void put_region(int peer, int slot, int64_t tag_offset) const {
        const int64_t region = region_offset + rank * region_stride;
        for (int sent = 0; sent < region_bytes; sent += net.max_put_bytes) {
            const int piece = min(net.max_put_bytes, region_bytes - sent);
            net.gin.put(0, peer, region + sent, region + sent, static_cast<uint64_t>(piece));
        }
        gin_put_signal(net.gin, peer, tag_offset, 8, slot * num_ranks + rank, 1);
    }

    __device__ __forceinline__ void signal_all(CallTag tag) const {
        uint8_t* mine = local();
        int slot;
        const int64_t tag_offset = gin_publish_tag(mine, rank, tag, false, slot);
        if constexpr (kRails) {
            for (int to_node = threadIdx.x; to_node < net.num_nodes(); to_node += blockDim.x)
                if (to_node != net.node()) put_region(net.rail_peer(to_node), slot, tag_offset);
        } else {
            for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
                if (net.by_lsa(p)) store_tag(net.lsa.bases[p], slot, rank, tag, true);
                else put_region(p, slot, tag_offset);
            }
        }
        gin_flush_contexts(net.gin, 1);  // context 0 only: the region and the tag may be rewritten after
    }

    // Hybrid mode, after the rail waits: every rail peer's region, landed here, into every other rank
    // of this node, one 4-byte word per thread at a time.
    __device__ __forceinline__ void forward_regions() const {
        const int node_ranks = net.node_ranks, words = region_bytes / 4;
        const int per_source = (node_ranks - 1) * words;
        const int64_t total = static_cast<int64_t>(net.num_nodes() - 1) * per_source;
        const uint8_t* mine = local();
        for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
            const int other_node = static_cast<int>(i / per_source), rest = static_cast<int>(i % per_source);
            const int from_node = other_node < net.node() ? other_node : other_node + 1;
            const int peer_index = rest / words, word = rest % words;
            const int local_index = rank % node_ranks;
            const int to = net.node() * node_ranks + (peer_index < local_index ? peer_index : peer_index + 1);
            const int64_t offset = region_offset + net.rail_peer(from_node) * region_stride + 4 * word;
            *reinterpret_cast<uint32_t*>(net.lsa.bases[to] + offset) = __ldcg(reinterpret_cast<const uint32_t*>(mine + offset));
        }
    }

    __device__ __forceinline__ bool wait_all(int phase, uint64_t timeout_ns) const {
        uint8_t* mine = local();
        uint32_t* ctrl = ctrl_of(mine);
        __shared__ int ok_flag;
        if (threadIdx.x == 0) ok_flag = 1;
        __syncthreads();
        const uint32_t epoch = ld_volatile(ctrl + kCtrlEpoch);
        const int slot = static_cast<int>(epoch & 1u);
        for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
            if (signals_by_gin(p)) {
                if (net.gin.wait_signal(0, slot * num_ranks + p, 1, p, phase, timeout_ns)) net.gin.reset_signal(0, slot * num_ranks + p);
                else ok_flag = 0;
                continue;
            }
            if constexpr (!kRails) {  // hybrid: the node is waited for below, after forwarding
                const uint64_t start = global_timer_ns();
                while (static_cast<int32_t>(ld_acquire_sys(ctrl + kCtrlArrive + p) - (epoch + 1u)) < 0) {
                    if (global_timer_ns() - start > timeout_ns) {
                        record_error(mine, kErrTimeout, rank, p, phase);
                        ok_flag = 0;
                        break;
                    }
                    if (ld_volatile(ctrl + kCtrlError) != 0u) { ok_flag = 0; break; }
                }
            }
        }
        __syncthreads();
        __threadfence();  // reads after the wait see what the signals covered
        const bool ok = ok_flag != 0;
        if constexpr (kRails) {
            // A rail peer missing: the node is not told, so its ranks' waits record this rank as missing.
            if (!ok) return false;
            forward_regions();
            const uint32_t* own = tag_words(mine, slot, rank);
            const CallTag tag{ld_volatile(own), ld_volatile(own + 1)};
            __syncthreads();  // every forwarded word before any arrival (signal_node fences, then arrives)
            net.signal_node(tag, true);
            return net.wait_all(phase, timeout_ns);
        }
        return ok;
    }

    // Every block of the kernel, at its end: the emulated NIC beside it ends once every block has.
    __device__ __forceinline__ void end_block() const {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(net.done, 1u);
        }
    }
};

template <typename Scaleout>
__device__ __forceinline__ void set_control_region(GinControlTransport<Scaleout>& tr, int64_t offset, int64_t stride,
                                                   int bytes) {
    tr.region_offset = offset;
    tr.region_stride = stride;
    tr.region_bytes = bytes;
}

template <typename Scaleout>
__device__ __forceinline__ void end_control_block(const GinControlTransport<Scaleout>& tr) {
    tr.end_block();
}

}  // namespace deep_ep::comm
