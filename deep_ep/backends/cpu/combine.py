"""Combine of the CPU backend, in the order of `deep_ep.reference` (bit-identical to it).

Every destination rank sends back, grouped by source rank and in the order the source expects:

* with multiple reduction (the non-expanded layout, or ``allow_multiple_reduction=True``): one bf16
  row per received token, its partial sum over the token's local slots (non-expanded: the row of
  ``x`` itself; expanded: ``bf16`` of the float32 sum of its rows in slot order, each row multiplied
  by its dispatch weight first with ``apply_dispatch_weights``), plus the ``K`` weights it holds for
  the token when ``topk_weights`` is given;
* without (expanded only): every (token, local slot) row as it is, plus its dispatch weight with
  ``apply_dispatch_weights`` (the source multiplies, in the same float32 operation as the reference).

A header first carries the row counts both sides expect, so handles of different dispatches raise the
same `RuntimeError` on every rank instead of moving data. The source then reduces: the biases'
float32 sum, then ``K`` dense additions in slot order (the partial of a rank at its last slot, or each
slot's row), rounded once to bf16. In hybrid mode across nodes (``num_scaleup_ranks < R``) with
``allow_multiple_reduction=True``, the rank partials of each node are first summed into a bf16 node partial, which
then stands at the node's last slot (`deep_ep.reference`, "Hybrid order"); the rows still travel
straight from each rank to the source, so only the values, not the traffic, follow DeepEP's hybrid
combine.
"""
from __future__ import annotations

import torch

from ... import shapes
from ...reference import hybrid_node_partials
from . import collectives as hdr
from .wire import as_bytes, pack, unpack, wire

__all__ = ["combine"]


def _bias_sum(bias: tuple, num_tokens: int, hidden: int) -> torch.Tensor:
    if not bias:
        return torch.zeros((num_tokens, hidden), dtype=torch.float32, device="cpu")
    acc = bias[0].to(torch.float32, copy=True)
    if len(bias) > 1:
        acc += bias[1].float()
    return acc


def _destination_rows(h, x, topk_weights, multi: bool, apply_dispatch_weights: bool):
    """What this rank returns to its sources: ``(rows bf16 [n, H], weights float32 [n, w] or None,
    rows per source rank int64 [R])``."""
    R, K = h.num_ranks, h.num_topk
    n_tok = int(h.psum_num_recv_tokens_per_scaleup_rank[-1]) if R else 0
    # per source rank from the metadata: in hybrid mode the prefix sum counts per scale-up rank
    src = torch.div(h.recv_src_metadata[:n_tok, 1].to(torch.int64), K, rounding_mode="floor")
    tokens_per_src = torch.bincount(src, minlength=R)
    slots = h.recv_src_metadata[:n_tok, 2:].to(torch.int64)
    if multi and not h.do_expand:
        return x[:n_tok], (topk_weights[:n_tok] if topk_weights is not None else None), tokens_per_src
    if multi:
        partial = torch.zeros((n_tok, h.hidden), dtype=torch.float32, device="cpu")
        for k in range(K):
            sel = slots[:, k] >= 0
            if sel.any():
                rows = slots[sel, k]
                value = x.index_select(0, rows).float()
                if apply_dispatch_weights:
                    value = h.recv_topk_weights.index_select(0, rows).unsqueeze(1) * value
                partial[sel] += value
        weights = None
        if topk_weights is not None:
            weights = torch.where(slots >= 0, topk_weights[slots.clamp(min=0)], 0.0)
        return partial.to(torch.bfloat16), weights, tokens_per_src
    used = slots >= 0
    rows = slots[used]                                           # ascending (token, slot)
    pairs_per_src = torch.zeros(R, dtype=torch.int64, device="cpu").index_add_(0, src, used.sum(1))
    weights = h.recv_topk_weights.index_select(0, rows).view(-1, 1) if apply_dispatch_weights else None
    return x.index_select(0, rows), weights, pairs_per_src


def combine(comm, x, handle, topk_weights, bias, *, allow_multiple_reduction: bool,
            apply_dispatch_weights: bool, call: int, num_scaleup_ranks: int = 0):
    """One combine on this rank (`deep_ep.backends.base.Backend.combine`); ``call``: this rank's call
    number; ``num_scaleup_ranks``: the buffer's logical scale-up size (0 or ``R``: one node or direct
    mode, the flat order; fewer: hybrid mode across nodes, the hybrid order)."""
    comm.begin(hdr.OP_COMBINE, call)
    R = comm.num_ranks
    h = handle
    T, H, K = h.num_tokens, h.hidden, h.num_topk
    has_w = topk_weights is not None
    multi = allow_multiple_reduction or not h.do_expand
    back, back_w, send_counts = _destination_rows(h, x, topk_weights, multi, apply_dispatch_weights)

    # --- source side: how many rows each destination returns
    owner = shapes.slot_owners(h.topk_idx, h.num_local_experts)
    if multi:
        hit = (torch.stack([(owner == d).any(1) for d in range(R)], 1) if T
               else torch.zeros((0, R), dtype=torch.bool, device="cpu"))
        expect = hit.sum(0).to(torch.int64)
    else:
        expect = torch.stack([(owner == d).sum() for d in range(R)]).to(torch.int64)

    fields = hdr.new_fields()
    fields[hdr.E], fields[hdr.H], fields[hdr.K] = h.num_experts, H, K
    fields[hdr.EXPAND], fields[hdr.ALIGN], fields[hdr.M] = int(h.do_expand), h.expert_alignment, \
        h.num_max_tokens_per_rank
    fields[hdr.SYNC], fields[hdr.HASW], fields[hdr.T] = int(h.do_cpu_sync), int(has_w), T
    fields[hdr.REDUCE] = 2 * int(multi) + int(apply_dispatch_weights)
    headers = comm.exchange_header(fields, torch.cat([send_counts, expect]))
    sends = headers[:, hdr.HEADER_FIELDS:hdr.HEADER_FIELDS + R]    # sends[d, s]: rows d returns to s
    expects = headers[:, hdr.HEADER_FIELDS + R:]                    # expects[s, d]
    if (sends != expects.t()).any():
        d, s = (sends != expects.t()).nonzero()[0].tolist()
        raise comm.error(
            f"handles do not match across ranks: rank {d} would return {int(sends[d, s])} rows to "
            f"rank {s}, which expects {int(expects[s, d])} (every rank must combine with the handle "
            f"of the same dispatch)")

    n_back = int(expect.sum())
    in_splits, out_splits = expect.tolist(), send_counts.tolist()
    y = torch.empty((n_back, H), dtype=torch.bfloat16, device="cpu")
    comm.all_to_all("data rows", wire(y), wire(back.contiguous()), in_splits, out_splits)
    y_w = None
    if back_w is not None:
        width = back_w.shape[1]
        w_in = torch.empty((n_back, 4 * width), dtype=torch.uint8, device="cpu")
        comm.all_to_all("weights", w_in,
                        pack([(as_bytes(back_w.float()), 4 * width)], torch.arange(back_w.shape[0], device="cpu")),
                        in_splits, out_splits)
        y_w = unpack(w_in, [(torch.float32, width)])[0]

    # --- reduce in the reference order
    acc = _bias_sum(bias, T, H)
    first = torch.cumsum(expect, 0) - expect                        # first returned row from each d
    cw = None
    if multi:
        pos = torch.where(hit, first.unsqueeze(0) + torch.cumsum(hit.long(), 0) - 1, -1)   # [T, R]
        if 0 < num_scaleup_ranks < R and allow_multiple_reduction:
            _add_hybrid(acc, owner, y, pos, num_scaleup_ranks)
        else:
            last = shapes.last_slot_of_rank(owner)
            for k in range(K):
                tok = last[:, k].nonzero().flatten()
                staging = torch.zeros((T, H), dtype=torch.bfloat16, device="cpu")
                if tok.numel():
                    wire(staging).index_copy_(0, tok, wire(y).index_select(0, pos[tok, owner[tok, k]]))
                acc += staging.float()
        if has_w:
            cw = torch.zeros((T, K), dtype=torch.float32, device="cpu")
            t, k = (owner >= 0).nonzero(as_tuple=True)
            cw[t, k] = y_w[pos[t, owner[t, k]], k]
    else:
        pos = torch.full((T * K,), -1, dtype=torch.int64, device="cpu")
        flat = owner.flatten()
        for d in range(R):
            sel = (flat == d).nonzero().flatten()                   # ascending (token, slot)
            pos[sel] = int(first[d]) + torch.arange(sel.numel(), device="cpu")
        pos = pos.view(T, K)
        for k in range(K):
            tok = (pos[:, k] >= 0).nonzero().flatten()
            staging = torch.zeros((T, H), dtype=torch.float32, device="cpu")
            if tok.numel():
                value = y.index_select(0, pos[tok, k]).float()
                if apply_dispatch_weights:
                    value = y_w[pos[tok, k]] * value
                staging[tok] = value
            acc += staging
    return acc.to(torch.bfloat16), cw


def _add_hybrid(acc, owner, y, pos, num_scaleup_ranks: int) -> None:
    """The hybrid order's node and final levels, adding into ``acc`` float32 ``[T, H]``: ``y`` holds
    the returned rank partials, the one of token ``t`` from rank ``d`` at row ``pos[t, d]`` (-1: none)."""
    T, H = acc.shape
    rank_partials = [(pos[:, d], y) for d in range(pos.shape[1])]
    node_owner, node_partials = hybrid_node_partials(owner, rank_partials, num_scaleup_ranks, H)
    last = shapes.last_slot_of_rank(node_owner)
    for k in range(owner.shape[1]):
        staging = torch.zeros((T, H), dtype=torch.bfloat16, device="cpu")
        for node, (where, rows) in enumerate(node_partials):
            tok = (last[:, k] & (node_owner[:, k] == node)).nonzero().flatten()
            if tok.numel():
                wire(staging).index_copy_(0, tok, wire(rows).index_select(0, where[tok]))
        acc += staging.float()
