// Dispatch: the kernels' argument struct, the output helpers both phases share, and the layout of a
// row in a peer's window (row_stride bytes): [data: kDataBytes][scale factors: kNumSF * 4]
//   [meta at kMetaOffset: int src_token, int out_row[K], int local_idx[K], float weight[K]]
// A cached dispatch sends no metadata but the weights (when given topk_weights).
#pragma once

#include "../common/abi.cuh"
#include "../comm/window.cuh"

namespace deep_ep {

template <int kDataBytes, int kNumSF, int K>
struct DispatchRow {
    static_assert(kDataBytes % 16 == 0, "row bytes must be a multiple of 16");
    static constexpr int kVecs = kDataBytes / 16;
    static constexpr int kMetaOffset = ((kDataBytes + kNumSF * 4) + 15) / 16 * 16;
    static constexpr int kMetaBytes = 4 + 12 * K;
};

struct DispatchArgs {
    // inputs (this rank as a source)
    const uint8_t* x;              // [T, kDataBytes]
    const int* sf;                 // [T, kNumSF] or null
    const int64_t* topk_idx;       // [T, K]
    const float* topk_weights;     // [T, K] or null
    int num_tokens;
    // handle (this rank as a source): local numbering in, absolute rows out (non-cached)
    int* pos_tok;                  // [T, R]
    int* pos_pair;                 // [T, K] (expanded)
    // outputs (this rank as a destination)
    uint8_t* out_x;                // [rows, kDataBytes]
    int* out_sf;                   // row-major [rows, kNumSF] or column-major [kNumSF, sf_ld]
    int sf_ld;                     // 0: row-major; else leading dimension of the column-major layout
    int64_t* out_topk_idx;         // non-expanded [rows, K] local expert ids; null in the expanded layout
    float* out_weights;            // non-expanded [rows, K]; expanded [rows]; null without topk_weights
    int* src_meta;                 // [tok_capacity, K + 2] the handle's recv_src_metadata: col 0 src_rank * M +
                                   // src_token, col 1 src_rank * K + the token's last local slot, cols 2..
                                   // the expanded row of each slot (-1: not local, or non-expanded)
    int max_tokens;                // M of the global source index (col 0)
    int out_capacity;              // rows allocated in the outputs
    int tok_capacity;              // token rows allocated in src_meta
    const int* layout;             // LayoutIndex words
    int num_experts, alignment;
    int64_t recv_offset, half_bytes;   // receive region: two halves of half_bytes
    int row_stride;
    uint64_t timeout_ns;
    uint32_t* err_host;            // mapped host memory for the error record (finish_wait), or null
    comm::CallTag tag;             // this call's number and fingerprint (comm/window.cuh)
};

template <int kDataBytes, int kNumSF>
__device__ __forceinline__ void store_sf(const DispatchArgs& a, int row, int i, int v) {
    if (a.sf_ld == 0) a.out_sf[static_cast<int64_t>(row) * kNumSF + i] = v;
    else a.out_sf[static_cast<int64_t>(i) * a.sf_ld + row] = v;
}

// Row ``j`` of recv_src_metadata for a token of source rank ``s``: lanes < K give their slot's
// expanded row (-1 where not local); ``local_mask`` has bit k set for the token's local slots.
template <int K>
__device__ __forceinline__ void write_src_meta(const DispatchArgs& a, int j, int s, int src_token, unsigned local_mask,
                                               int slot_row, int lane) {
    int* row = a.src_meta + static_cast<int64_t>(j) * (K + 2);
    if (lane == 0) {
        row[0] = s * a.max_tokens + src_token;
        row[1] = local_mask != 0u ? s * K + (31 - __clz(local_mask)) : -1;
    }
    if (lane < K) row[2 + lane] = slot_row;
}

}  // namespace deep_ep
