"""Loading cubins and launching kernels with the CUDA driver API (``cuda.bindings.driver``).

`Module` holds a cubin and loads it per device on first use; `Function` is one of its kernels, and
`Function.launch` packs the arguments (`deep_ep.jit.args`) and calls ``cuLaunchKernel`` (or
``cuLaunchCooperativeKernel``, or ``cuLaunchKernelEx`` for clusters) in the device's primary context
(`deep_ep.cuda.driver`), restoring the caller's context afterwards. `PreparedLaunch` is a launch
packed once, for calls repeated with the same shape.
"""

from __future__ import annotations

import ctypes
import threading

from ..cuda.driver import DriverError, device_count as cuda_device_count, driver as _drv, enter_context, \
    error_name as _err_name, launch_kernel, leave_context
from .args import pack_args, plan_for, summarize as _summarize
from .elf import function_names

__all__ = ["Module", "Function", "PreparedLaunch", "LaunchError", "cuda_device_count"]


class LaunchError(DriverError):
    """A kernel launch (or the loading before it) failed."""


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


class Function:
    """One kernel of a :class:`Module`; loaded per device on first launch.

    Use :meth:`launch`. ``Function`` objects are cheap to keep and thread-safe.
    """

    def __init__(self, module: "Module", name: str, symbol: str | None = None):
        self.module, self.name = module, name
        self.symbol = symbol or name               # the cubin's (mangled) name of the kernel
        self._handles: dict[int, object] = {}      # device -> CUfunction
        self._smem_limit: dict[int, int] = {}      # device -> max dynamic smem set so far
        self._plans: dict = {}
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
                        err, h = _drv().cuModuleGetFunction(mod, self.symbol.encode())
                    finally:
                        leave_context(previous)
                    if int(err) != 0:
                        raise LaunchError(f"kernel {self.name!r} not found in module {self.module.name!r} "
                                          f"(kernels: {self.module.kernel_names()}): {_err_name(err)}")
                    self._handles[device] = h
        return h

    def _needs_smem_limit(self, smem: int, device: int) -> bool:
        """Whether launching with ``smem`` dynamic bytes needs the function's limit raised first. A
        block gets 48 KB of static and dynamic shared memory together unless the function opts in,
        so the limit is raised to every new largest size, not only above 48 KB (a kernel with static
        shared memory can need it below)."""
        return smem > 0 and self._smem_limit.get(device, 0) < smem

    def _set_smem(self, device: int, h, smem: int) -> None:
        d = _drv()
        (err,) = d.cuFuncSetAttribute(h, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                      smem)
        if int(err) != 0:
            raise LaunchError(f"{self.name}: cannot allow {smem} bytes of dynamic shared memory: {_err_name(err)}")
        self._smem_limit[device] = smem

    def launch(self, grid, block, args=(), *, smem: int = 0, stream=None, cooperative: bool = False,
               cluster: tuple | None = None, device: int | None = None) -> None:
        """Launch the kernel asynchronously.

        Args:
            grid: blocks, an int or a tuple of up to 3 ints.
            block: threads per block, an int or a tuple of up to 3 ints.
            args: kernel arguments in order. ``torch.Tensor`` → device pointer (empty tensors
                allowed); ``None`` → null pointer; ``int`` → int32 (OverflowError if out of range);
                ``float`` → float32; ``bool`` → int32 0/1; ``jit.i32/u32/i64/u64/f32/f64/ptr``;
                ``ctypes.Structure`` or ``bytes``/``bytearray`` → passed by value (at least as
                large as the kernel's parameter).
            smem: dynamic shared memory bytes; the function's limit is raised to the largest size
                asked for (48 KB of static and dynamic shared memory together otherwise).
            stream: None (torch's current stream on the current device), a ``torch.cuda.Stream``,
                or a raw ``CUstream`` handle as int.
            cooperative: launch cooperatively (grid-wide sync allowed).
            cluster: thread-block cluster dimensions (int or tuple), Hopper+.
            device: the CUDA device index the stream belongs to (default: the stream's own device,
                or the current device for a raw handle).

        Raises:
            LaunchError: no GPU, load failure or launch failure (names kernel, grid, block, args).
            TypeError / OverflowError: an argument cannot be marshalled.
        """
        if not self._handles and cuda_device_count() == 0:
            raise LaunchError(f"cannot launch {self.module.name}:{self.name}: no CUDA device is present "
                              "(deep_ep.jit compiles without a GPU, but loading and launching need one)")
        resolved, hstream = _resolve_stream(stream)
        device = resolved if device is None else int(device)
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
        if self._needs_smem_limit(smem, device):
            self._set_smem(device, h, smem)
        buf, params = pack_args(plan_for(self._plans, args), args)  # buf: keeps the parameter memory alive
        d = _drv()
        if (cluster is None and gy == gz == by == bz == 1 and type(smem) is int
                and 0 < gx < 2 ** 31 and 0 < bx < 2 ** 31 and 0 <= smem < 2 ** 31):
            # The plain entry points (cuLaunchKernelEx needs launch-config objects built per call,
            # tens of microseconds of host time through the Python bindings), 1-D
            # (`deep_ep.cuda.driver.launch_kernel`).
            err = launch_kernel(h, gx, bx, smem, hstream, params, cooperative)
        elif cluster is None:
            if cooperative:
                (err,) = d.cuLaunchCooperativeKernel(h, gx, gy, gz, bx, by, bz, smem, hstream, params)
            else:
                (err,) = d.cuLaunchKernel(h, gx, gy, gz, bx, by, bz, smem, hstream, params, 0)
        else:
            err = self._launch_ex(h, (gx, gy, gz), (bx, by, bz), smem, hstream, params, cooperative, cluster)
        if int(err) != 0:
            raise LaunchError(f"launch of {self.module.name}:{self.name} failed ({_err_name(err)}); "
                              f"grid={(gx, gy, gz)} block={(bx, by, bz)} smem={smem} cooperative={cooperative} "
                              f"cluster={cluster} args={_summarize(args)}")
        del buf

    def prepare(self, grid: int, block: int, args: tuple, *, device: int,
                cooperative: bool = False, smem: int = 0) -> "PreparedLaunch":
        """A launch of this kernel with a block size and default grid whose argument storage is ``args``.

        Args:
            grid, block: blocks and threads per block (1-D).
            args: one ctypes object per kernel parameter, in order (``ctypes.Structure`` or a
                ``ctypes`` byte array for a by-value struct, ``ctypes.c_int`` etc. for scalars), each
                at least as large as the kernel's parameter. They are the parameter memory: change their fields between
                launches; the driver copies them at each launch (and at CUDA-graph capture).
            device: CUDA device index the kernel is loaded on.
            cooperative: launch with ``cuLaunchCooperativeKernel``: the driver starts the grid only
                if all its blocks can be resident at once, and refuses it otherwise
                (``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE``, raised as `LaunchError`) instead of
                letting blocks that wait for each other stall.
            smem: dynamic shared memory bytes per block; the function's limit is raised to the
                largest size asked for (48 KB of static and dynamic shared memory together otherwise).

        Raises:
            LaunchError: no GPU, or the kernel could not be loaded.
            TypeError: an argument is not a ctypes object.
        """
        for a in args:
            if not isinstance(a, (ctypes._SimpleCData, ctypes.Structure, ctypes.Array)):
                raise TypeError(f"{self.name}: prepared launches take ctypes objects, got {type(a).__name__}")
        h = self.handle(device)
        if self._needs_smem_limit(smem, device):
            previous = enter_context(device)
            try:
                self._set_smem(device, h, smem)
            finally:
                leave_context(previous)
        return PreparedLaunch(self, h, device, int(grid), int(block), tuple(args), bool(cooperative), int(smem))

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

    __slots__ = ("function", "args", "_h", "_device", "_grid", "_block", "_cooperative", "_smem", "_table",
                 "_params")

    def __init__(self, function: Function, h, device: int, grid: int, block: int, args: tuple,
                 cooperative: bool = False, smem: int = 0) -> None:
        self.function, self.args = function, args
        self._h, self._device, self._grid, self._block = h, device, grid, block
        self._cooperative, self._smem = cooperative, smem
        self._table = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(a) for a in args])
        self._params = ctypes.addressof(self._table)

    def update(self, index: int, value) -> None:
        """Copy ``value`` (a ctypes object of argument ``index``'s type) into that argument's storage.

        Raises:
            TypeError: ``value`` is not of the argument's type.
        """
        dst = self.args[index]
        if type(value) is not type(dst):
            raise TypeError(f"{self.function.name}: argument {index} is a {type(dst).__name__}, "
                            f"got {type(value).__name__}")
        ctypes.memmove(ctypes.addressof(dst), ctypes.addressof(value), ctypes.sizeof(dst))

    def launch(self, hstream: int, grid: int = 0) -> None:
        """Launch on the raw ``CUstream`` handle ``hstream`` (an int) of this launch's device, with
        ``grid`` blocks when given (> 0), else the prepared grid.

        Raises:
            LaunchError: the driver refused the launch.
        """
        grid = grid or self._grid
        previous = enter_context(self._device)
        try:
            err = launch_kernel(self._h, grid, self._block, self._smem, hstream, self._params, self._cooperative)
        finally:
            leave_context(previous)
        if err != 0:
            raise LaunchError(f"launch of {self.function.module.name}:{self.function.name} failed "
                              f"({_err_name(err)}); grid={grid} block={self._block} smem={self._smem} "
                              f"cooperative={self._cooperative} args={_summarize(self.args)} (prepared)")


def qualified_name(symbol: str) -> str:
    """``_ZN7deep_ep12combine_implE...`` -> ``deep_ep::combine_impl``: the qualified name of a kernel
    in namespaces (Itanium mangling, no templates); any other symbol as it is (``extern "C"``
    kernels have no mangling). Profilers show the demangled name, which tools match by substring."""
    if not symbol.startswith("_ZN"):
        return symbol
    parts, i = [], 3
    while i < len(symbol) and symbol[i].isdigit():
        j = i
        while j < len(symbol) and symbol[j].isdigit():
            j += 1
        length = int(symbol[i:j])
        parts.append(symbol[j:j + length])
        i = j + length
    return "::".join(parts) if parts and symbol[i:i + 1] == "E" else symbol


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
        """Names of the ``__global__`` entry points in the cubin: an ``extern "C"`` kernel's own name, a
        C++ kernel's qualified name (``deep_ep::combine_impl``), as `function` takes them. From the
        ptxas info, or the cubin's entry symbols where the compiler log had none."""
        symbols = self.info
        if not symbols:
            try:
                symbols = function_names(self.cubin, entries_only=True)
            except ValueError:   # not an ELF image: nothing to list
                symbols = ()
        return sorted(qualified_name(symbol) for symbol in symbols)

    def _symbol(self, kernel_name: str) -> str | None:
        """The cubin's symbol of ``kernel_name`` (a qualified name is matched to its mangled symbol;
        only kernels that are not overloaded or templates can be named so); None if there is none."""
        if "::" not in kernel_name:
            return kernel_name if not self.info or kernel_name in self.info else None
        symbols = self.info or function_names(self.cubin)
        found = [symbol for symbol in symbols if qualified_name(symbol) == kernel_name]
        return found[0] if len(found) == 1 else None

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
            symbol = self._symbol(kernel_name)
            if symbol is None:
                raise KeyError(f"module {self.name!r} has no kernel {kernel_name!r}; kernels: {self.kernel_names()}")
            f = self._functions.setdefault(kernel_name, Function(self, kernel_name, symbol))
        return f

    def load(self, device: int) -> None:
        """Load the module on ``device`` now (``cuModuleLoadData`` waits for the device's work to drain,
        so callers whose kernels wait on each other load before launching any).

        Raises:
            LaunchError: the cubin could not be loaded.
        """
        self._load(device)

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
