"""What this machine gives deep_ep, as ``python -m deep_ep env`` prints it: the package, Python, torch
and its CUDA and NCCL, the GPUs torch sees, what the JIT compiles with and for, its cache, and the
deep_ep environment variables that are set. For bug reports and for checking an install; each item
is found on its own, and one that cannot be says why instead of stopping the report.
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Callable, List, Tuple

__all__ = ["report", "report_lines"]


def _try(what: Callable[[], str]) -> str:
    try:
        return what()
    except Exception as exc:   # noqa: BLE001 - a missing piece is reported, not raised
        return f"not available ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"


def _package() -> str:
    import deep_ep
    return f"{deep_ep.__version__} at {os.path.dirname(deep_ep.__file__)}"


def _torch() -> str:
    import torch
    cuda = torch.version.cuda or "none (a CPU build)"
    return f"{torch.__version__}, CUDA {cuda}"


def _torch_nccl() -> str:
    import torch
    if not torch.version.cuda:
        return "none (a CPU build of torch)"
    version = torch.cuda.nccl.version()
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def _gpus() -> str:
    import torch
    if not torch.cuda.is_available():
        return "none visible to torch"
    names = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        names.append(f"cuda:{index} {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                     f"{props.total_memory / 2 ** 30:.0f} GiB)")
    return "; ".join(names)


def _nvrtc() -> str:
    from .jit import compiler, locate
    archs = compiler.nvrtc_archs()
    return f"{compiler.compiler_version()} ({locate.nvrtc_library()}), compiles for sm_{archs[0]} to sm_{archs[-1]}"


def _arch() -> str:
    from .jit import builder
    return f"{builder.default_arch()} ({builder._arch_source()})"


def _headers(find: Callable) -> Callable[[], str]:
    return lambda: str(find())


def _nccl_headers() -> str:
    from .jit import locate, nccl_header_version
    include = locate.nccl_include_dir()
    return f"{include} (NCCL {_version(nccl_header_version(include))})"


def _loaded_nccl() -> str:
    from .jit import loaded_nccl_version
    version = loaded_nccl_version()
    return "none loaded in this process" if version is None else _version(version)


def _version(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code >= 10000 else str(code)


def _cache() -> str:
    from .jit import cache_root
    root = cache_root()
    entries = len(list((root / "kernels").glob("*/*/meta.json"))) if (root / "kernels").is_dir() else 0
    return f"{root} ({entries} kernel modules)"


def _variables() -> str:
    from . import envs
    set_names = []
    for name in sorted(envs.VARIABLES):
        origin = envs.origin(name)
        if origin is not None:
            set_names.append(f"{name}={envs.get(name)}" + ("" if origin == name else f" (from {origin})"))
    return ", ".join(set_names) or "none set"


def report_lines() -> List[Tuple[str, str]]:
    """``(label, value)`` pairs of the report, in order."""
    from .jit import locate
    items = [("deep_ep", _package), ("python", lambda: f"{sys.version.split()[0]} on {platform.platform()}"),
             ("torch", _torch), ("torch's NCCL", _torch_nccl), ("GPUs", _gpus),
             ("JIT compiler", _nvrtc), ("JIT target arch", _arch),
             ("CUDA headers", _headers(locate.cuda_include_dir)), ("CCCL headers", _headers(locate.cccl_include_dir)),
             ("NCCL headers", _nccl_headers), ("libnccl loaded", _loaded_nccl), ("JIT cache", _cache),
             ("deep_ep variables", _variables)]
    return [(label, _try(what)) for label, what in items]


def report() -> str:
    """The report as text, one ``label: value`` line per item."""
    lines = report_lines()
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label + ':':<{width + 1}} {value}" for label, value in lines)
