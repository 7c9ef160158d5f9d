"""Allocation of the tensors a backend returns, with a test hook that poisons them.

Every output of `dispatch` and `combine` (received rows, scale factors, indices, weights, the handle's
tensors) is allocated here. Under `poisoned` each allocation is filled first with a pattern no
correct result has: bytes ``0xFF`` for floating-point tensors (NaN in bf16, fp32 and e4m3), bytes
``0xA5`` for integer tensors (-1515870811 as int32, never a valid row, count or expert id). A kernel
that leaves an element unwritten then shows up in an element-by-element comparison, whatever memory
torch's caching allocator handed out (an earlier call's correct values included).
"""
from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["empty", "fill_poison", "poisoned", "is_poisoning"]

_lock = threading.Lock()
_joins = threading.local()   # per thread: device index -> StreamJoin (the poison path's stream order)
_depth = 0          # nesting of `poisoned` (process-wide: emulated ranks run in threads)


def is_poisoning() -> bool:
    """Whether allocations are poisoned right now."""
    return _depth > 0


def fill_poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a contiguous tensor with the poison pattern of its dtype (in place; returns it)."""
    if t.numel():
        t.view(torch.uint8).fill_(0xFF if t.dtype.is_floating_point else 0xA5)
    return t


def empty(shape, dtype: torch.dtype, device, stream=None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, poisoned under `poisoned`.

    ``stream``: where the kernels that write the tensor run (the GPU backend's communication
    stream): it waits for the poison fill, which runs on the current stream, so the fill is ordered
    before the kernels and a read on the current stream before them sees poison. (Under `poisoned`
    only: the communication stream then also waits for the caller's work queued before the call.)
    """
    # A tuple's sizes passed as separate arguments: torch parses them about 0.45 us faster than the
    # tuple (docs/performance.md).
    t = torch.empty(*shape, dtype=dtype, device=device) if type(shape) is tuple and shape else \
        torch.empty(shape, dtype=dtype, device=device)
    if _depth:
        # Filled on the current stream, the tensor's own (a reader there before the kernels wrote
        # it sees the poison); the kernels' stream then waits for the fill.
        fill_poison(t)
        if stream is not None:
            current = torch.cuda.current_stream(t.device)
            if stream != current:
                _join(t.device).wait(stream.cuda_stream, current.cuda_stream)
    return t


def _join(device: torch.device):
    """This thread's reused event for ordering the fill before the kernels' stream (created at the
    thread's first poisoned allocation, released with the thread). Not a fresh ``torch.cuda.Event``
    per call: recording a fresh event was seen to block while another thread of the process waited in
    a copy to pageable memory, and with emulated ranks that copy can wait for the kernels this thread
    is about to queue (autograd runs every rank's backward in one engine thread)."""
    from ..cuda.streams import StreamJoin
    table = getattr(_joins, "by_device", None)
    if table is None:
        table = _joins.by_device = {}
    if device.index not in table:
        table[device.index] = StreamJoin(device)
    return table[device.index]


@contextlib.contextmanager
def poisoned():
    """Context (for tests and the bench's check): every output allocated inside it is poisoned.
    Nests; process-wide while any thread is inside."""
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
