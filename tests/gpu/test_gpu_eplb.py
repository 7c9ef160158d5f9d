"""The EPLB replica-map kernel against its CPU specification (every element), under CUDA-graph
capture, and dispatch to replicas + combine on the GPU backend (EP=1 over torch's NCCL
communicator) equal to the run without replicas. Skipped without a CUDA device.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/gpu/test_gpu_eplb.py``.
"""
from __future__ import annotations

import pytest
import torch

from deep_ep.eplb import ReplicaMap, rebalance_experts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _plan(layers, E, N, G, seed):
    g = torch.Generator().manual_seed(seed)
    return rebalance_experts(torch.rand(layers, E, generator=g, dtype=torch.float64) ** 5, N, 1, 1, G)


def _ids(T, K, E, g, minus_one=0.2):
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < minus_one] = -1
    return idx


@pytest.mark.parametrize("E,N,G,K", [(256, 288, 32, 8), (8, 16, 4, 2), (128, 128, 8, 8), (1, 3, 1, 1)])
def test_kernel_matches_cpu(E, N, G, K):
    dev = torch.device("cuda", 0)
    plan = _plan(3, E, N, G, seed=E + N)
    cpu_map = ReplicaMap(*plan)
    gpu_map = ReplicaMap(*plan, device=dev)
    g = torch.Generator().manual_seed(1)
    for T in (0, 1, 7, 333, 4096):
        idx = _ids(T, K, E, g)
        for layer in range(3):
            for offset in (0, 12345, 2**32 - 3, 2**40 + 1):   # the hashed index wraps at 2**32
                want = cpu_map.map(idx, layer=layer, token_offset=offset)
                out = torch.full((T, K), 7777, dtype=torch.int64, device=dev)          # poisoned
                got = gpu_map.map(idx.to(dev), layer=layer, token_offset=offset, out=out)
                assert got is out and torch.equal(got.cpu(), want), (T, layer, offset)
    # plan tensors given on the GPU, a non-contiguous input, one layer kept
    one = ReplicaMap(*(t.to(dev) for t in plan), layer=2)
    idx = _ids(64, 2 * K, E, g)
    strided = idx.to(dev)[:, ::2]
    assert not strided.is_contiguous()
    assert torch.equal(one.map(strided).cpu(), cpu_map.map(idx[:, ::2].contiguous(), layer=2))


def test_out_of_range_ids_on_gpu():
    dev = torch.device("cuda", 0)
    rmap = ReplicaMap(*_plan(1, 16, 24, 4, seed=3), device=dev)
    idx = torch.tensor([[0, 16, -1], [-5, 15, 2**40]], device=dev)
    got = rmap.map(idx).cpu()
    assert got[0, 1] == -1 and got[0, 2] == -1 and got[1, 0] == -1 and got[1, 2] == -1
    assert got[0, 0] >= 0 and got[1, 1] >= 0
    with pytest.raises(ValueError, match="outside"):
        rmap.map(idx, check=True)


def test_kernel_under_cuda_graph_capture():
    dev = torch.device("cuda", 0)
    plan = _plan(2, 256, 288, 32, seed=9)
    rmap = ReplicaMap(*plan).to(dev)
    g = torch.Generator().manual_seed(2)
    static_in = _ids(4096, 8, 256, g).to(dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):      # warm-up outside capture: the module loads here
        rmap.map(static_in, layer=1)
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = rmap.map(static_in, layer=1, token_offset=4096)
    for _ in range(3):
        idx = _ids(4096, 8, 256, g)
        static_in.copy_(idx)
        static_out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out.cpu(), ReplicaMap(*plan).map(idx, layer=1, token_offset=4096))


def test_dispatch_to_replicas_on_gpu(nccl_group):
    """EP=1: every slot is local, so this checks the GPU dispatch/combine with num_experts =
    num_replicas and the expert function of the logical id; the multi-rank equivalence runs on
    CPU (tests/test_eplb_ranks.py) and emulated ranks would add nothing the kernel path differs in."""
    import deep_ep
    dev = torch.device("cuda", 0)
    E, N, K, H, T = 32, 48, 4, 256, 512
    g = torch.Generator().manual_seed(4)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]      # distinct experts per token, as a gate gives
    idx[torch.rand(T, K, generator=g) < 0.1] = -1
    x = torch.randint(-3, 4, (T, H), generator=g).to(torch.bfloat16)
    w = torch.randint(1, 3, (T, K), generator=g).to(torch.float32)
    load = torch.bincount(idx[idx >= 0], minlength=E).double() * (1 + 9 * (torch.arange(E) < 3))
    p2l, l2p, count = rebalance_experts(load, N, 1, 1, 1)
    rmap = ReplicaMap(p2l, l2p, count, device=dev)
    buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)

    def run(topk, num_experts, logical_of):
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x.to(dev), topk, w.to(dev), num_experts=num_experts)
        valid = recv_idx >= 0
        logical = logical_of[recv_idx.clamp(min=0)]
        scale = torch.where(valid, recv_w * (logical + 1).float(), torch.zeros_like(recv_w)).sum(1)
        out, _, _ = buf.combine((recv_x.float() * scale[:, None]).to(torch.bfloat16), handle)
        return out.cpu()

    try:
        plain = run(idx.to(dev), E, torch.arange(E, device=dev))
        physical = rmap.map(idx.to(dev))
        replicas = run(physical, N, p2l.to(dev))
        want = sum(w[:, k:k + 1] * (idx[:, k:k + 1] + 1) * (idx[:, k:k + 1] >= 0) for k in range(K)) * x.float()
        assert torch.equal(plain.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
        assert torch.equal(replicas.view(torch.int16), plain.view(torch.int16))
        assert physical.cpu()[(idx >= 0) & (idx < 3)].unique().numel() > 3, "hot experts' tokens should reach several replicas"
    finally:
        buf.destroy()


def test_dispatch_to_replicas_emulated_ep4():
    """4 emulated ranks: tokens mapped to replicas on the GPU, dispatched with num_experts =
    num_replicas, experts computed from the logical id, combined: equal (bitwise) to the run
    without replicas, on every rank."""
    import deep_ep
    from deep_ep.emulated import EmulatedGroup
    dev = torch.device("cuda", 0)
    group = EmulatedGroup(4, device=dev)
    R, E, N, K, H, T = 4, 16, 24, 4, 128, 96
    g = torch.Generator().manual_seed(6)
    idx = [torch.rand(T, E, generator=g).argsort(dim=1)[:, :K] for _ in range(R)]
    for i in idx:
        i[torch.rand(T, K, generator=g) < 0.1] = -1
    xs = [torch.randint(-3, 4, (T, H), generator=g).to(torch.bfloat16) for _ in range(R)]
    ws = [torch.randint(1, 3, (T, K), generator=g).to(torch.float32) for _ in range(R)]
    load = torch.ones(E, dtype=torch.float64)
    load[[1, 9]] = 12.0
    p2l, l2p, count = rebalance_experts(load, N, 1, 1, R)
    rmap = ReplicaMap(p2l, l2p, count, device=dev)
    rmap.map(idx[0].to(dev))            # load the kernel before the ranks start spinning
    torch.cuda.synchronize()

    def body(rank_group):
        r = rank_group.rank()
        buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
        try:
            def run(topk, num_experts, logical_of):
                recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(xs[r].to(dev), topk, ws[r].to(dev),
                                                                   num_experts=num_experts)
                local = num_experts // R
                logical = logical_of[r * local + recv_idx.clamp(min=0)]
                scale = torch.where(recv_idx >= 0, recv_w * (logical + 1).float(), torch.zeros_like(recv_w)).sum(1)
                out, _, _ = buf.combine((recv_x.float() * scale[:, None]).to(torch.bfloat16), handle)
                return out.cpu()
            plain = run(idx[r].to(dev), E, torch.arange(E, device=dev))
            replicas = run(rmap.map(idx[r].to(dev), token_offset=r * T), N, p2l.to(dev))
            return plain, replicas
        finally:
            buf.destroy()

    for r, (plain, replicas) in enumerate(group.run(body)):
        want = sum(ws[r][:, k:k + 1] * (idx[r][:, k:k + 1] + 1) * (idx[r][:, k:k + 1] >= 0) for k in range(K)) * xs[r].float()
        assert torch.equal(plain.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)), r
        assert torch.equal(replicas.view(torch.int16), plain.view(torch.int16)), r


def test_monitor_and_weight_move_on_nccl(nccl_group):
    """The device paths at EP=1 over torch's NCCL communicator: counters on the GPU folded and
    all-reduced, the plan broadcast; expert tensors on the GPU moved (all local) and voted on."""
    from deep_ep.eplb import ExpertPlacement, LoadMonitor
    dev = torch.device("cuda", 0)
    E = 8
    monitor = LoadMonitor(nccl_group, 2, E)
    assert monitor.stats(0).device.type == "cuda" and monitor.stats(0).shape == (E,)
    counts = torch.tensor([[50, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 40]], dtype=torch.int32)
    for layer in range(2):
        monitor.stats(layer).add_(counts[layer].to(dev))
    assert torch.equal(monitor.global_load(), counts.to(torch.int64))
    p2l, l2p, count = monitor.plan(12)
    assert count[0, 0] >= 2 and count[1, 7] >= 2
    weights = {"w": torch.randn(E, 4, 16, device=dev).to(torch.bfloat16), "b": torch.arange(E, device=dev)}
    placement = ExpertPlacement(weights, torch.arange(E), nccl_group)
    placement.prepare(p2l[0])
    assert placement.tensors["w"] is weights["w"]
    moved = placement.switch()
    assert torch.equal(moved["b"].cpu(), p2l[0])
    assert torch.equal(moved["w"].cpu(), weights["w"].cpu()[p2l[0]])
    monitor.switch(p2l)
    monitor.stats(1).fill_(1)
    want = torch.zeros(2, E, dtype=torch.int64)
    want[1] = torch.bincount(p2l[1], minlength=E)
    assert torch.equal(monitor.global_load(), want)
