// How a kernel obtains its transport: the host passes one `TransportArgs` by value to every kernel
// (deep_ep/backends/gpu/abi.py mirrors both forms); `make_transport` copies the peers' window bases
// once per block into a shared-memory table, which the data loops index.
//   EP_TRANSPORT_NCCL=1: NCCL's device communicator and the buffer's symmetric window (LSA team).
//   EP_TRANSPORT_NCCL=0: ranks emulated on one GPU, window slices of one allocation.
#pragma once

#include "lsa.cuh"

#ifndef EP_TRANSPORT_NCCL
#define EP_TRANSPORT_NCCL 0
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
};

__device__ __forceinline__ LsaTransport make_transport(const TransportArgs& t, uint8_t** table) {
    for (int p = threadIdx.x; p < t.num_ranks; p += blockDim.x) table[p] = t.peers[p];
    __syncthreads();
    return LsaTransport{table, t.rank, t.num_ranks};
}
#endif

}  // namespace deep_ep::comm

// The peer table a kernel's blocks share; declare once per kernel entry.
#define EP_TRANSPORT_TABLE(name) __shared__ uint8_t* name[::deep_ep::kMaxRanks]
