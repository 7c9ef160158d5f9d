"""The Python cost of a GPU call's host code, without a GPU: the GPU backend's per-call code
(`deep_ep.backends.gpu.dispatch.run_dispatch`, `combine.run_combine`), the public argument checks
(`deep_ep.checks`, run on a call signature's first call) and what a later call of a signature checks
(`deep_ep.call_plans`), and the public calls over both (`ElasticBuffer.dispatch` / `combine`, with no
streams), on CPU tensors at the DeepSeek-V3 shapes, with bf16 rows and (public calls) FP8 rows
(e4m3 data and float32 scale factors, row- and column-major).

The backend is tests/test_gpu_host_path.py's stand-in (fake modules whose launches do nothing, a
layout report that says every token arrives once); output allocations are handed out again from a
cache, so neither allocations nor driver calls are in the figures: only the Python and the tensor
views and objects a call makes. The fresh dispatch's checks leave out the expert-id range check,
which reads the tensor on CPU only (the GPU's kernels do it), and so does the public full dispatch. Prints the best of five rounds of 1000
calls each, in us per call.

With ``--stamps`` it prints instead, for the public bf16 calls, when each allocation (``a``) and each
launch (``L``) happens and when the call returns, in us from the call's start (medians of 3000
calls): how much of a call's Python comes before its data kernel is queued.

Usage: python tools/host_python_cost.py [--stamps]
"""
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import test_gpu_host_path as host_path  # noqa: E402

from deep_ep import call_plans, checks  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402
from deep_ep.backends.base import BufferConfig  # noqa: E402
from deep_ep.backends.gpu import combine as gpu_combine  # noqa: E402
from deep_ep.backends.gpu import dispatch as gpu_dispatch  # noqa: E402
from deep_ep.bench.gpu_timing import best_host_us  # noqa: E402
from deep_ep.primitives import WindowUse  # noqa: E402

T, H, E, K = 4096, 7168, 256, 8


_STAMPS = []   # (kind, perf_counter_ns) of the current call, with --stamps


class _NoLaunch(host_path._Prepared):
    def launch(self, stream, grid=0):
        pass


class _StampedLaunch(_NoLaunch):
    def launch(self, stream, grid=0):
        _STAMPS.append(("L", time.perf_counter_ns()))


def _best_us(fn) -> float:
    return best_host_us(fn, calls=1000, rounds=5, warmup=200)


def _stamped(fn, calls: int = 3000) -> str:
    """The medians over ``calls`` calls of ``fn`` of each allocation's and launch's time, and of the
    return, in us from the call's start, as ``a6.6 a7.1 L8.8 ... end17.3``."""
    for _ in range(200):
        fn()
    runs = []
    for _ in range(calls):
        _STAMPS.clear()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        runs.append([(k, (t - t0) / 1e3) for k, t in _STAMPS] + [("end", (t1 - t0) / 1e3)])
    return " ".join(f"{kind}{statistics.median(r[i][1] for r in runs):.1f}" for i, (kind, _) in enumerate(runs[0]))


def main() -> None:
    stamps = "--stamps" in sys.argv[1:]
    host_path._Prepared = _StampedLaunch if stamps else _NoLaunch
    b = host_path._backend([])
    b.config = BufferConfig(buffer_id=0, rank=0, num_ranks=1, num_bytes=1 << 31, num_max_tokens_per_rank=T,
                            hidden=H, num_topk=K, use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True,
                            allow_multiple_reduction=True, prefer_overlap_with_compute=True, num_gpu_timeout_secs=100,
                            num_cpu_timeout_secs=300, explicitly_destroy=False)
    b.transport = types.SimpleNamespace(num_bytes=1 << 31, gin_contexts=lambda: 0,   # one node: no GIN
                                        kernel_args_using=lambda count: b.transport_args)
    b.notify_groups_max, b.last_tokens = 1056, T
    cache = {}

    def empty(shape, dtype, device, stream=None):
        t = cache.get((shape, dtype))
        if t is None:
            t = cache[(shape, dtype)] = torch.empty(shape, dtype=dtype)
        return t

    def stamped_empty(shape, dtype, device, stream=None):
        _STAMPS.append(("a", time.perf_counter_ns()))
        return empty(shape, dtype, device, stream)
    outputs.empty = stamped_empty if stamps else empty
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)

    def dispatch(handle=None, sync=True):
        b.calls += 1
        return gpu_dispatch.run_dispatch(
            b, x, None, None if handle else idx, w, num_experts=E, num_max_tokens_per_rank=T, expert_alignment=1,
            num_sms=24, handle=handle, do_handle_copy=True, do_cpu_sync=sync, do_expand=False, do_zero_padding=False,
            use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=None)
    handle = dispatch()[3]
    y = torch.randn(handle.num_recv_rows, H).to(torch.bfloat16)

    def combine():
        b.calls += 1
        return gpu_combine.run_combine(b, y, handle, None, (), num_sms=24)
    buf = types.SimpleNamespace(device=torch.device("cpu"), config=b.config, num_ranks=1, buffer_id=0, rank_idx=0,
                                num_allocated_qps=0, _plans={}, _window_use=WindowUse())
    checks.check_topk_values = lambda *a: None
    rows = [
        ("backend: full dispatch, CPU sync", lambda: dispatch(sync=True)),
        ("backend: full dispatch, no CPU sync", lambda: dispatch(sync=False)),
        ("backend: cached dispatch", lambda: dispatch(handle)),
        ("backend: combine", combine),
        ("checks: full dispatch", lambda: checks.validate_dispatch(
            buf, x, idx, w, None, E, None, None, 0, 0, None, None, False, False, None, True, None, False, False,
            False)),
        ("checks: cached dispatch", lambda: checks.validate_dispatch(
            buf, x, None, w, None, None, None, None, 0, 0, None, None, False, False, handle, True, None, False,
            False, False)),
        ("checks: combine", lambda: checks.validate_combine(buf, y, handle, None, None, 0, 0, None, None, False,
                                                            False, False)),
        ("plans: full dispatch, seen signature", lambda: call_plans.dispatch_plan(
            buf, x, idx, w, None, E, None, None, 0, 0, None, None, False, False, None, True, None, False, False,
            False)),
        ("plans: cached dispatch, seen signature", lambda: call_plans.dispatch_plan(
            buf, x, None, w, None, None, None, None, 0, 0, None, None, False, False, handle, True, None, False,
            False, False)),
        ("plans: combine, seen signature", lambda: call_plans.combine_plan(
            buf, y, handle, None, None, 0, 0, None, None, False, False, False)),
    ]
    # The public calls on that backend (argument checks, the buffer's stream layer with no streams).
    from deep_ep.buffer import ElasticBuffer
    pub = ElasticBuffer.__new__(ElasticBuffer)
    pub.__dict__.update(_backend=b, _destroyed=False, buffer_id=0, num_ranks=1, rank_idx=0, config=b.config,
                        allow_multiple_reduction=True, num_allocated_qps=0, _plans={}, _window_use=WindowUse())
    b.get_comm_stream = lambda: None
    rows += [
        ("public: full dispatch, CPU sync", lambda: pub.dispatch(x, idx, w, num_experts=E)),
        ("public: full dispatch, no CPU sync", lambda: pub.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False)),
        # as the bench and DeepEP's tests call it: the sizes and the alignment given
        ("public: full dispatch, sizes given", lambda: pub.dispatch(
            x, idx, w, num_experts=E, num_max_tokens_per_rank=T, expert_alignment=1, do_expand=False,
            do_zero_padding=False)),
        ("public: cached dispatch", lambda: pub.dispatch(x, topk_weights=w, handle=handle)),
        ("public: cached dispatch, zero padding", lambda: pub.dispatch(x, topk_weights=w, handle=handle,
                                                                       do_zero_padding=True)),
        ("public: combine", lambda: pub.combine(y, handle)),
    ]
    # FP8 rows (e4m3 data, float32 scale factors per 128 channels), as DeepSeek-V3 dispatches them
    x8 = (x.to(torch.float8_e4m3fn), torch.rand(T, H // 128))
    handle8 = pub.dispatch(x8, idx, w, num_experts=E)[3]
    rows += [
        ("public: FP8 full dispatch, CPU sync", lambda: pub.dispatch(x8, idx, w, num_experts=E)),
        ("public: FP8 cached dispatch", lambda: pub.dispatch(x8, topk_weights=w, handle=handle8)),
        ("public: FP8 cached, col-major scales", lambda: pub.dispatch(x8, topk_weights=w, handle=handle8,
                                                                      use_tma_aligned_col_major_sf=True)),
    ]
    if stamps:
        print(f"Allocations (a), launches (L) and return, us from the call's start (T={T}, medians)")
        for name, fn in rows:
            if name.startswith("public:") and "FP8" not in name:
                print(f"  {name:38s} {_stamped(fn)}")
        return
    print(f"Python per call, us (T={T}, hidden {H}, {E} experts, top-{K}; no allocations, no driver calls)")
    for name, fn in rows:
        print(f"  {name:38s} {_best_us(fn):6.1f}")


if __name__ == "__main__":
    main()
