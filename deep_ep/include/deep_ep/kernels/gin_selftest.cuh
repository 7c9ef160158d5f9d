// Test kernels of the GIN transports (comm/gin.cuh); built by tests and tools only, never by the
// library's modules. `gin_selftest`: emulated ranks (blocks [0, num_ranks)) each send a payload per
// round to the next rank and to themselves in `pieces` puts on context round % num_contexts, reuse
// the source, wait for the signals and count the words that differ from what was sent; the other
// blocks are the emulated NIC. Three modes are bugs of a GIN user that the emulated NIC must expose:
// trusting a weak signal for the other puts (kModeWeakLast), overwriting a source before flush
// (kModeNoFlush), and polling a put's first word as the sign that the rest landed (kModeFirstWord);
// kModeNoSignal checks that a wait's timeout is recorded. `gin_nccl_probe` only
// compiles the NCCL transport (NCCL >= 2.28.7 headers).
#pragma once

#include "../comm/gin.cuh"

namespace deep_ep::gin_selftest {

constexpr int kModeStrong = 0;     // pieces, a strong signal on the last; flush before the source is reused
constexpr int kModeWeakEach = 1;   // a weak signal on every piece, the reader waits for all of them
constexpr int kModeWeakLast = 2;   // bug: a weak signal on the last piece only, trusted for every piece
constexpr int kModeNoFlush = 3;    // bug: a strong signal, the source overwritten without a flush
constexpr int kModeCounter = 4;    // every piece counted; the source is reused after wait_counter
constexpr int kModeNoSignal = 5;   // nothing signals: every rank's first wait times out and records it
constexpr int kModeFirstWord = 6;  // bug: no signal; the reader polls each payload's first word, then reads the rest
constexpr int kPhase = 8;          // the phase this test's waits record on a timeout
constexpr int kReportWords = 4;    // per rank: mismatched words, rounds with a mismatch, rounds completed, 0

__device__ __forceinline__ uint32_t payload_word(int rank, int round, int word) {
    return ((rank + 1) * 0x9E3779B1u ^ (round + 1) * 0x85EBCA77u ^ word * 0xC2B2AE3Du) | 1u;
}

// Window layout (bytes): the control region, the source, then `rounds` receive slots from the left
// neighbour and `rounds` from this rank itself (deep_ep/comm/gin.py computes the same size).
__device__ __forceinline__ int64_t source_offset() { return kCtrlBytes; }
__device__ __forceinline__ int64_t recv_offset(int64_t payload_bytes, int rounds, bool from_self, int round) {
    return kCtrlBytes + payload_bytes * (1 + (from_self ? rounds : 0) + round);
}

__device__ __forceinline__ void issue(const comm::EmulatedGinTransport& tr, int mode, int context, int peer,
                                      int64_t dst_offset, int64_t payload_bytes, int pieces, int signal_id) {
    const int64_t piece_bytes = payload_bytes / pieces;
    for (int piece = 0; piece < pieces; ++piece) {
        comm::GinSignal signal;
        const bool last = piece == pieces - 1;
        if (mode == kModeWeakEach || (mode == kModeWeakLast && last)) signal = comm::GinSignal{signal_id, 1, true};
        else if (last && mode != kModeNoSignal && mode != kModeFirstWord) signal = comm::GinSignal{signal_id, 1, false};
        tr.put(context, peer, dst_offset + piece * piece_bytes, source_offset() + piece * piece_bytes, piece_bytes,
               signal, mode == kModeCounter ? 0 : -1);
    }
}

}  // namespace deep_ep::gin_selftest

// report: [num_ranks][kReportWords] (zeroed). Launch cooperatively (the NIC and the ranks spin on
// each other): num_ranks blocks of ranks, then enough blocks for one warp per queue.
extern "C" __global__ void gin_selftest(const __grid_constant__ deep_ep::comm::EmulatedGinArgs args, int mode,
                                        int rounds, int payload_words, int pieces, uint64_t timeout_ns,
                                        uint32_t* report) {
    using namespace deep_ep;
    using namespace deep_ep::gin_selftest;
    if (static_cast<int>(blockIdx.x) >= args.num_ranks) {
        const int nic_warp = (blockIdx.x - args.num_ranks) * (blockDim.x / 32) + threadIdx.x / 32;
        comm::emulated_gin_nic(args, nic_warp, args.num_ranks);
        return;
    }
    const int rank = blockIdx.x;
    const comm::EmulatedGinTransport tr{&args, rank, args.num_contexts};
    const int right = (rank + 1) % args.num_ranks, left = (rank + args.num_ranks - 1) % args.num_ranks;
    const int64_t payload_bytes = static_cast<int64_t>(payload_words) * 4;
    uint32_t* source = reinterpret_cast<uint32_t*>(tr.local() + source_offset());
    __shared__ int s_ok;
    __shared__ uint32_t s_mismatches;
    for (int round = 0; round < rounds; ++round) {
        const int context = tr.context_of(round);
        const uint64_t uses = round / args.num_contexts + 1;  // rounds so far on this context
        for (int w = threadIdx.x; w < payload_words; w += blockDim.x) __stcg(source + w, payload_word(rank, round, w));
        if (threadIdx.x == 0) { s_ok = 1; s_mismatches = 0; }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();  // the block's source words before the NIC may read them
            issue(tr, mode, context, right, recv_offset(payload_bytes, rounds, false, round), payload_bytes, pieces, 0);
            issue(tr, mode, context, rank, recv_offset(payload_bytes, rounds, true, round), payload_bytes, pieces, 1);
            if (mode == kModeCounter) {
                if (!tr.wait_counter(context, 0, uses * pieces * 2, kPhase, timeout_ns)) s_ok = 0;
            } else if (mode != kModeNoFlush) {
                tr.flush(context);
            }
        }
        __syncthreads();
        // Reuse the source: legal once flushed (or counted), a bug otherwise.
        for (int w = threadIdx.x; w < payload_words; w += blockDim.x) __stcg(source + w, ~payload_word(rank, round, w));
        if (threadIdx.x == 0 && s_ok && mode == kModeFirstWord) {
            // the bug: each payload's first word as its flag (the NIC may land it before the others)
            const uint64_t start = global_timer_ns();
            for (int from_self = 0; from_self < 2 && s_ok; ++from_self) {
                const uint32_t* first = reinterpret_cast<const uint32_t*>(
                    tr.local() + recv_offset(payload_bytes, rounds, from_self != 0, round));
                while (ld_volatile(first) != payload_word(from_self ? rank : left, round, 0)) {
                    if (global_timer_ns() - start > timeout_ns) { s_ok = 0; break; }
                }
            }
        } else if (threadIdx.x == 0 && s_ok) {
            const uint64_t per_round = mode == kModeWeakEach ? pieces : 1;
            if (!tr.wait_signal(context, 0, uses * per_round, left, kPhase, timeout_ns) ||
                !tr.wait_signal(context, 1, uses * per_round, rank, kPhase, timeout_ns) || comm::has_error(tr.local()))
                s_ok = 0;
        }
        __syncthreads();
        if (!s_ok) break;
        __threadfence();
        for (int from_self = 0; from_self < 2; ++from_self) {
            const int sender = from_self ? rank : left;
            const uint32_t* recv = reinterpret_cast<const uint32_t*>(
                tr.local() + recv_offset(payload_bytes, rounds, from_self != 0, round));
            uint32_t bad = 0;
            for (int w = threadIdx.x; w < payload_words; w += blockDim.x)
                bad += __ldcg(recv + w) != payload_word(sender, round, w);
            if (bad) atomicAdd(&s_mismatches, bad);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            report[rank * kReportWords] += s_mismatches;
            report[rank * kReportWords + 1] += s_mismatches ? 1u : 0u;
            report[rank * kReportWords + 2] = round + 1;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(args.done, 1u);
    }
}

#if EP_GIN_NCCL
// Compile-only: every member function of the NCCL transport, as the scale-out kernels will call them.
extern "C" __global__ void gin_nccl_probe(const __grid_constant__ ncclDevComm comm, ncclWindow_t window,
                                          int num_contexts, int phase, uint64_t timeout_ns, uint64_t* out) {
    using namespace deep_ep;
    const comm::NcclGinTransport tr{&comm, window, ncclTeamWorld(comm), num_contexts};
    const int context = tr.context_of(blockIdx.x);
    const int peer = (tr.rank() + 1) % tr.num_ranks();
    if (threadIdx.x == 0) {
        tr.put(context, peer, 4096, 0, 1024);
        tr.put(context, peer, 8192, 0, 1024, comm::GinSignal{0, 1, false});
        tr.put(context, peer, 12288, 0, 1024, comm::GinSignal{1, 1, true}, 0);
        tr.put(context, peer, 16384, 0, 1024, comm::GinSignal{}, 1);
        tr.signal(context, peer, 2, 1);
        tr.flush(context);
        const bool ok = tr.wait_signal(context, 0, 1, peer, phase, timeout_ns) &&
                        tr.wait_counter(context, 1, 1, phase, timeout_ns);
        out[blockIdx.x] = ok ? tr.read_signal(context, 2) + tr.read_counter(context, 0) : 0;
        tr.reset_signal(context, 2);
        tr.reset_counter(context, 0);
    }
}
#endif
