// All-gather / reduce-scatter sessions on GPU buffers (ElasticBuffer.all_gather / reduce_scatter).
// Across GPUs, data moves on copy engines and flags through stream memory operations, both queued by
// the host (deep_ep/backends/gpu/agrs.py); no SM takes part. One kernel here reports the peers'
// window addresses as this GPU sees them (once per agrs_set_config), for the host to aim its copies.
// Ranks emulated on one GPU move the same bytes and flags with the three kernels below instead (a
// copy, a row of flags, a wait with a GPU-side timeout): there, copy-engine copies and stream memory
// operations of ranks that wait for each other stalled the GPU's front end.
// Each window holds, from the AGRS region's start, a header of u32 words [kAgrsHeaderRows][num_ranks]
// (word row * num_ranks + rank: what that rank wrote), then the session space.
// The host reads these constants (one `constexpr int` per line).
#pragma once

#include "../comm/pp.cuh"

namespace deep_ep {

constexpr int kAgrsThreads = 32;       // threads of the peer-address kernel
constexpr int kAgrsMaxOps = 32;        // calls per session (AGRS_MAX_OPS_PER_SESSION)
constexpr int kAgrsEnteredRow = 0;     // the latest session each rank opened (its space is free)
constexpr int kAgrsConfigRow = 1;      // [2] each rank's agrs_set_config: session bytes / 32, calls
constexpr int kAgrsFlagRow = 3;        // [kAgrsMaxOps] the session in which each rank's call k arrived
constexpr int kAgrsHeaderRows = kAgrsFlagRow + kAgrsMaxOps;
constexpr int kAgrsCopyThreads = 512;  // threads per block of the emulated ranks' copy kernel
constexpr int kAgrsCopyUnroll = 8;     // its 16-byte loads in flight per thread

// The arguments of the wait kernel (host mirror: deep_ep/backends/gpu/agrs.py).
struct AgrsWaitArgs {
    const uint32_t* row;    // this rank's header row [num_ranks]: word p is what rank p wrote
    uint32_t session;       // wait until every word reaches it (wrapping u32 comparison)
    int phase;              // kPhaseAgrsEntered or kPhaseAgrsCall (common/abi.cuh), recorded on a timeout
    uint64_t timeout_ns;
    uint32_t* err_host;     // mapped host copy of an error record (may be null)
};

// The arguments of the flag kernel (host mirror: deep_ep/backends/gpu/agrs.py).
struct AgrsFlagArgs {
    int64_t row_offset;     // byte offset of the header row in every window
    uint32_t session;       // the value this rank writes into its word of the row in every window
};

// Every peer's window base, as a 64-bit address per rank.
__device__ __forceinline__ void agrs_peers_impl(const comm::LsaTransport& tr, uint64_t* out) {
    for (int p = threadIdx.x; p < tr.num_ranks; p += blockDim.x)
        out[p] = reinterpret_cast<uint64_t>(comm::peer_bytes(tr, p, 0));
}

// One block: after every earlier write of this GPU (the copy kernels before it on the stream),
// write the session into this rank's word of the row in every rank's window. Nothing once this rank
// recorded an error (a wait that gave up): a peer must not be told that bytes arrived which were
// never sent, or that a space is free which was not; it times out and names this rank instead.
__device__ __forceinline__ void agrs_flags_impl(const comm::LsaTransport& tr, const AgrsFlagArgs& a) {
    if (comm::has_error(tr.local())) return;
    __threadfence_system();
    for (int p = threadIdx.x; p < tr.num_ranks; p += blockDim.x)
        st_release_sys_u32(reinterpret_cast<uint32_t*>(comm::peer_bytes(tr, p, a.row_offset)) + tr.rank, a.session);
}

// Every thread of the grid: the copy of one piece, skipped once this rank recorded an error (the
// wait before it gave up: the peer's space may still hold outputs it reads).
__device__ __forceinline__ void agrs_copy_impl(const comm::LsaTransport& tr, uint8_t* dst, const uint8_t* src,
                                               int64_t num_bytes) {
    if (comm::has_error(tr.local())) return;
    grid_copy_bytes<kAgrsCopyUnroll>(dst, src, num_bytes);
}

// One block: thread p waits until rank p's word of the row reaches the session; after the timeout it
// records (kErrTimeout, rank, p, phase) in this rank's control region and copies it to the host.
// The flags are written after the bytes they announce (the flag kernel, or a stream memory operation,
// which fences the copies queued before it).
__device__ __forceinline__ void agrs_wait_impl(const comm::LsaTransport& tr, const AgrsWaitArgs& a) {
    uint8_t* my_window = tr.local();
    for (int p = threadIdx.x; p < tr.num_ranks; p += blockDim.x) {
        const uint64_t start = global_timer_ns();
        while (static_cast<int32_t>(ld_acquire_sys(a.row + p) - a.session) < 0) {
            if (comm::has_error(my_window)) break;
            if (global_timer_ns() - start > a.timeout_ns) {
                comm::record_error(my_window, kErrTimeout, tr.rank, p, a.phase);
                break;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const volatile uint32_t* record = reinterpret_cast<const volatile uint32_t*>(comm::ctrl_of(my_window) + kCtrlError);
        comm::error_to_host(record, record[0], a.err_host);
    }
}

}  // namespace deep_ep
