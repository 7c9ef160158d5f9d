"""Layout of the symmetric window the GPU kernels use, and the buffer-size hint.

Every rank's window has the same layout (offsets are identical on all ranks, so a kernel can address
a peer's region through the peer's base pointer):

==========  ==========================================  ==============================================
region      size                                        content
==========  ==========================================  ==============================================
control     64 KiB                                      u32 signal counters (one per peer), epoch,
                                                        round, done-counters (producer and consumer
                                                        phases), error record
                                                        (``include/deep_ep/common/abi.cuh``)
counts      ``R * (R + MAX_EXPERTS + 2) * 4``, 64 KiB   the count matrix of the layout stage: row
                                                        ``s`` = tokens per destination rank and pairs
                                                        per expert sent by rank ``s``
receive     ``2 * R * M * row_stride``                  two halves (consecutive rounds alternate, so
                                                        a round never overwrites rows a peer may still
                                                        read from the previous one); each half holds
                                                        ``R * M`` token rows
==========  ==========================================  ==============================================

``M`` is ``num_max_tokens_per_rank``. A row must hold either a dispatched token (data, scale factors,
a metadata trailer of ``4 + 12 K`` bytes) or a staged combine row (``H`` bf16 values in both
layouts, plus ``K`` fp32 weights), so
``row_stride = max(align16(data + sf) + align16(4 + 12 K), align16(2 H) + align16(4 K))``. A buffer
with ``allow_multiple_reduction=False`` stages the combine of an expanded handle unreduced, one row
per (token, slot): its halves hold ``K`` combine rows per token row (`check_single_reduction`), which
also gives hybrid mode's forwarding area and inbox room for rows passed on unreduced
(`check_hybrid_combine`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .abi import COUNTS_EXTRA_WORDS, CTRL_BYTES, MAX_EXPERTS, MAX_RANKS, MAX_TOPK

BUFFER_ALIGNMENT = 2 * 1024 * 1024  # window sizes are rounded up to 2 MiB (NCCL's allocation granularity)


def check_num_ranks(num_ranks: int) -> None:
    """Refuse a GPU group of more ranks than a window has room for: `MAX_RANKS` (``kMaxRanks``), the
    per-peer signal and tag words of the control region and the kernels' shared-memory peer table, all
    indexed by group rank. (Dispatch also needs ``num_experts`` divisible by the ranks and at most
    `MAX_EXPERTS`, so no group of more ranks could dispatch either.)

    Raises:
        ValueError: ``num_ranks > MAX_RANKS``.
    """
    if num_ranks > MAX_RANKS:
        raise ValueError(f"a GPU buffer holds at most {MAX_RANKS} ranks (kMaxRanks: per-peer words of every window's "
                         f"control region, include/deep_ep/common/abi.cuh); this group has {num_ranks} "
                         f"(docs/scaleout.md, \"How large a job\")")



def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class WindowLayout:
    """Byte offsets of one window; see the module docstring."""
    num_ranks: int
    num_max_tokens_per_rank: int
    row_stride: int
    counts_offset: int
    recv_offset: int
    half_bytes: int
    num_bytes: int

    @property
    def rows_per_half(self) -> int:
        return self.half_bytes // self.row_stride if self.row_stride else 0


def dispatch_row_stride(data_bytes: int, num_sf: int, num_topk: int) -> int:
    """Bytes of a dispatched token's window row: ``data_bytes`` of data, ``num_sf`` 4-byte scale
    factors, the metadata trailer. ``num_topk=0`` assumes `MAX_TOPK`."""
    return _align(data_bytes + 4 * num_sf, 16) + _align(4 + 12 * (num_topk or MAX_TOPK), 16)


def forward_slot_bytes(data_bytes: int, num_sf: int, num_topk: int, node_ranks: int) -> int:
    """Bytes of a hybrid dispatch's forwarding slot (impls/dispatch_forward.cuh): the row's data and
    scale factors, then the trailer (token, call mark and fingerprint, ``num_topk`` ids, weights and pair rows, a token
    row per rank of the destination node of ``node_ranks``)."""
    return _align(data_bytes + 4 * num_sf, 16) + _align(16 + 12 * num_topk + 4 * node_ranks, 16)


def check_hybrid_combine(half_bytes: int, num_ranks: int, node_ranks: int, num_max_tokens: int, hidden: int,
                         num_topk: int, unreduced: bool = False, expanded: bool = False) -> None:
    """Refuse a hybrid combine whose rows do not fit, each region ``half_bytes / nodes`` per source
    node. With multiple reduction (impls/combine_forward.cuh): an entry per (token, rank of the node)
    in the forwarding area, a node slot per token in the inbox. ``unreduced`` (a buffer with
    ``allow_multiple_reduction=False``, impls/combine_hybrid_single.cuh): an entry per (token, rank of
    the node), or per (token, slot) when ``expanded``, and a rows slot per token holding every entry.

    Raises:
        ValueError: they do not fit ``num_max_tokens`` tokens per rank.
    """
    values = _align(2 * hidden, 16)
    node_bytes = half_bytes // (num_ranks // node_ranks) // 16 * 16
    if unreduced and expanded:
        entries = num_max_tokens * num_topk * (values + 16)
        slot = _align(16 + 4 * num_topk, 16) + num_topk * values
    else:   # a node slot holds one node partial, or every rank's row unreduced
        entries = num_max_tokens * node_ranks * (values + _align(16 + 4 * num_topk, 16))
        slot = _align(16 + 4 * num_topk * node_ranks, 16) + (node_ranks if unreduced else 1) * values
    need = max(entries, num_max_tokens * slot)
    if need <= node_bytes:
        return
    if unreduced:
        what = "a row per (token, slot)" if expanded else "a row per (token, rank of a node)"
        raise ValueError(f"hybrid combine with allow_multiple_reduction=False passes {what} unreduced: "
                         f"{num_max_tokens} tokens per rank need {need} bytes per source node, the window's half "
                         f"holds {node_bytes}: create the buffer with num_bytes = "
                         f"ElasticBuffer.get_buffer_size_hint(..., num_topk={num_topk}, "
                         f"allow_multiple_reduction=False)")
    raise ValueError(f"hybrid combine: {num_max_tokens} tokens per rank need {need} "
                     f"bytes per source node, the window's half holds {node_bytes}: create the buffer with "
                     f"a larger num_bytes (see ElasticBuffer.get_buffer_size_hint)")


def check_single_reduction(rows_per_half: int, num_ranks: int, num_max_tokens: int, num_topk: int) -> None:
    """Refuse a combine of an expanded handle without multiple reduction (impls/combine_single.cuh)
    whose rows do not fit: every token row a rank holds stages ``num_topk`` rows, one per slot, so a
    half of ``rows_per_half`` combine rows must hold ``num_ranks * num_max_tokens * num_topk``.

    Raises:
        ValueError: they do not fit, or ``num_max_tokens`` is 0 (no bound on the tokens of the ranks).
    """
    if num_max_tokens <= 0:
        raise ValueError("combine of an expanded handle with allow_multiple_reduction=False stages a row per (token, "
                         "slot) and needs a bound on every rank's tokens: dispatch with num_max_tokens_per_rank set "
                         "(the buffer's or the call's)")
    need = num_ranks * num_max_tokens * num_topk
    if need > rows_per_half:
        raise ValueError(f"combine of an expanded handle with allow_multiple_reduction=False stages a row per (token, "
                         f"slot): {num_ranks} ranks x num_max_tokens_per_rank={num_max_tokens} x top-k {num_topk} = "
                         f"{need} rows, the window's half holds {rows_per_half}: create the buffer with "
                         f"num_bytes = ElasticBuffer.get_buffer_size_hint(..., num_topk={num_topk}, "
                         f"allow_multiple_reduction=False)")


def combine_row_stride(hidden: int, num_topk: int) -> int:
    """Bytes of a staged combine row: ``hidden`` bf16 values and the top-k weights."""
    return _align(2 * hidden, 16) + _align(4 * (num_topk or MAX_TOPK), 16)


def row_stride(hidden: int, num_topk: int, use_fp8_dispatch: bool) -> int:
    """Bytes of the largest row a buffer for ``hidden`` needs (see the module docstring): a buffer
    sized with it holds ``num_max_tokens_per_rank`` rows of every kind from every rank. Each call lays
    its rows out at its own kind's stride (`dispatch_row_stride`, `combine_row_stride`)."""
    data = hidden * (1 if use_fp8_dispatch else 2)
    sf = hidden // 128 if use_fp8_dispatch else 0
    return max(dispatch_row_stride(data, sf, num_topk), combine_row_stride(hidden, num_topk))


def make_layout(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                use_fp8_dispatch: bool = False, num_bytes: int = 0, stride: int = 0,
                allow_multiple_reduction: bool = True) -> WindowLayout:
    """The layout for a buffer; with ``num_bytes`` given, a window of that size (raises `ValueError`
    if it cannot hold ``num_max_tokens_per_rank`` tokens from every rank). ``stride``: the row stride
    (default: `row_stride` of ``hidden``). Without ``allow_multiple_reduction`` a token row's share of
    a half is at least ``K`` combine rows (``K``: ``num_topk``, or `MAX_TOPK` for 0) and what hybrid
    mode passes on unreduced per token and rank (`check_hybrid_combine`)."""
    stride = stride or row_stride(hidden, num_topk, use_fp8_dispatch)
    counts_offset = CTRL_BYTES
    recv_offset = counts_offset + _align(num_ranks * (num_ranks + MAX_EXPERTS + COUNTS_EXTRA_WORDS) * 4, 64 * 1024)
    per_token = stride
    if not allow_multiple_reduction:
        # K combine rows per token; in hybrid mode across nodes (nodes of S >= 2 ranks) also a node's
        # share of the unreduced entries and rows slots (`check_hybrid_combine`), at most this per token
        window_topk = num_topk or MAX_TOPK
        hybrid = _align(2 * hidden, 16) + _align(16 + 4 * window_topk, 16)
        per_token = max(stride, window_topk * combine_row_stride(hidden, num_topk), hybrid)
    half = num_ranks * num_max_tokens_per_rank * per_token
    need = _align(recv_offset + 2 * half, BUFFER_ALIGNMENT)
    if num_bytes:
        if num_bytes < need:
            raise ValueError(
                f"num_bytes={num_bytes} is too small for {num_max_tokens_per_rank} tokens per rank from "
                f"{num_ranks} ranks at hidden={hidden}: at least {need} bytes are needed "
                f"(ElasticBuffer.get_buffer_size_hint gives it)")
        half = (num_bytes - recv_offset) // 2
        half -= half % 16
    else:
        num_bytes = need
    return WindowLayout(num_ranks, num_max_tokens_per_rank, stride, counts_offset, recv_offset, half, num_bytes)


def buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                     use_fp8_dispatch: bool = False, *, allow_hybrid_mode: bool = True,
                     allow_multiple_reduction: bool = True) -> int:
    """Bytes of symmetric window one rank needs (a multiple of 2 MiB); see the module docstring.

    ``allow_hybrid_mode`` does not change the size: across nodes the scale-out transports allocate
    their staging, forwarding and inbox space beyond these bytes. ``allow_multiple_reduction=False``
    makes room for ``K`` staged combine rows per token (``K``: ``num_topk``, or `MAX_TOPK` for 0):
    the combine of an expanded handle then sends one row per (token, slot), and in hybrid mode across
    nodes the forwarders pass every rank's or slot's row on unreduced (`check_hybrid_combine`).

    Raises:
        ValueError: non-positive sizes, or more ranks than `check_num_ranks` allows.
    """
    if num_ranks <= 0 or num_max_tokens_per_rank <= 0 or hidden <= 0:
        raise ValueError(f"need num_ranks, num_max_tokens_per_rank and hidden > 0, got "
                         f"{num_ranks}, {num_max_tokens_per_rank}, {hidden}")
    check_num_ranks(num_ranks)
    return make_layout(num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                       allow_multiple_reduction=allow_multiple_reduction).num_bytes
