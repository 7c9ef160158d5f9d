"""Cached calls through the handle's prepared launches (deep_ep.backends.gpu, `jit.PreparedLaunch`).

A cached dispatch or combine prepares its kernel launch once per handle and later only updates the
per-call pointers. These tests repeat eager cached calls with fresh inputs and outputs, switch
between the options that change the launch (BF16 / FP8, weights and biases in combine, number of
SMs), copy and pickle a handle after use, rebuild a handle with other tensors, and call from another
current device. Every call runs under `deep_ep.backends.outputs.poisoned` (each output the library
allocates starts as NaN / 0xA5 bytes) and every element of what it returns is compared with the
reference: a cached dispatch's data, scale factors, indices, weights and handle; a combine's
output and reduced weights. Seeds differ per test and parameter (`gpu_cases.case_seed`). Skipped
without a CUDA device (one-rank NCCL group on GPU 0).
"""
from __future__ import annotations

import copy
import dataclasses
import io
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from deep_ep import reference as ref  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402
from gpu_cases import case_seed, handle_to_cpu, random_routing, to_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN, EXPERTS, TOPK, TOKENS = 1024, 32, 8, 96


def _routing(g: torch.Generator) -> torch.Tensor:
    return random_routing(TOKENS, EXPERTS, TOPK, g)


def _check_combine(got: torch.Tensor, want: torch.Tensor) -> None:
    ref.check_combine((got.cpu(), None), (want, None))   # bit for bit


def _fp8(g: torch.Generator):
    """Random FP8 input: e4m3 data [TOKENS, HIDDEN] and float32 scale factors [TOKENS, HIDDEN / 128]."""
    return ((torch.randn((TOKENS, HIDDEN), generator=g) * 4).to(torch.float8_e4m3fn),
            torch.rand((TOKENS, HIDDEN // 128), generator=g) + 0.5)


def _check_cached(out, exp, handle, expand: bool) -> None:
    """A cached dispatch's outputs ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``
    against the reference ``exp`` of the same routing: every element, the handle included.
    A cached dispatch given no topk_weights returns the indices of the dispatch that made the handle
    (None in the expanded layout), no weights, and the handle itself (DeepEP's contract)."""
    assert out[3] is handle, "a cached dispatch returns the handle it was given"
    want = dataclasses.replace(exp, recv_topk_weights=None)
    ref.check_dispatch((to_cpu(out[0]), to_cpu(out[1]), to_cpu(out[2]), handle_to_cpu(out[3])), want)


@pytest.fixture()
def buf(nccl_group):
    b = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK,
                              explicitly_destroy=True)
    yield b
    b.destroy()


@pytest.mark.parametrize("expand", [False, True], ids=["non-expanded", "expanded"])
def test_repeated_cached_calls_with_changing_options(buf, expand):
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(case_seed("cached-changing-options", expand))
    idx, w = _routing(g), torch.rand((TOKENS, TOPK), generator=g)
    x0 = torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    kw = dict(do_expand=expand, expert_alignment=4 if expand else 1, do_zero_padding=True)
    with outputs.poisoned():
        _, _, _, handle, _ = buf.dispatch(x0.to(dev), idx.to(dev), w.to(dev), num_experts=EXPERTS, **kw)
    for i in range(8):
        fp8 = i % 4 == 3
        xin = _fp8(g) if fp8 else torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
        num_sms = (0, 7, 0, 3)[i % 4]
        with outputs.poisoned():
            out = buf.dispatch(tuple(t.to(dev) for t in xin) if fp8 else xin.to(dev), handle=handle,
                               num_sms=num_sms, do_zero_padding=True)
        exp = ref.reference_dispatch([xin], [idx], [w], EXPERTS, do_expand=expand,
                                     expert_alignment=4 if expand else 1, num_max_tokens_per_rank=TOKENS)[0]
        _check_cached(out, exp, handle, expand)
        # combine: with and without weights and biases, alternating (different prepared launches)
        y = torch.randn((handle.num_recv_rows, HIDDEN), generator=g).to(torch.bfloat16)
        cw = torch.rand((handle.num_recv_rows,) if expand else (handle.num_recv_rows, TOPK),
                        generator=g) if i % 2 else None
        bias = (torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16),) if i % 3 == 1 else None
        with outputs.poisoned():
            got, got_w, _ = buf.combine(y.to(dev), handle, topk_weights=None if cw is None else cw.to(dev),
                                        bias=None if bias is None else tuple(b.to(dev) for b in bias),
                                        num_sms=num_sms)
        want, want_w = ref.reference_combine([y], [exp.handle], None if cw is None else [cw],
                                             None if bias is None else [bias])[0]
        ref.check_combine((got.cpu(), None), (want, None))   # bit for bit, both layouts
        if cw is None:
            assert got_w is None
        else:  # one source rank: the reduced weights are the received ones, bit for bit
            assert torch.equal(got_w.cpu().view(torch.int32), want_w.view(torch.int32)), "combined weights"


def test_handle_copies_and_rebuilt_handles(buf):
    """Expanded layout: its combine reads the handle's routing (topk_idx), so a launch that kept
    the old tensor's pointer would produce zeros below."""
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(case_seed("cached-handle-copies"))
    idx = _routing(g)
    x = torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    with outputs.poisoned():
        _, _, _, handle, _ = buf.dispatch(x.to(dev), idx.to(dev), num_experts=EXPERTS, do_expand=True)
    y = torch.randn((handle.num_recv_rows, HIDDEN), generator=g).to(torch.bfloat16)
    exp = ref.reference_dispatch([x], [idx], None, EXPERTS, do_expand=True, num_max_tokens_per_rank=TOKENS)[0]
    want = ref.reference_combine([y], [exp.handle])[0][0]
    assert float(want.float().abs().sum()) > 0

    def combine(h):
        with outputs.poisoned():
            return buf.combine(y.to(dev), h)[0]

    x2 = torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    with outputs.poisoned():
        out = buf.dispatch(x2.to(dev), handle=handle)
    _check_cached(out, ref.reference_dispatch([x2], [idx], None, EXPERTS, do_expand=True,
                                              num_max_tokens_per_rank=TOKENS)[0], handle, True)
    _check_combine(combine(handle), want)   # the handle now holds prepared launches
    for other in (copy.deepcopy(handle), handle.clone()):
        assert not other.backend_state.launches
        _check_combine(combine(other), want)
    torch.save(handle.backend_state, io.BytesIO())  # picklable: the launches are left behind
    # A handle rebuilt with another (equal) routing tensor: the launch must read the new tensor.
    rebuilt = dataclasses.replace(handle, topk_idx=handle.topk_idx.clone())
    handle.topk_idx.fill_(-1)  # the old tensor no longer routes anything
    _check_combine(combine(rebuilt), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_call_with_another_current_device(buf):
    """The buffer is on GPU 0 while GPU 1 is current: results must still be ordered and right."""
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(case_seed("cached-another-current-device"))
    idx = _routing(g)
    x = torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16).to(dev)
    with outputs.poisoned():
        _, _, _, handle, _ = buf.dispatch(x, idx.to(dev), num_experts=EXPERTS)
    y = torch.randn((handle.num_recv_rows, HIDDEN), generator=g).to(torch.bfloat16)
    exp = ref.reference_dispatch([x.cpu()], [idx], None, EXPERTS)[0]
    want = ref.reference_combine([y], [exp.handle])[0][0]
    with torch.cuda.device(1):
        yd = y.to(dev)
        for _ in range(3):
            with outputs.poisoned():
                got = buf.combine(yd, handle)[0]
            snapshot = got.clone()  # queued on GPU 0's current stream after the call
            _check_combine(snapshot, want)
            # the calls launched on GPU 0 without changing the caller's current device
            assert torch.cuda.current_device() == 1
            assert torch.empty(1, device="cuda").device.index == 1


@pytest.mark.parametrize("expand", [False, True], ids=["non-expanded", "expanded"])
def test_cached_dispatch_counts_into_the_stats(buf, expand):
    """``cumulative_local_expert_recv_stats`` is incremented by every dispatch, cached ones included
    (as on the CPU backend), from a non-zero start."""
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(case_seed("cached-stats", expand))
    idx, w = _routing(g), torch.rand((TOKENS, TOPK), generator=g)
    x = torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    start = torch.randint(0, 1000, (EXPERTS,), generator=g, dtype=torch.int32)
    stats = start.to(dev)
    kw = dict(do_expand=expand, expert_alignment=4 if expand else 1)
    exp = ref.reference_dispatch([x], [idx], [w], EXPERTS, num_max_tokens_per_rank=TOKENS, **kw)
    counts = ref.local_expert_counts(exp)[0]
    handle = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev), num_experts=EXPERTS,
                          cumulative_local_expert_recv_stats=stats, **kw)[3]
    assert torch.equal(stats.cpu(), start + counts), "a fresh dispatch adds its counts"
    buf.dispatch(x.to(dev), handle=handle, cumulative_local_expert_recv_stats=stats)
    assert torch.equal(stats.cpu(), start + 2 * counts), "a cached dispatch adds the handle's counts"
