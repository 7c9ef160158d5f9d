"""The short path of the most common calls (`deep_ep.checks.plain_cached_dispatch_ok`,
`plain_fresh_dispatch_ok`, `plain_combine_ok`): it accepts exactly the valid calls, so that every call
it takes would have passed the full checks (`validate_dispatch`, `validate_combine`), and every
invalid one still gets the full checks' error. Checked on CPU tensors with a GPU dispatch's handle (the backend's per-call
host code with stand-in modules, as in tests/test_gpu_host_path.py) and with the reference's."""
import dataclasses
import types

import pytest
import torch

import test_gpu_host_path as host_path
from deep_ep import checks
from deep_ep.handle import EPHandle

H, K = host_path.H, host_path.K


class _SubHandle(EPHandle):
    pass


def _buffer(b, **over):
    values = dict(device=torch.device("cpu"), config=b.config, num_ranks=1, buffer_id=0, rank_idx=0,
                  num_allocated_qps=0, allow_multiple_reduction=True)
    values.update(over)
    return types.SimpleNamespace(**values)


def _public(b):
    """An `ElasticBuffer` over the stand-in backend ``b``, without streams (its public calls run the
    checks and the backend's code on CPU tensors)."""
    from deep_ep.buffer import ElasticBuffer
    pub = ElasticBuffer.__new__(ElasticBuffer)
    pub.__dict__.update(_backend=b, _destroyed=False, buffer_id=0, num_ranks=1, rank_idx=0, config=b.config,
                        allow_multiple_reduction=True, num_allocated_qps=0)
    b.get_comm_stream = lambda: None
    return pub


def _full_ok(fn) -> bool:
    try:
        fn()
    except (TypeError, ValueError):
        return False
    return True


def _handles(b):
    (_, _, _, handle), keep = host_path._dispatch(b, **host_path.CALLS[0], seed=3)
    sub = _SubHandle.__new__(_SubHandle)
    sub.__dict__.update(vars(handle))
    return handle, [("other buffer", dataclasses.replace(handle, buffer_id=7)),
                    ("other rank", dataclasses.replace(handle, rank=1)),
                    ("other ranks", dataclasses.replace(handle, num_ranks=2)),
                    ("subclass", sub), ("not a handle", types.SimpleNamespace(**vars(handle)))], keep


def _inputs(T, rows, g):
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)   # noqa: E731
    return {"x": bf(rows, H), "x float32": torch.randn(rows, H, generator=g), "x wider": bf(rows, H + 8),
            "x one row more": bf(rows + 1, H), "x strided": bf(H, rows).t(), "x 3-D": bf(1, rows, H),
            "x a list": bf(rows, H).tolist(), "x on meta": torch.empty(rows, H, dtype=torch.bfloat16, device="meta"),
            **_fp8_inputs(rows, g)}


def _fp8_inputs(rows, g):
    """FP8 forms of ``x``: (e4m3 data, scale factors), valid and not."""
    e4m3 = torch.randn(rows, H, generator=g).to(torch.float8_e4m3fn)
    f32, ue8m0 = torch.rand(rows, H // 128, generator=g), torch.ones(rows, -(-H // 512), dtype=torch.int32)
    return {"x fp8 tuple": (e4m3, f32), "x fp8 list": [e4m3, f32], "x fp8 ue8m0": (e4m3, ue8m0),
            "x fp8 sf float64": (e4m3, f32.double()), "x fp8 sf one column more": (e4m3, torch.rand(rows, H // 128 + 1)),
            "x fp8 sf strided": (e4m3, torch.rand(H // 128, rows, generator=g).t()),
            "x fp8 sf a list": (e4m3, f32.tolist()), "x fp8 sf one row more": (e4m3, torch.rand(rows + 1, H // 128)),
            "x fp8 e5m2": (e4m3.to(torch.float8_e5m2), f32), "x fp8 three items": (e4m3, f32, f32),
            "x fp8 data strided": (torch.randn(H, rows, generator=g).to(torch.float8_e4m3fn).t(), f32),
            "x fp8 bare": e4m3, "x fp8 bf16 data": (e4m3.to(torch.bfloat16), f32),
            "x fp8 wider": (torch.zeros(rows, H + 128, dtype=torch.float8_e4m3fn), torch.ones(rows, H // 128 + 1)),
            "x fp8 hidden 320": (torch.zeros(rows, 320, dtype=torch.float8_e4m3fn), torch.ones(rows, 2))}


def _weights(rows, g, expand=False):
    shape = (rows,) if expand else (rows, K)
    return {"none": None, "w": torch.rand(*shape, generator=g), "w float64": torch.rand(*shape, generator=g).double(),
            "w one column more": torch.rand(rows, K + 1, generator=g), "w strided": torch.rand(K, rows, generator=g).t(),
            "w a list": [0.5] * rows}


def test_the_short_path_takes_exactly_the_valid_cached_dispatches():
    b = host_path._backend([])
    handle, bad_handles, _keep = _handles(b)
    buf = _buffer(b)
    g = torch.Generator().manual_seed(8)
    T = handle.num_tokens
    cases = [(xn, x, wn, w, "handle", handle) for xn, x in _inputs(T, T, g).items()
             for wn, w in _weights(T, g).items()]
    cases += [("x", cases[0][1], "none", None, hn, h) for hn, h in bad_handles]
    cases = [c + (None, None, False) for c in cases]
    # the handle's sizes and layout given again (or other ones), which the short path takes too
    expanded = dataclasses.replace(handle, do_expand=True, num_expanded_tokens=handle.num_recv_tokens)
    M_, A_ = handle.num_max_tokens_per_rank, handle.expert_alignment
    cases += [("x", cases[0][1], "none", None, hn, h, m, a, e) for hn, h in (("handle", handle), ("expanded", expanded))
              for m in (None, M_, M_ + 1, 0, True, float(M_)) for a in (None, A_, A_ + 1, True, float(A_))
              for e in (False, True)]
    taken = 0
    for xn, x, wn, w, hn, h, m, a, e in cases:
        short = checks.plain_cached_dispatch_ok(buf, x, w, h, m, a, e)
        full = _full_ok(lambda: checks.validate_dispatch(buf, x, None, w, None, None, m, a, 0, 0, None, None,
                                                         False, False, h, True, None, e, False, False))
        if hn == "subclass" and full:
            full = False   # valid, but the short path takes EPHandle itself only
        assert short == full, (xn, wn, hn, m, a, e, short, full)
        taken += short
    # x (bf16, and FP8 as a tuple, a list and with packed scales) with and without weights; the sizes
    # None or the handle's
    assert taken == 4 * 2 + 2 * 2 * 2 + 2 * 2


def _routings(T, g):
    E = host_path.E
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    masked = idx.clone()
    masked[::3, 1:] = -1
    wide = torch.stack([torch.randperm(E, generator=g)[:K + 1] for _ in range(T)])
    bad, low = idx.clone(), idx.clone()
    bad[T // 2, 1] = E
    low[1, 0] = -2
    return {"idx": idx, "idx masked": masked, "idx int32": idx.int(), "idx one row more": torch.cat([idx, idx[:1]]),
            "idx top-k+1": wide, "idx no columns": idx[:, :0], "idx strided": idx.t().contiguous().t(),
            "idx 1-D": idx[:, 0].contiguous(), "idx a list": idx.tolist(), "idx id E": bad, "idx id -2": low,
            "idx on meta": torch.empty(T, K, dtype=torch.int64, device="meta")}


def test_the_short_path_takes_exactly_the_valid_fresh_dispatches():
    b = host_path._backend([])
    g = torch.Generator().manual_seed(11)
    T = 12
    xs = {n: x for n, x in _inputs(T, T, g).items() if n in ("x", "x float32", "x strided", "x one row more",
                                                               "x 3-D") or n.startswith("x fp8")}
    ws = {n: w for n, w in _weights(T, g).items() if n in ("none", "w", "w float64", "w strided")}
    routings = _routings(T, g)
    taken = 0
    for buf_name, buf in (("one rank", _buffer(b)), ("two ranks", _buffer(b, num_ranks=2)),
                          ("no M", _buffer(b, config=dataclasses.replace(b.config, num_max_tokens_per_rank=0))),
                          ("M 8", _buffer(b, config=dataclasses.replace(b.config, num_max_tokens_per_rank=8))),
                          ("hidden 128", _buffer(b, config=dataclasses.replace(b.config, hidden=128)))):
        cases = [(xn, x, "idx", routings["idx"], wn, w, E_, sync) for xn, x in xs.items() for wn, w in ws.items()
                 for E_ in (host_path.E,) for sync in (None, True, False)]
        cases += [("x", xs["x"], rn, r, "w", ws["w"], host_path.E, None) for rn, r in routings.items()]
        cases += [("x", xs["x"], "idx", routings["idx"], "none", None, E_, True)
                  for E_ in (None, 0, -1, 3, True, 16.0, 2 ** 31, host_path.E * 2)]
        cases = [c + (None, None, "none") for c in cases]
        # the per-call sizes, the alignment and the statistics, which the short path takes too
        stats = {"none": None, "stats": torch.zeros(host_path.E, dtype=torch.int32),
                 "stats int64": torch.zeros(host_path.E, dtype=torch.int64),
                 "stats one more": torch.zeros(host_path.E + 1, dtype=torch.int32),
                 "stats strided": torch.zeros(2 * host_path.E, dtype=torch.int32)[::2], "stats a list": [0] * 16}
        cases += [("x", xs["x"], "idx", routings["idx"], "w", ws["w"], host_path.E, sync, M_, A_, "none")
                  for sync in (None, False) for M_ in (None, 0, 8, 12, 11, 64, 65, -1, True, 12.0, 2 ** 31)
                  for A_ in (None, 1, 128, 0, -1, True, 2.0, 2 ** 31)]
        cases += [("x", xs["x"], "idx", routings["idx"], "w", ws["w"], host_path.E, None, None, None, sn)
                  for sn in stats]
        for xn, x, rn, r, wn, w, E_, sync, M_, A_, sn in cases:
            st = stats[sn]
            short = checks.plain_fresh_dispatch_ok(buf, x, r, w, E_, sync, M_, A_, st)
            full = _full_ok(lambda: checks.validate_dispatch(buf, x, r, w, st, E_, M_, A_, 0, 0, None, None,
                                                             False, False, None, True, sync, False, False, False))
            assert short == full, (buf_name, xn, rn, wn, E_, sync, M_, A_, sn, short, full)
            taken += short
    assert taken > 60


@pytest.mark.parametrize("expand", [False, True])
def test_the_short_path_takes_exactly_the_valid_combines(expand):
    b = host_path._backend([])
    handle, bad_handles, _keep = _handles(b)
    if expand:
        handle = dataclasses.replace(handle, do_expand=True, num_expanded_tokens=handle.num_recv_tokens)
    g = torch.Generator().manual_seed(9)
    rows = handle.num_recv_rows
    for multiple in (True, False):
        buf = _buffer(b, allow_multiple_reduction=multiple)
        cases = [(xn, x, wn, w, "handle", handle) for xn, x in _inputs(handle.num_tokens, rows, g).items()
                 for wn, w in _weights(rows, g, expand).items()]
        cases += [("x", cases[0][1], "none", None, hn, h) for hn, h in bad_handles]
        taken = 0
        for xn, x, wn, w, hn, h in cases:
            short = checks.plain_combine_ok(buf, x, h, w)
            full = _full_ok(lambda: checks.validate_combine(buf, x, h, w, None, 0, 0, None, None, False, False,
                                                            False))
            if hn == "subclass" and full:
                full = False
            assert short == full, (xn, wn, hn, multiple, short, full)
            taken += short
        assert taken == (2 if multiple or not expand else 1)


def test_the_public_calls_take_the_short_path_exactly_for_the_plain_calls(monkeypatch):
    """`ElasticBuffer.dispatch` / `combine` (over the stand-in backend, without streams): a plain call
    skips the full checks and reaches the backend's short entry point; a call with any option set
    goes through the full checks and the backend's general one. Both return the same things."""
    b = host_path._backend([])
    handle, _bad, _keep = _handles(b)
    pub = _public(b)
    seen = []
    for module, name in ((checks, "validate_dispatch"), (checks, "validate_combine")):
        monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), _n=name: seen.append(_n) or _f(*a))
    for name in ("cached_dispatch", "fresh_dispatch", "dispatch", "plain_combine", "combine"):
        monkeypatch.setattr(b, name, lambda *a, _f=getattr(b, name), _n=name, **k: seen.append(_n) or _f(*a, **k))
    g = torch.Generator().manual_seed(10)
    T, rows = handle.num_tokens, handle.num_recv_rows
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g)
    y = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    short = pub.dispatch(x, topk_weights=w, handle=handle, num_sms=4, do_cpu_sync=False)
    assert seen == ["cached_dispatch"]
    seen.clear()
    full = pub.dispatch(x, topk_weights=w, handle=handle, num_sms=4, allocate_on_comm_stream=True)
    assert seen == ["validate_dispatch", "dispatch"]
    for a, c in zip(short, full):
        assert type(a) is type(c) and (not isinstance(a, torch.Tensor) or a.shape == c.shape)
    assert short[3] is handle and full[3] is handle and short[1] is full[1]
    seen.clear()
    # FP8 rows (with row- or column-major scale factors) take the short path too
    x8 = (x.to(torch.float8_e4m3fn), torch.rand(T, H // 128, generator=g))
    for col_major in (False, True):
        short = pub.dispatch(x8, topk_weights=w, handle=handle, use_tma_aligned_col_major_sf=col_major)
        assert seen == ["cached_dispatch"], col_major
        seen.clear()
        assert short[0][0].dtype == torch.float8_e4m3fn and short[0][1].shape == (handle.num_recv_rows, H // 128)
    idx = torch.stack([torch.randperm(host_path.E, generator=g)[:K] for _ in range(T)])
    for sync in (None, True, False):
        b.last_tokens = T
        short = pub.dispatch(x, idx, w, num_experts=host_path.E, do_cpu_sync=sync)
        assert seen == ["fresh_dispatch", "dispatch"], sync   # the backend's own entry, without the full checks
        seen.clear()
        full = pub.dispatch(x, idx, w, num_experts=host_path.E, do_cpu_sync=sync, allocate_on_comm_stream=True)
        assert seen == ["validate_dispatch", "dispatch"]
        seen.clear()
        # explicit sizes and options take the short path too, with the same result
        b.last_tokens = T
        given = pub.dispatch(x, idx, w, num_experts=host_path.E, do_cpu_sync=sync, expert_alignment=1,
                             num_max_tokens_per_rank=b.config.num_max_tokens_per_rank, do_zero_padding=False,
                             do_expand=False)
        assert seen == ["fresh_dispatch", "dispatch"], sync
        for a, c in zip(given[:3], short[:3]):
            assert a.shape == c.shape and a.dtype == c.dtype
        seen.clear()
        for a, c in zip(short[:3], full[:3]):
            assert a.shape == c.shape and a.dtype == c.dtype
        assert short[3].num_recv_tokens == full[3].num_recv_tokens and short[3].do_cpu_sync == (sync is not False)
    short = pub.combine(y, handle)
    assert seen == ["plain_combine"]
    seen.clear()
    full = pub.combine(y, handle, bias=(None, None))
    assert seen == ["validate_combine", "combine"]
    assert short[0].shape == full[0].shape == (T, H) and short[1] is full[1] is None


def test_the_short_fresh_path_passes_the_backend_what_the_full_checks_pass(monkeypatch):
    """A fresh dispatch with explicit sizes, alignment, layout options and statistics, of bf16 or FP8
    rows, reaches the backend's `dispatch` with the same arguments by the short path as by the full
    checks (a call with an option only the full path takes: ``allocate_on_comm_stream``, which a
    buffer without streams ignores)."""
    b = host_path._backend([])
    pub = _public(b)
    calls = []
    real = b.dispatch
    monkeypatch.setattr(b, "dispatch", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    g = torch.Generator().manual_seed(12)
    T = 16
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(host_path.E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    x8 = (x.to(torch.float8_e4m3fn), torch.rand(T, H // 128, generator=g))
    for xs, options in [(xs, o) for xs in (x, x8) for o in (
            dict(), dict(num_max_tokens_per_rank=32, expert_alignment=4, do_expand=True, do_zero_padding=True),
            dict(num_max_tokens_per_rank=T, do_cpu_sync=False), dict(expert_alignment=2, do_expand=False))] + \
            [(x8, dict(use_tma_aligned_col_major_sf=True)), (x8, dict(use_tma_aligned_col_major_sf=True, do_cpu_sync=False,
                                                                    num_max_tokens_per_rank=T))]:
        got = []
        stats = torch.zeros(host_path.E, dtype=torch.int32)
        for extra in ({}, {"allocate_on_comm_stream": True}):
            calls.clear()
            b.last_tokens = T
            pub.dispatch(xs, idx, w, num_experts=host_path.E, cumulative_local_expert_recv_stats=stats,
                         **options, **extra)
            (args, kwargs), = calls
            got.append((args, kwargs))
        (a1, k1), (a2, k2) = got
        assert all(u is v for u, v in zip(a1, a2)) and k1.keys() == k2.keys(), options
        for name in k1:
            assert k1[name] is k2[name] or k1[name] == k2[name], (options, name, k1[name], k2[name])


def test_the_short_cached_path_passes_the_backend_what_the_full_checks_pass(monkeypatch):
    """A cached dispatch of bf16 or FP8 rows (float32 or packed scale factors, row- or column-major)
    that gives the handle's sizes, its layout and zero padding reaches the GPU backend's cached
    dispatch (`run_cached`) with the same arguments by the short path as by the full checks."""
    import deep_ep.backends.gpu as gpu_backend
    from deep_ep.backends.gpu import dispatch as gpu_dispatch
    b = host_path._backend([])
    handle, _bad, _keep = _handles(b)
    pub = _public(b)
    calls = []
    real = gpu_dispatch.run_cached

    def recorded(*a):
        calls.append((a, {}))
        return real(*a)
    monkeypatch.setattr(gpu_backend, "run_cached", recorded)     # the short path's entry
    monkeypatch.setattr(gpu_dispatch, "run_cached", recorded)    # the general dispatch's
    g = torch.Generator().manual_seed(13)
    T = handle.num_tokens
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g)
    x8 = (x.to(torch.float8_e4m3fn), torch.rand(T, H // 128, generator=g))
    x8_packed = (x8[0], torch.randint(0, 2 ** 31 - 1, (T, -(-H // 512)), dtype=torch.int32, generator=g))
    for xs, options in [(xs, o) for xs in (x, x8, x8_packed) for o in (
            dict(), dict(do_zero_padding=True), dict(num_max_tokens_per_rank=handle.num_max_tokens_per_rank,
                                                     expert_alignment=handle.expert_alignment, do_expand=False))] + \
            [(x8, dict(use_tma_aligned_col_major_sf=True))]:
        got = []
        for extra in ({}, {"allocate_on_comm_stream": True}):
            calls.clear()
            pub.dispatch(xs, topk_weights=w, handle=handle, **options, **extra)
            (args, _), = calls
            got.append(args)
        a1, a2 = got
        assert len(a1) == len(a2) and all(u is v or u == v for u, v in zip(a1, a2)), (options, a1, a2)
