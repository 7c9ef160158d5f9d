// Common device helpers for deep_ep kernels: vector copies, system-scope signals and timed waits.
//
// Every kernel reaches its peers through a table of base pointers, one per rank of the scale-up
// (NVLink / LSA) domain: `peers[r]` is rank r's symmetric window as seen from this GPU. With NCCL the
// table is filled from ncclGetLsaPointer; with emulated ranks on one GPU it points into one
// allocation. The kernels never know which.
#pragma once

#include <cuda_bf16.h>
#ifdef __CUDACC_RTC__
// NVRTC has no libc headers: the fixed-width types come from libcu++ (CCCL).
#include <cuda/std/cstdint>
using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uint8_t;
#else
#include <stdint.h>
#endif

namespace deep_ep {

// ---- window layout (byte offsets inside every rank's window; same on all ranks) -----------------
// Control region: u32 words.
constexpr int kMaxRanks = 1024;
constexpr int kMaxExperts = 1024;           // MAX_EXPERTS in deep_ep/backends/window_layout.py
constexpr int kCtrlArrive = 0;               // [kMaxRanks] signals received from each peer
constexpr int kCtrlEpoch = kMaxRanks;        // barriers this rank has completed
constexpr int kCtrlRound = kMaxRanks + 1;    // data rounds completed (selects the receive half)
constexpr int kCtrlDone = kMaxRanks + 2;     // blocks that finished a producer phase (send, notify)
constexpr int kCtrlDoneWait = kMaxRanks + 3; // blocks that finished a consumer phase (finish_wait)
constexpr int kCtrlError = kMaxRanks + 4;    // [4]: code, rank, peer, phase (first error wins)
constexpr int64_t kCtrlBytes = 64 * 1024;

// Error codes written to kCtrlError[0].
constexpr int kErrTimeout = 1;    // a peer did not arrive in time
constexpr int kErrCapacity = 2;   // this rank would receive more rows than its outputs hold

// Phases, reported with a timeout.
constexpr int kPhaseNotify = 1;    // dispatch: waiting for peers' counts
constexpr int kPhaseDispatch = 2;  // dispatch: waiting for peers' tokens
constexpr int kPhaseCombine = 3;   // combine: waiting for peers' expert outputs

__device__ __forceinline__ uint32_t* ctrl_of(uint8_t* window) { return reinterpret_cast<uint32_t*>(window); }

// ---- memory-model primitives ------------------------------------------------------------------
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_sys_add(uint32_t* p, uint32_t v) {
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// 16-byte loads that bypass L1 (window memory is written by other GPUs / other ranks' kernels).
__device__ __forceinline__ int4 ld_cg(const int4* p) { return __ldcg(p); }
__device__ __forceinline__ void st_cg(int4* p, const int4& v) { __stcg(p, v); }
// Read-only data of this kernel's caller (x, y): the non-coherent path is fine. EP_LOAD_NO_L1=1
// (a build-time tunable, measured by tools/tune_gpu.py) also skips allocating in L1: rows are
// used once.
#ifndef EP_LOAD_NO_L1
#define EP_LOAD_NO_L1 0
#endif
__device__ __forceinline__ int4 ld_nc(const int4* p) {
#if EP_LOAD_NO_L1
    int4 v;
    asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}

// Record an error (the first one wins) in this rank's control region.
__device__ __forceinline__ void record_error(uint8_t* my_window, int code, int rank, int peer, int phase) {
    uint32_t* ctrl = ctrl_of(my_window);
    if (atomicCAS(ctrl + kCtrlError, 0u, static_cast<uint32_t>(code)) == 0u) {
        ctrl[kCtrlError + 1] = rank;
        ctrl[kCtrlError + 2] = peer;
        ctrl[kCtrlError + 3] = phase;
    }
}

// ---- signals between ranks --------------------------------------------------------------------
// Called by the last block of a producer kernel (see `last_block`): tell every peer that this
// rank's writes into their windows are complete. Release semantics at system scope make every
// write this GPU issued before visible to a peer that observes the increment with acquire.
__device__ __forceinline__ void signal_all_peers(uint8_t* const* peers, int rank, int num_ranks) {
    __threadfence_system();
    for (int p = threadIdx.x; p < num_ranks; p += blockDim.x)
        red_release_sys_add(ctrl_of(peers[p]) + kCtrlArrive + rank, 1u);
}

// Returns true in every thread of exactly one block: the last block to finish this phase. Resets
// the done-counter (``slot``) for the next kernel. Each block must have finished its own writes.
// Producer and consumer phases count on separate words: in a kernel that runs both, a block may
// finish its consumer phase early (a recorded error makes waits return at once) while others are
// still producing, and one shared counter would then pick the wrong last block.
// EP_BLOCK_FENCE (build-time tunable, measured by tools/tune_gpu.py): 0 = every thread fences its
// own writes at system scope before the block arrives; 1 = the block meets at bar.sync first and
// one thread fences: bar.sync orders the other threads' writes before thread 0's later operations,
// and the system-scope fence is cumulative over what precedes it in that order (the pattern of a
// cooperative-groups grid sync, at system scope because the writes go to peers' windows).
#ifndef EP_BLOCK_FENCE
#define EP_BLOCK_FENCE 1
#endif
// ``system``: the blocks' writes must be visible to peers (a producer phase); false: only to this
// GPU (a consumer phase, whose writes are local; peers learn of its end through the next signal).
// The count is the release half only: there is no fence after the atomicAdd, so a caller that
// reads other blocks' writes in the last block fences first (signal_all_peers and finish_wait do).
__device__ __forceinline__ void block_fence(bool system) {
    if (system) __threadfence_system();
    else __threadfence();
}

__device__ __forceinline__ bool last_block(uint8_t* my_window, int slot = kCtrlDone, bool system = true) {
    __shared__ bool is_last;
#if !EP_BLOCK_FENCE
    block_fence(system);
#endif
    __syncthreads();
    if (threadIdx.x == 0) {
#if EP_BLOCK_FENCE
        block_fence(system);
#endif
        uint32_t* done = ctrl_of(my_window) + slot;
        uint32_t prev = atomicAdd(done, 1u);
        is_last = (prev == gridDim.x - 1);
        if (is_last) atomicExch(done, 0u);
    }
    __syncthreads();
    return is_last;
}

// Wait (every block that calls it) until each peer has signalled `epoch + 1` times, where `epoch`
// is this rank's count of completed barriers. Gives up after `timeout_ns`: records the rank, the
// first missing peer and the phase in the control region and returns false.
__device__ __forceinline__ bool wait_all_peers(uint8_t* my_window, int rank, int num_ranks, int phase,
                                               uint64_t timeout_ns) {
    uint32_t* ctrl = ctrl_of(my_window);
    __shared__ int ok_flag;
    if (threadIdx.x == 0) ok_flag = 1;
    __syncthreads();
    const uint32_t target = *reinterpret_cast<volatile uint32_t*>(ctrl + kCtrlEpoch) + 1u;
    for (int p = threadIdx.x; p < num_ranks; p += blockDim.x) {
        const uint64_t start = global_timer_ns();
        while (static_cast<int32_t>(ld_acquire_sys(ctrl + kCtrlArrive + p) - target) < 0) {
            if (global_timer_ns() - start > timeout_ns) {
                record_error(my_window, kErrTimeout, rank, p, phase);
                ok_flag = 0;
                break;
            }
            if (*reinterpret_cast<volatile uint32_t*>(ctrl + kCtrlError) != 0u) { ok_flag = 0; break; }
        }
    }
    __syncthreads();
    __threadfence();  // reads after the wait see what the peers wrote before signalling
    return ok_flag != 0;
}

// After every block of a consumer kernel has waited: the last block advances the epoch and, when
// ``err_host`` is given (host memory mapped into the device's address space), copies the error
// record there, so the host sees an error of an asynchronous call at its next call without a copy
// operation on the stream (also under CUDA-graph replay).
__device__ __forceinline__ void finish_wait(uint8_t* my_window, bool advance_round, uint32_t* err_host = nullptr) {
    if (last_block(my_window, kCtrlDoneWait, false) && threadIdx.x == 0) {
        uint32_t* ctrl = ctrl_of(my_window);
        __threadfence();  // every block has arrived: their error records are visible from here on
        const volatile uint32_t* src = reinterpret_cast<const volatile uint32_t*>(ctrl + kCtrlError);
        const uint32_t code = src[0];
        // Reductions (no value comes back): the kernel's end makes them visible to the next one.
        atomicAdd(ctrl + kCtrlEpoch, 1u);
        if (advance_round) atomicAdd(ctrl + kCtrlRound, 1u);
        // Only an error is copied: the window's record is never cleared, so while it reads 0 the
        // host's copy (zeroed at creation) is already right, and a call without an error does not
        // pay for writes and system-scope fences over PCIe.
        if (err_host != nullptr && code != 0u) {
            // rank, peer, phase first, then the code the host tests: never a torn record
            volatile uint32_t* dst = reinterpret_cast<volatile uint32_t*>(err_host);
            for (int i = 1; i < 4; ++i) dst[i] = src[i];
            __threadfence_system();
            dst[0] = code;
            __threadfence_system();
        }
    }
}

__device__ __forceinline__ bool has_error(uint8_t* my_window) {
    return *reinterpret_cast<volatile uint32_t*>(ctrl_of(my_window) + kCtrlError) != 0u;
}

// The receive half this rank's current round uses (rounds alternate halves).
__device__ __forceinline__ int current_half(uint8_t* my_window) {
    return static_cast<int>(*reinterpret_cast<volatile uint32_t*>(ctrl_of(my_window) + kCtrlRound) & 1u);
}

// ---- window rows ------------------------------------------------------------------------------
// Row ``row`` of receive half ``half`` in a window (layout: deep_ep/backends/window_layout.py).
// ``Args`` is any kernel argument struct with recv_offset, half_bytes and row_stride.
template <typename Args>
__device__ __forceinline__ uint8_t* window_row(uint8_t* window, const Args& a, int half, int row) {
    return window + a.recv_offset + half * a.half_bytes + static_cast<int64_t>(row) * a.row_stride;
}

// ---- grid geometry ----------------------------------------------------------------------------
// Lane, global warp index and warp count of a kernel whose warps stride over work items. Warp
// indices go round the blocks first (warp w of block b is w * gridDim + b): a small batch (decode,
// fewer items than warps) is spread over every SM instead of filling the first few blocks.
struct WarpGrid {
    int lane, warp, num_warps;
    __device__ __forceinline__ WarpGrid()
        : lane(static_cast<int>(threadIdx.x & 31)),
          warp(static_cast<int>((threadIdx.x >> 5) * gridDim.x + blockIdx.x)),
          num_warps(static_cast<int>(gridDim.x * (blockDim.x >> 5))) {}
};

// ---- tunables (defaults; tools/tune_gpu.py builds variants) ------------------------------------
// 16-byte vectors per lane per chunk when moving a dispatched row (at most; 8 = 4 KiB per warp),
// and the same for the rows a combine sums (fp32 accumulators: 8 per vector). 0 = balanced: the
// fewest chunks of at most 8 (send) / 4 (combine) vectors, all of equal size (see row_unroll).
#ifndef EP_SEND_UNROLL
#define EP_SEND_UNROLL 0
#endif
#ifndef EP_COMBINE_UNROLL
#define EP_COMBINE_UNROLL 0
#endif

// Vectors per lane per chunk for a row of kVecs 16-byte vectors: kTunable if it is not 0, else
// the fewest chunks of at most kMax each, evened out (e.g. 28 vectors per lane and kMax 8: four
// chunks of 7 rather than 8 + 8 + 8 + 4).
template <int kVecs, int kTunable, int kMax>
__host__ __device__ constexpr int row_unroll() {
    constexpr int per_lane = (kVecs + 31) / 32;
    constexpr int chunks = (per_lane + kMax - 1) / kMax;
    return kTunable != 0 ? kTunable : (per_lane + chunks - 1) / chunks;
}

// ---- warp-wide row chunks ------------------------------------------------------------------
// A warp moves a row of kVecs 16-byte vectors in chunks of 32 * kUnroll vectors: lane l handles
// vectors base + u * 32 + l (u < kUnroll) that exist. Loads of a chunk are all issued before use.
// Stores tunable at build time: EP_STORE_STREAMING=1 stores with the evict-first hint
// (st.global.cs); reads go through ld_nc (EP_LOAD_NO_L1).
#ifndef EP_STORE_STREAMING
#define EP_STORE_STREAMING 0
#endif

__device__ __forceinline__ void store_row_vec(int4* p, const int4& v) {
#if EP_STORE_STREAMING
    __stcs(p, v);
#else
    *p = v;
#endif
}

template <int kUnroll, int kVecs, bool kCoherent>
__device__ __forceinline__ void load_chunk(const int4* src, int base, int lane, int4 (&v)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < kVecs) v[u] = kCoherent ? __ldcg(src + i) : ld_nc(src + i);
    }
}

template <int kUnroll, int kVecs>
__device__ __forceinline__ void store_chunk(int4* dst, int base, int lane, const int4 (&v)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < kVecs) store_row_vec(dst + i, v[u]);
    }
}

// ---- test-only defects -------------------------------------------------------------------------
// The checks of this library must be able to fail: the tests build the kernels with one deliberate
// defect at a time (EP_TEST_DEFECT, set only through DEEP_EP_TEST_DEFECT by tools/mutation_check.py)
// and expect the GPU suite and the bench's check to report it. 0, the default, builds no defect.
#ifndef EP_TEST_DEFECT
#define EP_TEST_DEFECT 0
#endif
constexpr int kDefectDroppedRow = 1;     // dispatch: every 64th output row is not written
constexpr int kDefectWrongRow = 2;       // dispatch: some tokens land in the neighbouring row
constexpr int kDefectMissingBias = 3;    // combine: the first bias is not added
constexpr int kDefectScaledWeight = 4;   // dispatch: the first top-k weight of a row is doubled
constexpr int kDefectStaleScale = 5;     // cached FP8 dispatch: some rows keep stale scale factors
constexpr int kDefectSkippedExpert = 6;  // expanded dispatch: local expert 1 receives no rows

// ---- small math -------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ T ceil_div(T a, T b) { return (a + b - 1) / b; }

__device__ __forceinline__ void bf16x8_to_f32(const int4& v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ int4 f32_to_bf16x8(const float* f) {
    int4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
}

}  // namespace deep_ep
