// What the host and the kernels must agree on: window control words, error codes, phases, limits
// and the layout words of a handle. This file is the one source: deep_ep/backends/gpu/abi.py reads
// every `constexpr int k... = ...;` line and the EP_LAYOUT_WORDS list below, so keep them in that
// form (one per line; values are integers or sums/products of earlier names).
#pragma once

#include "types.cuh"

namespace deep_ep {

constexpr int kMaxRanks = 1024;     // ranks of one scale-up (LSA) domain: signal words per window
constexpr int kMaxExperts = 1024;   // experts a window's count matrix has room for
constexpr int kMaxTopk = 16;        // top-k assumed when a buffer was created without num_topk

// The control region of every rank's window (u32 words from the window's start).
constexpr int kCtrlBytes = 65536;
constexpr int kCtrlArrive = 0;               // [kMaxRanks] signals received from each peer
constexpr int kCtrlEpoch = kMaxRanks;        // waits this rank has completed (one per consumer phase)
constexpr int kCtrlRound = kMaxRanks + 1;    // data rounds completed (selects the receive half)
constexpr int kCtrlDone = kMaxRanks + 2;     // blocks that finished a producer phase (send, notify)
constexpr int kCtrlDoneWait = kMaxRanks + 3; // blocks that finished a consumer phase (finish_wait)
constexpr int kCtrlError = kMaxRanks + 4;    // [4]: code, rank, peer, phase (the first error wins)
constexpr int kCtrlTag = kMaxRanks + 8;      // [epoch parity][peer][2]: (call number, fingerprint)

// Error codes (kCtrlError[0]) and the phases a timeout names (kCtrlError[3]).
constexpr int kErrTimeout = 1;    // a peer did not arrive in time
constexpr int kErrCapacity = 2;   // this rank would receive more rows than its outputs hold
constexpr int kErrBadExpert = 3;  // a rank's topk_idx holds an id outside [-1, num_experts): nothing moved
constexpr int kErrMismatch = 4;   // ranks are at different calls of the buffer, or disagree on the call
constexpr int kErrFingerprint = 5;  // a low-latency direct call's peer made the same call with other sizes
constexpr int kErrPpByteCount = 6;  // a pp_recv tensor's byte count differs from the sent one (phase: the sent count)
// Every phase of every kernel is here, each code once: the host names them from this list
// (deep_ep/backends/gpu/abi.py, PHASES), so a code shared by two primitives would misname a timeout.
constexpr int kPhaseNotify = 1;    // dispatch: waiting for peers' counts
constexpr int kPhaseDispatch = 2;  // dispatch: waiting for peers' tokens
constexpr int kPhaseCombine = 3;   // combine: waiting for peers' expert outputs
constexpr int kPhaseBarrier = 4;   // barrier: waiting for peers
constexpr int kPhaseGinPut = 16;     // GIN put: waiting for room in a full queue, or beyond the emulation's limits
constexpr int kPhaseGinFlush = 17;   // GIN flush: waiting for the NIC to read this rank's sources
constexpr int kPhaseGinNic = 18;     // emulated NIC: its rank's data kernel neither put nor ended (comm/gin.cuh)
constexpr int kPhaseDispatchRail = 19;  // hybrid dispatch: a forwarder waiting for its rail peers' slots
constexpr int kPhaseCombineRail = 20;   // hybrid combine: a source waiting for its rail peers' node partials
constexpr int kPhasePpSend = 21;   // pp_send: waiting for a free slot at the receiver
constexpr int kPhasePpRecv = 22;   // pp_recv: waiting for the sender's tensor
constexpr int kPhaseAgrsEntered = 24;  // AGRS (emulated ranks): waiting for a peer to open the session
constexpr int kPhaseAgrsCall = 25;     // AGRS handle (emulated ranks): waiting for a peer's call's bytes

// A dispatch's count matrix (int32, in every window at counts_offset), row s written by source s:
// [R] tokens per destination rank, [E] pairs per expert, then the first out-of-range expert id it
// found: its flat index t * K + k (-1: none) and its value (clamped to int32).
constexpr int kCountsExtraWords = 2;

// The notify kernel: warps (token groups) per block, several so that the grid barriers take fewer
// atomics; (token, slot) pairs staged in shared memory at a time (whole tokens: top-k at most this).
constexpr int kNotifyWarps = 8;
constexpr int kNotifyTilePairs = 256;
// Its scratch: kNotifyGroupCounts + blocks * (R + kMaxExperts) int32 words, zeroed by the host but
// for kNotifyBadIndex; each kernel leaves them as it found them.
constexpr int kNotifyBarrierCount = 0;  // grid barrier: blocks arrived
constexpr int kNotifyBarrierGen = 1;    // grid barrier: generation
constexpr int kNotifyBadIndex = 2;      // smallest flat index of an out-of-range id (INT_MAX: none)
constexpr int kNotifyGroupCounts = 3;   // [blocks][R + E] pairs per column and block

// What the layout stage reports to a host that synchronises (int32 words of mapped host memory);
// the sequence number is written last.
constexpr int kReadbackSeq = 0;         // the call's sequence number (the host polls for it)
constexpr int kReadbackStatus = 1;      // 0, or an error code (kErr*)
constexpr int kReadbackRank = 2;        // the rank that reports
constexpr int kReadbackPeer = 3;        // timeout: the missing peer; bad expert id: the source rank;
                                        // mismatch: the first peer that differs
constexpr int kReadbackDetail = 4;      // timeout: the phase; bad expert id: the flat index t * K + k;
                                        // mismatch: that peer's call number
constexpr int kReadbackValue = 5;       // bad expert id: the id
constexpr int kReadbackOutRows = 6;     // output rows incl. padding
constexpr int kReadbackTokRows = 7;     // received token rows
constexpr int kReadbackCounts = 8;      // [L] received pairs per local expert, padded to the alignment

// The layout words of a handle (int32), in order: name, count in R, L (local experts) or E.
#define EP_LAYOUT_WORDS(X)                                                                        \
    X(num_out_rows, 1)       /* output rows incl. padding (expanded) = token rows (non-expanded) */ \
    X(num_tok_rows, 1)       /* received token rows */                                              \
    X(tok_prefix, R)         /* [R] inclusive prefix of token rows per source rank */               \
    X(rank_prefix_sum, R)    /* [R] inclusive prefix per source (tokens; expanded: pairs) */        \
    X(raw_counts, L)         /* [L] received pairs per local expert */                              \
    X(padded_counts, L)      /* [L] the same, padded to the alignment */                            \
    X(expert_start, L)       /* [L] first output row of each local expert */                        \
    X(send_base, R)          /* [R] this rank's first token row at each destination */              \
    X(out_base, E)           /* [E] expanded: this rank's first output row per global expert */     \
    X(psum_expert, L)        /* [L] the handle's psum_num_recv_tokens_per_expert (DeepEP's meaning) */

struct LayoutIndex {
#define EP_LAYOUT_MEMBER(name, count) int name##_offset = 0;
    EP_LAYOUT_WORDS(EP_LAYOUT_MEMBER)
#undef EP_LAYOUT_MEMBER
    int num_words = 0;

    __host__ __device__ constexpr LayoutIndex(int R, int L, int E) {
        int offset = 0;
#define EP_LAYOUT_PLACE(name, count) name##_offset = offset; offset += (count);
        EP_LAYOUT_WORDS(EP_LAYOUT_PLACE)
#undef EP_LAYOUT_PLACE
        num_words = offset;
    }
#define EP_LAYOUT_ACCESSOR(name, count) __host__ __device__ constexpr int name() const { return name##_offset; }
    EP_LAYOUT_WORDS(EP_LAYOUT_ACCESSOR)
#undef EP_LAYOUT_ACCESSOR
    __host__ __device__ constexpr int size() const { return num_words; }
};

}  // namespace deep_ep
