// A rank's window as its own kernels use it: the control region (word offsets in common/abi.cuh)
// and the receive rows; peers are reached only through comm/lsa.cuh. Protocol: every consumer phase
// (a kernel that waits for peers) ends with `finish_wait`, which advances this rank's epoch; a wait
// expects every peer to have signalled epoch + 1 times. Data rounds alternate between the two
// receive halves, so a round never overwrites rows a peer may still read from the previous one.
#pragma once

#include "../common/abi.cuh"
#include "../common/ptx.cuh"

namespace deep_ep::comm {

// A call's identity, sent with every signal: its number on the rank (refused calls count too) and a
// fingerprint of its configuration, so a rank that skipped, repeated or disagrees on a call is found
// at the next exchange instead of pairing with the wrong call or timing out.
struct CallTag {
    uint32_t seq, fingerprint;
};

__device__ __forceinline__ uint32_t* ctrl_of(uint8_t* window) { return reinterpret_cast<uint32_t*>(window); }

// Record an error (the first one wins) in this rank's control region.
__device__ __forceinline__ void record_error(uint8_t* my_window, int code, int rank, int peer, int phase) {
    uint32_t* ctrl = ctrl_of(my_window);
    if (atomicCAS(ctrl + kCtrlError, 0u, static_cast<uint32_t>(code)) == 0u) {
        ctrl[kCtrlError + 1] = rank;
        ctrl[kCtrlError + 2] = peer;
        ctrl[kCtrlError + 3] = phase;
    }
}

__device__ __forceinline__ bool has_error(uint8_t* my_window) {
    return ld_volatile(ctrl_of(my_window) + kCtrlError) != 0u;
}

__device__ __forceinline__ int current_half(uint8_t* my_window) {
    return static_cast<int>(ld_volatile(ctrl_of(my_window) + kCtrlRound) & 1u);
}

__device__ __forceinline__ uint32_t wait_target(uint8_t* my_window) {
    return ld_volatile(ctrl_of(my_window) + kCtrlEpoch) + 1u;
}

// The tag words peer ``peer`` writes into a window for a signal sent at epoch parity ``slot``.
__device__ __forceinline__ uint32_t* tag_words(uint8_t* window, int slot, int peer) {
    return ctrl_of(window) + kCtrlTag + (slot * kMaxRanks + peer) * 2;
}

// After a wait (every thread of the block): the first peer whose tag differs from ``mine`` (-1: none).
// Both sides of a mismatched exchange see each other's differing tag, so every rank finds one.
__device__ __forceinline__ int find_tag_mismatch(uint8_t* my_window, int num_ranks, CallTag mine, CallTag& theirs) {
    __shared__ int s_peer;
    if (threadIdx.x == 0) s_peer = 0x7fffffff;
    __syncthreads();
    const int slot = static_cast<int>(ld_volatile(ctrl_of(my_window) + kCtrlEpoch) & 1u);
    for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
        const uint32_t* t = tag_words(my_window, slot, p);
        if (ld_volatile(t) != mine.seq || ld_volatile(t + 1) != mine.fingerprint) atomicMin(&s_peer, p);
    }
    __syncthreads();
    const int peer = s_peer == 0x7fffffff ? -1 : s_peer;
    if (peer >= 0) {
        const uint32_t* t = tag_words(my_window, slot, peer);
        theirs = CallTag{ld_volatile(t), ld_volatile(t + 1)};
    }
    __syncthreads();  // s_peer is read before any later call resets it
    return peer;
}

// After a wait (every thread of the block): a differing tag is recorded as kErrMismatch (this rank,
// that peer, its call number in the phase word) and the caller moves nothing.
__device__ __forceinline__ bool check_tags(uint8_t* my_window, int rank, int num_ranks, CallTag mine) {
    CallTag theirs{0u, 0u};
    const int peer = find_tag_mismatch(my_window, num_ranks, mine, theirs);
    if (peer >= 0 && threadIdx.x == 0) record_error(my_window, kErrMismatch, rank, peer, static_cast<int>(theirs.seq));
    return peer < 0;
}

// Byte offset of row ``row`` of receive half ``half`` in every window (deep_ep/backends/gpu/window.py).
template <typename Args>
__device__ __forceinline__ int64_t row_offset(const Args& a, int half, int row) {
    return a.recv_offset + half * a.half_bytes + static_cast<int64_t>(row) * a.row_stride;
}

// last_block: true in every thread of exactly one block, the last to finish this phase (its own
// writes done); resets the counter ``slot`` for the next kernel. Producer and consumer phases count on
// separate words: a block may leave its consumer phase early (after a recorded error, waits return at
// once) while others still produce, and a shared counter would pick the wrong last block. bar.sync
// orders the block's writes before thread 0's fence, which is cumulative over them (the
// cooperative-groups grid-sync pattern); ``system`` scope for a producer phase, whose writes went to
// peers. Release half only: a last block that reads other blocks' writes fences first (signal_all
// and end_wait do).
__device__ __forceinline__ void block_fence(bool system) {
    if (system) __threadfence_system();
    else __threadfence();
}

__device__ __forceinline__ bool last_block(uint8_t* my_window, int slot = kCtrlDone, bool system = true) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        block_fence(system);
        uint32_t* done = ctrl_of(my_window) + slot;
        uint32_t prev = atomicAdd(done, 1u);
        is_last = (prev == gridDim.x - 1);
        if (is_last) atomicExch(done, 0u);
    }
    __syncthreads();
    return is_last;
}

// Copy an error record to mapped host memory only when there is one: the record is never cleared
// and the host's copy starts zeroed, so an error-free call pays no system-scope fences over PCIe.
__device__ __forceinline__ void error_to_host(const volatile uint32_t* src, uint32_t code, uint32_t* err_host) {
    if (err_host != nullptr && code != 0u) {
        // rank, peer, phase first, then the code the host tests: never a torn record
        volatile uint32_t* dst = reinterpret_cast<volatile uint32_t*>(err_host);
        for (int i = 1; i < 4; ++i) dst[i] = src[i];
        __threadfence_system();
        dst[0] = code;
        __threadfence_system();
    }
}

// By one thread once every block that waited is done: advance the epoch (and round) and copy any error
// to mapped host memory, where the host finds it at its next call without a copy on the stream (also
// under CUDA-graph replay).
__device__ __forceinline__ void end_wait(uint8_t* my_window, bool advance_round, uint32_t* err_host) {
    uint32_t* ctrl = ctrl_of(my_window);
    __threadfence();  // every block has arrived: their error records are visible from here on
    const volatile uint32_t* src = reinterpret_cast<const volatile uint32_t*>(ctrl + kCtrlError);
    const uint32_t code = src[0];
    // Reductions (no value comes back): the kernel's end makes them visible to the next one.
    atomicAdd(ctrl + kCtrlEpoch, 1u);
    if (advance_round) atomicAdd(ctrl + kCtrlRound, 1u);
    error_to_host(src, code, err_host);
}

// After every block of a consumer kernel has waited: the last block ends the wait (`end_wait`).
__device__ __forceinline__ void finish_wait(uint8_t* my_window, bool advance_round, uint32_t* err_host = nullptr) {
    if (last_block(my_window, kCtrlDoneWait, false) && threadIdx.x == 0) end_wait(my_window, advance_round, err_host);
}

// The same for a wait that one block of its kernel ran alone (the others never waited).
__device__ __forceinline__ void finish_wait_one_block(uint8_t* my_window, bool advance_round,
                                                      uint32_t* err_host = nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) end_wait(my_window, advance_round, err_host);
}

}  // namespace deep_ep::comm
