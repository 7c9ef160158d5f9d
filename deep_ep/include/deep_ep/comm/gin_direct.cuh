// The direct-mode scale-out transport: peers of this rank's node (`node_ranks` consecutive ranks;
// 1: this rank alone) are reached by loads and stores as LsaTransport reaches them, every other peer
// by GIN puts, with the member functions the data kernels call on LsaTransport (comm/lsa.cuh), so
// that dispatch and combine are the same kernels with another transport type. For a GIN peer:
//   - put / put_chunk write into this rank's staging area (one slice of half_bytes per peer, after
//     the window), at the destination's offset within its receive half; `end_row` (one warp, after
//     a row's last store) puts the staged row into the peer's window, on the warp's context;
//   - get / get_chunk read this rank's own window: combine rows were pushed here by their owners
//     (`kPushes`, comm/push.cuh; the kernels choose the row's offset);
//   - signal_all (the last block of a send phase) puts the call tag and a strong signal per context
//     to every GIN peer, then flushes, so staging may be rewritten by the next phase; node peers and
//     this rank itself are signalled through their control words, as LsaTransport does;
//   - wait_all waits for each peer's signal on every context: a strong signal lands after every
//     earlier put of its (context, peer). Signals are [epoch parity][source rank]: a peer signals
//     the slot of phase e + 2 only after this rank's phase e + 1, so `end_block` resets the slot of
//     the phase that just ended.
// The control kernels (notify and layout, barrier) use this transport's control form,
// comm/gin_control.cuh.
#pragma once

#include "../common/copy.cuh"
#include "gin.cuh"
#include "lsa.cuh"
#include "push.cuh"

namespace deep_ep::comm {

template <typename Gin>
struct GinDirectTransport {
    LsaTransport lsa;      // the windows of this rank and its node (as the NVLink kernels reach them)
    Gin gin;
    int rank, num_ranks;
    int num_contexts;
    int max_put_bytes;     // the largest single put (the emulated NIC's staging slot)
    int node_ranks;        // ranks of a node, reached by loads and stores
    int64_t recv_offset, half_bytes, stage_offset;
    uint32_t* done;        // [2] user blocks that ended, NIC warps that ended (the emulated NIC's stop;
                           // over NCCL's GIN the last block zeroes the first)

    __device__ __forceinline__ uint8_t* local() const { return lsa.local(); }
    __device__ __forceinline__ bool exchanges() const { return num_ranks > 1; }
    __device__ __forceinline__ bool by_lsa(int peer) const { return peer / node_ranks == rank / node_ranks; }

    // Where a row bound for `peer` at `offset` of its window is staged in this rank's window.
    __device__ __forceinline__ int64_t stage_of(int peer, int64_t offset) const {
        return stage_offset + peer * half_bytes + (offset - recv_offset) % half_bytes;
    }

    // Where a row bound for `peer` at `offset` of its window is written: there, or staged here.
    __device__ __forceinline__ uint8_t* row_target(int peer, int64_t offset) const {
        return by_lsa(peer) ? lsa.bases[peer] + offset : local() + stage_of(peer, offset);
    }

    template <typename T>
    __device__ __forceinline__ void put(int peer, int64_t offset, T value) const {
        *reinterpret_cast<T*>(row_target(peer, offset)) = value;
    }
    template <typename T>
    __device__ __forceinline__ T get(int, int64_t offset) const {
        return __ldcg(reinterpret_cast<const T*>(local() + offset));
    }
    template <int kUnroll, int kVecs>
    __device__ __forceinline__ void put_chunk(int peer, int64_t offset, int base, int lane, const int4 (&v)[kUnroll]) const {
        store_chunk<kUnroll, kVecs>(reinterpret_cast<int4*>(row_target(peer, offset)), base, lane, v);
    }
    template <int kUnroll, int kVecs>
    __device__ __forceinline__ void get_chunk(int, int64_t offset, int base, int lane, int4 (&v)[kUnroll]) const {
        load_chunk<kUnroll, kVecs, true>(reinterpret_cast<const int4*>(local() + offset), base, lane, v);
    }

    // Every lane of a warp, after its stores of the row bound for `peer` at `offset` (`bytes` long).
    __device__ __forceinline__ void end_row(int peer, int64_t offset, int bytes, int lane) const {
        if (by_lsa(peer)) return;  // stored in place; signal_all's fence publishes it
        __threadfence();  // this lane's stores before lane 0's puts, which the NIC reads later
        __syncwarp();
        if (lane == 0) {
            const int context = gin.context_of((blockIdx.x * blockDim.x + threadIdx.x) / 32);
            const int64_t src = stage_of(peer, offset);
            for (int done_bytes = 0; done_bytes < bytes; done_bytes += max_put_bytes) {
                const int piece = min(max_put_bytes, bytes - done_bytes);
                gin.put(context, peer, offset + done_bytes, src + done_bytes, static_cast<uint64_t>(piece));
            }
        }
        __syncwarp();
    }

    // By every thread of the last block of a send phase.
    __device__ __forceinline__ void signal_all(CallTag tag) const {
        uint8_t* mine = local();
        int slot;
        const int64_t tag_offset = gin_publish_tag(mine, rank, tag, true, slot);
        for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
            if (p == rank) continue;
            if (by_lsa(p)) store_tag(lsa.bases[p], slot, rank, tag, true);
            else gin_put_signal(gin, p, tag_offset, 8, slot * num_ranks + rank, num_contexts);
        }
        gin_flush_contexts(gin, num_contexts);
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
            if (by_lsa(p)) {
                const uint64_t start = global_timer_ns();
                while (static_cast<int32_t>(ld_acquire_sys(ctrl + kCtrlArrive + p) - (epoch + 1u)) < 0) {
                    if (global_timer_ns() - start > timeout_ns) {
                        record_error(mine, kErrTimeout, rank, p, phase);
                        ok_flag = 0;
                        break;
                    }
                    if (ld_volatile(ctrl + kCtrlError) != 0u) { ok_flag = 0; break; }
                }
                continue;
            }
            for (int c = 0; c < num_contexts; ++c) {
                if (!gin.wait_signal(c, slot * num_ranks + p, 1, p, phase, timeout_ns)) {
                    ok_flag = 0;
                    break;
                }
            }
        }
        __syncthreads();
        __threadfence();  // reads after the wait see what the signals covered
        return ok_flag != 0;
    }

    // Every thread of every block, at the end of a data kernel (after its wait ended the phase).
    __device__ __forceinline__ void end_block() const {
        __syncthreads();
        if (threadIdx.x != 0) return;
        __threadfence();
        const uint32_t before = atomicAdd(done, 1u);
        if (before != gridDim.x - 1) return;
        // The last block: every block's wait is over and the epoch was advanced past it.
        __threadfence();
        if constexpr (!Gin::kNicCountsBlocks) *done = 0u;   // no NIC zeroes it: ready for the next launch
        uint32_t* ctrl = ctrl_of(local());
        const int slot = static_cast<int>((ld_volatile(ctrl + kCtrlEpoch) - 1u) & 1u);
        for (int p = 0; p < num_ranks; ++p) {
            if (by_lsa(p)) continue;
            for (int c = 0; c < num_contexts; ++c) gin.reset_signal(c, slot * num_ranks + p);
        }
    }
};

}  // namespace deep_ep::comm
