"""Decode path under CUDA graphs: cached dispatch + combine captured once, replayed with fresh inputs.

For each layout (expanded or not) a handle is made by an ordinary dispatch; then a graph captures
``dispatch(x_static, handle=handle)`` followed by ``combine(y_static, handle)``. Each replay copies
fresh random data into the static inputs and compares every output element with the reference.
Two graphs of different batch sizes share one buffer and are replayed interleaved (the device-side
round counters must stay consistent). Skipped without a CUDA device.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from gpu_cases import assert_close_bf16, random_routing  # noqa: E402
from deep_ep import reference as ref  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN, EXPERTS, TOPK = 1024, 32, 8


class _Graph:
    """One captured decode step for a batch size: static inputs, the graph, static outputs."""

    def __init__(self, buf, tokens: int, expand: bool, g: torch.Generator, dev):
        self.tokens, self.expand = tokens, expand
        self.idx = random_routing(tokens, EXPERTS, TOPK, g)
        self.w = torch.rand((tokens, TOPK), generator=g)
        x0 = torch.randn((tokens, HIDDEN), generator=g).to(torch.bfloat16)
        _, _, _, self.handle, _ = buf.dispatch(x0.to(dev), self.idx.to(dev), self.w.to(dev), num_experts=EXPERTS,
                                               do_expand=expand, expert_alignment=8 if expand else 1,
                                               do_zero_padding=True)
        rows = self.handle.num_recv_rows
        self.x = torch.empty((tokens, HIDDEN), dtype=torch.bfloat16, device=dev)
        self.y = torch.empty((rows, HIDDEN), dtype=torch.bfloat16, device=dev)
        self.x.copy_(x0)
        self.y.normal_()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # warm-up outside capture (module loads, allocator pools)
            buf.dispatch(self.x, handle=self.handle, do_zero_padding=True)
            buf.combine(self.y, self.handle)
        torch.cuda.current_stream(dev).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.recv_x, _, _, _, _ = buf.dispatch(self.x, handle=self.handle, do_zero_padding=True)
            self.out, _, _ = buf.combine(self.y, self.handle)

    def replay_and_check(self, g: torch.Generator) -> None:
        x = torch.randn((self.tokens, HIDDEN), generator=g).to(torch.bfloat16)
        y = torch.randn(tuple(self.y.shape), generator=g).to(torch.bfloat16)
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        torch.cuda.synchronize()
        exp = ref.reference_dispatch([x], [self.idx], [self.w], EXPERTS, do_expand=self.expand,
                                     expert_alignment=8 if self.expand else 1)
        rows = torch.arange(exp[0].num_valid_rows)
        assert torch.equal(self.recv_x.cpu()[rows].view(torch.int16), exp[0].recv_x[rows].view(torch.int16))
        comb = ref.reference_combine([y], [exp[0].handle])[0][0]
        assert_close_bf16(self.out.cpu(), comb, f"combine, {self.tokens} tokens")


@pytest.mark.parametrize("expand", [False, True], ids=["nonexpanded", "expanded"])
def test_graph_replay_ep1(nccl_group, expand):
    dev = torch.device("cuda", 0)
    buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=256, hidden=HIDDEN, num_topk=TOPK)
    try:
        g = torch.Generator().manual_seed(7)
        small, large = _Graph(buf, 32, expand, g, dev), _Graph(buf, 128, expand, g, dev)
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
