"""Bytes a dispatch or combine puts on each link, per (sender, receiver, domain), from the routing.

Computed on the host from every rank's ``topk_idx`` and the row layouts of the GPU kernels
(`deep_ep.backends.gpu.window`, ``impls/dispatch_args.cuh``, ``impls/combine_args.cuh``,
``impls/dispatch_forward.cuh``, ``impls/combine_hybrid_reduce.cuh``): what each put or store carries
is fixed by the layout, so the counts are exact for those kernels, not measured. Ranks ``n N .. n N
+ N - 1`` form node ``n``; a hop between two ranks of one node is ``nvlink``, between nodes ``rdma``
(the emulated GIN's puts); a rank's rows to itself cross no link and are not counted.

* direct mode (and hybrid mode with one rank per node, which moves the same rows): dispatch sends
  one row per (token, destination rank), data, scale factors and a ``4 + 12 K`` byte trailer;
  combine returns one row per (token, owner rank), ``2 H`` bf16 values and ``K`` weights; every
  rank of another node also gets the 8-byte call tag per call;
* hybrid mode across nodes, dispatch: rows for the source's own node go straight there; a token
  crosses to each other node it reaches once, as a forwarding slot put to the rail peer there
  (the rank of the same local index), which stores the row over NVLink into every other rank of its
  node the token reaches; each rail peer gets a 16-byte header and the tag per call;
* hybrid combine: owners of the source's own node return their partial row over NVLink; on another
  node each owner stores its partial (an entry) to the node's rail peer of the source, which puts
  one node slot per token to the source, and its node's tags (8 bytes per rank) per call.

NVLink counts hold rows only (the control words a node's ranks store for each other are left out);
RDMA counts hold rows and the header / tag puts (`CallBytes.rdma_control`). Signals carry no bytes.
A fresh dispatch (``notify=True``) also counts its notify stage: each rank's count row
(`count_row_bytes`) and the tag, put to every GIN peer (direct mode: every rank of another node;
hybrid mode across nodes: each rail peer, which stores the row on into its node, not counted).

One definition, shared with the emulated NIC (`deep_ep.comm.gin.byte_counters`): ``rdma[i, j]`` is
the sum of the byte counts of the GIN puts rank ``i`` issues to rank ``j``, exactly as the kernels
issue them; a put split into pieces counts its pieces' sum, a signal alone counts 0.

`deepep_logical_bytes` gives DeepEP V2's "SO" / "SU" byte counts for the same routing (its
``tests/elastic/test_ep.py`` convention, local traffic included).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Sequence

import torch

from ..backends.gpu import window
from ..backends.gpu.abi import COUNTS_EXTRA_WORDS

__all__ = ["RowSizes", "row_sizes", "CallBytes", "RouteCounts", "reach", "route_counts", "link_bytes",
           "link_bytes_of_counts", "deepep_logical_bytes", "DOMAINS",
           "CALL_TAG_BYTES", "FORWARD_HEADER_BYTES", "count_row_bytes"]

DOMAINS = ("nvlink", "rdma")
_CPU = torch.device("cpu")   # the counts are host tensors, whatever a caller's default device
#: The call tag (number and fingerprint) put to every GIN peer per call (comm/gin_direct.cuh, gin_hybrid.cuh).
CALL_TAG_BYTES = 8
#: The header of a hybrid dispatch's forwarding region (token count and call tag).
FORWARD_HEADER_BYTES = 16


def count_row_bytes(num_ranks: int, num_experts: int) -> int:
    """Bytes of the count row a fresh dispatch's notify stage puts to each GIN peer: int32 counts per
    rank and per expert and the extra words (``kernels/dispatch.cuh``, ``4 (R + E + 2)``)."""
    return 4 * (num_ranks + num_experts + COUNTS_EXTRA_WORDS)


def _align16(num_bytes: int) -> int:
    return (num_bytes + 15) // 16 * 16


@dataclasses.dataclass(frozen=True)
class RowSizes:
    """Bytes of each kind of row the kernels move.

    Attributes:
        dispatch_row: a dispatched row as put or stored (``align16(data + 4 num_sf) + 4 + 12 K``).
        combine_row: a combine row returned to its source (``align16(2 H) + 4 K``).
        forward_slot: a hybrid dispatch's forwarding slot (`window.forward_slot_bytes`).
        combine_entry: a hybrid combine's rank partial stored at the forwarder
            (``align16(2 H) + align16(16 + 4 K)``).
        node_slot: a hybrid combine's node partial put to the source (``align16(2 H) + align16(16 + 4 K N)``).
    """
    dispatch_row: int
    combine_row: int
    forward_slot: int
    combine_entry: int
    node_slot: int


def row_sizes(hidden: int, num_topk: int, *, fp8: bool = False, num_sf: int = 0, node_ranks: int = 1) -> RowSizes:
    """`RowSizes` for ``hidden`` (a multiple of 8), top-``num_topk``, BF16 dispatch or FP8 (``hidden``
    bytes of data and ``num_sf`` 4-byte scale factors), nodes of ``node_ranks`` ranks."""
    data_bytes = hidden if fp8 else 2 * hidden
    num_sf = num_sf if fp8 else 0
    values = _align16(2 * hidden)
    return RowSizes(
        dispatch_row=_align16(data_bytes + 4 * num_sf) + 4 + 12 * num_topk,
        combine_row=values + 4 * num_topk,
        forward_slot=window.forward_slot_bytes(data_bytes, num_sf, num_topk, node_ranks),
        combine_entry=values + _align16(16 + 4 * num_topk),
        node_slot=values + _align16(16 + 4 * num_topk * node_ranks),
    )


def reach(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[T, R]`` bool: token ``t`` has a valid expert on rank ``d`` (``-1`` entries ignored)."""
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, num_ranks))
    hit = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, dest.to(torch.int64), True)
    return hit[:, :num_ranks]


@dataclasses.dataclass
class CallBytes:
    """One call's bytes per link: ``nvlink[i, j]`` / ``rdma[i, j]`` int64 ``[R, R]``, sent by rank
    ``i`` to rank ``j`` (the diagonal is 0); ``rows`` counts the rows (slots, entries) in each;
    ``rdma_control`` the header and tag bytes included in ``rdma``."""
    nvlink: torch.Tensor
    rdma: torch.Tensor
    nvlink_rows: torch.Tensor
    rdma_rows: torch.Tensor
    rdma_control: torch.Tensor

    def domain(self, name: str) -> torch.Tensor:
        """The ``[R, R]`` byte matrix of ``name`` (one of `DOMAINS`)."""
        return {"nvlink": self.nvlink, "rdma": self.rdma}[name]

    def per_rank(self) -> Dict[str, Dict[str, list]]:
        """``{domain: {"sent": [R], "received": [R]}}`` bytes per rank."""
        return {name: {"sent": self.domain(name).sum(1).tolist(), "received": self.domain(name).sum(0).tolist()}
                for name in DOMAINS}

    def totals(self) -> Dict[str, int]:
        """Bytes of all ranks per domain."""
        return {name: int(self.domain(name).sum()) for name in DOMAINS}


@dataclasses.dataclass
class RouteCounts:
    """What a routing sends where, for nodes of ``num_nvlink_ranks`` (int64 ``[R, R]`` each):
    ``tokens[s, d]`` tokens of ``s`` reaching ``d``; ``slots[s, f]`` tokens of ``s`` reaching the node
    of its rail peer ``f`` (hybrid forwarding slots); ``onward[f, d]`` rows rail peer ``f`` stores to
    ``d`` of its node for other nodes' sources; ``nodes_reached[s]`` (token, node) pairs of ``s``;
    ``num_experts`` the routing's E (0: unknown, as for counts made by hand)."""
    num_nvlink_ranks: int
    tokens: torch.Tensor
    slots: torch.Tensor
    onward: torch.Tensor
    nodes_reached: torch.Tensor
    num_experts: int = 0


def route_counts(topk_idxs: Sequence[torch.Tensor], num_experts: int, num_nvlink_ranks: int) -> RouteCounts:
    """`RouteCounts` of every rank's ``topk_idx`` (int64 ``[T_s, K]``, ``-1``: none).

    Raises:
        ValueError: N does not divide R, or R does not divide E.
    """
    num_ranks = len(topk_idxs)
    if num_ranks < 1 or num_nvlink_ranks < 1 or num_ranks % num_nvlink_ranks:
        raise ValueError(f"num_nvlink_ranks={num_nvlink_ranks} must divide the {num_ranks} ranks")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by {num_ranks} ranks")
    node_ranks, num_nodes = num_nvlink_ranks, num_ranks // num_nvlink_ranks
    tokens, slots, onward = (torch.zeros(num_ranks, num_ranks, dtype=torch.int64, device=_CPU) for _ in range(3))
    nodes_reached = torch.zeros(num_ranks, dtype=torch.int64, device=_CPU)
    for source, idx in enumerate(topk_idxs):
        hits = reach(idx.cpu(), num_experts, num_ranks)
        tokens[source] = hits.sum(0)
        by_node = hits.view(hits.shape[0], num_nodes, node_ranks)
        node_hits = by_node.any(2)                                   # [T, nodes]
        nodes_reached[source] = node_hits.sum()
        local, own_node = source % node_ranks, source // node_ranks
        forwarders = torch.arange(num_nodes, dtype=torch.int64, device=_CPU) * node_ranks + local
        slots[source, forwarders] = node_hits.sum(0)
        slots[source, own_node * node_ranks + local] = 0
        rows = by_node.sum(0)                                        # [nodes, node_ranks]
        rows[:, local] = 0                                           # the forwarder's own rows stay there
        rows[own_node] = 0                                           # the own node is reached directly
        onward[forwarders] += torch.zeros(num_nodes, num_ranks, dtype=torch.int64, device=_CPU).scatter_(
            1, torch.arange(num_ranks, dtype=torch.int64, device=_CPU).view(num_nodes, node_ranks), rows)
    return RouteCounts(num_nvlink_ranks, tokens, slots, onward, nodes_reached, num_experts)


def link_bytes(topk_idxs: Sequence[torch.Tensor], num_experts: int, num_nvlink_ranks: int, *, hybrid: bool,
               hidden: int, fp8: bool = False, num_sf: int = 0, notify: bool = False) -> Dict[str, CallBytes]:
    """Bytes per link of one dispatch and of the combine of its handle (module docstring).

    Args:
        topk_idxs: per source rank, int64 ``[T_s, K]`` (``-1``: no expert); `link_bytes_of_counts`
            takes their `RouteCounts` instead.
        num_experts: E, divisible by the number of ranks ``R = len(topk_idxs)``.
        num_nvlink_ranks: N, ranks per node (dividing ``R``).
        hybrid: the buffer's ``allow_hybrid_mode`` (it changes nothing with one node or one rank per node).
        hidden: H; fp8 / num_sf: FP8 dispatch with ``num_sf`` 4-byte scale factors per row.
        notify: a fresh dispatch, its notify stage's count rows and tags included in ``dispatch``
            (default False: the data kernel's bytes alone, those of a cached dispatch).

    Returns:
        ``{"dispatch": CallBytes, "combine": CallBytes}``. The layout (expanded or not) does not
        change them: both send one row per (token, rank).

    Raises:
        ValueError: N does not divide R, or R does not divide E.
    """
    counts = route_counts(topk_idxs, num_experts, num_nvlink_ranks)
    return link_bytes_of_counts(counts, int(topk_idxs[0].shape[1]), hybrid=hybrid, hidden=hidden, fp8=fp8,
                                num_sf=num_sf, notify=notify)


def link_bytes_of_counts(counts: RouteCounts, num_topk: int, *, hybrid: bool, hidden: int, fp8: bool = False,
                         num_sf: int = 0, notify: bool = False) -> Dict[str, CallBytes]:
    """`link_bytes` of a routing's `RouteCounts` (top-``num_topk``).

    Raises:
        ValueError: ``notify`` with counts that do not know their number of experts.
    """
    calls = _data_bytes(counts, num_topk, hybrid=hybrid, hidden=hidden, fp8=fp8, num_sf=num_sf)
    if notify:
        if counts.num_experts < 1:
            raise ValueError("link_bytes_of_counts: notify=True needs the counts' num_experts (route_counts sets it)")
        num_ranks, node_ranks = counts.tokens.shape[0], counts.num_nvlink_ranks
        rank_ids = torch.arange(num_ranks, dtype=torch.int64, device=_CPU)
        peers = (rank_ids[:, None] // node_ranks) != (rank_ids[None, :] // node_ranks)
        if hybrid and node_ranks > 1:
            peers &= (rank_ids[:, None] % node_ranks) == (rank_ids[None, :] % node_ranks)
        control = peers.long() * (count_row_bytes(num_ranks, counts.num_experts) + CALL_TAG_BYTES)
        dispatch = calls["dispatch"]
        calls["dispatch"] = dataclasses.replace(dispatch, rdma=dispatch.rdma + control,
                                                rdma_control=dispatch.rdma_control + control)
    return calls


def _data_bytes(counts: RouteCounts, num_topk: int, *, hybrid: bool, hidden: int, fp8: bool,
                num_sf: int) -> Dict[str, CallBytes]:
    """The data kernels' bytes of `link_bytes_of_counts` (the notify stage left out)."""
    num_ranks = counts.tokens.shape[0]
    node_ranks = counts.num_nvlink_ranks
    num_nodes = num_ranks // node_ranks
    sizes = row_sizes(hidden, num_topk, fp8=fp8, num_sf=num_sf, node_ranks=node_ranks)
    rank_ids = torch.arange(num_ranks, dtype=torch.int64, device=_CPU)
    cross = (rank_ids[:, None] // node_ranks) != (rank_ids[None, :] // node_ranks)
    same_node = ~cross & ~torch.eye(num_ranks, dtype=torch.bool, device=_CPU)
    tokens = counts.tokens
    if not (hybrid and num_nodes > 1 and node_ranks > 1):
        rows = tokens * (cross | same_node)
        tags = cross.long() * CALL_TAG_BYTES    # every GIN peer gets the tag (cross is symmetric)
        out = {}
        for name, row_bytes, call_rows in (("dispatch", sizes.dispatch_row, rows), ("combine", sizes.combine_row, rows.T)):
            near, far = call_rows * same_node, call_rows * cross
            out[name] = CallBytes(near * row_bytes, far * row_bytes + tags, near, far, tags)
        return out
    rail = cross & ((rank_ids[:, None] % node_ranks) == (rank_ids[None, :] % node_ranks))
    own, slots, onward = tokens * same_node, counts.slots, counts.onward
    # Dispatch: own node stored directly, then the forwarders' stores onward.
    dispatch_control = rail.long() * (FORWARD_HEADER_BYTES + CALL_TAG_BYTES)
    dispatch = CallBytes((own + onward) * sizes.dispatch_row, slots * sizes.forward_slot + dispatch_control,
                         own + onward, slots.clone(), dispatch_control)
    # Combine: the own node's partial rows to the source, other nodes' partials to the forwarder (the
    # reverse of its stores), one node slot per (token, node) to the source.
    combine_control = rail.long() * CALL_TAG_BYTES * node_ranks
    combine = CallBytes(own.T * sizes.combine_row + onward.T * sizes.combine_entry,
                        slots.T * sizes.node_slot + combine_control, own.T + onward.T, slots.T.clone(),
                        combine_control)
    return {"dispatch": dispatch, "combine": combine}


def deepep_logical_bytes(counts: RouteCounts, num_topk: int, num_scaleout_ranks: int, *, hidden: int,
                         fp8: bool = False, num_sf: int = 0) -> Dict[str, Dict[str, list]]:
    """DeepEP V2's logical byte counts per rank (``tests/elastic/test_ep.py``, local traffic included,
    multiple reduction on), from a routing's `RouteCounts`:
    ``{"dispatch" | "combine": {"scaleout": [R], "scaleup": [R]}}``.

    ``scaleout``: the rank's tokens times the scale-out ranks (nodes in hybrid mode) each reaches,
    this rank's own included; 0 with one scale-out rank (direct mode's logical split is ``(1, R)``).
    ``scaleup``: the tokens the rank receives. Bytes per token: dispatch ``data + 4 num_sf + 8 K +
    4 K`` (received rows, int64 indices, float32 weights), combine ``2 H + 4 K``.

    Raises:
        ValueError: ``num_scaleout_ranks`` is neither 1 nor the number of nodes of ``counts``.
    """
    num_ranks = counts.tokens.shape[0]
    if num_scaleout_ranks not in (1, num_ranks // counts.num_nvlink_ranks):
        raise ValueError(f"num_scaleout_ranks={num_scaleout_ranks}: 1 or the {num_ranks // counts.num_nvlink_ranks} "
                         f"nodes of the counts")
    dispatch_token = (hidden + 4 * num_sf if fp8 else 2 * hidden) + 12 * num_topk
    combine_token = 2 * hidden + 4 * num_topk
    scaleout_tokens = counts.nodes_reached if num_scaleout_ranks > 1 else torch.zeros(num_ranks, dtype=torch.int64, device=_CPU)
    received = counts.tokens.sum(0)
    return {name: {"scaleout": (scaleout_tokens * per_token).tolist(), "scaleup": (received * per_token).tolist()}
            for name, per_token in (("dispatch", dispatch_token), ("combine", combine_token))}
