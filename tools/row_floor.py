"""What a row move costs on this GPU without the library around it: the attribution of the gap
between a dispatch/combine kernel and the copy floor (issue 5's "what limits it").

Times, from CUDA graphs of 10 calls each (`deep_ep.bench.gpu_timing.graph_time_us`, as the bench and
tools/tune_gpu.py time the library's kernels), on rows of ``--hidden`` bf16 values:
* ``copy``: torch's device-to-device copy of all rows (the bench's floor where it is not a write,
  `copy_floor_us`);
* ``index_select``: torch's row gather with a random permutation;
* ``gather GxT uU map``: a minimal warp-per-row gather kernel (G blocks of T threads, U 16-byte
  vectors in flight per lane, warps numbered block-major or round the blocks as the library's
  WarpGrid does), the same way the dispatch kernel moves a row, with nothing else in it;
* ``empty G`` and ``barrier G``: a kernel that does nothing, and one whose blocks meet at a
  grid-wide barrier (counter + flag in global memory), the fixed cost the one-kernel dispatch and
  combine pay between their send and receive phases.
Every gather output is checked against ``index_select``.

Usage: python tools/row_floor.py [--tokens 4096] [--hidden 7168] [--iters 50] [--unroll 2,4,7,8]
"""
import argparse

import torch

from deep_ep import jit
from deep_ep.bench.gpu_timing import copy_floor_us, graph_time_us

SOURCE = r"""
#include <cuda/std/cstdint>

// Warp w of the grid: block-major (w = block * warps_per_block + warp_in_block) or round the
// blocks (w = warp_in_block * gridDim.x + block: a small batch reaches every SM).
__device__ __forceinline__ void warp_of_grid(int& warp, int& num_warps) {
  const int wpb = blockDim.x >> 5, wib = threadIdx.x >> 5;
  warp = ROUND_THE_BLOCKS ? wib * gridDim.x + blockIdx.x : blockIdx.x * wpb + wib;
  num_warps = gridDim.x * wpb;
}

extern "C" __global__ void __launch_bounds__(1024) gather_rows(const int4* __restrict__ x, int4* __restrict__ out,
                                                               const int* __restrict__ perm, int rows, int vecs) {
  int warp, num_warps;
  warp_of_grid(warp, num_warps);
  const int lane = threadIdx.x & 31;
  for (int r = warp; r < rows; r += num_warps) {
    const int4* s = x + static_cast<int64_t>(perm[r]) * vecs;
    int4* d = out + static_cast<int64_t>(r) * vecs;
    for (int base = 0; base < vecs; base += 32 * UNROLL) {
      int4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = base + u * 32 + lane;
        if (i < vecs) v[u] = __ldg(s + i);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = base + u * 32 + lane;
        if (i < vecs) d[i] = v[u];
      }
    }
  }
}

extern "C" __global__ void empty_kernel(int* sink) {
  if (sink != nullptr && threadIdx.x == 0 && blockIdx.x == 0) *sink = 0;
}

// state[0]: arrivals of this call; state[1]: epoch. Every block arrives; the last one resets the
// counter and bumps the epoch; every block waits for the bump.
extern "C" __global__ void grid_barrier(unsigned* state) {
  __shared__ unsigned epoch;
  if (threadIdx.x == 0) {
    epoch = *reinterpret_cast<volatile unsigned*>(state + 1);
    __threadfence();
    if (atomicAdd(state, 1u) == gridDim.x - 1) {
      state[0] = 0;
      __threadfence();
      atomicAdd(state + 1, 1u);
    } else {
      while (*reinterpret_cast<volatile unsigned*>(state + 1) == epoch) {}
    }
  }
  __syncthreads();
}
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--unroll", default="2,4,7,8", help="vectors in flight per lane to try")
    a = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    T, H = a.tokens, a.hidden
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    perm = torch.randperm(T, device=dev, generator=g).to(torch.int32)
    expected = x.index_select(0, perm.long())
    out = torch.empty_like(x)
    vecs = H * 2 // 16
    none = lambda: None  # noqa: E731

    floor = copy_floor_us(T * H * 2, dev)  # the rows, read once and written once
    print(f"T={T} hidden={H} ({T * H * 2 / 1e6:.1f} MB of rows), {sms} SMs")
    print(f"{'what':36s} {'us':>8s} {'x floor':>8s}")
    print(f"{'copy (floor)':36s} {floor:8.1f} {1.0:8.2f}")
    us = graph_time_us(lambda: torch.index_select(x, 0, perm, out=out), a.iters, none)
    print(f"{'index_select (torch)':36s} {us:8.1f} {us / floor:8.2f}")

    for round_the_blocks in (1, 0):
        for unroll in [int(u) for u in a.unroll.split(",")]:
            mod = jit.build("row_floor", SOURCE, defines={"UNROLL": unroll, "ROUND_THE_BLOCKS": round_the_blocks})
            fn = mod.function("gather_rows")
            for blocks, threads in ((sms, 512), (sms, 1024), (2 * sms, 1024), (4 * sms, 512)):
                def call(fn=fn, blocks=blocks, threads=threads):
                    fn.launch(blocks, threads, (x, out, perm, T, vecs))
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                ok = torch.equal(out, expected)
                us = graph_time_us(call, a.iters, none)
                name = f"gather {blocks}x{threads} u{unroll} {'round' if round_the_blocks else 'block-major'}"
                print(f"{name:36s} {us:8.1f} {us / floor:8.2f}{'' if ok else '  WRONG OUTPUT'}", flush=True)

    mod = jit.build("row_floor", SOURCE, defines={"UNROLL": 1, "ROUND_THE_BLOCKS": 1})
    state = torch.zeros(2, dtype=torch.int32, device=dev)
    for blocks in (sms, 2 * sms):
        us = graph_time_us(lambda: mod.function("empty_kernel").launch(blocks, 512, (None,)), a.iters, none)
        print(f"{'empty ' + str(blocks) + 'x512':36s} {us:8.1f}")
        us = graph_time_us(lambda: mod.function("grid_barrier").launch(blocks, 512, (state,)), a.iters, none)
        print(f"{'barrier ' + str(blocks) + 'x512':36s} {us:8.1f}")


if __name__ == "__main__":
    main()
