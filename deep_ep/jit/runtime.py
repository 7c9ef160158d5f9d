"""Loading cubins and launching kernels with the CUDA driver API (``cuda.bindings.driver``).

The launch path is on the hot path of dispatch/combine, so :meth:`Function.launch` keeps per-call
work small: the ``CUfunction`` per device is cached, the argument layout (a ``struct.Struct``
and the slot offsets) is cached per tuple of argument types, and parameters are packed into a
single ``ctypes`` buffer that also holds the ``void*`` table handed to ``cuLaunchKernel``.
"""

from __future__ import annotations

import ctypes
import struct
import threading

__all__ = ["Module", "Function", "PreparedLaunch", "LaunchError", "i32", "u32", "i64", "u64", "f32", "f64", "ptr",
           "cuda_device_count"]


class LaunchError(RuntimeError):
    """A kernel launch (or the loading before it) failed."""


# ---------------------------------------------------------------------------------------------
# Typed scalar arguments


class _Typed:
    __slots__ = ("value",)
    fmt = ""
    lo = hi = None

    def __init__(self, value):
        v = int(value) if self.fmt not in ("f", "d") else float(value)
        if self.lo is not None and not (self.lo <= v <= self.hi):
            raise OverflowError(f"{type(self).__name__}({value}) out of range [{self.lo}, {self.hi}]")
        self.value = v

    def __repr__(self):
        return f"{type(self).__name__}({self.value})"


class i32(_Typed):
    """A kernel argument of type ``int32_t``."""
    __slots__ = ()
    fmt, lo, hi = "i", -2**31, 2**31 - 1


class u32(_Typed):
    """A kernel argument of type ``uint32_t``."""
    __slots__ = ()
    fmt, lo, hi = "I", 0, 2**32 - 1


class i64(_Typed):
    """A kernel argument of type ``int64_t``."""
    __slots__ = ()
    fmt, lo, hi = "q", -2**63, 2**63 - 1


class u64(_Typed):
    """A kernel argument of type ``uint64_t``."""
    __slots__ = ()
    fmt, lo, hi = "Q", 0, 2**64 - 1


class ptr(_Typed):
    """A pointer kernel argument given as an integer address (0 = null)."""
    __slots__ = ()
    fmt, lo, hi = "Q", 0, 2**64 - 1


class f32(_Typed):
    """A kernel argument of type ``float``."""
    __slots__ = ()
    fmt = "f"


class f64(_Typed):
    """A kernel argument of type ``double``."""
    __slots__ = ()
    fmt = "d"


def _int32(v: int) -> int:
    if -2147483648 <= v <= 2147483647:
        return v
    raise OverflowError(f"Python int {v} does not fit the int32 kernel argument; wrap it (jit.i64/u64/u32/ptr)")


def _null(_a) -> int:
    return 0


def _typed_value(a) -> int | float:
    return a.value


def _blob(a) -> bytes:
    return bytes(a)


def _type_plan(tp):
    """(struct format, converter) for an argument type; blobs handled by the caller."""
    if tp is bool:
        return "i4x", int
    if tp is int:
        return "i4x", _int32
    if tp is float:
        return "f4x", float
    if tp is type(None):
        return "Q", _null
    if isinstance(tp, type) and issubclass(tp, _Typed):
        fmt = tp.fmt
        return (fmt + "4x" if fmt in "iIf" else fmt), _typed_value
    data_ptr = getattr(tp, "data_ptr", None)
    if callable(data_ptr):  # torch.Tensor and subclasses: the unbound method, no wrapper call
        return "Q", data_ptr
    raise TypeError(f"unsupported kernel argument type {tp.__name__}: use a tensor, None, int, float, bool, "
                    "jit.i32/u32/i64/u64/f32/ptr, a ctypes.Structure or bytes")


_BLOB_TYPES = (bytes, bytearray, memoryview)


class _Plan:
    """Precomputed layout for one tuple of argument types (and blob sizes)."""
    __slots__ = ("struct", "convs", "offsets", "table_offset", "size", "table_struct", "local")

    def __init__(self, args):
        fmt = ["="]
        convs, offsets = [], []
        off = 0
        for a in args:
            tp = type(a)
            if _is_blob_type(tp):
                n = len(bytes(a)) if isinstance(a, _BLOB_TYPES) else ctypes.sizeof(a)
                pad = (-off) % 16
                if pad:
                    fmt.append(f"{pad}x")
                    off += pad
                fmt.append(f"{n}s")
                offsets.append(off)
                off += n
                convs.append(_blob)
                continue
            f, conv = _type_plan(tp)
            pad = (-off) % 8
            if pad:
                fmt.append(f"{pad}x")
                off += pad
            fmt.append(f)
            offsets.append(off)
            off += struct.calcsize("=" + f)
            convs.append(conv)
        pad = (-off) % 8
        if pad:
            fmt.append(f"{pad}x")
            off += pad
        self.struct = struct.Struct("".join(fmt))
        self.convs = tuple(convs)
        self.offsets = tuple(offsets)
        self.table_offset = off
        self.table_struct = struct.Struct(f"={len(args)}Q")
        self.size = off + 8 * max(1, len(args))
        self.local = threading.local()


_blob_type_memo: dict[type, bool] = {}


def _is_blob_type(tp) -> bool:
    b = _blob_type_memo.get(tp)
    if b is None:
        b = _blob_type_memo[tp] = issubclass(tp, _BLOB_TYPES + (ctypes.Structure, ctypes.Union, ctypes.Array))
    return b


def _plan_key(args):
    """Cache key of an argument tuple's layout: the types, plus the sizes of by-value blobs."""
    key = tuple(map(type, args))
    if any(map(_is_blob_type, key)):
        key += tuple(len(bytes(a)) if isinstance(a, _BLOB_TYPES) else ctypes.sizeof(a)
                     for a in args if _is_blob_type(type(a)))
    return key


def pack_args(plan: _Plan, args) -> tuple[ctypes.Array, int]:
    """Pack ``args`` per ``plan`` into this thread's buffer for the plan.

    Returns ``(buffer, address of the void* table)``. The buffer is reused by later launches of
    the same plan on the same thread: the driver copies parameters during ``cuLaunchKernel``.
    """
    local = plan.local
    try:
        buf, table = local.buf, local.table
    except AttributeError:
        buf = ctypes.create_string_buffer(plan.size)
        base = ctypes.addressof(buf)
        plan.table_struct.pack_into(buf, plan.table_offset, *[base + o for o in plan.offsets])
        table = base + plan.table_offset
        local.buf, local.table = buf, table
    plan.struct.pack_into(buf, 0, *[c(a) for c, a in zip(plan.convs, args)])
    return buf, table


# ---------------------------------------------------------------------------------------------
# Driver helpers

_driver = None
_init_lock = threading.Lock()
_primary_ctx: dict[int, object] = {}


def _drv():
    global _driver
    if _driver is None:
        from cuda.bindings import driver
        _driver = driver
    return _driver


def _err_name(err) -> str:
    d = _drv()
    try:
        _e, name = d.cuGetErrorName(err)
        _e, msg = d.cuGetErrorString(err)
        return f"{name.decode()}: {msg.decode()}"
    except Exception:
        return str(err)


def cuda_device_count() -> int:
    """Number of CUDA devices the driver sees (0 when no driver or no GPU)."""
    try:
        d = _drv()
        (err,) = d.cuInit(0)
        if int(err) != 0:
            return 0
        err, n = d.cuDeviceGetCount()
        return int(n) if int(err) == 0 else 0
    except Exception:
        return 0


def _primary_context(device: int):
    """``device``'s primary context (the one torch uses), retained once per process."""
    ctx = _primary_ctx.get(device)
    if ctx is None:
        with _init_lock:
            ctx = _primary_ctx.get(device)
            if ctx is None:
                d = _drv()
                if cuda_device_count() == 0:
                    raise LaunchError("no CUDA device is present: deep_ep.jit can compile kernels here, but not "
                                      "load or launch them")
                err, dev = d.cuDeviceGet(device)
                if int(err) != 0:
                    raise LaunchError(f"cuDeviceGet({device}): {_err_name(err)}")
                err, ctx = d.cuDevicePrimaryCtxRetain(dev)
                if int(err) != 0:
                    raise LaunchError(f"cuDevicePrimaryCtxRetain({device}): {_err_name(err)}")
                _primary_ctx[device] = ctx
    return ctx


def ensure_context(device: int):
    """Make ``device``'s primary context (the one torch uses) current on this thread; return it.
    It stays current: use it where the caller restores the device (``torch.cuda.device``), else
    `enter_context` / `leave_context`."""
    enter_context(device)
    return _primary_context(device)


def enter_context(device: int):
    """Make ``device``'s primary context current for a driver call; return what `leave_context`
    needs to restore the caller's (None when it was already current: the common, cheap case).
    Without the restore, a launch on a buffer's device would silently change the caller's current
    device (the CUDA runtime derives it from the current context)."""
    ctx = _primary_context(device)
    d = _drv()
    err, cur = d.cuCtxGetCurrent()
    if int(cur) == int(ctx):
        return None
    (err,) = d.cuCtxSetCurrent(ctx)
    if int(err) != 0:
        raise LaunchError(f"cuCtxSetCurrent(device {device}): {_err_name(err)}")
    return cur


def leave_context(previous) -> None:
    """Undo `enter_context` (``previous`` is its return value)."""
    if previous is not None:
        _drv().cuCtxSetCurrent(previous)


def _torch():
    import torch
    return torch


def _current_device() -> int:
    torch = _torch()
    try:
        return torch._C._cuda_getDevice()
    except Exception:
        return torch.cuda.current_device()


def _resolve_stream(stream) -> tuple[int, int]:
    """``(device, raw CUstream handle)`` for ``stream`` (None = torch's current stream)."""
    if stream is None:
        torch = _torch()
        dev = _current_device()
        try:
            return dev, torch._C._cuda_getCurrentRawStream(dev)
        except Exception:
            return dev, torch.cuda.current_stream(dev).cuda_stream
    if isinstance(stream, int):
        return _current_device(), stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = int(stream)  # e.g. a cuda.bindings CUstream
        return _current_device(), handle
    dev = getattr(stream, "device_index", None)
    if dev is None:
        dev = getattr(getattr(stream, "device", None), "index", None)
    return (_current_device() if dev is None else dev), handle


def _dim3(v, what: str) -> tuple[int, int, int]:
    if isinstance(v, int):
        return v, 1, 1
    t = tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"{what} must be an int or a tuple of 1..3 ints, got {v!r}")
    return t + (1,) * (3 - len(t))


def _summarize(args) -> str:
    out = []
    for a in args:
        if hasattr(a, "data_ptr") and hasattr(a, "shape"):
            out.append(f"Tensor(shape={tuple(a.shape)}, dtype={a.dtype}, device={a.device}, ptr=0x{a.data_ptr():x})")
        elif isinstance(a, (ctypes.Structure, ctypes.Union)):
            out.append(f"{type(a).__name__}(<{ctypes.sizeof(a)} bytes by value>)")
        elif isinstance(a, _BLOB_TYPES):
            out.append(f"<{len(a)} bytes by value>")
        else:
            out.append(repr(a))
    return "[" + ", ".join(out) + "]"


class Function:
    """One kernel of a :class:`Module`; loaded per device on first launch.

    Use :meth:`launch`. ``Function`` objects are cheap to keep and thread-safe.
    """

    def __init__(self, module: "Module", name: str):
        self.module, self.name = module, name
        self._handles: dict[int, object] = {}      # device -> CUfunction
        self._smem_limit: dict[int, int] = {}      # device -> max dynamic smem set so far
        self._plans: dict[tuple, _Plan] = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return f"<jit.Function {self.module.name}:{self.name}>"

    def handle(self, device: int | None = None):
        """The ``CUfunction`` on ``device`` (default: torch's current device), loading the module.

        Raises:
            LaunchError: no GPU, or the cubin/kernel could not be loaded.
        """
        if device is None:
            device = _current_device() if cuda_device_count() else 0
        h = self._handles.get(device)
        if h is None:
            with self._lock:
                h = self._handles.get(device)
                if h is None:
                    previous = enter_context(device)
                    try:
                        mod = self.module._load(device)
                        err, h = _drv().cuModuleGetFunction(mod, self.name.encode())
                    finally:
                        leave_context(previous)
                    if int(err) != 0:
                        raise LaunchError(f"kernel {self.name!r} not found in module {self.module.name!r} "
                                          f"(kernels: {self.module.kernel_names()}): {_err_name(err)}")
                    self._handles[device] = h
        return h

    def _set_smem(self, device: int, h, smem: int) -> None:
        d = _drv()
        (err,) = d.cuFuncSetAttribute(h, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      smem)
        if int(err) != 0:
            raise LaunchError(f"{self.name}: cannot allow {smem} bytes of dynamic shared memory: {_err_name(err)}")
        self._smem_limit[device] = smem

    def launch(self, grid, block, args=(), *, smem: int = 0, stream=None, cooperative: bool = False,
               cluster: tuple | None = None) -> None:
        """Launch the kernel asynchronously.

        Args:
            grid: blocks, an int or a tuple of up to 3 ints.
            block: threads per block, an int or a tuple of up to 3 ints.
            args: kernel arguments in order. ``torch.Tensor`` → device pointer (empty tensors
                allowed); ``None`` → null pointer; ``int`` → int32 (OverflowError if out of range);
                ``float`` → float32; ``bool`` → int32 0/1; ``jit.i32/u32/i64/u64/f32/f64/ptr``;
                ``ctypes.Structure`` or ``bytes``/``bytearray`` → passed by value (at least as
                large as the kernel's parameter).
            smem: dynamic shared memory bytes; above 48 KB the function's limit is raised.
            stream: None (torch's current stream on the current device), a ``torch.cuda.Stream``,
                or a raw ``CUstream`` handle as int.
            cooperative: launch cooperatively (grid-wide sync allowed).
            cluster: thread-block cluster dimensions (int or tuple), Hopper+.

        Raises:
            LaunchError: no GPU, load failure or launch failure (names kernel, grid, block, args).
            TypeError / OverflowError: an argument cannot be marshalled.
        """
        if not self._handles and cuda_device_count() == 0:
            raise LaunchError(f"cannot launch {self.module.name}:{self.name}: no CUDA device is present "
                              "(deep_ep.jit compiles without a GPU, but loading and launching need one)")
        device, hstream = _resolve_stream(stream)
        h = self._handles.get(device)
        if h is None:
            h = self.handle(device)
        previous = enter_context(device)
        try:
            self._launch(h, device, hstream, grid, block, args, smem, cooperative, cluster)
        finally:
            leave_context(previous)

    def _launch(self, h, device, hstream, grid, block, args, smem, cooperative, cluster) -> None:
        gx, gy, gz = (grid, 1, 1) if type(grid) is int else _dim3(grid, "grid")
        bx, by, bz = (block, 1, 1) if type(block) is int else _dim3(block, "block")
        if smem > 48 * 1024 and self._smem_limit.get(device, 0) < smem:
            self._set_smem(device, h, smem)
        key = _plan_key(args)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(args)
        buf, params = pack_args(plan, args)  # buf: keeps the parameter memory alive
        d = _drv()
        if not cooperative and cluster is None:
            (err,) = d.cuLaunchKernel(h, gx, gy, gz, bx, by, bz, smem, hstream, params, 0)
        else:
            err = self._launch_ex(h, (gx, gy, gz), (bx, by, bz), smem, hstream, params, cooperative, cluster)
        if int(err) != 0:
            raise LaunchError(f"launch of {self.module.name}:{self.name} failed ({_err_name(err)}); "
                              f"grid={(gx, gy, gz)} block={(bx, by, bz)} smem={smem} cooperative={cooperative} "
                              f"cluster={cluster} args={_summarize(args)}")
        del buf

    def prepare(self, grid: int, block: int, args: tuple, *, device: int,
                cooperative: bool = False) -> "PreparedLaunch":
        """A launch of this kernel with fixed grid and block whose argument storage is ``args``.

        Args:
            grid, block: blocks and threads per block (1-D).
            args: one ctypes object per kernel parameter, in order (``ctypes.Structure`` for a
                by-value struct, ``ctypes.c_int`` etc. for scalars), each at least as large as the
                kernel's parameter. They are the parameter memory: change their fields between
                launches; the driver copies them at each launch (and at CUDA-graph capture).
            device: CUDA device index the kernel is loaded on.
            cooperative: launch with ``cuLaunchCooperativeKernel``: the driver starts the grid only
                if all its blocks can be resident at once, and refuses it otherwise
                (``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE``, raised as `LaunchError`) instead of
                letting blocks that wait for each other stall.

        Raises:
            LaunchError: no GPU, or the kernel could not be loaded.
            TypeError: an argument is not a ctypes object.
        """
        for a in args:
            if not isinstance(a, ctypes._SimpleCData) and not isinstance(a, ctypes.Structure):
                raise TypeError(f"{self.name}: prepared launches take ctypes objects, got {type(a).__name__}")
        return PreparedLaunch(self, self.handle(device), device, int(grid), int(block), tuple(args),
                              bool(cooperative))

    def _launch_ex(self, h, grid, block, smem, hstream, params, cooperative, cluster):
        d = _drv()
        cfg = d.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = smem
        cfg.hStream = d.CUstream(hstream)
        attrs = []
        if cooperative:
            a = d.CUlaunchAttribute()
            a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            a.value.cooperative = 1
            attrs.append(a)
        if cluster is not None:
            cx, cy, cz = _dim3(cluster, "cluster")
            a = d.CUlaunchAttribute()
            a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cx, cy, cz
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        (err,) = d.cuLaunchKernelEx(cfg, h, params, 0)
        return err


class PreparedLaunch:
    """A kernel launch packed once (`Function.prepare`); calling it costs one driver call.

    For launches repeated many times with the same shape, e.g. a cached dispatch: the caller keeps the
    ctypes argument objects, updates the fields that change, and calls ``launch(stream_handle)``.
    Not thread-safe (one owner updates the arguments).
    """

    __slots__ = ("function", "args", "_h", "_device", "_grid", "_block", "_cooperative", "_table")

    def __init__(self, function: Function, h, device: int, grid: int, block: int, args: tuple,
                 cooperative: bool = False) -> None:
        self.function, self.args = function, args
        self._h, self._device, self._grid, self._block = h, device, grid, block
        self._cooperative = cooperative
        self._table = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(a) for a in args])

    def launch(self, hstream: int) -> None:
        """Launch on the raw ``CUstream`` handle ``hstream`` (an int) of this launch's device.

        Raises:
            LaunchError: the driver refused the launch.
        """
        previous = enter_context(self._device)
        try:
            d = _drv()
            if self._cooperative:
                (err,) = d.cuLaunchCooperativeKernel(self._h, self._grid, 1, 1, self._block, 1, 1, 0, hstream,
                                                     ctypes.addressof(self._table))
            else:
                (err,) = d.cuLaunchKernel(self._h, self._grid, 1, 1, self._block, 1, 1, 0, hstream,
                                          ctypes.addressof(self._table), 0)
        finally:
            leave_context(previous)
        if int(err) != 0:
            raise LaunchError(f"launch of {self.function.module.name}:{self.function.name} failed "
                              f"({_err_name(err)}); grid={self._grid} block={self._block} "
                              f"cooperative={self._cooperative} args={_summarize(self.args)} (prepared)")


class Module:
    """A compiled cubin (see :func:`deep_ep.jit.build`).

    Attributes:
        name: the name given to ``build``.
        cubin: the ELF image (bytes).
        cache_path: the disk-cache entry directory holding it (``pathlib.Path``).
        key: the cache key (sha256 hex).
        info: per-kernel ptxas info: ``{kernel: {"registers", "stack", "spill_stores", "spill_loads"}}``.
        log: the compiler log of the build that produced the cubin.
        options: the compile options used.
    """

    def __init__(self, name: str, cubin: bytes, key: str, cache_path, info: dict, log: str = "",
                 options: list | None = None, arch: str = ""):
        self.name, self.cubin, self.key, self.cache_path = name, cubin, key, cache_path
        self.info, self.log, self.options, self.arch = info, log, options or [], arch
        self._modules: dict[int, object] = {}
        self._functions: dict[str, Function] = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return f"<jit.Module {self.name} {self.arch} kernels={self.kernel_names()} key={self.key[:12]}>"

    def kernel_names(self) -> list[str]:
        """Names of the ``__global__`` entry points in the cubin."""
        return sorted(self.info)

    @property
    def registers(self) -> dict:
        """``{kernel: registers per thread}`` (None where unknown)."""
        return {k: v.get("registers") for k, v in self.info.items()}

    @property
    def spills(self) -> dict:
        """``{kernel: (spill store bytes, spill load bytes, stack frame bytes)}``."""
        return {k: (v.get("spill_stores", 0), v.get("spill_loads", 0), v.get("stack", 0)) for k, v in self.info.items()}

    def function(self, kernel_name: str) -> Function:
        """The :class:`Function` for ``kernel_name`` (loaded lazily at first launch).

        Raises:
            KeyError: the cubin has no such kernel (when the kernel list is known).
        """
        f = self._functions.get(kernel_name)
        if f is None:
            if self.info and kernel_name not in self.info:
                raise KeyError(f"module {self.name!r} has no kernel {kernel_name!r}; kernels: {self.kernel_names()}")
            f = self._functions.setdefault(kernel_name, Function(self, kernel_name))
        return f

    def _load(self, device: int):
        m = self._modules.get(device)
        if m is None:
            with self._lock:
                m = self._modules.get(device)
                if m is None:
                    previous = enter_context(device)
                    try:
                        err, m = _drv().cuModuleLoadData(self.cubin)
                    finally:
                        leave_context(previous)
                    if int(err) != 0:
                        raise LaunchError(f"cuModuleLoadData({self.name}, {self.arch}) on device {device}: "
                                          f"{_err_name(err)}")
                    self._modules[device] = m
        return m
