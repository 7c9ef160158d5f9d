"""Expert load balancing over 2 gloo ranks: dispatch to replicas then combine gives the result of
dispatch without replicas; the load monitor sums dispatch's statistics over ranks and plans; expert
weights move to a new placement, and a failure half-way leaves the old placement intact."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from proc_utils import run_gloo_ranks

E, K, H, T = 8, 3, 64, 40      # logical experts, top-k, hidden, tokens per rank


def _leave_together():
    """A final barrier: without it, a rank that tore down gloo while its peer was still finishing
    the last collective aborted at interpreter exit ("terminate called without an active
    exception") in about one run in ten here."""
    dist.barrier()


def _routing(world, seed):
    """Every rank's topk_idx (skewed: expert 5 is hot), x (small integers, exact in bf16) and
    weights (1 or 2), from one seed, so that every rank knows all of them."""
    from deep_ep.routing import zipf_routing
    g = torch.Generator().manual_seed(seed)
    order = torch.tensor([5, 2, 7, 0, 1, 3, 4, 6])
    idx = [zipf_routing(T, E, K, alpha=1.5, popularity_order=order, generator=g) for _ in range(world)]
    for i in idx:
        i[torch.rand(T, K, generator=g) < 0.15] = -1
    xs = [torch.randint(-3, 4, (T, H), generator=g).to(torch.bfloat16) for _ in range(world)]
    ws = [torch.randint(1, 3, (T, K), generator=g).to(torch.float32) for _ in range(world)]
    return idx, xs, ws


def _experts(recv_x, recv_idx, recv_w, logical_of_local):
    """Expert outputs of non-expanded rows: row r -> sum over its local slots k of
    w[r, k] * (logical expert + 1) * x[r] (exact in bf16 for these inputs)."""
    valid = recv_idx >= 0
    logical = logical_of_local[recv_idx.clamp(min=0)]
    scale = torch.where(valid, recv_w * (logical + 1).to(torch.float32), torch.zeros_like(recv_w)).sum(1)
    return (recv_x.float() * scale[:, None]).to(torch.bfloat16)


def _dispatch_to_replicas(rank, world):
    import deep_ep
    from deep_ep.backends import outputs
    from deep_ep.eplb import LoadMonitor, ReplicaMap, rebalance_experts
    idx, xs, ws = _routing(world, seed=11)
    load = torch.bincount(torch.cat(idx).flatten().clamp(min=0), weights=(torch.cat(idx).flatten() >= 0).double(),
                          minlength=E)
    want = sum(ws[rank][:, k:k + 1] * (idx[rank][:, k:k + 1] + 1) * (idx[rank][:, k:k + 1] >= 0)
               for k in range(K)) * xs[rank].float()
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    with outputs.poisoned():
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(xs[rank], idx[rank], ws[rank], num_experts=E)
        local = torch.arange(E // world) + rank * (E // world)
        plain, _, _ = buf.combine(_experts(recv_x, recv_idx, recv_w, local), handle)
    assert torch.equal(plain.float(), want.to(torch.bfloat16).float())
    for name, (N, groups, nodes) in {"global": (12, 1, 1), "hierarchical": (16, 2, 2)}.items():
        # plan from an exaggerated load (with 2 GPUs, the measured one needs no replica)
        p2l, l2p, count = rebalance_experts(load * (1 + 9 * (torch.arange(E) == 5)), N, groups, nodes, world)
        assert count[5] >= 2, "the hot expert should be replicated"
        rmap = ReplicaMap(p2l, l2p, count, num_logical_experts=E, num_physical_experts=N)
        physical = rmap.map(idx[rank], token_offset=rank * T)
        monitor = LoadMonitor(None, 1, E, physical_to_logical=p2l)
        stats = monitor.stats(0)
        with outputs.poisoned():
            recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(xs[rank], physical, ws[rank], num_experts=N,
                                                               cumulative_local_expert_recv_stats=stats)
            slots = N // world
            y = _experts(recv_x, recv_idx, recv_w, p2l[rank * slots:(rank + 1) * slots])
            out, _, _ = buf.combine(y, handle)
        assert torch.equal(out.view(torch.int16), plain.view(torch.int16)), f"{name}: combine differs"
        # the hot expert's tokens (over both ranks) reached more than one replica
        hot = torch.cat([rmap.map(i, token_offset=r * T) for r, i in enumerate(idx)])[torch.cat(idx) == 5]
        assert hot.unique().numel() == count[5] >= 2
        # the monitor folds the physical counters back onto logical experts and sums the ranks
        assert torch.equal(monitor.global_load()[0], load.to(torch.int64))
    buf.destroy()
    _leave_together()
    return True


def test_dispatch_to_replicas_then_combine_matches_plain(tmp_path):
    assert all(run_gloo_ranks(_dispatch_to_replicas, 2, tmp_path).values())


def _monitor(rank, world):
    from deep_ep.eplb import LoadMonitor, rebalance_experts
    L, N = 3, 12
    g = torch.Generator().manual_seed(5)
    p2l = torch.stack([torch.cat([torch.arange(E), torch.randint(0, E, (N - E,), generator=g)])[torch.randperm(N, generator=g)]
                       for _ in range(L)])
    counts = torch.randint(0, 50, (world, 4, L, N // world), generator=g, dtype=torch.int32)
    monitor = LoadMonitor(None, L, E, physical_to_logical=p2l)
    assert monitor.num_physical_experts == N and monitor.stats(0).shape == (N // world,)
    for step in range(4):
        for layer in range(L):
            if step % 2:
                monitor.add(layer, counts[rank, step, layer])
            else:
                monitor.stats(layer).add_(counts[rank, step, layer])   # as dispatch does
    want = torch.zeros(L, E, dtype=torch.int64)
    for r in range(world):
        local = p2l[:, r * (N // world):(r + 1) * (N // world)]
        want.scatter_add_(1, local, counts[r].sum(0).to(torch.int64))
    assert torch.equal(monitor.global_load(), want)
    plan = monitor.plan(16, 2, 2)
    expected = rebalance_experts(want, 16, 2, 2, world)
    assert all(torch.equal(a, b) for a, b in zip(plan, expected))
    assert not monitor.global_load().any(), "plan(reset=True) forgets the load"
    # after a switch, counters are folded through the new placement
    monitor.switch(plan[0])
    assert monitor.stats(1).shape == (8,)
    monitor.stats(1).fill_(1)
    got = monitor.global_load()
    want = torch.zeros(L, E, dtype=torch.int64)
    want[1].scatter_add_(0, plan[0][1], torch.ones(16, dtype=torch.int64))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="multiple of num_gpus"):
        monitor.plan(13)
    with pytest.raises(ValueError, match="shape"):
        monitor.add(0, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="layer"):
        monitor.stats(3)
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        monitor.switch(torch.arange(E).repeat(2)[:15])
    _leave_together()
    return True


def test_load_monitor_two_ranks(tmp_path):
    assert all(run_gloo_ranks(_monitor, 2, tmp_path).values())


def _expert_tensors(p2l, rank, world):
    """Tensors whose rows are a function of the logical expert they hold."""
    slots = p2l.numel() // world
    mine = p2l[rank * slots:(rank + 1) * slots]
    rows = {"ids": [], "up": [], "bias": []}
    for e in mine.tolist():
        g = torch.Generator().manual_seed(100 + e)
        rows["ids"].append(torch.tensor(e * 7))
        rows["up"].append(torch.randn(3, 5, generator=g))
        rows["bias"].append(torch.randn(6, generator=g).to(torch.bfloat16))
    return {k: torch.stack(v) for k, v in rows.items()}


def _weights(rank, world):
    from deep_ep.eplb import ExpertMoveError, ExpertPlacement, rebalance_experts
    from deep_ep.eplb import weights as weights_module
    old = torch.arange(E)
    g = torch.Generator().manual_seed(3)
    new = rebalance_experts(torch.rand(E, generator=g) ** 3, 12, 1, 1, world)[0]
    current = _expert_tensors(old, rank, world)
    saved = {k: v.clone() for k, v in current.items()}
    placement = ExpertPlacement(current, old)

    # a failure after the first tensors were exchanged, on rank 1 only
    real_unpack = weights_module._unpack

    def failing_unpack(name, *args):
        if rank == 1 and name == "ids":
            raise RuntimeError("simulated failure")
        return real_unpack(name, *args)

    weights_module._unpack = failing_unpack
    with pytest.raises(ExpertMoveError, match="old tensors are unchanged"):
        placement.prepare(new)
    weights_module._unpack = real_unpack
    assert placement.staged is None and placement.tensors.keys() == saved.keys()
    for k in saved:
        assert placement.tensors[k] is current[k] and torch.equal(current[k], saved[k])
    assert torch.equal(placement.physical_to_logical, old)

    # bad input on one rank: that rank raises its error, the other learns of it; nothing moves
    bad = dict(current, up=current["up"][:3]) if rank == 1 else current
    with pytest.raises(ValueError, match="rows" if rank == 1 else "another rank"):
        weights_module.move_expert_weights(bad, old, new)
    with pytest.raises(ValueError, match="different placements"):
        weights_module.move_expert_weights(current, old, new if rank == 0 else new.flip(0))

    # the group still works: the move succeeds, and only switch() adopts it
    staged = placement.prepare(new)
    assert placement.tensors["up"] is current["up"]
    got = placement.switch()
    assert got is staged and torch.equal(placement.physical_to_logical, new)
    want = _expert_tensors(new, rank, world)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    with pytest.raises(RuntimeError, match="nothing prepared"):
        placement.switch()
    # the same placement: local copies only, no exchange called
    same = weights_module.move_expert_weights(got, new, new)
    assert all(torch.equal(same[k], got[k]) and same[k] is not got[k] for k in got)
    # and back again, from the replicated placement
    back = weights_module.move_expert_weights(got, new, old)
    for k in saved:
        assert torch.equal(back[k], saved[k])
    _leave_together()
    return True


def test_move_expert_weights_two_ranks(tmp_path):
    assert all(run_gloo_ranks(_weights, 2, tmp_path).values())
