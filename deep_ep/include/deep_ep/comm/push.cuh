// How a transport moves rows, chosen at compile time by the data kernels:
//   `kPushes<Transport>`: false for the NVLink transport (LsaTransport: a peer's window is
//   addressable, combine rows are pulled), true for the direct-mode scale-out transport of
//   comm/gin_direct.cuh (GIN has no get: every byte a rank needs is put into its window by the owner,
//   rows are staged first and sent whole by `end_row`);
//   `kForwards<Transport>`: true for the hybrid-mode transport of comm/gin_hybrid.cuh (a row crosses
//   the network once per node, to the rail peer there, which forwards it over NVLink:
//   impls/dispatch_forward.cuh).
// Both scale-out transports end every block of a data kernel with `end_block` (comm/transport.cuh).
#pragma once

#include "../common/abi.cuh"

namespace deep_ep::comm {

template <typename Gin>
struct GinDirectTransport;
template <typename Gin>
struct GinHybridTransport;

template <typename Transport>
struct PushTraits {
    static constexpr bool kPushes = false;
    static constexpr bool kForwards = false;
};

template <typename Gin>
struct PushTraits<GinDirectTransport<Gin>> {
    static constexpr bool kPushes = true;
    static constexpr bool kForwards = false;
};

template <typename Gin>
struct PushTraits<GinHybridTransport<Gin>> {
    static constexpr bool kPushes = false;
    static constexpr bool kForwards = true;
};

template <typename Transport>
constexpr bool kPushes = PushTraits<Transport>::kPushes;
template <typename Transport>
constexpr bool kForwards = PushTraits<Transport>::kForwards;

// Control words of the hybrid dispatch, past the tags: blocks that finished the rail puts, and
// blocks that finished forwarding (each reset by the last block, as kCtrlDone is).
constexpr int kCtrlRailDone = kCtrlTag + 4 * kMaxRanks;
constexpr int kCtrlForwardDone = kCtrlRailDone + 1;
static_assert((kCtrlForwardDone + 1) * 4 <= kCtrlBytes, "the hybrid dispatch's control words are in the region");

// The hybrid transport's rail waits (comm/gin_hybrid.cuh) record kPhaseDispatchRail and
// kPhaseCombineRail (common/abi.cuh); its node waits kPhaseDispatch / kPhaseCombine, as on one node.

}  // namespace deep_ep::comm
