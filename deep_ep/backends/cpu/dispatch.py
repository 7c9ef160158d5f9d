"""Dispatch of the CPU backend: the protocol of one call on rank ``r`` (all collectives on the group).

1. *Header* (`Collectives.exchange_header`): the call's configuration, this rank's token count and how
   many tokens it sends to every rank. Every rank checks that all ranks agree and that every receive
   fits; any violation raises the same `RuntimeError` on every rank, before data moves (no hang,
   nothing written past an allocation).
2. Expanded layout only: an all-gather of int64 ``[E]`` pair counts per expert, from which every
   source computes where its pairs land (``dst_buffer_slot_idx``) without asking the destination.
3. *Rows* (two ``all_to_all_single``): each token travels once to every rank holding one of its
   experts, ordered by (destination, token): first the packed uint8 metadata
   ``scale factors | topk_idx | topk_weights | source token``, then the data rows alone (viewed as
   int64 words, received in place for non-expanded outputs). The destination lays rows out
   (expanding them in the expanded layout) exactly as `deep_ep.reference` does.

A cached dispatch runs the same protocol with the handle's routing (it recomputes nothing the
handle holds, and returns the handle itself).
"""
from __future__ import annotations

import torch

from ... import shapes
from ...handle import EPHandle
from .. import outputs
from . import collectives as hdr
from .wire import as_bytes, pack, unpack, wire

__all__ = ["dispatch"]


def _check_capacity(comm, headers, topk_idx, num_max_tokens_per_rank, expert_alignment, num_local_experts,
                    do_expand, do_cpu_sync):
    """Raise on every rank (same numbers everywhere) when a ``do_cpu_sync=False`` output could not hold
    what some rank receives. Returns the pair counts per (source rank, expert) in the expanded
    layout (None otherwise)."""
    R, M, A, L = comm.num_ranks, num_max_tokens_per_rank, expert_alignment, num_local_experts
    K = int(topk_idx.shape[1])
    if not do_cpu_sync:
        ms = headers[:, hdr.M]
        if (ms != ms[0]).any():
            raise comm.error(f"ranks disagree on num_max_tokens_per_rank (needed to size do_cpu_sync=False "
                             f"outputs): per-rank values {ms.tolist()}")
        over = (headers[:, hdr.T] > M).nonzero().flatten().tolist()
        if over:
            raise comm.error(f"rank(s) {over} dispatch {headers[over, hdr.T].tolist()} tokens, more than "
                             f"num_max_tokens_per_rank={M}: outputs sized for the worst case could not hold them")
    if not do_expand:
        return None
    valid = topk_idx[topk_idx >= 0]
    my_pairs = torch.bincount(valid, minlength=L * R).to(torch.int64)
    pair_counts = comm.all_gather(my_pairs, "expert counts")        # [R sources, E]
    if not do_cpu_sync:
        need = shapes.align_up(pair_counts.sum(0), A).view(R, L).sum(1)    # rows per destination
        cap = shapes.worst_case_recv_rows(R, M, K, L, A, True)
        over = (need > cap).nonzero().flatten().tolist()
        if over:
            raise comm.error(
                f"rank(s) {over} would receive {need[over].tolist()} expanded rows, more than the {cap} a "
                f"do_cpu_sync=False output holds (R x M x min(K, L) pairs + padding: a token that names the "
                f"same expert more than once can exceed it). Nothing was written")
    return pair_counts


def _send_positions(counts, pair_counts, hit, topk_idx, rank, num_local_experts, expert_alignment, do_expand):
    """``dst_buffer_slot_idx`` of this rank's tokens, from the exchanged counts alone."""
    T, R = hit.shape
    K = int(topk_idx.shape[1])
    if not do_expand:
        offsets = counts[:rank].sum(0)                              # [R]: rows at d from sources < r
        return torch.where(hit, offsets.unsqueeze(0) + torch.cumsum(hit.long(), 0) - 1, -1).to(torch.int32)
    total = pair_counts.sum(0)                                      # [E] pairs per expert at its owner
    padded = shapes.align_up(total, expert_alignment).view(R, num_local_experts)
    starts = (torch.cumsum(padded, 1) - padded).flatten()           # group start in the owner's rows
    before = pair_counts[:rank].sum(0)                              # pairs of sources < r, per expert
    flat = (topk_idx.flatten() >= 0).nonzero().flatten()
    ge = topk_idx.flatten()[flat]
    order = torch.sort(ge, stable=True).indices
    flat, ge = flat[order], ge[order]
    mine = pair_counts[rank]
    rank_in = torch.arange(flat.numel(), device="cpu") - (torch.cumsum(mine, 0) - mine)[ge]
    pos = torch.full((T * K,), -1, dtype=torch.int32, device="cpu")
    pos[flat] = (starts[ge] + before[ge] + rank_in).to(torch.int32)
    return pos.view(T, K)


def dispatch(comm, buffer_id: int, data, sf, topk_idx, topk_weights, *, num_experts, num_max_tokens_per_rank,
             expert_alignment, handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
             use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats, call: int,
             num_scaleup_ranks: int = 0):
    """One dispatch on this rank (`deep_ep.backends.base.Backend.dispatch`); ``comm`` is the buffer's
    `Collectives`, ``call`` this rank's call number, ``num_scaleup_ranks`` the logical scale-up size
    (0: every rank): the handle's ``psum_num_recv_tokens_per_scaleup_rank`` counts per scale-up rank,
    the tokens of every node's rank of that index (DeepEP's hybrid layout)."""
    comm.begin(hdr.OP_DISPATCH, call)
    R, r = comm.num_ranks, comm.rank
    cached = handle is not None
    if cached:
        topk_idx = handle.topk_idx
    E, A, M = num_experts, expert_alignment, num_max_tokens_per_rank
    L = E // R
    T, H = int(data.shape[0]), int(data.shape[1])
    K = int(topk_idx.shape[1])
    has_w = topk_weights is not None
    num_sf = 0 if sf is None else int(sf.shape[1])

    # --- routing on the source side
    owner = shapes.slot_owners(topk_idx, L)
    hit = torch.stack([(owner == d).any(1) for d in range(R)], 1) if T > 0 else \
        torch.zeros((0, R), dtype=torch.bool, device="cpu")        # [T, R]: token t goes to rank d
    send_counts = hit.sum(0).to(torch.int64)

    fields = hdr.new_fields()
    fields[hdr.E], fields[hdr.H], fields[hdr.K] = E, H, K
    fields[hdr.XKIND] = 0 if sf is None else (1 if sf.dtype == torch.float32 else 2)
    fields[hdr.NSF], fields[hdr.EXPAND], fields[hdr.ALIGN] = num_sf, int(do_expand), A
    fields[hdr.M], fields[hdr.SYNC], fields[hdr.HASW], fields[hdr.T] = M, int(do_cpu_sync), int(has_w), T
    headers = comm.exchange_header(fields, send_counts)
    counts = headers[:, hdr.HEADER_FIELDS:hdr.HEADER_FIELDS + R]    # counts[s, d]: tokens s -> d
    pair_counts = _check_capacity(comm, headers, topk_idx, M, A, L, do_expand, do_cpu_sync)
    recv_counts = counts[:, r]                                      # tokens s -> r
    send_pos = None if cached else _send_positions(counts, pair_counts, hit, topk_idx, r, L, A, do_expand)

    # --- move rows: each token once per destination rank, in (d, t) order. The data rows travel
    # alone (wide integer view, no packing copy); scale factors, routing and the source token
    # index travel packed side by side in a second, small exchange.
    parts, layout = [], []
    if sf is not None:
        parts.append((as_bytes(sf), num_sf * 4))
        layout.append((sf.dtype, num_sf))
    parts.append((as_bytes(topk_idx), K * 8))
    layout.append((torch.int64, K))
    if has_w:
        parts.append((as_bytes(topk_weights.float()), K * 4))
        layout.append((torch.float32, K))
    parts.append((as_bytes(torch.arange(T, dtype=torch.int32, device="cpu").view(T, 1)), 4))
    layout.append((torch.int32, 1))
    _, tok_t = hit.t().nonzero(as_tuple=True)                       # sorted by (d, t)
    n_in = int(recv_counts.sum())
    in_splits, out_splits = recv_counts.tolist(), send_counts.tolist()
    meta_out = pack(parts, tok_t)
    meta_in = torch.empty((n_in, meta_out.shape[1]), dtype=torch.uint8, device="cpu")
    comm.all_to_all("routing rows", meta_in, meta_out, in_splits, out_splits)
    # Non-expanded outputs receive the data in place; expanded ones go through a staging tensor.
    tok_capacity = n_in if do_cpu_sync else shapes.worst_case_recv_tokens(R, M)
    in_data_full = outputs.empty((n_in if do_expand else tok_capacity, H), data.dtype, "cpu")
    in_data = in_data_full[:n_in]
    comm.all_to_all("data rows", wire(in_data), wire(data).index_select(0, tok_t), in_splits, out_splits)

    # --- lay out on the destination side (rows arrive ordered by (s, t))
    unpacked = unpack(meta_in, layout)
    in_sf = unpacked.pop(0) if sf is not None else None
    in_idx = unpacked.pop(0)
    in_w = unpacked.pop(0) if has_w else None
    in_tok = unpacked.pop(0).flatten()
    in_src = torch.repeat_interleave(torch.arange(R, device="cpu"), recv_counts)
    local = shapes.slot_owners(in_idx, L) == r                      # [n_in, K]
    local_expert = in_idx - r * L
    expert_counts = torch.bincount(local_expert[local], minlength=L).to(torch.int32)
    aligned = shapes.align_up(expert_counts, A)
    n_expanded = int(aligned.sum())
    expanded_capacity = n_expanded if do_cpu_sync else shapes.worst_case_recv_rows(R, M, K, L, A, True)

    slot_rows = None
    if not do_expand:
        rows, n_valid = tok_capacity, n_in
        row_of = src_of = torch.arange(n_in, device="cpu")
        recv_idx = torch.full((rows, K), -1, dtype=torch.int64, device="cpu")
        recv_idx[:n_in] = torch.where(local, local_expert, -1)
        recv_w = None
        if has_w:
            recv_w = torch.zeros((rows, K), dtype=torch.float32, device="cpu")
            recv_w[:n_in] = torch.where(local, in_w, 0.0)
    else:
        rows, n_valid = expanded_capacity, n_expanded
        flat = local.flatten().nonzero().flatten()                  # ascending (j, k) = (s, t, k)
        e = local_expert.flatten()[flat]
        order = torch.sort(e, stable=True).indices
        flat, e = flat[order], e[order]
        j, k = torch.div(flat, K, rounding_mode="floor"), flat % K
        starts = torch.cumsum(aligned, 0) - aligned
        ustarts = torch.cumsum(expert_counts, 0) - expert_counts
        row_of = starts[e] + torch.arange(flat.numel(), device="cpu") - ustarts[e]
        src_of = j
        slot_rows = torch.full((n_in, K), -1, dtype=torch.int64, device="cpu")
        slot_rows[j, k] = row_of
        recv_idx = None
        recv_w = None
        if has_w:
            recv_w = torch.zeros(rows, dtype=torch.float32, device="cpu")
            recv_w[row_of] = in_w[j, k]
        pad_rows = torch.ones(n_valid, dtype=torch.bool, device="cpu")
        pad_rows[row_of] = False
    if n_valid > rows:  # cannot happen after the header checks; never write past the allocation
        raise comm.error(f"{n_valid} rows received, only {rows} allocated")

    # recv_x: rows past the true count are unspecified; padding rows are zeroed on request
    # (the expanded gather below covers every non-padding row).
    if not do_expand:
        recv_data = in_data_full                                    # received in place
    else:
        recv_data = outputs.empty((rows, H), data.dtype, "cpu")
        wire(recv_data).index_copy_(0, row_of, wire(in_data).index_select(0, src_of))
        if do_zero_padding:
            shapes.as_bits(recv_data)[:n_valid][pad_rows] = 0
    if sf is not None:
        recv_sf = shapes.alloc_recv_sf(rows, num_sf, sf.dtype, "cpu", use_tma_aligned_col_major_sf, zero=False)
        recv_sf[row_of] = in_sf[src_of]
        if do_expand and do_zero_padding:
            recv_sf[:n_valid][pad_rows] = 0
        recv_x = (recv_data, recv_sf)
    else:
        recv_x = recv_data

    if cumulative_local_expert_recv_stats is not None:
        cumulative_local_expert_recv_stats += expert_counts
    if cached:
        return recv_x, recv_idx, recv_w, handle

    new_handle = EPHandle(
        do_expand=do_expand, num_experts=E, expert_alignment=A, num_max_tokens_per_rank=M, num_sms=0,
        topk_idx=topk_idx.clone() if do_handle_copy else topk_idx, num_recv_tokens=tok_capacity,
        num_expanded_tokens=expanded_capacity,
        num_recv_tokens_per_expert_list=aligned.tolist() if do_cpu_sync else [],
        psum_num_recv_tokens_per_scaleup_rank=torch.cumsum(
            recv_counts.view(-1, num_scaleup_ranks or R).sum(0), 0).to(torch.int32),
        psum_num_recv_tokens_per_expert=shapes.expert_prefix_sum(expert_counts, A, do_expand),
        num_unaligned_recv_tokens_per_expert=expert_counts,
        recv_src_metadata=shapes.build_recv_src_metadata(in_src, in_tok, local, slot_rows, M, tok_capacity),
        dst_buffer_slot_idx=send_pos, buffer_id=buffer_id, num_ranks=R, rank=r, hidden=H,
        do_cpu_sync=bool(do_cpu_sync), recv_topk_weights=recv_w if do_expand else None)
    return recv_x, recv_idx, recv_w, new_handle
