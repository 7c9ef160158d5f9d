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

    GPU: the communication stream waits for ``previous_event`` (or, when it holds no event, for the
    caller's current stream) and for ``previous_event_before_epilogue`` (our kernels have no
    separate epilogue, so both are waited for before the call starts); outputs are allocated on the
    comm stream if ``allocate_on_comm_stream``; then either the caller's stream waits for the
    communication (synchronous: the event holds nothing) or an `EventOverlap` carrying the
    completion `EventHandle` is returned (``async_with_compute_stream``) while inputs and outputs
    are kept alive for the other stream. A synchronous call without events on a backend that
    `runs_on_caller_stream` queues its kernels on the caller's stream instead. A call that raises
    still orders the caller's stream after whatever it queued. CPU: calls ``fn``; the event of an
    asynchronous call is a no-op.
    """
    comm = backend.get_comm_stream()
    if comm is None:
        outputs = fn()
        return outputs, EventOverlap(EventHandle.completed() if async_with_compute_stream else None)
    before = None if previous_event is None else cuda_event_of(previous_event)
    epilogue = None if previous_event_before_epilogue is None else cuda_event_of(previous_event_before_epilogue)
    synchronous = before is None and epilogue is None and not async_with_compute_stream \
        and not allocate_on_comm_stream
    join = backend.stream_join
    if join is not None and torch._C._cuda_getDevice() == comm.device_index:
        # Raw stream handles ordered with the buffer's reused events (a few us of host time less
        # than torch's stream and event objects); only when the buffer's device is current: a raw
        # default-stream handle (0) means the null stream of the current context.
        caller = torch._C._cuda_getCurrentRawStream(comm.device_index)
        if synchronous and backend.runs_on_caller_stream:
            return _on_caller_stream(backend, caller, fn), EventOverlap()
        own = comm.cuda_stream
    else:
        caller, own = torch.cuda.current_stream(), comm
    backend.enter_comm_stream()
    if before is not None:
        comm.wait_event(before)
    else:
        _wait(join, own, caller)
    if epilogue is not None:
        comm.wait_event(epilogue)
    try:
        with (torch.cuda.stream(comm) if allocate_on_comm_stream else contextlib.nullcontext()):
            outputs = fn()
    except BaseException:
        _wait(join, caller, own)   # the caller's stream after whatever the failed call queued
        backend.leave_comm_stream()
        raise
    backend.leave_comm_stream()
    if allocate_on_comm_stream:
        compute = torch.cuda.current_stream()
        for t in _collect_tensors(outputs):
            t.record_stream(compute)
    if not async_with_compute_stream:
        _wait(join, caller, own)
        return outputs, EventOverlap()
    # Async: the communication stream may still read the inputs (and the handle) and write the
    # outputs after the caller drops them.
    done = EventHandle(comm)
    for t in _collect_tensors(inputs) + ([] if allocate_on_comm_stream else _collect_tensors(outputs)):
        t.record_stream(comm)
    return outputs, EventOverlap(done, extra_tensors=(tuple(t for t in inputs if t is not None), outputs))


def _wait(join, waiter, producer) -> None:
    """``waiter`` waits for the work queued so far on ``producer``: both raw stream handles (through
    the buffer's `deep_ep.cuda.streams.StreamJoin`) or both torch streams."""
    if isinstance(waiter, int):
        join.wait(waiter, producer)
    else:
        waiter.wait_stream(producer)


def _on_caller_stream(backend, compute_raw: int, fn):
    """``fn()`` with its kernels on the caller's raw stream ``compute_raw`` (NCCL-backed buffers:
    no join needed), after the previous call's kernels if those ran on another stream."""
    backend.enter_caller_stream(compute_raw)
    try:
        return fn()
    finally:
        backend.leave_caller_stream(compute_raw)
