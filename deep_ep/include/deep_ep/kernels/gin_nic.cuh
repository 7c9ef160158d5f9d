// The emulated NIC of one rank (comm/gin.cuh's `emulated_gin_nic`), a kernel of its own: emulated
// ranks launch their data kernels separately, so a rank's outgoing queues are drained by this kernel,
// launched on a stream of its own next to each of the rank's data kernels (deep_ep/comm/gin.py) and
// control kernels (notify, barrier: deep_ep/backends/gpu/modules.py's launch_control). One warp per
// (context used, destination); it ends once the kernel's blocks have all ended (the transports'
// `end_block`, comm/gin_direct.cuh, comm/gin_control.cuh) and its queues are empty, or after recording kPhaseGinNic when
// they neither put nor ended for kGinNicIdleTimeouts GPU timeouts, and its last warp zeroes the
// rank's `done` words for the next launch. Built with EP_TRANSPORT_GIN=1 (comm/transport.cuh).
// `carried_bytes` (null: not counted): the buffer's int64 [num_ranks][num_ranks] byte counters; each
// put this rank issues adds its bytes (a signal alone: none) to word (this rank, its destination),
// once, when the NIC reads its source (deep_ep/comm/gin.py, `byte_counters`).
#pragma once

#include "../comm/transport.cuh"

extern "C" __global__ void deep_ep_gin_nic(deep_ep::comm::TransportArgs transport, int num_user_blocks,
                                           unsigned long long* carried_bytes) {
    const deep_ep::comm::EmulatedGinArgs& gin = *transport.gin;
    const int num_ranks = gin.num_ranks, used = transport.num_contexts;
    const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
    if (warp >= used * num_ranks) return;
    const int queue = (transport.rank * gin.num_contexts + warp / num_ranks) * num_ranks + warp % num_ranks;
    deep_ep::comm::emulated_gin_nic(gin, queue, num_user_blocks, carried_bytes);
    __syncwarp();
    if (threadIdx.x % 32 == 0) {
        __threadfence();
        if (atomicAdd(gin.done + 1, 1u) == static_cast<uint32_t>(used * num_ranks - 1)) {
            gin.done[0] = 0u;
            gin.done[1] = 0u;
            __threadfence();
        }
    }
}
