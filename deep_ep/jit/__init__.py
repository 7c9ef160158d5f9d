"""deep_ep's JIT: compile CUDA C++ at run time with NVRTC, cache cubins on disk, load and launch.

Quick use::

    from deep_ep import jit
    mod = jit.build("scale", SOURCE, defines={"N": 4})
    mod.function("scale_kernel").launch(grid=8, block=256, args=(out, inp, 2.0, jit.i64(n)))

Modules:
    ``locate``        finds NVRTC, CUDA/CCCL/NCCL headers and tools (cuda-pathfinder first).
    ``nccl_headers``  NVRTC compatibility layer for NCCL's device headers (patched copies in the cache).
    ``compiler``      NVRTC (default) or nvcc (``EP_JIT_USE_NVCC=1``).
    ``cache``         atomic on-disk cache of cubins.
    ``args``          typed scalar arguments and the packing of argument tuples.
    ``runtime``       ``Module``/``Function``: driver-API loading and launching.
    ``builder``       :func:`build`, cache key, stats, NCCL version checks.

Environment switches are documented in ``docs/jit.md``.
"""

from .builder import (NcclVersionMismatch, build, clear_memory_cache, compile_options, default_arch,
                      loaded_nccl_version, reset_stats, stats)
from .cache import cache_root
from .lazy import LazyKernel
from .compiler import CompileError, SpillError
from .locate import JitEnvironmentError
from .nccl_headers import nccl_header_version
from .args import f32, f64, i32, i64, ptr, u32, u64
from .runtime import Function, LaunchError, Module, PreparedLaunch, cuda_device_count

__all__ = [
    "build", "LazyKernel", "Module", "Function", "PreparedLaunch", "CompileError", "SpillError", "LaunchError", "JitEnvironmentError",
    "NcclVersionMismatch", "stats", "reset_stats", "clear_memory_cache", "loaded_nccl_version",
    "nccl_header_version", "default_arch", "compile_options", "cache_root", "cuda_device_count",
    "i32", "u32", "i64", "u64", "f32", "f64", "ptr",
]
