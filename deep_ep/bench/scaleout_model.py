"""Scale-out on paper: bytes per link, predicted times and bandwidths (``python -m deep_ep bench --scaleout-model``).

For a topology (``R`` ranks in nodes of ``N``), a mode (hybrid or direct) and a dtype, the bytes one
rank puts on NVLink and on RDMA per dispatch and per combine, twice: in expectation for a balanced
gate (a token picking ``K`` of ``E`` experts reaches ``k_g = g (1 - C(E - E/g, K) / C(E, K))`` of
``g`` equal groups, `deep_ep.resources.expected_ranks_per_token`), and exactly for a seeded balanced
routing (`deep_ep.bench.link_bytes`). Both use the GPU kernels' row layouts.

Predicted time: the slowest rank's busiest link, ``max over ranks and domains of max(sent,
received) / rate`` (links full duplex, every link kept busy: the SM count of `deep_ep.resources`'
model is the one meant to do that, and is printed beside). Bandwidths are DeepEP V2's logical ones
(`link_bytes.deepep_logical_bytes`, the slowest rank's bytes over the predicted time): "SO" the
scale-out bytes, "SU" the scale-up bytes. Nothing here is measured.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

import torch

from .. import resources, routing
from .link_bytes import (CALL_TAG_BYTES, FORWARD_HEADER_BYTES, RouteCounts, deepep_logical_bytes, link_bytes_of_counts,
                         route_counts, row_sizes)

__all__ = ["Topology", "TOPOLOGIES", "PUBLISHED", "expected_link_bytes", "predict", "seeded_routing",
           "model_rows", "format_model", "run_model", "DEFAULT_TOKENS", "NVLINK5_GBS"]

#: DeepEP V2's README bench size: 8K tokens per rank.
DEFAULT_TOKENS = 8192
#: NVLink 5 (GB200 NVL72) per GPU and direction: half its 1.8 TB/s.
NVLINK5_GBS = 900.0


@dataclasses.dataclass(frozen=True)
class Topology:
    """A machine for the model: ``num_ranks`` ranks in nodes of ``num_nvlink_ranks``, ``num_experts``
    expert slots, link rates in GB/s per GPU and direction, SMs per GPU."""
    name: str
    num_ranks: int
    num_nvlink_ranks: int
    num_experts: int
    nvlink_gbs: float
    rdma_gbs: float
    num_device_sms: int
    gpu: str

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.num_nvlink_ranks


TOPOLOGIES = (
    Topology("EP 8x2", 16, 8, 256, resources.DEFAULT_NVLINK_GBS, resources.DEFAULT_RDMA_GBS, 132, "H200 + CX7"),
    Topology("EP 8x4", 32, 8, 256, resources.DEFAULT_NVLINK_GBS, resources.DEFAULT_RDMA_GBS, 132, "H200 + CX7"),
    Topology("EP 8x16", 128, 8, 256, resources.DEFAULT_NVLINK_GBS, resources.DEFAULT_RDMA_GBS, 132, "H200 + CX7"),
    # 72 ranks do not divide DeepSeek-V3's 256 experts: 288 slots (32 redundant, 4 per rank).
    Topology("NVL72", 72, 72, 288, NVLINK5_GBS, 0.0, 148, "GB200 NVL72"),
)

#: DeepEP V2's README (SM90, CX7, 8K tokens per batch, hidden 7168, top-8, FP8 dispatch, BF16
#: combine, logical bandwidth with local traffic): (dispatch GB/s, combine GB/s, SMs).
PUBLISHED = {"EP 8x2": (90.0, 81.0, 12), "EP 8x4": (61.0, 61.0, 6)}


def _forwards(topology: Topology, hybrid: bool) -> bool:
    return hybrid and topology.num_nodes > 1 and topology.num_nvlink_ranks > 1


def expected_link_bytes(topology: Topology, *, hybrid: bool, tokens: int, hidden: int, num_topk: int,
                        fp8: bool, num_sf: int = 0) -> Dict[str, Dict[str, float]]:
    """Bytes one rank sends (and, by symmetry, receives) per call in expectation:
    ``{"dispatch" | "combine": {"nvlink": bytes, "rdma": bytes}}``, for a balanced gate."""
    num_ranks, node_ranks, num_nodes = topology.num_ranks, topology.num_nvlink_ranks, topology.num_nodes
    sizes = row_sizes(hidden, num_topk, fp8=fp8, num_sf=num_sf, node_ranks=node_ranks)
    ranks_reached = resources.expected_ranks_per_token(topology.num_experts, num_topk, num_ranks)
    if not _forwards(topology, hybrid):
        remote = ranks_reached * (num_ranks - node_ranks) / num_ranks
        near = ranks_reached * (node_ranks - 1) / num_ranks
        tags = (num_ranks - node_ranks) * CALL_TAG_BYTES
        return {name: {"nvlink": tokens * near * size, "rdma": tokens * remote * size + tags}
                for name, size in (("dispatch", sizes.dispatch_row), ("combine", sizes.combine_row))}
    nodes_reached = resources.expected_ranks_per_token(topology.num_experts, num_topk, num_nodes)
    slots = tokens * nodes_reached * (num_nodes - 1) / num_nodes
    own = tokens * ranks_reached * (node_ranks - 1) / num_ranks
    onward = tokens * ranks_reached * (node_ranks - 1) * (num_nodes - 1) / num_ranks
    return {
        "dispatch": {"nvlink": (own + onward) * sizes.dispatch_row,
                     "rdma": slots * sizes.forward_slot + (num_nodes - 1) * (FORWARD_HEADER_BYTES + CALL_TAG_BYTES)},
        "combine": {"nvlink": own * sizes.combine_row + onward * sizes.combine_entry,
                    "rdma": slots * sizes.node_slot + (num_nodes - 1) * CALL_TAG_BYTES * node_ranks},
    }


def seeded_routing(topology: Topology, tokens: int, num_topk: int, seed: int = 0) -> List[torch.Tensor]:
    """Every rank's balanced routing (`deep_ep.routing.balanced_routing`), seeded per rank."""
    return [routing.balanced_routing(tokens, topology.num_experts, num_topk,
                                     generator=torch.Generator().manual_seed(seed * 1_000_003 + rank))
            for rank in range(topology.num_ranks)]


def _rate(topology: Topology, domain: str) -> float:
    return topology.nvlink_gbs if domain == "nvlink" else topology.rdma_gbs


def predict(topology: Topology, counts: RouteCounts, num_topk: int, *, hybrid: bool, hidden: int,
            fp8: bool, num_sf: int = 0) -> Dict[str, Dict[str, object]]:
    """The exact bytes of a routing (its `link_bytes.route_counts` for ``topology``'s nodes) and what they predict, per call: ``{"dispatch" | "combine":
    {"rdma_bytes", "nvlink_bytes" (the slowest rank's max(sent, received)), "bottleneck" (domain),
    "time_us", "so_gbps", "su_gbps" (DeepEP's logical bandwidths of the slowest rank's bytes; SO None
    with one scale-out rank)}}``.

    Raises:
        ValueError: a domain carries bytes but its rate is 0.
    """
    calls = link_bytes_of_counts(counts, num_topk, hybrid=hybrid, hidden=hidden, fp8=fp8, num_sf=num_sf)
    scaleout_ranks = topology.num_nodes if (hybrid and topology.num_nodes > 1) else 1
    logical = deepep_logical_bytes(counts, num_topk, scaleout_ranks, hidden=hidden, fp8=fp8, num_sf=num_sf)
    out: Dict[str, Dict[str, object]] = {}
    for name, call in calls.items():
        busiest, times = {}, {}
        for domain in ("nvlink", "rdma"):
            matrix = call.domain(domain)
            busiest[domain] = int(torch.maximum(matrix.sum(1), matrix.sum(0)).max())
            rate = _rate(topology, domain)
            if busiest[domain] and rate <= 0:
                raise ValueError(f"{topology.name}: {domain} carries bytes but has no rate")
            times[domain] = busiest[domain] / (rate * 1e3) if busiest[domain] else 0.0   # microseconds
        bottleneck = max(times, key=times.get)
        time_us = times[bottleneck]
        scaleout, scaleup = max(logical[name]["scaleout"]), max(logical[name]["scaleup"])
        out[name] = {"rdma_bytes": busiest["rdma"], "nvlink_bytes": busiest["nvlink"], "bottleneck": bottleneck,
                     "time_us": time_us,
                     "so_gbps": scaleout / (time_us * 1e3) if scaleout_ranks > 1 and time_us else None,
                     "su_gbps": scaleup / (time_us * 1e3) if time_us else None}
    return out


def _num_sms(topology: Topology, hybrid: bool, num_topk: int) -> int:
    device = resources.DeviceResources(topology.num_device_sms, topology.num_device_sms, topology.nvlink_gbs,
                                       topology.rdma_gbs)
    scaleout = topology.num_nodes if (hybrid and topology.num_nodes > 1) else 1
    return resources.theoretical_num_sms(
        topology.num_experts, num_topk, num_ranks=topology.num_ranks, resources=device,
        num_scaleout_ranks=scaleout, num_rdma_ranks=topology.num_nodes, num_nvlink_ranks=topology.num_nvlink_ranks)


def model_rows(topologies: Sequence[Topology] = TOPOLOGIES, *, tokens: int = DEFAULT_TOKENS, hidden: int = 7168,
               num_topk: int = 8, seed: int = 0, modes: Sequence[str] = ("hybrid", "direct")) -> List[dict]:
    """One row per (topology, mode, dispatch dtype, call): expected and exact bytes, the prediction,
    the SM model's count and DeepEP's published figure where there is one (hybrid, FP8 dispatch,
    BF16 combine). FP8 uses per-128 fp32 scale factors."""
    rows = []
    for topology in topologies:
        counts = route_counts(seeded_routing(topology, tokens, num_topk, seed), topology.num_experts,
                              topology.num_nvlink_ranks)
        for mode in modes:
            hybrid = mode == "hybrid"
            if mode not in ("hybrid", "direct"):
                raise ValueError(f"unknown mode {mode!r}")
            if hybrid and topology.num_nodes == 1 and "direct" in modes:
                continue   # one node: the modes move the same bytes
            for fp8 in (True, False):
                num_sf = hidden // 128 if fp8 else 0
                expected = expected_link_bytes(topology, hybrid=hybrid, tokens=tokens, hidden=hidden,
                                               num_topk=num_topk, fp8=fp8, num_sf=num_sf)
                exact = predict(topology, counts, num_topk, hybrid=hybrid, hidden=hidden, fp8=fp8, num_sf=num_sf)
                for call in ("dispatch", "combine"):
                    if call == "combine" and not fp8:
                        continue   # combine is BF16 either way
                    published = PUBLISHED.get(topology.name) if hybrid and fp8 else None
                    rows.append({
                        "topology": topology.name, "gpu": topology.gpu, "ranks": topology.num_ranks,
                        "mode": "one node" if topology.num_nodes == 1 else mode,
                        "dtype": ("FP8" if fp8 else "BF16") if call == "dispatch" else "BF16",
                        "call": call, "tokens": tokens,
                        "expected_rdma_bytes": expected[call]["rdma"], "expected_nvlink_bytes": expected[call]["nvlink"],
                        **exact[call], "num_sms": _num_sms(topology, hybrid, num_topk),
                        "published_gbps": None if published is None else published[0 if call == "dispatch" else 1],
                        "published_sms": None if published is None else published[2]})
    return rows


def _mb(value: Optional[float]) -> str:
    return "-" if not value else f"{value / 1e6:.1f}"


def _gbps(value: Optional[float]) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0f}"


def format_model(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table (docs/scaleout.md, "On paper")."""
    header = ("| topology | mode | call | RDMA MB/rank (expected / seeded max) | NVLink MB/rank (expected / seeded "
              "max) | bottleneck | time (us) | SO GB/s | SU GB/s | SMs (model) | DeepEP V2 published |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for row in rows:
        published = "-" if row["published_gbps"] is None else \
            f"{row['published_gbps']:.0f} GB/s (SO), {row['published_sms']} SMs"
        lines.append(
            f"| {row['topology']} | {row['mode']} | {row['call']} {row['dtype']} | "
            f"{_mb(row['expected_rdma_bytes'])} / {_mb(row['rdma_bytes'])} | "
            f"{_mb(row['expected_nvlink_bytes'])} / {_mb(row['nvlink_bytes'])} | {row['bottleneck']} | "
            f"{row['time_us']:.0f} | {_gbps(row['so_gbps'])} | {_gbps(row['su_gbps'])} | {row['num_sms']} | "
            f"{published} |")
    return "\n".join(lines)


def run_model(tokens: Optional[int] = None, seed: int = 0) -> int:
    """``python -m deep_ep bench --scaleout-model``: print the table of `TOPOLOGIES` (DeepSeek-V3
    sizes, ``tokens`` per rank, default `DEFAULT_TOKENS`); returns 0."""
    tokens = DEFAULT_TOKENS if tokens is None else tokens
    if tokens < 1:
        raise SystemExit(f"error: --tokens must be >= 1 for --scaleout-model, got {tokens}")
    print(f"Scale-out on paper: DeepSeek-V3 (hidden 7168, top-8 of 256; NVL72: of 288 slots), {tokens} tokens "
          f"per rank, balanced routing (seed {seed}); computed, not measured. NVLink 450 GB/s (H200), "
          f"{NVLINK5_GBS:.0f} GB/s (NVL72), RDMA {resources.DEFAULT_RDMA_GBS:.0f} GB/s (CX7 400 Gb/s), per GPU "
          f"and direction.", flush=True)
    print(format_model(model_rows(tokens=tokens, seed=seed)))
    return 0
