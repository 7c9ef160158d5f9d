"""How fast this GPU writes memory: candidates for the write half of the bench's floor
(`deep_ep.bench.gpu_timing.write_floor_us`, torch's ``fill_`` on bytes), so that the floor is the
fastest writer found, not just the first one tried.

Each writer fills ``--mb`` MB (default: the expanded dispatch's rows at DeepSeek-V3 shapes, 4096
tokens x 8 experts x 14,336 B = 470 MB), timed from CUDA graphs (`graph_time_us`), and is checked to
have written every byte:
* ``fill_ uint8``: the bench's writer; ``fill_ int64``: the same on 8-byte elements; ``zero_``;
* ``memset (driver)``: ``cuMemsetD32Async``;
* ``store GxT``: a grid-stride kernel of 16-byte stores (``streaming``: with the evict-first hint,
  as the data kernels' EP_STORE_STREAMING), G blocks of T threads.
Also prints a device copy of half the bytes each way (`copy_floor_us`, the floor's other half).

Usage: python tools/write_floor.py [--mb 470] [--iters 20]
"""
import argparse

import torch

from deep_ep import jit
from deep_ep.bench.gpu_timing import copy_floor_us, graph_time_us

SOURCE = r"""
#include <cuda/std/cstdint>

extern "C" __global__ void __launch_bounds__(1024) store_vectors(int4* __restrict__ out, long long vecs, int value) {
  const int4 v = make_int4(value, value, value, value);
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs; i += step) {
#if STREAMING
    __stcs(out + i, v);
#else
    out[i] = v;
#endif
  }
}
"""


def kernel(streaming: bool):
    """The store kernel's function (built with NVRTC; no GPU needed to build it)."""
    return jit.build("write_floor", SOURCE, defines={"STREAMING": int(streaming)}).function("store_vectors")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=4096 * 8 * 14336 / 1e6)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n = int(a.mb * 1e6) // 16 * 16
    out = torch.empty(n, dtype=torch.uint8, device=dev)
    none = lambda: None  # noqa: E731
    writers = [("fill_ uint8", lambda v: out.fill_(v)),
               ("fill_ int64", lambda v: out.view(torch.int64).fill_(v * 0x0101010101010101)),
               ("zero_", lambda v: out.zero_())]
    try:
        from deep_ep.cuda.driver import driver
        d = driver()
        # on the stream current at the call: a graph capture's own stream while capturing
        def memset(v):
            (err,) = d.cuMemsetD32Async(out.data_ptr(), v * 0x01010101, n // 4, torch.cuda.current_stream().cuda_stream)
            if int(err) != 0:
                raise RuntimeError(f"cuMemsetD32Async: {err}")
        writers.append(("memset (driver)", memset))
    except Exception as exc:  # no bindings: the others still run
        print(f"memset (driver): not run ({exc})")
    for streaming in (False, True):
        fn = kernel(streaming)
        for blocks, threads in ((sms, 1024), (2 * sms, 512), (4 * sms, 512), (8 * sms, 256)):
            writers.append((f"store {blocks}x{threads}{' streaming' if streaming else ''}",
                            lambda v, fn=fn, b=blocks, t=threads: fn.launch(b, t, (out, n // 16, v * 0x01010101))))
    copy = copy_floor_us(n // 2, dev)
    print(f"{n / 1e6:.1f} MB written; {sms} SMs; a copy of {n / 2e6:.1f} MB each way: {copy:.1f} us")
    print(f"{'writer':36s} {'us':>8s} {'TB/s':>6s}  check")
    for i, (name, write) in enumerate(writers):
        value = 1 + i % 100   # every writer leaves its own byte (< 128: the int64 fill's value fits)
        out.fill_(0xFF if name == "zero_" else 0)
        write(value)
        torch.cuda.synchronize()
        ok = bool((out == (0 if name == "zero_" else value)).all())
        us = graph_time_us(lambda: write(value), a.iters, none)
        us_text = "n/a" if us is None else f"{us:.1f}"
        rate = "" if us is None else f"{n / us / 1e6:6.2f}"
        print(f"{name:36s} {us_text:>8s} {rate:>6s}  {'ok' if ok else 'WRONG BYTES'}", flush=True)


if __name__ == "__main__":
    main()
