"""The bench's EPLB pass (``--eplb REDUNDANT``): the same tokens dispatched to balanced replicas.

The plain pass runs first, on the generated (logical) expert ids. Then, from the routed load of all
ranks (every rank's routing is regenerated from the seed), this module asks `deep_ep.eplb` for a
placement and maps the routing to physical ids:

    physical_to_logical, logical_to_physical, logical_count = deep_ep.eplb.rebalance_experts(
        weight [1, E] float32, num_replicas=E + REDUNDANT, num_groups=1, num_nodes=1, num_gpus=R)
    physical_topk_idx = deep_ep.eplb.ReplicaMap(physical_to_logical, logical_to_physical,
                                               logical_count).map(topk_idx)   # same shape, dtype

and the second pass dispatches the physical ids with ``num_experts = E + REDUNDANT`` (checked against
the reference like the first). The report compares, per rank, the received (token, expert) pairs and
rows, and the dispatch / combine times, before and after, with the max/mean load ratio of each.

Everything that touches `deep_ep.eplb` is in this module (:func:`require_eplb`, :func:`make_workload`).
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .. import routing
from .config import BenchConfig, Workload, make_topk
from .report import text_table

__all__ = ["require_eplb", "logical_load", "make_workload", "check_mapping", "section", "format_section"]


def require_eplb():
    """`deep_ep.eplb`, with the two names the bench uses.

    Raises:
        SystemExit: the module is missing or lacks ``rebalance_experts`` / ``ReplicaMap``.
    """
    try:
        module = importlib.import_module("deep_ep.eplb")
    except ImportError as exc:
        raise SystemExit(f"error: --eplb needs deep_ep.eplb (expert load balancing), which cannot be "
                         f"imported in this build: {exc}") from exc
    missing = [n for n in ("rebalance_experts", "ReplicaMap") if not hasattr(module, n)]
    if missing:
        raise SystemExit(f"error: --eplb needs deep_ep.eplb.{' and '.join(missing)}, which this build's "
                         f"deep_ep.eplb does not have")
    return module


def logical_load(topk: Sequence[torch.Tensor], num_experts: int) -> torch.Tensor:
    """float32 ``[1, E]``: (token, expert) pairs per logical expert, summed over the ranks' routing."""
    total = sum(routing.expert_load(t, num_experts) for t in topk)
    return total.to(torch.float32).view(1, num_experts)


def check_mapping(physical: torch.Tensor, logical: torch.Tensor, physical_to_logical: torch.Tensor,
                  num_physical: int) -> None:
    """Raise `SystemExit` unless ``physical`` is a valid mapping of ``logical`` (same shape and dtype,
    -1 kept, every id in ``[0, num_physical)`` and a replica of the logical expert it replaces)."""
    if not isinstance(physical, torch.Tensor) or physical.shape != logical.shape or physical.dtype != logical.dtype:
        raise SystemExit(f"error: deep_ep.eplb.ReplicaMap.map returned {getattr(physical, 'dtype', type(physical))} "
                         f"{list(getattr(physical, 'shape', []))} for topk_idx {logical.dtype} {list(logical.shape)}")
    valid = logical >= 0
    if not torch.equal(physical[~valid], logical[~valid]):
        raise SystemExit("error: deep_ep.eplb.ReplicaMap.map changed -1 entries of topk_idx")
    ids = physical[valid]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_physical):
        raise SystemExit(f"error: deep_ep.eplb.ReplicaMap.map returned ids outside [0, {num_physical})")
    back = physical_to_logical.reshape(-1, num_physical)[0].to(torch.int64)[ids]
    if not torch.equal(back, logical[valid]):
        raise SystemExit("error: deep_ep.eplb.ReplicaMap.map sent a token to a slot holding another expert")


def make_workload(cfg: BenchConfig) -> Tuple[Workload, Dict[str, Any]]:
    """The balanced pass of ``cfg`` (``cfg.eplb`` redundant slots) and a description of its plan.

    Raises:
        SystemExit: `deep_ep.eplb` missing, or a mapping that is not valid (:func:`check_mapping`).
    """
    eplb = require_eplb()
    E, R, P = cfg.num_experts, cfg.num_ranks, cfg.num_experts + cfg.eplb
    topk = [make_topk(cfg, s)["topk_idx"] for s in range(R)]
    weight = logical_load(topk, E)
    physical_to_logical, logical_to_physical, logical_count = eplb.rebalance_experts(
        weight, P, num_groups=1, num_nodes=1, num_gpus=R)
    replica_map = eplb.ReplicaMap(physical_to_logical, logical_to_physical, logical_count)
    mapped = []
    for t in topk:
        physical = replica_map.map(t)
        check_mapping(physical, t, physical_to_logical, P)
        mapped.append(physical.contiguous())
    count = torch.as_tensor(logical_count, dtype=torch.int64, device="cpu").reshape(-1, E)[0]
    info = {"redundant": cfg.eplb, "num_physical_experts": P, "policy": "global (num_nodes=1)",
            "max_replicas_per_expert": int(count.max()) if count.numel() else 0,
            "experts_replicated": int((count > 1).sum()),
            "pairs_before": _pairs_per_rank(topk, E, R), "pairs_after": _pairs_per_rank(mapped, P, R)}
    return Workload(cfg, name="eplb", topk_idx=mapped, num_experts=P), info


def _pairs_per_rank(topk: Sequence[torch.Tensor], num_experts: int, num_ranks: int) -> List[int]:
    total = sum(routing.rank_load(t, num_experts, num_ranks) for t in topk)
    return [int(v) for v in total.tolist()]


def _max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else float("nan")


def section(info: Dict[str, Any], before: Sequence[Dict[str, Any]], after: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``eplb`` entry of the result: ``info`` of :func:`make_workload` plus per rank the pairs,
    received rows and dispatch / combine times (us) before and after, and the max/mean ratios."""
    ranks = []
    for b, a in zip(before, after):
        r = b["rank"]
        ranks.append({"rank": r, "pairs_before": info["pairs_before"][r], "pairs_after": info["pairs_after"][r],
                      "received_before": b["received"], "received_after": a["received"],
                      "dispatch_us_before": b["dispatch_us"], "dispatch_us_after": a["dispatch_us"],
                      "combine_us_before": b["combine_us"], "combine_us_after": a["combine_us"]})
    out = {k: v for k, v in info.items() if k not in ("pairs_before", "pairs_after")}
    out["ranks"] = ranks
    for key in ("pairs", "received", "dispatch_us", "combine_us"):
        for when in ("before", "after"):
            out[f"{key}_max_over_mean_{when}"] = _max_over_mean([x[f"{key}_{when}"] for x in ranks])
    return out


def format_section(sec: Dict[str, Any]) -> str:
    """The report's EPLB lines: a per-rank table (before -> after) and the max/mean ratios."""
    header = ["rank", "pairs before", "pairs after", "recv before", "recv after", "dispatch us before",
              "dispatch us after", "combine us before", "combine us after"]
    body = [[str(r["rank"]), str(r["pairs_before"]), str(r["pairs_after"]), str(r["received_before"]),
             str(r["received_after"]), f"{r['dispatch_us_before']:.1f}", f"{r['dispatch_us_after']:.1f}",
             f"{r['combine_us_before']:.1f}", f"{r['combine_us_after']:.1f}"] for r in sec["ranks"]]

    def ratio(key):
        return f"{sec[key + '_max_over_mean_before']:.2f} -> {sec[key + '_max_over_mean_after']:.2f}"
    return "\n".join([
        f"EPLB: {sec['redundant']} redundant slots, {sec['num_physical_experts']} physical experts "
        f"({sec['experts_replicated']} experts replicated, at most {sec['max_replicas_per_expert']} copies; "
        f"deep_ep.eplb.rebalance_experts, {sec['policy']}); before -> after balancing:",
        text_table(header, body),
        f"max/mean over ranks: (token, expert) pairs {ratio('pairs')}, received {ratio('received')}, "
        f"dispatch time {ratio('dispatch_us')}, combine time {ratio('combine_us')}",
    ])
