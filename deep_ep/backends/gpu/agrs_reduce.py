"""The sum a reduce-scatter's handle makes of the chunks it received (`deep_ep.backends.gpu.agrs`): per
element, the float32 sum of the R chunks in rank order (0, 1, ..., R-1), each addition rounded to
float32, divided by R with ``average`` (a true division), rounded once to the output dtype. That is the
CPU backend's formula; `reduce_torch` states it in torch ops (the specification, and the path off
CUDA), and on a CUDA device one NVRTC kernel (``include/deep_ep/kernels/agrs_reduce.cuh``) computes
the same bits in one pass.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ... import jit
from .abi import _read_constants

__all__ = ["KERNEL_NAME", "reduce", "reduce_torch", "load_kernel"]

KERNEL_NAME = "deep_ep_agrs_reduce"
# the kernel's own constants, read from its header (one source for host and device)
_CONSTANTS = _read_constants(Path(__file__).resolve().parents[2] / "include" / "deep_ep" / "impls" /
                             "agrs_reduce.cuh")
_THREADS = _CONSTANTS["kAgrsReduceThreads"]
_VECTOR_BYTES = _CONSTANTS["kAgrsReduceVectorBytes"]
_MAX_BLOCKS = 4096
_DTYPES = (torch.bfloat16, torch.float32)
_kernel = jit.LazyKernel("deep_ep_agrs_reduce", "deep_ep/kernels/agrs_reduce.cuh", KERNEL_NAME)


def load_kernel(device: torch.device) -> None:
    """Build (once per process) and load the kernel on a CUDA ``device`` now, not at a handle's first
    wait; nothing on other devices or during a CUDA-graph capture."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        _kernel().handle(device.index)


def reduce_torch(received: torch.Tensor, average: bool, out: torch.Tensor) -> torch.Tensor:
    """The specification, in torch ops (any device); arguments as `reduce`."""
    num_ranks = received.shape[0]
    total = received[0].to(torch.float32, copy=True)
    for rank in range(1, num_ranks):   # rank order: the same bits on every run and backend
        total.add_(received[rank])
    if average:
        # a tensor divisor: a true division on every device (a host scalar on CUDA becomes a reciprocal)
        total.div_(torch.full((), float(num_ranks), dtype=torch.float32, device=total.device))
    return out.copy_(total)


def reduce(received: torch.Tensor, average: bool, out: torch.Tensor) -> torch.Tensor:
    """Write the sum of the received chunks into ``out`` and return it, on the current stream.

    Args:
        received: ``[R, *shape]`` bf16 or float32, contiguous: chunk ``r`` came from rank ``r``.
        average: divide the float32 sum by R before the final rounding.
        out: ``[*shape]`` contiguous, of ``received``'s dtype and device.

    On a CUDA device one kernel, elsewhere `reduce_torch`; equal bit for bit (a NaN's payload aside).

    Raises:
        TypeError: a dtype other than bf16 and float32, or ``out`` of another dtype.
        ValueError: shapes that do not match, a non-contiguous tensor, tensors on different devices.
    """
    if received.dtype not in _DTYPES or out.dtype != received.dtype:
        raise TypeError(f"deep_ep: agrs reduce: bf16 or float32 chunks and an output of their dtype, got "
                        f"{received.dtype} and {out.dtype}")
    if received.dim() < 1 or received.shape[0] < 1 or tuple(received.shape[1:]) != tuple(out.shape):
        raise ValueError(f"deep_ep: agrs reduce: received {list(received.shape)} must be [R, *out.shape] with out "
                         f"{list(out.shape)}")
    if not received.is_contiguous() or not out.is_contiguous() or received.device != out.device:
        raise ValueError("deep_ep: agrs reduce: received and out must be contiguous and on one device")
    if received.device.type != "cuda":
        return reduce_torch(received, average, out)
    num_ranks, num_elements = received.shape[0], out.numel()
    if num_elements == 0:
        return out
    chunk_bytes = num_elements * out.element_size()
    vector = (chunk_bytes % _VECTOR_BYTES == 0 and received.data_ptr() % _VECTOR_BYTES == 0
              and out.data_ptr() % _VECTOR_BYTES == 0)
    num_items = chunk_bytes // _VECTOR_BYTES if vector else num_elements
    blocks = min((num_items + _THREADS - 1) // _THREADS, _MAX_BLOCKS)
    _kernel().launch(blocks, _THREADS, (received, out, jit.i64(num_elements), num_ranks,
                                        out.dtype == torch.bfloat16, bool(average), vector),
                     stream=torch.cuda.current_stream(out.device), device=out.device.index)
    return out
