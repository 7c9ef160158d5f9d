// The scale-up transport over loads and stores (LSA): every peer's window is addressable from this
// GPU (NVLink peer memory of NCCL's symmetric window, or slices of one allocation for emulated ranks).
// Kernels reach peers only through it: put/get (and their warp-chunk forms) at a byte offset of a
// peer's window, signal_all to publish this rank's writes, wait_all to wait for every peer's signal.
#pragma once

#include "../common/copy.cuh"
#include "window.cuh"

namespace deep_ep::comm {

struct LsaTransport {
    uint8_t* const* bases;  // [num_ranks] peers' window bases as seen from this GPU (shared memory)
    int rank, num_ranks;

    __device__ __forceinline__ uint8_t* local() const { return bases[rank]; }

    // A rank alone stages nothing in any window, so its data kernels neither signal nor wait and its
    // epoch and arrival count stay equal; its notify kernel and barrier still signal and wait on
    // itself, one wait (one epoch advance) per signal.
    __device__ __forceinline__ bool exchanges() const { return num_ranks > 1; }

    template <typename T>
    __device__ __forceinline__ void put(int peer, int64_t offset, T value) const {
        *reinterpret_cast<T*>(bases[peer] + offset) = value;
    }
    template <typename T>
    __device__ __forceinline__ T get(int peer, int64_t offset) const {
        return __ldcg(reinterpret_cast<const T*>(bases[peer] + offset));
    }
    // A 64-bit flag at ``offset`` of a peer's window, stored with system-scope release: the writes
    // this thread ordered before it (a fence covering other threads' writes included) are visible to
    // a peer that reads the flag with acquire.
    __device__ __forceinline__ void put_release(int peer, int64_t offset, uint64_t value) const {
        st_release_sys_u64(reinterpret_cast<uint64_t*>(bases[peer] + offset), value);
    }
    template <int kUnroll, int kVecs>
    __device__ __forceinline__ void put_chunk(int peer, int64_t offset, int base, int lane, const int4 (&v)[kUnroll]) const {
        store_chunk<kUnroll, kVecs>(reinterpret_cast<int4*>(bases[peer] + offset), base, lane, v);
    }
    template <int kUnroll, int kVecs>
    __device__ __forceinline__ void get_chunk(int peer, int64_t offset, int base, int lane, int4 (&v)[kUnroll]) const {
        load_chunk<kUnroll, kVecs, true>(reinterpret_cast<const int4*>(bases[peer] + offset), base, lane, v);
    }

    // By the last block of a producer phase (`last_block`). The system-scope release increment makes
    // every earlier write of this GPU, the tag included, visible to a peer that observes it with
    // acquire. The tag goes into the slot of this rank's epoch parity: a peer runs at most one call
    // ahead, so two slots never overwrite a tag not yet read.
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

    // Wait until each peer has signalled epoch + 1 times (epoch: this rank's completed waits); after
    // `timeout_ns`, record rank, missing peer and phase in the control region and return false.
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
