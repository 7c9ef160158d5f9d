"""Dispatch and combine as differentiable PyTorch operators (training; docs/training.md).

``deep_ep.ops.dispatch(buffer, x, topk_idx, topk_weights, num_experts=E)`` and
``deep_ep.ops.combine(buffer, y, handle)`` return what `ElasticBuffer.dispatch` / `combine` return
(less the event) with the handle as a `Handle` (a tuple of tensors and numbers), and autograd flows
through them: a dispatch's backward is a combine, a combine's backward is a cached dispatch. They
run on every backend (CPU over gloo, GPU, emulated ranks) and ``torch.compile(fullgraph=True)``
traces them without a graph break.

Underneath are three custom operators, ``torch.ops.deep_ep.dispatch``, ``cached_dispatch`` and
``combine`` (`deep_ep.ops.library`), with fake implementations for the compiler and the autograd
formulas of `deep_ep.ops.autograd`; `deep_ep.ops.registry` says how the buffer and the handle reach
them.
"""
from .functional import Handle, combine, dispatch, ep_handle
from .registry import num_live_handles

__all__ = ["Handle", "dispatch", "combine", "ep_handle", "num_live_handles"]
