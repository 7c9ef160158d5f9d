// Whether a transport pushes: `kPushes<Transport>` is false for the NVLink transport (LsaTransport:
// a peer's window is addressable, combine rows are pulled) and true for the scale-out transport of
// comm/gin_direct.cuh (GIN has no get: every byte a rank needs is put into its window by the owner,
// rows are staged first and sent whole by `end_row`). The data kernels branch on it at compile time.
#pragma once

namespace deep_ep::comm {

template <typename Gin>
struct GinDirectTransport;

template <typename Transport>
struct PushTraits {
    static constexpr bool kPushes = false;
};

template <typename Gin>
struct PushTraits<GinDirectTransport<Gin>> {
    static constexpr bool kPushes = true;
};

template <typename Transport>
constexpr bool kPushes = PushTraits<Transport>::kPushes;

}  // namespace deep_ep::comm
