"""The checks of `ElasticBuffer.dispatch` and `combine`, run once per call signature.

The rules are `deep_ep.checks.validate_dispatch` / `validate_combine`'s; this module decides when
they run. A call's signature holds every value a rule reads except what may differ between calls
that share it: the dtypes and shapes of the tensors (without their rows), the ints, the flags
(bools), the kinds of events, and the fields of the handle that the rules read (its layout, not its
identity: every step of a model makes new handles of the same layout). The first call of a
signature runs the full checks and keeps their `CallPlan` in the buffer's ``_plans`` (at most
`MAX_PLANS`, the oldest dropped first). A later call of the signature re-checks only the rest: every
tensor's device and contiguity, the rows (the token count: equal across ``x``, its scale factors,
the routing and the weights, within ``num_max_tokens_per_rank``; a handle's rows, also when its
routing tensor changed in place) and, for a fresh dispatch of CPU tensors, the expert ids. A call
that fails these, or whose arguments are not of the usual kinds (an int or a flag of another type,
such as a flag given as 0 / 1; an object where a tensor goes), takes the full checks, which say
what is wrong. The buffer's own configuration is fixed at its construction.
"""
from __future__ import annotations

import torch

from . import checks
from .handle import EPHandle

__all__ = ["MAX_PLANS", "dispatch_plan", "combine_plan"]

MAX_PLANS = 64   # signatures kept per buffer (a model has a few per layer kind)

_Tensor = torch.Tensor
_LAYOUT = object()   # where a handle's launch memo keeps its layout (`_handle_layout`)


class _Unusual(Exception):
    """An argument of a kind that signatures leave to the full checks."""


def _handle_layout(handle) -> tuple:
    """The fields of ``handle`` the checks read, and its routing tensor's device, which cannot
    change in place (its sizes can: they are read on every call). Kept in the handle's launch memo,
    which any assignment to a field empties."""
    memo = handle.launch_memo()
    layout = memo.get(_LAYOUT)
    if layout is None:
        layout = memo[_LAYOUT] = (
            type(handle), handle.buffer_id, handle.num_ranks, handle.rank, handle.topk_idx.device, handle.hidden,
            handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank, handle.do_expand,
            handle.do_cpu_sync, handle.recv_topk_weights is None)
    return layout


def _named(method: str, check, *args):
    """``check(*args)``, its argument errors prefixed with the public method's name (a check says
    what is wrong, the prefix says in which call)."""
    try:
        return check(*args)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith(method):
            raise
        raise type(exc)(f"{method}: {exc}") from None


def _remember(buf, key, plan) -> None:
    plans = buf._plans
    if len(plans) >= MAX_PLANS:
        del plans[next(iter(plans))]
    plans[key] = plan


def _sizes_and_key(tensor) -> tuple:
    """``(sizes, key)``: a tensor's sizes (read once: each read makes a new `torch.Size`) and its part
    of a signature, its dtype and its sizes after the rows: ``sizes[1]`` for the usual 2-D tensor
    (cheaper than a slice, and never equal to one), else ``sizes[1:]``."""
    sizes = tensor.shape
    return sizes, (tensor.dtype, sizes[1] if len(sizes) == 2 else sizes[1:])


def dispatch_plan(buf, x, topk_idx, topk_weights, stats, num_experts, num_max_tokens_per_rank, expert_alignment,
                  num_sms, num_qps, previous_event, previous_event_before_epilogue, async_with_compute_stream,
                  allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                  use_tma_aligned_col_major_sf) -> tuple:
    """`checks.validate_dispatch` for ``buf`` (an `ElasticBuffer`), once per signature; the same
    arguments (``stats`` is ``cumulative_local_expert_recv_stats``), the same result ``(data, sf,
    plan)`` and the same exceptions."""
    try:
        # Flags of other types (ints 0 / 1, numpy or torch bools) and equal values of other types for ints
        # (True, 8.0) would share a signature with values they may differ from: the full checks take those.
        if not (type(async_with_compute_stream) is bool and type(allocate_on_comm_stream) is bool
                and type(do_handle_copy) is bool and type(do_expand) is bool and type(do_zero_padding) is bool
                and type(use_tma_aligned_col_major_sf) is bool and (do_cpu_sync is None or type(do_cpu_sync) is bool)
                and type(num_sms) is int and type(num_qps) is int and (num_experts is None or type(num_experts) is int)
                and (num_max_tokens_per_rank is None or type(num_max_tokens_per_rank) is int)
                and (expert_alignment is None or type(expert_alignment) is int)):
            raise _Unusual
        if isinstance(x, _Tensor):
            data, sf, sf_key = x, None, None
        elif (type(x) is tuple or type(x) is list) and len(x) == 2 and isinstance(x[0], _Tensor) \
                and isinstance(x[1], _Tensor):
            data, sf = x
            sf_sizes, sf_key = _sizes_and_key(sf)
        else:
            raise _Unusual
        if handle is None and isinstance(topk_idx, _Tensor):
            routing, layout = topk_idx, (topk_idx.dtype, topk_idx.device)
        elif topk_idx is None and isinstance(handle, EPHandle):
            routing, layout = handle.topk_idx, _handle_layout(handle)
        else:
            raise _Unusual
        if topk_weights is None:
            weights_key = None
        elif isinstance(topk_weights, _Tensor):
            weights_sizes, weights_key = _sizes_and_key(topk_weights)
        else:
            raise _Unusual
        if stats is None:
            stats_key = None
        elif isinstance(stats, _Tensor):
            stats_key = (stats.dtype, stats.shape)
        else:
            raise _Unusual
        sizes, routing_sizes = data.shape, routing.shape
        key = ("dispatch", layout, routing_sizes[1] if len(routing_sizes) == 2 else routing_sizes[1:], data.dtype,
               sizes[1] if len(sizes) == 2 else sizes[1:], sf_key, weights_key, stats_key, num_experts,
               num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, type(previous_event),
               type(previous_event_before_epilogue), async_with_compute_stream, allocate_on_comm_stream,
               do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf)
        plan = buf._plans.get(key)   # TypeError: a handle field of an unhashable type
    except (_Unusual, TypeError):
        plan = key = None
    if plan is not None:
        # What may differ between calls of one signature (which fixes every tensor's other sizes).
        device, T, max_tokens = plan.device, sizes[0], plan.num_max_tokens_per_rank
        if (routing_sizes[0] == T and (not max_tokens or T <= max_tokens)
                and data.device == device and data.is_contiguous()
                and (handle is not None or routing.is_contiguous())   # a fresh routing's device: in the key
                and (sf is None or (sf_sizes[0] == T and sf.device == device and sf.is_contiguous()))
                and (topk_weights is None or (weights_sizes[0] == T and topk_weights.device == device
                                              and topk_weights.is_contiguous()))
                and (stats is None or (stats.device == device and stats.is_contiguous()))):
            if plan.check_ids:
                _named("ElasticBuffer.dispatch", checks.check_topk_values, topk_idx, plan.num_experts)
            return data, sf, plan
    # A new signature, an argument of another kind, or a call that fails the re-checks: the full
    # checks say what is wrong, if anything is.
    data, sf, plan = _named(
        "ElasticBuffer.dispatch", checks.validate_dispatch,
        buf, x, topk_idx, topk_weights, stats, num_experts, num_max_tokens_per_rank, expert_alignment, num_sms,
        num_qps, previous_event, previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream,
        handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf)
    if key is not None:
        _remember(buf, key, plan)
    return data, sf, plan


def combine_plan(buf, x, handle, topk_weights, bias, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                 async_with_compute_stream, allocate_on_comm_stream, apply_dispatch_weights) -> tuple:
    """`checks.validate_combine` for ``buf``, once per signature: the same arguments, the same result
    ``(bias, plan)`` and the same exceptions."""
    try:
        if not (type(async_with_compute_stream) is bool and type(allocate_on_comm_stream) is bool
                and type(apply_dispatch_weights) is bool and type(num_sms) is int and type(num_qps) is int
                and isinstance(x, _Tensor) and isinstance(handle, EPHandle)):
            raise _Unusual
        if topk_weights is None:
            weights_key = None
        elif isinstance(topk_weights, _Tensor):
            weights_sizes, weights_key = _sizes_and_key(topk_weights)
        else:
            raise _Unusual
        if bias is None:
            biases = ()
        elif isinstance(bias, _Tensor):
            biases = (bias,)
        elif (type(bias) is tuple or type(bias) is list) and len(bias) <= 2 \
                and all(b is None or isinstance(b, _Tensor) for b in bias):
            biases = tuple(b for b in bias if b is not None)
        else:
            raise _Unusual
        if topk_weights is None and not biases:
            routing_sizes = routing_key = None   # they matter to the weights ([rows, K]) and biases ([T, H]) only
        else:
            routing_sizes = handle.topk_idx.shape
            routing_key = routing_sizes[1] if len(routing_sizes) == 2 else routing_sizes[1:]
        sizes = x.shape
        key = ("combine", _handle_layout(handle), routing_key, x.dtype, sizes[1] if len(sizes) == 2 else sizes[1:],
               weights_key, tuple((b.dtype, b.shape[1:]) for b in biases) if biases else (), num_sms, num_qps,
               type(previous_event), type(previous_event_before_epilogue), async_with_compute_stream,
               allocate_on_comm_stream, apply_dispatch_weights)
        plan = buf._plans.get(key)   # TypeError: a handle field of an unhashable type
    except (_Unusual, TypeError):
        plan = key = None
    if plan is not None:
        device, rows = plan.device, handle.num_recv_rows
        if (sizes[0] == rows and x.device == device and x.is_contiguous()
                and (topk_weights is None or (weights_sizes[0] == rows and topk_weights.device == device
                                              and topk_weights.is_contiguous()))
                and (not biases or all(b.shape[0] == routing_sizes[0] and b.device == device and b.is_contiguous()
                                       for b in biases))):
            return biases, plan
    biases, plan = _named("ElasticBuffer.combine", checks.validate_combine, buf, x, handle, topk_weights, bias,
                          num_sms, num_qps, previous_event, previous_event_before_epilogue, async_with_compute_stream,
                          allocate_on_comm_stream, apply_dispatch_weights)
    if key is not None:
        _remember(buf, key, plan)
    return biases, plan
