"""Autograd formulas of the custom operators (`register` installs them; `deep_ep.ops` calls it).

Dispatch copies rows and weights; combine sums rows (in float32, rounded once to bf16) and copies
weights back. The formulas follow (docs/training.md derives them):

* dispatch (fresh or cached), ``recv_x`` -> ``x``: the gradient of a token is the sum of the
  gradients of its copies: a **combine** of the received rows' gradients;
* dispatch, ``recv_topk_weights`` -> ``topk_weights``: slot ``k`` of a token is received by one rank
  only, so its gradient is that rank's: combine's **weight reduction** of their gradients;
* combine, ``combined_x`` -> ``x``: every row of a token gets the token's gradient: a **cached
  dispatch** of the output gradient (rows without data get zero);
* combine, ``combined_topk_weights`` -> ``topk_weights``: a cached dispatch with the gradient as its
  weights; ``bias`` -> the output gradient itself;
* combine with ``dispatch_weights`` (``apply_dispatch_weights``): the row ``r`` entered the sum as
  ``w_r * x_r``, so ``x_r`` gets ``w_r * g_r`` and ``w_r`` gets ``sum_h x_r * g_r``, ``g_r`` the
  row's share of the output gradient (a cached dispatch of it).

Backward passes communicate, so every rank must run the same ones: which inputs need a gradient
is a property of the model, the same on every rank, and a gradient that did not arrive (an output
nobody used) is sent as zeros rather than skipped.
"""
from __future__ import annotations

import torch

from .library import cached_dispatch_op, combine_op

__all__ = ["register"]

_BF16 = torch.bfloat16


def _rows_grad(grad, rows, hidden, device):
    if grad is None:
        return torch.zeros((rows, hidden), dtype=_BF16, device=device)
    return grad.to(_BF16).contiguous()


def _weights_grad(grad, shape, device):
    if grad is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return grad.float().contiguous()


# ---------------------------------------------------------------------------------------------- dispatch
def _save_dispatch(ctx, *, buffer_id, token, x, num_topk, num_sms, do_expand, rows_like, weights_like):
    ctx.save_for_backward(token)
    ctx.buffer_id, ctx.num_topk, ctx.num_sms, ctx.do_expand = buffer_id, num_topk, num_sms, do_expand
    ctx.num_tokens, ctx.hidden, ctx.device = x.shape[0], x.shape[1], x.device
    ctx.rows = rows_like.shape[0]
    ctx.weights_shape = tuple(weights_like.shape)
    ctx.set_materialize_grads(False)


def _dispatch_backward(ctx, grad_recv_x, grad_recv_w, x_index: int, w_index: int, num_inputs: int):
    """Gradients of a dispatch's ``x`` and ``topk_weights`` (positions in the op's inputs)."""
    grads = [None] * num_inputs
    need_x = ctx.needs_input_grad[x_index]
    need_w = w_index is not None and ctx.needs_input_grad[w_index]
    if not (need_x or need_w):
        return tuple(grads)
    token, = ctx.saved_tensors
    rows = _rows_grad(grad_recv_x, ctx.rows, ctx.hidden, ctx.device)
    weights = _weights_grad(grad_recv_w, ctx.weights_shape, ctx.device) if need_w else None
    grad_x, grad_w = combine_op(ctx.buffer_id, token, rows, weights, None, None, None, ctx.num_tokens, ctx.num_topk,
                                ctx.num_sms, ctx.do_expand)
    if need_x:
        grads[x_index] = grad_x
    if need_w:
        grads[w_index] = grad_w
    return tuple(grads)


def _dispatch_setup(ctx, inputs, output):
    (buffer_id, x, sf, topk_idx, _topk_weights, _ranks, _experts, _max_tokens, _alignment, num_sms, _sync,
     do_expand, _col_major) = inputs
    recv_data, recv_sf, recv_idx, recv_w, token, psum, counts = output
    ctx.mark_non_differentiable(recv_sf, recv_idx, token, psum, counts)
    if sf is not None:   # FP8 data: forward only (the functional API refuses FP8 data that requires grad)
        ctx.mark_non_differentiable(recv_data)
    _save_dispatch(ctx, buffer_id=buffer_id, token=token, x=x, num_topk=topk_idx.shape[1], num_sms=num_sms,
                   do_expand=do_expand, rows_like=recv_data, weights_like=recv_w)


def _dispatch_grad(ctx, grad_recv_x, _grad_sf, _grad_idx, grad_recv_w, _grad_token, _grad_psum, _grad_counts):
    return _dispatch_backward(ctx, grad_recv_x, grad_recv_w, x_index=1, w_index=4, num_inputs=13)


def _cached_setup(ctx, inputs, output):
    buffer_id, token, x, sf, _topk_weights, _rows, num_topk, num_sms, do_expand, _col_major = inputs
    recv_data, recv_sf, recv_idx, recv_w = output
    ctx.mark_non_differentiable(recv_sf, recv_idx)
    if sf is not None:
        ctx.mark_non_differentiable(recv_data)
    _save_dispatch(ctx, buffer_id=buffer_id, token=token, x=x, num_topk=num_topk, num_sms=num_sms,
                   do_expand=do_expand, rows_like=recv_data, weights_like=recv_w)


def _cached_grad(ctx, grad_recv_x, _grad_sf, _grad_idx, grad_recv_w):
    return _dispatch_backward(ctx, grad_recv_x, grad_recv_w, x_index=2, w_index=4, num_inputs=10)


# ---------------------------------------------------------------------------------------------- combine
def _combine_setup(ctx, inputs, output):
    (buffer_id, token, x, topk_weights, _bias_0, _bias_1, dispatch_weights, num_tokens, num_topk, num_sms,
     do_expand) = inputs
    combined_x, combined_w = output
    if topk_weights is None:
        ctx.mark_non_differentiable(combined_w)
    if dispatch_weights is not None:
        ctx.save_for_backward(token, x, dispatch_weights)
    else:
        ctx.save_for_backward(token)
    ctx.buffer_id, ctx.num_topk, ctx.num_sms = buffer_id, num_topk, num_sms
    ctx.rows, ctx.hidden, ctx.device = x.shape[0], x.shape[1], x.device
    ctx.num_tokens, ctx.do_expand = num_tokens, do_expand
    ctx.has_dispatch_weights = dispatch_weights is not None
    ctx.set_materialize_grads(False)


def _combine_grad(ctx, grad_out, grad_combined_w):
    grads = [None] * 11
    need_x, need_w, need_b0, need_b1, need_dw = (ctx.needs_input_grad[i] for i in (2, 3, 4, 5, 6))
    if not any((need_x, need_w, need_b0, need_b1, need_dw)):
        return tuple(grads)
    saved = ctx.saved_tensors
    token = saved[0]
    g = _rows_grad(grad_out, ctx.num_tokens, ctx.hidden, ctx.device)
    if need_b0:
        grads[4] = g
    if need_b1:
        grads[5] = g.clone() if need_b0 else g    # two inputs, two gradient tensors
    if need_x or need_w or need_dw:
        weights = _weights_grad(grad_combined_w, (ctx.num_tokens, ctx.num_topk), ctx.device) if need_w else None
        g_rows, _, _, g_w = cached_dispatch_op(ctx.buffer_id, token, g, None, weights, ctx.rows, ctx.num_topk,
                                               ctx.num_sms, ctx.do_expand, False)
        if ctx.has_dispatch_weights:
            x, dispatch_weights = saved[1], saved[2]
            g32 = g_rows.float()
            if need_x:
                grads[2] = (g32 * dispatch_weights.unsqueeze(1)).to(_BF16)
            if need_dw:
                grads[6] = (x.float() * g32).sum(1)
        elif need_x:
            grads[2] = g_rows
        if need_w:
            grads[3] = g_w
    return tuple(grads)


_registered = False


def register() -> None:
    """Install the formulas on the three operators (once per process)."""
    global _registered
    if _registered:
        return
    torch.library.register_autograd("deep_ep::dispatch", _dispatch_grad, setup_context=_dispatch_setup)
    torch.library.register_autograd("deep_ep::cached_dispatch", _cached_grad, setup_context=_cached_setup)
    torch.library.register_autograd("deep_ep::combine", _combine_grad, setup_context=_combine_setup)
    _registered = True
