"""Host side of combine on the GPU backend: one kernel, ``modules.COMBINE_KERNEL`` (each destination
stages the rows that came from peers in its own window and signals; each source then pulls and sums
its tokens' rows), launched through the handle's prepared launch; with ``phases=SEND_PHASE``
(`modules.launch_send_phase`) the staging alone, the pull and sum left to a `modules.DeferredReceive`.
An expanded handle of a buffer with ``allow_multiple_reduction=False`` combines through the same
kernel built with `modules.SINGLE_REDUCTION` (a row per (token, slot), summed at the source); in hybrid
mode across nodes a non-expanded one with `modules.UNREDUCED_RANKS` (the forwarders pass each rank's
row on unreduced).
"""
from __future__ import annotations

import torch

from .. import outputs
from .abi import CombineArgs, call_tag
from .dispatch_plan import ptr as _ptr
from . import modules
from . import window
from .state import GPUHandleState

__all__ = ["run_combine"]


def run_combine(backend, x, handle, topk_weights, bias, *, num_sms, apply_dispatch_weights=False, num_qps=0,
                phases=modules.BOTH_PHASES):
    """`Backend.combine` on the GPU backend ``backend`` (see `deep_ep.backends.base`): the combine
    kernel through the handle's prepared launch (`_combine_launch`), its per-call pointers and call
    number set. ``phases`` as in `deep_ep.backends.gpu.dispatch.run_dispatch`: with
    `modules.SEND_PHASE` the result has a third item, the `modules.DeferredReceive` (which keeps
    ``x``, read again by the receive)."""
    if phases not in (modules.BOTH_PHASES, modules.SEND_PHASE):
        raise ValueError(f"phases must be BOTH_PHASES or SEND_PHASE at a call, got {phases!r}")
    if phases != modules.BOTH_PHASES and getattr(backend, "transport_gin", 0) == 2:
        raise NotImplementedError("a combine's send phase alone (a receive hook) in hybrid mode across nodes: "
                                  "forwarding waits between the phases; create the buffer with allow_hybrid_mode=False")
    state = handle.backend_state
    if not isinstance(state, GPUHandleState):
        raise ValueError("the handle was not made by a GPU dispatch (it has no GPU layout state)")
    has_weights = topk_weights is not None
    prepared, num_blocks, out_shape, w_shape, tag, _ = _combine_launch(backend, handle, state, num_sms,
                                                                       apply_dispatch_weights, has_weights, num_qps)
    backend.raise_if_broken()
    device, fill = backend.device, backend.fill_stream
    out = outputs.empty(out_shape, torch.bfloat16, device, fill)
    out_w = outputs.empty(w_shape, torch.float32, device, fill) if has_weights else None
    args = prepared.args[0]  # the per-call pointers (`_ptr` written out for the tensors always given)
    args.y, args.weights_in, args.out, args.out_weights = x.data_ptr() or None, _ptr(topk_weights), \
        out.data_ptr() or None, _ptr(out_w)
    if bias:
        args.bias0, args.bias1 = _ptr(bias[0]), (_ptr(bias[1]) if len(bias) > 1 else None)
    else:
        args.bias0 = args.bias1 = None
    tag.seq = backend.calls & 0xFFFFFFFF   # a view into the arguments (memo)
    if phases == modules.BOTH_PHASES:
        backend.launch_data(prepared, num_blocks)
        return out, out_w
    structure = (handle.hidden, handle.num_topk,   # not in hybrid mode: refused above
                 modules.combine_layout(handle.do_expand, backend.config.allow_multiple_reduction))
    deferred = modules.launch_send_phase(backend, "combine", structure, prepared, num_blocks,
                                         keep=(x, topk_weights, bias))
    return out, out_w, deferred


def _combine_launch(backend, handle, state, num_sms, apply_dispatch_weights, has_weights, num_qps=0) -> tuple:
    """The prepared combine launch for these options and what goes with it: ``(launch, SMs, output
    shape, weights' shape, the launch's tag, guard)``. Found in the handle's memo
    (`EPHandle.launch_memo`) by the call's options, else in its ``state`` by a key of the options and
    every handle field the launch reads; the first call of a key prepares it (`_prepare`)."""
    options = ("combine", num_sms, bool(apply_dispatch_weights), has_weights, num_qps)
    memo = handle.launch_memo()   # emptied by any assignment to the handle's fields
    entry = memo.get(options)
    topk = handle.topk_idx
    guard = (topk.data_ptr(), topk.shape, _ptr(handle.recv_topk_weights))   # tensors changed in place
    if entry is None or entry[-1] != guard:
        # The handle's fields and tensors the launch reads are part of the state's key: a handle
        # rebuilt with other values (dataclasses.replace) shares this state but must not reuse them.
        key = options + guard + (state.src_meta_ptr, handle.hidden, handle.num_experts, handle.do_expand)
        launch = state.launches.get(key)
        if launch is None:
            launch = state.launches[key] = _prepare(backend, handle, num_sms, apply_dispatch_weights, has_weights,
                                                    num_qps)
        num_tokens = handle.num_tokens
        entry = memo[options] = launch + ((num_tokens, handle.hidden), (num_tokens, handle.num_topk),
                                          launch[0].args[0].tag, guard)
    return entry


def _prepare(backend, handle, num_sms, apply_dispatch_weights, has_weights, num_qps=0) -> tuple:
    """The handle's prepared combine launch for this key, every argument but the per-call pointers
    and the call number set; returns ``(launch, SMs)``."""
    state = handle.backend_state
    hidden, num_topk, num_experts = handle.hidden, handle.num_topk, handle.num_experts
    node_ranks = getattr(backend, "hybrid_node_ranks", 0)   # hybrid mode across nodes: forwarders
    expand = modules.combine_layout(handle.do_expand, backend.config.allow_multiple_reduction, hybrid=bool(node_ranks))
    layout = backend.layout(window.combine_row_stride(hidden, backend.config.num_topk))
    if expand == modules.SINGLE_REDUCTION:
        window.check_single_reduction(layout.rows_per_half, backend.num_ranks, handle.num_max_tokens_per_rank,
                                      num_topk)
    if node_ranks:
        window.check_hybrid_combine(backend.transport_args.half_bytes, backend.num_ranks, node_ranks,
                                    handle.num_max_tokens_per_rank or handle.num_tokens, hidden, num_topk,
                                    unreduced=expand in (modules.SINGLE_REDUCTION, modules.UNREDUCED_RANKS),
                                    expanded=bool(handle.do_expand))
    num_blocks = backend.num_sms(num_sms, num_experts, num_topk)
    module = backend.module("combine", (hidden, num_topk, expand))
    transport = backend.transport_args_for(num_qps)   # the contexts across nodes
    tag = call_tag(0, 3, hidden, num_topk, int(expand), num_experts, has_weights, int(bool(apply_dispatch_weights)),
                   getattr(transport, "num_contexts", 0))
    args = CombineArgs(
        recv_weights=_ptr(handle.recv_topk_weights),
        src_meta=state.src_meta_ptr, layout=state.layout_ptr, pos_tok=state.pos_tok_ptr,
        pos_pair=state.pos_pair_ptr, topk_idx=_ptr(handle.topk_idx), num_tokens=handle.num_tokens,
        num_experts=num_experts, apply_weights=int(bool(apply_dispatch_weights)),
        recv_offset=layout.recv_offset, half_bytes=layout.half_bytes, row_stride=layout.row_stride,
        timeout_ns=backend.timeout_ns, err_host=backend.err_record.device_ptr, tag=tag,
        max_tokens=handle.num_max_tokens_per_rank)
    prepared = module.function(modules.COMBINE_KERNEL).prepare(
        num_blocks, modules.THREADS, (args, transport), device=backend.device.index,
        cooperative=backend.cooperative)
    return prepared, num_blocks
