"""What the expanded dispatch's row fan-out costs on this GPU without the library around it.

The expanded dispatch of a rank alone reads each token row once and writes it to one output row per
selected expert (rows grouped by expert). Its data kernel takes about 148 us at DeepSeek-V3 shapes
(4096 tokens x 14,336 B, top-8: 470 MB written), while a plain fill of 470 MB takes about 103 us.
This tool times minimal fan-out kernels with the same pattern, to find what a kernel of this shape
can reach and which way of organising the work gets there:

* ``token``: one warp per token, as the library's send phase: each chunk of U 16-byte vectors per
  lane is loaded, then stored to the token's K rows;
* ``chunk``: one warp per (token, chunk): the same stores, four times as many independent warps'
  worth of work items (each loads one chunk);
* ``half``: one warp per (token, half of its K rows): reads twice (the second mostly from L2);
* ``prefetch``: ``token`` with the next chunk's loads issued before the current chunk's stores;
* ``noload``: ``token`` storing a constant (the scattered writes alone);
* ``streaming``: with the evict-first store hint;
* ``l2 bulk prefetch`` / ``l2 line prefetch``: the warp's next item's source bytes requested into
  L2 (one bulk prefetch, or one line prefetch per 128 bytes) before the current item moves.
Each on G blocks of T threads (warps numbered round the blocks, as the library's WarpGrid), timed
from CUDA graphs (`graph_time_us`), every output row checked against its source row. Also prints a
fill of the same bytes (int64 ``fill_``) and a copy with the same traffic (`copy_floor_us`).

Usage: python tools/expand_floor.py [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256] [--iters 30]
"""
import argparse

import torch

from deep_ep import jit
from deep_ep.bench.gpu_timing import copy_floor_us, graph_time_us

SOURCE = r"""
#include <cuda/std/cstdint>

__device__ __forceinline__ int4 load_nc(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void store(int4* p, const int4& v) {
#if STREAMING
  __stcs(p, v);
#else
  *p = v;
#endif
}

// MODE 0: warp per token; 1: warp per (token, chunk); 2: warp per (token, half of K).
// PREFETCH (MODE 0): the next chunk's loads before the current chunk's stores. LOADS 0: store a constant.
extern "C" __global__ void __launch_bounds__(MAX_THREADS) fanout(const int4* __restrict__ x, int4* __restrict__ out,
                                                          const int* __restrict__ pos, int tokens, int vecs) {
  const int lane = threadIdx.x & 31;
  const int warp = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
  const int num_warps = gridDim.x * (blockDim.x >> 5);
  constexpr int kChunk = 32 * UNROLL;
  const int chunks = (vecs + kChunk - 1) / kChunk;
  const int per_token = MODE == 1 ? chunks : (MODE == 2 ? 2 : 1);
  const int items = tokens * per_token;
  for (int item = warp; item < items; item += num_warps) {
    const int t = item / per_token, part = item % per_token;
    const int my_row = lane < K ? pos[t * K + lane] : -1;
    const int4* s = x + static_cast<int64_t>(t) * vecs;
#if L2PF
    if (item + num_warps < items) {   // the warp's next item's source bytes into L2
      const int nt = (item + num_warps) / per_token, np = (item + num_warps) % per_token;
      const int first = MODE == 1 ? np * kChunk : 0;
      const int count = MODE == 1 ? min(kChunk, vecs - first) : vecs;
      const int4* ns = x + static_cast<int64_t>(nt) * vecs + first;
#if L2PF == 1
      if (lane == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(ns), "r"(count * 16) : "memory");
#else
      for (int i = lane * 8; i < count; i += 32 * 8)   // one 128-byte line per lane per step
        asm volatile("prefetch.global.L2 [%0];" :: "l"(ns + i));
#endif
    }
#endif
    const int c0 = MODE == 1 ? part : 0, c1 = MODE == 1 ? part + 1 : chunks;
    const int k0 = MODE == 2 ? part * (K / 2) : 0, k1 = MODE == 2 ? k0 + K / 2 : K;
    int4 v[UNROLL], w[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = c0 * kChunk + u * 32 + lane;
      v[u] = (LOADS && i < vecs) ? load_nc(s + i) : make_int4(t, t, t, t);
    }
    for (int c = c0; c < c1; ++c) {
      const int base = c * kChunk;
      if (PREFETCH && c + 1 < c1) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int i = base + kChunk + u * 32 + lane;
          w[u] = (LOADS && i < vecs) ? load_nc(s + i) : make_int4(t, t, t, t);
        }
      }
      for (int k = k0; k < k1; ++k) {
        const int row = __shfl_sync(0xffffffffu, my_row, k);
        if (row < 0) continue;
        int4* d = out + static_cast<int64_t>(row) * vecs;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int i = base + u * 32 + lane;
          if (i < vecs) store(d + i, v[u]);
        }
      }
      if (c + 1 < c1) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int i = base + kChunk + u * 32 + lane;
          if (PREFETCH) v[u] = w[u];
          else v[u] = (LOADS && i < vecs) ? load_nc(s + i) : make_int4(t, t, t, t);
        }
      }
    }
  }
}
"""

VARIANTS = {   # name -> defines (UNROLL 7: the library's chunk of a 14,336-byte row)
    "token": dict(MODE=0, PREFETCH=0, LOADS=1, STREAMING=0),
    "token streaming": dict(MODE=0, PREFETCH=0, LOADS=1, STREAMING=1),
    "chunk": dict(MODE=1, PREFETCH=0, LOADS=1, STREAMING=0),
    "chunk streaming": dict(MODE=1, PREFETCH=0, LOADS=1, STREAMING=1),
    "half": dict(MODE=2, PREFETCH=0, LOADS=1, STREAMING=0),
    "prefetch": dict(MODE=0, PREFETCH=1, LOADS=1, STREAMING=0),
    "prefetch streaming": dict(MODE=0, PREFETCH=1, LOADS=1, STREAMING=1),
    "token l2 bulk prefetch": dict(MODE=0, PREFETCH=0, LOADS=1, STREAMING=0, L2PF=1),
    "token l2 line prefetch": dict(MODE=0, PREFETCH=0, LOADS=1, STREAMING=0, L2PF=2),
    "chunk l2 bulk prefetch": dict(MODE=1, PREFETCH=0, LOADS=1, STREAMING=0, L2PF=1),
    "token streaming l2 bulk prefetch": dict(MODE=0, PREFETCH=0, LOADS=1, STREAMING=1, L2PF=1),
    "noload": dict(MODE=0, PREFETCH=0, LOADS=0, STREAMING=0),
    "noload chunk": dict(MODE=1, PREFETCH=0, LOADS=0, STREAMING=0),
}


def expanded_rows(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 ``[T, K]``: the output row of each (token, slot) in the expanded layout at alignment 1
    (rows grouped by expert, tokens in order within an expert)."""
    T, K = idx.shape
    flat = idx.flatten().long()
    key = flat * T + torch.arange(T, device=idx.device).repeat_interleave(K)
    order = torch.argsort(key)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=idx.device)
    return pos.view(T, K).to(torch.int32)


def build(defines: dict, unroll: int, topk: int, threads: int):
    """The fan-out kernel for ``defines``, bounded to ``threads`` per block (its register budget;
    built with NVRTC, no GPU needed to build it)."""
    return jit.build("expand_floor", SOURCE, defines={"L2PF": 0, **defines, "UNROLL": unroll, "K": topk,
                                                      "MAX_THREADS": threads}).function("fanout")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--unroll", type=int, default=7)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    a = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    T, H, K = a.tokens, a.hidden, a.topk
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand((T, a.experts), device=dev, generator=g).topk(K, dim=1).indices
    pos = expanded_rows(idx, a.experts)
    rows = T * K
    out = torch.empty((rows, H), dtype=torch.bfloat16, device=dev)
    vecs = H * 2 // 16
    none = lambda: None  # noqa: E731
    written = rows * H * 2
    fill = graph_time_us(lambda: out.view(torch.int64).fill_(7), a.iters, none)
    copy = copy_floor_us((written + T * H * 2) // 2, dev)
    print(f"T={T} hidden={H} top-{K}: {written / 1e6:.1f} MB written, {T * H * 2 / 1e6:.1f} MB read; {sms} SMs")
    print(f"{'what':40s} {'us':>8s} {'x fill':>7s}  check")
    print(f"{'fill_ int64 (write floor)':40s} {fill:8.1f} {1.0:7.2f}")
    print(f"{'copy, same traffic (copy floor)':40s} {copy:8.1f} {copy / fill:7.2f}")
    src_of_row = torch.empty(rows, dtype=torch.long, device=dev)
    src_of_row[pos.flatten().long()] = torch.arange(T, device=dev).repeat_interleave(K)
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(VARIANTS)
    for name in names:
        defines = VARIANTS[name]
        for blocks, threads in ((sms, 512), (sms, 1024), (2 * sms, 512)):
            fn = build(defines, a.unroll, K, threads)
            def call(fn=fn, blocks=blocks, threads=threads):
                fn.launch(blocks, threads, (x, out, pos, T, vecs))
            out.view(torch.int16).fill_(-1)
            call()
            torch.cuda.synchronize()
            if defines["LOADS"]:
                ok = torch.equal(out.view(torch.int16), x.view(torch.int16).index_select(0, src_of_row))
            else:
                ok = torch.equal(out.view(torch.int32)[:, 0].long(), src_of_row)
            us = graph_time_us(call, a.iters, none)
            label = f"{name} {blocks}x{threads}"
            print(f"{label:40s} {us:8.1f} {us / fill:7.2f}  {'ok' if ok else 'WRONG OUTPUT'}", flush=True)


if __name__ == "__main__":
    main()
