"""The scale-out bench on emulated nodes (``--virtual-ranks R --nvlink-ranks N``), and the bytes the
emulated GIN carried against `deep_ep.bench.link_bytes`.

The byte counts the bench reports are computed from the routing (`deep_ep.bench.link_bytes`); the
last test compares them, per (source, destination), with what the emulated NICs carried
(`deep_ep.comm.gin.byte_counters`) around a fresh dispatch (its notify stage included:
``notify=True``), a cached dispatch and a combine.
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
    assert all(m["per_link_equal"] and m["rdma"] > 0 for m in direct["measured"].values()), direct["measured"]


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
    assert all(m["per_link_equal"] and m["rdma"] > 0 for m in hybrid["measured"].values()), hybrid["measured"]


@pytest.mark.parametrize("hybrid,within_node", [(False, False), (True, False), (False, True)],
                         ids=["direct", "hybrid", "direct-gin-within-node"])
def test_emulated_gin_bytes_match_link_bytes(hybrid, within_node):
    """Every entry of the NIC's [R, R] byte counters equals link_bytes' RDMA bytes of that call.

    Domains: with the default settings the NIC carries only puts between nodes, so its counters are
    the ``rdma`` domain and stay 0 between ranks of one node. With ``gin_within_node=True`` (direct
    mode) every peer is a GIN peer: the counters equal link_bytes of one rank per node, and their
    entries between ranks of one emulated node (the ``nvlink`` domain, carried by the NIC) hold that
    node's rows (link_bytes' ``nvlink``) plus the tags and count rows a GIN peer gets."""
    from deep_ep import ElasticBuffer, emulated
    from deep_ep.comm import gin

    num_ranks, nvlink_ranks = 4, 2
    cfg, idxs = _routing(num_ranks)
    settings = gin.EmulatedGinSettings(gin_within_node=within_node)
    group = emulated.EmulatedGroup(num_ranks, num_nvlink_ranks=nvlink_ranks, gin_settings=settings)

    def body(rank_group):
        rank = rank_group.rank()
        inputs = Workload(cfg).inputs(rank, torch.device("cuda"))
        buffer = ElasticBuffer(rank_group, num_max_tokens_per_rank=cfg.max_tokens, hidden=cfg.hidden,
                               num_topk=cfg.top_k, use_fp8_dispatch=True, allow_hybrid_mode=hybrid,
                               explicitly_destroy=True)
        readings = []

        def settle():
            # every rank's kernels (and NIC kernels) done, then rank 0 reads while the others wait
            buffer.barrier()
            if rank == 0:
                readings.append(gin.byte_counters(rank_group))
            rank_group.barrier()

        try:
            settle()
            recv_x, _, _, handle, _ = buffer.dispatch(inputs["x"], topk_idx=inputs["topk_idx"],
                                                      topk_weights=inputs["topk_weights"],
                                                      num_experts=cfg.num_experts)
            settle()
            buffer.dispatch(inputs["x"], handle=handle)
            settle()
            y = recv_x[0].to(torch.bfloat16) if isinstance(recv_x, tuple) else recv_x
            buffer.combine(y, handle)
            settle()
            if rank == 0:
                gin.reset_byte_counters(rank_group)
                assert int(gin.byte_counters(rank_group).abs().sum()) == 0
            rank_group.barrier()
            return readings
        finally:
            buffer.destroy()

    readings = group.run(body)[0]
    fresh, cached, combine = (after - before for before, after in zip(readings, readings[1:]))
    common = dict(hybrid=hybrid, hidden=cfg.hidden, fp8=True, num_sf=cfg.num_sf)
    want = lb.link_bytes(idxs, cfg.num_experts, nvlink_ranks, **common)
    want_fresh = lb.link_bytes(idxs, cfg.num_experts, nvlink_ranks, notify=True, **common)["dispatch"]
    ranks = torch.arange(num_ranks)
    same_node = (ranks[:, None] // nvlink_ranks) == (ranks[None, :] // nvlink_ranks)
    assert int(fresh.sum()) > int(cached.sum()) > 0 and int(combine.sum()) > 0
    if not within_node:
        assert torch.equal(fresh, want_fresh.rdma)
        assert torch.equal(cached, want["dispatch"].rdma)
        assert torch.equal(combine, want["combine"].rdma)
        assert int(fresh[same_node].abs().sum()) == 0
        return
    flat = lb.link_bytes(idxs, cfg.num_experts, 1, **common)
    flat_fresh = lb.link_bytes(idxs, cfg.num_experts, 1, notify=True, **common)["dispatch"]
    assert torch.equal(fresh, flat_fresh.rdma)
    assert torch.equal(cached, flat["dispatch"].rdma)
    assert torch.equal(combine, flat["combine"].rdma)
    # the nvlink domain carried by the NIC: the node's rows plus what every GIN peer gets
    off_diagonal = same_node & ~torch.eye(num_ranks, dtype=torch.bool)
    control = off_diagonal.long() * lb.CALL_TAG_BYTES
    # a fresh dispatch's notify stage: a count row and its own call tag to every GIN peer
    notify = off_diagonal.long() * (lb.count_row_bytes(num_ranks, cfg.num_experts) + lb.CALL_TAG_BYTES)
    assert torch.equal(cached * same_node, want["dispatch"].nvlink + control)
    assert torch.equal(fresh * same_node, want["dispatch"].nvlink + control + notify)
    assert torch.equal(combine * same_node, want["combine"].nvlink + control)
    assert torch.equal(cached * ~same_node, want["dispatch"].rdma)
