"""The CUDA driver API (``cuda.bindings.driver``) and the devices' primary contexts.

deep_ep launches its kernels with the driver API in the primary context of each device, the context
torch's runtime uses, so tensors and kernels share one address space. A driver call needs that
context current on the calling thread: `enter_context` makes it current and returns what
`leave_context` needs to restore the caller's, so a launch never changes the caller's current
device (the CUDA runtime derives the current device from the current context).
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

__all__ = ["DriverError", "driver", "error_name", "device_count", "primary_context", "ensure_context",
           "enter_context", "leave_context", "FastCalls", "fast_calls", "set_fast_calls", "launch_kernel",
           "event_record", "stream_wait_event"]


class DriverError(RuntimeError):
    """A CUDA driver call failed (no device, a context that cannot be retained or made current)."""


_driver = None
_init_lock = threading.Lock()
_primary: dict = {}
_primary_raw: dict = {}     # device -> the primary context as an int (what ctypes calls compare)


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
                _primary_raw[device] = int(ctx)
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
    fast = fast_calls()
    raw = _primary_raw.get(device)
    if fast is not None and raw is not None:
        cur = fast.current_context()
        if cur == raw:
            return None
        err = fast.set_current(raw)
        if err != 0:
            raise DriverError(f"cuCtxSetCurrent(device {device}): {error_name(err)}")
        return _RawContext(cur)
    ctx = primary_context(device)
    d = driver()
    _err, cur = d.cuCtxGetCurrent()
    if int(cur) == int(ctx):
        return None
    (err,) = d.cuCtxSetCurrent(ctx)
    if int(err) != 0:
        raise DriverError(f"cuCtxSetCurrent(device {device}): {error_name(err)}")
    return cur


class _RawContext:
    """A context to restore, as the raw handle a ctypes call returned (0: none was current)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle


def leave_context(previous) -> None:
    """Undo `enter_context` (``previous`` is its return value)."""
    if previous is None:
        return
    if isinstance(previous, _RawContext):
        fast = fast_calls()
        if fast is not None:
            fast.set_current(previous.handle)
            return
        previous = driver().CUcontext(previous.handle)
    driver().cuCtxSetCurrent(previous)


# ============================================================================ the per-call path
class FastCalls:
    """The per-call driver entry points as ctypes function pointers (``cuGetProcAddress``: the legacy
    default stream's variants, or the per-thread ones when the bindings use those): each returns the
    ``CUresult`` as an int. Arguments are not range-checked (ctypes wraps an out-of-range unsigned):
    callers pass values they have checked.

    Handles are ints: a ``CUfunction``, ``CUstream``, ``CUevent`` or ``CUcontext`` of the bindings
    converts with ``int()``. ctypes releases the GIL during each call.

    Raises:
        DriverError: the driver does not export one of the entry points.
    """

    _SIGNATURES = {   # name -> argument types (every one returns CUresult)
        "cuLaunchKernel": (ctypes.c_void_p,) + (ctypes.c_uint,) * 7 + (ctypes.c_void_p,) * 3,
        "cuLaunchCooperativeKernel": (ctypes.c_void_p,) + (ctypes.c_uint,) * 7 + (ctypes.c_void_p,) * 2,
        "cuEventRecord": (ctypes.c_void_p, ctypes.c_void_p),
        "cuStreamWaitEvent": (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint),
        "cuCtxGetCurrent": (ctypes.POINTER(ctypes.c_void_p),),
        "cuCtxSetCurrent": (ctypes.c_void_p,),
    }

    def __init__(self, lookup, current_context=None) -> None:
        """``lookup(name) -> int``: the address of driver entry point ``name`` (0: not found).
        ``current_context``: a no-argument callable returning the current context as an int, used
        instead of the ctypes ``cuCtxGetCurrent`` (on the H200's host the bindings' call cost about a
        microsecond less per launch than the ctypes call with its output pointer object)."""
        for name, argtypes in self._SIGNATURES.items():
            address = int(lookup(name) or 0)
            if not address:
                raise DriverError(f"the CUDA driver has no entry point {name}")
            setattr(self, name, ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(address))
        if current_context is not None:
            self.current_context = current_context

    def current_context(self) -> int:
        """The calling thread's current context as an int (0: none)."""
        out = ctypes.c_void_p()
        self.cuCtxGetCurrent(ctypes.byref(out))
        return out.value or 0

    def set_current(self, ctx: int) -> int:
        """Make ``ctx`` (an int; 0: none) current on the calling thread."""
        return self.cuCtxSetCurrent(ctx)

    def launch(self, function: int, grid: int, block: int, smem: int, stream: int, params: int,
               cooperative: bool = False) -> int:
        """A 1-D launch of ``function`` with the kernel-parameter table at address ``params``."""
        if cooperative:
            return self.cuLaunchCooperativeKernel(function, grid, 1, 1, block, 1, 1, smem, stream, params)
        return self.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, smem, stream, params, None)

    def event_record(self, event: int, stream: int) -> int:
        """Record ``event`` on ``stream`` (0: the null stream)."""
        return self.cuEventRecord(event, stream)

    def stream_wait_event(self, stream: int, event: int) -> int:
        """``stream`` waits for the last record of ``event``."""
        return self.cuStreamWaitEvent(stream, event, 0)


_fast: Optional[FastCalls] = None
_fast_state = "unset"      # "unset" (read DEEP_EP_FAST_DRIVER_CALLS), "wanted" (build it), "on" or "off"


#: The ABI version the prototypes of `FastCalls` describe (CUDA 12.0's; these entry points have not
#: changed since), asked of ``cuGetProcAddress`` so that a later versioned variant is never picked.
ABI_VERSION = 12000


def _per_thread_default_stream() -> bool:
    """Whether ``cuda.bindings`` uses the per-thread default stream (its environment switch): the
    direct path then asks for the same variants, so that stream 0 means the same stream on both."""
    return os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")


def _bindings_lookup(name: str) -> int:
    d = driver()
    err, version = d.cuDriverGetVersion()
    if int(err) != 0:
        return 0
    flags = d.CUdriverProcAddress_flags
    flag = (flags.CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM if _per_thread_default_stream()
            else flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM)
    result = d.cuGetProcAddress(name.encode(), min(int(version), ABI_VERSION), flag)
    if int(result[0]) != 0:
        return 0
    return int(result[1] or 0)


def _bindings_current_context() -> int:
    """The calling thread's current context as an int (0: none), through the bindings."""
    _err, ctx = driver().cuCtxGetCurrent()
    return int(ctx) if ctx is not None else 0


def fast_calls() -> Optional[FastCalls]:
    """The `FastCalls` of this process, or None (every call goes through ``cuda.bindings``, the
    default). ``DEEP_EP_FAST_DRIVER_CALLS=1`` (or true / yes / on) asks for the ctypes path; it is not used without a
    driver or with an entry point missing. On the H200's host the bindings were the faster of the
    two in the runs that compared them (docs/performance.md, "Measured choices")."""
    global _fast, _fast_state
    if _fast_state in ("unset", "wanted"):
        with _init_lock:
            if _fast_state == "unset":
                wanted = os.environ.get("DEEP_EP_FAST_DRIVER_CALLS", "").strip().lower() in ("1", "true", "yes", "on")
                _fast_state = "wanted" if wanted else "off"
            if _fast_state == "wanted":
                fast = None
                if device_count() > 0:
                    try:
                        fast = FastCalls(_bindings_lookup, _bindings_current_context)
                    except Exception:  # noqa: BLE001 - an old driver or bindings: the bindings path works
                        fast = None
                _fast = fast
                _fast_state = "on" if fast is not None else "off"
    return _fast if _fast_state == "on" else None


def set_fast_calls(enabled: bool) -> None:
    """Turn the ctypes path on or off for the rest of the process, whatever the environment says
    (tools time the two against each other; on takes effect where `fast_calls` can build it)."""
    global _fast, _fast_state
    with _init_lock:
        _fast, _fast_state = None, ("wanted" if enabled else "off")


def launch_kernel(function, grid: int, block: int, smem: int, stream: int, params: int,
                  cooperative: bool = False) -> int:
    """A 1-D launch of the ``CUfunction`` ``function`` (the bindings' object or an int) with the
    parameter table at address ``params`` in the current context; returns the ``CUresult`` as an int."""
    fast = fast_calls()
    if fast is not None:
        return fast.launch(int(function), grid, block, smem, stream, params, cooperative)
    d = driver()
    if cooperative:
        (err,) = d.cuLaunchCooperativeKernel(function, grid, 1, 1, block, 1, 1, smem, stream, params)
    else:
        (err,) = d.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, smem, stream, params, 0)
    return int(err)


def event_record(event, stream: int) -> int:
    """Record ``event`` (a ``CUevent`` or an int) on the raw ``stream`` in the current context."""
    fast = fast_calls()
    if fast is not None:
        return fast.event_record(int(event), stream)
    (err,) = driver().cuEventRecord(event, stream)
    return int(err)


def stream_wait_event(stream: int, event) -> int:
    """The raw ``stream`` waits for ``event``'s last record (in the current context)."""
    fast = fast_calls()
    if fast is not None:
        return fast.stream_wait_event(stream, int(event))
    (err,) = driver().cuStreamWaitEvent(stream, event, 0)
    return int(err)
