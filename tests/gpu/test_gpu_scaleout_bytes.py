"""The scale-out bench on emulated nodes (``--virtual-ranks R --nvlink-ranks N``), and the emulated GIN's
bytes against `deep_ep.bench.link_bytes` once the GIN counts them.

The byte counts the bench reports are computed from the routing (`deep_ep.bench.link_bytes`); the
last test compares them with what the emulated NIC carried, and is skipped until
`deep_ep.comm.gin` offers ``byte_counters(group) -> int64 [R, R]`` (bytes put by rank i to rank j
since the group was made, tags and headers included).
"""
from __future__ import annotations

import json

import pytest
import torch

from deep_ep.__main__ import build_parser, main
from deep_ep.bench import link_bytes as lb
from deep_ep.bench.config import Workload, make_config

ARGS = ["--model", "deepseek-v2-lite", "--tokens", "64", "--fp8"]


def _routing(num_ranks):
    cfg = make_config(build_parser().parse_args(["bench", *ARGS]), num_ranks, gpu=True)
    return cfg, [Workload(cfg).inputs(rank)["topk_idx"] for rank in range(num_ranks)]


@pytest.mark.parametrize("num_ranks,nvlink_ranks", [(4, 2), (8, 2)])
def test_bench_direct_mode_on_emulated_nodes(tmp_path, num_ranks, nvlink_ranks):
    out = tmp_path / "scaleout.json"
    code = main(["bench", "--virtual-ranks", str(num_ranks), "--nvlink-ranks", str(nvlink_ranks),
                 "--scaleout-mode", "direct", *ARGS, "--iters", "3", "--json", str(out)])
    assert code == 0
    (direct,) = json.loads(out.read_text())["modes"]
    assert direct["refused"] is None and direct["checked"] and not direct["mismatches"]
    cfg, idxs = _routing(num_ranks)
    want = lb.link_bytes(idxs, cfg.num_experts, nvlink_ranks, hybrid=False, hidden=cfg.hidden, fp8=True,
                         num_sf=cfg.num_sf)
    assert direct["totals"]["dispatch"] == want["dispatch"].totals()
    assert all(row["dispatch_us"] > 0 and row["dispatch_su_gbps"] > 0 for row in direct["rows"])


@pytest.mark.parametrize("num_ranks,nvlink_ranks", [(4, 2), (8, 2)])
def test_bench_hybrid_mode_on_emulated_nodes(tmp_path, num_ranks, nvlink_ranks):
    """Hybrid mode runs on emulated nodes and passes the check, combine in the hybrid order."""
    out = tmp_path / "scaleout.json"
    code = main(["bench", "--virtual-ranks", str(num_ranks), "--nvlink-ranks", str(nvlink_ranks),
                 "--scaleout-mode", "hybrid", *ARGS, "--iters", "3", "--json", str(out)])
    assert code == 0
    (hybrid,) = json.loads(out.read_text())["modes"]
    assert hybrid["refused"] is None and hybrid["checked"] and not hybrid["mismatches"]
    assert hybrid["logical_domains"] == [num_ranks // nvlink_ranks, nvlink_ranks]
    cfg, idxs = _routing(num_ranks)
    want = lb.link_bytes(idxs, cfg.num_experts, nvlink_ranks, hybrid=True, hidden=cfg.hidden, fp8=True,
                         num_sf=cfg.num_sf)
    assert hybrid["totals"]["dispatch"] == want["dispatch"].totals()
    assert all(row["dispatch_so_gbps"] > 0 and row["dispatch_su_gbps"] > 0 for row in hybrid["rows"])


@pytest.mark.parametrize("hybrid", [False, True])
def test_emulated_gin_bytes_match_link_bytes(hybrid):
    from deep_ep import ElasticBuffer, emulated
    from deep_ep.comm import gin

    counters = getattr(gin, "byte_counters", None)
    if counters is None:
        pytest.skip("the emulated GIN keeps no byte counters yet (deep_ep.comm.gin.byte_counters)")
    num_ranks, nvlink_ranks = 4, 2
    cfg, idxs = _routing(num_ranks)
    group = emulated.EmulatedGroup(num_ranks, num_nvlink_ranks=nvlink_ranks)

    def body(rank_group):
        rank = rank_group.rank()
        inputs = Workload(cfg).inputs(rank, torch.device("cuda"))
        buffer = ElasticBuffer(rank_group, num_max_tokens_per_rank=cfg.max_tokens, hidden=cfg.hidden,
                               num_topk=cfg.top_k, use_fp8_dispatch=True, allow_hybrid_mode=hybrid,
                               explicitly_destroy=True)
        try:
            before = counters(rank_group).clone() if rank == 0 else None
            rank_group.barrier()
            recv_x, _, _, handle, _ = buffer.dispatch(inputs["x"], topk_idx=inputs["topk_idx"],
                                                      topk_weights=inputs["topk_weights"],
                                                      num_experts=cfg.num_experts)
            torch.cuda.synchronize()
            rank_group.barrier()
            after_dispatch = counters(rank_group).clone() if rank == 0 else None
            y = recv_x[0].to(torch.bfloat16) if isinstance(recv_x, tuple) else recv_x
            buffer.combine(y, handle)
            torch.cuda.synchronize()
            rank_group.barrier()
            after_combine = counters(rank_group).clone() if rank == 0 else None
            return before, after_dispatch, after_combine
        finally:
            buffer.destroy()

    before, after_dispatch, after_combine = group.run(body)[0]
    want = lb.link_bytes(idxs, cfg.num_experts, nvlink_ranks, hybrid=hybrid, hidden=cfg.hidden, fp8=True,
                         num_sf=cfg.num_sf)
    assert torch.equal((after_dispatch - before).cpu(), want["dispatch"].rdma)
    assert torch.equal((after_combine - after_dispatch).cpu(), want["combine"].rdma)
