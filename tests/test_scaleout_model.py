"""Scale-out byte counts (deep_ep.bench.link_bytes) against deep_ep.reference, and the paper model
(deep_ep.bench.scaleout_model): closed form against seeded counts, the table's rows."""
from __future__ import annotations

import math

import pytest
import torch

from deep_ep import reference, resources, routing
from deep_ep.bench import link_bytes as lb
from deep_ep.bench import scaleout_model as model


def _routing(num_ranks, tokens, num_experts, num_topk, seed=0, mask=0.0):
    gen = torch.Generator().manual_seed(seed)
    idxs = [routing.balanced_routing(tokens - rank, num_experts, num_topk, generator=gen) for rank in range(num_ranks)]
    return [routing.mask_routing(idx, mask, generator=gen) if mask else idx for idx in idxs]


def _received(idxs, num_experts, hidden=16):
    """Per destination rank, its reference handle's (source rank, source token) of every received token."""
    xs = [torch.zeros(idx.shape[0], hidden, dtype=torch.bfloat16) for idx in idxs]
    results = reference.reference_dispatch(xs, idxs, None, num_experts)
    return [(r.handle.recv_src_rank.tolist(), r.handle.recv_src_token.tolist()) for r in results]


@pytest.mark.parametrize("num_ranks,node_ranks", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_counts_match_the_reference(num_ranks, node_ranks):
    num_experts, num_topk = 24 if num_ranks == 6 else 32, 4
    idxs = _routing(num_ranks, 40, num_experts, num_topk, mask=0.2)
    counts = lb.route_counts(idxs, num_experts, node_ranks)
    received = _received(idxs, num_experts)
    tokens = torch.zeros(num_ranks, num_ranks, dtype=torch.int64)
    reached = {}   # (source, node) -> source tokens some rank of the node received
    for dest, (ranks, toks) in enumerate(received):
        for src, tok in zip(ranks, toks):
            tokens[src, dest] += 1
            reached.setdefault((src, dest // node_ranks), set()).add(tok)
    assert tokens.sum() > 0
    assert torch.equal(counts.tokens, tokens)
    assert counts.nodes_reached.tolist() == [sum(len(reached.get((s, n), ())) for n in range(num_ranks // node_ranks))
                                             for s in range(num_ranks)]
    for src in range(num_ranks):
        for forwarder in range(num_ranks):
            same_rail = src % node_ranks == forwarder % node_ranks and src // node_ranks != forwarder // node_ranks
            want = len(reached.get((src, forwarder // node_ranks), ())) if same_rail else 0
            assert counts.slots[src, forwarder] == want
    # Rows forwarder f stores onward to d: tokens from its rail peers on other nodes that d receives.
    for forwarder in range(num_ranks):
        for dest in range(num_ranks):
            want = 0
            if dest // node_ranks == forwarder // node_ranks and dest != forwarder:
                want = sum(int(tokens[s, dest]) for s in range(num_ranks)
                           if s % node_ranks == forwarder % node_ranks and s // node_ranks != dest // node_ranks)
            assert counts.onward[forwarder, dest] == want


def test_bytes_follow_the_row_layouts():
    num_ranks, node_ranks, num_experts, hidden, num_topk = 8, 2, 32, 256, 4
    idxs = _routing(num_ranks, 48, num_experts, num_topk)
    counts = lb.route_counts(idxs, num_experts, node_ranks)
    sizes = lb.row_sizes(hidden, num_topk, fp8=True, num_sf=2, node_ranks=node_ranks)
    assert sizes.dispatch_row == 256 + 16 + 4 + 12 * 4 and sizes.combine_row == 512 + 16
    assert sizes.forward_slot == 272 + 16 + 48 + 16 and sizes.node_slot == 512 + 48
    direct = lb.link_bytes(idxs, num_experts, node_ranks, hybrid=False, hidden=hidden, fp8=True, num_sf=2)
    hybrid = lb.link_bytes(idxs, num_experts, node_ranks, hybrid=True, hidden=hidden, fp8=True, num_sf=2)
    rank_ids = torch.arange(num_ranks)
    cross = (rank_ids[:, None] // node_ranks) != (rank_ids[None, :] // node_ranks)
    # Direct: every (token, other rank) row once, on the link between the two ranks.
    off = counts.tokens * ~torch.eye(num_ranks, dtype=torch.bool)
    assert torch.equal(direct["dispatch"].rdma_rows, off * cross)
    assert torch.equal(direct["dispatch"].rdma, off * cross * sizes.dispatch_row + cross * lb.CALL_TAG_BYTES)
    assert torch.equal(direct["combine"].nvlink, (off * ~cross).T * sizes.combine_row)
    # Hybrid: RDMA only between rail peers, one slot per (token, node); every delivery is either
    # local (to itself or to the forwarder) or one NVLink row.
    dispatch = hybrid["dispatch"]
    rail = cross & ((rank_ids[:, None] % node_ranks) == (rank_ids[None, :] % node_ranks))
    assert int(dispatch.rdma_rows[~rail].sum()) == 0 and int(dispatch.rdma_rows.sum()) > 0
    local = sum(int(counts.tokens[s, d]) for s in range(num_ranks) for d in range(num_ranks)
                if s % node_ranks == d % node_ranks)
    assert int(dispatch.nvlink_rows.sum()) + local == int(counts.tokens.sum())
    assert int(dispatch.rdma_rows.sum()) < int(direct["dispatch"].rdma_rows.sum())
    assert torch.equal(hybrid["combine"].rdma_rows, dispatch.rdma_rows.T)
    assert torch.equal(dispatch.rdma, dispatch.rdma_rows * sizes.forward_slot + rail * 24)
    # One rank per node or one node: hybrid moves what direct moves.
    for nodes_of in (1, num_ranks):
        same = lb.link_bytes(idxs, num_experts, nodes_of, hybrid=True, hidden=hidden)
        other = lb.link_bytes(idxs, num_experts, nodes_of, hybrid=False, hidden=hidden)
        assert all(torch.equal(same[c].nvlink, other[c].nvlink) and torch.equal(same[c].rdma, other[c].rdma)
                   for c in ("dispatch", "combine"))


def test_deepep_logical_bytes():
    idxs = _routing(4, 30, 16, 4)
    counts = lb.route_counts(idxs, 16, 2)
    out = lb.deepep_logical_bytes(counts, 4, 2, hidden=128, fp8=True, num_sf=1)
    for src, idx in enumerate(idxs):
        nodes = int(lb.reach(idx, 16, 4).view(-1, 2, 2).any(2).sum())
        assert out["dispatch"]["scaleout"][src] == nodes * (128 + 4 + 48)
        assert out["combine"]["scaleout"][src] == nodes * (256 + 16)
    assert out["dispatch"]["scaleup"] == [int(n) * 180 for n in counts.tokens.sum(0)]
    assert lb.deepep_logical_bytes(counts, 4, 1, hidden=128)["dispatch"]["scaleout"] == [0] * 4
    with pytest.raises(ValueError):
        lb.deepep_logical_bytes(counts, 4, 4, hidden=128)
    with pytest.raises(ValueError):
        lb.route_counts(idxs, 16, 3)


@pytest.mark.parametrize("hybrid", [True, False])
def test_closed_form_matches_seeded_counts(hybrid):
    topology = model.Topology("test 4x2", 8, 4, 64, 450.0, 50.0, 132, "test")
    tokens, num_topk, hidden = 2048, 8, 512
    counts = lb.route_counts(model.seeded_routing(topology, tokens, num_topk), 64, 4)
    calls = lb.link_bytes_of_counts(counts, num_topk, hybrid=hybrid, hidden=hidden)
    expected = model.expected_link_bytes(topology, hybrid=hybrid, tokens=tokens, hidden=hidden, num_topk=num_topk,
                                         fp8=False)
    for call in ("dispatch", "combine"):
        for domain in lb.DOMAINS:
            mean = float(calls[call].domain(domain).sum(1).float().mean())
            assert mean > 0
            assert math.isclose(mean, expected[call][domain], rel_tol=0.02), (call, domain)
    k = resources.expected_ranks_per_token(64, num_topk, 8)
    assert math.isclose(float(counts.tokens.sum()) / (8 * tokens), k, rel_tol=0.01)


def test_model_rows_and_table():
    small = (model.Topology("EP 8x2", 4, 2, 16, 450.0, 50.0, 132, "test"),
             model.Topology("one", 4, 4, 16, 900.0, 0.0, 148, "test"))
    rows = model.model_rows(small, tokens=256, hidden=256, num_topk=4)
    assert [(r["topology"], r["mode"], r["call"], r["dtype"]) for r in rows][:3] == [
        ("EP 8x2", "hybrid", "dispatch", "FP8"), ("EP 8x2", "hybrid", "combine", "BF16"),
        ("EP 8x2", "hybrid", "dispatch", "BF16")]
    assert {r["mode"] for r in rows if r["topology"] == "one"} == {"one node"}
    first = rows[0]
    assert first["bottleneck"] == "rdma" and first["published_gbps"] == 90.0
    assert math.isclose(first["time_us"], first["rdma_bytes"] / 50e3)
    assert first["so_gbps"] > 0 and first["su_gbps"] > first["so_gbps"]
    one = [r for r in rows if r["topology"] == "one"][0]
    assert one["bottleneck"] == "nvlink" and one["rdma_bytes"] == 0 and one["so_gbps"] is None
    table = model.format_model(rows)
    assert table.count("\n") == len(rows) + 1 and "90 GB/s (SO), 12 SMs" in table


def test_paper_bandwidth_near_deepep_published():
    """The model's logical SO bandwidth for EP 8x2 / 8x4 (hybrid, FP8 dispatch) is the published one
    within the gap between a 400 Gb/s line rate and what a NIC achieves (they must not be far apart)."""
    for topology in model.TOPOLOGIES[:2]:
        rows = model.model_rows((topology,), tokens=1024, modes=("hybrid",))
        for row in rows[:2]:
            assert row["published_gbps"] <= row["so_gbps"] <= 1.3 * row["published_gbps"], row


def test_cpu_bench_across_nodes(tmp_path, capsys):
    """``python -m deep_ep bench --nvlink-ranks 2`` on 4 gloo ranks: both modes run and pass the check;
    the JSON's bytes are `link_bytes`' for the bench's routing."""
    import json

    from deep_ep.__main__ import main

    out = tmp_path / "scaleout.json"
    code = main(["bench", "--device", "cpu", "--ranks", "4", "--nvlink-ranks", "2", "--model", "deepseek-v2-lite",
                 "--tokens", "24", "--iters", "1", "--warmup", "0", "--fp8", "--bias", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "hybrid mode (logical domains 2 x 2)" in printed and "direct mode (logical domains 1 x 4)" in printed
    result = json.loads(out.read_text())
    hybrid, direct = result["modes"]
    assert hybrid["refused"] is None and not hybrid["mismatches"] and hybrid["checked"]
    from deep_ep.__main__ import build_parser
    from deep_ep.bench.config import Workload, make_config
    args = build_parser().parse_args(["bench", "--model", "deepseek-v2-lite", "--tokens", "24", "--fp8", "--bias", "1"])
    cfg = make_config(args, 4, gpu=False)
    idxs = [Workload(cfg).inputs(rank)["topk_idx"] for rank in range(4)]
    want = lb.link_bytes(idxs, cfg.num_experts, 2, hybrid=True, hidden=cfg.hidden, fp8=True, num_sf=cfg.num_sf)
    assert [row["dispatch_rdma_sent_bytes"] for row in hybrid["rows"]] == want["dispatch"].rdma.sum(1).tolist()
    assert hybrid["totals"]["combine"] == want["combine"].totals()
    assert all(row["dispatch_so_gbps"] > 0 for row in hybrid["rows"])
    assert all(row["dispatch_so_gbps"] is None and row["dispatch_su_gbps"] > 0 for row in direct["rows"])
    assert direct["totals"]["dispatch"]["rdma"] > hybrid["totals"]["dispatch"]["rdma"]


def test_bench_refuses_bad_nvlink_ranks():
    from deep_ep.__main__ import main

    with pytest.raises(SystemExit, match="must divide"):
        main(["bench", "--device", "cpu", "--ranks", "4", "--nvlink-ranks", "3", "--tokens", "4"])


def test_the_model_refuses_options_it_would_ignore():
    import argparse

    from deep_ep.bench import cli
    args = cli.add_arguments(argparse.ArgumentParser()).parse_args(["--scaleout-model", "--ranks", "32", "--fp8"])
    with pytest.raises(SystemExit, match="from --tokens and --seed only; it would ignore --fp8, --ranks"):
        cli.main(args)
