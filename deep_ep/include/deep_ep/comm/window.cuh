// A rank's window as its own kernels use it: the control region (epoch, round, error record, block
// counters; word offsets in common/abi.cuh) and where receive rows live. Everything here touches
// this rank's own window only; reaching peers is the transport's job (comm/lsa.cuh).
//
// Protocol: every kernel that waits for peers (a consumer phase) ends with `finish_wait`, whose
// last block advances this rank's epoch (`finish_wait_one_block` where one block alone waited, as
// the notify kernel's layout stage does); a wait expects every peer to have signalled epoch + 1
// times. Data rounds alternate between the two receive halves (the round word), so a round never
// overwrites rows a peer may still read from the previous one.
#pragma once

#include "../common/abi.cuh"
#include "../common/ptx.cuh"

namespace deep_ep::comm {

// A call's identity, sent with every signal: its number on the rank (every public call counts,
// refused ones too) and a fingerprint of its configuration. After a wait every rank compares its
// peers' with its own, so a rank that skipped or repeated a call, or that disagrees on the call, is
// found at the next exchange instead of pairing with the wrong call or waiting for a timeout.
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

// The receive half this rank's current round uses (rounds alternate halves).
__device__ __forceinline__ int current_half(uint8_t* my_window) {
    return static_cast<int>(ld_volatile(ctrl_of(my_window) + kCtrlRound) & 1u);
}

// The number of signals from each peer the next wait expects (this rank's epoch + 1).
__device__ __forceinline__ uint32_t wait_target(uint8_t* my_window) {
    return ld_volatile(ctrl_of(my_window) + kCtrlEpoch) + 1u;
}

// The tag words peer ``peer`` writes into a window for a signal sent at epoch parity ``slot``.
__device__ __forceinline__ uint32_t* tag_words(uint8_t* window, int slot, int peer) {
    return ctrl_of(window) + kCtrlTag + (slot * kMaxRanks + peer) * 2;
}

// After a wait (every thread of the block calls it): the first peer whose tag differs from ``mine``
// (-1: none), with its tag. A rank that skipped or repeated a call sees a peer's differing tag, and
// that peer sees its: every rank of a mismatched exchange finds one.
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

// After the wait of a data or barrier kernel (every thread of the block calls it): a peer whose tag
// differs is recorded as an error (kErrMismatch: this rank, that peer, and its call number in the
// phase word), and the caller moves nothing.
__device__ __forceinline__ bool check_tags(uint8_t* my_window, int rank, int num_ranks, CallTag mine) {
    CallTag theirs{0u, 0u};
    const int peer = find_tag_mismatch(my_window, num_ranks, mine, theirs);
    if (peer >= 0 && threadIdx.x == 0) record_error(my_window, kErrMismatch, rank, peer, static_cast<int>(theirs.seq));
    return peer < 0;
}

// Byte offset of row ``row`` of receive half ``half`` in every rank's window (layout:
// deep_ep/backends/gpu/window.py). ``Args`` is any kernel argument struct with recv_offset,
// half_bytes and row_stride.
template <typename Args>
__device__ __forceinline__ int64_t row_offset(const Args& a, int half, int row) {
    return a.recv_offset + half * a.half_bytes + static_cast<int64_t>(row) * a.row_stride;
}

// ---- counting finished blocks -------------------------------------------------------------------
// Returns true in every thread of exactly one block: the last block to finish this phase. Resets
// the done-counter (``slot``) for the next kernel. Each block must have finished its own writes.
// Producer and consumer phases count on separate words: in a kernel that runs both, a block may
// finish its consumer phase early (a recorded error makes waits return at once) while others are
// still producing, and one shared counter would then pick the wrong last block.
// The block meets at bar.sync first and one thread fences: bar.sync orders the other threads'
// writes before thread 0's later operations, and the fence is cumulative over what precedes it in
// that order (the pattern of a cooperative-groups grid sync, at system scope where the writes go to
// peers' windows).
// ``system``: the blocks' writes must be visible to peers (a producer phase); false: only to this
// GPU (a consumer phase, whose writes are local; peers learn of its end through the next signal).
// The count is the release half only: there is no fence after the atomicAdd, so a caller that
// reads other blocks' writes in the last block fences first (the transport's signal and
// finish_wait do).
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

// Copy this rank's error record ``src`` (its code already read: ``code``) to mapped host memory.
// Only an error is copied: the window's record is never cleared, so while it reads 0 the host's
// copy (zeroed at creation) is already right, and a call without an error does not pay for writes
// and system-scope fences over PCIe.
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

// The end of a wait, by one thread once every block that waited is done: advance the epoch (and
// the round), and when ``err_host`` is given (host memory mapped into the device's address space),
// copy the error record there, so the host sees an error of an asynchronous call at its next call
// without a copy operation on the stream (also under CUDA-graph replay).
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
