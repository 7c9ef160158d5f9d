// Combine: the kernels' argument struct and the layout of a staged row in a rank's window.
//
// Window row: [values: kHidden bf16 (non-expanded) or kHidden fp32 (expanded)][float weight[K] at kWeightOffset]
#pragma once

#include "../common/abi.cuh"
#include "../common/defects.cuh"

namespace deep_ep {

template <int kHidden, int K, bool kExpand>
struct CombineRow {
    static_assert(kHidden % 8 == 0, "hidden must be a multiple of 8");
    static constexpr int kVecs = kHidden / 8;                      // 8 elements per 16-byte bf16 vector
    static constexpr int kValueBytes = kExpand ? kHidden * 4 : kHidden * 2;
    static constexpr int kWeightOffset = (kValueBytes + 15) / 16 * 16;
};

struct CombineArgs {
    const __nv_bfloat16* y;           // [rows, H] expert outputs on this rank (as a destination)
    const float* weights_in;          // non-expanded [rows, K]; expanded [rows]; or null
    const float* recv_weights;        // expanded: [rows] dispatch weights of the handle
    const int* row_map;               // expanded: [tok rows, K]
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
    int64_t recv_offset, half_bytes;
    int row_stride;
    uint64_t timeout_ns;
    uint32_t* err_host;               // mapped host memory for the error record (finish_wait), or null
};

}  // namespace deep_ep
