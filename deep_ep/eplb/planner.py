"""``rebalance_experts``: which logical expert each physical expert slot holds, per layer.

The numeric search lives in :mod:`deep_ep.eplb.packing`; this module checks arguments, splits the
hierarchical problem into node problems and assembles the plan tensors.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import torch

from . import packing
from .validate import as_weight, positive_int

__all__ = ["rebalance_experts", "check_plan_args", "hierarchy_bound", "gpu_loads", "static_gpu_loads"]

#: Largest number of group-to-node partitions enumerated exactly (more: LPT + local search).
MAX_EXACT_PARTITIONS = 5000


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int):
    """Plan expert replication and placement from per-layer expert loads.

    Physical expert slot ``p`` (``0 <= p < num_replicas``) lives on GPU ``p // (num_replicas /
    num_gpus)``; GPUs ``n * G/num_nodes .. (n + 1) * G/num_nodes - 1`` form node ``n``. Logical
    expert ``e`` belongs to group ``e // (E / num_groups)``. The plan assumes that dispatch spreads
    an expert's tokens evenly over its replicas (:class:`deep_ep.eplb.ReplicaMap` does).

    Policies:
        * **hierarchical**, when ``num_nodes > 1`` and ``num_groups % num_nodes == 0``: the groups
          are packed onto nodes, ``num_groups / num_nodes`` per node, minimising the most loaded
          node (exactly, by enumerating the partitions when there are at most 5000 of them, e.g.
          8 groups on 4 or 8 nodes; otherwise LPT plus swaps); so group-limited routing (top-k
          groups per token) reaches at most that many nodes. Each node then solves its own
          replicate-and-pack problem (below) with ``num_replicas / num_nodes`` slots on its GPUs:
          replicas never leave their group's node.
        * **global** otherwise (``num_nodes == 1`` included): one problem over all GPUs; groups
          are ignored.

    The replicate-and-pack problem (:mod:`deep_ep.eplb.packing`): pick replica counts (at least
    one per expert, ``num_replicas`` in all) and put every replica, carrying ``load / count``, on a
    GPU with exactly ``num_replicas / num_gpus`` slots each, minimising the most loaded GPU. The
    candidates are: the classical greedy (repeatedly split the expert with the highest
    per-replica load), the same stopped earlier with the leftover slots given to the coldest
    experts, a split-to-fit rule, and combinations of counts around ``load / target`` for the
    hottest experts; each is packed largest-first onto the least loaded GPU with room and improved
    by pairwise swaps of replicas between GPUs; the best wins.

    Guarantees: every logical expert has at least one replica; every GPU holds exactly
    ``num_replicas / num_gpus`` slots; ``logical_count`` sums to ``num_replicas`` per layer;
    hierarchical plans keep every group on one node; the maximum GPU load is never above that of
    greedy replication followed by LPT packing; the same input gives the same plan. Lower bounds
    for comparison: the mean GPU load, and (hierarchical) :func:`hierarchy_bound`. The search stops
    once the maximum is within 0.1% of the load it aims at (for a node problem: the larger of the
    node's own mean and the mean of the layer's most loaded node, so lighter nodes are balanced
    only as far as the layer's maximum needs).

    Args:
        weight: float or integer tensor ``[L, E]`` (or ``[E]``, one layer), any device: the load of
            every logical expert (e.g. tokens routed to it), finite and >= 0.
        num_replicas: N, physical expert slots per layer, ``E <= N``, a multiple of ``num_gpus``.
        num_groups: expert groups; must divide E (1: no groups).
        num_nodes: nodes; must divide ``num_gpus``.
        num_gpus: GPUs (EP ranks).

    Returns:
        ``(physical_to_logical, logical_to_physical, logical_count)``, int64 CPU tensors:
        ``[L, N]`` the logical expert of every slot; ``[L, E, N - E + 1]`` the slots of every logical
        expert in increasing order, -1 after the last one; ``[L, E]`` replicas per logical expert.
        Without the layer dimension when ``weight`` is 1-D.

    Raises:
        TypeError: ``weight`` is not a float/integer tensor, or a count is not an int.
        ValueError: a count < 1, ``num_replicas`` not a multiple of ``num_gpus`` or smaller than E,
            ``num_groups`` not dividing E, ``num_nodes`` not dividing ``num_gpus``, or loads that
            are negative, NaN or infinite.
    """
    w, squeezed = as_weight(weight)
    L, E = w.shape
    N, groups, nodes, G = check_plan_args(E, num_replicas, num_groups, num_nodes, num_gpus)
    if nodes > 1 and groups % nodes == 0:
        p2l = _hierarchical(w, N, groups, nodes, G)
    else:
        slots, _ = packing.balance(w, N, G, w.sum(axis=1) / G)
        p2l = slots
    p2l_t, l2p_t, count_t = _assemble(p2l, E)
    if squeezed:
        return p2l_t[0], l2p_t[0], count_t[0]
    return p2l_t, l2p_t, count_t


def check_plan_args(num_experts: int, num_replicas, num_groups, num_nodes, num_gpus) -> tuple:
    """The checks of :func:`rebalance_experts` on its counts: ``(N, groups, nodes, gpus)`` as ints.

    Raises:
        TypeError: a count is not an int. ValueError: see :func:`rebalance_experts`.
    """
    N = positive_int(num_replicas, "num_replicas")
    groups = positive_int(num_groups, "num_groups")
    nodes = positive_int(num_nodes, "num_nodes")
    G = positive_int(num_gpus, "num_gpus")
    E = num_experts
    if N % G:
        raise ValueError(f"num_replicas ({N}) must be a multiple of num_gpus ({G})")
    if N < E:
        raise ValueError(f"num_replicas ({N}) must be at least the number of logical experts ({E})")
    if E % groups:
        raise ValueError(f"num_groups ({groups}) must divide the number of experts ({E})")
    if G % nodes:
        raise ValueError(f"num_nodes ({nodes}) must divide num_gpus ({G})")
    return N, groups, nodes, G


def _hierarchical(w: np.ndarray, N: int, groups: int, nodes: int, G: int) -> np.ndarray:
    L, E = w.shape
    per_group = E // groups
    group_load = w.reshape(L, groups, per_group).sum(axis=2)
    node_groups = _pack_groups(group_load, nodes)                       # [L, nodes, groups/nodes]
    experts = (node_groups[..., None] * per_group + np.arange(per_group)).reshape(L * nodes, -1)
    node_w = np.take_along_axis(np.repeat(w, nodes, axis=0), experts, 1)
    gpus = G // nodes
    heaviest = node_w.reshape(L, nodes, -1).sum(axis=2).max(axis=1)     # [L]
    target = np.maximum(node_w.sum(axis=1), np.repeat(heaviest, nodes)) / gpus
    slots, _ = packing.balance(node_w, N // nodes, gpus, target)
    return np.take_along_axis(experts, slots, 1).reshape(L, N)


@functools.lru_cache(maxsize=16)
def _equal_partitions(n: int, parts: int) -> np.ndarray:
    """``[P, parts, n/parts]``: every split of ``range(n)`` into equal blocks (blocks ordered by
    their first element, elements increasing)."""
    size = n // parts
    out = []

    def rec(rest, blocks):
        if not rest:
            out.append(blocks)
            return
        for tail in itertools.combinations(rest[1:], size - 1):
            block = (rest[0],) + tail
            rec([r for r in rest if r not in block], blocks + [block])

    rec(list(range(n)), [])
    return np.array(out, dtype=np.int64)


def _num_partitions(n: int, parts: int) -> int:
    size = n // parts
    return math.factorial(n) // (math.factorial(size) ** parts * math.factorial(parts))


def _best_partition(group_load: np.ndarray, parts: int):
    """``(blocks [L, parts, g/parts], max block load [L])`` over every equal partition."""
    L, n = group_load.shape
    table = _equal_partitions(n, parts)                                  # [P, parts, size]
    sums = group_load[:, table].sum(axis=3)                              # [L, P, parts]
    worst = sums.max(axis=2)
    best = worst.argmin(axis=1)
    return table[best], worst[np.arange(L), best]


def _pack_groups(group_load: np.ndarray, nodes: int) -> np.ndarray:
    L, n = group_load.shape
    if _num_partitions(n, nodes) <= MAX_EXACT_PARTITIONS:
        return _best_partition(group_load, nodes)[0]
    slots = packing.pack_fixed(group_load, nodes, n // nodes)
    return np.sort(slots.reshape(L, nodes, -1), axis=2)


def _assemble(p2l: np.ndarray, E: int):
    L, N = p2l.shape
    count = np.zeros((L, E), dtype=np.int64)
    np.add.at(count, (np.repeat(np.arange(L), N), p2l.reshape(-1)), 1)
    order = np.argsort(p2l, axis=1, kind="stable")                       # slots grouped by expert
    expert = np.take_along_axis(p2l, order, 1)
    start = np.cumsum(count, axis=1) - count
    pos = np.arange(N)[None, :] - np.take_along_axis(start, expert, 1)
    l2p = np.full((L, E, N - E + 1), -1, dtype=np.int64)
    l2p[np.arange(L)[:, None], expert, pos] = order
    return torch.from_numpy(p2l.astype(np.int64)), torch.from_numpy(l2p), torch.from_numpy(count)


def hierarchy_bound(weight: torch.Tensor, num_groups: int, num_nodes: int) -> torch.Tensor:
    """The best balance a hierarchical plan can reach: float64 ``[L]``, the smallest possible
    (most loaded node) / (mean node load) over every way of putting ``num_groups / num_nodes``
    groups on each node. Replicas stay inside their node, so no plan's max/mean GPU load is below
    it. Exact (enumerates the partitions).

    Raises:
        ValueError: ``num_groups`` not a multiple of ``num_nodes``, not dividing E, or more than
            5000 partitions to enumerate; the errors of :func:`rebalance_experts` for ``weight``.
    """
    w, _ = as_weight(weight)
    groups = positive_int(num_groups, "num_groups")
    nodes = positive_int(num_nodes, "num_nodes")
    if groups % nodes or w.shape[1] % groups:
        raise ValueError(f"num_groups ({groups}) must be a multiple of num_nodes ({nodes}) and divide "
                         f"the number of experts ({w.shape[1]})")
    if _num_partitions(groups, nodes) > MAX_EXACT_PARTITIONS:
        raise ValueError(f"{_num_partitions(groups, nodes)} partitions of {groups} groups onto {nodes} nodes: "
                         "too many to enumerate")
    L = w.shape[0]
    group_load = w.reshape(L, groups, -1).sum(axis=2)
    _, worst = _best_partition(group_load, nodes)
    total = w.sum(axis=1)
    ratio = np.where(total > 0, worst * nodes / np.where(total > 0, total, 1), 1.0)
    return torch.from_numpy(ratio)


def gpu_loads(weight: torch.Tensor, physical_to_logical: torch.Tensor, logical_count: torch.Tensor,
              num_gpus: int) -> torch.Tensor:
    """Load of every GPU under a plan, float64 ``[L, num_gpus]`` (``[num_gpus]`` for 1-D
    ``weight``): each slot carries its logical expert's load divided by the expert's replica count,
    as :class:`deep_ep.eplb.ReplicaMap` spreads it."""
    w, squeezed = as_weight(weight)
    p2l = physical_to_logical.detach().to("cpu", torch.int64).reshape(w.shape[0], -1).numpy()
    cnt = logical_count.detach().to("cpu", torch.int64).reshape(w.shape[0], -1).numpy()
    G = positive_int(num_gpus, "num_gpus")
    if cnt.shape != w.shape or p2l.shape[1] % G:
        raise ValueError(f"plan shapes {tuple(p2l.shape)} / {tuple(cnt.shape)} do not fit weight "
                         f"{tuple(w.shape)} and {G} GPUs")
    per_slot = np.take_along_axis(w / cnt, p2l, 1)
    out = torch.from_numpy(per_slot.reshape(w.shape[0], G, -1).sum(axis=2))
    return out[0] if squeezed else out


def static_gpu_loads(weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Load of every GPU without balancing (expert ``e`` on GPU ``e // (E / num_gpus)``, no
    replicas): float64 ``[L, num_gpus]`` (``[num_gpus]`` for 1-D ``weight``)."""
    w, squeezed = as_weight(weight)
    G = positive_int(num_gpus, "num_gpus")
    if w.shape[1] % G:
        raise ValueError(f"num_gpus ({G}) must divide the number of experts ({w.shape[1]})")
    out = torch.from_numpy(w.reshape(w.shape[0], G, -1).sum(axis=2))
    return out[0] if squeezed else out
