"""Host side of combine on the GPU backend: one kernel, ``modules.COMBINE_KERNEL`` (each destination
stages the rows that came from peers in its own window and signals; each source then pulls and sums
its tokens' rows), launched through the handle's prepared launch.
"""
from __future__ import annotations

import torch

from .. import outputs
from .abi import CombineArgs, call_tag
from .dispatch import _ptr
from . import modules
from . import window as wl
from .state import GPUHandleState

__all__ = ["run_combine"]


def run_combine(b, x, handle, topk_weights, bias, *, num_sms, apply_dispatch_weights=False):
    """`Backend.combine` on the GPU backend ``b`` (see `deep_ep.backends.base`)."""
    state = handle.backend_state
    if not isinstance(state, GPUHandleState):
        raise ValueError("the handle was not made by a GPU dispatch (it has no GPU layout state)")
    has_weights = topk_weights is not None
    options = ("combine", num_sms, bool(apply_dispatch_weights), has_weights)
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
            launch = state.launches[key] = _prepare(b, handle, num_sms, apply_dispatch_weights, has_weights)
        T = handle.num_tokens
        entry = memo[options] = launch + ((T, handle.hidden), (T, handle.num_topk), launch[0].args[0].tag, guard)
    prepared, n_sms, out_shape, w_shape, tag, _ = entry
    b.raise_if_broken()
    dev, fill = b.device, b.fill_stream
    out = outputs.empty(out_shape, torch.bfloat16, dev, fill)
    out_w = outputs.empty(w_shape, torch.float32, dev, fill) if has_weights else None
    a = prepared.args[0]  # the per-call pointers (`_ptr` written out for the tensors always given)
    a.y, a.weights_in, a.out, a.out_weights = x.data_ptr() or None, _ptr(topk_weights), out.data_ptr() or None, \
        _ptr(out_w)
    if bias:
        a.bias0, a.bias1 = _ptr(bias[0]), (_ptr(bias[1]) if len(bias) > 1 else None)
    else:
        a.bias0 = a.bias1 = None
    tag.seq = b.calls & 0xFFFFFFFF   # a view into the arguments (memo)
    b.launch_data(prepared, n_sms)
    return out, out_w


def _prepare(b, handle, num_sms, apply_dispatch_weights, has_weights) -> tuple:
    """The handle's prepared combine launch for this key, every argument but the per-call pointers
    and the call number set; returns ``(launch, SMs)``."""
    if handle.do_expand and not b.config.allow_multiple_reduction:
        raise NotImplementedError(
            "combine of an expanded handle with allow_multiple_reduction=False (one reduction of every "
            "(token, expert) row at the source) is not implemented on the GPU yet: create the buffer with "
            "allow_multiple_reduction=True (the default), or use the CPU backend")
    state = handle.backend_state
    T, H, K, E = handle.num_tokens, handle.hidden, handle.num_topk, handle.num_experts
    layout = b.layout(wl.combine_row_stride(H, b.config.num_topk))
    n_sms = b.num_sms(num_sms, E, K)
    mod = b.module("combine", (H, K, bool(handle.do_expand)))
    tag = call_tag(0, 3, H, K, int(bool(handle.do_expand)), E, has_weights, int(bool(apply_dispatch_weights)))
    args = CombineArgs(
        recv_weights=_ptr(handle.recv_topk_weights),
        src_meta=state.src_meta_ptr, layout=state.layout_ptr, pos_tok=state.pos_tok_ptr,
        pos_pair=state.pos_pair_ptr, topk_idx=_ptr(handle.topk_idx), num_tokens=T,
        num_experts=E, apply_weights=int(bool(apply_dispatch_weights)),
        recv_offset=layout.recv_offset, half_bytes=layout.half_bytes, row_stride=layout.row_stride,
        timeout_ns=b.timeout_ns, err_host=b.err_record.device_ptr, tag=tag)
    prepared = mod.function(modules.COMBINE_KERNEL).prepare(
        n_sms, modules.THREADS, (args, b.transport_args), device=b.device.index, cooperative=b.cooperative)
    return prepared, n_sms
