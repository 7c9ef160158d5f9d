"""Host side of dispatch on the GPU backend.

Flow of one non-cached dispatch (every kernel on the buffer's communication stream):

1. ``deep_ep_notify``  (one warp per group of tokens) numbers this rank's tokens per destination
   rank and pairs per expert, checks the expert ids, copies them for the handle (``do_handle_copy``),
   and writes its count row into every peer's window; its last block signals the peers.
2. ``deep_ep_layout``  (1 block) waits for every peer's counts and writes the handle's layout words.
3. With ``do_cpu_sync`` the layout kernel also writes the received row counts to mapped host memory,
   which the host polls (`GPUBackend.wait_readback`), then allocates exact outputs; without it the
   outputs are sized for the worst case and nothing waits on the host.
4. ``deep_ep_dispatch`` (num_sms blocks): the send phase moves every token row once per
   destination rank (peers: into their window; this rank: straight into the outputs) and signals;
   the receive phase waits for every peer, then copies peers' rows into the outputs.

A cached dispatch runs step 4 only (``deep_ep_dispatch_cached``) with the handle's prepared launch.
Rounds alternate between the two halves of the receive region (see `window`).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Optional

import torch

from ...handle import EPHandle
from ...shapes import worst_case_recv_rows, worst_case_recv_tokens
from .. import outputs
from .abi import CONSTANTS, MAX_EXPERTS, MAX_TOPK, READBACK, DispatchArgs, call_tag, LayoutArgs, NotifyArgs, layout_index
from . import modules
from . import window as wl
from .modules import LAYOUT_THREADS
from .state import GPUHandleState

__all__ = ["run_dispatch", "NOTIFY_PAIRS_PER_GROUP", "notify_groups"]

# (token, slot) pairs one notify group (a warp) numbers, at most: its two passes go over them 32
# at a time, so fewer pairs per group mean a shorter kernel, up to the backend's cap on groups
# (`GPUBackend.notify_groups_max`), past which the grid barriers cost more than they save.
NOTIFY_PAIRS_PER_GROUP = 32
NOTIFY_WARPS = CONSTANTS["kNotifyWarps"]   # groups per block of the notify kernel


def _align_words(n: int) -> int:
    """``n`` int32 words rounded up to a multiple of 32 (128 bytes)."""
    return (n + 31) // 32 * 32


@functools.lru_cache(maxsize=256)
def _word_views(ix, R: int, L: int, T: int, K: int, expanded: bool, meta_rows: int) -> tuple:
    """How a fresh dispatch's int32 words are laid out and split, so that two ``split_with_sizes``
    calls make every view of them: ``(total words, outer split sizes, inner split sizes, inner
    indices of tok_prefix, psum_expert, raw_counts)``.

    The outer split: the layout words, pos_tok ``[T * R]``, pos_pair ``[T * K]`` (empty unless
    expanded), recv_src_metadata ``[meta_rows * (K + 2)]`` (without CPU sync, whose receive is sized
    before the call; else empty), each starting on a 128-byte boundary, with the padding after each
    as a piece of its own. The inner split cuts the layout piece into the three ranges the handle
    shows and the words between them."""
    outer, at = [], 0
    for n in (ix.size, T * R, T * K if expanded else 0, meta_rows * (K + 2)):
        outer += [n, _align_words(at + n) - at - n]
        at = _align_words(at + n)
    inner, where, pos = [], [], 0
    for start, n in sorted([(ix.tok_prefix, R), (ix.psum_expert, L), (ix.raw_counts, L)]):
        if start > pos:
            inner.append(start - pos)
        where.append((start, len(inner)))
        inner.append(n)
        pos = start + n
    inner.append(ix.size - pos)
    order = dict(where)
    return at, tuple(outer), tuple(inner), (order[ix.tok_prefix], order[ix.psum_expert], order[ix.raw_counts])


def notify_groups(T: int, K: int, groups_max: int) -> int:
    """Groups (warps) of the notify kernel for ``T`` tokens of top-``K``: enough for at most
    `NOTIFY_PAIRS_PER_GROUP` pairs each, at most ``groups_max``, in whole blocks of `NOTIFY_WARPS`."""
    groups = max(1, min(groups_max, -(-T * K // NOTIFY_PAIRS_PER_GROUP)))
    return -(-groups // NOTIFY_WARPS) * NOTIFY_WARPS


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def run_dispatch(b, data, sf, topk_idx, topk_weights, *, num_experts, num_max_tokens_per_rank,
                 expert_alignment, num_sms, handle, do_handle_copy, do_cpu_sync, do_expand,
                 do_zero_padding, use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats):
    """`Backend.dispatch` on the GPU backend ``b`` (see `deep_ep.backends.base`)."""
    dev = b.device
    R, rank = b.num_ranks, b.rank
    cached = handle is not None
    if cached:
        state = handle.backend_state
        if not isinstance(state, GPUHandleState):
            raise ValueError("the handle was not made by a GPU dispatch (it has no GPU layout state)")
        topk_idx = handle.topk_idx
        do_expand = handle.do_expand
        expert_alignment = handle.expert_alignment
        num_experts = handle.num_experts
    E, A = num_experts, expert_alignment
    if E > MAX_EXPERTS:
        raise ValueError(f"num_experts={E} exceeds the {MAX_EXPERTS} experts a window has room for")
    L = E // R
    ix = layout_index(R, L, E)
    T, H = int(data.shape[0]), int(data.shape[1])
    K = int(topk_idx.shape[1])
    if K > (b.config.num_topk or MAX_TOPK):
        raise ValueError(f"top-k {K} exceeds the {b.config.num_topk or MAX_TOPK} the window rows were "
                         f"sized for: create the buffer with num_topk={K}")
    data_bytes = H * data.element_size()
    num_sf = 0 if sf is None else int(sf.shape[1])
    if data_bytes % 16:
        raise ValueError(f"a token row must be a multiple of 16 bytes on the GPU; got hidden={H} "
                         f"({data.dtype}): use a hidden size that is a multiple of 8 (bf16) / 16 (fp8)")
    layout = b.layout(wl.dispatch_row_stride(data_bytes, num_sf, b.config.num_topk))
    cap_tok_rows = layout.rows_per_half
    m = num_max_tokens_per_rank or (cap_tok_rows // R)
    if R * m > cap_tok_rows:
        raise ValueError(f"the window holds {cap_tok_rows} token rows per round, fewer than "
                         f"{R} ranks x num_max_tokens_per_rank={m}: create the buffer with a larger "
                         f"num_bytes (see ElasticBuffer.get_buffer_size_hint)")
    if T > m:
        raise ValueError(f"{T} tokens on rank {rank}, more than the {m} per rank the buffer holds "
                         f"(num_max_tokens_per_rank)")
    b.last_m = m
    n_sms = b.num_sms(num_sms, E, K)
    structure = (data_bytes, num_sf, K, bool(do_expand))
    mod = b.module("dispatch", structure)
    transport = b.transport_args

    b.raise_if_broken()
    # What every rank's call must agree on (sent with every signal, comm/window.cuh).
    tag = call_tag(b.calls, 2 if cached else 1, data_bytes, num_sf, K, int(bool(do_expand)), A, E,
                   topk_weights is not None, int(bool(do_cpu_sync)), 0 if do_cpu_sync else m)
    if not cached:
        # do_cpu_sync=False: outputs are sized now for the worst case; the layout kernel refuses
        # (error code 2) a receive that would not fit, e.g. a peer with a larger M.
        big = 2 ** 31 - 1
        out_cap = big if do_cpu_sync else worst_case_recv_rows(R, m, K, L, A, do_expand)
        tok_cap = big if do_cpu_sync else worst_case_recv_tokens(R, m)
        # The handle's int32 words in one allocation: layout words, pos_tok [T, R], (expanded)
        # pos_pair [T, K], (no CPU sync) recv_src_metadata, each starting on a 128-byte boundary as
        # a tensor of its own would; its views made by two splits (`_word_views`).
        meta_rows = 0 if do_cpu_sync else tok_cap
        total, outer, inner, at = _word_views(ix, R, L, T, K, bool(do_expand), meta_rows)
        lay, _, pos_tok, _, pos_pair, _, src_meta, _ = outputs.empty(
            total, torch.int32, dev, b.fill_stream).split_with_sizes(outer)
        pos_tok = pos_tok.view(T, R)
        pos_pair = pos_pair.view(T, K) if do_expand else None
        src_meta = None if do_cpu_sync else src_meta.view(meta_rows, K + 2)
        pieces = lay.split_with_sizes(inner)
        views = (pieces[at[0]], pieces[at[1]], pieces[at[2]])
        stream = b.launch_stream
        groups = notify_groups(T, K, b.notify_groups_max)
        # The notify and layout launches are prepared once per module and expert count, with the
        # arguments that stay the same; each call sets the rest in place (the notify grid is given
        # at launch).
        fresh = b.fresh_launches.get((structure, E))
        if fresh is None:
            fresh = b.fresh_launches[(structure, E)] = (
                mod.function("deep_ep_notify").prepare(
                    1, 32 * NOTIFY_WARPS, (NotifyArgs(num_experts=E, counts_offset=layout.counts_offset,
                                       scratch=b.notify_scratch.data_ptr(), timeout_ns=b.timeout_ns), transport),
                    device=dev.index, cooperative=b.cooperative, smem=4 * NOTIFY_WARPS * (R + E)),
                mod.function("deep_ep_layout").prepare(
                    1, LAYOUT_THREADS, (LayoutArgs(num_experts=E, counts_offset=layout.counts_offset,
                                                   timeout_ns=b.timeout_ns, err_host=b.err_record.device_ptr),
                                        transport), device=dev.index))
        notify_launch, layout_launch = fresh
        # The handle's copy of topk_idx is written by the notify kernel (no copy of its own).
        handle_topk = outputs.empty((T, K), torch.int64, dev, b.fill_stream) if do_handle_copy else topk_idx
        na = notify_launch.args[0]
        na.topk_idx, na.num_tokens, na.tokens_per_group = _ptr(topk_idx), T, max(1, -(-T // groups))
        na.topk_copy = _ptr(handle_topk) if do_handle_copy else None
        na.pos_tok, na.pos_pair, na.tag = _ptr(pos_tok), _ptr(pos_pair), tag
        b.launched_call = b.calls
        notify_launch.launch(stream, groups // NOTIFY_WARPS)
        seq = 0
        if do_cpu_sync:
            b.readback_seq = seq = (b.readback_seq % (2 ** 31 - 1)) + 1
        la = layout_launch.args[0]
        la.alignment, la.layout, la.cumulative_stats = A, lay.data_ptr(), _ptr(cumulative_local_expert_recv_stats)
        la.out_capacity, la.tok_capacity = out_cap, tok_cap
        la.host_out, la.seq, la.tag = (b.readback.device_ptr if do_cpu_sync else None), seq, tag
        layout_launch.launch(stream)
        b.last_num_experts, b.last_num_topk = E, K
        if do_cpu_sync:
            head = b.wait_readback(seq, E, K)   # every peer's counts are in: the layout kernel is done
            out_rows = head[READBACK["out_rows"]]
            num_tok_rows = tok_capacity = head[READBACK["tok_rows"]]
        else:
            out_rows, tok_capacity = out_cap, tok_cap
    else:
        lay, pos_tok, pos_pair = state.layout, state.pos_tok, state.pos_pair
        out_rows = handle.num_recv_rows

    # outputs
    out_x = outputs.empty((out_rows, H), data.dtype, dev, b.fill_stream)
    out_sf, sf_ld = None, 0
    if sf is not None:
        if use_tma_aligned_col_major_sf:
            sf_ld = (out_rows + 3) // 4 * 4
            out_sf = outputs.empty((num_sf, sf_ld), sf.dtype, dev, b.fill_stream).t()[:out_rows]
        else:
            out_sf = outputs.empty((out_rows, num_sf), sf.dtype, dev, b.fill_stream)
    out_w = None
    if topk_weights is not None:
        out_w = outputs.empty(out_rows if do_expand else (out_rows, K), torch.float32, dev, b.fill_stream)
    if not cached:
        out_idx = None if do_expand else outputs.empty((out_rows, K), torch.int64, dev, b.fill_stream)
        if src_meta is None:
            src_meta = outputs.empty((tok_capacity, K + 2), torch.int32, dev, b.fill_stream)
    else:
        out_idx, src_meta = state.recv_topk_idx, state.src_meta

    out_sf_ptr = out_sf.data_ptr() if out_sf is not None and out_sf.numel() else None
    prepared = None
    if cached:
        # The handle's prepared launch: only the per-call pointers change. The handle-level tensors
        # the launch reads are part of the key: a handle rebuilt with other tensors
        # (dataclasses.replace) shares this state but must not reuse the pointers.
        key = ("dispatch", data_bytes, num_sf, K, n_sms, bool(do_zero_padding), sf_ld,
               topk_idx.data_ptr(), src_meta.data_ptr())
        prepared = state.launches.get(key)
        if prepared is not None:
            a = prepared.args[0]
            a.x, a.sf, a.out_x, a.out_sf = _ptr(data), _ptr(sf), _ptr(out_x), out_sf_ptr
            a.topk_weights, a.out_weights = _ptr(topk_weights), _ptr(out_w)
            a.tag = tag
    if not cached:
        # A fresh dispatch: one prepared launch per module, SM count and padding flag, with the
        # arguments that stay the same; each call sets the rest in place.
        fresh_key = (structure, n_sms, bool(do_zero_padding))
        prepared = b.fresh_data_launches.get(fresh_key)
        if prepared is None:
            prepared = b.fresh_data_launches[fresh_key] = mod.function("deep_ep_dispatch").prepare(
                n_sms, modules.THREADS,
                (DispatchArgs(recv_offset=layout.recv_offset, half_bytes=layout.half_bytes,
                              row_stride=layout.row_stride, timeout_ns=b.timeout_ns, err_host=b.err_record.device_ptr),
                 transport, ctypes.c_int(int(do_zero_padding))), device=dev.index, cooperative=b.cooperative)
        a = prepared.args[0]
        a.x, a.sf, a.topk_idx, a.topk_weights, a.num_tokens = _ptr(data), _ptr(sf), _ptr(topk_idx), \
            _ptr(topk_weights), T
        a.pos_tok, a.pos_pair, a.out_x, a.out_sf, a.sf_ld = _ptr(pos_tok), _ptr(pos_pair), _ptr(out_x), out_sf_ptr, sf_ld
        a.out_topk_idx, a.out_weights, a.src_meta = _ptr(out_idx), _ptr(out_w), _ptr(src_meta)
        a.max_tokens, a.out_capacity, a.tok_capacity = num_max_tokens_per_rank, out_rows, int(src_meta.shape[0])
        a.layout, a.num_experts, a.alignment, a.tag = lay.data_ptr(), E, A, tag
    elif prepared is None:   # the handle's first cached dispatch with this key
        args = DispatchArgs(
            x=_ptr(data), sf=_ptr(sf), topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights), num_tokens=T,
            pos_tok=_ptr(pos_tok), pos_pair=_ptr(pos_pair), out_x=_ptr(out_x), out_sf=out_sf_ptr, sf_ld=sf_ld,
            out_topk_idx=_ptr(out_idx), out_weights=_ptr(out_w), src_meta=_ptr(src_meta),
            max_tokens=num_max_tokens_per_rank, out_capacity=out_rows, tok_capacity=int(src_meta.shape[0]),
            layout=lay.data_ptr(), num_experts=E, alignment=A,
            recv_offset=layout.recv_offset, half_bytes=layout.half_bytes, row_stride=layout.row_stride,
            timeout_ns=b.timeout_ns, err_host=b.err_record.device_ptr, tag=tag)
        fn = mod.function("deep_ep_dispatch_cached")
        prepared = state.launches[key] = fn.prepare(
            n_sms, modules.THREADS, (args, transport, ctypes.c_int(int(do_zero_padding))), device=dev.index,
            cooperative=b.cooperative)
    b.launch_data(prepared, n_sms)

    recv_x = out_x if sf is None else (out_x, out_sf)
    if cached:
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            # The layout kernel counts a fresh dispatch; a cached one adds the handle's counts here, on
            # the stream its kernels ran on.
            with contextlib.nullcontext() if b.fill_stream is None else torch.cuda.stream(b.fill_stream):
                stats.add_(lay[ix.raw_counts: ix.raw_counts + L])
        return recv_x, out_idx, out_w, handle

    if do_cpu_sync:
        counts = head[READBACK["counts"]: READBACK["counts"] + L]
        num_recv_tokens, num_expanded_tokens = num_tok_rows, sum(counts)
    else:
        counts = []
        num_recv_tokens = worst_case_recv_tokens(R, m)
        num_expanded_tokens = worst_case_recv_rows(R, m, K, L, A, True)
    new_state = GPUHandleState(layout=lay, pos_tok=pos_tok, pos_pair=pos_pair, recv_topk_idx=out_idx,
                               src_meta=src_meta)
    new_handle = EPHandle(
        do_expand=do_expand, num_experts=E, expert_alignment=A, num_max_tokens_per_rank=num_max_tokens_per_rank,
        num_sms=n_sms, topk_idx=handle_topk,
        num_recv_tokens=num_recv_tokens, num_expanded_tokens=num_expanded_tokens,
        num_recv_tokens_per_expert_list=counts,
        psum_num_recv_tokens_per_scaleup_rank=views[0], psum_num_recv_tokens_per_expert=views[1],
        num_unaligned_recv_tokens_per_expert=views[2],
        recv_src_metadata=src_meta, dst_buffer_slot_idx=pos_pair if do_expand else pos_tok,
        buffer_id=b.config.buffer_id, num_ranks=R, rank=rank, hidden=H, do_cpu_sync=do_cpu_sync,
        recv_topk_weights=out_w if do_expand else None, backend_state=new_state)
    return recv_x, out_idx, out_w, new_handle
