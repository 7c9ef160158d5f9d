"""Host side of dispatch on the GPU backend. Every rank count, a rank alone too, runs the same
kernels (`modules`); this module decides which is launched.

Flow of one non-cached dispatch (every kernel on the buffer's communication stream):

1. ``modules.NOTIFY_KERNEL`` (eight warps per block, a warp per group of tokens) numbers this rank's
   tokens per destination rank and pairs per expert, checks the expert ids, copies them for the
   handle (``do_handle_copy``), and writes its count row into every peer's window; its last block
   signals the peers, then waits for every peer's counts and writes the handle's layout words (the
   layout stage, in the same kernel).
2. With ``do_cpu_sync`` the layout stage also writes the received row counts to mapped host memory,
   which the host polls (`GPUBackend.wait_readback`), then allocates exact outputs; without it the
   outputs are sized for the worst case and nothing waits on the host. A rank alone with CPU sync
   receives its own tokens only: its outputs are allocated for a bound on its rows and its data
   kernel queued before the wait (`early_rows`).
3. ``modules.DISPATCH_KERNEL`` (num_sms blocks): the send phase moves every token row once per
   destination rank (peers: into their window; this rank: straight into the outputs) and signals;
   the receive phase waits for every peer, then copies peers' rows into the outputs.

A cached dispatch runs step 3 only (``modules.CACHED_DISPATCH_KERNEL``) with the handle's prepared
launch. Rounds alternate between the two halves of the receive region (see `window`).
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Optional

import torch

from ... import jit
from ...handle import EPHandle
from ...shapes import alone_recv_rows_bound
from .. import outputs
from .abi import READBACK, DispatchArgs, layout_index
from . import modules
from .dispatch_plan import NOTIFY_WARPS, FreshPlan, check_config, dispatch_tag
from .dispatch_plan import ptr as _ptr, sf_ld as _sf_ld
from .state import GPUHandleState, word_plan

__all__ = ["run_dispatch", "run_cached", "NOTIFY_PAIRS_PER_GROUP", "notify_groups", "early_rows", "word_plan"]

# (token, slot) pairs one notify group (a warp) numbers, at most: its two passes go over them 32
# at a time, so fewer pairs per group mean a shorter kernel, up to the backend's cap on groups
# (`GPUBackend.notify_groups_max`), past which the grid barriers cost more than they save.
NOTIFY_PAIRS_PER_GROUP = 32


def notify_groups(T: int, K: int, groups_max: int) -> int:
    """Groups (warps) of the notify kernel for ``T`` tokens of top-``K``: enough for at most
    `NOTIFY_PAIRS_PER_GROUP` pairs each, at most ``groups_max``, in whole blocks of `NOTIFY_WARPS`."""
    cap = max(NOTIFY_WARPS, groups_max // NOTIFY_WARPS * NOTIFY_WARPS)
    groups = -(-max(1, -(-T * K // NOTIFY_PAIRS_PER_GROUP)) // NOTIFY_WARPS) * NOTIFY_WARPS
    return min(groups, cap)


# A rank alone's expanded outputs are allocated ahead of its counts only when the padding to the
# alignment (at most A - 1 rows per expert) can add at most 1 / EARLY_EXPANDED_SLACK to its
# (token, slot) pairs; with more, the outputs wait for the exact counts.
EARLY_EXPANDED_SLACK = 8


def early_rows(T: int, K: int, E: int, A: int, expanded: bool) -> Optional[int]:
    """Rows a rank alone's outputs are allocated for before its counts are known (a dispatch with
    CPU sync, which cuts them to the reported rows afterwards; `shapes.alone_recv_rows_bound`), or
    None to wait for the counts: expanded, when the padding to the alignment ``A`` could add more
    than 1 / `EARLY_EXPANDED_SLACK` of the pairs (never for ``A = 1``)."""
    if expanded and min(E, T * K) * (A - 1) * EARLY_EXPANDED_SLACK > T * K:
        return None
    return alone_recv_rows_bound(T, K, E, A, expanded)


_MAX_PLANS = 64   # configurations kept per buffer (a model has a few; more are re-derived)
# Where the layout stage's report (`GPUBackend.wait_readback`) holds what a fresh dispatch reads
_OUT_ROWS, _TOK_ROWS, _COUNTS = READBACK["out_rows"], READBACK["tok_rows"], READBACK["counts"]


class _NotifyRefused(Exception):
    """The device refused the notify kernel's cooperative launch (`run_dispatch` retries)."""


def run_dispatch(b, data, sf, topk_idx, topk_weights, *, num_experts, num_max_tokens_per_rank,
                 expert_alignment, num_sms, handle, do_handle_copy, do_cpu_sync, do_expand,
                 do_zero_padding, use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats):
    """`Backend.dispatch` on the GPU backend ``b`` (see `deep_ep.backends.base`).

    A fresh dispatch whose notify kernel the device refuses to launch cooperatively (its blocks
    cannot all be resident: fewer SMs than the device has, under MPS or a green context) is started
    again with half the grid: nothing of the call was queued yet, and any grid numbers the same.

    Raises:
        jit.LaunchError: not even one notify block fits, or the grid would have to change during
            CUDA-graph capture.
    """
    if handle is not None:
        return run_cached(b, data, sf, topk_weights, handle, num_sms, do_zero_padding,
                           use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats)
    while True:
        try:
            return _run_fresh(b, data, sf, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                              expert_alignment, num_sms, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                              use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats)
        except _NotifyRefused as refused:
            blocks = refused.args[0]
            capturing = _capturing(b)
            if blocks <= 1 or capturing:
                why = ("during CUDA-graph capture the grid cannot be lowered: make one fresh dispatch before "
                       "capturing" if blocks > 1 else "not even one block fits")
                raise jit.LaunchError(f"rank {b.rank}: the device cannot hold the {blocks} blocks of the notify "
                                      f"kernel at once (fewer SMs available, e.g. under MPS or a green context); "
                                      f"{why}") from refused.__cause__
            b.set_notify_groups_max((blocks // 2) * NOTIFY_WARPS)   # later calls keep the lower cap


def _run_fresh(b, data, sf, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank, expert_alignment,
               num_sms, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf,
               cumulative_local_expert_recv_stats):
    """A fresh dispatch (`run_dispatch`). Raises `_NotifyRefused` (its argument: the refused grid, in
    blocks) when the notify kernel's cooperative launch is refused."""
    if do_cpu_sync and _capturing(b):   # before a new configuration would build or load a module
        raise RuntimeError("deep_ep: a fresh dispatch with do_cpu_sync=True cannot be captured in a CUDA graph: the "
                           "host would wait for counts that its kernels write only at replay. Capture a dispatch "
                           "with do_cpu_sync=False (outputs sized by num_max_tokens_per_rank) or a cached one "
                           "(handle=...); nothing was queued")
    dev = b.device
    R = b.num_ranks
    T, H = data.shape   # (each read of a tensor's shape makes a new torch.Size: read it once)
    K = topk_idx.shape[1]
    has_weights = topk_weights is not None
    key = (H, data.dtype, None if sf is None else (int(sf.shape[1]), sf.dtype), K, num_experts,
           expert_alignment, num_max_tokens_per_rank, num_sms, has_weights, do_cpu_sync, do_expand, do_zero_padding)
    plan = b.fresh_plans.get(key)
    if plan is None:
        if len(b.fresh_plans) >= _MAX_PLANS:
            b.fresh_plans.clear()
        plan = b.fresh_plans[key] = FreshPlan(b, data, sf, K, num_experts, expert_alignment, num_max_tokens_per_rank,
                                              num_sms, has_weights, do_cpu_sync, do_expand, do_zero_padding)
    E, L, ix = plan.num_experts, plan.num_local_experts, plan.layout_index
    if T > plan.num_max_tokens:
        raise ValueError(f"{T} tokens on rank {b.rank}, more than the {plan.num_max_tokens} per rank the buffer holds "
                         f"(num_max_tokens_per_rank)")
    b.call_record.num_max_tokens = plan.num_max_tokens
    b.raise_if_broken()
    seq = b.calls & 0xFFFFFFFF
    # With CPU sync a rank alone receives its own tokens only: its outputs are allocated for a bound
    # on their rows (`early_rows`) and its data kernel queued while the notify kernel runs, and the
    # layout stage refuses more rows than that before the data kernel could write them. Not for
    # column-major scale factors, whose layout depends on the exact rows.
    early = plan.early and (sf is None or not use_tma_aligned_col_major_sf)
    # The handle's int32 words in one allocation: layout words, pos_tok [T, R], (expanded) pos_pair
    # [T, K], recv_src_metadata when its rows are known before the call (no CPU sync: the worst
    # case; early: T) (`word_plan`); the kernels get addresses inside it.
    grid_key = (T, early, b.notify_groups_max, NOTIFY_PAIRS_PER_GROUP)
    per_t = plan.per_tokens.get(grid_key)
    if per_t is None:
        if len(plan.per_tokens) >= _MAX_PLANS:
            plan.per_tokens.clear()
        rows = early_rows(T, K, E, plan.alignment, bool(do_expand)) if early else None
        words_plan = word_plan(ix, R, L, T, K, bool(do_expand), plan.meta_rows if rows is None else T)
        groups = notify_groups(T, K, b.notify_groups_max)
        per_t = (words_plan, groups // NOTIFY_WARPS, max(1, -(-T // groups)), rows)
        plan.per_tokens[grid_key] = per_t
    words_plan, notify_blocks, tokens_per_group, early_out_rows = per_t
    fill = b.fill_stream
    words = outputs.empty(words_plan.total, torch.int32, dev, fill)
    # The handle's copy of topk_idx is written by the notify kernel (no copy of its own).
    handle_topk = outputs.empty((T, K), torch.int64, dev, fill) if do_handle_copy else topk_idx
    lay_ptr = words.data_ptr()
    pos_tok_ptr, pos_pair_ptr, meta_ptr = words_plan.addresses(lay_ptr)
    # `_ptr` written out for the tensors that are always given (a call per address adds up here)
    topk_ptr = topk_idx.data_ptr() or None
    notify_args, layout_args, data_args = plan.notify.args[0], plan.notify.args[1], plan.data.args[0]
    notify_args.topk_idx, notify_args.num_tokens, notify_args.tokens_per_group = topk_ptr, T, tokens_per_group
    notify_args.topk_copy = (handle_topk.data_ptr() or None) if do_handle_copy else None
    notify_args.pos_tok, notify_args.pos_pair = pos_tok_ptr, pos_pair_ptr
    layout_args.layout, layout_args.cumulative_stats = lay_ptr, _ptr(cumulative_local_expert_recv_stats)
    if do_cpu_sync:
        record = b.call_record
        record.readback_seq = layout_args.seq = (record.readback_seq % (2 ** 31 - 1)) + 1
        layout_args.out_capacity, layout_args.tok_capacity = (plan.out_capacity, plan.tok_capacity) if early_out_rows is None \
            else (early_out_rows, T)
    notify_tag, layout_tag, data_tag = plan.tags
    notify_tag.seq = layout_tag.seq = data_tag.seq = seq
    b.call_record.launched_call = b.calls
    try:
        plan.notify.launch(b.launch_stream, notify_blocks)
    except jit.LaunchError as exc:
        if "COOPERATIVE_LAUNCH_TOO_LARGE" in str(exc):
            raise _NotifyRefused(notify_blocks) from exc
        raise
    b.call_record.num_experts, b.call_record.num_topk = E, K
    # The data kernel's arguments that do not depend on the counts (set while the notify kernel runs).
    data_args.x, data_args.sf, data_args.topk_idx, data_args.topk_weights, data_args.num_tokens = \
        data.data_ptr() or None, _ptr(sf), topk_ptr, _ptr(topk_weights), T
    data_args.pos_tok, data_args.pos_pair, data_args.layout = pos_tok_ptr, pos_pair_ptr, lay_ptr
    if early_out_rows is not None:
        # Outputs before the counts, for a bound on the rows, cut to those the layout stage reports
        # after the wait (non-expanded: all T unless a token selects no expert; the kernel marks the
        # rows past them as it marks any spare rows).
        out_x, out_sf, out_w, out_idx, _, sf_ld = _alloc_outputs(
            b, data, sf, early_out_rows, K, has_weights, do_expand, None, use_tma_aligned_col_major_sf)
        _set_outputs(data_args, out_x, out_sf, sf_ld, out_idx, out_w, meta_ptr, early_out_rows, T)
        b.launch_data(plan.data, plan.num_sms)
        # If the wait raises, the caller's stream is still ordered after the queued kernels
        # (`call_streams.run_call`), so the dropped outputs are not reused while they write.
        head = b.wait_readback(layout_args.seq, E, K)
        out_rows, tok_capacity = head[_OUT_ROWS], head[_TOK_ROWS]
        if out_rows < early_out_rows:
            out_x, out_sf, out_w, out_idx = (None if t is None else t[:out_rows]
                                             for t in (out_x, out_sf, out_w, out_idx))
        # recv_src_metadata: the first tok_capacity rows of the words' piece (a view made when read)
        state = GPUHandleState(words, words_plan, out_idx, None, tok_capacity)
    else:
        if do_cpu_sync:   # the exact rows are known only once every peer's counts are in
            head = b.wait_readback(layout_args.seq, E, K)
            out_rows, tok_capacity = head[_OUT_ROWS], head[_TOK_ROWS]
            meta_rows = tok_capacity
        else:   # worst-case rows; recv_src_metadata's are a piece of the words
            out_rows, tok_capacity, meta_rows = plan.out_capacity, plan.tok_capacity, None
        out_x, out_sf, out_w, out_idx, src_meta, sf_ld = _alloc_outputs(
            b, data, sf, out_rows, K, has_weights, do_expand, meta_rows, use_tma_aligned_col_major_sf)
        state = GPUHandleState(words, words_plan, out_idx, src_meta, tok_capacity)
        _set_outputs(data_args, out_x, out_sf, sf_ld, out_idx, out_w, state.src_meta_ptr, out_rows, tok_capacity)
        b.launch_data(plan.data, plan.num_sms)

    recv_x = out_x if sf is None else (out_x, out_sf)
    # Without CPU sync the handle's counts are the worst case (tok_capacity too).
    if do_cpu_sync:
        counts = head[_COUNTS: _COUNTS + L]
        num_expanded_tokens = sum(counts)
    else:
        counts, num_expanded_tokens = [], plan.expanded_capacity
    # The handle's layout tensors, dst_buffer_slot_idx and recv_src_metadata are views of the state,
    # made when first read (`EPHandle.with_lazy_fields`); the fields that follow from the
    # configuration come with the plan.
    fields = plan.handle_fields.copy()
    fields["topk_idx"], fields["num_recv_tokens"] = handle_topk, tok_capacity
    fields["num_expanded_tokens"], fields["num_recv_tokens_per_expert_list"] = num_expanded_tokens, counts
    if do_expand:
        fields["recv_topk_weights"] = out_w
    new_handle = EPHandle.with_lazy_fields(state, fields)
    return recv_x, out_idx, out_w, new_handle


def _capturing(b) -> bool:
    """Whether the current stream of the backend's (CUDA) device is being captured in a CUDA graph."""
    return b.device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


def _set_outputs(a, out_x, out_sf, sf_ld, out_idx, out_w, src_meta_ptr, out_rows, tok_capacity) -> None:
    """Set a fresh dispatch's output arguments in its data kernel's struct ``a``."""
    a.out_x, a.out_sf, a.sf_ld = out_x.data_ptr() or None, _ptr(out_sf), sf_ld
    a.out_topk_idx, a.out_weights, a.src_meta = _ptr(out_idx), _ptr(out_w), src_meta_ptr
    a.out_capacity, a.tok_capacity = out_rows, tok_capacity


def _alloc_outputs(b, data, sf, out_rows: int, K: int, has_weights: bool, expanded: bool,
                   meta_rows: Optional[int], col_major: bool) -> tuple:
    """A fresh dispatch's outputs for ``out_rows`` rows: ``(recv_x, scale factors, weights,
    recv_topk_idx, recv_src_metadata, sf leading dimension)``; weights None without ``has_weights``,
    recv_topk_idx None when expanded, recv_src_metadata (``meta_rows`` rows) None when ``meta_rows``
    is None (without CPU sync it is a piece of the handle's words)."""
    dev, fill = b.device, b.fill_stream
    out_x = outputs.empty((out_rows, data.shape[1]), data.dtype, dev, fill)
    out_sf, sf_ld = (None, 0) if sf is None else _alloc_sf(b, sf, out_rows, col_major)
    out_w = outputs.empty(out_rows if expanded else (out_rows, K), torch.float32, dev, fill) if has_weights else None
    out_idx = None if expanded else outputs.empty((out_rows, K), torch.int64, dev, fill)
    src_meta = None if meta_rows is None else outputs.empty((meta_rows, K + 2), torch.int32, dev, fill)
    return out_x, out_sf, out_w, out_idx, src_meta, sf_ld


def _alloc_sf(b, sf, out_rows: int, col_major: bool) -> tuple:
    """The received scale factors of an FP8 dispatch (``sf`` given: its callers skip it without FP8)
    and their leading dimension (column-major: rows rounded up to 4; else 0)."""
    num_sf = int(sf.shape[1])
    if col_major:
        sf_ld = _sf_ld(out_rows)
        return outputs.empty((num_sf, sf_ld), sf.dtype, b.device, b.fill_stream).t()[:out_rows], sf_ld
    return outputs.empty((out_rows, num_sf), sf.dtype, b.device, b.fill_stream), 0


def run_cached(b, data, sf, topk_weights, handle, num_sms, do_zero_padding, col_major_sf, stats):
    """A cached dispatch: the data kernel only, through the handle's prepared launch, found in the
    handle's memo (`EPHandle.launch_memo`) by the call's options, else in its state by a key of the
    options and every handle field the launch reads; the first call of a key derives the rest."""
    state = handle.backend_state
    if not isinstance(state, GPUHandleState):
        raise ValueError("the handle was not made by a GPU dispatch (it has no GPU layout state)")
    has_weights = topk_weights is not None
    options = ("dispatch", data.dtype, None if sf is None else (int(sf.shape[1]), sf.dtype), num_sms,
               bool(do_zero_padding), bool(col_major_sf), has_weights)
    memo = handle.launch_memo()   # emptied by any assignment to the handle's fields
    entry = memo.get(options)
    topk = handle.topk_idx
    guard = (topk.data_ptr(), topk.shape)   # its tensor changed in place (set_, resize_): derive again
    if entry is None or entry[-1] != guard:
        # The handle's fields and tensors the launch reads are part of the state's key: a handle
        # rebuilt with other values (dataclasses.replace) shares this state but must not reuse them.
        key = options + guard + (state.src_meta_ptr, handle.hidden, handle.num_experts, handle.expert_alignment,
                                 handle.num_max_tokens_per_rank, handle.do_expand, handle.do_cpu_sync,
                                 handle.num_recv_rows)
        launch = state.launches.get(key)
        if launch is None:
            launch = state.launches[key] = _prepare_cached(b, data, sf, has_weights, handle, num_sms,
                                                           do_zero_padding, col_major_sf)
        rows = handle.num_recv_rows
        entry = memo[options] = launch + (rows, (rows, int(data.shape[1])),
                                          rows if handle.do_expand else (rows, launch[2]), launch[0].args[0].tag,
                                          guard)
    prepared, m, K, n_sms, out_rows, x_shape, w_shape, tag, _ = entry
    b.call_record.num_max_tokens = m
    b.raise_if_broken()
    dev, fill = b.device, b.fill_stream
    out_x = outputs.empty(x_shape, data.dtype, dev, fill)
    out_sf = None if sf is None else _alloc_sf(b, sf, out_rows, col_major_sf)[0]
    out_w = outputs.empty(w_shape, torch.float32, dev, fill) if has_weights else None
    a = prepared.args[0]
    # `_ptr` written out for the tensors that are always given (a call per address adds up here)
    a.x, a.sf, a.out_x, a.out_sf = data.data_ptr() or None, _ptr(sf), out_x.data_ptr() or None, _ptr(out_sf)
    a.topk_weights, a.out_weights = _ptr(topk_weights), _ptr(out_w)
    tag.seq = b.calls & 0xFFFFFFFF
    b.launch_data(prepared, n_sms)
    recv_x = out_x if sf is None else (out_x, out_sf)
    if stats is not None:
        # The layout stage counts a fresh dispatch; a cached one adds the handle's counts here, on
        # the stream its kernels ran on.
        lay, ix = state.layout, layout_index(handle.num_ranks, handle.num_local_experts, handle.num_experts)
        with contextlib.nullcontext() if b.fill_stream is None else torch.cuda.stream(b.fill_stream):
            stats.add_(lay[ix.raw_counts: ix.raw_counts + handle.num_local_experts])
    return recv_x, state.recv_topk_idx, out_w, handle


def _prepare_cached(b, data, sf, has_weights, handle, num_sms, do_zero_padding, col_major_sf) -> tuple:
    """The handle's prepared cached-dispatch launch for this key, every argument but the per-call
    pointers and the call number set; returns ``(launch, M, K, SMs)``."""
    state = handle.backend_state
    E, A, K = handle.num_experts, handle.expert_alignment, handle.num_topk
    do_expand, do_cpu_sync = bool(handle.do_expand), bool(handle.do_cpu_sync)
    data_bytes, num_sf, layout, m = check_config(b, data, sf, K, E, handle.num_max_tokens_per_rank)
    n_sms = b.num_sms(num_sms, E, K)
    mod = b.module("dispatch", (data_bytes, num_sf, K, do_expand))
    out_rows = handle.num_recv_rows
    sf_ld = _sf_ld(out_rows) if sf is not None and col_major_sf else 0
    tag = dispatch_tag(2, data_bytes, num_sf, K, do_expand, A, E, has_weights, do_cpu_sync, m)
    args = DispatchArgs(
        topk_idx=_ptr(handle.topk_idx), num_tokens=int(data.shape[0]), pos_tok=state.pos_tok_ptr,
        pos_pair=state.pos_pair_ptr, sf_ld=sf_ld, out_topk_idx=_ptr(state.recv_topk_idx),
        src_meta=state.src_meta_ptr, max_tokens=handle.num_max_tokens_per_rank, out_capacity=out_rows,
        tok_capacity=state.tok_capacity, layout=state.layout_ptr, num_experts=E, alignment=A,
        recv_offset=layout.recv_offset, half_bytes=layout.half_bytes, row_stride=layout.row_stride,
        timeout_ns=b.timeout_ns, err_host=b.err_record.device_ptr, tag=tag)
    prepared = mod.function(modules.CACHED_DISPATCH_KERNEL).prepare(
        n_sms, modules.THREADS, (args, b.transport_args, ctypes.c_int(int(do_zero_padding))), device=b.device.index,
        cooperative=b.cooperative)
    return prepared, m, K, n_sms
