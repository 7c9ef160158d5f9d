"""Shape and layout helpers shared by the executable spec (`deep_ep.reference`) and the backends.

Everything here is a pure function of its arguments, vectorised torch that runs on any device (the
GPU backend can derive a handle's fields from its layout tensors with the same code the CPU backend
and the reference use). Nothing here communicates.

Sizes:
    align_up, worst_case_recv_tokens, worst_case_recv_rows, alloc_recv_sf
Row moves of any dtype:
    as_bits, as_rows, split_x
Routing of one rank's tokens:
    slot_owners, last_slot_of_rank
Handle fields (docs/design.md, "The handle"):
    expert_prefix_sum, build_recv_src_metadata, row_sources,
    pairs_prefix_sum_per_source, expanded_row_experts
"""
from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = [
    "align_up", "worst_case_recv_tokens", "worst_case_recv_rows", "alloc_recv_sf", "as_bits", "as_rows",
    "split_x", "slot_owners", "last_slot_of_rank", "expert_prefix_sum", "build_recv_src_metadata", "row_sources", "pairs_prefix_sum_per_source", "expanded_row_experts",
]

Tensor = torch.Tensor
XType = Union[Tensor, tuple]


# ---------------------------------------------------------------------------------------------- sizes
def align_up(value, alignment: int):
    """Smallest multiple of ``alignment`` that is >= ``value`` (ints or integer tensors)."""
    return (value + alignment - 1) // alignment * alignment


def worst_case_recv_tokens(num_ranks: int, num_max_tokens_per_rank: int) -> int:
    """Received tokens a ``do_cpu_sync=False`` dispatch allocates for: ``R * M`` (every rank's
    every token)."""
    return num_ranks * num_max_tokens_per_rank


def worst_case_recv_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int,
                         num_local_experts: int, expert_alignment: int, do_expand: bool) -> int:
    """Rows of the receive tensors of a ``do_cpu_sync=False`` dispatch (design.md).

    Non-expanded: ``R * M``. Expanded: ``R * M * min(K, L) + L * (A - 1)`` rounded up to ``A`` (every
    token selecting ``min(K, L)`` distinct local experts, every expert group padded by ``A - 1``).
    """
    if not do_expand:
        return worst_case_recv_tokens(num_ranks, num_max_tokens_per_rank)
    pairs = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts)
    return align_up(pairs + num_local_experts * (expert_alignment - 1), expert_alignment)


def alloc_recv_sf(rows: int, num_sf: int, dtype: torch.dtype, device, col_major: bool,
                  zero: bool = True) -> Tensor:
    """Allocate received scale factors ``[rows, num_sf]``.

    Row-major normally; with ``col_major`` a ``[rows, num_sf]`` view of a ``[num_sf, align4(rows)]``
    storage (the TMA-aligned layout DeepGEMM reads). ``zero=False`` leaves them uninitialised.
    """
    make = torch.zeros if zero else torch.empty
    if not col_major:
        return make((rows, num_sf), dtype=dtype, device=device)
    storage = make((num_sf, align_up(rows, 4)), dtype=dtype, device=device)
    return storage.t()[:rows]


# ---------------------------------------------------------------------------------------------- row moves
def split_x(x: XType) -> tuple:
    """``x`` -> ``(data, sf)``: ``(x, None)`` for a bf16 tensor, the pair itself for an FP8 tuple."""
    if isinstance(x, (tuple, list)):
        return x[0], x[1]
    return x, None


def as_bits(t: Tensor) -> Tensor:
    """View a tensor as the integer dtype of the same width (row moves of any dtype, FP8 included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def as_rows(t: Tensor, dtypes: tuple = (torch.int64, torch.int32, torch.int16)) -> Tensor:
    """View a contiguous ``[rows, n]`` tensor as ``[rows, m]`` of the widest integer type of ``dtypes``
    (none narrower than an element) that divides a row, else as uint8 bytes: moving whole rows
    (index_select / index_copy_) is then a few wide copies per row."""
    if t.numel() == 0 and t.dim() and t.stride(-1) != 1:
        # An empty tensor counts as contiguous whatever its strides (autograd hands a rank with no
        # tokens a [0, H] gradient of strides (0, 0)), but a dtype-changing view needs a unit last
        # stride: a dense copy of nothing (nothing to write through either).
        t = t.clone(memory_format=torch.contiguous_format)
    row_bytes = t.shape[1] * t.element_size()
    for dtype in dtypes:
        if row_bytes % dtype.itemsize == 0 and dtype.itemsize >= t.element_size():
            return t.view(dtype)
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------------------- routing
def slot_owners(topk_idx: Tensor, num_local_experts: int) -> Tensor:
    """int64 ``[T, K]``: the rank owning the expert of each top-k slot (``topk_idx // L``), -1 for a
    masked slot (``topk_idx == -1``)."""
    return torch.where(topk_idx >= 0, torch.div(topk_idx, num_local_experts, rounding_mode="floor"),
                       torch.full_like(topk_idx, -1))


def last_slot_of_rank(owners: Tensor) -> Tensor:
    """bool ``[T, K]``: slot ``k`` of token ``t`` is valid and no later slot of ``t`` has the same owner
    rank. With multiple reduction a rank's partial sum enters a token's result at this slot."""
    last = owners >= 0
    for k in range(owners.shape[1] - 1):
        last[:, k] &= ~(owners[:, k + 1:] == owners[:, k:k + 1]).any(1)
    return last


# ---------------------------------------------------------------------------------------------- handle fields
def expert_prefix_sum(unaligned: Tensor, expert_alignment: int, do_expand: bool) -> Tensor:
    """``psum_num_recv_tokens_per_expert`` (int32 ``[L]``) from the unaligned received pairs per local
    expert.

    Non-expanded: the inclusive prefix sum of the counts aligned up to ``A``. Expanded: the aligned
    cumulative count of the experts before ``i`` plus the unaligned count of ``i``, so
    ``psum[i] - align(psum[i - 1], A)`` is expert ``i``'s count and ``align(psum[i], A)`` is where
    expert ``i + 1``'s rows start.
    """
    aligned = align_up(unaligned.to(torch.int64), expert_alignment)
    inclusive = torch.cumsum(aligned, 0)
    out = inclusive - aligned + unaligned.to(torch.int64) if do_expand else inclusive
    return out.to(torch.int32)


def build_recv_src_metadata(src_rank: Tensor, src_token: Tensor, local: Tensor, slot_rows: Optional[Tensor],
                            num_max_tokens_per_rank: int, capacity: int) -> Tensor:
    """``recv_src_metadata`` (int32 ``[capacity, K + 2]``) of the ``n`` received tokens, in received order.

    Args:
        src_rank, src_token: int ``[n]``, the source of each received token.
        local: bool ``[n, K]``, whether slot ``k`` of the token selects an expert of this rank.
        slot_rows: expanded layout: int ``[n, K]``, the expanded row of each slot (-1 where not local);
            None for the non-expanded layout.
        num_max_tokens_per_rank: M, the stride of the global token index.
        capacity: rows to allocate (``>= n``; rows past ``n`` hold -1).

    Columns: 0 = ``src_rank * M + src_token``; 1 = ``src_rank * K + k_last`` with ``k_last`` the last
    slot of the token that is local to this rank; 2.. = ``slot_rows`` (-1 in the non-expanded layout).
    """
    n, K = local.shape
    out = torch.full((capacity, K + 2), -1, dtype=torch.int32, device=local.device)
    if n == 0:
        return out
    src_rank = src_rank.to(torch.int64)
    k_last = (local.to(torch.int64) * torch.arange(1, K + 1, device=local.device)).max(1).values - 1
    out[:n, 0] = (src_rank * num_max_tokens_per_rank + src_token.to(torch.int64)).to(torch.int32)
    out[:n, 1] = (src_rank * K + k_last).to(torch.int32)
    if slot_rows is not None:
        out[:n, 2:] = slot_rows.to(torch.int32)
    return out


def row_sources(recv_src_metadata: Tensor, num_rows: int, num_max_tokens_per_rank: int,
                do_expand: bool) -> tuple:
    """``(src_rank, src_token)``, int32 ``[num_rows]`` each: the source of every row of the receive
    tensors (-1 on expanded padding rows and rows past the true count), from ``recv_src_metadata``."""
    K = recv_src_metadata.shape[1] - 2
    meta = recv_src_metadata.to(torch.int64)
    valid = meta[:, 1] >= 0
    rank = torch.where(valid, torch.div(meta[:, 1], max(K, 1), rounding_mode="floor"), -1)
    token = torch.where(valid, meta[:, 0] - rank * num_max_tokens_per_rank, -1)
    if not do_expand:
        return rank[:num_rows].to(torch.int32), token[:num_rows].to(torch.int32)
    slots = meta[:, 2:]
    used = slots >= 0
    out_rank = torch.full((num_rows,), -1, dtype=torch.int32, device=meta.device)
    out_token = torch.full((num_rows,), -1, dtype=torch.int32, device=meta.device)
    rows = slots[used]
    out_rank[rows] = rank.unsqueeze(1).expand_as(slots)[used].to(torch.int32)
    out_token[rows] = token.unsqueeze(1).expand_as(slots)[used].to(torch.int32)
    return out_rank, out_token


def pairs_prefix_sum_per_source(recv_src_metadata: Tensor, num_ranks: int) -> Tensor:
    """int32 ``[R]``: inclusive prefix sum over source ranks of the received (token, local expert)
    pairs (expanded layout: the unpadded rows from each source), from ``recv_src_metadata``."""
    K = recv_src_metadata.shape[1] - 2
    meta = recv_src_metadata.to(torch.int64)
    valid = meta[:, 1] >= 0
    rank = torch.div(meta[valid, 1], max(K, 1), rounding_mode="floor")
    pairs = (meta[valid, 2:] >= 0).sum(1)
    counts = torch.zeros(num_ranks, dtype=torch.int64, device=meta.device).index_add_(0, rank, pairs)
    return torch.cumsum(counts, 0).to(torch.int32)


def expanded_row_experts(psum_num_recv_tokens_per_expert: Tensor, num_unaligned_recv_tokens_per_expert: Tensor,
                         num_rows: int) -> Tensor:
    """int64 ``[num_rows]``: the local expert of every row of an expanded receive tensor, -1 on padding
    rows and rows past the true count (what a grouped GEMM's per-row expert id would be)."""
    unaligned = num_unaligned_recv_tokens_per_expert.to(torch.int64)
    starts = psum_num_recv_tokens_per_expert.to(torch.int64) - unaligned
    L = unaligned.numel()
    device = unaligned.device
    experts = torch.repeat_interleave(torch.arange(L, device=device), unaligned)
    first = torch.cumsum(unaligned, 0) - unaligned
    rank_in_group = torch.arange(experts.numel(), device=device) - first[experts]
    out = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    out[starts[experts] + rank_in_group] = experts
    return out
