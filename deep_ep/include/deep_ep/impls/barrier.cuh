// A barrier across the ranks of a buffer on the GPU (one block): signal every peer, wait for every
// peer's signal (with the buffer's timeout), advance the epoch. Ordered on a stream like any kernel,
// so work queued before it on every rank is complete, as far as the window is concerned, after it.
// `Transport`: LsaTransport, or on several nodes comm/gin_control.cuh's (the ranks of other nodes
// through GIN; in hybrid mode the rail peers first, then the node, as DeepEP's sequential barrier).
#pragma once

#include "../comm/lsa.cuh"

namespace deep_ep {

template <typename Transport>
__device__ __forceinline__ void barrier_impl(const Transport& tr, uint64_t timeout_ns, uint32_t* err_host,
                                             comm::CallTag tag) {
    if (comm::last_block(tr.local())) tr.signal_all(tag);
    if (tr.wait_all(kPhaseBarrier, timeout_ns)) comm::check_tags(tr.local(), tr.rank, tr.num_ranks, tag);
    comm::finish_wait(tr.local(), false, err_host);
}

}  // namespace deep_ep
