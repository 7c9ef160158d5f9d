// The scale-up transport over loads and stores (LSA): every peer's window is addressable from this
// GPU, either NVLink peer memory of NCCL's symmetric window, or, for ranks emulated on one GPU, a
// slice of one allocation. Kernels reach peers only through this object:
//   put / put_chunk   store a value / a warp's row chunk into a peer's window (at a byte offset),
//   get / get_chunk   coherent load from a peer's window,
//   signal_all        tell every peer that this rank's writes into their windows are complete (with
//                     the call's tag, window.cuh),
//   wait_all          wait until every peer has signalled this round, with a timeout that records
//                     rank, peer and phase.
// A transport over RDMA (NCCL GIN) implements the same operations: a put becomes a GIN put from
// this rank's window, a signal a GIN signal, a wait a wait on GIN signals.
#pragma once

#include "../common/copy.cuh"
#include "window.cuh"

namespace deep_ep::comm {

struct LsaTransport {
    uint8_t* const* bases;  // [num_ranks] peers' window bases as seen from this GPU (shared memory)
    int rank, num_ranks;

    // This rank's own window (control region, received rows, staged combine rows).
    __device__ __forceinline__ uint8_t* local() const { return bases[rank]; }

    // Whether the data phases exchange signals. A rank alone stages nothing in any window (its rows
    // go straight between the caller's tensors), so its dispatch and combine kernels neither signal
    // nor wait: no grid-wide meeting of their blocks, and the epoch and the arrival count stay
    // equal (both untouched). The notify kernel and the barrier still exchange, with itself: each
    // signal is matched by one wait, which advances the epoch.
    __device__ __forceinline__ bool exchanges() const { return num_ranks > 1; }

    template <typename T>
    __device__ __forceinline__ void put(int peer, int64_t offset, T value) const {
        *reinterpret_cast<T*>(bases[peer] + offset) = value;
    }
    template <typename T>
    __device__ __forceinline__ T get(int peer, int64_t offset) const {
        return __ldcg(reinterpret_cast<const T*>(bases[peer] + offset));
    }
    template <int kUnroll, int kVecs>
    __device__ __forceinline__ void put_chunk(int peer, int64_t offset, int base, int lane, const int4 (&v)[kUnroll]) const {
        store_chunk<kUnroll, kVecs>(reinterpret_cast<int4*>(bases[peer] + offset), base, lane, v);
    }
    template <int kUnroll, int kVecs>
    __device__ __forceinline__ void get_chunk(int peer, int64_t offset, int base, int lane, int4 (&v)[kUnroll]) const {
        load_chunk<kUnroll, kVecs, true>(reinterpret_cast<const int4*>(bases[peer] + offset), base, lane, v);
    }

    // Called by the last block of a producer phase (see `last_block`): tell every peer that this
    // rank's writes into their windows are complete. Release semantics at system scope make every
    // write this GPU issued before visible to a peer that observes the increment with acquire.
    // The call's tag goes first, into the slot of this rank's epoch parity (a peer runs at most one
    // call ahead, so two slots never overwrite a tag not yet read); the release increment orders it.
    __device__ __forceinline__ void signal_all(CallTag tag) const {
        __threadfence_system();
        const int slot = static_cast<int>(ld_volatile(ctrl_of(local()) + kCtrlEpoch) & 1u);
        for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
            uint32_t* t = tag_words(bases[p], slot, rank);
            t[0] = tag.seq;
            t[1] = tag.fingerprint;
            red_release_sys_add(ctrl_of(bases[p]) + kCtrlArrive + rank, 1u);
        }
    }

    // Wait (every block that calls it) until each peer has signalled `epoch + 1` times, where
    // `epoch` is this rank's count of completed waits. Gives up after `timeout_ns`: records the
    // rank, the first missing peer and the phase in the control region and returns false.
    __device__ __forceinline__ bool wait_all(int phase, uint64_t timeout_ns) const {
        uint8_t* my_window = local();
        uint32_t* ctrl = ctrl_of(my_window);
        __shared__ int ok_flag;
        if (threadIdx.x == 0) ok_flag = 1;
        __syncthreads();
        const uint32_t target = wait_target(my_window);
        for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
            const uint64_t start = global_timer_ns();
            while (static_cast<int32_t>(ld_acquire_sys(ctrl + kCtrlArrive + p) - target) < 0) {
                if (global_timer_ns() - start > timeout_ns) {
                    record_error(my_window, kErrTimeout, rank, p, phase);
                    ok_flag = 0;
                    break;
                }
                if (ld_volatile(ctrl + kCtrlError) != 0u) { ok_flag = 0; break; }
            }
        }
        __syncthreads();
        __threadfence();  // reads after the wait see what the peers wrote before signalling
        return ok_flag != 0;
    }
};

}  // namespace deep_ep::comm
