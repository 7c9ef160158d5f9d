// All-gather / reduce-scatter sessions on GPU buffers (ElasticBuffer.all_gather / reduce_scatter).
// Data moves on copy engines and flags through stream memory operations, both queued by the host
// (deep_ep/backends/gpu/agrs.py); no SM takes part. The one kernel here reports the peers' window
// addresses as this GPU sees them (once per agrs_set_config), for the host to aim its copies.
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

// Every peer's window base, as a 64-bit address per rank.
__device__ __forceinline__ void agrs_peers_impl(const comm::LsaTransport& tr, uint64_t* out) {
    for (int p = threadIdx.x; p < tr.num_ranks; p += blockDim.x)
        out[p] = reinterpret_cast<uint64_t>(comm::peer_bytes(tr, p, 0));
}

}  // namespace deep_ep
