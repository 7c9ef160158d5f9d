"""Checks run once per call signature (`deep_ep.call_plans`): a call whose signature was validated
before gets exactly the outcome of the full checks (`checks.validate_dispatch` / `validate_combine`),
the same result or the same exception, with what may change between calls of one signature checked
again (devices, contiguity, rows, a handle's routing tensor, CPU expert ids).

On CPU tensors with the GPU backend's per-call host code and stand-in modules (as in
tests/test_gpu_host_path.py), for handles of a real dispatch."""
import dataclasses
import enum
import types

import numpy as np
import pytest
import torch

import test_gpu_host_path as host_path
from deep_ep import call_plans, checks
from deep_ep.handle import EPHandle

H, K, E, M = host_path.H, host_path.K, host_path.E, host_path.M
FP8 = torch.float8_e4m3fn


class _SubHandle(EPHandle):
    pass


class _Count(enum.IntEnum):
    FOUR = 4


def _buffer(b, **over):
    """What the checks read of an `ElasticBuffer` over the stand-in backend ``b``, with its plans."""
    values = dict(device=torch.device("cpu"), config=b.config, num_ranks=1, buffer_id=0, rank_idx=0,
                  num_allocated_qps=0, _plans={})
    values.update(over)
    return types.SimpleNamespace(**values)


def _public(b):
    """An `ElasticBuffer` over the stand-in backend ``b``, without streams."""
    from deep_ep.buffer import ElasticBuffer
    from deep_ep.primitives import WindowUse
    pub = ElasticBuffer.__new__(ElasticBuffer)
    pub.__dict__.update(_backend=b, _destroyed=False, buffer_id=0, num_ranks=1, rank_idx=0, config=b.config,
                        allow_multiple_reduction=True, num_allocated_qps=0, _plans={}, _window_use=WindowUse())
    b.get_comm_stream = lambda: None
    return pub


def _same(t):
    """A returned tensor as a comparable value, by layout and values (strided FP8 scales come back as
    a contiguous copy from both paths, each a new tensor, so identity cannot compare them)."""
    if t is None:
        return None
    return t.dtype, tuple(t.shape), t.stride(), tuple(t.flatten().tolist())


def _outcome(fn):
    """``fn()``'s result as comparable values (`_same`), or its exception's type and message (without
    the method's name that the plans put first, which the bare checks do not)."""
    try:
        result = fn()
    except (TypeError, ValueError) as exc:
        message = str(exc)
        for method in ("ElasticBuffer.dispatch: ", "ElasticBuffer.combine: "):
            message = message[len(method):] if message.startswith(method) else message
        return type(exc), message
    *tensors, plan = result
    return [_same(t) for t in (tensors[-1] if len(tensors) == 1 else tensors)], plan


def _counting(monkeypatch):
    """How often the full checks ran, by name."""
    runs = {"validate_dispatch": 0, "validate_combine": 0}
    for name in runs:
        real = getattr(checks, name)

        def counted(*args, _real=real, _name=name):
            runs[_name] += 1
            return _real(*args)
        monkeypatch.setattr(checks, name, counted)
    return runs


def _routing(T, g):
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(T)]
    return torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)


def _bf16(*shape, g):
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _handle(b, T, seed, **options):
    call = dict(weights=True, sync=True, align=1, stats=False)
    call.update(options)
    (_, _, _, handle), keep = host_path._dispatch(b, T, **call, seed=seed)
    return handle, keep


_DISPATCH_OPTIONS = dict(num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0,
                         previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream=False,
                         allocate_on_comm_stream=False, do_handle_copy=True, do_cpu_sync=None, do_expand=False,
                         do_zero_padding=False, use_tma_aligned_col_major_sf=False)
_COMBINE_OPTIONS = dict(num_sms=0, num_qps=0, previous_event=None, previous_event_before_epilogue=None,
                        async_with_compute_stream=False, allocate_on_comm_stream=False, apply_dispatch_weights=False)


def _dispatch_args(x, topk_idx=None, topk_weights=None, stats=None, num_experts=None, handle=None, **options):
    """`checks.validate_dispatch`'s arguments after ``buf``: the defaults, then ``options``."""
    o = {**_DISPATCH_OPTIONS, **options}
    return (x, topk_idx, topk_weights, stats, num_experts, o["num_max_tokens_per_rank"], o["expert_alignment"],
            o["num_sms"], o["num_qps"], o["previous_event"], o["previous_event_before_epilogue"],
            o["async_with_compute_stream"], o["allocate_on_comm_stream"], handle, o["do_handle_copy"],
            o["do_cpu_sync"], o["do_expand"], o["do_zero_padding"], o["use_tma_aligned_col_major_sf"])


def _combine_args(x, handle, topk_weights=None, bias=None, **options):
    o = {**_COMBINE_OPTIONS, **options}
    return (x, handle, topk_weights, bias, o["num_sms"], o["num_qps"], o["previous_event"],
            o["previous_event_before_epilogue"], o["async_with_compute_stream"], o["allocate_on_comm_stream"],
            o["apply_dispatch_weights"])


def _assert_same_outcomes(buf, cases, planned, full, args_of) -> int:
    """Every case (name -> keyword arguments) has the full checks' outcome through the plans; returns
    how many were valid."""
    valid = 0
    for name, kwargs in cases.items():
        args = args_of(**kwargs)
        got, want = _outcome(lambda: planned(buf, *args)), _outcome(lambda: full(buf, *args))
        assert got == want, (name, got, want)
        valid += not isinstance(want[0], type)
    return valid


def _fp8(T, g, hidden=H):
    return torch.randn(T, hidden, generator=g).to(FP8), torch.rand(T, hidden // 128, generator=g)


def _fresh_cases(T, g):
    """Fresh dispatches that share a few signatures (every option but one at a valid value)."""
    idx, w, x = _routing(T, g), torch.rand(T, K, generator=g), _bf16(T, H, g=g)
    data8, sf8 = _fp8(T, g)
    stats = torch.zeros(E, dtype=torch.int32)
    base = dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E)
    meta = dict(device="meta")
    bad_id, low_id = idx.clone(), idx.clone()
    bad_id[T // 2, 1], low_id[1, 0] = E, -2
    more = T + 1
    changes = {
        "valid": {}, "other tokens": dict(x=_bf16(T - 3, H, g=g), topk_idx=idx[3:].contiguous(),
                                          topk_weights=w[3:].contiguous()),
        "no tokens": dict(x=_bf16(0, H, g=g), topk_idx=idx[:0], topk_weights=w[:0]),
        "x one row more": dict(x=_bf16(more, H, g=g)), "x strided": dict(x=_bf16(H, T, g=g).t()),
        "x on meta": dict(x=torch.empty(T, H, dtype=torch.bfloat16, **meta)),
        "x float32": dict(x=torch.randn(T, H, generator=g)), "x wider": dict(x=_bf16(T, H + 8, g=g)),
        "x 3-D": dict(x=_bf16(1, T, H, g=g)), "x a list": dict(x=x.tolist()),
        "x fp8": dict(x=(data8, sf8)), "x fp8 list": dict(x=[data8, sf8]),
        "x fp8 ue8m0": dict(x=(data8, torch.ones(T, -(-H // 512), dtype=torch.int32))),
        "x fp8 sf one row more": dict(x=(data8, torch.rand(more, H // 128, generator=g))),
        "x fp8 sf strided": dict(x=(data8, torch.rand(H // 128, T, generator=g).t())),
        "x fp8 sf float64": dict(x=(data8, sf8.double())), "x fp8 three items": dict(x=(data8, sf8, sf8)),
        "x fp8 data on meta": dict(x=(torch.empty(T, H, dtype=FP8, **meta), sf8)),
        "x fp8 bare": dict(x=data8),
        "idx one row more": dict(topk_idx=_routing(more, g)), "idx strided": dict(topk_idx=idx.t().contiguous().t()),
        "idx on meta": dict(topk_idx=torch.empty(T, K, dtype=torch.int64, **meta)),
        "idx int32": dict(topk_idx=idx.int()), "idx id E": dict(topk_idx=bad_id), "idx id -2": dict(topk_idx=low_id),
        "idx top-k + 1": dict(topk_idx=torch.cat([idx, idx[:, :1]], 1), topk_weights=None),
        "idx 1-D": dict(topk_idx=idx[:, 0].contiguous()), "idx missing": dict(topk_idx=None),
        "w none": dict(topk_weights=None), "w one row more": dict(topk_weights=torch.rand(more, K, generator=g)),
        "w strided": dict(topk_weights=torch.rand(K, T, generator=g).t()),
        "w on meta": dict(topk_weights=torch.empty(T, K, **meta)), "w float64": dict(topk_weights=w.double()),
        "stats": dict(stats=stats), "stats strided": dict(stats=torch.zeros(2 * E, dtype=torch.int32)[::2]),
        "stats on meta": dict(stats=torch.empty(E, dtype=torch.int32, **meta)),
        "stats int64": dict(stats=stats.long()), "stats a list": dict(stats=[0] * E),
        "experts 2E": dict(num_experts=2 * E), "experts float": dict(num_experts=float(E)),
        "experts True": dict(num_experts=True), "experts missing": dict(num_experts=None),
        "no cpu sync": dict(do_cpu_sync=False), "no cpu sync as 0": dict(do_cpu_sync=0),
        "cpu sync as numpy": dict(do_cpu_sync=np.True_), "cpu sync 2": dict(do_cpu_sync=2),
        "M given": dict(num_max_tokens_per_rank=T), "M below T": dict(num_max_tokens_per_rank=T - 1),
        "M above the buffer's": dict(num_max_tokens_per_rank=M + 1), "M float": dict(num_max_tokens_per_rank=1.0 * T),
        "alignment 4": dict(expert_alignment=4), "alignment 0": dict(expert_alignment=0),
        "alignment numpy": dict(expert_alignment=np.int64(4)), "alignment enum": dict(expert_alignment=_Count.FOUR),
        "expanded": dict(do_expand=True, do_zero_padding=True), "expanded as ints": dict(do_expand=1, do_zero_padding=1),
        "copy flag tensor": dict(do_handle_copy=torch.tensor(False)), "copy flag str": dict(do_handle_copy="no"),
        "num_sms 4": dict(num_sms=4), "num_sms True": dict(num_sms=True), "num_qps 1": dict(num_qps=1),
        "previous event": dict(previous_event=object()), "async": dict(async_with_compute_stream=1),
        "with a handle": dict(handle=object()),
    }
    return {name: {**base, **change} for name, change in changes.items()}


def test_a_warm_fresh_dispatch_signature_has_the_outcome_of_the_full_checks():
    b = host_path._backend([])
    g = torch.Generator().manual_seed(11)
    T = 12
    cases = _fresh_cases(T, g)
    # (buffer, how many cases are valid): two ranks want other statistics; without M a dispatch
    # without CPU sync is refused and M above 64 is taken; M = 8 takes the dispatch of no tokens only
    for buf, expected in ((_buffer(b), 21), (_buffer(b, num_ranks=2), 20),
                          (_buffer(b, config=dataclasses.replace(b.config, num_max_tokens_per_rank=0)), 20),
                          (_buffer(b, config=dataclasses.replace(b.config, num_max_tokens_per_rank=8)), 1)):
        for case in cases.values():   # warm: every valid signature of the table gets its plan
            try:
                call_plans.dispatch_plan(buf, *_dispatch_args(**case))
            except (TypeError, ValueError):
                pass
        assert buf._plans
        valid = _assert_same_outcomes(buf, cases, call_plans.dispatch_plan, checks.validate_dispatch, _dispatch_args)
        assert valid == expected


def test_a_warm_cached_dispatch_signature_has_the_outcome_of_the_full_checks():
    b = host_path._backend([])
    g = torch.Generator().manual_seed(8)
    handle, _keep = _handle(b, 12, seed=3)
    other, _keep_other = _handle(b, 12, seed=4)           # the same layout, another routing
    fewer, _keep_fewer = _handle(b, 9, seed=5)            # the same layout, fewer tokens
    expanded, _keep_expanded = _handle(b, 12, seed=6, expand=True, align=2)
    T = handle.num_tokens
    sub = _SubHandle.__new__(_SubHandle)
    sub.__dict__.update({k: v for k, v in vars(handle).items() if k != "_launch_memo"})
    resized = dataclasses.replace(handle, topk_idx=handle.topk_idx.clone())
    resized.topk_idx.set_(resized.topk_idx[:T - 2].clone())   # in place: the handle's fields stay
    x, w = _bf16(T, H, g=g), torch.rand(T, K, generator=g)
    base = dict(x=x, topk_weights=w, handle=handle)
    changes = {
        "valid": {}, "another handle": dict(handle=other), "fewer tokens": dict(handle=fewer),
        "fewer tokens, x too": dict(handle=fewer, x=_bf16(9, H, g=g), topk_weights=w[:9].contiguous()),
        "subclass": dict(handle=sub), "resized routing": dict(handle=resized),
        "other buffer": dict(handle=dataclasses.replace(handle, buffer_id=7)),
        "other rank": dict(handle=dataclasses.replace(handle, rank=1)),
        "other hidden": dict(handle=dataclasses.replace(handle, hidden=H * 2)),
        "not a handle": dict(handle=types.SimpleNamespace(**vars(handle))),
        "with topk_idx": dict(topk_idx=handle.topk_idx),
        "x one row more": dict(x=_bf16(T + 1, H, g=g)), "x strided": dict(x=_bf16(H, T, g=g).t()),
        "x on meta": dict(x=torch.empty(T, H, dtype=torch.bfloat16, device="meta")),
        "x fp8": dict(x=_fp8(T, g)), "x fp8 sf one row less": dict(x=(_fp8(T, g)[0], torch.rand(T - 1, H // 128))),
        "w none": dict(topk_weights=None), "w one column more": dict(topk_weights=torch.rand(T, K + 1, generator=g)),
        "w one row less": dict(topk_weights=w[1:].contiguous()), "w strided": dict(topk_weights=torch.rand(K, T).t()),
        "experts given": dict(num_experts=E), "experts other": dict(num_experts=2 * E),
        "M given": dict(num_max_tokens_per_rank=M), "M other": dict(num_max_tokens_per_rank=M - 1),
        "alignment given": dict(expert_alignment=1), "alignment other": dict(expert_alignment=2),
        "expanded on a flat handle": dict(do_expand=True), "expanded handle": dict(handle=expanded),
        "expanded handle, expanded": dict(handle=expanded, do_expand=1, do_zero_padding=True),
        "cpu sync": dict(do_cpu_sync=True), "cpu sync as 1": dict(do_cpu_sync=1), "no cpu sync": dict(do_cpu_sync=0),
        "zero padding": dict(do_zero_padding=True), "col-major sf": dict(x=_fp8(T, g), use_tma_aligned_col_major_sf=1),
    }
    cases = {name: {**base, **change} for name, change in changes.items()}
    buf = _buffer(b)
    for case in cases.values():
        try:
            call_plans.dispatch_plan(buf, *_dispatch_args(**case))
        except (TypeError, ValueError):
            pass
    valid = _assert_same_outcomes(buf, cases, call_plans.dispatch_plan, checks.validate_dispatch, _dispatch_args)
    assert valid == 14


@pytest.mark.parametrize("expand", [False, True])
def test_a_warm_combine_signature_has_the_outcome_of_the_full_checks(expand):
    b = host_path._backend([])
    g = torch.Generator().manual_seed(9)
    # expanded: without CPU sync, rows for the worst case (the stand-in reports no expanded rows)
    layout = dict(expand=expand, align=2, sync=not expand)
    handle, _keep = _handle(b, 12, seed=3, **layout)
    fewer, _keep_fewer = _handle(b, 9 + expand, seed=5, **layout)
    unweighted, _keep_unweighted = _handle(b, 12, seed=7, weights=False, **layout)
    rows, T = handle.num_recv_rows, handle.num_tokens
    y = _bf16(rows, H, g=g)
    w_shape = (rows,) if expand else (rows, K)
    w = torch.rand(*w_shape, generator=g)
    bias = _bf16(T, H, g=g)
    base = dict(x=y, handle=handle)
    changes = {
        "valid": {}, "weights": dict(topk_weights=w), "fewer rows": dict(handle=fewer),
        "fewer rows, x too": dict(handle=fewer, x=_bf16(fewer.num_recv_rows, H, g=g)),
        "x one row more": dict(x=_bf16(rows + 1, H, g=g)), "x strided": dict(x=_bf16(H, rows, g=g).t()),
        "x on meta": dict(x=torch.empty(rows, H, dtype=torch.bfloat16, device="meta")),
        "x float32": dict(x=y.float()), "x fp8 tuple": dict(x=_fp8(rows, g)), "x wider": dict(x=_bf16(rows, 2 * H, g=g)),
        "w one row more": dict(topk_weights=torch.rand(rows + 1, *w_shape[1:], generator=g)),
        "w strided": dict(topk_weights=torch.rand(rows, 2, generator=g)[:, 0] if expand
                          else torch.rand(K, rows, generator=g).t()),
        "w float64": dict(topk_weights=w.double()), "w 3-D": dict(topk_weights=w.reshape(1, *w_shape)),
        "bias": dict(bias=bias), "bias pair": dict(bias=(bias, bias)), "bias list with None": dict(bias=[None, bias]),
        "bias one row less": dict(bias=bias[1:].contiguous()), "bias strided": dict(bias=_bf16(H, T, g=g).t()),
        "bias on meta": dict(bias=torch.empty(T, H, dtype=torch.bfloat16, device="meta")),
        "bias float32": dict(bias=bias.float()), "three biases": dict(bias=(bias, bias, bias)),
        "bias an int": dict(bias=3), "second bias one row less": dict(bias=(bias, bias[1:].contiguous())),
        "apply weights": dict(apply_dispatch_weights=1), "apply weights, unweighted": dict(
            handle=unweighted, apply_dispatch_weights=True), "apply weights 2": dict(apply_dispatch_weights=2),
        "other buffer": dict(handle=dataclasses.replace(handle, buffer_id=7)),
        "not a handle": dict(handle=None), "num_sms 4": dict(num_sms=4), "num_sms 4.0": dict(num_sms=4.0),
        "num_qps 1": dict(num_qps=1), "allocate as 1": dict(allocate_on_comm_stream=1),
    }
    cases = {name: {**base, **change} for name, change in changes.items()}
    # valid: no options, weights, three forms of bias, num_sms, allocation, the same rows of another
    # handle; expanded: also the fused weighting, both handles' worst-case rows, and the reduced
    # weights with multiple reduction only
    for multiple, expected in ((True, 10 if expand else 8), (False, 9 if expand else 8)):
        buf = _buffer(b, config=dataclasses.replace(b.config, allow_multiple_reduction=multiple))
        for case in cases.values():
            try:
                call_plans.combine_plan(buf, *_combine_args(**case))
            except (TypeError, ValueError):
                pass
        valid = _assert_same_outcomes(buf, cases, call_plans.combine_plan, checks.validate_combine, _combine_args)
        assert valid == expected


def test_a_signature_is_checked_once_whatever_its_token_count(monkeypatch):
    """Public calls: a fresh dispatch, a cached dispatch and a combine run the full checks once per
    signature; the token count, the handle (of the same layout) and the routing may change."""
    b = host_path._backend([])
    pub = _public(b)
    runs = _counting(monkeypatch)
    g = torch.Generator().manual_seed(10)
    handles = []
    for T in (12, 7, 12, 0):
        b.last_tokens = T
        x, idx, w = _bf16(T, H, g=g), _routing(T, g), torch.rand(T, K, generator=g)
        recv_x, _, _, handle, _ = pub.dispatch(x, idx, w, num_experts=E)
        assert recv_x.shape == (T, H) and handle.num_tokens == T
        handles.append((handle, x, w))
    assert runs == {"validate_dispatch": 1, "validate_combine": 0}
    for handle, x, w in handles:
        assert pub.dispatch(x, topk_weights=w, handle=handle)[3] is handle
        combined = pub.combine(_bf16(handle.num_recv_rows, H, g=g), handle)[0]
        assert combined.shape == (handle.num_tokens, H)
    assert runs == {"validate_dispatch": 2, "validate_combine": 1}
    assert len(pub._plans) == 3


def test_flags_given_as_ints_take_the_full_checks_and_reach_the_backend_as_bools(monkeypatch):
    """A flag given as an int 0 / 1, a numpy bool or a torch bool scalar is accepted as its bool: such
    calls take the full checks every time (only real bools make a signature), and the backend gets
    bools."""
    b = host_path._backend([])
    pub = _public(b)
    runs = _counting(monkeypatch)
    seen = []
    real = b.dispatch
    monkeypatch.setattr(b, "dispatch", lambda *a, **k: seen.append(k) or real(*a, **k))
    g = torch.Generator().manual_seed(12)
    T = 16
    x, idx, w = _bf16(T, H, g=g), _routing(T, g), torch.rand(T, K, generator=g)
    flag_sets = [dict(do_cpu_sync=True, do_expand=True, do_zero_padding=False, do_handle_copy=True),
                 dict(do_cpu_sync=1, do_expand=1, do_zero_padding=0, do_handle_copy=1),
                 dict(do_cpu_sync=np.True_, do_expand=np.bool_(True), do_zero_padding=np.int64(0),
                      do_handle_copy=torch.tensor(True)),
                 dict(do_cpu_sync=torch.tensor(1), do_expand=torch.tensor([True]), do_zero_padding=False,
                      do_handle_copy=True, async_with_compute_stream=0, allocate_on_comm_stream=np.False_)]
    for flags in flag_sets:
        b.last_tokens = T
        pub.dispatch(x, idx, w, num_experts=E, **flags)
    assert runs["validate_dispatch"] == len(flag_sets)
    for kwargs in seen:
        assert {name: kwargs[name] for name in ("do_cpu_sync", "do_expand", "do_zero_padding", "do_handle_copy")} \
            == dict(do_cpu_sync=True, do_expand=True, do_zero_padding=False, do_handle_copy=True)
        assert all(type(kwargs[name]) is bool for name in ("do_cpu_sync", "do_expand", "do_zero_padding",
                                                           "do_handle_copy", "use_tma_aligned_col_major_sf"))


def test_values_of_other_types_never_take_a_plan(monkeypatch):
    """Values equal to a planned int (True, 4.0) still fail the full checks; an int subclass passes
    them, every call."""
    b = host_path._backend([])
    pub = _public(b)
    g = torch.Generator().manual_seed(13)
    T = 8
    x, idx = _bf16(T, H, g=g), _routing(T, g)
    b.last_tokens = T
    pub.dispatch(x, idx, num_experts=E, num_sms=1, expert_alignment=4)
    for options, message in ((dict(num_sms=True), "num_sms must be an int"),
                             (dict(num_sms=1.0), "num_sms must be an int"),
                             (dict(num_experts=float(E)), "num_experts must be an int"),
                             (dict(expert_alignment=np.int64(4)), "expert_alignment must be an int")):
        with pytest.raises(TypeError, match=message):
            pub.dispatch(x, idx, **{"num_experts": E, "num_sms": 1, "expert_alignment": 4, **options})
    runs = _counting(monkeypatch)
    for _ in range(2):
        b.last_tokens = T
        pub.dispatch(x, idx, num_experts=E, num_sms=1, expert_alignment=_Count.FOUR)
    assert runs["validate_dispatch"] == 2


def test_what_may_change_between_calls_is_checked_every_call():
    """After a signature's plan: the expert ids of CPU routing, a handle's fields and its routing
    tensor changed in place, the token count against ``num_max_tokens_per_rank``."""
    b = host_path._backend([])
    pub = _public(b)
    g = torch.Generator().manual_seed(14)
    T = 10
    x, idx = _bf16(T, H, g=g), _routing(T, g)
    b.last_tokens = T
    handle = pub.dispatch(x, idx, num_experts=E)[3]
    bad = idx.clone()
    bad[3, 2] = E + 5
    with pytest.raises(ValueError, match=r"^ElasticBuffer.dispatch: .*expert id 21 at \[3, 2\]"):
        pub.dispatch(x, bad, num_experts=E)      # the method's name first, from the plan's path too
    over = _bf16(M + 1, H, g=g)
    with pytest.raises(ValueError, match="65 tokens, more than num_max_tokens_per_rank=64"):
        pub.dispatch(over, _routing(M + 1, g), num_experts=E)
    pub.dispatch(x, topk_weights=None, handle=handle)
    pub.combine(_bf16(handle.num_recv_rows, H, g=g), handle)
    handle.hidden = 2 * H
    with pytest.raises(ValueError, match=r"x must have the handle's shape \[10, 512\]"):
        pub.dispatch(x, handle=handle)
    with pytest.raises(ValueError, match=r"^ElasticBuffer.combine: x must have shape \[10, 512\]"):
        pub.combine(_bf16(handle.num_recv_rows, H, g=g), handle)
    handle.hidden = H
    handle.topk_idx.set_(handle.topk_idx[:T - 1].clone())
    with pytest.raises(ValueError, match=r"x must have the handle's shape \[9, 256\]"):
        pub.dispatch(x, handle=handle)
    with pytest.raises(ValueError, match=r"bias\[0\] must have shape \[9, 256\]"):
        pub.combine(_bf16(handle.num_recv_rows, H, g=g), handle, bias=x)


def test_the_plans_are_bounded(monkeypatch):
    """A buffer keeps at most `call_plans.MAX_PLANS` signatures, dropping the oldest first."""
    b = host_path._backend([])
    buf = _buffer(b)
    g = torch.Generator().manual_seed(15)
    T = 4
    x, idx = _bf16(T, H, g=g), _routing(T, g)
    last = call_plans.MAX_PLANS + 9
    for num_sms in range(last + 1):
        call_plans.dispatch_plan(buf, *_dispatch_args(x, idx, num_experts=E, num_sms=num_sms))
    assert len(buf._plans) == call_plans.MAX_PLANS
    runs = _counting(monkeypatch)
    call_plans.dispatch_plan(buf, *_dispatch_args(x, idx, num_experts=E, num_sms=last))
    assert runs["validate_dispatch"] == 0
    call_plans.dispatch_plan(buf, *_dispatch_args(x, idx, num_experts=E, num_sms=9))
    assert runs["validate_dispatch"] == 1
