// Combine: the kernels' argument struct and the layout of a row staged in a rank's window:
// [values: kHidden bf16][float weight[K] at kWeightOffset]. Non-expanded, the expert output the
// destination computed for the token; expanded, the destination's partial: the fp32 sum of its rows
// for the token in top-k slot order, rounded to bf16 (what DeepEP's "multiple reduction" sends).
#pragma once

#include "../common/abi.cuh"
#include "../comm/window.cuh"

namespace deep_ep {

template <int kHidden, int K, bool kExpand>
struct CombineRow {
    static_assert(kHidden % 8 == 0, "hidden must be a multiple of 8");
    static constexpr int kVecs = kHidden / 8;                      // 8 elements per 16-byte bf16 vector
    static constexpr int kValueBytes = kHidden * 2;
    static constexpr int kWeightOffset = (kValueBytes + 15) / 16 * 16;
};

struct CombineArgs {
    const __nv_bfloat16* y;           // [rows, H] expert outputs on this rank (as a destination)
    const float* weights_in;          // non-expanded [rows, K]; expanded [rows]; or null
    const float* recv_weights;        // expanded, with apply_weights: [rows] the handle's dispatch weights
    const int* src_meta;              // expanded: [tok rows, K + 2] the handle's recv_src_metadata (cols 2..: rows)
    const int* layout;                // this rank's layout words (as a destination)
    // this rank as the source
    const int* pos_tok;               // [T, R] absolute token rows at each destination
    const int* pos_pair;              // [T, K] absolute output rows (expanded)
    const int64_t* topk_idx;          // [T, K]
    int num_tokens;
    const __nv_bfloat16* bias0;       // [T, H] or null
    const __nv_bfloat16* bias1;       // [T, H] or null
    __nv_bfloat16* out;               // [T, H]
    float* out_weights;               // [T, K] or null
    int num_experts;
    int apply_weights;                // expanded: multiply each row by its dispatch weight first (opt-in)
    int64_t recv_offset, half_bytes;
    int row_stride;
    uint64_t timeout_ns;
    uint32_t* err_host;               // mapped host memory for the error record (finish_wait), or null
    comm::CallTag tag;                // this call's number and fingerprint (comm/window.cuh)
    int max_tokens;                   // the handle's num_max_tokens_per_rank (M of recv_src_metadata's col 0; may be 0)
};

// A pushing transport (comm/push.cuh): where owner rank `owner`'s row for the `index`-th token a
// source sent it lands in that source's window: receive half `half`, a block of rows per owner.
__device__ __forceinline__ int64_t pushed_row_offset(const CombineArgs& a, int half, int num_ranks, int owner,
                                                     int index) {
    const int rows_per_owner = static_cast<int>(a.half_bytes / a.row_stride) / num_ranks;
    return comm::row_offset(a, half, owner * rows_per_owner + index);
}

}  // namespace deep_ep
