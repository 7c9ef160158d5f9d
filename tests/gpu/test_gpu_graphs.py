"""Decode path under CUDA graphs: cached dispatch + combine captured once, replayed with fresh inputs.

For each layout (expanded or not, BF16 or FP8) a handle is made by an ordinary dispatch; then a graph
captures ``dispatch(x_static, handle=handle)`` followed by ``combine(y_static, handle,
bias=bias_static)``. Before each replay the test copies fresh random data into the static inputs and
fills the graph's outputs with the poison pattern (`deep_ep.backends.outputs.fill_poison`: what the
replay leaves unwritten shows); after it, every output element is compared with the reference. Two
graphs of different batch sizes share one buffer and are replayed interleaved (the handles' layouts
must not mix; at EP=1 the data kernels leave the device-side round counters alone). Seeds differ per parameter. Skipped without a CUDA device.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from gpu_cases import case_seed, handle_to_cpu, random_routing, to_cpu  # noqa: E402
from deep_ep import reference as ref  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN, EXPERTS, TOPK = 1024, 32, 8


def _x(tokens: int, fp8: bool, g: torch.Generator):
    """Fresh dispatch input: bf16 [tokens, HIDDEN], or (e4m3 data, float32 scale factors [tokens, HIDDEN / 128])."""
    if not fp8:
        return torch.randn((tokens, HIDDEN), generator=g).to(torch.bfloat16)
    return ((torch.randn((tokens, HIDDEN), generator=g) * 4).to(torch.float8_e4m3fn),
            torch.rand((tokens, HIDDEN // 128), generator=g) + 0.5)


def _copy_into(static, value) -> None:
    if isinstance(static, tuple):
        for s, v in zip(static, value):
            s.copy_(v)
    else:
        static.copy_(value)


def _poison(x) -> None:
    for t in (x if isinstance(x, tuple) else (x,)):
        outputs.fill_poison(t)


class _Graph:
    """One captured decode step for a batch size: static inputs, the graph, static outputs."""

    def __init__(self, buf, tokens: int, expand: bool, fp8: bool, g: torch.Generator, dev):
        self.tokens, self.expand, self.fp8 = tokens, expand, fp8
        self.idx = random_routing(tokens, EXPERTS, TOPK, g)
        self.w = torch.rand((tokens, TOPK), generator=g)
        x0 = torch.randn((tokens, HIDDEN), generator=g).to(torch.bfloat16)
        with outputs.poisoned():
            _, _, _, self.handle, _ = buf.dispatch(x0.to(dev), self.idx.to(dev), self.w.to(dev),
                                                   num_experts=EXPERTS, do_expand=expand,
                                                   expert_alignment=8 if expand else 1, do_zero_padding=True)
        rows = self.handle.num_recv_rows
        first = _x(tokens, fp8, g)
        self.x = tuple(t.to(dev) for t in first) if fp8 else first.to(dev)
        self.y = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16).to(dev)
        self.bias = torch.randn((tokens, HIDDEN), generator=g).to(torch.bfloat16).to(dev)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # warm-up outside capture (module loads, allocator pools)
            buf.dispatch(self.x, handle=self.handle, do_zero_padding=True)
            buf.combine(self.y, self.handle, bias=self.bias)
        torch.cuda.current_stream(dev).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        # Captured without poisoning, as a user's graph is: the test poisons the outputs before replays.
        with torch.cuda.graph(self.graph):
            self.recv_x, self.recv_idx, self.recv_w, _, _ = buf.dispatch(self.x, handle=self.handle,
                                                                         do_zero_padding=True)
            self.out, _, _ = buf.combine(self.y, self.handle, bias=self.bias)

    def replay_and_check(self, g: torch.Generator) -> None:
        x = _x(self.tokens, self.fp8, g)
        y = torch.randn(tuple(self.y.shape), generator=g).to(torch.bfloat16)
        bias = torch.randn(tuple(self.bias.shape), generator=g).to(torch.bfloat16)
        _copy_into(self.x, x)
        self.y.copy_(y)
        self.bias.copy_(bias)
        _poison(self.recv_x)
        outputs.fill_poison(self.out)
        self.graph.replay()
        torch.cuda.synchronize()
        exp = ref.reference_dispatch([x], [self.idx], [self.w], EXPERTS, do_expand=self.expand,
                                     expert_alignment=8 if self.expand else 1,
                                     num_max_tokens_per_rank=256)[0]
        # a cached dispatch given no topk_weights returns no weights (DeepEP)
        want = dataclasses.replace(exp, recv_topk_weights=None)
        ref.check_dispatch((to_cpu(self.recv_x), to_cpu(self.recv_idx), to_cpu(self.recv_w),
                            handle_to_cpu(self.handle)), want)
        comb = ref.reference_combine([y], [exp.handle], None, [bias])[0][0]
        ref.check_combine((self.out.cpu(), None), (comb, None))   # bit for bit, both layouts


@pytest.mark.parametrize("expand, fp8", [(False, False), (True, False), (False, True)],
                         ids=["nonexpanded", "expanded", "nonexpanded-fp8"])
def test_graph_replay_ep1(nccl_group, expand, fp8):
    dev = torch.device("cuda", 0)
    buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=256, hidden=HIDDEN, num_topk=TOPK)
    try:
        g = torch.Generator().manual_seed(case_seed("graph-replay", expand, fp8))
        small, large = _Graph(buf, 32, expand, fp8, g, dev), _Graph(buf, 128, expand, fp8, g, dev)
        for step in range(6):  # interleaved replays of two graphs sharing one buffer
            (small if step % 2 else large).replay_and_check(g)
            small.replay_and_check(g) if step % 3 == 0 else None
    finally:
        buf.destroy()


def test_create_during_capture_raises(nccl_group):
    dev = torch.device("cuda", 0)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        with pytest.raises(RuntimeError, match="before capture"):
            with torch.cuda.graph(g, stream=s):
                deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=16, hidden=HIDDEN, num_topk=TOPK)


def test_a_fresh_dispatch_with_cpu_sync_during_capture_raises(nccl_group):
    """The host of a dispatch with do_cpu_sync=True waits for counts that a captured kernel writes only
    at replay: refused at once, before anything is queued (not after num_cpu_timeout_secs), and the
    buffer still works once the capture has ended."""
    import time
    dev = torch.device("cuda", 0)
    buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=16, hidden=HIDDEN, num_topk=TOPK)
    try:
        x = torch.randn((16, HIDDEN), device=dev).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(EXPERTS, device=dev)[:TOPK] for _ in range(16)])
        buf.dispatch(x, idx, num_experts=EXPERTS)   # module loads and allocator pools outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(dev)
        t0 = time.monotonic()
        with torch.cuda.stream(s):
            with pytest.raises(RuntimeError, match="cannot be captured"):
                with torch.cuda.graph(g, stream=s):
                    buf.dispatch(x, idx, num_experts=EXPERTS)
        assert time.monotonic() - t0 < 10
        torch.cuda.synchronize()
        recv_x, _, _, handle, _ = buf.dispatch(x, idx, num_experts=EXPERTS)
        assert handle.num_recv_tokens == 16 and recv_x.shape == (16, HIDDEN)
    finally:
        buf.destroy()


@pytest.mark.parametrize("expand, fp8", [(False, False), (True, False), (False, True)],
                         ids=["nonexpanded", "expanded", "nonexpanded-fp8"])
def test_a_fresh_dispatch_without_cpu_sync_replays_with_fresh_routing(nccl_group, expand, fp8):
    """The serving decode step: a fresh dispatch with ``do_cpu_sync=False`` (outputs sized for the
    worst case) and a combine on its handle, captured once in a CUDA graph, then replayed with new
    data and a new routing copied into the static inputs each time (masked slots included). Before
    each replay every output, the handle's device words and its copy of the routing are poisoned; after it, the dispatch
    outputs, the handle's tensors and the combine are compared with the reference of that replay's
    inputs, element by element."""
    T, M = 64, 64
    align = 8 if expand else 1
    dev = torch.device("cuda", 0)
    buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=TOPK)
    try:
        g = torch.Generator().manual_seed(case_seed("graph-fresh-nosync", expand, fp8))
        first = _x(T, fp8, g)
        x_s = tuple(t.to(dev) for t in first) if fp8 else first.to(dev)
        idx_s = random_routing(T, EXPERTS, TOPK, g).to(dev)
        w_s = torch.rand((T, TOPK), generator=g).to(dev)

        def step():
            recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
                x_s, idx_s, w_s, num_experts=EXPERTS, do_cpu_sync=False, num_max_tokens_per_rank=M,
                do_expand=expand, expert_alignment=align, do_zero_padding=True)
            return recv_x, recv_idx, recv_w, handle

        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):   # module loads and the call's plan outside capture
            _, _, _, h0 = step()
            buf.combine(torch.zeros((h0.num_recv_rows, HIDDEN), dtype=torch.bfloat16, device=dev), h0)
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize()
        rows = h0.num_recv_rows
        y_s = torch.empty((rows, HIDDEN), dtype=torch.bfloat16, device=dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv_x, recv_idx, recv_w, handle = step()
            out, _, _ = buf.combine(y_s, handle)
        assert handle.num_recv_rows == rows
        for _ in range(4):
            x = _x(T, fp8, g)
            idx = random_routing(T, EXPERTS, TOPK, g)
            w = torch.rand((T, TOPK), generator=g)
            y = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16)
            _copy_into(x_s, x)
            idx_s.copy_(idx)
            w_s.copy_(w)
            y_s.copy_(y)
            own_topk = handle.topk_idx if handle.topk_idx.data_ptr() != idx_s.data_ptr() else None
            _poison(recv_x)
            for t in (recv_idx, recv_w, out, handle.backend_state.words, own_topk):
                if t is not None:
                    outputs.fill_poison(t)
            graph.replay()
            torch.cuda.synchronize()
            exp = ref.reference_dispatch([x], [idx], [w], EXPERTS, do_expand=expand, expert_alignment=align,
                                         do_cpu_sync=False, num_max_tokens_per_rank=M)[0]
            ref.check_dispatch((to_cpu(recv_x), to_cpu(recv_idx), to_cpu(recv_w), handle_to_cpu(handle)), exp)
            comb = ref.reference_combine([y], [exp.handle])[0][0]
            ref.check_combine((out.cpu(), None), (comb, None))
    finally:
        buf.destroy()
