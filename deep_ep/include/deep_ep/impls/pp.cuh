// Pipeline send/recv between ring neighbours (ElasticBuffer.pp_send / pp_recv), one tensor per
// kernel, ordered on the caller's stream. Each rank's window holds, from `PpArgs::pp_offset` on, a
// word header, the byte count of every slot, and two receive rings (channel 0: from the previous
// rank, channel 1: from the next; with one or two ranks only channel 0) of `num_slots` slots.
// Counters are u32 and only grow within a configuration (pp_set_config zeroes them):
//   sent[c]      tensors this rank published on its outgoing channel c (only this rank writes it)
//   freed[c]     tensors of those the receiver has taken (the receiver adds, release)
//   published[c] tensors the sender has placed into this rank's ring c (the sender adds, release)
//   consumed[c]  tensors this rank took from ring c (only this rank writes it)
// A send of tensor n waits (acquire) for freed >= n + 1 - num_slots, writes slot n % num_slots of
// the receiver's ring and its byte count, then adds 1 to the receiver's published. A receive of
// tensor n waits for published >= n + 1, copies the slot out, then adds 1 to the sender's freed.
// Waits give up after the buffer's GPU timeout and record (kErrTimeout, rank, peer, phase) like the
// other kernels; a receive tensor of another byte count records kErrPpByteCount with the sent count.
// The copy-engine path (num_sms == 0, deep_ep/backends/gpu/pp.py) keeps the same words with stream
// memory operations: it writes sent/consumed/published/freed as absolute values (each word has one
// writer, so that equals the kernels' increments) and the slot's byte count, so the two paths mix.
// The host reads these constants (deep_ep/backends/gpu/pp.py): one `constexpr int` per line.
#pragma once

#include "../comm/pp.cuh"

namespace deep_ep {

// A lone block's copy is bound by the loads one SM keeps in flight: 512 threads x 8 x 16 bytes.
constexpr int kPpThreads = 512;        // threads per block of every PP kernel
constexpr int kPpCopyUnroll = 8;       // 16-byte loads in flight per thread of a copy
constexpr int kPpSent = 0;             // [2] header words (u32 from pp_offset)
constexpr int kPpFreed = 2;            // [2]
constexpr int kPpPublished = 4;        // [2]
constexpr int kPpConsumed = 6;         // [2]
constexpr int kPpDoneSend = 8;         // [2] blocks of a send kernel that finished (last-block count)
constexpr int kPpDoneRecv = 10;        // [2] the same for receive kernels
constexpr int kPpCounterWords = 12;    // words pp_set_config zeroes
constexpr int kPpFlush = 32;           // [num_ranks][kPpFlushWords]: what each rank reports at a flush
constexpr int kPpFlushWords = 6;       // sent[2], consumed[2], slot bytes / 32, slots
static_assert(kPpFlushWords % 2 == 0, "flush step 1 writes u64 window bases after the rows");

// The arguments of every PP kernel (host mirror: deep_ep/backends/gpu/pp.py).
struct PpArgs {
    int64_t pp_offset;      // byte offset of the PP region in every window
    int64_t sizes_offset;   // from pp_offset: u32 byte counts [2][num_slots]
    int64_t ring_offset;    // from pp_offset: slots [2][num_slots][slot_bytes]
    int64_t slot_bytes;     // a multiple of 32
    int num_slots;          // num_max_inflight_tensors
    int peer;               // send: the destination; receive: the source
    int local_channel;      // this rank's channel towards peer
    int remote_channel;     // peer's channel towards this rank
    int64_t num_bytes;      // bytes of this tensor
    uint8_t* data;          // send: the tensor; receive: the output; flush: the report's copy
    uint64_t timeout_ns;
    uint32_t* err_host;     // mapped host copy of an error record (may be null)
};

namespace pp {

__device__ __forceinline__ uint32_t* words_of(uint8_t* window, const PpArgs& a) {
    return reinterpret_cast<uint32_t*>(window + a.pp_offset);
}

__device__ __forceinline__ uint8_t* slot_of(uint8_t* window, const PpArgs& a, int channel, uint32_t seq) {
    const int64_t slot = channel * static_cast<int64_t>(a.num_slots) + seq % static_cast<uint32_t>(a.num_slots);
    return window + a.pp_offset + a.ring_offset + slot * a.slot_bytes;
}

__device__ __forceinline__ uint32_t* byte_count_of(uint8_t* window, const PpArgs& a, int channel, uint32_t seq) {
    return reinterpret_cast<uint32_t*>(window + a.pp_offset + a.sizes_offset) +
           channel * a.num_slots + seq % static_cast<uint32_t>(a.num_slots);
}

// By one thread: wait until *word - target >= 0 (wrapping u32); on timeout record it and return false.
__device__ __forceinline__ bool wait_reaches(uint8_t* my_window, const uint32_t* word, uint32_t target,
                                             const PpArgs& a, int rank, int phase) {
    const uint64_t start = global_timer_ns();
    while (static_cast<int32_t>(ld_acquire_sys(word) - target) < 0) {
        if (comm::has_error(my_window)) return false;
        if (global_timer_ns() - start > a.timeout_ns) {
            comm::record_error(my_window, kErrTimeout, rank, a.peer, phase);
            return false;
        }
    }
    return true;
}

// True in every thread of the one block that finishes last; resets the counter for the next kernel.
// The system-scope fence before the count orders this block's writes (to a peer's window too)
// before whatever the last block publishes.
__device__ __forceinline__ bool last_block(uint32_t* done) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        is_last = atomicAdd(done, 1u) == gridDim.x - 1;
        if (is_last) atomicExch(done, 0u);
    }
    __syncthreads();
    return is_last;
}

__device__ __forceinline__ void report_error(uint8_t* my_window, uint32_t* err_host) {
    const volatile uint32_t* record = reinterpret_cast<const volatile uint32_t*>(comm::ctrl_of(my_window) + kCtrlError);
    comm::error_to_host(record, record[0], err_host);
}

}  // namespace pp

__device__ __forceinline__ void pp_send_impl(const comm::LsaTransport& tr, const PpArgs& a) {
    uint8_t* my_window = tr.local();
    uint32_t* my_words = pp::words_of(my_window, a);
    uint8_t* peer_window = comm::peer_bytes(tr, a.peer, 0);
    __shared__ int s_ok;
    __shared__ uint32_t s_seq;
    if (threadIdx.x == 0) {
        const uint32_t seq = ld_volatile(my_words + kPpSent + a.local_channel);
        // slot seq % num_slots is free once the receiver took tensor seq - num_slots
        s_ok = pp::wait_reaches(my_window, my_words + kPpFreed + a.local_channel,
                                seq + 1u - static_cast<uint32_t>(a.num_slots), a, tr.rank, kPhasePpSend);
        s_seq = seq;
    }
    __syncthreads();
    __threadfence();
    const uint32_t seq = s_seq;
    if (s_ok) {
        grid_copy_bytes<kPpCopyUnroll>(pp::slot_of(peer_window, a, a.remote_channel, seq), a.data, a.num_bytes);
        if (blockIdx.x == 0 && threadIdx.x == 0)
            *pp::byte_count_of(peer_window, a, a.remote_channel, seq) = static_cast<uint32_t>(a.num_bytes);
    }
    if (pp::last_block(my_words + kPpDoneSend + a.local_channel) && threadIdx.x == 0) {
        if (!comm::has_error(my_window)) {
            __threadfence_system();  // every block's bytes (counted above) before the publication
            comm::add_release(tr, a.peer, a.pp_offset + 4 * (kPpPublished + a.remote_channel), 1u);
            my_words[kPpSent + a.local_channel] = seq + 1u;
        }
        pp::report_error(my_window, a.err_host);
    }
}

__device__ __forceinline__ void pp_recv_impl(const comm::LsaTransport& tr, const PpArgs& a) {
    uint8_t* my_window = tr.local();
    uint32_t* my_words = pp::words_of(my_window, a);
    __shared__ int s_ok;
    __shared__ uint32_t s_seq;
    if (threadIdx.x == 0) {
        const uint32_t seq = ld_volatile(my_words + kPpConsumed + a.local_channel);
        int ok = pp::wait_reaches(my_window, my_words + kPpPublished + a.local_channel, seq + 1u, a, tr.rank,
                                  kPhasePpRecv);
        if (ok) {
            const uint32_t sent_bytes = ld_acquire_sys(pp::byte_count_of(my_window, a, a.local_channel, seq));
            if (sent_bytes != static_cast<uint32_t>(a.num_bytes)) {
                comm::record_error(my_window, kErrPpByteCount, tr.rank, a.peer, static_cast<int>(sent_bytes));
                ok = 0;
            }
        }
        s_ok = ok;
        s_seq = seq;
    }
    __syncthreads();
    __threadfence();  // the slot's bytes are read after the acquire above
    const uint32_t seq = s_seq;
    if (s_ok) grid_copy_bytes<kPpCopyUnroll>(a.data, pp::slot_of(my_window, a, a.local_channel, seq), a.num_bytes);
    if (pp::last_block(my_words + kPpDoneRecv + a.local_channel) && threadIdx.x == 0) {
        if (!comm::has_error(my_window)) {
            my_words[kPpConsumed + a.local_channel] = seq + 1u;
            __threadfence_system();  // every block's reads of the slot are done before it is handed back
            comm::add_release(tr, a.peer, a.pp_offset + 4 * (kPpFreed + a.remote_channel), 1u);
        }
        pp::report_error(my_window, a.err_host);
    }
}

// pp_set_config's steps, one block each, separated by host barriers:
//   0: write this rank's report (counters when `valid`, else zeros; sizes) into every rank's flush rows
//   1: copy this rank's flush rows ([num_ranks][kPpFlushWords] u32) to a.data, then every rank's
//      window base as this GPU addresses it ([num_ranks] u64: the copy-engine path's addresses)
//   2: zero this rank's counters
__device__ __forceinline__ void pp_flush_impl(const comm::LsaTransport& tr, const PpArgs& a, int step, int valid) {
    uint32_t* my_words = pp::words_of(tr.local(), a);
    if (step == 0) {
        uint32_t report[kPpFlushWords];
        report[0] = valid ? ld_volatile(my_words + kPpSent) : 0u;
        report[1] = valid ? ld_volatile(my_words + kPpSent + 1) : 0u;
        report[2] = valid ? ld_volatile(my_words + kPpConsumed) : 0u;
        report[3] = valid ? ld_volatile(my_words + kPpConsumed + 1) : 0u;
        report[4] = static_cast<uint32_t>(a.slot_bytes >> 5);
        report[5] = static_cast<uint32_t>(a.num_slots);
        for (int p = threadIdx.x; p < tr.num_ranks; p += blockDim.x) {
            uint32_t* row = pp::words_of(comm::peer_bytes(tr, p, 0), a) + kPpFlush + tr.rank * kPpFlushWords;
#pragma unroll
            for (int i = 0; i < kPpFlushWords; ++i) row[i] = report[i];
        }
        __threadfence_system();
    } else if (step == 1) {
        uint32_t* out = reinterpret_cast<uint32_t*>(a.data);
        for (int i = threadIdx.x; i < tr.num_ranks * kPpFlushWords; i += blockDim.x)
            out[i] = ld_volatile(my_words + kPpFlush + i);
        // kPpFlushWords is even: the bases start 8-byte aligned
        uint64_t* window_addresses = reinterpret_cast<uint64_t*>(out + tr.num_ranks * kPpFlushWords);
        for (int p = threadIdx.x; p < tr.num_ranks; p += blockDim.x)
            window_addresses[p] = reinterpret_cast<uint64_t>(comm::peer_bytes(tr, p, 0));
    } else {
        for (int i = threadIdx.x; i < kPpCounterWords; i += blockDim.x) my_words[i] = 0u;
        __threadfence_system();
    }
}

}  // namespace deep_ep
