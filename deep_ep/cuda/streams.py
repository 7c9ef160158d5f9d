"""Dedicated CUDA streams.

`torch.cuda.Stream()` hands out streams from a fixed pool (32 per priority, round-robin), so two
"new" streams can be the same CUDA stream. A communication stream must never be shared: a kernel
that spins waiting for peers would block whatever else was queued on it (with emulated ranks, a
peer's own compute work, which it needs to make progress: a deadlock). These streams are created
with the CUDA driver, non-blocking with respect to the legacy default stream, and wrapped for torch.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

import torch

from .driver import enter_context, error_name, event_record, leave_context, stream_wait_event

__all__ = ["new_stream", "release_stream", "StreamJoin", "poll_event", "spin_until"]

_lock = threading.RLock()  # re-entrant: a garbage-collected owner may release a stream inside new_stream
_free: dict = {}   # device index -> streams released by their owner, ready for reuse


def new_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A non-blocking CUDA stream on ``device`` that nobody else uses until the caller releases it
    (`release_stream`): a recycled one, or a new one.

    Created with the driver API in ``device``'s primary context (the context torch uses), made current
    explicitly: the CUDA runtime inside ``cuda.bindings`` keeps its own notion of the current device,
    which is not torch's.

    Raises:
        RuntimeError: the driver refused to create it.
    """
    from cuda.bindings import driver

    from .driver import ensure_context

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        free = _free.get(index)
        if free:
            return free.pop()
    with torch.cuda.device(index):  # restores the caller's current device (and context) afterwards
        torch.cuda.current_stream(index)  # make sure torch initialised this device's primary context
        ensure_context(index)
        err, handle = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
    if int(err) != 0:
        raise RuntimeError(f"cuStreamCreate on cuda:{index} failed: {err}")
    return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", index))


def release_stream(stream: torch.cuda.ExternalStream) -> None:
    """Keep ``stream`` (from `new_stream`) for the next `new_stream` on its device.

    No wait: work still queued on it only delays the next owner's work, which is queued behind it.

    Streams are recycled, never destroyed: a tensor that was used on the stream (``record_stream``)
    makes torch's caching allocator record an event on that stream when the tensor is freed, which
    may be long after the buffer that owned the stream is gone. A destroyed stream there is a
    use-after-free (the likely cause of segfaults and "invalid device context" errors seen on the H200
    while streams were destroyed).
    """
    index = stream.device.index
    with _lock:
        if index not in _free:
            _free[index] = []
        _free[index].append(stream)


class StreamJoin:
    """Orders two CUDA streams with reused driver events, for the synchronous call path.

    ``wait(waiter, producer)`` makes the raw stream ``waiter`` wait for the work queued so far on the
    raw stream ``producer`` (an event recorded on ``producer``, waited on by ``waiter``): what
    ``torch.cuda.Stream.wait_stream`` does, without creating torch stream and event objects per call
    (about 10 us of host time per dispatch). Valid under CUDA-graph capture (the record and the wait
    become a dependency between the captured streams). One object per owner and thread: its event is
    reused, which is safe because a wait refers to the record made just before it.

    Args:
        device: the CUDA device of both streams.

    Raises:
        RuntimeError: the driver refused to create an event.
    """

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver

        from .driver import ensure_context

        index = device.index if device.index is not None else torch.cuda.current_device()
        self._driver, self._index = driver, index
        with torch.cuda.device(index):
            torch.cuda.current_stream(index)
            ensure_context(index)
            err, self._event = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if int(err) != 0:
            raise RuntimeError(f"cuEventCreate on cuda:{index} failed: {err}")
        self._raw = int(self._event)

    def _driver_calls(self, what: str, *calls) -> None:
        """Run ``(function, args)`` calls (`deep_ep.cuda.driver`'s, returning an int ``CUresult``) in
        order in this device's context, stopping at the first that fails; raises ``RuntimeError``
        naming ``what``."""
        previous = enter_context(self._index)  # a thread that never used CUDA has no current context
        try:
            for fn, args in calls:
                err = fn(*args)
                if err != 0:
                    break
        finally:
            leave_context(previous)
        if err != 0:
            raise RuntimeError(f"{what} on cuda:{self._index} failed: {error_name(err)}")

    def wait(self, waiter: int, producer: int) -> None:
        """``waiter`` (raw CUstream) waits for everything queued on ``producer`` so far. Both are
        streams of this object's device; a handle of 0 is that device's null stream.

        Raises:
            RuntimeError: the driver refused the record or the wait.
        """
        self._driver_calls("ordering CUDA streams", (event_record, (self._raw, producer)),
                           (stream_wait_event, (waiter, self._raw)))

    def record(self, producer: int) -> None:
        """Record this object's event on the raw stream ``producer`` (for a later `wait_recorded`).

        Raises:
            RuntimeError: the driver refused the record.
        """
        # Once per synchronous call (after its kernels): the driver call without `_driver_calls`' loop.
        previous = enter_context(self._index)
        try:
            err = event_record(self._raw, producer)
        finally:
            leave_context(previous)
        if err != 0:
            raise RuntimeError(f"recording a CUDA event on cuda:{self._index} failed: {error_name(err)}")

    def wait_recorded(self, waiter: int) -> None:
        """The raw stream ``waiter`` waits for the work that preceded the last `record`.

        Raises:
            RuntimeError: the driver refused the wait.
        """
        self._driver_calls("ordering CUDA streams", (stream_wait_event, (waiter, self._raw)))

    def destroy(self) -> None:
        """Release the event (a wait already queued stays valid)."""
        if self._event is not None:
            self._driver.cuEventDestroy(self._event)
            self._event, self._raw = None, 0

    def __del__(self) -> None:
        # Owners destroy their joins explicitly; a thread's own join (the poison path of
        # deep_ep.backends.outputs) goes with the thread.
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass


# How a host wait polls (`spin_until`): spinning, with os.sched_yield() every few polls (it releases
# the GIL and has no timer slack), for up to SPIN_SECS; then with sleeps of SLEEP_SECS, so that a
# long wait does not hold a core. A sleep, even time.sleep(0), lasts the kernel's timer slack (50 us
# by default on Linux): a wait that sleeps from the start sees a short kernel finish tens of
# microseconds late. A spinning thread takes the GIL back sooner than a sleeping one, which slows
# other Python threads that need it (emulated ranks' threads queueing their kernels): such waits
# pass spin_secs=0.
SPIN_SECS = 2e-3
SLEEP_SECS = 2e-5
_YIELD_EVERY = 16


def spin_until(done, timeout_secs: Optional[float] = None, spin_secs: Optional[float] = None) -> bool:
    """Call ``done()`` until it returns true: spinning first (``spin_secs``, yielding the GIL every
    few calls), then with short sleeps (`SLEEP_SECS`).

    Args:
        done: a no-argument callable, cheap (a read of mapped memory, an event query).
        timeout_secs: give up after this many seconds; None (the default) waits for as long as it takes.
        spin_secs: how long to spin before sleeping between polls; None (the default): `SPIN_SECS`;
            0: sleep from the start (other threads of the process get the GIL sooner).

    Returns:
        True once ``done()`` returned true; False when ``timeout_secs`` passed first.
    """
    if done():
        return True
    start = time.monotonic()
    spin_end = start + (SPIN_SECS if spin_secs is None else spin_secs)
    deadline = None if timeout_secs is None else start + timeout_secs
    polls = 0
    while not done():
        polls += 1
        if polls % _YIELD_EVERY:
            continue
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return False
        if now < spin_end:
            os.sched_yield()
        else:
            time.sleep(SLEEP_SECS)
    return True


def poll_event(event, timeout_secs: Optional[float] = None, spin_secs: Optional[float] = 0.0) -> bool:
    """Wait on the host for a recorded ``event`` (a `torch.cuda.Event`) by polling ``query()``
    (`spin_until`), never inside a blocking driver call: a blocking wait (``synchronize()``, a copy to pageable
    memory) can hold up other threads' CUDA calls while it waits, and with emulated ranks those may
    be the calls the awaited work depends on.

    Args:
        event: the recorded event.
        timeout_secs: give up after this many seconds; None (the default) waits for as long as it takes.
        spin_secs: as for `spin_until`; by default 0 (sleep between queries from the start: a query
            takes the driver's lock, which other threads' CUDA calls need too).

    Returns:
        True once the event completed; False when ``timeout_secs`` passed first (the caller raises
        its own error, naming what it waited for).
    """
    return spin_until(event.query, timeout_secs, spin_secs)
