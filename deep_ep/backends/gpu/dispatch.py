"""Host side of dispatch on the GPU backend. Every rank count, a rank alone too, runs the same
kernels (`modules`); this module decides which is launched.

Flow of one non-cached dispatch (every kernel on the buffer's communication stream):

1. ``modules.NOTIFY_KERNEL`` (eight warps per block, a warp per group of tokens) numbers this rank's
   tokens per destination rank and pairs per expert, checks the expert ids, copies them for the
   handle (``do_handle_copy``), and writes its count row into every peer's window; its last block
   signals the peers, then waits for every peer's counts and writes the handle's layout words (the
   layout stage, in the same kernel). On emulated nodes the ranks of other nodes get the count row
   through the emulated GIN, this rank's NIC kernel beside the notify kernel (`modules.launch_control`).
2. With ``do_cpu_sync`` the layout stage also writes the received row counts to mapped host memory,
   which the host polls (`GPUBackend.wait_readback`), then allocates exact outputs; without it the
   outputs are sized for the worst case and nothing waits on the host.
3. ``modules.DISPATCH_KERNEL`` (num_sms blocks): the send phase moves every token row once per
   destination rank (peers: into their window; this rank: straight into the outputs) and signals;
   the receive phase waits for every peer, then copies peers' rows into the outputs.

With ``phases=SEND_PHASE`` (`modules.launch_send_phase`) step 3 launches the send phase alone and the
call returns the receive phase as a `modules.DeferredReceive`, launched later by its owner (a V1
low-latency receive hook): between the two, no kernel of the call holds an SM.

A cached dispatch runs step 3 only (``modules.CACHED_DISPATCH_KERNEL``) with the handle's prepared
launch. Rounds alternate between the two halves of the receive region (see `window`).

On the host a fresh dispatch is a `DispatchCall` going through four steps: plan (`_plan`: the
configuration's `FreshPlan`, derived once, and what the token count derives), allocate
(`_allocate_words`: the handle's words), launch (`_launch_notify`, then `_launch_data`, which
allocates the outputs before or after the counts) and handle (`_make_handle`).
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Optional

import torch

from ... import jit
from ...handle import EPHandle
from .. import outputs
from .abi import READBACK, DispatchArgs, layout_index
from . import modules
from .dispatch_plan import NOTIFY_WARPS, FreshPlan, check_config, dispatch_tag
from .dispatch_plan import ptr as _ptr, sf_ld as _sf_ld
from .state import GPUHandleState, word_plan

__all__ = ["run_dispatch", "run_cached", "NOTIFY_PAIRS_PER_GROUP", "notify_groups", "word_plan"]

# (token, slot) pairs one notify group (a warp) numbers, at most: its two passes go over them 32
# at a time, so fewer pairs per group mean a shorter kernel, up to the backend's cap on groups
# (`GPUBackend.notify_groups_max`), past which the grid barriers cost more than they save.
NOTIFY_PAIRS_PER_GROUP = 32


def notify_groups(num_tokens: int, num_topk: int, groups_max: int) -> int:
    """Groups (warps) of the notify kernel for ``num_tokens`` tokens of top-``num_topk``: enough for
    at most `NOTIFY_PAIRS_PER_GROUP` pairs each, at most ``groups_max``, in whole blocks of
    `NOTIFY_WARPS`."""
    cap = max(NOTIFY_WARPS, groups_max // NOTIFY_WARPS * NOTIFY_WARPS)
    groups = -(-max(1, -(-num_tokens * num_topk // NOTIFY_PAIRS_PER_GROUP)) // NOTIFY_WARPS) * NOTIFY_WARPS
    return min(groups, cap)


_MAX_PLANS = 64   # configurations kept per buffer (a model has a few; more are re-derived)
# Where the layout stage's report (`GPUBackend.wait_readback`) holds what a fresh dispatch reads
_OUT_ROWS, _TOK_ROWS, _COUNTS = READBACK["out_rows"], READBACK["tok_rows"], READBACK["counts"]


class _NotifyRefused(Exception):
    """The device refused the notify kernel's cooperative launch (`run_dispatch` retries)."""


class DispatchCall:
    """One fresh dispatch while it runs: its arguments, then what each step derives for the next.

    plan (`_plan`): ``plan`` (the configuration's `FreshPlan`), ``num_tokens``, ``num_topk``,
    ``word_plan`` (the handle's int32 words, `word_plan`), ``notify_blocks``, ``tokens_per_group``;
    allocate (`_allocate_words`): ``device``, ``fill`` (the stream outputs are allocated for,
    `GPUBackend.fill_stream`), ``words``, ``handle_topk``, ``addresses`` (the words' address and
    their pieces', `WordPlan.addresses`), ``topk_ptr`` (the input topk_idx's address);
    launch (`_launch_notify`, `_launch_data`): ``report`` (the layout stage's, with CPU sync),
    ``recv`` (``(recv_x, recv_sf, recv_topk_weights, recv_topk_idx)``), ``state`` (the handle's
    `GPUHandleState`); the handle step (`_make_handle`) reads them all.
    """

    __slots__ = ("backend", "data", "sf", "topk_idx", "topk_weights", "num_experts", "num_max_tokens_per_rank",
                 "expert_alignment", "num_sms", "num_qps", "do_handle_copy", "do_cpu_sync", "do_expand", "do_zero_padding",
                 "col_major_sf", "stats", "phases", "deferred",
                 "plan", "num_tokens", "num_topk", "word_plan", "notify_blocks", "tokens_per_group",
                 "device", "fill", "words", "handle_topk", "addresses", "topk_ptr",
                 "report", "recv", "state")

    def __init__(self, backend, data, sf, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                 expert_alignment, num_sms, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, col_major_sf,
                 stats, num_qps=0):
        self.backend, self.data, self.sf, self.topk_idx, self.topk_weights = backend, data, sf, topk_idx, topk_weights
        self.num_experts, self.num_max_tokens_per_rank = num_experts, num_max_tokens_per_rank
        self.expert_alignment, self.num_sms, self.do_handle_copy = expert_alignment, num_sms, do_handle_copy
        self.do_cpu_sync, self.do_expand, self.do_zero_padding = do_cpu_sync, do_expand, do_zero_padding
        self.col_major_sf, self.stats, self.num_qps = col_major_sf, stats, num_qps
        self.phases, self.deferred = modules.BOTH_PHASES, None


def run_dispatch(backend, data, sf, topk_idx, topk_weights, *, num_experts, num_max_tokens_per_rank,
                 expert_alignment, num_sms, handle, do_handle_copy, do_cpu_sync, do_expand,
                 do_zero_padding, use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats,
                 num_qps=0, phases=modules.BOTH_PHASES):
    """`Backend.dispatch` on the GPU backend ``backend`` (see `deep_ep.backends.base`).

    ``phases`` (fresh dispatches only; internal, for V1 receive hooks): `modules.SEND_PHASE` launches
    the data kernel's send phase alone and adds the `modules.DeferredReceive` of its receive phase
    to the result, which the caller must launch before any other call on the buffer.

    A fresh dispatch whose notify kernel the device refuses to launch cooperatively (its blocks
    cannot all be resident: fewer SMs than the device has, under MPS or a green context) is started
    again with half the grid: nothing of the call was queued yet, and any grid numbers the same.

    Raises:
        jit.LaunchError: not even one notify block fits, or the grid would have to change during
            CUDA-graph capture.
    """
    if phases not in (modules.BOTH_PHASES, modules.SEND_PHASE):
        raise ValueError(f"phases must be BOTH_PHASES or SEND_PHASE at a call, got {phases!r}")
    if phases != modules.BOTH_PHASES and getattr(backend, "transport_gin", 0) == 2:
        raise NotImplementedError("a dispatch's send phase alone (a receive hook) in hybrid mode across nodes: "
                                  "forwarding waits between the phases; create the buffer with allow_hybrid_mode=False")
    if handle is not None:
        if phases != modules.BOTH_PHASES:
            raise ValueError("a cached dispatch runs both phases in one launch")
        return run_cached(backend, data, sf, topk_weights, handle, num_sms, do_zero_padding,
                          use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats, num_qps)
    call = DispatchCall(backend, data, sf, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                        expert_alignment, num_sms, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                        use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats, num_qps)
    call.phases = phases
    while True:   # the steps up to the notify kernel's launch, again after a refused grid
        try:
            _plan(call)
            _allocate_words(call)
            _launch_notify(call)
            break
        except _NotifyRefused as refused:
            _lower_notify_grid(backend, refused)
    _launch_data(call)
    result = _make_handle(call)
    return result if call.deferred is None else result + (call.deferred,)


def _lower_notify_grid(backend, refused: _NotifyRefused) -> None:
    """After the device refused the notify kernel's grid: halve the backend's cap on it (later
    calls keep the lower cap), or raise `jit.LaunchError` when it cannot be lowered (one block, or
    during CUDA-graph capture)."""
    blocks = refused.args[0]
    capturing = _capturing(backend)
    if blocks <= 1 or capturing:
        why = ("during CUDA-graph capture the grid cannot be lowered: make one fresh dispatch before "
               "capturing" if blocks > 1 else "not even one block fits")
        raise jit.LaunchError(f"rank {backend.rank}: the device cannot hold the {blocks} blocks of the notify "
                              f"kernel at once (fewer SMs available, e.g. under MPS or a green context); "
                              f"{why}") from refused.__cause__
    backend.set_notify_groups_max((blocks // 2) * NOTIFY_WARPS)


def _plan(call: DispatchCall) -> None:
    """The plan step: the configuration's `FreshPlan` (kept per configuration in
    `GPUBackend.fresh_plans`) and what the call's token count derives (the handle's word plan and
    the notify grid), both derived on first use; checks
    the token count and that the buffer is usable."""
    backend, sf = call.backend, call.sf
    if call.do_cpu_sync and _capturing(backend):   # before a new configuration would build or load a module
        raise RuntimeError("deep_ep: a fresh dispatch with do_cpu_sync=True cannot be captured in a CUDA graph: the "
                           "host would wait for counts that its kernels write only at replay. Capture a dispatch "
                           "with do_cpu_sync=False (outputs sized by num_max_tokens_per_rank) or a cached one "
                           "(handle=...); nothing was queued")
    num_tokens, hidden = call.data.shape   # (each read of a tensor's shape makes a new torch.Size: read it once)
    num_topk = call.topk_idx.shape[1]
    call.num_tokens, call.num_topk = num_tokens, num_topk
    key = (hidden, call.data.dtype, None if sf is None else (int(sf.shape[1]), sf.dtype), num_topk, call.num_experts,
           call.expert_alignment, call.num_max_tokens_per_rank, call.num_sms, call.topk_weights is not None,
           call.do_cpu_sync, call.do_expand, call.do_zero_padding, call.num_qps)
    plan = backend.fresh_plans.get(key)
    if plan is None:
        plan = _new_fresh_plan(call, key, num_topk)
    call.plan = plan
    if num_tokens > plan.num_max_tokens:
        raise ValueError(f"{num_tokens} tokens on rank {backend.rank}, more than the {plan.num_max_tokens} per "
                         f"rank the buffer holds (num_max_tokens_per_rank)")
    backend.call_record.num_max_tokens = plan.num_max_tokens
    backend.raise_if_broken()
    grid_key = (num_tokens, backend.notify_groups_max, NOTIFY_PAIRS_PER_GROUP)
    per_tokens = plan.per_tokens.get(grid_key)
    if per_tokens is None:
        per_tokens = _plan_tokens(plan, grid_key, backend.num_ranks, num_topk, bool(call.do_expand))
    call.word_plan, call.notify_blocks, call.tokens_per_group = per_tokens


def _new_fresh_plan(call: DispatchCall, key: tuple, num_topk: int) -> FreshPlan:
    """The `FreshPlan` of the call's configuration (``key``), derived now and kept in the backend's
    `GPUBackend.fresh_plans` (at most `_MAX_PLANS`: emptied when full)."""
    plans = call.backend.fresh_plans
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plan = plans[key] = FreshPlan(call.backend, call.data, call.sf, num_topk, call.num_experts, call.expert_alignment,
                                  call.num_max_tokens_per_rank, call.num_sms, call.topk_weights is not None,
                                  call.do_cpu_sync, call.do_expand, call.do_zero_padding, call.num_qps)
    return plan


def _plan_tokens(plan: FreshPlan, grid_key: tuple, num_ranks: int, num_topk: int, expanded: bool) -> tuple:
    """What a token count derives under ``plan`` (``grid_key``: tokens, the notify grid's settings),
    kept in ``plan.per_tokens``: ``(word plan, notify blocks, tokens per group)``. The handle's int32
    words are one allocation: layout words, pos_tok [T, R], (expanded) pos_pair [T, K], and
    recv_src_metadata when its rows are known before the call (no CPU sync: the worst case)
    (`word_plan`); the kernels get addresses inside it."""
    num_tokens, groups_max, _ = grid_key
    if len(plan.per_tokens) >= _MAX_PLANS:
        plan.per_tokens.clear()
    words = word_plan(plan.layout_index, num_ranks, plan.num_local_experts, num_tokens, num_topk, expanded,
                      plan.meta_rows)
    groups = notify_groups(num_tokens, num_topk, groups_max)
    per_tokens = plan.per_tokens[grid_key] = (words, groups // NOTIFY_WARPS, max(1, -(-num_tokens // groups)))
    return per_tokens


def _allocate_words(call: DispatchCall) -> None:
    """The allocate step before the launches: the handle's int32 words (`word_plan`) and its copy
    of topk_idx (written by the notify kernel: no copy of its own), and their addresses."""
    backend = call.backend
    device, fill = call.device, call.fill = backend.device, backend.fill_stream
    words = call.words = outputs.empty(call.word_plan.total, torch.int32, device, fill)
    call.handle_topk = outputs.empty((call.num_tokens, call.num_topk), torch.int64, device, fill) \
        if call.do_handle_copy else call.topk_idx
    layout_ptr = words.data_ptr()
    call.addresses = (layout_ptr,) + call.word_plan.addresses(layout_ptr)
    # `_ptr` written out for the tensors that are always given (a call per address adds up here)
    call.topk_ptr = call.topk_idx.data_ptr() or None


def _launch_notify(call: DispatchCall) -> None:
    """The first launch: set the notify kernel's and its layout stage's per-call arguments (a new
    report number with CPU sync) and every kernel's call number, then launch it; raises
    `_NotifyRefused` when the device refuses its cooperative launch."""
    backend, plan = call.backend, call.plan
    notify_args, layout_args = plan.notify_args, plan.layout_args
    notify_args.topk_idx, notify_args.num_tokens = call.topk_ptr, call.num_tokens
    notify_args.tokens_per_group = call.tokens_per_group
    notify_args.topk_copy = (call.handle_topk.data_ptr() or None) if call.do_handle_copy else None
    layout_ptr, pos_tok_ptr, pos_pair_ptr, _ = call.addresses
    notify_args.pos_tok, notify_args.pos_pair = pos_tok_ptr, pos_pair_ptr
    layout_args.layout, layout_args.cumulative_stats = layout_ptr, _ptr(call.stats)
    record = backend.call_record
    if call.do_cpu_sync:
        record.readback_seq = layout_args.seq = (record.readback_seq % (2 ** 31 - 1)) + 1
    notify_tag, layout_tag, data_tag = plan.tags
    notify_tag.seq = layout_tag.seq = data_tag.seq = backend.calls & 0xFFFFFFFF
    record.launched_call = backend.calls
    try:   # on emulated nodes beside this rank's NIC kernel (its counts reach other nodes through it)
        stream, blocks = backend.launch_stream, call.notify_blocks
        modules.launch_control(backend, stream, blocks, lambda: plan.notify.launch(stream, blocks))
    except jit.LaunchError as exc:
        if "COOPERATIVE_LAUNCH_TOO_LARGE" in str(exc):
            raise _NotifyRefused(call.notify_blocks) from exc
        raise
    record.num_experts, record.num_topk = plan.num_experts, call.num_topk


def _launch_data(call: DispatchCall) -> None:
    """The data kernel: its arguments that do not depend on the counts (set while the notify kernel
    runs), then, with CPU sync, the wait for the exact rows (known only once every peer's counts are
    in), else the worst case; then the outputs and the launch."""
    backend, plan = call.backend, call.plan
    data_args = plan.data_args
    data_args.x, data_args.sf, data_args.topk_idx, data_args.topk_weights, data_args.num_tokens = \
        call.data.data_ptr() or None, _ptr(call.sf), call.topk_ptr, _ptr(call.topk_weights), call.num_tokens
    layout_ptr, pos_tok_ptr, pos_pair_ptr, _ = call.addresses
    data_args.pos_tok, data_args.pos_pair, data_args.layout = pos_tok_ptr, pos_pair_ptr, layout_ptr
    if call.do_cpu_sync:
        report = call.report = backend.wait_readback(backend.call_record.readback_seq, plan.num_experts,
                                                     call.num_topk)
        out_rows, tok_capacity = report[_OUT_ROWS], report[_TOK_ROWS]
        meta_rows = tok_capacity
    else:   # worst-case rows; recv_src_metadata's are a piece of the words
        out_rows, tok_capacity, meta_rows = plan.out_capacity, plan.tok_capacity, None
    out_x, out_sf, out_w, out_idx, src_meta, sf_ld = _allocate_outputs(call, out_rows, meta_rows)
    state = call.state = GPUHandleState(call.words, call.word_plan, out_idx, src_meta, tok_capacity, call.addresses,
                                        getattr(backend, "hybrid_scaleup_ranks", 0))
    _set_outputs(data_args, out_x, out_sf, sf_ld, out_idx, out_w, state.src_meta_ptr, out_rows, tok_capacity)
    if call.phases == modules.BOTH_PHASES:
        backend.launch_data(plan.data, plan.num_sms)
    else:
        structure = (int(call.data.shape[1]) * call.data.element_size(), 0 if call.sf is None else int(call.sf.shape[1]),
                     call.num_topk, bool(call.do_expand))
        call.deferred = modules.launch_send_phase(backend, "dispatch", structure, plan.data, plan.num_sms)
    call.recv = (out_x, out_sf, out_w, out_idx)


def _make_handle(call: DispatchCall) -> tuple:
    """The handle step: `run_dispatch`'s result, ``(recv_x, recv_topk_idx, recv_topk_weights,
    handle)``. The handle's layout tensors, dst_buffer_slot_idx and recv_src_metadata are views of
    the state, made when first read (`EPHandle.with_lazy_fields`); the fields that follow from the
    configuration come with the plan. Without CPU sync its counts are the worst case."""
    plan, state = call.plan, call.state
    out_x, out_sf, out_w, out_idx = call.recv
    recv_x = out_x if call.sf is None else (out_x, out_sf)
    if call.do_cpu_sync:
        counts = call.report[_COUNTS: _COUNTS + plan.num_local_experts]
        num_expanded_tokens = sum(counts)
    else:
        counts, num_expanded_tokens = [], plan.expanded_capacity
    fields = plan.handle_fields.copy()
    fields["topk_idx"], fields["num_recv_tokens"] = call.handle_topk, state.tok_capacity
    fields["num_expanded_tokens"], fields["num_recv_tokens_per_expert_list"] = num_expanded_tokens, counts
    if call.do_expand:
        fields["recv_topk_weights"] = out_w
    return recv_x, out_idx, out_w, EPHandle.with_lazy_fields(state, fields)


def _capturing(backend) -> bool:
    """Whether the current stream of the backend's (CUDA) device is being captured in a CUDA graph."""
    return backend.device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


def _set_outputs(data_args, out_x, out_sf, sf_ld, out_idx, out_w, src_meta_ptr, out_rows, tok_capacity) -> None:
    """Set a fresh dispatch's output arguments in its data kernel's struct ``data_args``."""
    data_args.out_x, data_args.out_sf, data_args.sf_ld = out_x.data_ptr() or None, _ptr(out_sf), sf_ld
    data_args.out_topk_idx, data_args.out_weights, data_args.src_meta = _ptr(out_idx), _ptr(out_w), src_meta_ptr
    data_args.out_capacity, data_args.tok_capacity = out_rows, tok_capacity


def _allocate_outputs(call: DispatchCall, out_rows: int, meta_rows: Optional[int]) -> tuple:
    """A fresh dispatch's outputs for ``out_rows`` rows: ``(recv_x, scale factors, weights,
    recv_topk_idx, recv_src_metadata, sf leading dimension)``; weights None without topk_weights,
    recv_topk_idx None when expanded, recv_src_metadata (``meta_rows`` rows) None when ``meta_rows``
    is None (without CPU sync it is a piece of the handle's words)."""
    data, sf, num_topk, device, fill = call.data, call.sf, call.num_topk, call.device, call.fill
    out_x = outputs.empty((out_rows, data.shape[1]), data.dtype, device, fill)
    out_sf, sf_ld = (None, 0) if sf is None else _allocate_sf(call.backend, sf, out_rows, call.col_major_sf)
    out_w = None if call.topk_weights is None else \
        outputs.empty(out_rows if call.do_expand else (out_rows, num_topk), torch.float32, device, fill)
    out_idx = None if call.do_expand else outputs.empty((out_rows, num_topk), torch.int64, device, fill)
    src_meta = None if meta_rows is None else outputs.empty((meta_rows, num_topk + 2), torch.int32, device, fill)
    return out_x, out_sf, out_w, out_idx, src_meta, sf_ld


def _allocate_sf(backend, sf, out_rows: int, col_major: bool) -> tuple:
    """The received scale factors of an FP8 dispatch (``sf`` given: its callers skip it without FP8)
    and their leading dimension (column-major: rows rounded up to 4; else 0)."""
    num_sf = int(sf.shape[1])
    if col_major:
        leading_dim = _sf_ld(out_rows)
        return (outputs.empty((num_sf, leading_dim), sf.dtype, backend.device, backend.fill_stream).t()[:out_rows],
                leading_dim)
    return outputs.empty((out_rows, num_sf), sf.dtype, backend.device, backend.fill_stream), 0


def run_cached(backend, data, sf, topk_weights, handle, num_sms, do_zero_padding, col_major_sf, stats, num_qps=0):
    """A cached dispatch: the data kernel only, through the handle's prepared launch
    (`_cached_launch`); its per-call pointers and call number set, outputs of the handle's rows."""
    state = handle.backend_state
    if not isinstance(state, GPUHandleState):
        raise ValueError("the handle was not made by a GPU dispatch (it has no GPU layout state)")
    has_weights = topk_weights is not None
    prepared, num_max_tokens, _, num_blocks, out_rows, x_shape, w_shape, tag, _ = _cached_launch(
        backend, data, sf, has_weights, handle, num_sms, do_zero_padding, col_major_sf, num_qps)
    backend.call_record.num_max_tokens = num_max_tokens
    backend.raise_if_broken()
    device, fill = backend.device, backend.fill_stream
    out_x = outputs.empty(x_shape, data.dtype, device, fill)
    out_sf = None if sf is None else _allocate_sf(backend, sf, out_rows, col_major_sf)[0]
    out_w = outputs.empty(w_shape, torch.float32, device, fill) if has_weights else None
    args = prepared.args[0]
    # `_ptr` written out for the tensors that are always given (a call per address adds up here)
    args.x, args.sf, args.out_x, args.out_sf = data.data_ptr() or None, _ptr(sf), out_x.data_ptr() or None, \
        _ptr(out_sf)
    args.topk_weights, args.out_weights = _ptr(topk_weights), _ptr(out_w)
    tag.seq = backend.calls & 0xFFFFFFFF
    backend.launch_data(prepared, num_blocks)
    recv_x = out_x if sf is None else (out_x, out_sf)
    if stats is not None:
        # The layout stage counts a fresh dispatch; a cached one adds the handle's counts here, on
        # the stream its kernels ran on.
        index = layout_index(handle.num_ranks, handle.num_local_experts, handle.num_experts)
        with contextlib.nullcontext() if backend.fill_stream is None else torch.cuda.stream(backend.fill_stream):
            stats.add_(state.layout[index.raw_counts: index.raw_counts + handle.num_local_experts])
    return recv_x, state.recv_topk_idx, out_w, handle


def _cached_launch(backend, data, sf, has_weights, handle, num_sms, do_zero_padding, col_major_sf, num_qps) -> tuple:
    """The prepared launch of a cached dispatch with these options and what goes with it: ``(launch,
    num_max_tokens, num_topk, SMs, output rows, recv_x's shape, weights' shape, the launch's tag,
    guard)``. Found in the handle's memo (`EPHandle.launch_memo`) by the call's options, else in its
    state by a key of the options and every handle field the launch reads; the first call of a key
    prepares it (`_prepare_cached`)."""
    options = ("dispatch", data.dtype, None if sf is None else (int(sf.shape[1]), sf.dtype), num_sms,
               bool(do_zero_padding), bool(col_major_sf), has_weights, num_qps)
    memo = handle.launch_memo()   # emptied by any assignment to the handle's fields
    entry = memo.get(options)
    topk = handle.topk_idx
    guard = (topk.data_ptr(), topk.shape)   # its tensor changed in place (set_, resize_): derive again
    if entry is None or entry[-1] != guard:
        # The handle's fields and tensors the launch reads are part of the state's key: a handle
        # rebuilt with other values (dataclasses.replace) shares this state but must not reuse them.
        state = handle.backend_state
        key = options + guard + (state.src_meta_ptr, handle.hidden, handle.num_experts, handle.expert_alignment,
                                 handle.num_max_tokens_per_rank, handle.do_expand, handle.do_cpu_sync,
                                 handle.num_recv_rows)
        launch = state.launches.get(key)
        if launch is None:
            launch = state.launches[key] = _prepare_cached(backend, data, sf, has_weights, handle, num_sms,
                                                           do_zero_padding, col_major_sf, num_qps)
        rows = handle.num_recv_rows
        entry = memo[options] = launch + (rows, (rows, int(data.shape[1])),
                                          rows if handle.do_expand else (rows, launch[2]), launch[0].args[0].tag,
                                          guard)
    return entry


def _prepare_cached(backend, data, sf, has_weights, handle, num_sms, do_zero_padding, col_major_sf, num_qps) -> tuple:
    """The handle's prepared cached-dispatch launch for this key, every argument but the per-call
    pointers and the call number set; returns ``(launch, num_max_tokens, num_topk, SMs)``."""
    state = handle.backend_state
    num_experts, alignment, num_topk = handle.num_experts, handle.expert_alignment, handle.num_topk
    do_expand, do_cpu_sync = bool(handle.do_expand), bool(handle.do_cpu_sync)
    data_bytes, num_sf, layout, num_max_tokens = check_config(backend, data, sf, num_topk, num_experts,
                                                              handle.num_max_tokens_per_rank)
    num_blocks = backend.num_sms(num_sms, num_experts, num_topk)
    module = backend.module("dispatch", (data_bytes, num_sf, num_topk, do_expand))
    out_rows = handle.num_recv_rows
    leading_dim = _sf_ld(out_rows) if sf is not None and col_major_sf else 0
    transport = backend.transport_args_for(num_qps)
    tag = dispatch_tag(2, data_bytes, num_sf, num_topk, do_expand, alignment, num_experts, has_weights, do_cpu_sync,
                       num_max_tokens, getattr(transport, "num_contexts", 0))
    args = DispatchArgs(
        topk_idx=_ptr(handle.topk_idx), num_tokens=int(data.shape[0]), pos_tok=state.pos_tok_ptr,
        pos_pair=state.pos_pair_ptr, sf_ld=leading_dim, out_topk_idx=_ptr(state.recv_topk_idx),
        src_meta=state.src_meta_ptr, max_tokens=handle.num_max_tokens_per_rank, out_capacity=out_rows,
        tok_capacity=state.tok_capacity, layout=state.layout_ptr, num_experts=num_experts, alignment=alignment,
        recv_offset=layout.recv_offset, half_bytes=layout.half_bytes, row_stride=layout.row_stride,
        timeout_ns=backend.timeout_ns, err_host=backend.err_record.device_ptr, tag=tag)
    prepared = module.function(modules.CACHED_DISPATCH_KERNEL).prepare(
        num_blocks, modules.THREADS, (args, transport, ctypes.c_int(int(do_zero_padding))),
        device=backend.device.index, cooperative=backend.cooperative)
    return prepared, num_max_tokens, num_topk, num_blocks
