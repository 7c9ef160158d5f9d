// The scale-out transport over GIN (GPU-initiated networking): one-sided puts from this rank's window
// to a peer's window, carried by a NIC, on `num_contexts` independent contexts (DeepEP's num_qps of
// num_allocated_qps; one queue per peer each). Two implementations, same member functions:
//   NcclGinTransport      NCCL's device API (`ncclGin`, NCCL >= 2.28.7) on one team of the communicator;
//   EmulatedGinTransport  ranks emulated on one GPU: per-(context, peer) queues in device memory that
//                         a "NIC" (`emulated_gin_nic`, warps of the same launch) drains with seeded delay
//                         and reordering, so that code correct on a real NIC is the only code that passes.
// Contract (every member function is called by one thread, NCCL's thread coop):
//   - put reads the source when the NIC executes it, not when issued: overwrite a source only after
//     flush(context) or its counter says the NIC consumed it;
//   - puts land in no order, and a put's words in no order (aligned 4-byte words land whole);
//   - a strong signal becomes visible after its put and every earlier put of the same (context, peer);
//     a weak one covers its own put only; nothing orders puts of different contexts;
//   - flush is local: sources may be reused, remote data need not have landed;
//   - signals and counters belong to a context; a put to this rank itself is asynchronous too;
//   - a full queue makes the issuer wait;
//   - waits give up after a timeout and record (kErrTimeout, rank, peer, phase) in this rank's window,
//     as the NVLink transport's waits do (comm/window.cuh).
#pragma once

#include "window.cuh"

#if EP_TRANSPORT_NCCL
#include <nccl.h>
#include <nccl_device.h>
#endif

// NCCL's device API has GIN from 2.28.7 (nccl_device/gin.h); explicit strong / weak actions were
// checked in the 2.30.7 headers (earlier releases' signal actions are strong).
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 22807
#define EP_GIN_NCCL 1
#if NCCL_VERSION_CODE >= 23007
#define EP_GIN_NCCL_WEAK_ACTIONS 1
#endif
#endif

namespace deep_ep::comm {

// The GIN's error records name kPhaseGinPut (a put that waited too long for room in a full queue
// or broke the emulation's limits: kErrCapacity), kPhaseGinFlush (a flush that waited too long for
// the NIC) and kPhaseGinNic (common/abi.cuh): the emulated NIC gave up, its rank's user blocks
// neither put nor ended for kGinNicIdleTimeouts GPU timeouts (`EmulatedGinArgs::issue_timeout_ns`);
// recorded in the issuing rank's window, the queue's destination as the peer.
// deep_ep/comm/gin.py mirrors the count.
constexpr int kGinNicIdleTimeouts = 4;

// A signal added to a peer's context when a put lands (signal < 0: none).
struct GinSignal {
    int signal = -1;
    uint64_t value = 0;
    bool weak = false;
};

// NCCL's rolling comparison: ``least`` <= ``value`` modulo 2^64, as long as they are within 2^63.
__device__ __forceinline__ bool gin_reached(uint64_t value, uint64_t least) {
    return static_cast<int64_t>(value - least) >= 0;
}

// CUDA's 64-bit atomics take unsigned long long, which uint64_t need not be.
__device__ __forceinline__ unsigned long long* as_ull(uint64_t* p) { return reinterpret_cast<unsigned long long*>(p); }

#if EP_GIN_NCCL
// Peers are ranks of the communicator (the world team), as the scale-out transports number them;
// each operation converts its peer to an index of `team` (World for direct mode, Rail for hybrid,
// whose peers are always rail peers). Errors name world ranks.
struct NcclGinTransport {
    const ncclDevComm* comm;
    ncclWindow_t window;  // the buffer's symmetric window: sources and destinations are offsets in it
    ncclTeam team;        // the team the puts go through (World for direct mode, Rail for hybrid)
    int num_contexts;     // contexts used (num_qps), at most the device communicator's

    // No emulated NIC counts a kernel's blocks: the scale-out transports zero their own block count.
    static constexpr bool kNicCountsBlocks = false;

    __device__ __forceinline__ int rank() const { return comm->rank; }
    __device__ __forceinline__ int num_ranks() const { return comm->nRanks; }
    __device__ __forceinline__ uint8_t* local() const { return static_cast<uint8_t*>(ncclGetLocalPointer(window, 0)); }
    // Contexts are independent queues: spreading channels over them spreads the NIC's work.
    __device__ __forceinline__ int context_of(int channel) const { return channel % num_contexts; }
    // `peer` (a world rank) as an index of `team`.
    __device__ __forceinline__ int team_peer(int peer) const {
        return ncclTeamRankToTeam(team, ncclTeamWorld(*comm), peer);
    }

    __device__ __forceinline__ void put(int context, int world_peer, int64_t dst_offset, int64_t src_offset,
                                        uint64_t bytes, GinSignal signal = {}, int counter = -1) const {
        ncclGin gin(*comm, context);
        const int peer = team_peer(world_peer);
        const size_t dst = dst_offset, src = src_offset;
        if (signal.signal < 0) {
            if (counter < 0) gin.put(team, peer, window, dst, window, src, bytes);
            else gin.put(team, peer, window, dst, window, src, bytes, ncclGin_None{}, counter_action(counter));
        } else if (signal.weak) {
            if (counter < 0) gin.put(team, peer, window, dst, window, src, bytes, weak_add(signal));
            else gin.put(team, peer, window, dst, window, src, bytes, weak_add(signal), counter_action(counter));
        } else {
            if (counter < 0) gin.put(team, peer, window, dst, window, src, bytes, strong_add(signal));
            else gin.put(team, peer, window, dst, window, src, bytes, strong_add(signal), counter_action(counter));
        }
    }
    // A signal alone: strong, so it tells the peer that every earlier put of this context has landed.
    __device__ __forceinline__ void signal(int context, int world_peer, int signal_id, uint64_t value) const {
        ncclGin gin(*comm, context);
        gin.signal(team, team_peer(world_peer), strong_add(GinSignal{signal_id, value, false}));
    }
    __device__ __forceinline__ void flush(int context) const {
        ncclGin gin(*comm, context);
        gin.flush(ncclCoopThread{});
    }
    __device__ __forceinline__ uint64_t read_signal(int context, int signal_id) const {
        ncclGin gin(*comm, context);
        return gin.readSignal(static_cast<ncclGinSignal_t>(signal_id));
    }
    __device__ __forceinline__ uint64_t read_counter(int context, int counter) const {
        ncclGin gin(*comm, context);
        return gin.readCounter(static_cast<ncclGinCounter_t>(counter));
    }
    __device__ __forceinline__ void reset_signal(int context, int signal_id) const {
        ncclGin gin(*comm, context);
        gin.resetSignal(static_cast<ncclGinSignal_t>(signal_id));
    }
    __device__ __forceinline__ void reset_counter(int context, int counter) const {
        ncclGin gin(*comm, context);
        gin.resetCounter(static_cast<ncclGinCounter_t>(counter));
    }

    // Polls rather than ncclGin::waitSignal: the releases checked have no timeout on it.
    __device__ __forceinline__ bool wait_signal(int context, int signal_id, uint64_t least, int peer, int phase,
                                                uint64_t timeout_ns) const {
        ncclGin gin(*comm, context);
        const uint64_t start = global_timer_ns();
        while (!gin_reached(gin.readSignal(static_cast<ncclGinSignal_t>(signal_id)), least)) {
            if (global_timer_ns() - start > timeout_ns) {
                record_error(local(), kErrTimeout, rank(), peer, phase);
                return false;
            }
            if (has_error(local())) return false;
        }
        return true;
    }
    __device__ __forceinline__ bool wait_counter(int context, int counter, uint64_t least, int phase,
                                                 uint64_t timeout_ns) const {
        ncclGin gin(*comm, context);
        const uint64_t start = global_timer_ns();
        while (!gin_reached(gin.readCounter(static_cast<ncclGinCounter_t>(counter)), least)) {
            if (global_timer_ns() - start > timeout_ns) {
                record_error(local(), kErrTimeout, rank(), rank(), phase);
                return false;
            }
        }
        return true;
    }

  private:
#if EP_GIN_NCCL_WEAK_ACTIONS
    using StrongAdd = ncclGin_StrongSignalAdd;
    using WeakAdd = ncclGin_WeakSignalAdd;
    using CounterInc = ncclGin_WeakCounterInc;
#else
    // Before explicit actions every signal is strong, which also satisfies a weak request.
    using StrongAdd = ncclGin_SignalAdd;
    using WeakAdd = ncclGin_SignalAdd;
    using CounterInc = ncclGin_CounterInc;
#endif
    static __device__ __forceinline__ StrongAdd strong_add(GinSignal s) {
        return {static_cast<ncclGinSignal_t>(s.signal), s.value};
    }
    static __device__ __forceinline__ WeakAdd weak_add(GinSignal s) {
        return {static_cast<ncclGinSignal_t>(s.signal), s.value};
    }
    static __device__ __forceinline__ CounterInc counter_action(int counter) {
        return {static_cast<ncclGinCounter_t>(counter)};
    }
};
#endif  // EP_GIN_NCCL

// ---------------------------------------------------------------------------------------------
// Emulated GIN. State (zeroed before the launch, laid out by deep_ep/comm/gin.py): for each queue
// (source rank, context, destination rank) a `GinQueue`, `queue_depth` entries and as many staging
// slots of `stage_bytes`; per (rank, context) `num_signals` signals and `num_counters` counters.

struct GinQueue {
    uint64_t issued;      // entries reserved by issuers (never more than freed + depth)
    uint64_t consumed;    // entries whose source the NIC has read (in order, as a QP reads its work)
    uint64_t freed;       // entries landed in order: their slots are free again
    uint64_t full_waits;  // puts that found the queue full and waited
};
static_assert(sizeof(GinQueue) == 32, "mirrored by deep_ep/comm/gin.py");

struct GinEntry {
    uint64_t seq;       // index + 1 once the entry is published
    uint64_t issue_ns;  // when it was published: the NIC's delays count from here
    const uint8_t* src;
    uint8_t* dst;
    uint64_t signal_value;
    uint32_t bytes;
    int32_t signal;     // < 0: none
    int32_t counter;    // < 0: none
    uint32_t weak;
    uint64_t pad;
};
static_assert(sizeof(GinEntry) == 64, "mirrored by deep_ep/comm/gin.py");

struct EmulatedGinArgs {
    uint8_t* const* windows;  // [num_ranks] the emulated ranks' windows
    GinQueue* queues;         // [num_ranks * num_contexts * num_ranks]
    GinEntry* entries;        // [queues][queue_depth]
    uint8_t* staging;         // [queues][queue_depth][stage_bytes]
    uint64_t* signals;        // [num_ranks][num_contexts][num_signals]
    uint64_t* counters;       // [num_ranks][num_contexts][num_counters]
    uint32_t* done;           // user blocks that finished: the NIC stops once all have and it is idle
    uint64_t seed;
    uint64_t issue_timeout_ns;
    uint32_t min_delay_ns, max_delay_ns;  // each NIC step (reading a source, landing a put) waits this long
    uint32_t linger_ns;                   // how long the NIC waits to gather `batch` entries of a queue
    int num_ranks, num_contexts, num_signals, num_counters, queue_depth, stage_bytes, batch;
};
// NVRTC has no offsetof: the size pins the layout, and tests/test_gin_compile.py checks the offsets on the host.
static_assert(sizeof(EmulatedGinArgs) == 112, "mirrored by deep_ep/comm/gin.py");

__device__ __forceinline__ int gin_queue_index(const EmulatedGinArgs& a, int src, int context, int dst) {
    return (src * a.num_contexts + context) * a.num_ranks + dst;
}

struct EmulatedGinTransport {
    const EmulatedGinArgs* args;
    int rank;
    int num_contexts;  // contexts used (num_qps), at most args->num_contexts (allocated)

    // The emulated NIC reads the count of a kernel's ended blocks to stop, and zeroes it.
    static constexpr bool kNicCountsBlocks = true;

    __device__ __forceinline__ int num_ranks() const { return args->num_ranks; }
    __device__ __forceinline__ uint8_t* local() const { return args->windows[rank]; }
    __device__ __forceinline__ int context_of(int channel) const { return channel % num_contexts; }

    __device__ __forceinline__ void put(int context, int peer, int64_t dst_offset, int64_t src_offset, uint64_t bytes,
                                        GinSignal signal = {}, int counter = -1) const {
        if (bytes > static_cast<uint64_t>(args->stage_bytes) || (bytes | dst_offset | src_offset) % 4 != 0) {
            record_error(local(), kErrCapacity, rank, peer, kPhaseGinPut);  // the emulation's limits
            return;
        }
        const int q = gin_queue_index(*args, rank, context, peer);
        GinQueue* queue = args->queues + q;
        // Reserve only with room, so a timed-out issuer leaves no hole the NIC would wait on.
        uint64_t index = ld_acquire_gpu_u64(&queue->issued);
        bool counted = false;
        const uint64_t start = global_timer_ns();
        while (true) {
            if (index - ld_acquire_gpu_u64(&queue->freed) < static_cast<uint64_t>(args->queue_depth)) {
                const uint64_t seen = atomicCAS(as_ull(&queue->issued), index, index + 1);
                if (seen == index) break;
                index = seen;
                continue;
            }
            if (!counted) {
                atomicAdd(as_ull(&queue->full_waits), 1ull);
                counted = true;
            }
            if (global_timer_ns() - start > args->issue_timeout_ns) {
                record_error(local(), kErrTimeout, rank, peer, kPhaseGinPut);
                return;
            }
            index = ld_acquire_gpu_u64(&queue->issued);
        }
        GinEntry* entry = args->entries + static_cast<int64_t>(q) * args->queue_depth + index % args->queue_depth;
        entry->src = local() + src_offset;
        entry->dst = args->windows[peer] + dst_offset;
        entry->bytes = static_cast<uint32_t>(bytes);
        entry->signal = signal.signal;
        entry->signal_value = signal.value;
        entry->weak = signal.weak ? 1u : 0u;
        entry->counter = counter;
        entry->issue_ns = global_timer_ns();
        __threadfence();  // the source and the entry before the sequence number the NIC polls
        st_release_gpu_u64(&entry->seq, index + 1);
    }
    __device__ __forceinline__ void signal(int context, int peer, int signal_id, uint64_t value) const {
        put(context, peer, 0, 0, 0, GinSignal{signal_id, value, false});
    }
    __device__ __forceinline__ void flush(int context) const {
        for (int peer = 0; peer < args->num_ranks; ++peer) {
            GinQueue* queue = args->queues + gin_queue_index(*args, rank, context, peer);
            const uint64_t target = ld_acquire_gpu_u64(&queue->issued);
            const uint64_t start = global_timer_ns();
            while (!gin_reached(ld_acquire_gpu_u64(&queue->consumed), target)) {
                if (global_timer_ns() - start > args->issue_timeout_ns) {
                    record_error(local(), kErrTimeout, rank, peer, kPhaseGinFlush);
                    return;
                }
            }
        }
    }
    __device__ __forceinline__ uint64_t* signal_word(int context, int signal_id) const {
        const int64_t row = static_cast<int64_t>(rank) * args->num_contexts + context;
        return args->signals + row * args->num_signals + signal_id;
    }
    __device__ __forceinline__ uint64_t* counter_word(int context, int counter) const {
        const int64_t row = static_cast<int64_t>(rank) * args->num_contexts + context;
        return args->counters + row * args->num_counters + counter;
    }
    __device__ __forceinline__ uint64_t read_signal(int context, int signal_id) const {
        return ld_acquire_gpu_u64(signal_word(context, signal_id));
    }
    __device__ __forceinline__ uint64_t read_counter(int context, int counter) const {
        return ld_acquire_gpu_u64(counter_word(context, counter)) & ((1ull << 56) - 1);
    }
    __device__ __forceinline__ void reset_signal(int context, int signal_id) const {
        st_release_gpu_u64(signal_word(context, signal_id), 0);
    }
    __device__ __forceinline__ void reset_counter(int context, int counter) const {
        st_release_gpu_u64(counter_word(context, counter), 0);
    }

    __device__ __forceinline__ bool wait_signal(int context, int signal_id, uint64_t least, int peer, int phase,
                                                uint64_t timeout_ns) const {
        const uint64_t start = global_timer_ns();
        while (!gin_reached(read_signal(context, signal_id), least)) {
            if (global_timer_ns() - start > timeout_ns) {
                record_error(local(), kErrTimeout, rank, peer, phase);
                return false;
            }
            if (has_error(local())) return false;
        }
        return true;
    }
    __device__ __forceinline__ bool wait_counter(int context, int counter, uint64_t least, int phase,
                                                 uint64_t timeout_ns) const {
        const uint64_t start = global_timer_ns();
        while (!gin_reached(read_counter(context, counter), least)) {
            if (global_timer_ns() - start > timeout_ns) {
                record_error(local(), kErrTimeout, rank, rank, phase);
                return false;
            }
        }
        return true;
    }
};

// ---------------------------------------------------------------------------------------------
// What every GIN transport's signalling phase does (comm/gin_direct.cuh, gin_hybrid.cuh,
// gin_control.cuh), by every thread of the one block that ends the phase: gin_publish_tag, then per
// peer a node peer's store_tag or a GIN peer's gin_put_signal, then gin_flush_contexts.

// One thread: `tag` into the tag words `rank` writes into `window` (of this rank or of a peer of its
// node) at epoch parity `slot`; with `arrive`, then `rank`'s arrival there, a system-scope release
// after the tag.
__device__ __forceinline__ void store_tag(uint8_t* window, int slot, int rank, CallTag tag, bool arrive) {
    uint32_t* words = tag_words(window, slot, rank);
    words[0] = tag.seq;
    words[1] = tag.fingerprint;
    if (arrive) red_release_sys_add(ctrl_of(window) + kCtrlArrive + rank, 1u);
}

// Every thread of the block: a system fence (this GPU's earlier writes before any put or store that
// signals them), then thread 0 stores `tag` as this rank's own (`arrive`: with its own arrival) in
// `window` at the epoch's parity (returned in `slot`); the block meets. Returns the byte offset of
// those tag words: a tag put's source and destination, as a peer keeps this rank's tag at the same
// words. They are rewritten two phases later, after gin_flush_contexts has released them.
__device__ __forceinline__ int64_t gin_publish_tag(uint8_t* window, int rank, CallTag tag, bool arrive, int& slot) {
    __threadfence_system();
    slot = static_cast<int>(ld_volatile(ctrl_of(window) + kCtrlEpoch) & 1u);
    const int64_t offset = reinterpret_cast<uint8_t*>(tag_words(window, slot, rank)) - window;
    if (threadIdx.x == 0) store_tag(window, slot, rank, tag, arrive);
    __syncthreads();
    return offset;
}

// One thread: `bytes` at `offset` of this rank's window to the same offset of `peer`'s on context 0,
// then a strong signal `signal_id` (+1) on each of contexts [0, num_contexts): the one of context 0
// lands after the put, each other after its context's earlier puts.
template <typename Gin>
__device__ __forceinline__ void gin_put_signal(const Gin& gin, int peer, int64_t offset, uint64_t bytes, int signal_id,
                                               int num_contexts) {
    gin.put(0, peer, offset, offset, bytes);
    for (int c = 0; c < num_contexts; ++c) gin.signal(c, peer, signal_id, 1);
}

// Every thread of the block, after its puts: the block meets, contexts [0, num_contexts) are flushed
// (a thread each), the block meets; every source put may be rewritten after.
template <typename Gin>
__device__ __forceinline__ void gin_flush_contexts(const Gin& gin, int num_contexts) {
    __syncthreads();
    for (int c = threadIdx.x; c < num_contexts; c += blockDim.x) gin.flush(c);
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// The emulated NIC: one warp per queue. Each round it gathers up to `batch` published entries (or
// what came within `linger_ns`), reads their sources in order into staging after a random delay
// (counters count here, flush waits for it), then lands them in a seeded random order, weak-signalled
// entries first: the legal order most hostile to code that treats a weak signal as covering other
// puts. A strong signal is added once every earlier entry of the queue has landed.

// An entry as the NIC reads it: past L1, which may hold the slot's previous use.
__device__ __forceinline__ GinEntry gin_load_entry(const GinEntry* p) {
    GinEntry e;
    e.seq = __ldcg(reinterpret_cast<const unsigned long long*>(&p->seq));
    e.issue_ns = __ldcg(reinterpret_cast<const unsigned long long*>(&p->issue_ns));
    e.src = reinterpret_cast<const uint8_t*>(__ldcg(reinterpret_cast<const unsigned long long*>(&p->src)));
    e.dst = reinterpret_cast<uint8_t*>(__ldcg(reinterpret_cast<const unsigned long long*>(&p->dst)));
    e.signal_value = __ldcg(reinterpret_cast<const unsigned long long*>(&p->signal_value));
    e.bytes = __ldcg(&p->bytes);
    e.signal = __ldcg(&p->signal);
    e.counter = __ldcg(&p->counter);
    e.weak = __ldcg(&p->weak);
    e.pad = 0;
    return e;
}

__device__ __forceinline__ bool gin_weak_signal(const GinEntry* p) {
    return __ldcg(&p->weak) != 0u && __ldcg(&p->signal) >= 0;
}

__device__ __forceinline__ uint64_t gin_random(uint64_t& state) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

__device__ __forceinline__ void gin_delay(const EmulatedGinArgs& a, uint64_t& rng, uint64_t since_ns) {
    const uint32_t span = a.max_delay_ns > a.min_delay_ns ? a.max_delay_ns - a.min_delay_ns : 0u;
    const uint64_t wait = a.min_delay_ns + (span ? gin_random(rng) % span : 0u);
    while (global_timer_ns() - since_ns < wait) {}
}

// Word copy by one warp, last words first, or first words first with `forward`: a reader racing the
// landing sees a mix of old and new, and no word of a put (its first or its last) is safe to poll as
// a sign that the others landed.
__device__ __forceinline__ void gin_copy_words(uint32_t* dst, const uint32_t* src, uint32_t num_words, int lane,
                                               bool forward = false) {
    if (forward) {
        for (int64_t w = lane; w < static_cast<int64_t>(num_words); w += 32) __stcg(dst + w, __ldcg(src + w));
        return;
    }
    for (int64_t w = static_cast<int64_t>(num_words) - 1 - lane; w >= 0; w -= 32) __stcg(dst + w, __ldcg(src + w));
}

__device__ __forceinline__ void gin_add_signal(const EmulatedGinArgs& a, const GinEntry& e, int dst, int context) {
    uint64_t* word = a.signals + (static_cast<int64_t>(dst) * a.num_contexts + context) * a.num_signals + e.signal;
    __threadfence();  // the landed words before the signal
    atomicAdd(as_ull(word), static_cast<unsigned long long>(e.signal_value));
}

// Every thread of the NIC's blocks; `nic_warp` counts this warp among all NIC warps of the launch and
// `num_user_blocks` is how many blocks report to `done` when they have issued their last put.
// `carried_bytes` (null: none) is [num_ranks][num_ranks]: each put's bytes are added to its (source,
// destination) word as the NIC reads its source (deep_ep/comm/gin.py, `byte_counters`).
__device__ __forceinline__ void emulated_gin_nic(const EmulatedGinArgs& a, int nic_warp, int num_user_blocks,
                                                 unsigned long long* carried_bytes = nullptr) {
    const int lane = threadIdx.x % 32;
    const int num_queues = a.num_ranks * a.num_contexts * a.num_ranks;
    if (nic_warp >= num_queues) return;
    const int q = nic_warp;
    const int src_rank = q / (a.num_contexts * a.num_ranks);
    const int context = q / a.num_ranks % a.num_contexts;
    const int dst_rank = q % a.num_ranks;
    GinQueue* queue = a.queues + q;
    GinEntry* entries = a.entries + static_cast<int64_t>(q) * a.queue_depth;
    uint8_t* staging = a.staging + static_cast<int64_t>(q) * a.queue_depth * a.stage_bytes;
    uint64_t rng = (a.seed + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(q) + 1) * 0xD1B54A32D192ED03ull;
    rng |= 1;
    // A queue outlives a launch (the library's NIC kernel runs once per data kernel): resume where the
    // previous NIC left it, everything it read landed.
    uint64_t consumed = ld_acquire_gpu_u64(&queue->consumed), landed_prefix = ld_acquire_gpu_u64(&queue->freed);
    uint64_t landed_mask = 0;  // bit i: entry landed_prefix + i has landed
    const int depth = a.queue_depth;
    const int batch = a.batch < 1 ? 1 : (a.batch > depth ? depth : a.batch);
    // The issuers (the user blocks) may go quiet for as long as their own waits last, each bounded by
    // the GPU timeout, a few in a row; past kGinNicIdleTimeouts of them the NIC gives up.
    const uint64_t idle_limit_ns = kGinNicIdleTimeouts * a.issue_timeout_ns;
    uint64_t idle_since = global_timer_ns();  // when this queue last had an entry to gather
    while (true) {
        // Gather: published entries from `consumed` on, waiting up to linger_ns for a full batch. The
        // warp acts as one: the entries every lane has seen published, and lane 0's decision.
        int ready = 0;
        uint64_t first_seen = 0;
        while (true) {
            while (ready < batch) {
                const uint64_t index = consumed + ready;
                if (ld_acquire_gpu_u64(&entries[index % depth].seq) != index + 1) break;
                ++ready;
            }
            for (int offset = 16; offset > 0; offset >>= 1) ready = min(ready, __shfl_xor_sync(0xffffffffu, ready, offset));
            int action = 0;  // 0: gather on, 1: land what is ready, 2: every issuer is done and nothing is left,
                             // 3: no entry and no end for idle_limit_ns
            if (lane == 0) {
                const uint64_t now = global_timer_ns();
                if (ready == batch) {
                    action = 1;
                } else if (ready > 0) {
                    if (first_seen == 0) first_seen = now;
                    else if (now - first_seen > a.linger_ns) action = 1;
                } else if (ld_volatile(a.done) >= static_cast<uint32_t>(num_user_blocks)
                           && ld_acquire_gpu_u64(&queue->issued) == consumed) {
                    action = 2;
                } else if (idle_limit_ns != 0 && now - idle_since > idle_limit_ns) {
                    action = 3;
                }
            }
            action = __shfl_sync(0xffffffffu, action, 0);
            if (action == 1) break;
            if (action == 3 && lane == 0) {
                // recorded in the issuing rank's window: its next call raises it (kErrTimeout, this
                // rank, the queue's destination, kPhaseGinNic)
                record_error(a.windows[src_rank], kErrTimeout, src_rank, dst_rank, kPhaseGinNic);
            }
            if (action >= 2) return;
        }
        idle_since = global_timer_ns();
        // Read the sources in order, each after a random delay: a source overwritten before flush is
        // read as overwritten.
        for (int i = 0; i < ready; ++i) {
            const GinEntry e = gin_load_entry(&entries[(consumed + i) % depth]);
            gin_delay(a, rng, e.issue_ns);
            uint8_t* slot = staging + ((consumed + i) % depth) * static_cast<int64_t>(a.stage_bytes);
            gin_copy_words(reinterpret_cast<uint32_t*>(slot), reinterpret_cast<const uint32_t*>(e.src), e.bytes / 4,
                           lane);
            __threadfence();
            __syncwarp();
            if (lane == 0) {
                if (e.counter >= 0) {
                    const int64_t row = static_cast<int64_t>(src_rank) * a.num_contexts + context;
                    atomicAdd(as_ull(a.counters + row * a.num_counters + e.counter), 1ull);
                }
                if (carried_bytes != nullptr && e.bytes != 0u)
                    atomicAdd(carried_bytes + static_cast<int64_t>(src_rank) * a.num_ranks + dst_rank,
                              static_cast<unsigned long long>(e.bytes));
                st_release_gpu_u64(&queue->consumed, consumed + i + 1);
            }
        }
        consumed += ready;
        // Land everything read, weak-signalled entries first, each group in a random order.
        for (int pass = 0; pass < 2; ++pass) {
            while (true) {
                int candidates = 0;
                for (uint64_t j = landed_prefix; j < consumed; ++j) {
                    const bool weak = gin_weak_signal(&entries[j % depth]);
                    if (!(landed_mask >> (j - landed_prefix) & 1ull) && (pass == 1 || weak)) ++candidates;
                }
                if (candidates == 0) break;
                int pick = static_cast<int>(gin_random(rng) % candidates);
                uint64_t chosen = landed_prefix;
                for (uint64_t j = landed_prefix; j < consumed; ++j) {
                    const bool weak = gin_weak_signal(&entries[j % depth]);
                    if (!(landed_mask >> (j - landed_prefix) & 1ull) && (pass == 1 || weak) && pick-- == 0) {
                        chosen = j;
                        break;
                    }
                }
                const GinEntry e = gin_load_entry(&entries[chosen % depth]);
                gin_delay(a, rng, global_timer_ns());
                const uint8_t* slot = staging + (chosen % depth) * static_cast<int64_t>(a.stage_bytes);
                const bool forward = (gin_random(rng) & 1u) != 0u;   // the same on every lane
                gin_copy_words(reinterpret_cast<uint32_t*>(e.dst), reinterpret_cast<const uint32_t*>(slot), e.bytes / 4,
                               lane, forward);
                __threadfence();
                __syncwarp();
                if (lane == 0 && e.signal >= 0 && e.weak) gin_add_signal(a, e, dst_rank, context);
                landed_mask |= 1ull << (chosen - landed_prefix);
                // Strong signals of the landed prefix, then free its slots.
                while (landed_mask & 1ull) {
                    const GinEntry head = gin_load_entry(&entries[landed_prefix % depth]);
                    if (lane == 0 && head.signal >= 0 && !head.weak) gin_add_signal(a, head, dst_rank, context);
                    landed_mask >>= 1;
                    ++landed_prefix;
                }
                __syncwarp();
                if (lane == 0) st_release_gpu_u64(&queue->freed, landed_prefix);
            }
        }
    }
}

}  // namespace deep_ep::comm
