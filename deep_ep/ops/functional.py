"""The functional API: `dispatch` and `combine` as differentiable functions of tensors, which
``torch.compile(fullgraph=True)`` traces without a graph break (docs/training.md).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from ..buffer import ElasticBuffer
from ..handle import EPHandle
from . import autograd, registry
from .library import cached_dispatch_op, combine_op, dispatch_op

autograd.register()

__all__ = ["Handle", "dispatch", "combine", "ep_handle"]

_FP8 = torch.float8_e4m3fn


class Handle(NamedTuple):
    """The handle `dispatch` returns: what `combine`, a cached `dispatch` and the backward passes need.

    Unlike `deep_ep.EPHandle` (a Python object a compiled graph cannot carry) it is a tuple of tensors
    and numbers. Under ``torch.compile`` the row count is a symbolic size.

    Fields:
        token: int64 ``[1]`` on the CPU, naming the dispatch's `EPHandle` (and keeping it alive).
        buffer_id: the `ElasticBuffer` of the dispatch.
        do_expand: the layout. num_experts: E. expert_alignment: A. num_topk: K. hidden: H.
        num_tokens: T, the tokens this rank dispatched.
        num_recv_rows: rows of the receive tensors (and of combine's ``x``).
        psum_num_recv_tokens_per_expert: int32 ``[L]`` on the buffer's device (DeepEP's meaning:
            docs/design.md, "The handle").
        num_unaligned_recv_tokens_per_expert: int32 ``[L]``: received (token, expert) pairs per
            local expert.
        recv_topk_weights: the dispatch's received weights (expanded layout with weights, else
            None): `combine(apply_dispatch_weights=True)` multiplies by them, and differentiates.
    """
    token: Tensor
    buffer_id: int
    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_topk: int
    hidden: int
    num_tokens: int
    num_recv_rows: int
    psum_num_recv_tokens_per_expert: Tensor
    num_unaligned_recv_tokens_per_expert: Tensor
    recv_topk_weights: Optional[Tensor]


def ep_handle(handle: Handle) -> EPHandle:
    """The `deep_ep.EPHandle` behind ``handle`` (eager code only: it is not a tensor).

    Raises:
        TypeError: ``handle`` is not a `Handle`. RuntimeError: the handle no longer exists.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be a deep_ep.ops.Handle, got {type(handle).__name__}")
    return registry.handle_of(handle.token)


def _check_buffer(buffer) -> None:
    if not isinstance(buffer, ElasticBuffer):
        raise TypeError(f"buffer must be a deep_ep.ElasticBuffer, got {type(buffer).__name__}")


def _split(x) -> tuple:
    """``x`` -> ``(data, sf)``; FP8 data must not require grad (FP8 dispatch is forward only)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (fp8 data, scale factors), got {len(x)} items")
        data, sf = x
        if isinstance(data, Tensor) and data.requires_grad and torch.is_grad_enabled():
            raise ValueError("deep_ep.ops.dispatch: FP8 dispatch is forward only, and the FP8 data requires "
                             "grad: quantize under torch.no_grad() (or .detach() the data) for inference-style "
                             "use, or dispatch bf16 to train through the dispatch")
        return data, sf
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a bf16 tensor or an FP8 tuple (data, scale factors), got {type(x).__name__}")
    if x.dtype == _FP8:
        raise TypeError("FP8 x must be given as a tuple (data, scale factors)")
    # an operator in a model's graph takes what the layer before made (a transposed matmul's output):
    # a dense copy where needed, which autograd follows (ElasticBuffer, DeepEP's API, refuses instead)
    return x.contiguous(), None


def _check_stats(stats, num_local_experts: int) -> None:
    # the operators leave the counting to the caller's tensor (an in-place add the compiler sees),
    # so the buffer never gets to check it
    if stats is not None and (not isinstance(stats, Tensor) or stats.dtype != torch.int32
                              or tuple(stats.shape) != (num_local_experts,)):
        raise TypeError(f"cumulative_local_expert_recv_stats must be an int32 tensor [{num_local_experts}] "
                        f"(one count per local expert)")


def _check_weights_grad(buffer, do_expand: bool, topk_weights) -> None:
    if do_expand and not buffer.allow_multiple_reduction and topk_weights is not None \
            and topk_weights.requires_grad and torch.is_grad_enabled():
        raise ValueError("the gradient of expanded dispatch weights is a combine's weight reduction, which needs "
                         "a buffer with allow_multiple_reduction=True (the default)")


def dispatch(buffer: ElasticBuffer, x: Union[Tensor, tuple], topk_idx: Optional[Tensor] = None,
             topk_weights: Optional[Tensor] = None, *, num_experts: Optional[int] = None,
             num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
             num_sms: int = 0, handle: Optional[Handle] = None, do_cpu_sync: Optional[bool] = None,
             do_expand: bool = False, use_tma_aligned_col_major_sf: bool = False,
             cumulative_local_expert_recv_stats: Optional[Tensor] = None):
    """Differentiable `ElasticBuffer.dispatch` (collective; arguments and layouts as there).

    Args:
        buffer: the `ElasticBuffer` (its group's ranks all call this together).
        x: bf16 ``[T, H]`` (differentiable; copied to a dense tensor if it is not one), or an FP8
            tuple ``(float8_e4m3fn [T, H], sf)``, forward only: its data must not require grad.
        topk_idx: int64 ``[T, K]`` global expert ids or -1; None with ``handle``.
        topk_weights: optional float32 ``[T, K]`` (differentiable).
        num_experts: E (required without ``handle``). num_max_tokens_per_rank: M (default: the
            buffer's). expert_alignment: A (default 1). num_sms: SMs on the GPU (0: automatic).
        handle: a `Handle` of this buffer's: a cached dispatch in its layout (no routing inputs).
        do_cpu_sync: size the outputs exactly (default True; False: the worst case, no host sync;
            always False with ``handle``).
        do_expand: the expanded layout. use_tma_aligned_col_major_sf: FP8 scale-factor layout.
        cumulative_local_expert_recv_stats: optional int32 ``[L]``, incremented in place by the
            received (unaligned) pairs per local expert.

    Returns:
        ``(recv_x, recv_topk_idx, recv_topk_weights, handle)`` as `ElasticBuffer.dispatch` returns
        them less the event, with ``handle`` a `Handle`. Rows that hold no data (expanded padding,
        rows past the true count) are zero (DeepEP leaves rows past the count unspecified).

    Raises:
        TypeError, ValueError: bad arguments (those of `ElasticBuffer.dispatch`, raised by it before
        any communication; here: FP8 data that requires grad, a ``handle`` of another buffer,
        expanded weights that require grad on a buffer without multiple reduction,
        ``do_cpu_sync=False`` without ``num_max_tokens_per_rank``, stats that are not int32 ``[L]``).
        RuntimeError: as `ElasticBuffer.dispatch`.
    """
    _check_buffer(buffer)
    data, sf = _split(x)
    if handle is not None:
        return _cached_dispatch(buffer, data, sf, topk_idx, topk_weights, handle, num_experts,
                                num_max_tokens_per_rank, expert_alignment, num_sms, do_cpu_sync, do_expand,
                                use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats)
    if topk_idx is None or num_experts is None:
        raise ValueError("topk_idx and num_experts are required unless a handle is given")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise TypeError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_max_tokens_per_rank is None:
        num_max_tokens_per_rank = buffer.config.num_max_tokens_per_rank
    expert_alignment = 1 if expert_alignment is None else expert_alignment
    do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
    if not do_cpu_sync and not num_max_tokens_per_rank:
        raise ValueError("do_cpu_sync=False sizes outputs for the worst case and needs num_max_tokens_per_rank "
                         "(> 0), in the buffer or in this call")
    _check_weights_grad(buffer, do_expand, topk_weights)
    _check_stats(cumulative_local_expert_recv_stats, num_experts // buffer.num_ranks)
    recv_data, recv_sf, recv_idx, recv_w, token, psum, counts = dispatch_op(
        buffer.buffer_id, data, sf, topk_idx, topk_weights, buffer.num_ranks, num_experts, num_max_tokens_per_rank,
        expert_alignment, num_sms, do_cpu_sync, do_expand, use_tma_aligned_col_major_sf)
    recv_w = recv_w if topk_weights is not None else None
    out_handle = Handle(token, buffer.buffer_id, do_expand, num_experts, expert_alignment, topk_idx.shape[1],
                        data.shape[1], data.shape[0], recv_data.shape[0], psum, counts,
                        recv_w if do_expand else None)
    if cumulative_local_expert_recv_stats is not None:
        cumulative_local_expert_recv_stats.add_(counts)
    return ((recv_data, recv_sf) if sf is not None else recv_data, None if do_expand else recv_idx, recv_w,
            out_handle)


def _cached_dispatch(buffer, data, sf, topk_idx, topk_weights, handle, num_experts, num_max_tokens_per_rank,
                     expert_alignment, num_sms, do_cpu_sync, do_expand, col_major, stats):
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be the deep_ep.ops.Handle dispatch returned, got {type(handle).__name__}")
    if handle.buffer_id != buffer.buffer_id:
        raise ValueError(f"handle was made by ElasticBuffer #{handle.buffer_id}, but is used with "
                         f"ElasticBuffer #{buffer.buffer_id}")
    if topk_idx is not None:
        raise ValueError("a cached dispatch (handle given) takes no topk_idx: the routing is the handle's")
    if do_cpu_sync:
        raise ValueError("do_cpu_sync=True cannot be used with a handle: a cached dispatch never synchronises")
    for name, given, own in (("num_experts", num_experts, handle.num_experts),
                             ("expert_alignment", expert_alignment, handle.expert_alignment)):
        if given is not None and given != own:
            raise ValueError(f"{name}={given} does not match the handle's {name}={own}")
    if do_expand and not handle.do_expand:
        raise ValueError("do_expand=True, but the handle was made by a non-expanded dispatch")
    _check_weights_grad(buffer, handle.do_expand, topk_weights)
    _check_stats(stats, handle.num_experts // buffer.num_ranks)
    recv_data, recv_sf, recv_idx, recv_w = cached_dispatch_op(
        buffer.buffer_id, handle.token, data, sf, topk_weights, handle.num_recv_rows, handle.num_topk, num_sms,
        handle.do_expand, col_major)
    if stats is not None:
        stats.add_(handle.num_unaligned_recv_tokens_per_expert)
    return ((recv_data, recv_sf) if sf is not None else recv_data, None if handle.do_expand else recv_idx,
            recv_w if topk_weights is not None else None, handle)


def combine(buffer: ElasticBuffer, x: Tensor, handle: Handle, topk_weights: Optional[Tensor] = None, bias=None, *,
            num_sms: int = 0, apply_dispatch_weights: bool = False):
    """Differentiable `ElasticBuffer.combine` (collective): the rows of every token summed in
    float32 (with the biases), rounded once to bf16; weights reduced back.

    Args:
        buffer: the `ElasticBuffer` of the dispatch.
        x: bf16 ``[handle.num_recv_rows, H]`` in the dispatch's layout (differentiable; copied to a
            dense tensor if it is not one; rows without data are never read and get zero gradient).
        handle: the `Handle` `dispatch` returned on this rank.
        topk_weights: optional float32 ``[rows, K]`` (expanded: ``[rows]``), reduced back
            (differentiable).
        bias: None, a bf16 ``[T, H]`` tensor, or a tuple of two (differentiable).
        num_sms: SMs (0: the dispatch's).
        apply_dispatch_weights: multiply every row by its dispatch weight before the sum (expanded
            handles whose dispatch had weights); the gradient reaches those weights too.

    Returns:
        ``(combined_x bf16 [T, H], combined_topk_weights float32 [T, K] or None)``.

    Raises:
        TypeError, ValueError: bad arguments (here: a ``handle`` that is not this buffer's `Handle`,
        ``apply_dispatch_weights`` without dispatch weights; the rest by `ElasticBuffer.combine`,
        before any communication). RuntimeError: as `ElasticBuffer.combine`.
    """
    _check_buffer(buffer)
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be the deep_ep.ops.Handle dispatch returned, got {type(handle).__name__}")
    if handle.buffer_id != buffer.buffer_id:
        raise ValueError(f"handle was made by ElasticBuffer #{handle.buffer_id}, but is used with "
                         f"ElasticBuffer #{buffer.buffer_id}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a bf16 tensor, got {type(x).__name__}")
    x = x.contiguous()   # as dispatch's x (`_split`)
    if bias is None or isinstance(bias, Tensor):
        biases = (bias, None)
    elif isinstance(bias, (tuple, list)) and len(bias) <= 2:
        biases = (tuple(bias) + (None, None))[:2]
    else:
        raise TypeError("bias must be None, a tensor or a tuple of up to two tensors")
    dispatch_weights = None
    if apply_dispatch_weights:
        if not handle.do_expand or handle.recv_topk_weights is None:
            raise ValueError("apply_dispatch_weights=True needs the handle of an expanded dispatch that had "
                             "topk_weights")
        dispatch_weights = handle.recv_topk_weights
    if topk_weights is not None:
        _check_weights_grad(buffer, handle.do_expand, topk_weights)
    combined_x, combined_w = combine_op(buffer.buffer_id, handle.token, x, topk_weights, biases[0], biases[1],
                                        dispatch_weights, handle.num_tokens, handle.num_topk, num_sms,
                                        handle.do_expand)
    return combined_x, combined_w if topk_weights is not None else None
