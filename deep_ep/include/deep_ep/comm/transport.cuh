// How a kernel obtains its transport: the host passes one `TransportArgs` by value to every kernel
// (deep_ep/backends/gpu/abi.py mirrors both forms); `make_transport` copies the peers' window bases
// once per block into a shared-memory table, which the data loops index.
//   EP_TRANSPORT_NCCL=1: NCCL's device communicator and the buffer's symmetric window (LSA team).
//   EP_TRANSPORT_NCCL=0: ranks emulated on one GPU, window slices of one allocation.
// EP_TRANSPORT_GIN=1 (emulated ranks only): the data kernels' transport is comm/gin_direct.cuh over
// the emulated GIN, whose state `TransportArgs::gin` points at (deep_ep/comm/gin.py lays it out);
// `make_data_transport` is what the dispatch and combine data kernels call, `make_control_transport`
// the control kernels (notify and layout, barrier: comm/gin_control.cuh), `make_transport` the
// kernels that reach every peer by loads and stores (pp, agrs, engram).
// EP_TRANSPORT_GIN=2 (emulated nodes in hybrid mode): the data kernels' transport is
// comm/gin_hybrid.cuh, and TransportArgs ends with the forwarding area's offset.
// EP_TRANSPORT_NCCL=1 with EP_TRANSPORT_GIN=1 or 2: the same scale-out transports over NCCL's GIN
// (NcclGinTransport, comm/gin.cuh) for a group over several NVLink domains; TransportArgs is the
// NCCL one, then the scale-out fields (deep_ep/comm/nccl_gin.py mirrors them). The node's windows
// come from the LSA team, placed at the world ranks of the node (its ranks are consecutive).
#pragma once

#include "lsa.cuh"
#include "push.cuh"

#ifndef EP_TRANSPORT_NCCL
#define EP_TRANSPORT_NCCL 0
#endif
#ifndef EP_TRANSPORT_GIN
#define EP_TRANSPORT_GIN 0
#endif
#if EP_TRANSPORT_GIN
#include "gin_control.cuh"
#endif

#if EP_TRANSPORT_NCCL
#include <nccl.h>
#include <nccl_device.h>
#endif

namespace deep_ep::comm {

#if EP_TRANSPORT_NCCL
struct TransportArgs {
    ncclDevComm comm;      // the device communicator of the buffer's group
    ncclWindow_t window;   // the buffer's symmetric window on it
#if EP_TRANSPORT_GIN
    // mirrored by deep_ep/comm/nccl_gin.py (NcclGinFields)
    const ncclDevComm* gin_comm;    // a copy of `comm` in device memory, which the GIN calls read
    uint32_t* done;                 // [2] this rank's block count (data kernels), and the control kernels'
    int64_t recv_offset, half_bytes;  // the receive halves (every call's layout has the same)
    int64_t stage_offset;           // this rank's staging area: [num_ranks][half_bytes], in the window
    int max_put_bytes;              // the largest single put
    int num_contexts;               // contexts used, at most the device communicator's
    int node_ranks;                 // ranks of a node (its LSA team)
#if EP_TRANSPORT_GIN == 2
    int64_t forward_offset;         // the forwarding area (comm/gin_hybrid.cuh), in the window
    int64_t inbox_offset;           // combine's inbox of node partials, in the window
#endif
#endif
};

__device__ __forceinline__ LsaTransport make_transport(const TransportArgs& t, uint8_t** table) {
    const ncclTeam lsa = ncclTeamLsa(t.comm);
    for (int p = threadIdx.x; p < lsa.nRanks; p += blockDim.x)
        table[p] = static_cast<uint8_t*>(ncclGetLsaPointer(t.window, 0, p));
    __syncthreads();
    return LsaTransport{table, lsa.rank, lsa.nRanks};
}
#else
struct TransportArgs {
    uint8_t* const* peers;  // [num_ranks] device array of the ranks' window slices
    int rank, num_ranks;
#if EP_TRANSPORT_GIN
    // mirrored by deep_ep/comm/gin.py (GinTransportArgs)
    const EmulatedGinArgs* gin;     // this rank's copy (its `done` words are its own)
    int64_t recv_offset, half_bytes;  // the receive halves (every call's layout has the same)
    int64_t stage_offset;           // this rank's staging area: [num_ranks][half_bytes] after the window
    int max_put_bytes;              // the emulated NIC's staging slot
    int num_contexts;               // contexts used (num_qps)
    int node_ranks;                 // ranks of a node, reached by loads and stores (1: every peer by GIN)
#if EP_TRANSPORT_GIN == 2
    int64_t forward_offset;         // the forwarding area (comm/gin_hybrid.cuh), from every window
    int64_t inbox_offset;           // combine's inbox of node partials (comm/gin_hybrid.cuh), likewise
#endif
#endif
};

__device__ __forceinline__ LsaTransport make_transport(const TransportArgs& t, uint8_t** table) {
    for (int p = threadIdx.x; p < t.num_ranks; p += blockDim.x) table[p] = t.peers[p];
    __syncthreads();
    return LsaTransport{table, t.rank, t.num_ranks};
}
#endif

#if EP_TRANSPORT_GIN && EP_TRANSPORT_NCCL && !EP_GIN_NCCL
#error "EP_TRANSPORT_GIN over NCCL needs NCCL's GIN device API (NCCL >= 2.28.7 headers)"
#endif

#if EP_TRANSPORT_GIN
// The window layout of the scale-out transports, the same fields in both argument forms.
template <typename Transport, typename Args>
__device__ __forceinline__ void copy_scaleout_layout(Transport& tr, const Args& t) {
    tr.num_contexts = t.num_contexts;
    tr.max_put_bytes = t.max_put_bytes;
    tr.node_ranks = t.node_ranks;
    tr.recv_offset = t.recv_offset;
    tr.half_bytes = t.half_bytes;
    tr.stage_offset = t.stage_offset;
#if EP_TRANSPORT_GIN == 2
    tr.forward_offset = t.forward_offset;   // hybrid: the rail peers' forwarding slots and the inbox
    tr.inbox_offset = t.inbox_offset;
#endif
}

#endif

#if EP_TRANSPORT_GIN && EP_TRANSPORT_NCCL
#if EP_TRANSPORT_GIN == 2
using DataTransport = GinHybridTransport<NcclGinTransport>;
#else
using DataTransport = GinDirectTransport<NcclGinTransport>;
#endif

// The node's windows at their world ranks (a node's ranks are consecutive; the others stay unset:
// the scale-out transports reach them through GIN only).
__device__ __forceinline__ LsaTransport make_node_transport(const TransportArgs& t, uint8_t** table) {
    const ncclTeam lsa = ncclTeamLsa(t.comm);
    const int first = t.comm.rank - lsa.rank;
    for (int p = threadIdx.x; p < lsa.nRanks; p += blockDim.x)
        table[first + p] = static_cast<uint8_t*>(ncclGetLsaPointer(t.window, 0, p));
    __syncthreads();
    return LsaTransport{table, t.comm.rank, t.comm.nRanks};
}

__device__ __forceinline__ DataTransport make_data_transport(const TransportArgs& t, uint8_t** table) {
    DataTransport tr;
    tr.lsa = make_node_transport(t, table);
#if EP_TRANSPORT_GIN == 2
    const ncclTeam team = ncclTeamRail(*t.gin_comm);   // hybrid: rail peers only
#else
    const ncclTeam team = ncclTeamWorld(*t.gin_comm);
#endif
    tr.gin = NcclGinTransport{t.gin_comm, t.window, team, t.num_contexts};
    tr.rank = t.comm.rank;
    tr.num_ranks = t.comm.nRanks;
    copy_scaleout_layout(tr, t);
    tr.done = t.done;
    return tr;
}
#elif EP_TRANSPORT_GIN
#if EP_TRANSPORT_GIN == 2
using DataTransport = GinHybridTransport<EmulatedGinTransport>;
#else
using DataTransport = GinDirectTransport<EmulatedGinTransport>;
#endif

__device__ __forceinline__ DataTransport make_data_transport(const TransportArgs& t, uint8_t** table) {
    DataTransport tr;
    tr.lsa = make_transport(t, table);
    tr.gin = EmulatedGinTransport{t.gin, t.rank, t.num_contexts};
    tr.rank = t.rank;
    tr.num_ranks = t.num_ranks;
    copy_scaleout_layout(tr, t);
    tr.done = t.gin->done;
    return tr;
}
#else
using DataTransport = LsaTransport;

__device__ __forceinline__ LsaTransport make_data_transport(const TransportArgs& t, uint8_t** table) {
    return make_transport(t, table);
}
#endif

// The control kernels' transport: the scale-out one's control form (comm/gin_control.cuh) across
// nodes (emulated or over NCCL's GIN), else the loads and stores of LsaTransport. `set_control_region` names the bytes each rank
// sends (`bytes` at `offset + rank * stride` of every window); `end_control_block` ends every block.
#if EP_TRANSPORT_GIN
using ControlTransport = GinControlTransport<DataTransport>;

__device__ __forceinline__ ControlTransport make_control_transport(const TransportArgs& t, uint8_t** table) {
    ControlTransport tr;
    tr.net = make_data_transport(t, table);
    tr.rank = tr.net.rank;
    tr.num_ranks = tr.net.num_ranks;
#if EP_TRANSPORT_NCCL
    // No NIC reads the control kernels' block count: they count into a word of their own, so the
    // data kernels' count (the last block's test) is untouched.
    tr.net.done = t.done + 1;
#endif
    return tr;
}
#else
using ControlTransport = LsaTransport;

__device__ __forceinline__ LsaTransport make_control_transport(const TransportArgs& t, uint8_t** table) {
    return make_transport(t, table);
}
#endif

// LsaTransport stores every peer's bytes where they belong, and its blocks have no NIC to tell.
__device__ __forceinline__ void set_control_region(LsaTransport&, int64_t, int64_t, int) {}
__device__ __forceinline__ void end_control_block(const LsaTransport&) {}

// At the end of every block of a data kernel: what the transport does once the kernel's phases are over.
template <typename Transport>
__device__ __forceinline__ void end_data_block(const Transport& tr) {
    if constexpr (kPushes<Transport> || kForwards<Transport>) tr.end_block();
}

}  // namespace deep_ep::comm

// The peer table a kernel's blocks share; declare once per kernel entry.
#define EP_TRANSPORT_TABLE(name) __shared__ uint8_t* name[::deep_ep::kMaxRanks]
