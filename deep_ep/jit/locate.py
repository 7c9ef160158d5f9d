"""Finding what the JIT needs: NVRTC, the CUDA and CCCL headers, NCCL's headers, and tools.

Search order for every item:

1. an environment override (``EP_NVRTC_PATH``, ``EP_CUDA_INCLUDE_DIR``, ``EP_CCCL_INCLUDE_DIR``,
   ``EP_NCCL_INCLUDE_DIR``; ``EP_JIT_INCLUDE_OVERLAY`` puts a copy of ``deep_ep/include`` first);
2. ``cuda-pathfinder`` (pip wheels first: ``nvidia-cuda-nvrtc``/``-cu12``, ``nvidia-cuda-runtime``,
   ``nvidia-cuda-cccl``, ``nvidia-nccl-cu13``/``-cu12``; then Conda and ``CUDA_HOME``/``CUDA_PATH``);
3. ``CUDA_HOME`` / ``CUDA_PATH`` / ``/usr/local/cuda`` by hand, for what pathfinder does not cover.

Every function is memoised for the process (the environment is read on the first call);
:func:`clear_cache` forgets the results (tests use it after changing the environment).
Failures raise :class:`JitEnvironmentError`, whose message names the pip package to install.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

from .. import envs

__all__ = [
    "JitEnvironmentError", "cuda_major", "nvrtc_library", "cuda_include_dir", "cccl_include_dir",
    "nccl_include_dir", "deep_ep_include_dir", "include_overlay_dir", "find_tool", "clear_cache", "package_hint",
]


class JitEnvironmentError(RuntimeError):
    """A library, header set or tool the JIT needs was not found (the message says what to install)."""


# pip package names per CUDA major version (CUDA 13 wheels dropped the -cu13 suffix except NCCL's).
_PACKAGES = {
    13: {"nvrtc": "nvidia-cuda-nvrtc", "cudart": "nvidia-cuda-runtime", "cccl": "nvidia-cuda-cccl",
         "nccl": "nvidia-nccl-cu13"},
    12: {"nvrtc": "nvidia-cuda-nvrtc-cu12", "cudart": "nvidia-cuda-runtime-cu12",
         "cccl": "nvidia-cuda-cccl-cu12", "nccl": "nvidia-nccl-cu12"},
}


def _guess_major_from_torch() -> int:
    """CUDA major version torch was built with (13 when unknown, e.g. a CPU build)."""
    try:
        import torch
        v = torch.version.cuda
        if v:
            return int(v.split(".")[0])
    except Exception:  # pragma: no cover - torch missing or odd
        pass
    return 13


def package_hint(what: str, major: int | None = None) -> str:
    """The ``pip install`` suggestion for ``what`` (``nvrtc``, ``cudart``, ``cccl`` or ``nccl``).

    Args:
        what: which component.
        major: CUDA major version; default: torch's CUDA version, else 13.
    """
    major = major or _guess_major_from_torch()
    names = _PACKAGES.get(major, _PACKAGES[13])
    other = _PACKAGES[12 if major != 12 else 13]
    return f"pip install {names[what]}  (or {other[what]} for CUDA {12 if major != 12 else 13})"


def _pathfinder():
    try:
        import cuda.pathfinder as pf
        return pf
    except Exception:  # pragma: no cover - dependency missing
        return None


def _cuda_home_candidates() -> list[Path]:
    out = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if envs.get(var):
            out.append(Path(envs.get(var)))
    out.append(Path("/usr/local/cuda"))
    return out


def _env_dir(var: str, must_contain: str) -> Path | None:
    """Directory from env ``var`` if set; raises if it does not contain ``must_contain``."""
    value = envs.get(var)
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    if not (path / must_contain).exists():
        source = envs.origin(var)
        given = f"{var}={value}" if source == var else f"{var}={value} (from {source})"
        raise JitEnvironmentError(f"{given}: {path / must_contain} does not exist")
    return path


@functools.lru_cache(maxsize=None)
def nvrtc_library() -> str:
    """Absolute path of the NVRTC shared library that ``cuda.bindings.nvrtc`` loads.

    ``EP_NVRTC_PATH`` overrides (a file, or a directory holding ``libnvrtc.so*``); the override is
    handed to cuda-bindings through ``CUDA_PYTHON_CUDA_NVRTC_DLL`` semantics by preloading it.

    Raises:
        JitEnvironmentError: NVRTC not found (names the pip package).
    """
    override = envs.get("EP_NVRTC_PATH")
    if override:
        p = Path(override).expanduser()
        if p.is_dir():
            libs = sorted(p.glob("libnvrtc.so*"))
            libs = [x for x in libs if "builtins" not in x.name]
            if not libs:
                raise JitEnvironmentError(f"EP_NVRTC_PATH={override}: no libnvrtc.so* there")
            p = libs[-1]
        if not p.exists():
            raise JitEnvironmentError(f"EP_NVRTC_PATH={override} does not exist")
        import ctypes
        ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)  # make this copy the one the bindings bind to
        return str(p.resolve())
    pf = _pathfinder()
    if pf is not None:
        try:
            return pf.load_nvidia_dynamic_lib("nvrtc").abs_path
        except Exception as e:
            raise JitEnvironmentError(
                f"NVRTC (libnvrtc) not found ({e}). Install it: {package_hint('nvrtc')}; "
                "or set EP_NVRTC_PATH to libnvrtc.so") from e
    raise JitEnvironmentError(f"cuda-pathfinder is missing: pip install cuda-pathfinder; and {package_hint('nvrtc')}")


@functools.lru_cache(maxsize=None)
def cuda_major() -> int:
    """Major version of the NVRTC in use (12 or 13)."""
    nvrtc_library()
    from cuda.bindings import nvrtc
    err, major, _minor = nvrtc.nvrtcVersion()
    return int(major)


def _locate_header_dir(libname: str, env: str, marker: str, what: str) -> Path:
    found = _env_dir(env, marker)
    if found:
        return found
    pf = _pathfinder()
    if pf is not None:
        try:
            loc = pf.locate_nvidia_header_directory(libname)
        except Exception:
            loc = None
        if loc is not None and (Path(loc.abs_path) / marker).exists():
            return Path(loc.abs_path)
    for home in _cuda_home_candidates():
        for sub in ("include", "include/cccl", "targets/x86_64-linux/include",
                    "targets/x86_64-linux/include/cccl", "targets/sbsa-linux/include"):
            if (home / sub / marker).exists():
                return home / sub
    raise JitEnvironmentError(
        f"{what} headers ({marker}) not found. Install them: {package_hint(libname)}; "
        f"or set {env}")


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> Path:
    """Directory holding ``cuda_runtime.h``, ``cuda_bf16.h``, ... (``EP_CUDA_INCLUDE_DIR`` overrides)."""
    return _locate_header_dir("cudart", "EP_CUDA_INCLUDE_DIR", "cuda_runtime.h", "CUDA runtime")


@functools.lru_cache(maxsize=None)
def cccl_include_dir() -> Path:
    """Directory holding ``cuda/std/...`` (CCCL; ``EP_CCCL_INCLUDE_DIR`` overrides)."""
    return _locate_header_dir("cccl", "EP_CCCL_INCLUDE_DIR", "cuda/std/version", "CCCL")


@functools.lru_cache(maxsize=None)
def nccl_include_dir() -> Path:
    """Directory holding ``nccl.h`` and ``nccl_device.h`` (``EP_NCCL_INCLUDE_DIR`` overrides).

    Raises:
        JitEnvironmentError: not found, or an NCCL without the device API (``nccl_device.h``).
    """
    found = _env_dir("EP_NCCL_INCLUDE_DIR", "nccl.h")
    if found is None:
        pf = _pathfinder()
        loc = None
        if pf is not None:
            try:
                loc = pf.locate_nvidia_header_directory("nccl")
            except Exception:
                loc = None
        if loc is not None:
            found = Path(loc.abs_path)
        else:
            for home in _cuda_home_candidates() + [Path("/usr")]:
                if (home / "include" / "nccl.h").exists():
                    found = home / "include"
                    break
    if found is None:
        raise JitEnvironmentError(f"NCCL headers (nccl.h) not found. Install them: {package_hint('nccl')}; "
                                  "or set EP_NCCL_INCLUDE_DIR")
    if not (found / "nccl_device.h").exists():
        raise JitEnvironmentError(f"{found} has nccl.h but no nccl_device.h: NCCL >= 2.28 is needed for the "
                                  f"device API ({package_hint('nccl')})")
    return found


def deep_ep_include_dir() -> Path:
    """``deep_ep/include``: the project's own header tree (always on the include path)."""
    return Path(__file__).resolve().parent.parent / "include"


def include_overlay_dir() -> Path | None:
    """``EP_JIT_INCLUDE_OVERLAY``: a copy of the ``deep_ep/include`` tree searched before the package's,
    so that its headers shadow the package's; None when unset. Read at every call, not memoised.

    For tests only (tools/mutation_check.py builds kernels with planted defects this way). The kernels
    include each other by relative paths, so the copy must be whole, not only the edited files.

    Raises:
        JitEnvironmentError: the directory has no ``deep_ep`` folder.
    """
    return _env_dir("EP_JIT_INCLUDE_OVERLAY", "deep_ep")


@functools.lru_cache(maxsize=None)
def find_tool(name: str) -> str | None:
    """Path of a CUDA binary utility (``nvcc``, ``cuobjdump``, ``nvdisasm``, ``ptxas``), or None."""
    pf = _pathfinder()
    if pf is not None:
        try:
            p = pf.find_nvidia_binary_utility(name)
            if p:
                return str(p)
        except Exception:
            pass
    for home in _cuda_home_candidates():
        if (home / "bin" / name).exists():
            return str(home / "bin" / name)
    return shutil.which(name)


def clear_cache() -> None:
    """Forget every memoised location (call after changing the environment overrides)."""
    for f in (nvrtc_library, cuda_major, cuda_include_dir, cccl_include_dir, nccl_include_dir, find_tool):
        f.cache_clear()
