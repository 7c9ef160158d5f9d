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
from deep_ep.backends.gpu import CallRecord, GPUBackend
from deep_ep.backends.gpu import combine as gpu_combine
from deep_ep.backends.gpu import dispatch as gpu_dispatch
from deep_ep.backends.gpu import dispatch_plan, modules
from deep_ep.backends.gpu.abi import READBACK, READBACK_WORDS, NotifyArgs

H, E, K, M = 256, 16, 4, 64


class _Prepared:
    """Stands in for `jit.PreparedLaunch`: the same argument objects, launches recorded as bytes."""

    def __init__(self, name, grid, args, log, block=None, cooperative=None):
        self.name, self.grid, self.args, self.log, self.block = name, grid, args, log, block
        self.cooperative = cooperative

    def update(self, index, value):
        ctypes.memmove(ctypes.addressof(self.args[index]), ctypes.addressof(value), ctypes.sizeof(value))

    def launch(self, stream, grid=0):
        self.log.append((self.name, grid or self.grid, tuple(bytes(a) for a in self.args)))


class _Module:
    def __init__(self, log):
        self.log = log

    def function(self, name):
        log = self.log
        return types.SimpleNamespace(name=name, prepare=lambda grid, block, args, **kw: _Prepared(
            name, grid, args, log, block, kw.get("cooperative")))

    def kernel_names(self):
        return sorted([modules.BARRIER_KERNEL, modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL,
                       modules.CACHED_DISPATCH_KERNEL, modules.COMBINE_KERNEL])


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
    b.transport = types.SimpleNamespace(num_bytes=64 << 20, gin_contexts=lambda: 0,
                                        kernel_args_using=lambda count: b.transport_args)   # one node
    b.transport_args = ctypes.c_int(7)
    b._layouts, b._default_sms, b._sm_limit, b.num_device_sms = {}, {}, 8, 8
    b.module = lambda kind, structure: _Module(log)
    b.broken = None
    b.err_record = types.SimpleNamespace(words=[0, 0, 0, 0], device_ptr=0x1000)
    b.readback = types.SimpleNamespace(device_ptr=0x2000)
    b.call_record = CallRecord()
    b.timeout_ns, b.cooperative, b.call_stream, b.comm_handle, b.comm_stream = 10 ** 9, True, 0, 5, None
    b.notify_groups_max, b.notify_scratch = 32, torch.zeros(16, dtype=torch.int32)
    b.fresh_plans = {}

    def wait_readback(seq, num_experts, num_topk):
        report = [0] * READBACK_WORDS
        report[READBACK["out_rows"]] = b.last_tokens
        report[READBACK["tok_rows"]] = b.last_tokens if b.last_tok_rows is None else b.last_tok_rows
        return report
    b.last_tok_rows = None   # token rows to report, if not the rows (expanded: fewer)
    b.wait_readback = wait_readback
    return b


def _dispatch(b, T, *, weights, sync, align, stats, handle=None, seed=0, expand=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = None if handle is not None else \
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    w = torch.rand(T, K, generator=g) if weights else None
    st = torch.zeros(E, dtype=torch.int32) if stats else None
    b.last_tokens = T
    b.calls += 1
    out = gpu_dispatch.run_dispatch(
        b, x, None, idx, w, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=align, num_sms=4,
        handle=handle, do_handle_copy=True, do_cpu_sync=sync, do_expand=expand, do_zero_padding=False,
        use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=st)
    return out, (x, idx, w, st)   # the inputs stay alive: their addresses are not reused


FRESH = [modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL]   # the kernels of a fresh dispatch, in order


def _notify_and_data_args(log) -> tuple:
    """``(NotifyArgs, DispatchArgs)`` of the first fresh dispatch in ``log``."""
    from deep_ep.backends.gpu.abi import DispatchArgs, NotifyArgs
    assert [name for name, _, _ in log[:2]] == FRESH
    return NotifyArgs.from_buffer_copy(log[0][2][0]), DispatchArgs.from_buffer_copy(log[1][2][0])


CALLS = [dict(T=48, weights=True, sync=True, align=4, stats=True),
         dict(T=20, weights=False, sync=False, align=1, stats=False),
         dict(T=64, weights=True, sync=False, align=2, stats=True),
         dict(T=1, weights=False, sync=True, align=1, stats=False),
         # the configurations of CALLS[0] and CALLS[1] (one plan each) with other token counts and stats
         dict(T=33, weights=True, sync=True, align=4, stats=False),
         dict(T=7, weights=False, sync=False, align=1, stats=True)]


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


@pytest.mark.parametrize("order", [(0, 1), (1, 0), (2, 3), (3, 2), (0, 3), (0, 4), (4, 0), (1, 5), (5, 1)])
def test_a_reused_fresh_launch_carries_only_this_calls_arguments(order, monkeypatch):
    """Two different fresh dispatches on one backend (with and without CPU sync, weights, statistics,
    another alignment and token count): the second call's launches (notify with its layout stage,
    and data), carry the same bytes as that call's launches on a backend that never ran
    the first, with the same inputs and output tensors; where the two calls share a configuration
    (the same plan: only the token count and the statistics differ), the second reuses the first's
    prepared launches."""
    from deep_ep.backends import outputs
    alloc = _Allocations(outputs.empty)
    monkeypatch.setattr(outputs, "empty", alloc)
    first, second = (CALLS[i] for i in order)
    log = []
    b = _backend(log)
    keep = _dispatch(b, **first, seed=1)
    plans = dict(b.fresh_plans)
    log.clear()
    alloc.recorded.clear()
    (_, inputs) = _dispatch(b, **second, seed=2)
    reused = list(log)
    shared = {k: first[k] for k in ("weights", "sync", "align")} == {k: second[k] for k in ("weights", "sync", "align")}
    assert (b.fresh_plans == plans) == shared   # the same plan objects: its launches were reused
    fresh_log = []
    fresh = _backend(fresh_log)
    fresh.calls = b.calls - 1
    fresh.notify_scratch = b.notify_scratch     # the backend's own device memory: the same address
    # the same report number
    fresh.call_record.readback_seq = b.call_record.readback_seq - (1 if second["sync"] else 0)
    alloc.replay = list(alloc.recorded)
    x, idx, w, st = inputs
    fresh.last_tokens = second["T"]
    fresh.calls += 1
    gpu_dispatch.run_dispatch(
        fresh, x, None, idx, w, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=second["align"],
        num_sms=4, handle=None, do_handle_copy=True, do_cpu_sync=second["sync"], do_expand=False,
        do_zero_padding=False, use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=st)
    assert alloc.replay == []
    assert [name for name, _, _ in reused] == FRESH
    assert [(n, g) for n, g, _ in reused] == [(n, g) for n, g, _ in fresh_log]
    for (name, _, got), (_, _, want) in zip(reused, fresh_log):
        assert got == want, f"{name}: a reused launch's arguments differ from those of a launch prepared for this call"
    del keep


def test_word_plan_pieces_start_on_128_byte_boundaries():
    """The handle's int32 allocation: every piece starts on a 128-byte boundary, the layout words'
    three ranges are where the layout index puts them, and nothing overlaps."""
    from deep_ep.backends.gpu.abi import layout_index
    for R, L, T, expanded, meta in [(1, 256, 4096, False, 0), (8, 32, 100, True, 0), (4, 8, 3, False, 12),
                                    (2, 1, 0, True, 5)]:
        ix = layout_index(R, L, R * L)
        p = gpu_dispatch.word_plan(ix, R, L, T, 8, expanded, meta)
        pieces = [(0, ix.size), (p.pos_tok_at, T * R), (p.pos_pair_at, T * 8 if expanded else 0),
                  (p.meta_at, meta * 10)]
        assert all(at % 32 == 0 for at, _ in pieces)
        for (a0, n0), (a1, _) in zip(pieces, pieces[1:]):
            assert a0 + n0 <= a1
        assert pieces[-1][0] + pieces[-1][1] <= p.total and p.total % 32 == 0
        assert (p.tok_prefix, p.psum_expert, p.raw_counts) == (ix.tok_prefix, ix.psum_expert, ix.raw_counts)
        assert p.layout_words == ix.size


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
        handle.launch_memo().clear()
        b.calls -= 1
        alloc.replay = list(alloc.recorded)
        run(*second)
        assert alloc.replay == [] and len(reused) == len(log) == 1
        assert reused[0][:2] == log[0][:2]
        assert reused[0][2] == log[0][2], f"{reused[0][0]}: a reused launch's arguments differ"
        alloc.replay = None


def test_a_handles_launch_memo_follows_its_fields(monkeypatch):
    """A cached dispatch and a combine keep their prepared launch in the handle's memo; an assignment
    to any field of the handle empties it, so the next call derives its launch from the new values
    (here fewer receive rows: the launch's capacity and the outputs follow), and a handle rebuilt
    with `dataclasses.replace` starts without it."""
    import dataclasses

    from deep_ep.backends.gpu.abi import CombineArgs, DispatchArgs
    log = []
    b = _backend(log)
    (_, _, _, handle), _ = _dispatch(b, **CALLS[0], seed=2)
    T, rows = handle.num_tokens, handle.num_recv_rows
    g = torch.Generator().manual_seed(6)

    def cached(h):
        b.calls += 1
        out = gpu_dispatch.run_cached(b, torch.randn(T, H, generator=g).to(torch.bfloat16), None, None, h, 4,
                                      False, False, None)
        return out[0], DispatchArgs.from_buffer_copy(log[-1][2][0])

    def combine(h):
        b.calls += 1
        y = torch.randn(h.num_recv_rows, H, generator=g).to(torch.bfloat16)
        gpu_combine.run_combine(b, y, h, None, (), num_sms=4)
        return CombineArgs.from_buffer_copy(log[-1][2][0])

    out, args = cached(handle)
    assert out.shape == (rows, H) and args.out_capacity == rows
    combine(handle)
    assert len(handle.launch_memo()) == 2
    assert "_launch_memo" not in vars(dataclasses.replace(handle, hidden=H))
    handle.num_recv_tokens = rows - 1
    assert handle.launch_memo() == {}
    out, args = cached(handle)
    assert out.shape == (rows - 1, H) and args.out_capacity == rows - 1
    combine(handle)
    assert len(handle.launch_memo()) == 2
    # The handle's routing tensor changed in place (no assignment): the launches follow it too.
    half = handle.topk_idx[:T // 2].clone()
    handle.topk_idx.set_(half)
    b.calls += 1
    gpu_dispatch.run_cached(b, torch.randn(T // 2, H, generator=g).to(torch.bfloat16), None, None, handle, 4,
                            False, False, None)
    args = DispatchArgs.from_buffer_copy(log[-1][2][0])
    assert args.num_tokens == T // 2 and args.topk_idx == half.data_ptr()
    combined = combine(handle)
    assert combined.num_tokens == T // 2 and combined.topk_idx == half.data_ptr()


def test_every_launch_carries_this_calls_tag():
    """The tag of each launch (the call's number and its configuration's fingerprint, which peers
    compare) is this call's: fresh dispatches with two configurations, then a cached dispatch and a
    combine, each after other calls."""
    from deep_ep.backends.gpu.abi import CallTag, CombineArgs, DispatchArgs, LayoutArgs, NotifyArgs, call_tag
    log = []
    b = _backend(log)
    # the argument structs that carry a tag, per kernel (the notify kernel's layout stage has its own)
    structs = {modules.NOTIFY_KERNEL: (NotifyArgs, LayoutArgs), modules.DISPATCH_KERNEL: (DispatchArgs,),
               modules.CACHED_DISPATCH_KERNEL: (DispatchArgs,), modules.COMBINE_KERNEL: (CombineArgs,)}

    def tags():
        out = [(name, struct.from_buffer_copy(args[i]).tag) for name, _, args in log
               for i, struct in enumerate(structs[name])]
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
                        0 if call["sync"] else M, 0)   # 0: no GIN contexts on one node
        names = (modules.NOTIFY_KERNEL, modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL)
        assert tags() == [(n, want.seq, want.fingerprint) for n in names]
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
        want = call_tag(b.calls, 2, H * 2, 0, K, 0, handle.expert_alignment, E, weights, 1, 0, 0)
        assert tags() == [(modules.CACHED_DISPATCH_KERNEL, want.seq, want.fingerprint)]
        b.calls += 1
        y = torch.randn(handle.num_recv_rows, H, generator=g).to(torch.bfloat16)
        gpu_combine.run_combine(b, y, handle, torch.rand(handle.num_recv_rows, K, generator=g) if weights else None,
                                (), num_sms=4)
        want = call_tag(b.calls, 3, H, K, 0, E, weights, 0, 0)
        assert tags() == [(modules.COMBINE_KERNEL, want.seq, want.fingerprint)]
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
    K_big = dispatch_plan.NOTIFY_TILE_PAIRS + 1
    b.config = b.config.__class__(**{**b.config.__dict__, "num_topk": K_big})
    x = torch.randn(4, H).to(torch.bfloat16)
    idx = torch.zeros(4, K_big, dtype=torch.int64)
    with pytest.raises(ValueError, match="top-k"):
        gpu_dispatch.run_dispatch(
            b, x, None, idx, None, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=1, num_sms=4,
            handle=None, do_handle_copy=True, do_cpu_sync=True, do_expand=False, do_zero_padding=False,
            use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=None)
    assert log == []


@pytest.mark.parametrize("sync,expand", [(True, False), (False, False), (True, True), (False, True)])
def test_lazy_handle_fields_are_views_at_the_kernels_addresses(sync, expand):
    """A GPU dispatch's handle makes its three layout tensors, ``dst_buffer_slot_idx`` and
    ``recv_src_metadata`` on first access: each is then a view at exactly the address the kernels
    were given, with its documented shape and dtype; the fields can be assigned, and the handle
    clones, pickles and `dataclasses.replace`s with every field."""
    import dataclasses
    import io

    from deep_ep.backends.gpu.abi import layout_index
    log = []
    b = _backend(log)
    T = 24
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    b.last_tokens, b.last_tok_rows = T * (K if expand else 1), T
    b.calls += 1
    _, _, _, handle = gpu_dispatch.run_dispatch(
        b, x, None, idx, None, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=1, num_sms=4,
        handle=None, do_handle_copy=True, do_cpu_sync=sync, do_expand=expand, do_zero_padding=False,
        use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=None)
    assert not set(handle.LAZY_FIELDS) & set(vars(handle))
    early = torch.load(io.BytesIO(_saved(handle)), weights_only=False)   # pickled before any access
    assert not set(handle.LAZY_FIELDS) & set(vars(early))
    for name in handle.LAZY_FIELDS:
        assert torch.equal(getattr(early, name), getattr(handle, name)), name
    handle.__dict__ = {k: v for k, v in vars(handle).items() if k not in handle.LAZY_FIELDS}
    handle.backend_state._views.clear()
    notify, data = _notify_and_data_args(log)
    state = handle.backend_state
    ix = layout_index(1, E, E)
    want = {
        "psum_num_recv_tokens_per_scaleup_rank": (data.layout + 4 * ix.tok_prefix, (1,)),
        "psum_num_recv_tokens_per_expert": (data.layout + 4 * ix.psum_expert, (E,)),
        "num_unaligned_recv_tokens_per_expert": (data.layout + 4 * ix.raw_counts, (E,)),
        # (expanded: the rows of every pair; non-expanded: of every token)
        "dst_buffer_slot_idx": (data.pos_pair, (T, K)) if expand else (notify.pos_tok, (T, 1)),
        "recv_src_metadata": (data.src_meta, (data.tok_capacity, K + 2)),
    }
    for name, (ptr, shape) in want.items():
        t = getattr(handle, name)
        assert t.dtype == torch.int32 and tuple(t.shape) == shape and t.data_ptr() == ptr, name
        assert getattr(handle, name) is t   # made once
        if not (sync and name == "recv_src_metadata"):
            assert t.untyped_storage().data_ptr() == state.words.untyped_storage().data_ptr(), name
    assert state.layout.data_ptr() == data.layout and state.pos_tok.data_ptr() == notify.pos_tok
    for t in (state.layout, handle.recv_src_metadata, handle.dst_buffer_slot_idx):
        t.copy_(torch.randint(-1, 50, t.shape, generator=g, dtype=torch.int32))
    # copies: every field, equal values, storage of their own
    twin = handle.clone()
    back = torch.load(io.BytesIO(_saved(handle)), weights_only=False)
    changed = dataclasses.replace(handle, hidden=H + 8)
    for other in (twin, back, changed):
        for name in handle.LAZY_FIELDS:
            assert torch.equal(getattr(other, name), getattr(handle, name)), name
    assert twin.recv_src_metadata.data_ptr() != handle.recv_src_metadata.data_ptr()
    assert torch.equal(twin.backend_state.layout, state.layout) and changed.hidden == H + 8
    assert "recv_src_metadata=<int32" in repr(handle)
    # a field assigned (as DeepEP's tests do) reads back as assigned
    short = handle.recv_src_metadata[:3]
    handle.recv_src_metadata = short
    assert handle.recv_src_metadata is short
    with pytest.raises(AttributeError):
        handle.no_such_field


def _saved(obj) -> bytes:
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("sync", [True, False])
def test_a_gpu_handle_has_every_field(sync):
    """`EPHandle.with_lazy_fields` does not check its fields (it is on the per-call path): every field
    of the handles the GPU backend makes reads, and none but the lazy ones is left to the state."""
    import dataclasses

    from deep_ep.handle import EPHandle
    b = _backend([])
    (_, _, _, handle), keep = _dispatch(b, 8, weights=True, sync=sync, align=1, stats=False)
    names = {f.name for f in dataclasses.fields(EPHandle)}
    assert names - set(vars(handle)) == set(EPHandle.LAZY_FIELDS)
    for name in names:
        getattr(handle, name)


@pytest.mark.parametrize("sync", [True, False])
def test_a_handles_tensors_cover_its_state(sync):
    """What the buffer keeps alive and records on streams for a handle (`collect_tensors`), and what
    the operators compare their outputs with (`ops.registry.handle_tensors`), holds the memory the
    kernels read, including the lazy fields' storage before any was read: an operator then returns a
    copy of ``recv_topk_idx`` (which the handle holds), not the handle's own tensor."""
    from deep_ep.handle import collect_tensors
    from deep_ep.ops import library
    b = _backend([])
    (_, recv_idx, _, handle), keep = _dispatch(b, 16, weights=True, sync=sync, align=1, stats=False)
    state = handle.backend_state
    storages = {t.untyped_storage().data_ptr() for t in collect_tensors(handle)}
    assert state.words.untyped_storage().data_ptr() in storages
    assert recv_idx.untyped_storage().data_ptr() in storages
    assert handle.recv_src_metadata.untyped_storage().data_ptr() in storages
    assert not set(handle.LAZY_FIELDS) & set(vars(handle)) - {"recv_src_metadata"}
    own = library._own(recv_idx, handle)
    assert own is not recv_idx and torch.equal(own, recv_idx)


def test_a_lazy_field_without_its_state_says_so():
    b = _backend([])
    (_, _, _, handle), keep = _dispatch(b, 8, weights=False, sync=True, align=1, stats=False)
    handle.backend_state = None
    with pytest.raises(AttributeError, match="made from the handle's backend state"):
        handle.psum_num_recv_tokens_per_expert


def _record_allocations_and_launches(monkeypatch) -> list:
    """A list that gets ``("alloc", shape)`` for every output allocation and ``(kernel name, None)``
    for every launch of the stand-in modules, in order."""
    from deep_ep.backends import outputs
    events = []
    real_empty, real_launch = outputs.empty, _Prepared.launch

    def empty(shape, dtype, device, stream=None):
        events.append(("alloc", shape))
        return real_empty(shape, dtype, device, stream)

    def launch(self, stream, grid=0):
        events.append((self.name, None))
        real_launch(self, stream, grid)
    monkeypatch.setattr(outputs, "empty", empty)
    monkeypatch.setattr(_Prepared, "launch", launch)
    return events


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("expand", [False, True])
def test_with_cpu_sync_every_rank_count_waits_for_the_counts_then_allocates_and_launches(num_ranks, expand,
                                                                                         monkeypatch):
    """With CPU sync a rank alone takes the path of ranks with peers: the notify kernel, the wait for
    the layout stage's report, then outputs of exactly the reported rows and the data kernel, its
    capacities those rows."""
    events = _record_allocations_and_launches(monkeypatch)
    b = _backend([])
    b.num_ranks = num_ranks
    T, reported, tokens = 24, 50, 22
    wait = b.wait_readback

    def wait_readback(seq, num_experts, num_topk):
        events.append(("wait", None))
        report = wait(seq, num_experts, num_topk)
        report[READBACK["out_rows"]], report[READBACK["tok_rows"]] = reported, tokens
        return report
    b.wait_readback = wait_readback
    (recv_x, recv_idx, recv_w, handle), keep = _dispatch(b, T, weights=True, sync=True, align=1, stats=False,
                                                         expand=expand)
    kinds = [k for k, _ in events]
    notify, kernel = modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL
    assert kinds.index(notify) < kinds.index("wait") < kinds.index(kernel) and kinds.count(kernel) == 1
    assert kinds[-1] == kernel
    assert recv_x.shape == (reported, H) and handle.recv_src_metadata.shape == (tokens, K + 2)
    assert recv_w.shape == ((reported,) if expand else (reported, K))
    assert (recv_idx is None) == expand
    plan = b.fresh_plans[next(iter(b.fresh_plans))]
    data = plan.data.args[0]
    assert (data.out_capacity, data.tok_capacity) == (reported, tokens)
    assert data.out_x == recv_x.data_ptr() and data.src_meta == handle.recv_src_metadata.data_ptr()


@pytest.fixture(autouse=True)
def _notify_stream_busy(monkeypatch):
    """No driver here: the notify kernel's stream, which a wait for the counts asks about once a
    second, reads as busy (``CUDA_ERROR_NOT_READY``) unless a test says otherwise."""
    import deep_ep.backends.gpu as gpu_backend
    monkeypatch.setattr(gpu_backend, "stream_query", lambda stream, device: 600)


@pytest.mark.parametrize("code, message", [(0, "finished without the report"), (700, "failed with .*compute-sanitizer")])
def test_a_wait_for_the_counts_stops_when_the_notify_stream_ends_without_a_report(monkeypatch, code, message):
    """A notify kernel that ended (or faulted) without writing its report and without recording an
    error: the wait asks the stream once a second and raises within about a second, not after the
    host's timeout, naming what the stream said; the buffer is unusable."""
    import time

    import deep_ep.backends.gpu as gpu_backend
    queried = []
    monkeypatch.setattr(gpu_backend, "stream_query", lambda stream, device: queried.append((stream, device)) or code)
    monkeypatch.setattr(gpu_backend, "error_name", lambda err: f"CUDA_ERROR_{err}")
    b = GPUBackend.__new__(GPUBackend)
    b.config = types.SimpleNamespace(num_cpu_timeout_secs=30)
    b.spin_secs, b.rank, b.broken = 0.0, 0, None
    b.comm_handle, b.call_stream, b._device = 1234, None, torch.device("cuda", 3)
    b.readback = types.SimpleNamespace(words=[0] * READBACK_WORDS)
    b.err_record = types.SimpleNamespace(words=[0] * 4)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=message):
        b.wait_readback(1, E, K)
    assert time.monotonic() - start < 5 and queried == [(1234, 3)]
    assert b.broken == "no report of the counts"


def test_an_interrupted_or_timed_out_wait_for_the_counts_leaves_the_buffer_unusable(monkeypatch):
    """A wait for the layout stage's report that ends without it (an interrupt, the host's timeout)
    leaves the call half queued, its peers waiting for the rest: the buffer is marked unusable."""
    import deep_ep.backends.gpu as gpu_backend
    b = GPUBackend.__new__(GPUBackend)
    b.config = types.SimpleNamespace(num_cpu_timeout_secs=1)
    b.spin_secs, b.rank, b.broken = 0.0, 0, None
    b.readback = types.SimpleNamespace(words=[0] * READBACK_WORDS)
    b.err_record = types.SimpleNamespace(words=[0] * 4)

    def interrupted(cond, timeout, spin):
        raise KeyboardInterrupt
    monkeypatch.setattr(gpu_backend, "spin_until", interrupted)
    with pytest.raises(KeyboardInterrupt):
        b.wait_readback(1, E, K)
    assert b.broken and "interrupted" in b.broken
    b.broken = None
    monkeypatch.setattr(gpu_backend, "spin_until", lambda cond, timeout, spin: False)
    with pytest.raises(TimeoutError, match="num_cpu_timeout_secs"):
        b.wait_readback(1, E, K)
    assert b.broken == "host timeout"


def test_the_wait_for_the_counts_reads_the_report_or_raises_what_it_records():
    """`GPUBackend.wait_readback` on mapped words (here host memory, as `MappedWords` lays it out: a
    ctypes array and an int view of it): once the call's sequence number is there it returns the
    header and the L counts; a report of an out-of-range id raises the ValueError every rank raises
    (the buffer stays usable), a recorded timeout the TimeoutError that makes it unusable."""
    import ctypes

    from deep_ep.backends.gpu.abi import ERR_BAD_EXPERT, ERR_TIMEOUT
    b = GPUBackend.__new__(GPUBackend)
    b.config = types.SimpleNamespace(num_cpu_timeout_secs=1, num_gpu_timeout_secs=1, num_max_tokens_per_rank=M)
    b.spin_secs, b.rank, b.num_ranks, b.broken = 0.0, 0, 1, None
    b.call_record = CallRecord()
    b.call_record.num_max_tokens, b.call_record.launched_call = M, 1
    words = (ctypes.c_int32 * READBACK_WORDS)()
    b.readback = types.SimpleNamespace(words=words, ints=memoryview(words).cast("B").cast("i"))
    b.err_record = types.SimpleNamespace(words=[0] * 4)
    counts = [3 * e + 1 for e in range(E)]
    for e, c in enumerate(counts):
        words[READBACK["counts"] + e] = c
    words[READBACK["out_rows"]], words[READBACK["seq"]] = 40, 7
    report = b.wait_readback(7, E, K)
    assert report == list(words[:READBACK["counts"] + E]) and report[READBACK["counts"]:] == counts
    assert report[READBACK["out_rows"]] == 40 and b.broken is None
    words[READBACK["status"]], words[READBACK["peer"]] = ERR_BAD_EXPERT, 0
    words[READBACK["detail"]], words[READBACK["value"]] = 2 * K + 1, E + 5
    with pytest.raises(ValueError, match=rf"expert id {E + 5} at \[2, 1\]"):
        b.wait_readback(7, E, K)
    assert b.broken is None
    words[READBACK["status"]], words[READBACK["rank"]], words[READBACK["peer"]] = ERR_TIMEOUT, 0, 0
    with pytest.raises(TimeoutError):
        b.wait_readback(7, E, K)
    assert b.broken == "timeout"


def test_the_wait_for_the_counts_stops_at_an_error_recorded_without_a_report():
    """A kernel that records an error in the host's record and writes no report ends the wait at once
    with that error (not after the host's timeout, with a message that the GPU's timeout did not
    fire); an out-of-range id in the record (an earlier call's, raised at the next call) does not end
    it."""
    import ctypes
    import time

    from deep_ep.backends.gpu.abi import ERR_BAD_EXPERT, ERR_TIMEOUT, PHASES
    b = GPUBackend.__new__(GPUBackend)
    b.config = types.SimpleNamespace(num_cpu_timeout_secs=30, num_gpu_timeout_secs=1, num_max_tokens_per_rank=M)
    b.spin_secs, b.rank, b.num_ranks, b.broken = 0.0, 0, 1, None
    b.call_record = CallRecord()
    b.call_record.num_max_tokens, b.call_record.launched_call = M, 1
    words = (ctypes.c_int32 * READBACK_WORDS)()
    b.readback = types.SimpleNamespace(words=words, ints=memoryview(words).cast("B").cast("i"))
    record = [ERR_TIMEOUT, 0, 0, next(iter(PHASES))]
    b.err_record = types.SimpleNamespace(words=record, read=lambda: tuple(record))
    words[READBACK["seq"]] = 6   # an earlier call's report: this call's (7) never comes
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 0"):
        b.wait_readback(7, E, K)
    assert time.monotonic() - start < 5 and b.broken == "timeout"
    b.broken = None
    b.config.num_cpu_timeout_secs = 0.2
    record[:] = [ERR_BAD_EXPERT, 0, 3, 99]
    with pytest.raises(TimeoutError, match="num_cpu_timeout_secs"):
        b.wait_readback(7, E, K)
    assert b.broken == "host timeout"


def test_a_fresh_dispatch_with_cpu_sync_is_refused_while_capturing(monkeypatch):
    """Under CUDA-graph capture the counts a dispatch with CPU sync waits for are written only at
    replay: refused before any launch; without CPU sync the dispatch is captured as usual."""
    log = []
    b = _backend(log)
    monkeypatch.setattr(gpu_dispatch, "_capturing", lambda backend: True)
    seq = b.call_record.readback_seq
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        _dispatch(b, 24, weights=True, sync=True, align=1, stats=False)
    assert log == [] and b.call_record.readback_seq == seq
    _dispatch(b, 24, weights=True, sync=False, align=1, stats=False)
    assert [name for name, _, _ in log] == FRESH


def test_the_notify_grid_follows_its_settings_between_calls(monkeypatch):
    """A fresh dispatch's notify grid is kept per token count, and follows the settings that
    a tuning run may change between calls (the cap on groups, the pairs per group)."""
    log = []
    b = _backend(log)
    b.notify_groups_max = 64
    W = gpu_dispatch.NOTIFY_WARPS
    T = 48
    for pairs, cap in ((32, 64), (8, 64), (8, 16), (32, 64)):
        monkeypatch.setattr(gpu_dispatch, "NOTIFY_PAIRS_PER_GROUP", pairs)
        b.notify_groups_max = cap
        log.clear()
        _dispatch(b, T, weights=False, sync=False, align=1, stats=False)
        grids = [grid for name, grid, _ in log if name == "deep_ep_notify"]
        assert grids == [gpu_dispatch.notify_groups(T, K, cap) // W], (pairs, cap, grids)


def test_a_refused_notify_launch_is_retried_with_a_smaller_grid(monkeypatch):
    """Fewer SMs than the device has (MPS, a green context): the device refuses the notify kernel's
    cooperative launch. The dispatch starts again with half the grid until it fits, keeps that cap
    for later calls, and returns what a dispatch with that grid returns."""
    from deep_ep import jit
    log = []
    b = _backend(log)
    b.notify_groups_max = 64
    fits = 2   # blocks the stand-in device holds at once
    launch = _Prepared.launch

    def cooperative(self, stream, grid=0):
        if self.name == "deep_ep_notify" and (grid or self.grid) > fits:
            raise jit.LaunchError("launch of deep_ep_dispatch:deep_ep_notify failed "
                                  "(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE)")
        launch(self, stream, grid)
    monkeypatch.setattr(_Prepared, "launch", cooperative)
    T = 64   # 256 pairs: 8 blocks of 8 groups at 4 pairs each
    monkeypatch.setattr(gpu_dispatch, "NOTIFY_PAIRS_PER_GROUP", 4)
    (recv_x, _, _, handle), keep = _dispatch(b, T, weights=True, sync=True, align=1, stats=False)
    notify = [(grid, args) for name, grid, args in log if name == "deep_ep_notify"]
    assert [g for g, _ in notify] == [fits] and b.notify_groups_max == fits * gpu_dispatch.NOTIFY_WARPS
    tokens_per_group = NotifyArgs.from_buffer_copy(notify[0][1][0]).tokens_per_group
    assert tokens_per_group == -(-T // (fits * gpu_dispatch.NOTIFY_WARPS))
    assert recv_x.shape == (T, H) and handle.num_recv_tokens == T
    log.clear()
    _dispatch(b, T, weights=True, sync=True, align=1, stats=False)   # the lower cap stays
    assert [grid for name, grid, _ in log if name == "deep_ep_notify"] == [fits]
    fits = 0
    with pytest.raises(jit.LaunchError, match="not even one block fits"):
        _dispatch(b, T, weights=True, sync=True, align=1, stats=False)


def test_column_major_scale_factors_with_cpu_sync_wait_for_the_counts(monkeypatch):
    """With CPU sync, FP8 outputs of either scale-factor layout wait for the counts: the data kernel
    is queued after the wait, for the reported rows."""
    events = _record_allocations_and_launches(monkeypatch)
    b = _backend([])
    wait = b.wait_readback

    def wait_readback(seq, num_experts, num_topk):
        events.append(("wait", None))
        return wait(seq, num_experts, num_topk)
    b.wait_readback = wait_readback
    T, num_sf = 24, H // 128
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(torch.float8_e4m3fn)
    sf = torch.rand(T, num_sf, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    b.last_tokens = T
    for col_major in (True, False):
        events.clear()
        b.calls += 1
        (recv_x, recv_sf), _, _, handle = gpu_dispatch.run_dispatch(
            b, x, sf, idx, None, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=1, num_sms=4,
            handle=None, do_handle_copy=True, do_cpu_sync=True, do_expand=False, do_zero_padding=False,
            use_tma_aligned_col_major_sf=col_major, cumulative_local_expert_recv_stats=None)
        kinds = [k for k, _ in events if k != "alloc"]
        assert kinds == [modules.NOTIFY_KERNEL, "wait", modules.DISPATCH_KERNEL], col_major
        assert recv_x.shape == (T, H) and recv_sf.shape == (T, num_sf) and handle.num_recv_tokens == T


def _record_prepared(monkeypatch) -> list:
    """A list that every `_Prepared` made from now on (a prepared launch of the stand-in modules) is
    appended to."""
    prepared = []
    real_prepared = _Prepared.__init__

    def record(self, *args, **kw):
        real_prepared(self, *args, **kw)
        prepared.append(self)
    monkeypatch.setattr(_Prepared, "__init__", record)
    return prepared


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("expand", [False, True])
def test_every_rank_count_launches_the_same_kernels(expand, sync, ranks, monkeypatch):
    """A rank alone launches the kernels several ranks launch, with the same blocks and launch kind:
    a fresh dispatch the notify kernel (`NOTIFY_WARPS` warps per block) then the data kernel, a cached
    dispatch the cached data kernel, a combine the combine kernel, each data kernel with
    `modules.THREADS` threads per block on num_sms blocks, every launch cooperative."""
    prepared = _record_prepared(monkeypatch)
    log = []
    b = _backend(log)
    b.num_ranks = ranks   # the plan's kernel choice and word plan read this; the stand-in reports one rank's counts
    T = 24
    b.last_tok_rows = T
    b.last_tokens = T * K if expand else T
    (_, _, _, handle), keep = _dispatch(b, T, weights=True, sync=sync, align=1, stats=False, expand=expand, seed=5)
    b.num_ranks = 1   # the handle's layout is a rank alone's
    g = torch.Generator().manual_seed(4)
    b.calls += 1
    gpu_dispatch.run_dispatch(
        b, torch.randn(T, H, generator=g).to(torch.bfloat16), None, None, None, num_experts=None,
        num_max_tokens_per_rank=M, expert_alignment=None, num_sms=4, handle=handle, do_handle_copy=True,
        do_cpu_sync=sync, do_expand=expand, do_zero_padding=True, use_tma_aligned_col_major_sf=False,
        cumulative_local_expert_recv_stats=None)
    b.calls += 1
    gpu_combine.run_combine(b, torch.randn(handle.num_recv_rows, H, generator=g).to(torch.bfloat16), handle,
                            None, (), num_sms=4)
    names = [name for name, _, _ in log]
    assert names == FRESH + [modules.CACHED_DISPATCH_KERNEL, modules.COMBINE_KERNEL]
    shapes = [(p.name, p.block, p.cooperative) for p in prepared]
    assert shapes == [(modules.NOTIFY_KERNEL, 32 * dispatch_plan.NOTIFY_WARPS, True),
                      (modules.DISPATCH_KERNEL, modules.THREADS, True),
                      (modules.CACHED_DISPATCH_KERNEL, modules.THREADS, True),
                      (modules.COMBINE_KERNEL, modules.THREADS, True)]
    assert [grid for _, grid, _ in log[1:]] == [4, 4, 4]
    del keep


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_calls_num_qps_picks_the_gin_contexts_of_its_data_kernel(hybrid):
    """Across nodes a call's ``num_qps`` is the number of GIN contexts its data kernel uses, at most
    the contexts the transport has, 0 all of them (whatever the SMs); a copy of the transport's
    arguments per count (kept), with every other field the same; the count is part of the call's
    tag, so that ranks that disagree are told so. On one node (no GIN) the transport's arguments
    are used as they are."""
    from deep_ep.backends.gpu.dispatch_plan import dispatch_tag
    from deep_ep.comm.gin import GinHybridTransportArgs, GinTransportArgs
    from deep_ep.comm.transport import Transport

    class Fake(Transport):
        kernel_args = window_tensor = host_barrier = first_failed_rank = destroy = None
    base = (GinHybridTransportArgs if hybrid else GinTransportArgs)(
        peers=0x100, rank=1, num_ranks=4, gin=0x200, recv_offset=64, half_bytes=4096, stage_offset=8192,
        max_put_bytes=512, num_contexts=3, node_ranks=2)
    transport = Fake()
    transport.kernel_args = lambda: base
    b = GPUBackend.__new__(GPUBackend)
    b.transport = transport
    assert transport.gin_contexts() == 3
    assert b.transport_args_for(5) is base and b.transport_args_for(0) is base   # all of them
    one = b.transport_args_for(1)
    assert one is not base and one.num_contexts == 1 and base.num_contexts == 3
    assert b.transport_args_for(1) is one and type(one) is type(base)          # kept per count
    offset = GinTransportArgs.num_contexts.offset
    assert bytes(one)[:offset] == bytes(base)[:offset] and bytes(one)[offset + 4:] == bytes(base)[offset + 4:]
    assert b.transport_args_for(2).num_contexts == 2
    tags = {dispatch_tag(1, 7168, 0, 8, False, 1, 256, True, True, 0, n).fingerprint for n in (0, 1, 2, 3)}
    assert len(tags) == 4
    one_node = ctypes.c_int(7)
    transport.kernel_args = lambda: one_node
    assert transport.gin_contexts() == 0 and b.transport_args_for(1) is one_node   # nothing to pick


def test_a_gpu_error_recorded_on_one_rank_raises_at_the_barrier_on_every_rank():
    """`GPUBackend.barrier`: the ranks agree on whether any kernel recorded an error (through the
    emulated transport's `first_failed_rank`, ranks in threads), and every rank raises, the one
    that recorded it its own error, the others naming it; a clean round passes on every rank."""
    import threading
    from deep_ep.comm.emulated import EmulatedTransport
    num_ranks = 3
    windows = types.SimpleNamespace(num_ranks=num_ranks, num_bytes=64, device=torch.device("cpu"),
                                    peers=torch.zeros(num_ranks, dtype=torch.int64), ok_words=[True] * num_ranks)
    barrier = threading.Barrier(num_ranks, timeout=30)
    errors = {1: (2, 1, 0, 3)}   # rank 1's record: (code, rank, peer, phase)
    outcome = {}

    def rank_thread(rank):
        b = GPUBackend.__new__(GPUBackend)
        b.transport = EmulatedTransport(windows, rank, barrier.wait)
        b.rank, b.num_ranks, b.broken = rank, num_ranks, None
        b.drain = lambda: None
        b.read_error = lambda: errors.get(rank)

        def own(err):
            b.broken = "own"
            raise TimeoutError(f"own error {err}")
        b._raise = own
        try:
            b.barrier()
            outcome[rank] = ("passed", b.broken)
        except Exception as exc:   # noqa: BLE001 - what each rank raised is the result
            outcome[rank] = (str(exc), b.broken)
        errors.pop(1, None) if rank == 1 else None
        barrier.wait()
        try:
            b.broken = None
            b.barrier()
            outcome[rank] += ("then passed",)
        except Exception as exc:   # noqa: BLE001
            outcome[rank] += (str(exc),)

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in range(num_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert outcome[1] == ("own error (2, 1, 0, 3)", "own", "then passed")
    for rank in (0, 2):
        message, broken, after = outcome[rank]
        assert f"rank {rank} of 3): barrier: rank 1 met a GPU error" in message, message
        assert broken == "rank 1 met a GPU error" and after == "then passed"

    # a rank whose wait itself fails (a sticky CUDA error) raises that, and the others are told
    outcome.clear()

    def failing_drain_thread(rank):
        b = GPUBackend.__new__(GPUBackend)
        b.transport = EmulatedTransport(windows, rank, barrier.wait)
        b.rank, b.num_ranks, b.broken = rank, num_ranks, None
        b.drain = (lambda: (_ for _ in ()).throw(RuntimeError("sticky"))) if rank == 2 else (lambda: None)
        b.read_error = lambda: None
        try:
            b.barrier()
            outcome[rank] = "passed"
        except Exception as exc:   # noqa: BLE001
            outcome[rank] = str(exc)

    threads = [threading.Thread(target=failing_drain_thread, args=(rank,)) for rank in range(num_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert outcome[2] == "sticky" and all("barrier: rank 2 met a GPU error" in outcome[rank] for rank in (0, 1)), outcome


def test_a_data_wait_flushes_remote_writes_only_where_the_device_can(monkeypatch):
    """`deep_ep.cuda.driver.stream_wait_u32` adds CU_STREAM_WAIT_VALUE_FLUSH to its GEQ wait when
    asked; `can_flush_remote_writes` reads the device attribute once per device (a fake driver)."""
    from cuda.bindings import driver as real
    from deep_ep.cuda import driver as cuda_driver
    waits, queries = [], []
    fake = types.SimpleNamespace(
        CUstreamWaitValue_flags=real.CUstreamWaitValue_flags, CUdevice_attribute=real.CUdevice_attribute,
        cuStreamWaitValue32=lambda stream, address, value, flags: waits.append(flags) or (0,),
        cuDeviceGet=lambda index: (0, index),
        cuDeviceGetAttribute=lambda attribute, device: queries.append((attribute, device)) or (0, int(device == 1)))
    monkeypatch.setattr(cuda_driver, "driver", lambda: fake)
    monkeypatch.setattr(cuda_driver, "_can_flush", {})
    assert cuda_driver.stream_wait_u32(7, 0x1000, 3) == 0 and cuda_driver.stream_wait_u32(7, 0x1000, 3, True) == 0
    geq, flush = int(real.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), \
        int(real.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_FLUSH)
    assert waits == [geq, geq | flush]
    assert cuda_driver.can_flush_remote_writes(1) and not cuda_driver.can_flush_remote_writes(0)
    assert cuda_driver.can_flush_remote_writes(1) and len(queries) == 2   # cached per device
    assert queries[0][0] == real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES
