"""The custom operators (``torch.ops.deep_ep.*``): dispatch, cached dispatch and combine, each with a
real implementation (an `ElasticBuffer` call) and a fake one (shapes only, for ``torch.compile``).

Operators take and return tensors and numbers only (`deep_ep.ops.registry` says how the buffer and
the handle travel). An output that does not exist in a mode (the scale factors of a BF16 dispatch,
the indices of the expanded layout, weights when none were given) is an empty placeholder; the
functional API (`deep_ep.ops.functional`) turns it back into ``None`` from the flags, which are
constants of the graph.

Received rows: after a dispatch that synchronised with the host the row count is data-dependent
(the fake implementation gives it as a new unbacked size); without that synchronisation, the
worst case of docs/design.md (``do_cpu_sync=False``); a cached dispatch has its handle's count,
passed in as ``num_rows``. Every received row that holds no data (expanded padding rows, rows past
the true count) is zero, so expert outputs and gradients computed from it stay finite.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import shapes
from . import registry

__all__ = ["dispatch_op", "cached_dispatch_op", "combine_op", "recv_shape_rows", "prepare_backward_modules"]


def _placeholder(dtype: torch.dtype, device) -> Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def _own(t: Tensor, handle) -> Tensor:
    """``t``, or a copy if the handle holds the same memory (operator outputs belong to the caller)."""
    if t.numel() == 0:
        return t
    ptr = t.untyped_storage().data_ptr()
    if any(h.numel() and h.untyped_storage().data_ptr() == ptr for h in registry.handle_tensors(handle)):
        return t.clone()
    return t


def _zero_rows_without_data(handle, data: Tensor, sf: Optional[Tensor]) -> None:
    """Zero the received rows past the true count (a dispatch without a host sync leaves them
    unspecified); expanded padding rows are zeroed by the dispatch itself (``do_zero_padding``).
    Tensor operations only: no host synchronisation."""
    if handle.do_cpu_sync or data.shape[0] == 0:
        return
    if handle.do_expand:
        aligned = shapes.align_up(handle.num_unaligned_recv_tokens_per_expert.to(torch.int64),
                                  handle.expert_alignment)
        valid = aligned.sum()
    else:
        valid = handle.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)
    empty = torch.arange(data.shape[0], device=data.device) >= valid
    data.view(torch.uint8).masked_fill_(empty.unsqueeze(1), 0)
    if sf is not None:
        sf.masked_fill_(empty.unsqueeze(1), 0)


def _outputs(handle, recv_x, recv_idx, recv_w, device):
    data, sf = shapes.split_x(recv_x)
    _zero_rows_without_data(handle, data, sf)
    return (_own(data, handle),
            _own(sf, handle) if sf is not None else _placeholder(torch.float32, device),
            _own(recv_idx, handle) if recv_idx is not None else _placeholder(torch.int64, device),
            _own(recv_w, handle) if recv_w is not None else _placeholder(torch.float32, device))


def prepare_backward_modules(buf, hidden: int, num_topk: int, do_expand: bool) -> None:
    """Emulated ranks: load now the kernel modules a backward pass will need (a combine, a BF16
    cached dispatch of this structure).

    Emulated ranks load a module collectively, at a host barrier every rank thread reaches (see
    `deep_ep.emulated`). Autograd runs the backward of CUDA tensors in one engine thread per device,
    for every rank in turn, so a first load there would wait at that barrier for ranks whose backward
    is queued behind it. The forward runs in the ranks' own threads and calls this at the same point
    on every rank; once a module is loaded this is a lookup. A no-op for other backends."""
    backend = getattr(buf, "_backend", None)
    if not getattr(backend, "emulated", False) or not hasattr(backend, "module"):
        return
    from ..backends.gpu.modules import combine_layout
    hybrid = bool(getattr(backend, "hybrid_node_ranks", 0))
    backend.module("combine", (hidden, num_topk, combine_layout(do_expand, backend.config.allow_multiple_reduction,
                                                                hybrid=hybrid)))
    backend.module("dispatch", (2 * hidden, 0, num_topk, bool(do_expand)))


def recv_shape_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_experts: int,
                    expert_alignment: int, do_expand: bool) -> int:
    """Rows of a dispatch without host synchronisation (the worst case of docs/design.md)."""
    return shapes.worst_case_recv_rows(num_ranks, num_max_tokens_per_rank, num_topk, num_experts // num_ranks,
                                       expert_alignment, do_expand)


def _fake_recv(rows, x: Tensor, sf: Optional[Tensor], num_topk: int, has_weights: bool, do_expand: bool,
               col_major_sf: bool):
    device = x.device
    data = x.new_empty((rows, x.shape[1]))
    if sf is None:
        recv_sf = _placeholder(torch.float32, device)
    elif col_major_sf:
        recv_sf = torch.empty_strided((rows, sf.shape[1]), (1, shapes.align_up(rows, 4)), dtype=sf.dtype,
                                      device=device)
    else:
        recv_sf = sf.new_empty((rows, sf.shape[1]))
    idx = _placeholder(torch.int64, device) if do_expand else torch.empty((rows, num_topk), dtype=torch.int64,
                                                                           device=device)
    if not has_weights:
        w = _placeholder(torch.float32, device)
    else:
        w = torch.empty((rows,) if do_expand else (rows, num_topk), dtype=torch.float32, device=device)
    return data, recv_sf, idx, w


# ---------------------------------------------------------------------------------------------- dispatch
@torch.library.custom_op("deep_ep::dispatch", mutates_args=())
def dispatch_op(buffer_id: int, x: Tensor, sf: Optional[Tensor], topk_idx: Tensor, topk_weights: Optional[Tensor],
                num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, expert_alignment: int,
                num_sms: int, do_cpu_sync: bool, do_expand: bool, use_tma_aligned_col_major_sf: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A fresh dispatch. Returns ``(recv_data, recv_sf, recv_topk_idx, recv_topk_weights, token,
    psum_num_recv_tokens_per_expert, num_unaligned_recv_tokens_per_expert)`` (placeholders where a
    mode has no such output; the last two int32 ``[L]`` on the buffer's device, copies of the handle's)."""
    buf = registry.find_buffer(buffer_id)
    prepare_backward_modules(buf, x.shape[1], topk_idx.shape[1], do_expand)
    # Options at their defaults are passed as such (the buffer's M, alignment 1; zero padding only
    # matters in the expanded layout, the only one with padding rows): the call then shares its
    # checked signature with the buffer's direct calls (`deep_ep.call_plans`), with the same result.
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
        x if sf is None else (x, sf), topk_idx, topk_weights, num_experts=num_experts,
        num_max_tokens_per_rank=None if num_max_tokens_per_rank in (0, buf.config.num_max_tokens_per_rank)
        else num_max_tokens_per_rank, expert_alignment=None if expert_alignment == 1 else expert_alignment,
        num_sms=num_sms, do_cpu_sync=do_cpu_sync, do_expand=do_expand, do_zero_padding=do_expand,
        use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf)
    outs = _outputs(handle, recv_x, recv_idx, recv_w, x.device)
    return (*outs, registry.new_token(handle), handle.psum_num_recv_tokens_per_expert.clone(),
            handle.num_unaligned_recv_tokens_per_expert.clone())


@dispatch_op.register_fake
def _dispatch_fake(buffer_id, x, sf, topk_idx, topk_weights, num_ranks, num_experts, num_max_tokens_per_rank,
                   expert_alignment, num_sms, do_cpu_sync, do_expand, use_tma_aligned_col_major_sf):
    K = topk_idx.shape[1]
    worst = recv_shape_rows(num_ranks, num_max_tokens_per_rank, K, num_experts, expert_alignment, do_expand) \
        if num_max_tokens_per_rank else None
    if do_cpu_sync:
        # the bound helps the compiler's reasoning, when the sizes are plain ints
        rows = torch.library.get_ctx().new_dynamic_size(min=0, max=worst if isinstance(worst, int) else None)
    else:
        rows = worst
    outs = _fake_recv(rows, x, sf, K, topk_weights is not None, do_expand, use_tma_aligned_col_major_sf)
    L = num_experts // num_ranks
    counts = [torch.empty(L, dtype=torch.int32, device=x.device) for _ in range(2)]
    return (*outs, torch.empty(1, dtype=torch.int64, device="cpu"), *counts)


# ---------------------------------------------------------------------------------------------- cached dispatch
@torch.library.custom_op("deep_ep::cached_dispatch", mutates_args=())
def cached_dispatch_op(buffer_id: int, token: Tensor, x: Tensor, sf: Optional[Tensor],
                       topk_weights: Optional[Tensor], num_rows: int, num_topk: int, num_sms: int, do_expand: bool,
                       use_tma_aligned_col_major_sf: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A dispatch in the layout of the handle ``token`` names (``num_rows`` its receive rows).
    Returns ``(recv_data, recv_sf, recv_topk_idx, recv_topk_weights)`` (placeholders as in
    `dispatch_op`)."""
    buf = registry.find_buffer(buffer_id)
    handle = registry.handle_of(token)
    recv_x, recv_idx, recv_w, _, _ = buf.dispatch(
        x if sf is None else (x, sf), None, topk_weights, num_sms=num_sms, handle=handle,
        do_zero_padding=bool(handle.do_expand), use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf)
    return _outputs(handle, recv_x, recv_idx, recv_w, x.device)


@cached_dispatch_op.register_fake
def _cached_dispatch_fake(buffer_id, token, x, sf, topk_weights, num_rows, num_topk, num_sms, do_expand,
                          use_tma_aligned_col_major_sf):
    return _fake_recv(num_rows, x, sf, num_topk, topk_weights is not None, do_expand, use_tma_aligned_col_major_sf)


# ---------------------------------------------------------------------------------------------- combine
@torch.library.custom_op("deep_ep::combine", mutates_args=())
def combine_op(buffer_id: int, token: Tensor, x: Tensor, topk_weights: Optional[Tensor], bias_0: Optional[Tensor],
               bias_1: Optional[Tensor], dispatch_weights: Optional[Tensor], num_tokens: int, num_topk: int,
               num_sms: int, do_expand: bool) -> tuple[Tensor, Tensor]:
    """Combine through the handle ``token`` names. ``dispatch_weights`` given (the expanded
    dispatch's received weights) means ``apply_dispatch_weights=True``; the kernels read the
    handle's copy of them, the tensor is there for autograd. Returns ``(combined_x,
    combined_topk_weights)`` (the latter a placeholder without ``topk_weights``). ``do_expand`` is
    the handle's layout (the backward's cached dispatch needs it for its shapes)."""
    buf = registry.find_buffer(buffer_id)
    handle = registry.handle_of(token)
    bias = None if bias_0 is None and bias_1 is None else (bias_0, bias_1)   # None: a combine without bias's signature
    combined_x, combined_w, _ = buf.combine(x, handle, topk_weights, bias, num_sms=num_sms,
                                            apply_dispatch_weights=dispatch_weights is not None)
    return combined_x, combined_w if combined_w is not None else _placeholder(torch.float32, x.device)


@combine_op.register_fake
def _combine_fake(buffer_id, token, x, topk_weights, bias_0, bias_1, dispatch_weights, num_tokens, num_topk, num_sms,
                  do_expand):
    out = x.new_empty((num_tokens, x.shape[1]))
    if topk_weights is None:
        return out, _placeholder(torch.float32, x.device)
    return out, torch.empty((num_tokens, num_topk), dtype=torch.float32, device=x.device)
