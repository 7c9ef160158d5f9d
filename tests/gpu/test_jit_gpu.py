"""GPU tests of deep_ep.jit: build, load and launch (skipped without a CUDA device).

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/gpu/test_jit_gpu.py``.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deep_ep import jit  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

KERNELS = ROOT / "tests" / "jit_kernels"

SOURCE = r"""
#include <cuda/std/cstdint>

struct Params {          // must match the ctypes.Structure below
  int32_t a;
  float b;
  int64_t c;
  int32_t v[4];
};

extern "C" __global__ void mix(const int32_t* __restrict__ x, int64_t* __restrict__ out, int n,
                               float scale, int flag, int64_t big, uint32_t u, const float* maybe_null,
                               Params p) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    out[i] = (int64_t)x[i] * (int64_t)scale + flag + big + u + p.a + (int64_t)p.b + p.c + p.v[i % 4]
             + (maybe_null == nullptr ? 1000 : 0);
  }
}

extern "C" __global__ void big_smem(int64_t* out, int n) {
  extern __shared__ int32_t buf[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = i;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t s = 0;
    for (int i = 0; i < n; ++i) s += buf[i];
    out[blockIdx.x] = s;
  }
}

extern "C" __global__ void block_ids(int* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = blockIdx.x;
}
"""


class Params(ctypes.Structure):
    _fields_ = [("a", ctypes.c_int32), ("b", ctypes.c_float), ("c", ctypes.c_int64), ("v", ctypes.c_int32 * 4)]


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    import os
    os.environ.setdefault("EP_JIT_CACHE_DIR", str(tmp_path_factory.mktemp("jit-cache")))
    return jit.build("gpu_test", SOURCE)


def _expected(x, n, scale, flag, big, u, p, null):
    out = []
    for i in range(n):
        out.append(int(x[i]) * int(scale) + flag + big + u + p.a + int(p.b) + p.c + p.v[i % 4] + (1000 if null else 0))
    return out


def test_arch_is_device_arch(mod):
    major, minor = torch.cuda.get_device_capability()
    assert mod.arch == f"sm_{major}{minor}"


def test_launch_tensor_scalar_struct_args(mod):
    n = 1000
    x = torch.arange(n, dtype=torch.int32, device="cuda")
    out = torch.full((n,), -1, dtype=torch.int64, device="cuda")
    p = Params(7, 3.0, 2**40, (1, 2, 3, 4))
    big = 2**35
    f = mod.function("mix")
    f.launch((n + 127) // 128, 128, (x, out, n, 2.0, True, jit.i64(big), jit.u32(2**31 + 5), None, p))
    torch.cuda.current_stream().synchronize()
    assert out.cpu().tolist() == _expected(x.cpu().tolist(), n, 2.0, 1, big, 2**31 + 5, p, True)

    # Same kernel, non-null pointer, bytes for the struct, on a side stream given as torch.cuda.Stream.
    s = torch.cuda.Stream()
    dummy = torch.zeros(1, device="cuda")
    with torch.cuda.stream(s):
        f.launch((n + 127) // 128, (128, 1, 1), (x, out, n, 3.0, False, jit.i64(0), jit.u32(0), dummy, bytes(p)),
                 stream=s)
    s.synchronize()
    assert out.cpu().tolist() == _expected(x.cpu().tolist(), n, 3.0, 0, 0, 0, p, False)

    # Raw stream handle, empty tensor (its pointer may be null), zero-size work.
    empty = torch.empty(0, dtype=torch.int32, device="cuda")
    f.launch(1, 32, (empty, out, 0, 1.0, 0, jit.i64(0), jit.u32(0), None, p), stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()


def test_prepared_launch_updates_arguments_in_place(mod):
    """A prepared launch reads its ctypes arguments at each launch: fields changed between launches
    take effect, including pointers; the kernel sees the by-value struct exactly."""
    n = 300
    xs = [torch.randint(-50, 50, (n,), dtype=torch.int32, device="cuda") for _ in range(2)]
    outs = [torch.full((n,), -1, dtype=torch.int64, device="cuda") for _ in range(2)]
    p = Params(7, 3.0, 2**40, (1, 2, 3, 4))
    args = (ctypes.c_void_p(xs[0].data_ptr()), ctypes.c_void_p(outs[0].data_ptr()), ctypes.c_int(n),
            ctypes.c_float(2.0), ctypes.c_int(1), ctypes.c_int64(2**35), ctypes.c_uint32(9),
            ctypes.c_void_p(None), p)
    launch = mod.function("mix").prepare((n + 127) // 128, 128, args, device=torch.cuda.current_device())
    stream = torch.cuda.current_stream().cuda_stream
    launch.launch(stream)
    args[0].value, args[1].value, args[3].value = xs[1].data_ptr(), outs[1].data_ptr(), 3.0
    p.a, p.v[2] = -5, 100
    launch.launch(stream)
    torch.cuda.synchronize()
    assert outs[0].cpu().tolist() == _expected(xs[0].cpu().tolist(), n, 2.0, 1, 2**35, 9,
                                               Params(7, 3.0, 2**40, (1, 2, 3, 4)), True)
    assert outs[1].cpu().tolist() == _expected(xs[1].cpu().tolist(), n, 3.0, 1, 2**35, 9, p, True)
    with pytest.raises(TypeError, match="ctypes"):
        mod.function("mix").prepare(1, 32, (xs[0],), device=torch.cuda.current_device())


def test_prepared_cooperative_launch(mod):
    """A cooperative prepared launch runs like a plain one (also captured in a CUDA graph), and a
    grid that cannot be resident at once is refused with a LaunchError instead of being started."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    dev = torch.cuda.current_device()
    out = torch.full((sms,), -1, dtype=torch.int32, device="cuda")
    launch = mod.function("block_ids").prepare(sms, 256, (ctypes.c_void_p(out.data_ptr()),), device=dev,
                                               cooperative=True)
    launch.launch(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert out.cpu().tolist() == list(range(sms))
    out.fill_(-1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch.launch(torch.cuda.current_stream().cuda_stream)
    graph.replay()
    torch.cuda.synchronize()
    assert out.cpu().tolist() == list(range(sms))
    big = torch.empty(64 * sms, dtype=torch.int32, device="cuda")
    too_many = mod.function("block_ids").prepare(64 * sms, 1024, (ctypes.c_void_p(big.data_ptr()),), device=dev,
                                                 cooperative=True)
    with pytest.raises(jit.LaunchError, match="COOPERATIVE_LAUNCH_TOO_LARGE"):
        too_many.launch(torch.cuda.current_stream().cuda_stream)


def test_stream_join_orders_streams():
    """`StreamJoin.wait` makes one stream wait for work queued on another (both directions), as
    ``wait_stream`` does: a copy queued after the join sees a fill queued before it behind a sleep."""
    from deep_ep.cuda.streams import StreamJoin
    dev = torch.device("cuda", torch.cuda.current_device())
    join = StreamJoin(dev)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.zeros(1 << 20, device=dev)
    dst = torch.full((1 << 20,), -1.0, device=dev)
    torch.cuda.synchronize()
    for value, (producer, waiter) in enumerate([(a, b), (b, a), (a, b)], start=1):
        with torch.cuda.stream(producer):
            torch.cuda._sleep(20_000_000)  # ~10 ms on an H200: the waiter would otherwise run first
            src.fill_(float(value))
        join.wait(waiter.cuda_stream, producer.cuda_stream)
        with torch.cuda.stream(waiter):
            dst.copy_(src)
        torch.cuda.synchronize()
        assert bool((dst == value).all()), f"round {value}: the waiting stream ran before the producer"
    join.destroy()


def test_dynamic_shared_memory_above_48k(mod):
    n = 40 * 1024  # 160 KB of int32
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    mod.function("big_smem").launch(2, 256, (out, n), smem=n * 4)
    torch.cuda.synchronize()
    assert out.cpu().tolist() == [sum(range(n))] * 2


def test_cooperative_and_cluster_launch(mod):
    out = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    f = mod.function("block_ids")
    f.launch(8, 32, (out,), cooperative=True)
    torch.cuda.synchronize()
    assert out.cpu().tolist() == list(range(8))
    if torch.cuda.get_device_capability()[0] >= 9:
        out.fill_(-1)
        f.launch(8, 32, (out,), cluster=(2, 1, 1))
        torch.cuda.synchronize()
        assert out.cpu().tolist() == list(range(8))


def test_launch_failure_names_kernel(mod):
    with pytest.raises(jit.LaunchError, match="block_ids") as info:
        mod.function("block_ids").launch(1, 4096, (None,))
    assert "block=(4096, 1, 1)" in str(info.value)


def test_nccl_kernel_loads():
    """The NCCL device-API kernel's cubin loads on the device (headers match torch's libnccl)."""
    src = (KERNELS / "nccl_device_api.cu").read_text()
    loaded = jit.loaded_nccl_version()
    mod = jit.build("nccl_device_api", src, use_nccl=True)
    if loaded is not None:
        from deep_ep.jit import locate
        assert jit.nccl_header_version(locate.nccl_include_dir()) == loaded
    mod.function("nccl_device_api_probe").handle()
