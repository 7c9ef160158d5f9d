"""The stream and event layer of a call: DeepEP's stream semantics around a backend call.

`run_call` brackets a dispatch or combine (``fn``, already validated) with the waits and the event
that ``previous_event``, ``async_with_compute_stream`` and ``allocate_on_comm_stream`` ask for
(`ElasticBuffer.dispatch`).
"""
from __future__ import annotations

import contextlib

import torch

from .event import EventHandle, EventOverlap, cuda_event_of
from .handle import collect_tensors as _collect_tensors

__all__ = ["run_call"]


def run_call(backend, fn, previous_event, previous_event_before_epilogue, async_with_compute_stream: bool,
             allocate_on_comm_stream: bool, inputs: tuple):
    """Run ``fn`` (the call on ``backend``) with DeepEP's stream semantics; returns ``(outputs, event)``.

    GPU: the communication stream waits for ``previous_event`` (or for the current compute stream)
    and for ``previous_event_before_epilogue`` (our kernels have no separate epilogue, so both are
    waited for before the call starts); outputs are allocated on the comm stream if
    ``allocate_on_comm_stream``; then either the compute stream waits for the communication
    (synchronous: the event holds nothing) or an `EventOverlap` carrying the completion
    `EventHandle` is returned (``async_with_compute_stream``) while inputs and outputs are kept
    alive for the other stream. CPU: calls ``fn``; the event of an asynchronous call is a no-op.
    """
    comm = backend.get_comm_stream()
    if comm is None:
        outputs = fn()
        return outputs, EventOverlap(EventHandle.completed() if async_with_compute_stream else None)
    join = backend.stream_join
    if join is not None and previous_event is None and previous_event_before_epilogue is None \
            and not async_with_compute_stream and not allocate_on_comm_stream \
            and torch._C._cuda_getDevice() == comm.device_index:
        # The common synchronous call, on raw handles and reused events (a few us of host time
        # instead of ~12 with torch's stream and event objects); same ordering as below. Only
        # when the buffer's device is current: a raw default-stream handle (0) means the null
        # stream of the current context.
        compute_raw = torch._C._cuda_getCurrentRawStream(comm.device_index)
        if backend.runs_on_caller_stream:
            return _on_caller_stream(backend, compute_raw, fn), EventOverlap()
        comm_raw = comm.cuda_stream
        backend.enter_comm_stream()
        join.wait(comm_raw, compute_raw)
        try:
            outputs = fn()
        finally:
            # Also after a failed call: the caller's stream is ordered after whatever the call queued
            # (its freed tensors are not reused before those kernels end; a capture stays joined).
            join.wait(compute_raw, comm_raw)
            backend.leave_comm_stream()
        return outputs, EventOverlap()
    backend.enter_comm_stream()
    compute = torch.cuda.current_stream()
    if cuda_event_of(previous_event) is not None:
        comm.wait_event(cuda_event_of(previous_event))
    else:   # no event (or one that holds nothing, as a synchronous call's): order after the caller's stream
        comm.wait_stream(compute)
    if cuda_event_of(previous_event_before_epilogue) is not None:
        comm.wait_event(cuda_event_of(previous_event_before_epilogue))
    try:
        with (torch.cuda.stream(comm) if allocate_on_comm_stream else contextlib.nullcontext()):
            outputs = fn()
    except BaseException:
        compute.wait_stream(comm)   # as above: the caller's stream after whatever the failed call queued
        backend.leave_comm_stream()
        raise
    backend.leave_comm_stream()
    done = EventHandle(comm)
    if allocate_on_comm_stream:
        for t in _collect_tensors(outputs):
            t.record_stream(compute)
    if not async_with_compute_stream:
        compute.wait_event(done.event)
        return outputs, EventOverlap()
    # Async: the communication stream may still read the inputs (and the handle) and write the
    # outputs after the caller drops them.
    for t in _collect_tensors(inputs) + ([] if allocate_on_comm_stream else _collect_tensors(outputs)):
        t.record_stream(comm)
    return outputs, EventOverlap(done, extra_tensors=(tuple(t for t in inputs if t is not None), outputs))


def _on_caller_stream(backend, compute_raw: int, fn):
    """``fn()`` with its kernels on the caller's raw stream ``compute_raw`` (NCCL-backed buffers:
    no join needed), after the previous call's kernels if those ran on another stream."""
    backend.enter_caller_stream(compute_raw)
    try:
        return fn()
    finally:
        backend.leave_caller_stream(compute_raw)
