"""The GPU backend's per-call host code without a GPU: `deep_ep.backends.gpu.dispatch.run_dispatch`
and `combine.run_combine` on CPU tensors, with stand-ins for the loaded modules that record each
launch's argument bytes instead of launching.

A fresh dispatch keeps one prepared launch per kernel and configuration, with the arguments that stay
the same set once, and sets the rest in each call; a cached dispatch or combine keeps one per handle.
These tests check that a launch reused after a different call carries exactly the bytes of a launch
prepared for this call alone: no argument keeps a value from the call before (a per-call value taken
for a constant, or one set only under some condition, shows up as a difference).
"""
import ctypes
import types

import pytest
import torch

from deep_ep.backends.base import BufferConfig
from deep_ep.backends.gpu import GPUBackend
from deep_ep.backends.gpu import combine as gpu_combine
from deep_ep.backends.gpu import dispatch as gpu_dispatch
from deep_ep.backends.gpu.abi import READBACK, READBACK_WORDS

H, E, K, M = 256, 16, 4, 64


class _Prepared:
    """Stands in for `jit.PreparedLaunch`: the same argument objects, launches recorded as bytes."""

    def __init__(self, name, grid, args, log):
        self.name, self.grid, self.args, self.log = name, grid, args, log

    def update(self, index, value):
        ctypes.memmove(ctypes.addressof(self.args[index]), ctypes.addressof(value), ctypes.sizeof(value))

    def launch(self, stream, grid=0):
        self.log.append((self.name, grid or self.grid, tuple(bytes(a) for a in self.args)))


class _Module:
    def __init__(self, log):
        self.log = log

    def function(self, name):
        log = self.log
        return types.SimpleNamespace(name=name, prepare=lambda grid, block, args, **kw: _Prepared(name, grid, args, log))


def _backend(log):
    """A `GPUBackend` with only what the per-call code reads: one rank, CPU tensors, fake modules and
    a layout report that says every token arrives once (``do_cpu_sync``)."""
    b = GPUBackend.__new__(GPUBackend)
    b.config = BufferConfig(buffer_id=0, rank=0, num_ranks=1, num_bytes=64 << 20, num_max_tokens_per_rank=M,
                            hidden=H, num_topk=K, use_fp8_dispatch=False, deterministic=False,
                            allow_hybrid_mode=True, allow_multiple_reduction=True, prefer_overlap_with_compute=True,
                            num_gpu_timeout_secs=100, num_cpu_timeout_secs=300, explicitly_destroy=False)
    b.calls = 0
    b._device, b.num_ranks, b.rank, b.emulated = torch.device("cpu"), 1, 0, False
    b.transport = types.SimpleNamespace(num_bytes=64 << 20)
    b.transport_args = ctypes.c_int(7)
    b._layouts, b._default_sms, b._sm_limit, b.num_device_sms = {}, {}, 8, 8
    b.module = lambda kind, structure: _Module(log)
    b.broken = None
    b.err_record = types.SimpleNamespace(words=[0, 0, 0, 0], device_ptr=0x1000)
    b.readback = types.SimpleNamespace(device_ptr=0x2000)
    b.readback_seq = 0
    b.timeout_ns, b.cooperative, b.call_stream, b.comm_handle, b.comm_stream = 10 ** 9, True, 0, 5, None
    b.launched_call, b.last_m = 0, 0
    b.notify_groups_max, b.notify_scratch = 32, torch.zeros(16, dtype=torch.int32)
    b.fresh_plans = {}

    def wait_readback(seq, num_experts, num_topk):
        report = [0] * READBACK_WORDS
        report[READBACK["out_rows"]] = report[READBACK["tok_rows"]] = b.last_tokens
        return report
    b.wait_readback = wait_readback
    return b


def _dispatch(b, T, *, weights, sync, align, stats, handle=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = None if handle is not None else torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) if weights else None
    st = torch.zeros(E, dtype=torch.int32) if stats else None
    b.last_tokens = T
    b.calls += 1
    out = gpu_dispatch.run_dispatch(
        b, x, None, idx, w, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=align, num_sms=4,
        handle=handle, do_handle_copy=True, do_cpu_sync=sync, do_expand=False, do_zero_padding=False,
        use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=st)
    return out, (x, idx, w, st)   # the inputs stay alive: their addresses are not reused


CALLS = [dict(T=48, weights=True, sync=True, align=4, stats=True),
         dict(T=20, weights=False, sync=False, align=1, stats=False),
         dict(T=64, weights=True, sync=False, align=2, stats=True),
         dict(T=1, weights=False, sync=True, align=1, stats=False)]


class _Allocations:
    """`deep_ep.backends.outputs.empty`, recording what it hands out, or handing out a recording again
    in the same order (so that two runs of a call write to the same output addresses)."""

    def __init__(self, real):
        self.real, self.recorded, self.replay = real, [], None

    def __call__(self, shape, dtype, device, stream=None):
        if self.replay is None:
            t = self.real(shape, dtype, device, stream)
            self.recorded.append(t)
            return t
        t = self.replay.pop(0)
        assert t.dtype == dtype and tuple(t.shape) == (tuple(shape) if isinstance(shape, tuple) else (shape,))
        return t


@pytest.mark.parametrize("order", [(0, 1), (1, 0), (2, 3), (3, 2), (0, 3)])
def test_a_reused_fresh_launch_carries_only_this_calls_arguments(order, monkeypatch):
    """Two different fresh dispatches on one backend (with and without CPU sync, weights, statistics,
    another alignment and token count): the second call's notify, layout and data launches, prepared
    by the first and reused, carry the same bytes as that call's launches on a backend that never ran
    the first, with the same inputs and output tensors."""
    from deep_ep.backends import outputs
    alloc = _Allocations(outputs.empty)
    monkeypatch.setattr(outputs, "empty", alloc)
    first, second = (CALLS[i] for i in order)
    log = []
    b = _backend(log)
    keep = _dispatch(b, **first, seed=1)
    log.clear()
    alloc.recorded.clear()
    (_, inputs) = _dispatch(b, **second, seed=2)
    reused = list(log)
    fresh_log = []
    fresh = _backend(fresh_log)
    fresh.calls = b.calls - 1
    fresh.notify_scratch = b.notify_scratch     # the backend's own device memory: the same address
    fresh.readback_seq = b.readback_seq - (1 if second["sync"] else 0)   # the same report number
    alloc.replay = list(alloc.recorded)
    x, idx, w, st = inputs
    fresh.last_tokens = second["T"]
    fresh.calls += 1
    gpu_dispatch.run_dispatch(
        fresh, x, None, idx, w, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=second["align"],
        num_sms=4, handle=None, do_handle_copy=True, do_cpu_sync=second["sync"], do_expand=False,
        do_zero_padding=False, use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=st)
    assert alloc.replay == []
    assert [name for name, _, _ in reused] == ["deep_ep_notify", "deep_ep_layout", "deep_ep_dispatch"]
    assert [(n, g) for n, g, _ in reused] == [(n, g) for n, g, _ in fresh_log]
    for (name, _, got), (_, _, want) in zip(reused, fresh_log):
        assert got == want, f"{name}: a reused launch's arguments differ from those of a launch prepared for this call"
    del keep


def test_word_views_start_on_128_byte_boundaries():
    """The handle's int32 allocation: every view starts on a 128-byte boundary, the layout words'
    three views are where the layout index puts them, and nothing overlaps."""
    from deep_ep.backends.gpu.abi import layout_index
    for R, L, T, expanded, meta in [(1, 256, 4096, False, 0), (8, 32, 100, True, 0), (4, 8, 3, False, 12),
                                    (2, 1, 0, True, 5)]:
        ix = layout_index(R, L, R * L)
        total, outer, inner, at = gpu_dispatch._word_views(ix, R, L, T, 8, expanded, meta)
        assert sum(outer) == total and sum(inner) == ix.size and outer[0] == ix.size
        starts = [sum(outer[:i]) for i in range(0, len(outer), 2)]
        assert all(s % 32 == 0 for s in starts)
        assert outer[2] == T * R and outer[4] == (T * 8 if expanded else 0) and outer[6] == meta * 10
        offsets = [sum(inner[:i]) for i in at]
        assert offsets == [ix.tok_prefix, ix.psum_expert, ix.raw_counts]
        assert [inner[i] for i in at] == [R, L, L]


def test_a_reused_handle_launch_carries_only_this_calls_arguments(monkeypatch):
    """Cached dispatches and combines with one handle, with and without weights (and bias): the
    second call of each reuses the handle's prepared launch and carries the same bytes as a launch
    prepared for that call alone (the handle's launches dropped, the same inputs and outputs)."""
    from deep_ep.backends import outputs
    alloc = _Allocations(outputs.empty)
    monkeypatch.setattr(outputs, "empty", alloc)
    log = []
    b = _backend(log)
    (_, _, _, handle), _ = _dispatch(b, **CALLS[0], seed=1)
    T = handle.num_tokens
    g = torch.Generator().manual_seed(5)
    rows = handle.num_recv_rows

    def cached(x, w):
        b.calls += 1
        gpu_dispatch.run_dispatch(
            b, x, None, None, w, num_experts=None, num_max_tokens_per_rank=M, expert_alignment=None, num_sms=4,
            handle=handle, do_handle_copy=True, do_cpu_sync=True, do_expand=False, do_zero_padding=False,
            use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=None)

    def combine(y, w, bias):
        b.calls += 1
        gpu_combine.run_combine(b, y, handle, w, bias, num_sms=4)

    calls = [
        (cached, (torch.randn(T, H, generator=g).to(torch.bfloat16), torch.rand(T, K, generator=g)),
         (torch.randn(T, H, generator=g).to(torch.bfloat16), None)),
        (combine, (torch.randn(rows, H, generator=g).to(torch.bfloat16), torch.rand(rows, K, generator=g),
                   (torch.randn(T, H, generator=g).to(torch.bfloat16),) * 2),
         (torch.randn(rows, H, generator=g).to(torch.bfloat16), None, ())),
    ]
    for run, first, second in calls:
        run(*first)
        log.clear()
        alloc.recorded.clear()
        run(*second)
        reused = list(log)
        log.clear()
        handle.backend_state.launches.clear()
        b.calls -= 1
        alloc.replay = list(alloc.recorded)
        run(*second)
        assert alloc.replay == [] and len(reused) == len(log) == 1
        assert reused[0][:2] == log[0][:2]
        assert reused[0][2] == log[0][2], f"{reused[0][0]}: a reused launch's arguments differ"
        alloc.replay = None


def test_every_launch_carries_this_calls_tag(monkeypatch):
    """The tag of each launch (the call's number and its configuration's fingerprint, which peers
    compare) is this call's: fresh dispatches with two configurations, then a cached dispatch and a
    combine, each after other calls."""
    from deep_ep.backends.gpu.abi import CallTag, CombineArgs, DispatchArgs, LayoutArgs, NotifyArgs, call_tag
    log = []
    b = _backend(log)
    structs = {"deep_ep_notify": NotifyArgs, "deep_ep_layout": LayoutArgs, "deep_ep_dispatch": DispatchArgs,
               "deep_ep_dispatch_cached": DispatchArgs, "deep_ep_combine": CombineArgs}

    def tags():
        out = [(name, structs[name].from_buffer_copy(args[0]).tag) for name, _, args in log]
        log.clear()
        return [(name, t.seq, t.fingerprint) for name, t in out]

    keep = []
    # Configurations that differ from the one before in one field of the fingerprint each (a plan
    # found by a key that left the field out would carry the other configuration's fingerprint).
    base = dict(T=32, weights=True, sync=True, align=1, stats=False)
    variants = [base, dict(base, weights=False), base, dict(base, sync=False), base, dict(base, align=2), base,
                dict(base, T=33), *CALLS[:2]]
    for i, call in enumerate(variants):
        out, inputs = _dispatch(b, **call, seed=10 + i)
        keep.append((out, inputs))
        data_bytes = H * 2
        want = call_tag(b.calls, 1, data_bytes, 0, K, 0, call["align"], E, call["weights"], int(call["sync"]),
                        0 if call["sync"] else M)
        assert tags() == [(n, want.seq, want.fingerprint) for n in ("deep_ep_notify", "deep_ep_layout",
                                                                   "deep_ep_dispatch")]
    handle = keep[0][0][3]
    g = torch.Generator().manual_seed(3)
    for weights in (True, False, True):
        b.calls += 1
        x = torch.randn(handle.num_tokens, H, generator=g).to(torch.bfloat16)
        w = torch.rand(handle.num_tokens, K, generator=g) if weights else None
        gpu_dispatch.run_dispatch(
            b, x, None, None, w, num_experts=None, num_max_tokens_per_rank=M, expert_alignment=None, num_sms=4,
            handle=handle, do_handle_copy=True, do_cpu_sync=True, do_expand=False, do_zero_padding=False,
            use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=None)
        want = call_tag(b.calls, 2, H * 2, 0, K, 0, handle.expert_alignment, E, weights, 1, 0)
        assert tags() == [("deep_ep_dispatch_cached", want.seq, want.fingerprint)]
        b.calls += 1
        y = torch.randn(handle.num_recv_rows, H, generator=g).to(torch.bfloat16)
        gpu_combine.run_combine(b, y, handle, torch.rand(handle.num_recv_rows, K, generator=g) if weights else None,
                                (), num_sms=4)
        want = call_tag(b.calls, 3, H, K, 0, E, weights, 0)
        assert tags() == [("deep_ep_combine", want.seq, want.fingerprint)]
    assert isinstance(want, CallTag)


def test_notify_groups_stay_within_the_cap():
    """The notify grid: whole blocks, enough groups for the pairs at the configured group size, never
    more than the cap (rounded down to whole blocks, at least one block)."""
    W, P = gpu_dispatch.NOTIFY_WARPS, gpu_dispatch.NOTIFY_PAIRS_PER_GROUP
    for T, K, cap in [(1, 1, 8), (0, 8, 64), (128, 8, 1056), (4096, 8, 1056), (16384, 8, 1056), (4096, 8, 100),
                      (4096, 8, 3), (7, 3, 16)]:
        g = gpu_dispatch.notify_groups(T, K, cap)
        assert g % W == 0 and W <= g <= max(W, cap // W * W)
        assert g == min(max(W, cap // W * W), -(-max(1, -(-T * K // P)) // W) * W)


def test_top_k_beyond_the_notify_tile_is_refused():
    """A top-k larger than the notify kernel's shared-memory tile of ids is a ValueError before any
    launch (the buffer was made for it: num_topk large enough)."""
    log = []
    b = _backend(log)
    K_big = gpu_dispatch.NOTIFY_TILE_PAIRS + 1
    b.config = b.config.__class__(**{**b.config.__dict__, "num_topk": K_big})
    x = torch.randn(4, H).to(torch.bfloat16)
    idx = torch.zeros(4, K_big, dtype=torch.int64)
    with pytest.raises(ValueError, match="top-k"):
        gpu_dispatch.run_dispatch(
            b, x, None, idx, None, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=1, num_sms=4,
            handle=None, do_handle_copy=True, do_cpu_sync=True, do_expand=False, do_zero_padding=False,
            use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=None)
    assert log == []
