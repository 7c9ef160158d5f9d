"""Dedicated CUDA streams.

`torch.cuda.Stream()` hands out streams from a fixed pool (32 per priority, round-robin), so two
"new" streams can be the same CUDA stream. A communication stream must never be shared: a kernel
that spins waiting for peers would block whatever else was queued on it (with emulated ranks, a
peer's own compute work, which it needs to make progress: a deadlock). These streams are created
with the CUDA runtime, non-blocking with respect to the legacy default stream, and wrapped for torch.
"""
from __future__ import annotations

import torch

__all__ = ["new_stream", "destroy_stream"]


def new_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A fresh non-blocking CUDA stream on ``device``, owned by the caller (see `destroy_stream`).

    Raises:
        RuntimeError: the CUDA runtime refused to create it.
    """
    from cuda.bindings import runtime as cudart

    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # make sure torch initialised this device's context
        err, handle = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
    if int(err) != 0:
        raise RuntimeError(f"cudaStreamCreateWithFlags on {device} failed: {err}")
    return torch.cuda.ExternalStream(int(handle), device=device)


def destroy_stream(stream: torch.cuda.ExternalStream) -> None:
    """Wait for ``stream`` and destroy it (it must come from `new_stream`)."""
    from cuda.bindings import runtime as cudart

    stream.synchronize()
    cudart.cudaStreamDestroy(stream.cuda_stream)
