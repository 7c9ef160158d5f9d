"""Expert load balancing: how balanced the plans are and how long planning takes.

Loads: a Zipf(alpha) popularity over the experts (popularity rank i gets 1 / i**alpha), permuted at
random in every layer (``--sampled-tokens N``: also a table from N sampled tokens per layer, each
choosing ``--topk`` distinct experts with those popularities, as deep_ep.routing.zipf_routing
draws them). For each configuration it prints the max/mean GPU load over the layers (worst and
median) before balancing (experts in order, E/G per GPU, no replicas), after the global policy
and after the hierarchical one; for the hierarchical policy also the best balance the hierarchy
allows (`deep_ep.eplb.hierarchy_bound`, exact) and the ratio to it; for comparison the plain greedy
(split the hottest per-replica expert, then largest-first packing, no search) under the same
hierarchy; and the planning time of all layers (``time.perf_counter``, min and median of
``--repeats`` runs, and the least CPU time of the process, which a machine shared with other work
does not inflate).

``--gpu``: also the device time of ``ReplicaMap.map`` for ``--tokens`` x ``--topk`` ids on the
current GPU, replayed from a CUDA graph of 10 calls (as the bench times kernels), beside a copy of
the same ids.

Usage: python tools/eplb_bench.py [--layers 61] [--experts 256] [--alpha 1.2] [--groups 8]
       [--config 32:288:4 --config 64:320:8] [--repeats 5] [--seed 0] [--sampled-tokens 0] [--gpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from deep_ep.eplb import ReplicaMap, gpu_loads, hierarchy_bound, rebalance_experts, static_gpu_loads
from deep_ep.eplb import packing, planner


def zipf_popularity_loads(layers: int, experts: int, alpha: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** alpha
    p = p / p.sum()
    return torch.stack([p[torch.randperm(experts, generator=g)] for _ in range(layers)])


def zipf_sampled_loads(layers: int, experts: int, alpha: float, seed: int, tokens: int, topk: int) -> torch.Tensor:
    from deep_ep.routing import expert_load, zipf_routing
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        idx = zipf_routing(tokens, experts, topk, alpha=alpha, generator=g)
        out.append(expert_load(idx, experts))
    return torch.stack(out).to(torch.float64)


def ratio(loads: torch.Tensor) -> torch.Tensor:
    return loads.max(dim=1).values / loads.mean(dim=1)


def greedy_baseline(w: torch.Tensor, N: int, groups: int, nodes: int, G: int) -> torch.Tensor:
    """max/mean of greedy replication + LPT packing (no search), hierarchical like the planner."""
    a = w.numpy()
    L, E = a.shape
    node_groups = planner._pack_groups(a.reshape(L, groups, -1).sum(2), nodes)
    per_group = E // groups
    experts = (node_groups[..., None] * per_group + np.arange(per_group)).reshape(L * nodes, -1)
    nw = np.take_along_axis(np.repeat(a, nodes, 0), experts, 1)
    M, g = N // nodes, G // nodes
    picks = packing._greedy_picks(nw, M - nw.shape[1])
    counts = packing._counts_from_picks(picks, M - nw.shape[1], np.argsort(nw, 1, kind="stable"), nw.shape[1])
    slots = packing._lpt_slots(nw, counts, g, M // g)
    per_gpu = np.take_along_axis(nw / counts, slots, 1).reshape(L, nodes * g, -1).sum(2)
    return torch.from_numpy(per_gpu.max(1) / per_gpu.mean(1))


def timed(fn, repeats: int):
    """``(result, min wall ms, median wall ms, min CPU ms)``: wall time by time.perf_counter; the
    process's CPU time beside it shows what a machine shared with other work adds."""
    times, cpu, out = [], [], None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return out, min(times), statistics.median(times), min(cpu)


def stats(t: torch.Tensor) -> str:
    return f"worst {float(t.max()):.4f}  median {float(t.median()):.4f}"


def report(w: torch.Tensor, G: int, N: int, nodes: int, groups: int, repeats: int) -> None:
    L, E = w.shape
    print(f"\n{E} experts, {G} GPUs, {N} slots ({N - E} redundant, {N // G} per GPU), {L} layers")
    print(f"  before (E/G experts per GPU, no replicas)   max/mean {stats(ratio(static_gpu_loads(w, G)))}")
    plan, tmin, tmed, tcpu = timed(lambda: rebalance_experts(w, N, groups, 1, G), repeats)
    r = ratio(gpu_loads(w, plan[0], plan[2], G))
    print(f"  global policy (num_nodes=1)                 max/mean {stats(r)}  "
          f"(layers <= 1.05: {int((r <= 1.05).sum())}/{L})")
    print(f"    planning {L} layers: {tmin:.1f} ms (median {tmed:.1f}; CPU time {tcpu:.1f})")
    if groups % nodes == 0 and nodes > 1:
        plan, tmin, tmed, tcpu = timed(lambda: rebalance_experts(w, N, groups, nodes, G), repeats)
        r = ratio(gpu_loads(w, plan[0], plan[2], G))
        bound = hierarchy_bound(w, groups, nodes)
        greedy = greedy_baseline(w, N, groups, nodes, G)
        print(f"  hierarchy bound ({groups} groups on {nodes} nodes)     max/mean {stats(bound)}")
        print(f"  hierarchical policy                         max/mean {stats(r)}")
        print(f"    planning {L} layers: {tmin:.1f} ms (median {tmed:.1f}; CPU time {tcpu:.1f})")
        print(f"    / bound                                   {stats(r / bound)}  "
              f"(layers within 10%: {int((r / bound <= 1.10).sum())}/{L})")
        print(f"    greedy replicate-then-pack / bound        {stats(greedy / bound)}  "
              f"(min {float((greedy / bound).min()):.4f})")


def gpu_report(tokens: int, topk: int, experts: int, N: int, G: int) -> None:
    from deep_ep.bench.gpu_timing import graph_time_us
    dev = torch.device("cuda", torch.cuda.current_device())
    w = zipf_popularity_loads(1, experts, 1.2, 0)
    rmap = ReplicaMap(*rebalance_experts(w, N, 1, 1, G), device=dev)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, experts, (tokens, topk), generator=g).to(dev)
    out = torch.empty_like(idx)
    assert torch.equal(rmap.map(idx, out=out).cpu(), ReplicaMap(*rebalance_experts(w, N, 1, 1, G)).map(idx.cpu()))
    none = lambda: None  # noqa: E731 - one process: no barrier
    kernel = graph_time_us(lambda: rmap.map(idx, out=out), 1000, none)
    copy = graph_time_us(lambda: out.copy_(idx), 1000, none)
    t = time.perf_counter()
    for _ in range(1000):
        rmap.map(idx, out=out)
    host = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    name = torch.cuda.get_device_name(dev)
    print(f"\nReplicaMap.map on {name}, {tokens} x {topk} ids, {experts} experts -> {N} slots: "
          f"{kernel:.2f} us per call from a CUDA graph (copy of the ids: {copy:.2f} us); "
          f"host time per eager call {host:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=1.2)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--config", action="append", default=None,
                    help="GPUS:SLOTS:NODES (default 32:288:4 and 64:320:8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampled-tokens", type=int, default=0)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split(":")) for c in (args.config or ["32:288:4", "64:320:8"])]
    loads = {"Zipf popularity": zipf_popularity_loads(args.layers, args.experts, args.alpha, args.seed)}
    if args.sampled_tokens:
        loads[f"{args.sampled_tokens} sampled tokens x top-{args.topk}"] = zipf_sampled_loads(
            args.layers, args.experts, args.alpha, args.seed, args.sampled_tokens, args.topk)
    torch.set_num_threads(1)
    for name, w in loads.items():
        print(f"== loads: {name} (alpha {args.alpha}, permuted per layer, seed {args.seed}); "
              f"numpy {np.__version__}, torch {torch.__version__}")
        for G, N, nodes in configs:
            report(w, G, N, nodes, args.groups, args.repeats)
    if args.gpu:
        gpu_report(args.tokens, args.topk, args.experts, configs[0][1], configs[0][0])


if __name__ == "__main__":
    main()
