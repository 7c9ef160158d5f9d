// What pipeline send/recv (impls/pp.cuh) needs of the LSA transport beyond put/get: a peer's window
// bytes at an offset (the slot a whole-grid copy fills) and a release increment of a peer's u32
// word (a slot published, a slot handed back), which makes every earlier write of this GPU visible
// to a peer that observes it with acquire.
#pragma once

#include "lsa.cuh"

namespace deep_ep::comm {

__device__ __forceinline__ uint8_t* peer_bytes(const LsaTransport& tr, int peer, int64_t offset) {
    return tr.bases[peer] + offset;
}

__device__ __forceinline__ void add_release(const LsaTransport& tr, int peer, int64_t offset, uint32_t value) {
    red_release_sys_add(reinterpret_cast<uint32_t*>(tr.bases[peer] + offset), value);
}

}  // namespace deep_ep::comm
