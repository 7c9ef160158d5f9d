// Engram remote-memory fetch (ElasticBuffer.engram_write / engram_fetch). Every rank holds its shard
// of the table, `num_entries` rows of `row_bytes` bytes, either in its window at
// `EngramArgs::storage_offset` or, when `EngramArgs::shards` is set, in pinned host memory at
// `shards[rank]` (a device-accessible address: the same loads then cross PCIe or C2C instead of
// NVLink). A gather reads entry `indices[i]` (owner `index / num_entries`, row `index % num_entries`)
// from the owner's shard into row `i` of `out`, one warp per row, and for an FP8 table copies the entry's
// `num_sf_packs` scale-factor words from this rank's replicated copy `sf` into `out_sf` at
// `token * sf_token_stride + column * sf_column_stride` (token `i / num_per_token`, column
// `(i % num_per_token) * num_sf_packs + pack`). An index outside [0, num_ranks * num_entries) is
// never read: its row and factors are zeroed and one such (position, index) pair is written to the
// mapped host word `bad_index_host` (low half: position + 1, high half: the index), which the host
// reports at its next fetch. A store copies bytes into this rank's own window (engram_write).
// The host reads these constants (deep_ep/backends/gpu/engram.py): one `constexpr int` per line.
#pragma once

#include "../comm/lsa.cuh"
#include "../comm/pp.cuh"   // peer_bytes: a peer's window bytes at an offset

namespace deep_ep {

constexpr int kEngramThreads = 256;      // threads per block of both Engram kernels
constexpr int kEngramWarps = 8;          // warps per block (one fetched row per warp at a time)
constexpr int kEngramUnroll = 4;         // 16-byte loads in flight per lane of a row copy
constexpr int kEngramHeaderBytes = 64;   // engram_write's per-rank header, just below the storage

static_assert(kEngramThreads == 32 * kEngramWarps, "one warp per fetched row");

// The arguments of the gather kernel (host mirror: deep_ep/backends/gpu/engram.py).
struct EngramArgs {
    int64_t storage_offset;      // byte offset of the shard in every window
    int64_t row_bytes;           // bytes of one entry
    int64_t sf_token_stride;     // out_sf: words between consecutive tokens
    int64_t sf_column_stride;    // out_sf: words between consecutive columns
    const int32_t* indices;      // [num_fetched] global entries
    uint8_t* out;                // [num_fetched][row_bytes]
    const uint32_t* sf;          // [num_ranks * num_entries][num_sf_packs], or null (bf16)
    uint32_t* out_sf;            // see above, or null
    uint64_t* bad_index_host;    // mapped host word (may be null)
    const uint64_t* shards;      // [num_ranks] shard addresses in host memory, or null (in the windows)
    int num_entries;             // rows of every rank's shard
    int num_fetched;             // T * E
    int num_per_token;           // E
    int num_sf_packs;            // 0 for bf16
};

namespace engram {

// One warp: copy a row in 16-byte vectors where both ends and the size are 16-byte aligned, else in
// 4-byte words or bytes.
__device__ __forceinline__ void copy_row(uint8_t* dst, const uint8_t* src, int64_t num_bytes, int lane) {
    const uint64_t alignment = reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src) |
                               static_cast<uint64_t>(num_bytes);
    if ((alignment & 15u) == 0) {
        const int4* src_vecs = reinterpret_cast<const int4*>(src);
        int4* dst_vecs = reinterpret_cast<int4*>(dst);
        const int64_t num_vecs = num_bytes >> 4;
        for (int64_t base = lane; base < num_vecs; base += 32 * kEngramUnroll) {
            int4 values[kEngramUnroll];
#pragma unroll
            for (int k = 0; k < kEngramUnroll; ++k) {
                const int64_t index = base + 32 * k;
                if (index < num_vecs) values[k] = ld_cg(src_vecs + index);
            }
#pragma unroll
            for (int k = 0; k < kEngramUnroll; ++k) {
                const int64_t index = base + 32 * k;
                if (index < num_vecs) dst_vecs[index] = values[k];
            }
        }
    } else if ((alignment & 3u) == 0) {
        const uint32_t* src_words = reinterpret_cast<const uint32_t*>(src);
        uint32_t* dst_words = reinterpret_cast<uint32_t*>(dst);
        for (int64_t index = lane; index < (num_bytes >> 2); index += 32) dst_words[index] = __ldcg(src_words + index);
    } else {
        for (int64_t index = lane; index < num_bytes; index += 32) dst[index] = __ldcg(src + index);
    }
}

__device__ __forceinline__ void zero_row(uint8_t* dst, int64_t num_bytes, int lane) {
    for (int64_t index = lane; index < num_bytes; index += 32) dst[index] = 0;
}

}  // namespace engram

__device__ __forceinline__ void engram_gather_impl(const comm::LsaTransport& tr, const EngramArgs& args) {
    const int lane = threadIdx.x % 32;
    const int num_warps = gridDim.x * kEngramWarps;
    const int64_t num_total = static_cast<int64_t>(tr.num_ranks) * args.num_entries;
    for (int row = blockIdx.x * kEngramWarps + threadIdx.x / 32; row < args.num_fetched; row += num_warps) {
        const int index = __ldg(args.indices + row);
        const bool valid = index >= 0 && index < num_total;
        uint8_t* dst = args.out + static_cast<int64_t>(row) * args.row_bytes;
        if (valid) {
            const int owner = index / args.num_entries;
            const int64_t local = index - owner * args.num_entries;
            const uint8_t* src = args.shards != nullptr
                ? reinterpret_cast<const uint8_t*>(args.shards[owner]) + local * args.row_bytes
                : comm::peer_bytes(tr, owner, args.storage_offset + local * args.row_bytes);
            engram::copy_row(dst, src, args.row_bytes, lane);
        } else {
            engram::zero_row(dst, args.row_bytes, lane);
            if (lane == 0 && args.bad_index_host != nullptr) {
                // one 8-byte store: the host never sees half of one record and half of another
                const uint64_t record = (static_cast<uint64_t>(static_cast<uint32_t>(index)) << 32) |
                                        static_cast<uint32_t>(row + 1);
                *reinterpret_cast<volatile uint64_t*>(args.bad_index_host) = record;
                __threadfence_system();
            }
        }
        if (args.num_sf_packs > 0) {
            const int token = row / args.num_per_token;
            const int64_t first_column = static_cast<int64_t>(row - token * args.num_per_token) * args.num_sf_packs;
            for (int pack = lane; pack < args.num_sf_packs; pack += 32) {
                const uint32_t value = valid ? __ldg(args.sf + static_cast<int64_t>(index) * args.num_sf_packs + pack) : 0u;
                args.out_sf[token * args.sf_token_stride + (first_column + pack) * args.sf_column_stride] = value;
            }
        }
    }
}

// Every thread of the grid: copy num_bytes from src into this rank's window at offset.
__device__ __forceinline__ void engram_store_impl(const comm::LsaTransport& tr, int64_t offset, const uint8_t* src,
                                                  int64_t num_bytes) {
    uint8_t* dst = tr.local() + offset;
    const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t num_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    int64_t done = 0;
    if (((reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src)) & 15u) == 0) {
        const int64_t num_vecs = num_bytes >> 4;
        for (int64_t index = thread; index < num_vecs; index += num_threads)
            st_cg(reinterpret_cast<int4*>(dst) + index, ld_cg(reinterpret_cast<const int4*>(src) + index));
        done = num_vecs << 4;
    }
    for (int64_t index = done + thread; index < num_bytes; index += num_threads) dst[index] = src[index];
}

}  // namespace deep_ep
