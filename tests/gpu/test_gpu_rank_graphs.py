"""Every emulated rank's cached dispatch and combine in one CUDA graph, captured by one thread.

Each rank's buffer and handle are made in the ranks' threads (`EmulatedGroup.run`: buffer creation
and the first use of each kernel meet at host barriers); then the test's own thread captures every
rank's calls with `deep_ep.bench.rank_graphs.capture_rank_calls` (a branch per rank, each call made
under `EmulatedGroup.acting_as`). Each replay gets fresh data copied into the static inputs and
poisoned outputs; after it every rank's received rows and combined rows are compared bit for bit
with `deep_ep.reference`. The replays are also timed (`time_replays`). Skipped without a CUDA device.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from gpu_cases import case_seed, random_routing  # noqa: E402
from deep_ep import reference as ref  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402
from deep_ep.bench import rank_graphs  # noqa: E402
from deep_ep.emulated import EmulatedGroup, wait_for_stream  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOKENS, HIDDEN, EXPERTS, TOPK = 64, 512, 32, 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16)


@pytest.mark.parametrize("num_ranks", [2, 8])
@pytest.mark.parametrize("expand", [False, True], ids=["nonexpanded", "expanded"])
def test_every_rank_in_one_graph_replays_with_fresh_data(num_ranks, expand):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    group = EmulatedGroup(num_ranks, device=dev)
    g = torch.Generator().manual_seed(case_seed("rank-graphs", num_ranks, expand))
    idx = [random_routing(TOKENS, EXPERTS, TOPK, g) for _ in range(num_ranks)]
    align = 4 if expand else 1

    def new_x():
        return [torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16) for _ in range(num_ranks)]
    first_x = new_x()

    def setup(rank_group):
        rank = rank_group.rank()
        buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK)
        x_s = first_x[rank].to(dev)
        _, _, _, handle, _ = buf.dispatch(x_s, idx[rank].to(dev), num_experts=EXPERTS, do_expand=expand,
                                          expert_alignment=align, do_zero_padding=expand)
        y_s = torch.zeros((handle.num_recv_rows, HIDDEN), dtype=torch.bfloat16, device=dev)
        buf.dispatch(x_s, handle=handle, do_zero_padding=expand)   # every kernel loaded, launches prepared
        buf.combine(y_s, handle)
        wait_for_stream()
        return buf, handle, x_s, y_s

    ranks = group.run(setup)
    try:
        def step(rank):
            buf, handle, x_s, y_s = ranks[rank]
            recv_x, _, _, _, _ = buf.dispatch(x_s, handle=handle, do_zero_padding=expand)
            combined, _, _ = buf.combine(y_s, handle)
            return recv_x, combined
        captured = rank_graphs.capture_rank_calls(group, [lambda r=r: step(r) for r in range(num_ranks)])
        assert captured is not None
        graph, outs = captured
        for _ in range(3):
            xs = new_x()
            exp = ref.reference_dispatch(xs, idx, None, EXPERTS, do_expand=expand, expert_alignment=align,
                                         num_max_tokens_per_rank=TOKENS)
            ys = [torch.randn((e.handle.num_recv_rows, HIDDEN), generator=g).to(torch.bfloat16) for e in exp]
            for (_, _, x_s, y_s), x, y in zip(ranks, xs, ys):
                x_s.copy_(x)
                y_s.copy_(y)
            for recv_x, combined in outs:
                outputs.fill_poison(recv_x)
                outputs.fill_poison(combined)
            graph.replay()
            torch.cuda.synchronize()
            combined_ref = ref.reference_combine(ys, [e.handle for e in exp])
            for rank, ((recv_x, combined), e) in enumerate(zip(outs, exp)):
                rows = e.num_valid_rows
                assert torch.equal(_bits(recv_x[:rows]), _bits(e.recv_x[:rows])), f"rank {rank}: recv_x"
                assert torch.equal(_bits(combined), _bits(combined_ref[rank][0])), f"rank {rank}: combined_x"
        times = rank_graphs.time_replays(graph, 5)
        assert times is not None and len(times) == 5 and all(t > 0 for t in times)
        del graph, outs, captured
        torch.cuda.synchronize()
    finally:
        group.run(lambda rank_group: ranks[rank_group.rank()][0].destroy())
