"""Executable specification of dispatch and combine (docs/design.md, "Semantics").

Everything here takes *all* ranks' inputs in one process and returns *every* rank's outputs, with
plain vectorised torch (no per-token Python loops), so it runs in seconds at DeepSeek-V3 sizes.
The CPU backend matches it bit for bit in every mode; the GPU kernels are checked against it.

Entry points:
    reference_dispatch(xs, topk_idxs, topk_weights, num_experts, ...) -> list[ReferenceDispatch]
    reference_combine(ys, handles, topk_weights=None, biases=None, ...) -> list[(combined_x, combined_w)]
    local_expert_counts(results)                                      the stats counter's increments
    check_dispatch(...) / check_combine(...)                          compare a backend's outputs

Combine, exactly (the order is what makes results bit-identical, and it is DeepEP V2's reference
order). For one token ``t`` of source rank ``s`` with top-k slots ``k = 0 .. K-1``, let ``d(k)`` be
the rank owning expert ``topk_idx[t, k]`` (slots with ``-1`` have no owner and contribute nothing),
and ``y(k)`` the bf16 row that ``d(k)`` returns for slot ``k``: the non-expanded layout has one row
per (token, rank), ``x_d[dst_buffer_slot_idx[t, d]]``, shared by all slots of ``d``; the expanded
layout has one row per slot, ``x_d[dst_buffer_slot_idx[t, k]]``. All sums are float32, ``+=`` rounds
to float32 after every addition, and ``bf16(.)`` rounds to nearest even.

1. ``acc = fp32(bias_0) + fp32(bias_1)``, or ``fp32(bias_0)`` with one bias, or ``+0.0`` with none.
2. Multiple reduction (the non-expanded layout always; the expanded layout when the buffer was
   created with ``allow_multiple_reduction=True``, the default): each rank ``d`` first reduces its
   own slots, ``p_d = bf16(+0.0 + c(k1) + c(k2) + ...)`` over the slots of ``d`` in ascending ``k``
   (non-expanded: ``p_d`` is the single row ``x_d[row]`` itself); then for ``k = 0 .. K-1``:
   ``acc += fp32(p_d(k))`` if ``k`` is the *last* slot of ``d(k)`` (`shapes.last_slot_of_rank`),
   else ``acc += +0.0``.
3. Single reduction (expanded layout with ``allow_multiple_reduction=False``): for ``k = 0 .. K-1``:
   ``acc += c(k)`` (``+0.0`` for a masked slot).
4. ``combined_x[t] = bf16(acc)``.

Hybrid order (``reference_combine(..., num_scaleup_ranks=S)`` with ``S < R``: DeepEP's hybrid mode
across ``R / S`` nodes, ranks ``n S .. n S + S - 1`` forming node ``n``) with multiple reduction:
rank, then node, then across. The rank partials ``p_d`` are those of step 2; node ``n`` first sums
its ranks' partials, ``q_n = bf16(+0.0 + fp32(p_d) + ...)`` over the ranks ``d`` of ``n`` that the
token reached, in ascending order of ``d``'s last slot (the node's forwarder does this before the
token crosses the network, so ``q_n`` is rounded to bf16 there); then step 2 runs over nodes instead
of ranks: for ``k = 0 .. K-1``, ``acc += fp32(q_n(k))`` if ``k`` is the last slot of the node
``n(k)`` owning slot ``k``, else ``acc += +0.0``. With ``allow_multiple_reduction=False`` (either
layout) the hybrid order is the flat one: forwarders pass every rank's row (or every slot's) on
unreduced.

``c(k) = fp32(y(k))``, or with ``apply_dispatch_weights=True`` (expanded layout only)
``c(k) = fp32(w(k) * fp32(y(k)))``, ``w(k)`` the dispatch weight of that row on ``d(k)``
(``handle.recv_topk_weights``). The ``+0.0`` additions matter only when the biases sum to ``-0.0``.

Reduced weights: ``combined_topk_weights[t, k]`` is the value rank ``d(k)`` holds for slot ``k``
(non-expanded: ``topk_weights_d[row, k]``; expanded: ``topk_weights_d[row of (t, k)]``), ``0`` for a
masked slot; nothing is summed. The expanded layout needs multiple reduction for this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from . import shapes
from .handle import EPHandle
# Re-exported for existing callers; new code imports them from deep_ep.shapes.
from .shapes import align_up, alloc_recv_sf, as_bits, as_rows, split_x, worst_case_recv_rows  # noqa: F401

__all__ = [
    "ReferenceDispatch", "reference_dispatch", "reference_combine", "local_expert_counts",
    "check_dispatch", "check_combine", "hybrid_node_partials", "HANDLE_VALUE_FIELDS", "HANDLE_TENSOR_FIELDS",
]

Tensor = torch.Tensor
XType = Union[Tensor, tuple]


# ---------------------------------------------------------------------------------------------- dispatch
@dataclass
class ReferenceDispatch:
    """One rank's dispatch outputs: what `ElasticBuffer.dispatch` returns there (less the event)."""
    recv_x: XType
    recv_topk_idx: Optional[Tensor]    # None in the expanded layout
    recv_topk_weights: Optional[Tensor]
    handle: EPHandle
    num_valid_rows: int          # rows that hold data (excl. rows past the true count), incl. padding
    is_padding_row: Tensor       # [rows] bool: expanded padding rows (within the true count)

    def as_tuple(self):
        """``(recv_x, recv_topk_idx, recv_topk_weights, handle)``, as `ElasticBuffer.dispatch` returns
        them (less the event)."""
        return self.recv_x, self.recv_topk_idx, self.recv_topk_weights, self.handle


def reference_dispatch(xs: Sequence[XType], topk_idxs: Sequence[Tensor],
                       topk_weights: Optional[Sequence[Optional[Tensor]]], num_experts: int, *,
                       do_expand: bool = False, expert_alignment: int = 1, do_zero_padding: bool = True,
                       do_cpu_sync: bool = True, num_max_tokens_per_rank: int = 0,
                       use_tma_aligned_col_major_sf: bool = False) -> list:
    """Every rank's dispatch result, from every rank's inputs.

    Args:
        xs: per source rank ``s``, bf16 ``[T_s, H]`` or ``(fp8 data [T_s, H], sf [T_s, num_sf])``.
        topk_idxs: per rank, int64 ``[T_s, K]``; ``-1`` = no selection.
        topk_weights: None, or per rank float32 ``[T_s, K]`` (or None for every rank).
        num_experts: E, divisible by the number of ranks R = ``len(xs)``.
        do_expand, expert_alignment, do_zero_padding, use_tma_aligned_col_major_sf: as in
            `ElasticBuffer.dispatch`. Padding rows are always zero here (with ``do_zero_padding=False``
            their content is unspecified, so zero is as good as anything).
        do_cpu_sync: False -> outputs sized for the worst case (`shapes.worst_case_recv_rows`), rows
            past the true count hold zeros, ``recv_topk_idx = -1``, weights 0, metadata -1.
        num_max_tokens_per_rank: M, needed when ``do_cpu_sync=False`` (and the stride of
            ``recv_src_metadata``'s global token index).

    Returns:
        list of `ReferenceDispatch`, one per rank, whose ``handle`` has ``buffer_id = -1``. A cached
        dispatch of new data with the same routing equals ``reference_dispatch`` of that data (with
        ``topk_weights=None`` when the cached call passes none).
    """
    num_ranks = len(xs)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by {num_ranks} ranks")
    L = num_experts // num_ranks
    A = int(expert_alignment)
    M = int(num_max_tokens_per_rank)
    datas, sfs = zip(*(split_x(x) for x in xs))
    is_fp8 = sfs[0] is not None
    device = datas[0].device
    num_tokens = [int(d.shape[0]) for d in datas]
    hidden = int(datas[0].shape[1])
    K = int(topk_idxs[0].shape[1])
    if not do_cpu_sync and M <= 0:
        raise ValueError("do_cpu_sync=False needs num_max_tokens_per_rank > 0")
    has_weights = topk_weights is not None and topk_weights[0] is not None

    # All tokens of all ranks, in (source rank, source token) order: global index g.
    data_all = torch.cat(datas, 0)
    sf_all = torch.cat([s.contiguous() for s in sfs], 0) if is_fp8 else None
    idx_all = torch.cat(list(topk_idxs), 0).to(torch.int64)
    w_all = torch.cat(list(topk_weights), 0).float() if has_weights else None
    src_rank_all = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                           torch.tensor(num_tokens, dtype=torch.int64, device=device))
    src_tok_all = torch.cat([torch.arange(t, device=device) for t in num_tokens])
    offsets = [0]
    for t in num_tokens:
        offsets.append(offsets[-1] + t)
    N = offsets[-1]
    owner = shapes.slot_owners(idx_all, L)

    send_pos_all = torch.full((N, K if do_expand else num_ranks), -1, dtype=torch.int32, device=device)
    results = []
    for d in range(num_ranks):
        local = owner == d                                            # [N, K]
        local_expert = idx_all - d * L                                # valid where local
        counts = torch.bincount(local_expert[local], minlength=L).to(torch.int32)   # unaligned pairs
        aligned = align_up(counts, A)
        tok_g = local.any(1).nonzero().squeeze(1)                     # received tokens, by (s, t)
        n_tok = int(tok_g.numel())
        tok_capacity = n_tok if do_cpu_sync else shapes.worst_case_recv_tokens(num_ranks, M)
        if n_tok > tok_capacity:
            raise ValueError(f"rank {d} receives {n_tok} tokens, more than the {tok_capacity} allocated")
        n_expanded = int(aligned.sum())
        expanded_capacity = n_expanded if do_cpu_sync else worst_case_recv_rows(num_ranks, M, K, L, A, True)
        slot_rows = None
        if not do_expand:
            rows, n_valid = tok_capacity, n_tok
            row_of = torch.arange(n_tok, device=device)
            src_g = tok_g
            send_pos_all[tok_g, d] = row_of.to(torch.int32)
            recv_idx = torch.full((rows, K), -1, dtype=torch.int64, device=device)
            recv_idx[:n_tok] = torch.where(local[tok_g], local_expert[tok_g], -1)
            recv_w = None
            if has_weights:
                recv_w = torch.zeros((rows, K), dtype=torch.float32, device=device)
                recv_w[:n_tok] = torch.where(local[tok_g], w_all[tok_g], 0.0)
            is_pad = torch.zeros(rows, dtype=torch.bool, device=device)
            handle_w = None
        else:
            rows, n_valid = expanded_capacity, n_expanded
            if n_valid > rows:
                raise ValueError(f"rank {d} receives {n_valid} rows, more than the {rows} allocated")
            pair = local.flatten().nonzero().squeeze(1)              # ascending (g, k)
            e = local_expert.flatten()[pair]
            order = torch.sort(e, stable=True).indices               # by expert, then (g, k)
            pair, e = pair[order], e[order]
            g, k = torch.div(pair, K, rounding_mode="floor"), pair % K
            starts = torch.cumsum(aligned, 0) - aligned              # aligned group starts
            ustarts = torch.cumsum(counts, 0) - counts               # unaligned group starts
            row_of = starts[e] + torch.arange(pair.numel(), device=device) - ustarts[e]
            src_g = g
            send_pos_all[g, k] = row_of.to(torch.int32)
            token_pos = torch.full((N,), -1, dtype=torch.int64, device=device)
            token_pos[tok_g] = torch.arange(n_tok, device=device)
            slot_rows = torch.full((n_tok, K), -1, dtype=torch.int64, device=device)
            slot_rows[token_pos[g], k] = row_of
            recv_idx = None
            recv_w = None
            if has_weights:
                recv_w = torch.zeros(rows, dtype=torch.float32, device=device)
                recv_w[row_of] = w_all[g, k]
            is_pad = torch.zeros(rows, dtype=torch.bool, device=device)
            is_pad[:n_valid] = True
            is_pad[row_of] = False
            handle_w = recv_w

        recv_data = torch.zeros((rows, hidden), dtype=data_all.dtype, device=device)
        as_rows(recv_data).index_copy_(0, row_of, as_rows(data_all).index_select(0, src_g))
        if is_fp8:
            recv_sf = alloc_recv_sf(rows, sf_all.shape[1], sf_all.dtype, device, use_tma_aligned_col_major_sf)
            recv_sf[row_of] = sf_all[src_g]
            recv_x = (recv_data, recv_sf)
        else:
            recv_x = recv_data
        tokens_per_src = torch.bincount(src_rank_all[tok_g], minlength=num_ranks)
        metadata = shapes.build_recv_src_metadata(src_rank_all[tok_g], src_tok_all[tok_g], local[tok_g],
                                                  slot_rows, M, tok_capacity)
        handle = EPHandle(
            do_expand=do_expand, num_experts=num_experts, expert_alignment=A, num_max_tokens_per_rank=M,
            num_sms=0, topk_idx=topk_idxs[d].to(torch.int64).clone(), num_recv_tokens=tok_capacity,
            num_expanded_tokens=expanded_capacity,
            num_recv_tokens_per_expert_list=aligned.tolist() if do_cpu_sync else [],
            psum_num_recv_tokens_per_scaleup_rank=torch.cumsum(tokens_per_src, 0).to(torch.int32),
            psum_num_recv_tokens_per_expert=shapes.expert_prefix_sum(counts, A, do_expand),
            num_unaligned_recv_tokens_per_expert=counts, recv_src_metadata=metadata,
            dst_buffer_slot_idx=send_pos_all,   # replaced by each source's rows below
            buffer_id=-1, num_ranks=num_ranks, rank=d, hidden=hidden, do_cpu_sync=bool(do_cpu_sync),
            recv_topk_weights=handle_w)
        results.append(ReferenceDispatch(recv_x, recv_idx, recv_w, handle, n_valid, is_pad))

    for s, res in enumerate(results):
        res.handle.dst_buffer_slot_idx = send_pos_all[offsets[s]:offsets[s + 1]].clone()
    return results


def local_expert_counts(results: Sequence[ReferenceDispatch]) -> list:
    """Per rank, int32 ``[L]`` unaligned received pairs per local expert (what
    ``cumulative_local_expert_recv_stats`` is incremented by)."""
    return [res.handle.num_unaligned_recv_tokens_per_expert.clone() for res in results]


# ---------------------------------------------------------------------------------------------- combine
def _bias_tuple(bias) -> tuple:
    if bias is None:
        return ()
    if isinstance(bias, Tensor):
        return (bias,)
    return tuple(b for b in bias if b is not None)


def _bias_sum(bias: tuple, num_tokens: int, hidden: int, device) -> Tensor:
    """Step 1 of the combine order: float32 ``[T, H]``, ``fp32(b0) + fp32(b1)``, ``fp32(b0)``, or +0.0."""
    if not bias:
        return torch.zeros((num_tokens, hidden), dtype=torch.float32, device=device)
    acc = bias[0].to(torch.float32, copy=True)
    if len(bias) > 1:
        acc += bias[1].float()
    return acc


def _gather(t: Tensor, rows: Tensor) -> Tensor:
    """``t[rows]`` for a ``[n, H]`` tensor, moved as wide integer words (bf16 gathers are slow on CPU)."""
    return as_rows(t).index_select(0, rows).view(t.dtype)


def _slot_rows(h: EPHandle, owner: Tensor) -> Tensor:
    """int64 ``[T, K]``: the row at the owner rank of each slot (-1 for masked slots)."""
    pos = h.dst_buffer_slot_idx.to(torch.int64)
    if h.do_expand:
        return torch.where(owner >= 0, pos, -1)
    return torch.where(owner >= 0, pos.gather(1, owner.clamp(min=0)), -1)


def reference_combine(ys: Sequence[Tensor], handles: Sequence[EPHandle],
                      topk_weights: Optional[Sequence[Optional[Tensor]]] = None,
                      biases: Optional[Sequence] = None, *, allow_multiple_reduction: bool = True,
                      apply_dispatch_weights: bool = False, num_scaleup_ranks: Optional[int] = None) -> list:
    """Every rank's combine result, in the order of the module docstring.

    Args:
        ys: per rank ``d``, bf16 ``[handles[d].num_recv_rows, H]`` (the expert outputs, in the
            received layout; rows past the true count and padding rows are never read).
        handles: per rank, the handle its dispatch returned (reference or real).
        topk_weights: None, or per rank float32 ``[rows_d, K]`` (non-expanded) / ``[rows_d]``
            (expanded) to be reduced back like dispatch's backward.
        biases: None, or per rank None / a bf16 ``[T_s, H]`` tensor / a tuple of up to two.
        allow_multiple_reduction: the buffer's setting (affects the expanded layout only).
        apply_dispatch_weights: expanded layout only: multiply every row by its dispatch weight first.
        num_scaleup_ranks: None or ``R`` for the flat order; ``S < R`` (dividing ``R``) for the hybrid
            order of ``R / S`` nodes of ``S`` ranks (module docstring; the buffer's
            ``num_scaleup_ranks`` in hybrid mode across nodes).

    Returns:
        per rank ``(combined_x bf16 [T_s, H], combined_topk_weights float32 [T_s, K] or None)``.

    Raises:
        ValueError: expanded ``topk_weights`` without multiple reduction; ``apply_dispatch_weights``
        with a non-expanded handle or one whose dispatch had no weights; ``num_scaleup_ranks`` that
        is not a positive divisor of ``R``.
    """
    num_ranks = len(ys)
    if num_scaleup_ranks is None:
        num_scaleup_ranks = num_ranks
    if (not isinstance(num_scaleup_ranks, int) or isinstance(num_scaleup_ranks, bool) or num_scaleup_ranks <= 0
            or num_ranks % num_scaleup_ranks):
        raise ValueError(f"num_scaleup_ranks must be a positive divisor of the {num_ranks} ranks, "
                         f"got {num_scaleup_ranks!r}")
    has_w = topk_weights is not None and topk_weights[0] is not None
    expanded = handles[0].do_expand
    multi = allow_multiple_reduction or not expanded
    if has_w and not multi:
        raise ValueError("reducing topk_weights in the expanded layout needs allow_multiple_reduction=True")
    if apply_dispatch_weights and (not expanded or any(h.recv_topk_weights is None for h in handles)):
        raise ValueError("apply_dispatch_weights needs expanded handles whose dispatch had topk_weights")
    out = []
    for s in range(num_ranks):
        h = handles[s]
        T, H, K = h.num_tokens, h.hidden, h.num_topk
        device = ys[s].device
        owner = shapes.slot_owners(h.topk_idx, h.num_local_experts)
        rows = _slot_rows(h, owner)

        def contribution(d: int, sel: Tensor, k: int) -> Tensor:
            """fp32 ``c(k)`` of the tokens ``sel`` (all owned by ``d`` at slot ``k``)."""
            r = rows[sel, k]
            value = _gather(ys[d], r).float()
            if apply_dispatch_weights:
                value = handles[d].recv_topk_weights.index_select(0, r).unsqueeze(1) * value
            return value

        acc = _bias_sum(_bias_tuple(biases[s] if biases is not None else None), T, H, device)
        if multi:
            # p_d for every token that reached d, then added at d's last slot.
            partials = []
            for d in range(num_ranks):
                tok = (owner == d).any(1).nonzero().squeeze(1)
                where = torch.full((T,), -1, dtype=torch.int64, device=device)
                where[tok] = torch.arange(tok.numel(), device=device)
                if not expanded:
                    p = _gather(ys[d], h.dst_buffer_slot_idx[tok, d].long())
                else:
                    pacc = torch.zeros((tok.numel(), H), dtype=torch.float32, device=device)
                    for k in range(K):
                        sel = owner[tok, k] == d
                        if sel.any():
                            pacc[sel] += contribution(d, tok[sel], k)
                    p = pacc.to(torch.bfloat16)
                partials.append((where, p))
            if num_scaleup_ranks < num_ranks and allow_multiple_reduction:
                _add_partials(acc, *hybrid_node_partials(owner, partials, num_scaleup_ranks, H))
            else:
                _add_partials(acc, owner, partials)
        else:
            for k in range(K):
                staging = torch.zeros((T, H), dtype=torch.float32, device=device)
                for d in range(num_ranks):
                    sel = (owner[:, k] == d).nonzero().squeeze(1)
                    if sel.numel():
                        staging[sel] = contribution(d, sel, k)
                acc += staging
        cw = None
        if has_w:
            cw = torch.zeros((T, K), dtype=torch.float32, device=device)
            for d in range(num_ranks):
                for k in range(K):
                    sel = (owner[:, k] == d).nonzero().squeeze(1)
                    if sel.numel():
                        w = topk_weights[d].float()
                        cw[sel, k] = w[rows[sel, k]] if expanded else w[rows[sel, k], k]
        out.append((acc.to(torch.bfloat16), cw))
    return out


def _add_partials(acc: Tensor, owner: Tensor, partials: list) -> None:
    """Step 2's additions: for ``k = 0 .. K-1``, ``acc += fp32(partial of owner(k))`` at the owner's
    last slot, ``+0.0`` elsewhere. ``partials[d] = (where, rows)``: ``rows`` bf16 ``[n_d, H]``, the
    row of token ``t`` at ``where[t]`` (-1 for tokens ``d`` does not hold)."""
    T, H = acc.shape
    last = shapes.last_slot_of_rank(owner)
    for k in range(owner.shape[1]):
        staging = torch.zeros((T, H), dtype=torch.bfloat16, device=acc.device)
        for d, (where, p) in enumerate(partials):
            sel = (last[:, k] & (owner[:, k] == d)).nonzero().squeeze(1)
            if sel.numel():
                as_rows(staging).index_copy_(0, sel, as_rows(p).index_select(0, where[sel]))
        acc += staging.float()


def hybrid_node_partials(owner: Tensor, partials: list, num_scaleup_ranks: int, hidden: int) -> tuple:
    """The hybrid order's node level (module docstring): from the rank partials of one source's tokens
    to the node partials ``q_n``.

    Args:
        owner: int64 ``[T, K]``, the rank of each slot (-1 for a masked slot).
        partials: per rank ``d``, ``(where int64 [T], rows bf16 [n_d, H])``: the partial ``p_d`` of
            token ``t`` is ``rows[where[t]]`` (``where[t] = -1`` where ``d`` holds no slot of ``t``).
        num_scaleup_ranks: ``S``, the ranks of a node (ranks ``n S .. n S + S - 1`` form node ``n``).
        hidden: ``H``.

    Returns:
        ``(node_owner int64 [T, K], node_partials)``: the node of each slot (-1 masked) and per node
        ``(where, rows)`` in the same form, each row ``bf16(+0.0 + fp32(p_d) + ...)`` over the node's
        ranks in ascending order of their last slot.
    """
    T = owner.shape[0]
    device = owner.device
    node_owner = torch.where(owner >= 0, torch.div(owner, num_scaleup_ranks, rounding_mode="floor"), -1)
    last = shapes.last_slot_of_rank(owner)
    node_partials = []
    for node in range(len(partials) // num_scaleup_ranks):
        tok = (node_owner == node).any(1).nonzero().squeeze(1)
        where = torch.full((T,), -1, dtype=torch.int64, device=device)
        where[tok] = torch.arange(tok.numel(), device=device)
        node_acc = torch.zeros((tok.numel(), hidden), dtype=torch.float32, device=device)
        for k in range(owner.shape[1]):
            for d in range(node * num_scaleup_ranks, (node + 1) * num_scaleup_ranks):
                sel = (last[tok, k] & (owner[tok, k] == d)).nonzero().squeeze(1)
                if sel.numel():
                    rank_where, rows = partials[d]
                    node_acc[sel] += _gather(rows, rank_where[tok[sel]]).float()
        node_partials.append((where, node_acc.to(torch.bfloat16)))
    return node_owner, node_partials


# ---------------------------------------------------------------------------------------------- checks
def _assert_equal(name: str, actual: Tensor, expected: Tensor, rows: Optional[Tensor] = None) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected {expected.dtype}")
    a, e = actual, expected
    if rows is not None:
        a, e = a[rows], e[rows]
    a, e = a.cpu(), e.cpu()
    if a.dtype.is_floating_point or a.dtype == torch.float8_e4m3fn:
        a, e = as_bits(a), as_bits(e)
    bad = (a != e)
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        got, want = (actual[rows], expected[rows]) if rows is not None else (actual, expected)
        raise AssertionError(f"{name}: {int(bad.sum())} element(s) differ, first at {list(first)}: "
                             f"got {got[first]}, expected {want[first]}")


def _assert_optional(name: str, actual: Optional[Tensor], expected: Optional[Tensor]) -> None:
    if expected is None or actual is None:
        if actual is not expected:
            raise AssertionError(f"{name} should {'be None' if expected is None else 'not be None'}")
        return
    _assert_equal(name, actual, expected)


#: The handle's fields `check_dispatch` compares: host values, then tensors (or None).
HANDLE_VALUE_FIELDS = ("do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank",
                       "num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list", "num_ranks",
                       "rank", "hidden", "do_cpu_sync", "num_topk", "num_tokens")
HANDLE_TENSOR_FIELDS = ("topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                        "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx",
                        "recv_topk_weights")


def check_dispatch(actual: Sequence, expected: ReferenceDispatch, *, do_zero_padding: bool = True,
                   check_handle: bool = True, rank: Optional[int] = None) -> None:
    """Raise `AssertionError` unless a backend's dispatch outputs equal the reference, bit for bit.

    ``actual`` is ``(recv_x, recv_topk_idx, recv_topk_weights, handle[, event])``. Data rows past the
    true count are not compared (unspecified); padding rows only with ``do_zero_padding``. Every other
    element (indices, weights, every handle field but ``buffer_id``, ``num_sms`` and
    ``backend_state``) is compared.
    """
    where = f"rank {expected.handle.rank if rank is None else rank}: "
    recv_x, recv_idx, recv_w, handle = actual[:4]
    exp_data, exp_sf = split_x(expected.recv_x)
    data, sf = split_x(recv_x)
    if (sf is None) != (exp_sf is None):
        raise AssertionError(where + ("recv_x: FP8 tuple expected" if exp_sf is not None else
                                      "recv_x: bf16 tensor expected"))
    rows = torch.arange(expected.num_valid_rows, device=exp_data.device)
    if not do_zero_padding:
        rows = rows[~expected.is_padding_row[:expected.num_valid_rows]]
    _assert_equal(where + "recv_x", data, exp_data, rows)
    if exp_sf is not None:
        _assert_equal(where + "recv_x sf", sf, exp_sf, rows)
        if exp_sf.stride() != sf.stride():
            raise AssertionError(where + f"recv_x sf strides {sf.stride()}, expected {exp_sf.stride()}")
    _assert_optional(where + "recv_topk_idx", recv_idx, expected.recv_topk_idx)
    _assert_optional(where + "recv_topk_weights", recv_w, expected.recv_topk_weights)
    if not check_handle:
        return
    eh = expected.handle
    for name in HANDLE_VALUE_FIELDS:
        if getattr(handle, name) != getattr(eh, name):
            raise AssertionError(where + f"handle.{name} = {getattr(handle, name)!r}, "
                                 f"expected {getattr(eh, name)!r}")
    for name in HANDLE_TENSOR_FIELDS:
        _assert_optional(where + f"handle.{name}", getattr(handle, name), getattr(eh, name))


def check_combine(actual: Sequence, expected: tuple, *, rank: int = 0) -> None:
    """Raise `AssertionError` unless ``(combined_x, combined_topk_weights[, event])`` equals the
    reference ``(combined_x, combined_topk_weights)`` bit for bit."""
    where = f"rank {rank}: "
    _assert_equal(where + "combined_x", actual[0], expected[0])
    _assert_optional(where + "combined_topk_weights", actual[1], expected[1])
