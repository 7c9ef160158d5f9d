// Notify stage of a dispatch (impls/layout.cuh follows in the same launch), on source rank s:
// pos_tok[t, d] is t's index among s's tokens to rank d (-1: not sent); expanded, pos_pair[t, k] the
// pair's index among s's pairs for its expert (-1: masked); every peer's window gets s's count row.
// All blocks must be resident at once (grid barriers); the last to finish signals every peer.
// `Transport`: LsaTransport (stores into every peer's row), or on several nodes the control form of
// the scale-out transport (comm/gin_control.cuh: stores into the node's ranks, and the row, kept in
// this rank's own window, goes to the other nodes whole with the signal).
#pragma once

#include "../comm/lsa.cuh"
#include "../common/grid.cuh"

namespace deep_ep {

struct NotifyArgs {
    const int64_t* topk_idx;  // [T, K]
    int64_t* topk_copy;       // [T, K] out: a copy of topk_idx for the handle, or null
    int num_tokens, num_experts;
    int tokens_per_group;     // tokens of one group (warp)
    int64_t counts_offset;    // byte offset of the count matrix in every window
    int* pos_tok;             // [T, R] out: local row of token t at rank d, or -1
    int* pos_pair;            // [T, K] out (expanded): local row of pair (t, k) at its expert's owner, or -1
    int* scratch;             // the kNotify* words of common/abi.cuh, then a row of counts per block
    uint64_t timeout_ns;      // for the grid barriers (blocks that never arrive)
    comm::CallTag tag;        // this call's number and fingerprint, sent with the counts' signal
};

// Stage the ids of tokens [t0, t1) (a tile of whole tokens, so a slot's earlier slots are there too)
// into shared memory, every load in flight at once: e in [0, E), or -1 when masked or out of range.
// ``kFirst`` (phase A): also note the smallest flat index of an out-of-range id, and copy the ids.
template <int K, bool kFirst>
__device__ __forceinline__ void notify_stage(const NotifyArgs& a, int t0, int t1, int* ids, int lane) {
    const int64_t p0 = static_cast<int64_t>(t0) * K;
    const int n = (t1 - t0) * K;
    __syncwarp();
#pragma unroll 8
    for (int i = lane; i < n; i += 32) {
        const int64_t e = __ldg(a.topk_idx + p0 + i);
        const bool in_range = e >= 0 && e < a.num_experts;
        ids[i] = in_range ? static_cast<int>(e) : -1;
        if (kFirst) {
            if (e < -1 || e >= a.num_experts) atomicMin(a.scratch + kNotifyBadIndex, static_cast<int>(p0 + i));
            if (a.topk_copy != nullptr) a.topk_copy[p0 + i] = e;
        }
    }
    __syncwarp();
}

// One pass over the staged tokens [t0, t1), 32 pairs at a time. ``kNumber``: false = count into
// run[] (phase A), true = write positions (phase C; run[] holds the group's prefixes).
template <int K, bool kExpand, bool kNumber>
__device__ __forceinline__ void notify_pass(const NotifyArgs& a, int R, int L, int t0, int t1, const int* ids,
                                            int* run, int lane) {
    const int n = (t1 - t0) * K;
    const unsigned lanes_before = (1u << lane) - 1u;
    for (int base = 0; base < n; base += 32) {
        const int i = base + lane;
        const bool active = i < n;
        const int e = active ? ids[i] : -1;
        const int tl = i / K, k = i - tl * K;
        const int d = e >= 0 ? e / L : -1;
        // A token counts once per rank (its first slot there) and once per slot for its expert.
        bool first = d >= 0;
        for (int kk = 0; first && kk < k; ++kk) {
            const int ek = ids[tl * K + kk];
            first = !(ek >= 0 && ek / L == d);
        }
        const int rank_key = first ? d : -1;
        const unsigned same_rank = __match_any_sync(0xffffffffu, rank_key);
        const int rank_base = first ? run[d] : 0;
        const unsigned same_expert = __match_any_sync(0xffffffffu, e);
        const int expert_base = e >= 0 ? run[R + e] : 0;
        __syncwarp();
        if (kNumber) {
            const int t = t0 + tl;
            if (first) a.pos_tok[static_cast<int64_t>(t) * R + d] = rank_base + __popc(same_rank & lanes_before);
            if (kExpand && active)
                a.pos_pair[static_cast<int64_t>(t) * K + k] = e >= 0 ? expert_base + __popc(same_expert & lanes_before) : -1;
        }
        // the lowest lane of each set advances the running counts
        if (first && (same_rank & lanes_before) == 0u) run[d] = rank_base + __popc(same_rank);
        if (e >= 0 && (same_expert & lanes_before) == 0u) run[R + e] = expert_base + __popc(same_expert);
        __syncwarp();
    }
}

// Phase B for columns c0, c0 + stride, ... of one warp, loaded together (one round trip, not one per
// column): each column's exclusive prefix over the blocks, in place, and its total in totals[j].
constexpr int kNotifyColumnsAtOnce = 4;

__device__ __forceinline__ void notify_prefix_columns(int* counts, int cols, int num_rows, int c0, int stride,
                                                      int lane, int* totals) {
    const int per_lane = (num_rows + 31) / 32;
    const int g0 = min(num_rows, lane * per_lane), g1 = min(num_rows, g0 + per_lane);
    int sum[kNotifyColumnsAtOnce];
#pragma unroll
    for (int j = 0; j < kNotifyColumnsAtOnce; ++j) sum[j] = 0;
#pragma unroll 4
    for (int g = g0; g < g1; ++g) {
#pragma unroll
        for (int j = 0; j < kNotifyColumnsAtOnce; ++j) {
            const int c = c0 + j * stride;
            if (c < cols) sum[j] += __ldcg(counts + static_cast<int64_t>(g) * cols + c);
        }
    }
    int prefix[kNotifyColumnsAtOnce];
#pragma unroll
    for (int j = 0; j < kNotifyColumnsAtOnce; ++j) {
        int inclusive = sum[j];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
            if (lane >= o) inclusive += v;
        }
        prefix[j] = inclusive - sum[j];
        totals[j] = __shfl_sync(0xffffffffu, inclusive, 31);
    }
#pragma unroll 4
    for (int g = g0; g < g1; ++g) {
#pragma unroll
        for (int j = 0; j < kNotifyColumnsAtOnce; ++j) {
            const int c = c0 + j * stride;
            if (c < cols) {
                int* cell = counts + static_cast<int64_t>(g) * cols + c;
                const int v = __ldcg(cell);
                *cell = prefix[j];
                prefix[j] += v;
            }
        }
    }
}

// Each warp owns a consecutive token range (a group) and goes over its pairs 32 at a time, in order:
// `__match_any_sync` gathers the lanes of one rank (or expert), so a lane's index is the group's
// running count plus the lanes before it. Three phases, separated by grid barriers:
//   A. count each group's pairs per column (R ranks, then E experts); the block turns its warps'
//      counts into prefixes and writes its totals to scratch[block][column];
//   B. warp w scans columns w, w + W, ... over the blocks (exclusive, in place) and publishes each
//      column's total in row s of every peer's count matrix;
//   C. each group numbers its pairs again, from its block's prefix plus its own.
// Expert ids outside [-1, E) count as masked; the first one is published with the counts, so every
// rank's layout stage sees it and the call moves nothing (kErrBadExpert). Returns true in the block
// that finished last (and signalled the peers).
template <int K, bool kExpand, typename Transport>
__device__ __forceinline__ bool notify_impl(const NotifyArgs& a, const Transport& tr) {
    const int R = tr.num_ranks, rank = tr.rank, E = a.num_experts, L = E / R;
    const int cols = R + E;
    const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
    const int block = static_cast<int>(blockIdx.x), num_blocks = static_cast<int>(gridDim.x);
    const int group = block * kNotifyWarps + warp, num_groups = num_blocks * kNotifyWarps;
    const int t0 = min(a.num_tokens, group * a.tokens_per_group);
    const int t1 = min(a.num_tokens, t0 + a.tokens_per_group);
    static_assert(K >= 1 && K <= kNotifyTilePairs, "a tile holds at least one token");
    constexpr int kTileTokens = kNotifyTilePairs / K;
    const bool one_tile = t1 - t0 <= kTileTokens;   // the tile staged in phase A is still there in phase C
    int* counts = a.scratch + kNotifyGroupCounts;  // [num_blocks][cols]
    extern __shared__ int smem[];                  // [kNotifyWarps][cols]: each warp's running counts
    int* run = smem + warp * cols;
    __shared__ int tiles[kNotifyWarps][kTileTokens * K];
    int* ids = tiles[warp];
    uint8_t* my_window = tr.local();

    // ---- A: count; the block's exclusive prefix over its warps, its totals to its scratch row
    for (int c = lane; c < cols; c += 32) run[c] = 0;
    for (int s = t0; s < t1; s += kTileTokens) {
        const int e = min(t1, s + kTileTokens);
        notify_stage<K, true>(a, s, e, ids, lane);
        notify_pass<K, kExpand, false>(a, R, L, s, e, ids, run, lane);
    }
    __syncthreads();
    for (int c = static_cast<int>(threadIdx.x); c < cols; c += static_cast<int>(blockDim.x)) {
        int acc = 0;
#pragma unroll
        for (int w = 0; w < kNotifyWarps; ++w) {
            const int v = smem[w * cols + c];
            smem[w * cols + c] = acc;
            acc += v;
        }
        counts[static_cast<int64_t>(block) * cols + c] = acc;
    }
    bool ok = grid_barrier(a.scratch + kNotifyBarrierCount, a.scratch + kNotifyBarrierGen, a.timeout_ns);

    // ---- B: prefix over the blocks, column by column (one warp per column); totals to every peer
    const int row = cols + kCountsExtraWords;
    const int64_t my_row = a.counts_offset + static_cast<int64_t>(rank) * row * 4;
    for (int c0 = group; ok && c0 < cols; c0 += kNotifyColumnsAtOnce * num_groups) {
        int totals[kNotifyColumnsAtOnce];
        notify_prefix_columns(counts, cols, num_blocks, c0, num_groups, lane, totals);
#pragma unroll
        for (int j = 0; j < kNotifyColumnsAtOnce; ++j) {
            const int c = c0 + j * num_groups;
            if (c < cols)
                for (int p = lane; p < R; p += 32) tr.template put<int>(p, my_row + 4 * c, totals[j]);
        }
    }
    if (ok && group == 0) {
        const int bad = ld_volatile(reinterpret_cast<const uint32_t*>(a.scratch + kNotifyBadIndex));
        const bool any = bad != 0x7fffffff;
        int value = 0;
        if (any) {
            const int64_t e = __ldg(a.topk_idx + bad);
            value = static_cast<int>(max(static_cast<int64_t>(-0x7fffffff), min(e, static_cast<int64_t>(0x7fffffff))));
        }
        for (int p = lane; p < R; p += 32) {
            tr.template put<int>(p, my_row + 4 * cols, any ? bad : -1);
            tr.template put<int>(p, my_row + 4 * (cols + 1), value);
        }
        if (lane == 0) a.scratch[kNotifyBadIndex] = 0x7fffffff;  // for the next call (read by this warp only)
    }
    ok = grid_barrier(a.scratch + kNotifyBarrierCount, a.scratch + kNotifyBarrierGen, a.timeout_ns) && ok;

    // ---- C: number, from the block's prefix plus the warp's within the block
    if (ok) {
        for (int c = lane; c < cols; c += 32) run[c] += __ldcg(counts + static_cast<int64_t>(block) * cols + c);
        for (int64_t i = static_cast<int64_t>(t0) * R + lane; i < static_cast<int64_t>(t1) * R; i += 32) a.pos_tok[i] = -1;
        __syncwarp();
        for (int s = t0; s < t1; s += kTileTokens) {
            const int e = min(t1, s + kTileTokens);
            if (!one_tile) notify_stage<K, false>(a, s, e, ids, lane);
            notify_pass<K, kExpand, true>(a, R, L, s, e, ids, run, lane);
        }
    } else if (lane == 0) {
        comm::record_error(my_window, kErrTimeout, rank, rank, kPhaseNotify);
    }
    const bool last = comm::last_block(my_window);
    if (last) tr.signal_all(a.tag);
    return last;
}

}  // namespace deep_ep
