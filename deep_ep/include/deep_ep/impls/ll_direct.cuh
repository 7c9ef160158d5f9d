// DeepEP's V1 low-latency dispatch and combine with every row sent straight to its final place in
// the destination's window, no counts exchanged first (host: deep_ep/legacy/ll_direct.py; the torch
// specifications of deep_ep/legacy/layouts.py and ll_reduce.py hold bit for bit):
//  - dispatch send (a block per token, tokens strided over the grid): the token's place among the
//    tokens of each of its experts (how many earlier tokens chose that expert), then its row (bf16,
//    or FP8 cast as impls/ll_layout.cuh casts, with its scales) and its (token, slot) word into the
//    expert owner's window at [local expert][source rank][place]; the last block to finish
//    publishes this rank's count of every expert, tagged, one release store each;
//  - dispatch receive (every block waits for every count, then takes a share of all received rows,
//    a warp per row segment): writes recv_count, layout_range (source ranks in order), the
//    statistics, the rows, scales and src_info of DeepEP's layout (src_info -1 past the count) and
//    each row's route back (its source rank's (token, slot) pair);
//  - combine send (every expert's received rows in order, in segments of 16-byte chunks, a warp
//    per segment): each expert output row into its source rank's window at pair (token, slot); the
//    last block publishes a tagged flag to every rank;
//  - combine receive: waits for every rank's flag, then per token the weighted top-k sum
//    (impls/ll_reduce.cuh's arithmetic: float32, slot order, products rounded first, one bf16 rounding).
// Every window holds two call halves (DeepEP's double buffering), each with control words of its
// own past the shared ones (abi.cuh, comm/push.cuh). A half counts its completed dispatch and combine
// receives; a send tags its flags with that count plus one and the receive waits for that tag, so a
// flag an earlier call left (emulated ranks and CUDA graph replays reuse the window) is never taken.
// A wait that times out records rank, peer and phase as every kernel does (comm/window.cuh).
// Rank masks (a Buffer with enable_shrink; null pointers otherwise): a dispatch reads the mask as the
// host copied it when the call was made (`rank_view`: both phases see one mask, whatever changes
// meanwhile), and its combine follows the dispatch's decisions (`present`), so that no change of a
// mask makes two ranks disagree on whether they exchange in a call. A rank exchanges with a peer
// when neither masks the other: it sends no rows to a peer it masks and flags it absent instead of
// a count (the flag names the last call on the half that included the peer, with its count, for a
// receive of that call that comes late); it waits for no peer it masks, takes a peer's absent flag
// as "not in this call", and masks a peer whose flag does not come within the timeout (DeepEP's
// failure detection: the peer is taken as failed, and must be stopped: a slow one that goes on may
// write combine rows this rank no longer waits for) in the Buffer's mask (`rank_state`: [R] the
// mask, then [R] the peers taken as failed) instead of recording an error; a wait for its own flags
// still fails with one. Later receives leave out the peers taken as failed. Every block of a receive
// waits for the flags itself, so the blocks agree on each peer through the half's decision words
// (the first to decide wins).
#pragma once

#include "../comm/lsa.cuh"
#include "ll_layout.cuh"
#include "ll_reduce.cuh"

namespace deep_ep {

constexpr int kLlDirectThreads = 512;
constexpr int kLlDirectWarps = 16;
constexpr int kLlDirectUnroll = 4;          // 16-byte loads a thread keeps in flight
constexpr int kLlDirectSegment = 256;       // 16-byte chunks of a row a warp copies at once (8 per lane)
constexpr int kLlDirectReduceBatch = 8;     // top-k rows a thread of the combine receive loads at once
constexpr int kLlDirectSendPrefetch = 2;    // chunks of its token a thread of the dispatch send loads first
constexpr int kLlDirectSendPhase = 1;       // a kernel's `phase`: the send
constexpr int kLlDirectReceivePhase = 2;    // the receive
constexpr int kLlDirectBothPhases = 3;      // the send, then the receive, in one launch (bits of both)
constexpr int kLlDirectMaxTopk = 16;         // top-k a token may have (shared-memory places)
constexpr int kLlDirectMaxExperts = 1024;    // experts of a call: one dispatch flag each per half
constexpr int kLlDirectMaxRanks = 512;       // ranks of a call: one combine flag each per half
constexpr int kLlDirectMaxSlots = 65535;     // num_max_dispatch_tokens_per_rank: a count's 16 bits (rank masks)
// u32 words of the control region: a half's words begin at kLlDirectCtrlWord + half * kLlDirectHalfWords
constexpr int kLlDirectCtrlWord = 6112;
constexpr int kLlDirectDispatchSeq = 0;      // dispatch receives completed on the half
constexpr int kLlDirectCombineSeq = 1;       // combine receives completed on the half
constexpr int kLlDirectDispatchSent = 2;     // blocks of the dispatch send that finished (ticket)
constexpr int kLlDirectCombineSent = 3;      // likewise, combine send
constexpr int kLlDirectDispatchDone = 4;     // likewise, dispatch receive
constexpr int kLlDirectCombineDone = 5;      // likewise, combine receive
constexpr int kLlDirectDispatchFlags = 16;   // [local expert][source rank] u64: tag << 32 | count
constexpr int kLlDirectCombineFlags = kLlDirectDispatchFlags + 2 * kLlDirectMaxExperts;   // [rank] u64
// rank masks only: what this rank last sent on the half to each expert's owner (dispatch) or peer
// (combine) in a call that included it, as an absent flag carries it (ll_direct_included)
constexpr int kLlDirectDispatchIncluded = kLlDirectCombineFlags + 2 * kLlDirectMaxRanks;   // [expert] u32
constexpr int kLlDirectCombineIncluded = kLlDirectDispatchIncluded + kLlDirectMaxExperts;  // [rank] u32
// rank masks only: [source rank] u16, two per word: 0x8000 | (tag & 0x1FFF) << 2 | decision
constexpr int kLlDirectDispatchDecided = kLlDirectCombineIncluded + kLlDirectMaxRanks;
constexpr int kLlDirectCombineDecided = kLlDirectDispatchDecided + kLlDirectMaxRanks / 2;
constexpr int kLlDirectHalfWords = kLlDirectCombineDecided + kLlDirectMaxRanks / 2;
// A flag's value for a peer this rank leaves out (rank masks): the absent bit (no count has it), and
// what this rank last sent that peer on the half in a call that included it: the low 15 bits of
// that call's tag and its count (a dispatch's; a combine's is 1). A peer whose receive of that call
// runs late, after this rank moved on and overwrote the flag, still finds the count there.
constexpr int kLlDirectAbsentShift = 31;
constexpr int kLlDirectIncludedTagShift = 16;
constexpr int kLlDirectIncludedTagMask = 32767;
constexpr int kLlDirectIncludedCountMask = 65535;
// what the blocks of a receive decide about a peer (rank masks)
constexpr int kLlDirectPeerIn = 0;          // exchanges in this call
constexpr int kLlDirectPeerMasked = 1;      // one of the two masks the other
constexpr int kLlDirectPeerTimedOut = 2;    // its flag did not come in time: masked from now on

static_assert(kCtrlTag + 4 * kMaxRanks + 2 <= kLlDirectCtrlWord, "the shared control words end before these");
static_assert((kLlDirectCtrlWord + 2 * kLlDirectHalfWords) * 4 <= kCtrlBytes, "both halves fit the control region");
static_assert(kLlDirectWarps * 32 == kLlDirectThreads, "whole warps");
static_assert(kLlDirectSegment % 32 == 0, "whole lanes per segment");
static_assert(kLlDirectBothPhases == (kLlDirectSendPhase | kLlDirectReceivePhase), "a phase is a bit");
static_assert(kLlDirectMaxRanks % 2 == 0 && kLlDirectHalfWords % 2 == 0 && kLlDirectCtrlWord % 2 == 0,
              "two decisions a word; 8-byte flags");
static_assert(kLlDirectMaxSlots <= kLlDirectIncludedCountMask, "a count fits an absent flag");

__device__ __forceinline__ uint32_t ll_direct_included(uint32_t tag, uint32_t count) {
    return (tag & kLlDirectIncludedTagMask) << kLlDirectIncludedTagShift | (count & kLlDirectIncludedCountMask);
}

__device__ __forceinline__ uint32_t ll_direct_absent(uint32_t included) {
    return 1u << kLlDirectAbsentShift | included;
}

// The absent flag of call `tag` to a peer whose last included call on the half `*included` names.
// Once that call is 2^13 calls old (no receive lags that far) the word names a call 2^14 ahead of
// this one instead, at every call from then on: its 15 bits stay 2^13 to 2^14 + 2^13 calls away
// from any live call's and never come round to one.
__device__ __forceinline__ uint32_t ll_direct_absent_flag(uint32_t* included, uint32_t tag) {
    constexpr uint32_t kRange = kLlDirectIncludedTagMask + 1u;
    uint32_t last = *included;
    if (((tag - (last >> kLlDirectIncludedTagShift)) & kLlDirectIncludedTagMask) >= kRange / 4u) {
        last = ll_direct_included(tag + kRange / 2u, 0u);
        *included = last;
    }
    return ll_direct_absent(last);
}

__device__ __forceinline__ bool ll_direct_is_absent(uint32_t value) { return (value >> kLlDirectAbsentShift) != 0u; }

__device__ __forceinline__ int ll_direct_word(int half, int word) {
    return kLlDirectCtrlWord + half * kLlDirectHalfWords + word;
}

// Byte offset (in every window) of flag `index` of the array starting at a half's word `word`.
__device__ __forceinline__ int64_t ll_direct_flag_offset(int half, int word, int index) {
    return static_cast<int64_t>(ll_direct_word(half, word)) * 4 + static_cast<int64_t>(index) * 8;
}

// A flag: the call's fingerprint (16 bits of its configuration, from the host), the low 16 bits of
// its tag, and a 32-bit value.
__device__ __forceinline__ uint64_t ll_direct_flag(uint32_t tag, uint32_t fingerprint, uint32_t value) {
    return (static_cast<uint64_t>(fingerprint & 0xFFFFu) << 48) | (static_cast<uint64_t>(tag & 0xFFFFu) << 32) | value;
}

// Wait until the local flag at byte `offset` carries `tag`; its value comes back in `value`. False
// (nothing to trust) once an error is recorded, after `timeout_ns` (recorded as a timeout here), or
// when the flag's fingerprint differs from this rank's: the peer's call paired with this one (same
// tag: the same count of calls on this half) has other sizes (recorded as kErrFingerprint, with the
// phase). With `masks` (rank masks), a flag of a later call on the half (its tag ahead by less than
// 2^15) is read too: the peer moved on. An absent flag that names this call as the last that included
// this rank gives this call's count (the peer left this rank out since, writing it no rows); any
// other means the peer left this rank out of this call (an absent value): in DeepEP's calling
// contract a peer that includes this rank in a call and in its next call on the half waits for this
// rank between the two (its combine waits for this rank's combine flag, sent after this receive). `absent` (rank masks; null: a timeout is an error): this
// block's view of the peer, in shared memory; a timeout is then no error but sets it to
// kLlDirectPeerTimedOut, and the wait gives up (false, with nothing recorded) once another thread of
// the block has set it.
__device__ __forceinline__ bool ll_direct_wait(uint8_t* window, int64_t offset, uint32_t tag, uint32_t fingerprint,
                                               uint32_t& value, int rank, int peer, int phase, uint64_t timeout_ns,
                                               bool masks = false, volatile uint8_t* absent = nullptr) {
    const uint64_t* flag = reinterpret_cast<const uint64_t*>(window + offset);
    const uint64_t start = global_timer_ns();
    while (true) {
        const uint64_t word = ld_acquire_sys_u64(flag);
        const uint32_t ahead = (static_cast<uint32_t>(word >> 32) - tag) & 0xFFFFu;
        if (ahead == 0u) {
            if (static_cast<uint32_t>(word >> 48) != (fingerprint & 0xFFFFu)) {
                comm::record_error(window, kErrFingerprint, rank, peer, phase);
                return false;
            }
            value = static_cast<uint32_t>(word);
            return true;
        }
        if (masks && ahead < 0x8000u) {
            // (a named call at most 2^13 - 1 calls before the flag's own: a word moved ahead by
            // ll_direct_absent_flag is 2^13 or more away, whatever this receive's lag)
            const uint32_t later = static_cast<uint32_t>(word);
            const uint32_t named = later >> kLlDirectIncludedTagShift & kLlDirectIncludedTagMask;
            const uint32_t since = (static_cast<uint32_t>(word >> 32) - named) & kLlDirectIncludedTagMask;
            const bool this_call = ll_direct_is_absent(later) && named == (tag & kLlDirectIncludedTagMask) &&
                since != 0u && since < (kLlDirectIncludedTagMask + 1u) / 4u;
            value = this_call ? (later & kLlDirectIncludedCountMask) : ll_direct_absent(0u);
            return true;
        }
        if (comm::has_error(window) || (absent != nullptr && *absent != kLlDirectPeerIn))
            return false;
        if (global_timer_ns() - start > timeout_ns) {
            if (absent != nullptr)
                *absent = kLlDirectPeerTimedOut;
            else
                comm::record_error(window, kErrTimeout, rank, peer, phase);
            return false;
        }
    }
}

// Rank masks: the decision of the receive's blocks about `peer` in the call tagged `tag` (the
// half's words at `word`): the first block's `proposal` stands; the others get it back. Words of
// the call before on this half hold its tag, one less.
__device__ __forceinline__ int ll_direct_decide(uint8_t* window, int half, int word, int peer, uint32_t tag,
                                                int proposal) {
    uint32_t* cell = comm::ctrl_of(window) + ll_direct_word(half, word) + peer / 2;
    const int shift = (peer % 2) * 16;
    const uint32_t mine = 0x8000u | (tag & 0x1FFFu) << 2 | static_cast<uint32_t>(proposal);
    uint32_t seen = ld_volatile(cell);
    while (true) {
        const uint32_t current = seen >> shift & 0xFFFFu;
        if ((current & ~3u) == (mine & ~3u))
            return static_cast<int>(current & 3u);
        const uint32_t old = atomicCAS(cell, seen, (seen & ~(0xFFFFu << shift)) | mine << shift);
        if (old == seen)
            return proposal;
        seen = old;
    }
}

// Rank masks: every block's view of every peer (`absent`, in shared memory) replaced by the
// decision of all blocks; a peer decided timed out is masked and taken as failed from now on
// (`rank_state`: [R] the Buffer's mask, then [R] the peers taken as failed).
__device__ __forceinline__ void ll_direct_agree(uint8_t* window, int half, int word, uint32_t tag, int num_ranks,
                                                volatile uint8_t* absent, int32_t* rank_state) {
    __syncthreads();
    for (int peer = threadIdx.x; peer < num_ranks; peer += blockDim.x) {
        const int decided = ll_direct_decide(window, half, word, peer, tag, absent[peer]);
        absent[peer] = static_cast<uint8_t>(decided);
        if (decided == kLlDirectPeerTimedOut) {
            atomicExch(rank_state + peer, 1);
            atomicExch(rank_state + num_ranks + peer, 1);
        }
    }
    __syncthreads();
}

// Rank masks: `absent` (shared memory) before any flag: for a dispatch from the call's copy of the
// mask (`rank_view`, 1 = masked), for a combine from its dispatch's decisions (`present`, 1 = in),
// and for both from the peers taken as failed (`failed`: their flags will not come; a receive run
// by a hook may find peers a later call's receive took as failed meanwhile).
__device__ __forceinline__ void ll_direct_start_view(int num_ranks, const int32_t* rank_view, const int32_t* present,
                                                     const int32_t* failed, volatile uint8_t* absent) {
    for (int peer = threadIdx.x; peer < num_ranks; peer += blockDim.x)
        absent[peer] = (rank_view != nullptr && rank_view[peer] != 0) || (present != nullptr && present[peer] == 0) ||
                       failed[peer] != 0
            ? kLlDirectPeerMasked : kLlDirectPeerIn;
    __syncthreads();
}

// By one thread of the last block of a receive: the half's next tag, and any recorded error to the
// host's mapped record (comm/window.cuh's end_wait, without the shared epoch).
__device__ __forceinline__ void ll_direct_finish(uint8_t* window, int half, int seq_word, uint32_t* err_host) {
    uint32_t* ctrl = comm::ctrl_of(window);
    __threadfence();
    const volatile uint32_t* record = reinterpret_cast<const volatile uint32_t*>(ctrl + kCtrlError);
    atomicAdd(ctrl + ll_direct_word(half, seq_word), 1u);
    comm::error_to_host(record, record[0], err_host);
}

__device__ __forceinline__ uint32_t ll_direct_tag(uint8_t* window, int half, int seq_word) {
    return ld_volatile(comm::ctrl_of(window) + ll_direct_word(half, seq_word)) + 1u;
}

// Window regions (byte offsets, the same in every window; deep_ep/legacy/ll_direct.py lays them
// out): rows [L][R][T_max] of `row_bytes`, their scales [L][R][T_max][S] float32, their pair words
// [L][R][T_max] int32 (token * K + slot), and the combine's rows [T_max * K] bf16.
struct LlDirectRegions {
    int64_t rows, scales, pairs, combine;
};

__device__ __forceinline__ void ll_direct_dispatch_send_impl(const comm::LsaTransport& tr, int half,
                                                             LlDirectRegions regions, const uint4* __restrict__ x,
                                                             const int64_t* __restrict__ topk_idx, int num_tokens,
                                                             int hidden, int num_topk, int num_experts,
                                                             int num_local_experts, int num_slots, int use_fp8,
                                                             int round_scale, const int32_t* rank_view,
                                                             uint32_t fingerprint) {
    __shared__ int64_t s_expert[kLlDirectMaxTopk];
    __shared__ int s_place[kLlDirectMaxTopk];
    __shared__ int s_owner[kLlDirectMaxTopk];      // the expert's rank, -1: the slot sends nothing
    __shared__ int64_t s_row[kLlDirectMaxTopk];    // byte offsets of the row and its scales in the owner's window
    __shared__ int64_t s_scales[kLlDirectMaxTopk];
    const int chunks_per_row = hidden / kLlCastChannels;
    const int num_scales = hidden / kLlScaleChannels;
    const int64_t row_bytes = use_fp8 ? hidden : 2 * static_cast<int64_t>(hidden);
    constexpr int chunks_per_scale = kLlScaleChannels / kLlCastChannels;
    uint8_t* window = tr.local();
    // the flags' tag, read before the rows go out (off the last block's path): only this rank's
    // receive on the half moves it, after every block of the send (the same launch or an earlier one)
    const uint32_t tag = ll_direct_tag(window, half, kLlDirectDispatchSeq);
    for (int token = blockIdx.x; token < num_tokens; token += gridDim.x) {
        const uint4* row_x = x + static_cast<int64_t>(token) * chunks_per_row;
        // the thread's first chunks, loaded while the places are counted
        uint4 prefetched[kLlDirectSendPrefetch];
#pragma unroll
        for (int i = 0; i < kLlDirectSendPrefetch; ++i) {
            const int chunk = threadIdx.x + i * kLlDirectThreads;
            prefetched[i] = chunk < chunks_per_row ? __ldg(row_x + chunk) : make_uint4(0u, 0u, 0u, 0u);
        }
        if (threadIdx.x < num_topk) {
            s_expert[threadIdx.x] = __ldg(topk_idx + static_cast<int64_t>(token) * num_topk + threadIdx.x);
            s_place[threadIdx.x] = 0;
        }
        __syncthreads();
        // the place among each expert's tokens: the earlier tokens that chose it (a token names an
        // expert once)
        const int earlier = token * num_topk;
        for (int index = threadIdx.x; index < earlier; index += blockDim.x) {
            const int64_t expert = __ldg(topk_idx + index);
            if (expert < 0)
                continue;
            for (int slot = 0; slot < num_topk; ++slot)
                if (s_expert[slot] == expert)
                    atomicAdd(&s_place[slot], 1);
        }
        __syncthreads();
        if (threadIdx.x < num_topk) {
            const int64_t expert = s_expert[threadIdx.x];
            int owner = -1;
            // an id past the experts (unchecked inside a CUDA-graph capture) or a place past the
            // slots (a token naming an expert twice) would write outside the window: not sent; nor
            // is a row to a rank this rank masks
            if (expert >= 0 && expert < num_experts && s_place[threadIdx.x] < num_slots &&
                (rank_view == nullptr || rank_view[expert / num_local_experts] == 0)) {
                owner = static_cast<int>(expert / num_local_experts);
                const int64_t local = expert % num_local_experts;
                const int64_t row = (local * tr.num_ranks + tr.rank) * num_slots + s_place[threadIdx.x];
                tr.put<int32_t>(owner, regions.pairs + row * 4, token * num_topk + static_cast<int>(threadIdx.x));
                s_row[threadIdx.x] = regions.rows + row * row_bytes;
                s_scales[threadIdx.x] = regions.scales + row * num_scales * 4;
            }
            s_owner[threadIdx.x] = owner;
        }
        __syncthreads();
        // a chunk to every slot's row; the per-slot offsets are computed once above, so the stores
        // take no division
        const auto send_chunk = [&](int chunk, const uint4& packed) {
            if (!use_fp8) {
                for (int slot = 0; slot < num_topk; ++slot) {
                    const int owner = s_owner[slot];
                    if (owner >= 0)
                        tr.put<uint4>(owner, s_row[slot] + chunk * 16, packed);
                }
                return;
            }
            float scale_inv;
            const uint2 codes = ll_cast_chunk(packed, round_scale, scale_inv);
            const bool first_of_scale = chunk % chunks_per_scale == 0;
            for (int slot = 0; slot < num_topk; ++slot) {
                const int owner = s_owner[slot];
                if (owner < 0)
                    continue;
                tr.put<uint2>(owner, s_row[slot] + chunk * 8, codes);
                if (first_of_scale)
                    tr.put<float>(owner, s_scales[slot] + (chunk / chunks_per_scale) * 4, scale_inv);
            }
        };
        // the scale's chunks are consecutive lanes of one warp, all in or all out together
        // (ll_cast_chunk): chunks_per_row and the thread count are multiples of chunks_per_scale
#pragma unroll
        for (int i = 0; i < kLlDirectSendPrefetch; ++i) {
            const int chunk = threadIdx.x + i * kLlDirectThreads;
            if (chunk < chunks_per_row)
                send_chunk(chunk, prefetched[i]);
        }
        for (int chunk = threadIdx.x + kLlDirectSendPrefetch * kLlDirectThreads; chunk < chunks_per_row;
             chunk += kLlDirectThreads)
            send_chunk(chunk, __ldg(row_x + chunk));
        __syncthreads();    // the places are read before the next token's
    }
    if (!comm::last_block(window, ll_direct_word(half, kLlDirectDispatchSent), true))
        return;
    // every block's rows are out: this rank's count of every expert, to the expert's owner (rank masks:
    // an owner this rank masks gets an absent flag with the count it last got from this rank on the
    // half, which this rank keeps for each expert in its own control words)
    __shared__ int s_count[kLlDirectMaxExperts];
    for (int expert = threadIdx.x; expert < num_experts; expert += blockDim.x)
        s_count[expert] = 0;
    __syncthreads();
    const int num_pairs = num_tokens * num_topk;
    for (int index = threadIdx.x; index < num_pairs; index += blockDim.x) {
        const int64_t expert = __ldg(topk_idx + index);
        if (expert >= 0 && expert < num_experts)
            atomicAdd(&s_count[expert], 1);
    }
    __syncthreads();
    __threadfence_system();
    // (the included words by the flag's place in the owner's window: [local expert][owner], the same
    // place whatever the call's expert count)
    uint32_t* included = comm::ctrl_of(window) + ll_direct_word(half, kLlDirectDispatchIncluded);
    for (int expert = threadIdx.x; expert < num_experts; expert += blockDim.x) {
        const int local = expert % num_local_experts;
        const int owner = expert / num_local_experts;
        uint32_t value = static_cast<uint32_t>(s_count[expert]);
        if (rank_view != nullptr) {
            uint32_t* last = included + local * tr.num_ranks + owner;
            if (rank_view[owner] != 0)
                value = ll_direct_absent_flag(last, tag);
            else
                *last = ll_direct_included(tag, min(value, static_cast<uint32_t>(num_slots)));
        }
        tr.put_release(owner, ll_direct_flag_offset(half, kLlDirectDispatchFlags, local * tr.num_ranks + tr.rank),
                       ll_direct_flag(tag, fingerprint, value));
    }
}

// Which of `count` consecutive ranges (begins[0] = 0, nondecreasing) holds `row`: the last with
// begins[index] <= row, past empty ranges.
__device__ __forceinline__ int ll_direct_range_of(const int* begins, int count, int row) {
    int low = 0, high = count - 1;
    while (low < high) {
        const int middle = (low + high + 1) / 2;
        if (begins[middle] <= row)
            low = middle;
        else
            high = middle - 1;
    }
    return low;
}

// Exclusive prefix sums of counts[0..n) into begins[0..n] (begins[n]: the total), by warp 0.
__device__ __forceinline__ void ll_direct_scan(const int* counts, int* begins, int n) {
    if (threadIdx.x >= 32)
        return;
    const int lane = threadIdx.x;
    int carry = 0;
    for (int base = 0; base < n; base += 32) {
        const int value = base + lane < n ? counts[base + lane] : 0;
        int sum = value;
#pragma unroll
        for (int offset = 1; offset < 32; offset *= 2) {
            const int other = __shfl_up_sync(0xffffffffu, sum, offset);
            if (lane >= offset)
                sum += other;
        }
        if (base + lane < n)
            begins[base + lane] = carry + sum - value;
        carry += __shfl_sync(0xffffffffu, sum, 31);
    }
    if (lane == 0)
        begins[n] = carry;
}

__device__ __forceinline__ void ll_direct_dispatch_recv_impl(
        const comm::LsaTransport& tr, int half, LlDirectRegions regions, uint4* __restrict__ data_out,
        float* __restrict__ scales_out, int32_t* __restrict__ recv_count, int32_t* __restrict__ src_info,
        int64_t* __restrict__ layout_range, int32_t* __restrict__ stats, int32_t* __restrict__ routes,
        int num_local_experts, int num_slots, int num_topk, int hidden, int use_fp8, int use_ue8m0,
        const int32_t* rank_view, int32_t* rank_state, int32_t* present, uint32_t fingerprint, uint64_t timeout_ns,
        uint32_t* err_host) {
    // [local expert][source rank]: the counts, then where each one's rows begin among all received rows
    __shared__ int s_counts[kLlDirectMaxExperts];
    __shared__ int s_begins[kLlDirectMaxExperts + 1];
    __shared__ int s_ok;
    __shared__ volatile uint8_t s_absent[kLlDirectMaxRanks];   // rank masks: each source's kLlDirectPeer*
    uint8_t* window = tr.local();
    const int num_ranks = tr.num_ranks;
    const int num_pairs = num_local_experts * num_ranks;
    const int num_rows = num_ranks * num_slots;
    const int num_scales = hidden / kLlScaleChannels;
    const int64_t row_bytes = use_fp8 ? hidden : 2 * static_cast<int64_t>(hidden);
    const int row_chunks = static_cast<int>(row_bytes / 16);
    const int pairs_per_rank = num_slots * num_topk;
    const int lane = threadIdx.x % 32;
    const uint32_t tag = ll_direct_tag(window, half, kLlDirectDispatchSeq);
    // every block waits for every count (each block places rows of any expert)
    if (threadIdx.x == 0)
        s_ok = 1;
    if (rank_view == nullptr) {
        __syncthreads();
        for (int index = threadIdx.x; index < num_pairs; index += blockDim.x) {
            uint32_t count = 0;
            if (!ll_direct_wait(window, ll_direct_flag_offset(half, kLlDirectDispatchFlags, index), tag, fingerprint,
                                count, tr.rank, index % num_ranks, kPhaseDispatch, timeout_ns)) {
                s_ok = 0;
                count = 0;
            }
            s_counts[index] = static_cast<int>(min(count, static_cast<uint32_t>(num_slots)));
        }
    } else {
        // rank masks: this block's view of each source (its flags, a timeout), then the blocks'
        // decision; a source decided in whose count this block has not seen yet is waited for again,
        // strictly (its flags are on their way: another block saw them)
        ll_direct_start_view(num_ranks, rank_view, nullptr, rank_state + num_ranks, s_absent);
        for (int index = threadIdx.x; index < num_pairs; index += blockDim.x) {
            const int source = index % num_ranks;
            uint32_t count = 0;
            s_counts[index] = -1;
            if (s_absent[source] != kLlDirectPeerIn)
                continue;
            // (its own flags: a timeout is an error, never a mask)
            if (ll_direct_wait(window, ll_direct_flag_offset(half, kLlDirectDispatchFlags, index), tag, fingerprint,
                               count, tr.rank, source, kPhaseDispatch, timeout_ns, true,
                               source == tr.rank ? nullptr : s_absent + source)) {
                if (ll_direct_is_absent(count))
                    s_absent[source] = kLlDirectPeerMasked;
                else
                    s_counts[index] = static_cast<int>(min(count, static_cast<uint32_t>(num_slots)));
            } else if (comm::has_error(window)) {
                s_ok = 0;
            }
        }
        ll_direct_agree(window, half, kLlDirectDispatchDecided, tag, num_ranks, s_absent, rank_state);
        for (int index = threadIdx.x; index < num_pairs; index += blockDim.x) {
            const int source = index % num_ranks;
            if (s_absent[source] != kLlDirectPeerIn) {
                s_counts[index] = 0;
            } else if (s_counts[index] < 0) {
                // (a source flags all its counts absent or none, from its call's copy of the mask:
                // an absent flag here would leave that expert's rows out)
                uint32_t count = 0;
                if (!ll_direct_wait(window, ll_direct_flag_offset(half, kLlDirectDispatchFlags, index), tag,
                                    fingerprint, count, tr.rank, source, kPhaseDispatch, timeout_ns, true)) {
                    s_ok = 0;
                    count = 0;
                }
                s_counts[index] = ll_direct_is_absent(count)
                    ? 0 : static_cast<int>(min(count, static_cast<uint32_t>(num_slots)));
            }
        }
        if (blockIdx.x == 0)
            for (int source = threadIdx.x; source < num_ranks; source += blockDim.x)
                present[source] = s_absent[source] == kLlDirectPeerIn;
    }
    __syncthreads();
    ll_direct_scan(s_counts, s_begins, num_pairs);
    __syncthreads();
    __threadfence();    // the rows each flag covers, read by threads other than the one that waited
    if (s_ok != 0) {
        // the counts, ranges and statistics (layout rows of an expert: its source ranks in order),
        // src_info -1 past each expert's count
        const int64_t grid_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
        const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
        for (int64_t index = thread; index < num_pairs; index += grid_threads) {
            const int local = static_cast<int>(index / num_ranks);
            const int expert_begin = s_begins[local * num_ranks];
            layout_range[index] = (static_cast<int64_t>(s_begins[index] - expert_begin) << 32) | s_counts[index];
            if (index % num_ranks == 0) {
                const int total = s_begins[(local + 1) * num_ranks] - expert_begin;
                recv_count[local] = total;
                if (stats != nullptr)
                    stats[local] += total;
            }
        }
        const int64_t num_layout_rows = static_cast<int64_t>(num_local_experts) * num_rows;
        for (int64_t index = thread; index < num_layout_rows; index += grid_threads) {
            const int local = static_cast<int>(index / num_rows);
            if (static_cast<int>(index % num_rows) >= s_begins[(local + 1) * num_ranks] - s_begins[local * num_ranks])
                src_info[index] = -1;
        }
        // Every received row in (expert, source rank, place) order, cut in segments of kLlDirectSegment
        // 16-byte chunks, a warp per segment; the first segment also moves the row's scales (FP8) and
        // pair word. Window memory, written by peers: loads that skip L1 (a previous call's lines may
        // be there).
        const float* window_scales = reinterpret_cast<const float*>(window + regions.scales);
        const int32_t* window_pairs = reinterpret_cast<const int32_t*>(window + regions.pairs);
        const int segments = (row_chunks + kLlDirectSegment - 1) / kLlDirectSegment;
        const int64_t num_units = static_cast<int64_t>(s_begins[num_pairs]) * segments;
        const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kLlDirectWarps;
        for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kLlDirectWarps + threadIdx.x / 32; unit < num_units;
             unit += num_warps) {
            const int flat = static_cast<int>(unit / segments);
            const int segment = static_cast<int>(unit % segments);
            const int pair_index = ll_direct_range_of(s_begins, num_pairs, flat);
            const int local = pair_index / num_ranks;
            const int source = pair_index % num_ranks;
            const int place = flat - s_begins[pair_index];
            const int row = s_begins[pair_index] - s_begins[local * num_ranks] + place;
            const int64_t window_row = static_cast<int64_t>(pair_index) * num_slots + place;
            const int64_t out_row = static_cast<int64_t>(local) * num_rows + row;
            const uint4* from = reinterpret_cast<const uint4*>(window + regions.rows + window_row * row_bytes);
            uint4* to = data_out + out_row * row_chunks;
            const int first = segment * kLlDirectSegment + lane;
            uint4 values[kLlDirectSegment / 32];
#pragma unroll
            for (int i = 0; i < kLlDirectSegment / 32; ++i)
                if (first + i * 32 < row_chunks)
                    values[i] = __ldcg(from + first + i * 32);
            if (segment == 0) {
                if (use_fp8) {
                    for (int column = lane; column < num_scales; column += 32) {
                        const float scale = __ldcg(window_scales + window_row * num_scales + column);
                        if (use_ue8m0) {
                            const int64_t word =
                                (static_cast<int64_t>(local) * (num_scales / 4) + column / 4) * num_rows + row;
                            reinterpret_cast<uint8_t*>(scales_out)[word * 4 + column % 4] =
                                static_cast<uint8_t>(ll_ue8m0_of(__float_as_uint(scale)));
                        } else {
                            scales_out[(static_cast<int64_t>(local) * num_scales + column) * num_rows + row] = scale;
                        }
                    }
                }
                if (lane == 0) {
                    const int pair = __ldcg(window_pairs + window_row);
                    src_info[out_row] = pair / num_topk;
                    routes[out_row] = source * pairs_per_rank + pair;
                }
            }
#pragma unroll
            for (int i = 0; i < kLlDirectSegment / 32; ++i)
                if (first + i * 32 < row_chunks)
                    to[first + i * 32] = values[i];
        }
    }
    if (comm::last_block(window, ll_direct_word(half, kLlDirectDispatchDone), false) && threadIdx.x == 0)
        ll_direct_finish(window, half, kLlDirectDispatchSeq, err_host);
}

__device__ __forceinline__ void ll_direct_combine_send_impl(const comm::LsaTransport& tr, int half,
                                                            LlDirectRegions regions, const uint4* __restrict__ x,
                                                            int64_t expert_stride, int64_t row_stride,
                                                            const int32_t* __restrict__ recv_count,
                                                            const int32_t* __restrict__ routes, int num_local_experts,
                                                            int num_slots, int num_topk, int hidden,
                                                            const int32_t* present, const int32_t* rank_state,
                                                            uint32_t fingerprint) {
    __shared__ int s_counts[kLlDirectMaxExperts];
    __shared__ int s_begins[kLlDirectMaxExperts + 1];
    __shared__ volatile uint8_t s_absent[kLlDirectMaxRanks];   // rank masks: the peers sent nothing
    const int num_rows = tr.num_ranks * num_slots;
    const int row_chunks = hidden * 2 / 16;
    const int pairs_per_rank = num_slots * num_topk;
    const int lane = threadIdx.x % 32;
    uint8_t* window = tr.local();
    const uint32_t tag = ll_direct_tag(window, half, kLlDirectCombineSeq);    // as the dispatch send's
    // every expert's received rows in order, each cut in segments of kLlDirectSegment 16-byte chunks:
    // a warp per segment, its route read once, kLlDirectSegment / 32 loads in flight per lane
    for (int local = threadIdx.x; local < num_local_experts; local += blockDim.x)
        s_counts[local] = min(__ldg(recv_count + local), num_rows);
    if (present != nullptr)
        ll_direct_start_view(tr.num_ranks, nullptr, present, rank_state + tr.num_ranks, s_absent);
    __syncthreads();
    ll_direct_scan(s_counts, s_begins, num_local_experts);
    __syncthreads();
    const int segments = (row_chunks + kLlDirectSegment - 1) / kLlDirectSegment;
    const int64_t num_units = static_cast<int64_t>(s_begins[num_local_experts]) * segments;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kLlDirectWarps;
    for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kLlDirectWarps + threadIdx.x / 32; unit < num_units;
         unit += num_warps) {
        const int flat = static_cast<int>(unit / segments);
        const int first = static_cast<int>(unit % segments) * kLlDirectSegment + lane;
        const int local = ll_direct_range_of(s_begins, num_local_experts, flat);
        const int row = flat - s_begins[local];
        const int route = __ldg(routes + static_cast<int64_t>(local) * num_rows + row);
        const int destination = route / pairs_per_rank;
        if (present != nullptr && s_absent[destination] != kLlDirectPeerIn)
            continue;
        const uint4* from = x + local * expert_stride + row * row_stride;
        uint4 values[kLlDirectSegment / 32];
#pragma unroll
        for (int i = 0; i < kLlDirectSegment / 32; ++i)
            if (first + i * 32 < row_chunks)
                values[i] = __ldg(from + first + i * 32);
        const int64_t target = regions.combine + static_cast<int64_t>(route % pairs_per_rank) * hidden * 2;
#pragma unroll
        for (int i = 0; i < kLlDirectSegment / 32; ++i)
            if (first + i * 32 < row_chunks)
                tr.put<uint4>(destination, target + (first + i * 32) * 16, values[i]);
    }
    if (!comm::last_block(window, ll_direct_word(half, kLlDirectCombineSent), true))
        return;
    __threadfence_system();
    // (rank masks: a peer left out gets an absent flag naming the last combine on the half that
    // included it, kept in this rank's control words)
    uint32_t* included = comm::ctrl_of(window) + ll_direct_word(half, kLlDirectCombineIncluded);
    for (int peer = threadIdx.x; peer < tr.num_ranks; peer += blockDim.x) {
        uint32_t value = 1u;
        if (present != nullptr) {
            if (s_absent[peer] != kLlDirectPeerIn)
                value = ll_direct_absent_flag(included + peer, tag);
            else
                included[peer] = ll_direct_included(tag, 1u);
        }
        tr.put_release(peer, ll_direct_flag_offset(half, kLlDirectCombineFlags, tr.rank),
                       ll_direct_flag(tag, fingerprint, value));
    }
}

__device__ __forceinline__ void ll_direct_combine_recv_impl(const comm::LsaTransport& tr, int half,
                                                            LlDirectRegions regions,
                                                            const int64_t* __restrict__ topk_idx,
                                                            const float* __restrict__ topk_weights,
                                                            uint4* __restrict__ out, int num_tokens, int num_topk,
                                                            int hidden, int num_local_experts, int32_t* rank_state,
                                                            const int32_t* present, uint32_t fingerprint,
                                                            uint64_t timeout_ns, uint32_t* err_host) {
    __shared__ int s_ok;
    __shared__ volatile uint8_t s_absent[kLlDirectMaxRanks];   // rank masks: each peer's kLlDirectPeer*
    __shared__ uint8_t s_in[kLlDirectMaxRanks];                // rank masks: the decisions, 1 = in
    uint8_t* window = tr.local();
    const uint32_t tag = ll_direct_tag(window, half, kLlDirectCombineSeq);
    const bool masks = present != nullptr;
    if (threadIdx.x == 0)
        s_ok = 1;
    if (masks)
        ll_direct_start_view(tr.num_ranks, nullptr, present, rank_state + tr.num_ranks, s_absent);
    __syncthreads();
    for (int peer = threadIdx.x; peer < tr.num_ranks; peer += blockDim.x) {
        if (masks && s_absent[peer] != kLlDirectPeerIn)
            continue;
        uint32_t value = 0;
        if (ll_direct_wait(window, ll_direct_flag_offset(half, kLlDirectCombineFlags, peer), tag, fingerprint, value,
                           tr.rank, peer, kPhaseCombine, timeout_ns, masks,
                           masks && peer != tr.rank ? s_absent + peer : nullptr)) {
            if (masks && ll_direct_is_absent(value))
                s_absent[peer] = kLlDirectPeerMasked;
        } else if (!masks || comm::has_error(window)) {
            s_ok = 0;
        }
    }
    // rank masks: one flag per peer, so a block that saw it agrees with the others unless it came
    // at the timeout; a peer decided in whose flag this block missed is waited for again, strictly
    if (masks) {
        ll_direct_agree(window, half, kLlDirectCombineDecided, tag, tr.num_ranks, s_absent, rank_state);
        for (int peer = threadIdx.x; peer < tr.num_ranks; peer += blockDim.x) {
            uint32_t value = 0;
            if (s_absent[peer] == kLlDirectPeerIn &&
                !ll_direct_wait(window, ll_direct_flag_offset(half, kLlDirectCombineFlags, peer), tag, fingerprint,
                                value, tr.rank, peer, kPhaseCombine, timeout_ns, true))
                s_ok = 0;
            s_in[peer] = s_absent[peer] == kLlDirectPeerIn;
        }
    }
    __syncthreads();
    __threadfence();    // the rows each flag covers, read by threads other than the one that waited
    if (s_ok != 0) {
        const uint4* pairs = reinterpret_cast<const uint4*>(window + regions.combine);
        const int64_t chunks_per_row = hidden / kLlReduceChannels;
        ll_reduce_chunks(out, num_tokens, hidden, [&](int64_t token, int64_t column, float (&acc)[kLlReduceChannels]) {
            // the slots' rows kLlDirectReduceBatch at a time, all loaded before any is needed (a slot's
            // row is read whether or not the slot is selected, so no load waits for the top-k ids),
            // the selected ones summed in slot order
            for (int first = 0; first < num_topk; first += kLlDirectReduceBatch) {
                uint4 packed[kLlDirectReduceBatch];
                float weights[kLlDirectReduceBatch];
                bool selected[kLlDirectReduceBatch];
#pragma unroll
                for (int i = 0; i < kLlDirectReduceBatch; ++i) {
                    const int slot = first + i;
                    selected[i] = false;
                    if (slot < num_topk) {
                        const int64_t pair = token * num_topk + slot;
                        const int64_t expert = __ldg(topk_idx + pair);
                        // rank masks: a slot whose expert's rank is out of the call adds nothing
                        selected[i] = expert >= 0 && (!masks || (expert < static_cast<int64_t>(num_local_experts) *
                                                                              tr.num_ranks &&
                                                                 s_in[static_cast<int>(expert) / num_local_experts]));
                        weights[i] = __ldg(topk_weights + pair);
                        packed[i] = __ldcg(pairs + pair * chunks_per_row + column);
                    }
                }
#pragma unroll
                for (int i = 0; i < kLlDirectReduceBatch; ++i)
                    if (selected[i])
                        ll_reduce_add(acc, packed[i], weights[i]);
            }
        });
    }
    if (comm::last_block(window, ll_direct_word(half, kLlDirectCombineDone), false) && threadIdx.x == 0)
        ll_direct_finish(window, half, kLlDirectCombineSeq, err_host);
}

}  // namespace deep_ep
