"""Expert load balancing (deep_ep.eplb) on CPU: plan invariants and quality, the replica map (and
its kernel compiling under NVRTC), bad input. The multi-rank parts (dispatch to replicas, load
monitor, weight moving over gloo) are in test_eplb_ranks.py."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from deep_ep import eplb
from deep_ep.eplb import ReplicaMap, gpu_loads, hierarchy_bound, rebalance_experts, replica_hash
from deep_ep.eplb.validate import check_plan


def zipf_loads(num_layers, num_experts, alpha, seed):
    """Per-layer loads: a Zipf(alpha) popularity, permuted independently in every layer."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** alpha
    p = p / p.sum()
    return torch.stack([p[torch.randperm(num_experts, generator=g)] for _ in range(num_layers)])


def check_invariants(w, plan, N, groups, nodes, G):
    p2l, l2p, count = plan
    L, E = w.shape
    assert p2l.shape == (L, N) and l2p.shape == (L, E, N - E + 1) and count.shape == (L, E)
    assert p2l.dtype == l2p.dtype == count.dtype == torch.int64
    check_plan(p2l, l2p, count)       # inverse maps, counts, -1 padding, each slot listed once
    assert (count >= 1).all() and (count.sum(1) == N).all()
    for layer in range(L):
        assert torch.equal(torch.bincount(p2l[layer], minlength=E), count[layer])
    if nodes > 1 and groups % nodes == 0:
        per_node = N // nodes
        node_of_slot = torch.arange(N) // per_node
        group_of_expert = p2l // (E // groups)
        for layer in range(L):
            for gr in range(groups):
                nodes_used = node_of_slot[group_of_expert[layer] == gr].unique()
                assert nodes_used.numel() == 1, f"group {gr} spans nodes {nodes_used.tolist()}"
            groups_per_node = [group_of_expert[layer][node_of_slot == n].unique().numel() for n in range(nodes)]
            assert groups_per_node == [groups // nodes] * nodes


CONFIGS = [  # (E, N, groups, nodes, G)
    (16, 24, 4, 2, 4), (16, 24, 4, 1, 4), (16, 16, 4, 2, 4), (8, 16, 2, 2, 8), (4, 8, 1, 1, 8),
    (32, 40, 8, 4, 8), (48, 54, 6, 3, 6), (12, 12, 3, 1, 1), (1, 4, 1, 1, 2),
    (64, 96, 16, 4, 16), (16, 32, 16, 16, 16),
]


@pytest.mark.parametrize("E,N,groups,nodes,G", CONFIGS)
def test_plan_invariants_random_loads(E, N, groups, nodes, G):
    g = torch.Generator().manual_seed(E * 1000 + N + nodes)
    for kind in ("skewed", "uniform", "integer", "sparse"):
        if kind == "skewed":
            w = torch.rand(5, E, generator=g, dtype=torch.float64) ** 6 * 1000
        elif kind == "uniform":
            w = torch.rand(5, E, generator=g, dtype=torch.float64) + 1
        elif kind == "integer":
            w = torch.randint(0, 10_000, (5, E), generator=g)
        else:
            w = (torch.rand(5, E, generator=g) < 0.2).to(torch.int32) * 50
        plan = rebalance_experts(w, N, groups, nodes, G)
        check_invariants(w.to(torch.float64), plan, N, groups, nodes, G)
        again = rebalance_experts(w.clone(), N, groups, nodes, G)
        assert all(torch.equal(a, b) for a, b in zip(plan, again)), "planning is not deterministic"
        # never worse than keeping the experts where they are (when that placement exists)
        loads = gpu_loads(w, plan[0], plan[2], G)
        assert torch.allclose(loads.sum(1), w.to(torch.float64).sum(1))
        if N == E and not (nodes > 1 and groups % nodes == 0):
            static = eplb.static_gpu_loads(w, G)
            assert (loads.max(1).values <= static.max(1).values * (1 + 1e-9)).all()


def test_one_dimensional_weight_and_zero_loads():
    w = torch.tensor([5.0, 0.0, 1.0, 9.0, 3.0, 0.0])
    p2l, l2p, count = rebalance_experts(w, 9, 1, 1, 3)
    assert p2l.shape == (9,) and l2p.shape == (6, 4) and count.shape == (6,)
    full = rebalance_experts(w[None], 9, 1, 1, 3)
    assert torch.equal(p2l, full[0][0]) and torch.equal(l2p, full[1][0]) and torch.equal(count, full[2][0])
    check_invariants(torch.zeros(2, 6), rebalance_experts(torch.zeros(2, 6), 12, 2, 2, 4), 12, 2, 2, 4)


def test_hot_expert_is_split_evenly():
    """One expert with 10x the others' load is replicated over the GPUs (8 GPUs of 3 slots: the
    slot granularity keeps the best plan a few percent above the mean)."""
    w = torch.ones(1, 8)
    w[0, 3] = 10.0
    p2l, _, count = rebalance_experts(w, 24, 1, 1, 8)
    assert count[0, 3] >= 8
    loads = gpu_loads(w, p2l, count, 8)
    assert loads.max() <= loads.mean() * 1.06


def test_hierarchy_bound_is_exact():
    g = torch.Generator().manual_seed(7)
    w = torch.rand(3, 24, generator=g, dtype=torch.float64) ** 3
    got = hierarchy_bound(w, 6, 3)
    group_load = w.reshape(3, 6, 4).sum(2)
    for layer in range(3):
        best = float("inf")
        for assign in itertools.product(range(3), repeat=6):
            if sorted(assign) != [0, 0, 1, 1, 2, 2]:
                continue
            node = torch.zeros(3, dtype=torch.float64).index_add_(0, torch.tensor(assign), group_load[layer])
            best = min(best, float(node.max()))
        assert got[layer] == pytest.approx(best * 3 / float(w[layer].sum()), rel=1e-12)


def test_quality_targets_256_experts_32_gpus():
    """The targets of docs/eplb.md on the benchmark's loads (tools/eplb_bench.py prints them):
    global max/mean <= 1.05 in every layer; hierarchical within 10% of the hierarchy's bound."""
    w = zipf_loads(61, 256, 1.2, seed=0)
    p2l, _, count = rebalance_experts(w, 288, 8, 1, 32)
    loads = gpu_loads(w, p2l, count, 32)
    assert (loads.max(1).values / loads.mean(1)).max() <= 1.05
    p2l, l2p, count = rebalance_experts(w, 288, 8, 4, 32)
    check_invariants(w, (p2l, l2p, count), 288, 8, 4, 32)
    loads = gpu_loads(w, p2l, count, 32)
    ratio = loads.max(1).values / loads.mean(1) / hierarchy_bound(w, 8, 4)
    assert ratio.min() >= 1 - 1e-9 and ratio.max() <= 1.10


def _plan(E=8, N=12, G=2, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(layers, E, generator=g, dtype=torch.float64) ** 4
    return rebalance_experts(w, N, 1, 1, G)


def test_replica_map_spec_and_spread():
    p2l, l2p, count = _plan(E=8, N=16, G=4, layers=3)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, 8, (4096, 4), generator=g)
    rmap = ReplicaMap(p2l, l2p, count)
    for layer in range(3):
        out = rmap.map(idx, layer=layer)
        assert out.dtype == torch.int64 and out.shape == idx.shape
        assert torch.equal(out < 0, idx < 0)
        valid = idx >= 0
        assert torch.equal(p2l[layer][out[valid]], idx[valid])
        # spec, element by element: replica = hash(row, expert) % count
        rows = torch.arange(4096)[:, None].expand(4096, 4)
        e = idx.clamp(min=0)
        want = l2p[layer][e, replica_hash(rows, e) % count[layer][e]]
        assert torch.equal(out[valid], want[valid])
        assert torch.equal(out, rmap.map(idx.clone(), layer=layer)), "not deterministic"
        one = ReplicaMap(p2l, l2p, count, layer=layer)
        assert torch.equal(one.map(idx), out)
        assert torch.equal(ReplicaMap(p2l[layer], l2p[layer], count[layer]).map(idx), out)
        # every replica of a replicated expert gets a fair share of its tokens
        for expert in torch.nonzero(count[layer] > 1).flatten().tolist():
            hits = torch.bincount(out[idx == expert], minlength=16)[l2p[layer, expert, :count[layer, expert]]]
            share = hits.sum() / count[layer, expert]
            assert hits.min() > 0.8 * share and hits.max() < 1.2 * share, hits.tolist()
    shifted = rmap.map(idx, layer=0, token_offset=4096)
    assert not torch.equal(shifted, rmap.map(idx, layer=0))
    # the hashed token index is row + token_offset: a tail mapped alone with its offset is unchanged
    assert torch.equal(rmap.map(idx[1000:], layer=0, token_offset=1000), rmap.map(idx, layer=0)[1000:])
    out = torch.full_like(idx, 12345)
    assert rmap.map(idx, layer=1, out=out) is out and torch.equal(out, rmap.map(idx, layer=1))
    assert rmap.map(torch.empty(0, 4, dtype=torch.int64), layer=0).shape == (0, 4)


def test_replica_hash_matches_32_bit_arithmetic():
    def ref(t, e):
        h = ((t * 0x9E3779B1) ^ ((e + 1) * 0x85EBCA77)) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x846CA68B) & 0xFFFFFFFF
        return h ^ (h >> 16)
    g = torch.Generator().manual_seed(3)
    tokens = torch.cat([torch.randint(0, 2**32, (500,), generator=g), torch.tensor([0, 1, 2**32 - 1, 2**31])])
    experts = torch.randint(0, 4096, (tokens.numel(),), generator=g)
    got = replica_hash(tokens, experts).tolist()
    assert got == [ref(int(t), int(e)) for t, e in zip(tokens, experts)]


def test_map_kernel_compiles_with_nvrtc():
    from deep_ep import jit
    mod = jit.build("deep_ep_eplb", "#include <deep_ep/kernels/eplb.cuh>\n", check_spills=True)
    assert "deep_ep_eplb_map" in mod.kernel_names()


def test_bad_input():
    w = torch.rand(2, 8)
    cases = [
        (dict(weight=[1.0, 2.0]), TypeError, "torch.Tensor"),
        (dict(weight=torch.ones(2, 8, dtype=torch.bool)), TypeError, "float or integer"),
        (dict(weight=torch.ones(2, 2, 8)), ValueError, "num_layers"),
        (dict(weight=torch.tensor([[1.0, -1.0] * 4])), ValueError, "negative"),
        (dict(weight=torch.tensor([[1.0, float("nan")] * 4])), ValueError, "NaN"),
        (dict(weight=torch.tensor([[1.0, float("inf")] * 4])), ValueError, "infinite"),
        (dict(num_replicas=13), ValueError, "multiple of num_gpus"),
        (dict(num_replicas=6, num_gpus=2), ValueError, "at least the number of logical experts"),
        (dict(num_groups=3), ValueError, "must divide the number of experts"),
        (dict(num_nodes=3), ValueError, "must divide num_gpus"),
        (dict(num_gpus=0), ValueError, ">= 1"),
        (dict(num_replicas=12.0), TypeError, "int"),
        (dict(num_groups=True), TypeError, "int"),
    ]
    for override, exc, match in cases:
        args = dict(weight=w, num_replicas=12, num_groups=2, num_nodes=2, num_gpus=4)
        args.update(override)
        with pytest.raises(exc, match=match):
            rebalance_experts(**args)
    with pytest.raises(ValueError, match="5000 partitions|too many"):
        hierarchy_bound(torch.rand(1, 64), 16, 4)


def test_replica_map_bad_input():
    p2l, l2p, count = _plan()
    with pytest.raises(ValueError, match="for 8 logical experts, expected 16"):
        ReplicaMap(p2l, l2p, count, num_logical_experts=16)
    with pytest.raises(ValueError, match="for 12 physical slots, expected 24"):
        ReplicaMap(p2l, l2p, count, num_physical_experts=24)
    other = _plan(E=16, N=24, G=4)
    with pytest.raises(ValueError, match="disagree"):
        ReplicaMap(p2l, other[1], count)
    with pytest.raises(TypeError, match="integer"):
        ReplicaMap(p2l.float(), l2p, count)
    broken = p2l.clone()
    a, b = 0, int(torch.nonzero(p2l[0] != p2l[0, 0])[0])
    broken[0, a], broken[0, b] = p2l[0, b], p2l[0, a]           # counts unchanged, inverse map broken
    with pytest.raises(ValueError, match="inverse"):
        ReplicaMap(broken, l2p, count)
    with pytest.raises(ValueError, match="layer"):
        ReplicaMap(p2l, l2p, count, layer=2)
    rmap = ReplicaMap(p2l, l2p, count)
    idx = torch.randint(0, 8, (5, 2))
    with pytest.raises(ValueError, match="pass layer="):
        rmap.map(idx)
    with pytest.raises(ValueError, match=r"outside \[-1, 8\)"):
        rmap.map(torch.tensor([[0, 8]]), layer=0)
    with pytest.raises(ValueError, match=r"outside \[-1, 8\)"):
        rmap.map(torch.tensor([[-2, 1]]), layer=0)
    with pytest.raises(TypeError, match="int64"):
        rmap.map(idx.to(torch.int32), layer=0)
    with pytest.raises(ValueError, match="num_tokens, num_topk"):
        rmap.map(idx.reshape(-1), layer=0)
    with pytest.raises(ValueError, match="token_offset"):
        rmap.map(idx, layer=0, token_offset=-1)
    with pytest.raises(ValueError, match="out must be"):
        rmap.map(idx, layer=0, out=torch.empty(3, 2, dtype=torch.int64))


class _LoadingGroup:
    """An emulated rank's group as the kernel load sees it: ``load_collectively`` records its keys."""

    def __init__(self):
        self.keys = []

    def load_collectively(self, key, load):
        self.keys.append(key)
        load()


def _loading_map(monkeypatch, group, device, capturing=False):
    """A one-layer map of ``group`` whose tables on ``device`` exist (kept on the CPU: no CUDA here),
    and the list its kernel loads go to."""
    from deep_ep.eplb import replica_map
    loads = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(replica_map, "load_kernel", lambda dev: loads.append(dev.index))
    p2l, l2p, count = _plan()
    rmap = ReplicaMap(p2l, l2p, count, layer=1, group=group)
    rmap._device_tables[device] = (rmap._l2p.to(torch.int32), rmap._count.to(torch.int32))
    return rmap, loads


def test_emulated_ranks_load_the_map_kernel_together_once(monkeypatch):
    """On emulated ranks the kernel loads at the group's collective load, at the map's first
    ``to(device)`` (before its first launch), once per map and device; a CPU device or a CPU map
    loads nothing."""
    group = _LoadingGroup()
    device = torch.device("cuda", 1)
    rmap, loads = _loading_map(monkeypatch, group, device)
    for _ in range(3):
        assert rmap.to(device) is rmap
    rmap.to("cpu")
    physical = rmap.map(torch.tensor([[0, 3, -1]]))
    assert rmap.physical_to_logical()[physical[0, :2]].tolist() == [0, 3] and physical[0, 2] == -1
    assert group.keys == [("deep_ep_eplb", 1)] and loads == [1]


@pytest.mark.parametrize("group", [None, object()], ids=["no group", "process group"])
def test_the_map_kernel_loads_directly_without_a_collective_load(group, monkeypatch):
    device = torch.device("cuda", 0)
    rmap, loads = _loading_map(monkeypatch, group, device)
    rmap.to(device)
    rmap.to(device)
    assert loads == [0]


def test_no_map_kernel_load_during_a_capture(monkeypatch):
    """Nothing loads inside a CUDA-graph capture; the first ``to`` after it does."""
    group = _LoadingGroup()
    device = torch.device("cuda", 2)
    rmap, loads = _loading_map(monkeypatch, group, device, capturing=True)
    rmap.to(device)
    assert group.keys == [] and loads == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    rmap.to(device)
    assert group.keys == [("deep_ep_eplb", 2)] and loads == [2]


def test_packing_never_worse_than_greedy_then_lpt():
    """The candidate search includes the classical greedy-then-LPT packing and only improves on it."""
    from deep_ep.eplb import packing
    rng = np.random.default_rng(5)
    w = rng.random((20, 24)) ** 5
    M, G = 32, 8
    picks = packing._greedy_picks(w, M - 24)
    counts = packing._counts_from_picks(picks, M - 24, np.argsort(w, 1, kind="stable"), 24)
    slots = packing._lpt_slots(w, counts, G, M // G)
    greedy = np.take_along_axis(w / counts, slots, 1).reshape(20, G, -1).sum(2).max(1)
    _, best = packing.balance(w, M, G, w.sum(1) / G)
    assert (best <= greedy * (1 + 1e-12)).all() and (best < greedy * 0.999).any()


def test_bench_call_shapes():
    """The calls the bench makes: one layer planned with keywords, a ReplicaMap from [1, ...]
    plan tensors, map returning int64 physical ids of the input's shape."""
    R, E, redundant = 4, 32, 8
    weight = torch.randint(0, 1000, (1, E))
    plan = rebalance_experts(weight, E + redundant, num_groups=1, num_nodes=1, num_gpus=R)
    assert [tuple(t.shape) for t in plan] == [(1, E + redundant), (1, E, redundant + 1), (1, E)]
    topk_idx = torch.randint(-1, E, (100, 8))
    physical = ReplicaMap(*plan).map(topk_idx)
    assert physical.dtype == torch.int64 and physical.shape == topk_idx.shape
    assert torch.equal(plan[0][0][physical[topk_idx >= 0]], topk_idx[topk_idx >= 0])
    assert torch.equal(ReplicaMap(*(t[0] for t in plan)).map(topk_idx), physical)


def test_device_hash_matches_spec_with_host_compiler(tmp_path):
    """The kernel's hash function, compiled for the host, gives replica_hash's values (a check of
    the device code's constants and integer semantics on machines without a GPU)."""
    import shutil
    import subprocess
    from pathlib import Path
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    header = Path(eplb.__file__).parents[1] / "include" / "deep_ep" / "impls" / "eplb_map.cuh"
    text = header.read_text()
    start = text.index("__device__ __forceinline__ uint32_t eplb_replica_hash")
    body = text[start:text.index("\n}\n", start) + 3]
    g = torch.Generator().manual_seed(9)
    tokens = torch.cat([torch.randint(0, 2**32, (64,), generator=g), torch.tensor([0, 2**32 - 1])])
    experts = torch.randint(0, 2**20, (tokens.numel(),), generator=g)
    pairs = ", ".join(f"{{{t}u, {e}u}}" for t, e in zip(tokens.tolist(), experts.tolist()))
    src = tmp_path / "hash.cpp"
    src.write_text("#include <cstdint>\n#include <cstdio>\n#define __device__\n#define __forceinline__ inline\n"
                   + body + f"\nint main() {{ uint32_t in[][2] = {{{pairs}}};\n"
                   "for (auto& p : in) std::printf(\"%u\\n\", eplb_replica_hash(p[0], p[1])); }\n")
    subprocess.run([cxx, "-O1", "-o", str(tmp_path / "hash"), str(src)], check=True)
    got = [int(v) for v in subprocess.run([str(tmp_path / "hash")], check=True, capture_output=True).stdout.split()]
    assert got == replica_hash(tokens, experts).tolist()
