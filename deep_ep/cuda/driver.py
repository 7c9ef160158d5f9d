"""The CUDA driver API (``cuda.bindings.driver``) and the devices' primary contexts.

deep_ep launches its kernels with the driver API in the primary context of each device, the context
torch's runtime uses, so tensors and kernels share one address space. A driver call needs that
context current on the calling thread: `enter_context` makes it current and returns what
`leave_context` needs to restore the caller's, so a launch never changes the caller's current
device (the CUDA runtime derives the current device from the current context).
"""
from __future__ import annotations

import threading

__all__ = ["DriverError", "driver", "error_name", "device_count", "primary_context", "ensure_context",
           "enter_context", "leave_context", "launch_kernel", "event_record", "stream_wait_event",
           "memcpy_async", "stream_write_u32", "stream_wait_u32", "can_flush_remote_writes"]


class DriverError(RuntimeError):
    """A CUDA driver call failed (no device, a context that cannot be retained or made current)."""


_driver = None
_init_lock = threading.Lock()
_primary: dict = {}


def driver():
    """The ``cuda.bindings.driver`` module (imported on first use)."""
    global _driver
    if _driver is None:
        from cuda.bindings import driver as d
        _driver = d
    return _driver


def error_name(err) -> str:
    """``"CUDA_ERROR_X: description"`` for a driver error code."""
    d = driver()
    try:
        _e, name = d.cuGetErrorName(err)
        _e, msg = d.cuGetErrorString(err)
        return f"{name.decode()}: {msg.decode()}"
    except Exception:  # an unknown code, or bindings without the call
        return str(err)


def device_count() -> int:
    """Number of CUDA devices the driver sees (0 when there is no driver or no GPU)."""
    try:
        d = driver()
        (err,) = d.cuInit(0)
        if int(err) != 0:
            return 0
        err, n = d.cuDeviceGetCount()
        return int(n) if int(err) == 0 else 0
    except Exception:  # no bindings or no driver library
        return 0


def primary_context(device: int):
    """``device``'s primary context (the one torch uses), retained once per process.

    Raises:
        DriverError: no CUDA device, or the driver refused.
    """
    ctx = _primary.get(device)
    if ctx is None:
        with _init_lock:
            ctx = _primary.get(device)
            if ctx is None:
                d = driver()
                if device_count() == 0:
                    raise DriverError("no CUDA device is present: deep_ep can compile kernels here, but not "
                                      "load or launch them")
                err, dev = d.cuDeviceGet(device)
                if int(err) != 0:
                    raise DriverError(f"cuDeviceGet({device}): {error_name(err)}")
                err, ctx = d.cuDevicePrimaryCtxRetain(dev)
                if int(err) != 0:
                    raise DriverError(f"cuDevicePrimaryCtxRetain({device}): {error_name(err)}")
                _primary[device] = ctx
    return ctx


def ensure_context(device: int):
    """Make ``device``'s primary context current on this thread and return it. It stays current:
    use it where the caller restores the device (``torch.cuda.device``), else `enter_context` /
    `leave_context`."""
    enter_context(device)
    return primary_context(device)


def enter_context(device: int):
    """Make ``device``'s primary context current for a driver call; return what `leave_context`
    needs to restore the caller's (None when it was current already: the common, cheap case).

    Raises:
        DriverError: the context could not be made current.
    """
    ctx = primary_context(device)
    d = driver()
    _err, cur = d.cuCtxGetCurrent()
    if int(cur) == int(ctx):
        return None
    (err,) = d.cuCtxSetCurrent(ctx)
    if int(err) != 0:
        raise DriverError(f"cuCtxSetCurrent(device {device}): {error_name(err)}")
    return cur


def leave_context(previous) -> None:
    """Undo `enter_context` (``previous`` is its return value)."""
    if previous is None:
        return
    driver().cuCtxSetCurrent(previous)


# ============================================================================ the per-call path
def launch_kernel(function, grid: int, block: int, smem: int, stream: int, params: int,
                  cooperative: bool = False) -> int:
    """A 1-D launch of the ``CUfunction`` ``function`` (the bindings' object or an int) with the
    parameter table at address ``params`` in the current context; returns the ``CUresult`` as an int."""
    d = driver()
    if cooperative:
        (err,) = d.cuLaunchCooperativeKernel(function, grid, 1, 1, block, 1, 1, smem, stream, params)
    else:
        (err,) = d.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, smem, stream, params, 0)
    return int(err)


def stream_query(stream: int, device: int) -> int:
    """``cuStreamQuery`` of the raw ``stream`` of ``device``: 0 once all its work is done, 600
    (``CUDA_ERROR_NOT_READY``) while some is queued or running, another ``CUresult`` after a fault
    (the context is then unusable). Never blocks."""
    previous = enter_context(device)
    try:
        (err,) = driver().cuStreamQuery(stream)
    finally:
        leave_context(previous)
    return int(err)


def event_record(event, stream: int) -> int:
    """Record ``event`` (a ``CUevent`` or an int) on the raw ``stream`` in the current context."""
    (err,) = driver().cuEventRecord(event, stream)
    return int(err)


def stream_wait_event(stream: int, event) -> int:
    """The raw ``stream`` waits for ``event``'s last record (in the current context)."""
    (err,) = driver().cuStreamWaitEvent(stream, event, 0)
    return int(err)


# ============================================================================ copy engines and stream memory operations
def memcpy_async(dst: int, src: int, num_bytes: int, stream: int) -> int:
    """Queue a copy of ``num_bytes`` between device addresses (a peer's mapped window included) on the
    raw ``stream`` (a copy engine, no SM), in the current context; returns the ``CUresult`` as an int."""
    (err,) = driver().cuMemcpyDtoDAsync(dst, src, num_bytes, stream)
    return int(err)


def stream_write_u32(stream: int, address: int, value: int) -> int:
    """Queue a write of the u32 ``value`` to the device ``address`` on the raw ``stream``, after the
    stream's earlier work and with a memory barrier before it (what a peer that sees the value may
    read was written first)."""
    d = driver()
    (err,) = d.cuStreamWriteValue32(stream, address, value & 0xFFFFFFFF,
                                    int(d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT))
    return int(err)


_can_flush: dict = {}   # device index -> whether its stream waits can flush remote writes


def can_flush_remote_writes(device_index: int) -> bool:
    """Whether the device's stream waits can flush the remote writes that reached it
    (``CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES``; a platform feature). False when unknown."""
    known = _can_flush.get(device_index)
    if known is None:
        d = driver()
        err, dev = d.cuDeviceGet(device_index)
        known = False
        if int(err) == 0:
            err, value = d.cuDeviceGetAttribute(
                d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, dev)
            known = int(err) == 0 and bool(value)
        _can_flush[device_index] = known
    return known


def stream_wait_u32(stream: int, address: int, value: int, flush: bool = False) -> int:
    """Make the raw ``stream`` wait until the u32 at the device ``address`` reaches ``value``
    (``(int32)(word - value) >= 0``, so counters may wrap). No timeout: the stream waits until then.
    ``flush`` (only where `can_flush_remote_writes`): the work after the wait also sees the writes a
    peer made before the one that satisfied it, which a device may otherwise reorder (CUDA asks for
    it when a peer's data and then its flag arrive from outside the device)."""
    d = driver()
    flags = int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    if flush:
        flags |= int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_FLUSH)
    (err,) = d.cuStreamWaitValue32(stream, address, value & 0xFFFFFFFF, flags)
    return int(err)
