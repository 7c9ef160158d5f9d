"""The GPU backend's combine of an expanded handle on a buffer with ``allow_multiple_reduction=False``
(impls/combine_single.cuh), the host side without a GPU: the module and tag it launches with, the
window's room for a row per (token, slot) (the size hint makes it; a smaller window is refused before
any launch), the refusal that remains (no bound on the tokens), hybrid mode across nodes (either
layout passed on unreduced by the forwarders, impls/combine_hybrid_single.cuh: its modules, tags and
room), and the GPU suite's single-reduction cases (tests/gpu_cases.py) run by its driver on two CPU
ranks, where they pass and fail when the combine reduces per rank first (so they tell the two orders
apart). The GPU runs: tests/gpu/test_gpu_backend.py and test_gpu_scaleout.py (direct and hybrid mode),
tests/gpu/test_gpu_deepep_compat.py.
"""
from __future__ import annotations

import ctypes
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from deep_ep.backends.gpu import combine as gpu_combine
from deep_ep.backends.gpu import modules, window
from deep_ep.backends.gpu.abi import MAX_TOPK, CombineArgs, call_tag

from gpu_cases import _BASE
from proc_utils import run_gloo_ranks
from test_gpu_host_path import E, H, K, M, _backend, _dispatch, _Module

ROOT = Path(__file__).resolve().parents[1]
SINGLE_CASES = tuple(c.name for c in _BASE if c.single_reduction)


def _single_backend(log, built):
    """`test_gpu_host_path._backend` for a buffer without multiple reduction, recording the modules
    it asks for."""
    b = _backend(log)
    b.config = dataclasses.replace(b.config, allow_multiple_reduction=False)
    b.module = lambda kind, structure: (built.append((kind, structure)), _Module(log))[1]
    return b


def _expanded_handle(b):
    b.last_tok_rows = None
    (_, _, _, handle), inputs = _dispatch(b, T=40, weights=True, sync=True, align=2, stats=False, seed=3,
                                          expand=True)
    return handle, inputs


def test_combine_layout_and_defines():
    assert modules.combine_layout(False, False) is False and modules.combine_layout(False, True) is False
    assert modules.combine_layout(True, True) is True
    assert modules.combine_layout(True, False) == modules.SINGLE_REDUCTION
    single = modules.combine_defines(H, K, modules.SINGLE_REDUCTION)
    assert single["EP_EXPAND"] == 1 and single["EP_SINGLE_REDUCTION"] == 1
    for expand in (False, True):   # the other modules keep their defines (names and cache keys)
        assert "EP_SINGLE_REDUCTION" not in modules.combine_defines(H, K, expand)
        assert modules.combine_defines(H, K, expand)["EP_EXPAND"] == int(expand)
    send = modules.combine_defines(H, K, modules.SINGLE_REDUCTION, modules.SEND_PHASE)
    assert send["EP_SINGLE_REDUCTION"] == 1 and send["EP_DATA_PHASES"] == modules.SEND_PHASE
    # hybrid mode across nodes: a non-expanded handle without multiple reduction has a module of its own
    # (the forwarders pass every rank's row on unreduced); the others are those of one node
    assert modules.combine_layout(False, False, hybrid=True) == modules.UNREDUCED_RANKS
    assert modules.combine_layout(False, True, hybrid=True) is False
    assert modules.combine_layout(True, True, hybrid=True) is True
    assert modules.combine_layout(True, False, hybrid=True) == modules.SINGLE_REDUCTION
    unreduced = modules.combine_defines(H, K, modules.UNREDUCED_RANKS, transport_gin=2)
    assert unreduced["EP_EXPAND"] == 0 and unreduced["EP_SINGLE_REDUCTION"] == 1
    hybrid_keys = {tuple(sorted(modules.combine_defines(H, K, e, transport_gin=2).items()))
                   for e in (False, True, modules.SINGLE_REDUCTION, modules.UNREDUCED_RANKS)}
    assert len(hybrid_keys) == 4


@pytest.mark.parametrize("apply_weights", [False, True])
def test_an_expanded_combine_launches_the_single_reduction_module(apply_weights):
    """The expanded handle's combine builds the module with `modules.SINGLE_REDUCTION` and launches it
    with a tag of its own (peers of a buffer that reduces per rank would disagree); a non-expanded
    handle of the same buffer combines as always (it reduces per rank in either setting)."""
    log, built = [], []
    b = _single_backend(log, built)
    handle, _keep = _expanded_handle(b)
    built.clear()
    log.clear()
    b.calls += 1
    y = torch.randn(handle.num_recv_rows, H).to(torch.bfloat16)
    out, weights = gpu_combine.run_combine(b, y, handle, None, (), num_sms=4, apply_dispatch_weights=apply_weights)
    assert out.shape == (handle.num_tokens, H) and weights is None
    assert built == [("combine", (H, K, modules.SINGLE_REDUCTION))]
    (name, _, args), = log
    assert name == modules.COMBINE_KERNEL
    tag = CombineArgs.from_buffer_copy(args[0]).tag
    want = call_tag(b.calls, 3, H, K, modules.SINGLE_REDUCTION, E, False, int(apply_weights), 0)   # 0: no GIN
    assert (tag.seq, tag.fingerprint) == (want.seq, want.fingerprint)
    assert want.fingerprint != call_tag(b.calls, 3, H, K, 1, E, False, int(apply_weights), 0).fingerprint
    assert CombineArgs.from_buffer_copy(args[0]).apply_weights == int(apply_weights)

    (_, _, _, flat), _keep2 = _dispatch(b, T=40, weights=False, sync=True, align=1, stats=False, seed=4)
    built.clear()
    b.calls += 1
    gpu_combine.run_combine(b, torch.randn(flat.num_recv_rows, H).to(torch.bfloat16), flat, None, (), num_sms=4)
    assert built == [("combine", (H, K, False))]


def test_a_window_without_room_for_every_slot_is_refused_before_any_launch():
    """Room for the dispatch's R x M token rows, not for K combine rows per token: a clear error names
    the size hint, nothing is launched; the same handle's combine on a window of the size hint for
    allow_multiple_reduction=False launches."""
    log, built = [], []
    b = _single_backend(log, built)
    handle, _keep = _expanded_handle(b)
    # the window's halves as combine sees them: K - 1 combine rows per token
    stride = window.combine_row_stride(H, K)
    b._layouts[stride] = dataclasses.replace(b.layout(stride), half_bytes=(K - 1) * M * stride + stride - 16)
    log.clear()
    y = torch.randn(handle.num_recv_rows, H).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"allow_multiple_reduction=False.*get_buffer_size_hint"):
        gpu_combine.run_combine(b, y, handle, None, (), num_sms=4)
    assert log == []
    b.transport.num_bytes = window.buffer_size_hint(1, M, H, K, allow_multiple_reduction=False)
    b._layouts.clear()
    gpu_combine.run_combine(b, y, handle, None, (), num_sms=4)
    assert [name for name, _, _ in log] == [modules.COMBINE_KERNEL]


def test_a_handle_without_a_token_bound_is_refused():
    log, built = [], []
    b = _single_backend(log, built)
    handle, _keep = _expanded_handle(b)
    unbounded = dataclasses.replace(handle, num_max_tokens_per_rank=0)
    log.clear()
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        gpu_combine.run_combine(b, torch.randn(handle.num_recv_rows, H).to(torch.bfloat16), unbounded, None, (),
                                num_sms=4)
    assert log == []


class _HybridArgs(ctypes.Structure):
    """The fields of the hybrid transport's arguments the combine's host code reads."""
    _fields_ = [("half_bytes", ctypes.c_int64)]


def _hybrid(b, half_bytes: int = 64 << 20):
    """Make ``b`` a buffer in hybrid mode across nodes (forwarders in each node) after its dispatch."""
    b.hybrid_scaleout, b.hybrid_node_ranks = True, 1
    b.transport_args = _HybridArgs(half_bytes)
    return b


def _handle(b, expand: bool, weights: bool, seed: int):
    """``(handle, what keeps its tensors alive)`` of a dispatch on ``b``: expanded, or a non-expanded
    one of 40 tokens (with received weights when ``weights``)."""
    if expand:
        return _expanded_handle(b)
    (_, _, _, handle), keep = _dispatch(b, T=40, weights=weights, sync=True, align=1, stats=False, seed=seed)
    return handle, keep


@pytest.mark.parametrize("expand", [False, True], ids=["rows", "expand"])
def test_hybrid_mode_across_nodes_combines_unreduced(expand):
    """Hybrid mode across nodes with allow_multiple_reduction=False: either layout launches its
    unreduced module (`modules.UNREDUCED_RANKS` non-expanded, `modules.SINGLE_REDUCTION` expanded)
    with a tag of its own; with multiple reduction the usual modules."""
    log, built = [], []
    b = _single_backend(log, built)
    handle, _keep = _handle(b, expand, weights=True, seed=5)
    _hybrid(b)
    built.clear()
    log.clear()
    b.calls += 1
    y = torch.randn(handle.num_recv_rows, H).to(torch.bfloat16)
    w = None if expand else torch.rand(handle.num_recv_rows, K)
    out, weights = gpu_combine.run_combine(b, y, handle, w, (), num_sms=4)
    layout = modules.SINGLE_REDUCTION if expand else modules.UNREDUCED_RANKS
    assert built == [("combine", (H, K, layout))]
    assert out.shape == (handle.num_tokens, H) and (weights is None) == expand
    (name, _, args), = log
    assert name == modules.COMBINE_KERNEL
    tag = CombineArgs.from_buffer_copy(args[0]).tag
    assert tag.fingerprint == call_tag(b.calls, 3, H, K, layout, E, not expand, 0, 0).fingerprint
    assert tag.fingerprint != call_tag(b.calls, 3, H, K, int(expand), E, not expand, 0, 0).fingerprint
    # the same handle on a buffer with multiple reduction: the hybrid order's module
    b.config = dataclasses.replace(b.config, allow_multiple_reduction=True)
    handle.backend_state.launches.clear()
    built.clear()
    gpu_combine.run_combine(b, y, dataclasses.replace(handle), w, (), num_sms=4)
    assert built == [("combine", (H, K, expand))]


@pytest.mark.parametrize("expand", [False, True], ids=["rows", "expand"])
def test_hybrid_room_for_unreduced_rows_is_checked_before_any_launch(expand):
    """Too small a window for the rows the forwarders pass on unreduced: a ValueError names the bytes
    and the size hint, nothing is launched. Expanded, the window holds the hybrid combine's node
    partials (one node slot per token) but not a row per (token, slot); non-expanded, an entry per
    (token, rank of the node) is what either setting needs, so a window one row short."""
    log, built = [], []
    b = _single_backend(log, built)
    handle, _keep = _handle(b, expand, weights=False, seed=6)
    per_token = 2 * H + 32   # K = 4, nodes of 1 rank: an entry, or a node slot
    half = M * per_token if expand else M * per_token - 16
    _hybrid(b, half_bytes=half)
    if expand:
        window.check_hybrid_combine(half, 1, 1, M, H, K)   # enough with multiple reduction
    log.clear()
    y = torch.randn(handle.num_recv_rows, H).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"hybrid combine with allow_multiple_reduction=False.*"
                                         r"get_buffer_size_hint\(\.\.\., num_topk=4, allow_multiple_reduction=False"):
        gpu_combine.run_combine(b, y, handle, None, (), num_sms=4)
    assert log == []


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("num_topk", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("hidden", [256, 2880, 7168])
def test_the_size_hint_makes_room_for_hybrid_unreduced_rows(hidden, num_topk, expand):
    """A window of `buffer_size_hint(..., allow_multiple_reduction=False)` passes the hybrid combine's
    check for rows passed on unreduced, for nodes of 2 to 8 ranks and every top-k up to the buffer's
    (the hint knows neither the node size nor the layout), also without the slack of its rounding."""
    for nodes, per_node in ((2, 2), (2, 4), (4, 2), (2, 8)):
        ranks = nodes * per_node
        for tokens in (1, 10, 128, 4096):
            num_bytes = window.buffer_size_hint(ranks, tokens, hidden, num_topk, allow_multiple_reduction=False)
            half = window.make_layout(ranks, 1, 8, num_bytes=num_bytes).half_bytes   # comm.gin.receive_halves
            exact = window.make_layout(ranks, tokens, hidden, num_topk, allow_multiple_reduction=False).half_bytes
            assert exact <= half
            for topk in range(1, (num_topk or MAX_TOPK) + 1):
                window.check_hybrid_combine(exact, ranks, per_node, tokens, hidden, topk, unreduced=True,
                                            expanded=expand)


@pytest.mark.parametrize("num_topk", [0, 1, 4, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_size_hint_makes_room_for_a_row_per_slot(num_topk, fp8):
    """`buffer_size_hint(..., allow_multiple_reduction=False)` holds R x M x K combine rows per half
    (K: num_topk, or MAX_TOPK for 0), which `check_single_reduction` accepts for every top-k up to
    the buffer's; the hint with multiple reduction is unchanged and, from top-2 on, too small."""
    ranks, tokens, hidden = 8, 128, 7168
    single = window.buffer_size_hint(ranks, tokens, hidden, num_topk, fp8, allow_multiple_reduction=False)
    multi = window.buffer_size_hint(ranks, tokens, hidden, num_topk, fp8)
    assert multi == window.make_layout(ranks, tokens, hidden, num_topk, fp8).num_bytes
    window_topk = num_topk or MAX_TOPK
    rows = window.make_layout(ranks, 0, 0, num_topk, num_bytes=single,
                              stride=window.combine_row_stride(hidden, num_topk)).rows_per_half
    for topk in range(1, window_topk + 1):
        window.check_single_reduction(rows, ranks, tokens, topk)
    multi_rows = window.make_layout(ranks, 0, 0, num_topk, num_bytes=multi,
                                    stride=window.combine_row_stride(hidden, num_topk)).rows_per_half
    if window_topk >= 2:
        assert single > multi
        with pytest.raises(ValueError, match="stages a row per"):
            window.check_single_reduction(multi_rows, ranks, tokens, window_topk)
    else:
        assert single >= multi   # top-1: room for hybrid mode's unreduced rows at most


# ------------------------------------------------------------------- the GPU suite's cases on the CPU
def _cases_worker(rank, world_size, names):
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import deep_ep
    import test_gpu_backend as gpu_suite
    from gpu_cases import cases_for
    import torch.distributed as dist
    cases = {c.name.split("-", 1)[1]: c for c in cases_for(world_size)}
    real = deep_ep.ElasticBuffer
    outcomes = []
    for name in names:
        assert cases[name].single_reduction
        gpu_suite.run_case(cases[name], lambda body: {rank: body(dist.group.WORLD)}, torch.device("cpu"))
        # the same case on a buffer that reduces per rank first: the check must fail
        deep_ep.ElasticBuffer = lambda *args, **kwargs: real(*args, **dict(kwargs, allow_multiple_reduction=True))
        try:
            gpu_suite.run_case(cases[name], lambda body: {rank: body(dist.group.WORLD)}, torch.device("cpu"))
            outcomes.append((name, None))
        except AssertionError as exc:
            outcomes.append((name, str(exc)[:200]))
        finally:
            deep_ep.ElasticBuffer = real
    return outcomes


def test_the_gpu_suites_single_reduction_cases_tell_the_orders_apart(tmp_path):
    assert len(SINGLE_CASES) >= 4 and all(c.expand for c in _BASE if c.single_reduction)
    results = run_gloo_ranks(_cases_worker, 2, tmp_path, SINGLE_CASES, deadline=300)
    # a rank without tokens passes either way; some rank of every case must not
    for index, name in enumerate(SINGLE_CASES):
        failures = [outcomes[index][1] for outcomes in results.values()]
        assert all(outcomes[index][0] == name for outcomes in results.values())
        assert any(f is not None and "combine" in f for f in failures), f"case {name} passed with multiple reduction"
