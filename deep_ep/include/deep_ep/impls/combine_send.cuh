// Combine, send phase on destination d: rows that came from peers are staged in d's own window at
// the row index they arrived at (expanded: d's partial, combine_args.cuh), with their top-k weights
// in a trailer; rows from d itself stay in the caller's tensor. The last block signals every peer.
// A pushing transport (comm/push.cuh) writes each row for its source (in place, or staged and put)
// into the source's window at `pushed_row_offset`. With kSingleReduction (expanded layout, single
// reduction) every slot's row is staged as it is instead (combine_single.cuh).
#pragma once

#include "../comm/lsa.cuh"
#include "../comm/push.cuh"
#include "../common/grid.cuh"
#include "combine_reduce.cuh"
#include "combine_single.cuh"

namespace deep_ep {

template <int kHidden, int K, bool kExpand, bool kSingleReduction, typename Transport>
__device__ __forceinline__ void combine_send_impl(const CombineArgs& a, const Transport& tr) {
    static_assert(kExpand || !kSingleReduction, "single reduction is a combine of the expanded layout");
    if constexpr (kSingleReduction) {
        combine_send_single<kHidden, K>(a, tr);
        return;
    }
    using Row = CombineRow<kHidden, K, kExpand>;
    const WarpGrid wg;
    const int lane = wg.lane, global_warp = wg.warp, num_warps = wg.num_warps;
    const int R = tr.num_ranks, L = a.num_experts / tr.num_ranks, rank = tr.rank;
    const LayoutIndex ix{R, L, a.num_experts};
    uint8_t* my_window = tr.local();
    const int half = comm::current_half(my_window);
    const int num_tok_rows = comm::has_error(my_window) ? 0 : a.layout[ix.num_tok_rows()];
    const int self_begin = rank == 0 ? 0 : a.layout[ix.tok_prefix() + rank - 1];
    const int self_end = a.layout[ix.tok_prefix() + rank];

    for (int j = global_warp; j < num_tok_rows; j += num_warps) {
        if (j >= self_begin && j < self_end) continue;
        uint8_t* dst = my_window + comm::row_offset(a, half, j);
        int source = 0;
        int64_t pushed = 0;  // a pushing transport: the row's offset in the source's window
        if constexpr (comm::kPushes<Transport>) {
            while (source < R - 1 && j >= a.layout[ix.tok_prefix() + source]) ++source;
            const int first = source == 0 ? 0 : a.layout[ix.tok_prefix() + source - 1];
            pushed = pushed_row_offset(a, half, R, rank, j - first);
            dst = tr.row_target(source, pushed);
        }
        float* dst_w = reinterpret_cast<float*>(dst + Row::kWeightOffset);
        if (!kExpand) {
            const int4* src = reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(j) * kHidden);
            int4* d4 = reinterpret_cast<int4*>(dst);
#pragma unroll 4
            for (int i = lane; i < Row::kVecs; i += 32) st_cg(d4 + i, ld_nc(src + i));
            if (lane < K) dst_w[lane] = a.weights_in != nullptr ? a.weights_in[static_cast<int64_t>(j) * K + lane] : 0.0f;
        } else {
            const int my_out = lane < K ? a.src_meta[static_cast<int64_t>(j) * (K + 2) + 2 + lane] : -1;
            const float my_w = (a.apply_weights && my_out >= 0) ? a.recv_weights[my_out] : 1.0f;
            int4* d4 = reinterpret_cast<int4*>(dst);
            // All lanes iterate together (the shuffles need the whole warp); lanes past the row idle.
            for (int base = 0; base < Row::kVecs; base += 32) {
                const int i = base + lane;
                const bool active = i < Row::kVecs;
                float part[1][8] = {{0, 0, 0, 0, 0, 0, 0, 0}};
#pragma unroll
                for (int k = 0; k < K; ++k) {
                    const int out = __shfl_sync(0xffffffffu, my_out, k);
                    const float w = __shfl_sync(0xffffffffu, my_w, k);
                    if (out < 0 || !active) continue;
                    const int4 v[1] = {ld_nc(reinterpret_cast<const int4*>(a.y + static_cast<int64_t>(out) * kHidden) + i)};
                    if (a.apply_weights) add_weighted_bf16_chunk(v, w, part);
                    else add_bf16_chunk(v, part);
                }
                if (!active) continue;
                st_cg(d4 + i, f32_to_bf16x8(part[0]));
            }
            if (lane < K) dst_w[lane] = (a.weights_in != nullptr && my_out >= 0) ? a.weights_in[my_out] : 0.0f;
        }
        if constexpr (comm::kPushes<Transport>) tr.end_row(source, pushed, Row::kWeightOffset + 4 * K, lane);
    }
    if (comm::last_block(my_window)) tr.signal_all(a.tag);
}

}  // namespace deep_ep
