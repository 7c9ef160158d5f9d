"""``build()``: options, cache key, in-process and disk caches, NCCL version checks, debug switches."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path

from .. import envs
from ..cuda import nccl
from . import compiler, dumps, locate, nccl_headers
from .cache import DiskCache, cache_root
from .compiler import SpillError
from .runtime import Module

__all__ = ["build", "stats", "reset_stats", "clear_memory_cache", "loaded_nccl_version", "default_arch",
           "NcclVersionMismatch", "compile_options"]

log = logging.getLogger("deep_ep.jit")

#: Bumped when the meaning of a cache entry changes.
CACHE_FORMAT = 1


class NcclVersionMismatch(locate.JitEnvironmentError):
    """The NCCL headers found differ from the libnccl loaded in this process."""


def _flag(name: str) -> bool:
    return envs.flag(name)


def _debug(msg: str, *a) -> None:
    if _flag("EP_JIT_DEBUG"):
        print("[deep_ep.jit] " + (msg % a if a else msg), flush=True)
    log.debug(msg, *a)


# ---------------------------------------------------------------------------------------------
# Stats

_stats_lock = threading.Lock()
_stats = {"builds": 0, "disk_hits": 0, "memory_hits": 0, "compile_seconds": 0.0}
_memory: dict[str, Module] = {}
_fast: dict[tuple, Module] = {}  # build() arguments + environment -> Module (skips header scans)
_ENV_KEYS = ("EP_JIT_CACHE_DIR", "EP_NVRTC_PATH", "EP_CUDA_INCLUDE_DIR", "EP_CCCL_INCLUDE_DIR", "EP_NCCL_INCLUDE_DIR",
             "EP_JIT_INCLUDE_OVERLAY", "EP_JIT_USE_NVCC", "EP_JIT_LINEINFO", "EP_JIT_ARCH", "EP_JIT_CHECK_SPILLS")


def stats() -> dict:
    """Counts since start (or :func:`reset_stats`).

    Returns:
        ``{"builds": compiled, "disk_hits": int, "memory_hits": int, "compile_seconds": float}``
    """
    with _stats_lock:
        return dict(_stats)


def reset_stats() -> None:
    """Zero the counters of :func:`stats`."""
    with _stats_lock:
        _stats.update(builds=0, disk_hits=0, memory_hits=0, compile_seconds=0.0)


def clear_memory_cache() -> None:
    """Forget the in-process caches: built modules, header-tree digests (the disk cache is untouched).

    Within a process, a second :func:`build` with identical arguments and environment returns the
    same :class:`Module` without rescanning headers; call this after editing headers in-process.
    """
    _memory.clear()
    _fast.clear()
    _digest_cache.clear()
    nccl_headers._prepared.clear()


def _count(key: str, value=1) -> None:
    with _stats_lock:
        _stats[key] += value


# ---------------------------------------------------------------------------------------------
# NCCL versions

def loaded_nccl_version() -> int | None:
    """``ncclGetVersion`` of the libnccl already loaded in this process (e.g. 22809), or None.

    The library is the one `deep_ep.cuda.nccl` finds in ``/proc/self/maps`` and opens with
    ``RTLD_NOLOAD`` (never a new copy).
    """
    if nccl.loaded_libnccl_path() is None:
        return None
    try:
        return nccl.nccl_version()
    except (OSError, RuntimeError):
        return None


def _version_str(code: int) -> str:
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def _check_nccl_versions(include_dir: Path, header_version: int) -> None:
    loaded = loaded_nccl_version()
    if loaded is None or loaded == header_version:
        return
    pkg = locate.package_hint("nccl").split()[2]
    raise NcclVersionMismatch(
        f"NCCL headers in {include_dir} are version {_version_str(header_version)} ({header_version}) but the libnccl "
        f"loaded in this process is {_version_str(loaded)} ({loaded}). Kernels must be compiled against the "
        f"library's headers: pip install {pkg}=={_version_str(loaded)}, or set EP_NCCL_INCLUDE_DIR to the "
        f"include directory of NCCL {_version_str(loaded)}.")


# ---------------------------------------------------------------------------------------------
# Options and key

def default_arch() -> str:
    """``sm_XY`` of torch's current CUDA device, else ``EP_JIT_ARCH``, else ``sm_90``."""
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:
        pass
    return envs.get("EP_JIT_ARCH") or "sm_90"


_digest_cache: dict[tuple, str] = {}


def _dir_digest(root: Path) -> str:
    """Content digest of every file under ``root``; memoised by the tree's (path, mtime, size) signature."""
    root = Path(root)
    if not root.exists():
        return "missing"
    files = sorted(p for p in root.rglob("*") if p.is_file())
    sig = (str(root),) + tuple((str(p), st.st_mtime_ns, st.st_size) for p in files for st in (p.stat(),))
    d = _digest_cache.get(sig)
    if d is None:
        d = nccl_headers.tree_digest(root, files)
        _digest_cache[sig] = d
    return d


_version_cache: dict[str, str] = {}


def _header_set_version(path: Path, file: str, pattern: str) -> str:
    key = f"{path}/{file}"
    v = _version_cache.get(key)
    if v is None:
        try:
            text = (path / file).read_text(errors="replace")
            m = re.search(pattern, text)
            v = m.group(1) if m else hashlib.sha256(text.encode()).hexdigest()[:16]
        except OSError:
            v = "missing"
        _version_cache[key] = v
    return v


def _arch_source() -> str:
    """Where `default_arch` takes the arch from, for error messages."""
    try:
        import torch
        if torch.cuda.is_available():
            return f"torch's current device, {torch.cuda.get_device_name()}"
    except Exception:
        pass
    return "EP_JIT_ARCH" if envs.get("EP_JIT_ARCH") else "the default where torch sees no GPU"


def _normalize_arch(arch: str) -> str:
    a = arch.strip()
    if re.fullmatch(r"\d+[a-z]?", a):
        a = "sm_" + a
    if a.startswith("compute_"):
        raise ValueError(f"arch={arch!r}: a real architecture is needed to produce a cubin (e.g. sm_90, sm_90a)")
    if not re.fullmatch(r"sm_\d+[a-z]?", a):
        raise ValueError(f"arch={arch!r} (the build's arch, or EP_JIT_ARCH where torch sees no GPU): expected e.g. "
                         f"'sm_90' or 'sm_90a'")
    return a


def compile_options(*, arch: str, defines: dict | None, use_nccl: bool, include_dirs=(), extra_options=(),
                    nccl_dirs: tuple | None = None) -> list[str]:
    """The full option list (NVRTC spelling) a build uses; see :func:`build`."""
    opts = ["-std=c++17", f"-arch={arch}", "--ptxas-options=-v"]
    if _flag("EP_JIT_LINEINFO"):
        opts.append("-lineinfo")
    for name, value in (defines or {}).items():
        if value is None or value is True:
            opts.append(f"-D{name}")
        elif value is False:
            opts.append(f"-D{name}=0")
        else:
            opts.append(f"-D{name}={value}")
    overlay = locate.include_overlay_dir()
    if overlay is not None:  # first: its headers shadow the package's
        opts.append(f"-I{overlay}")
    opts.append(f"-I{locate.deep_ep_include_dir()}")
    opts += [f"-I{Path(d).resolve()}" for d in include_dirs]
    if use_nccl:
        patched, shims = nccl_dirs
        if not compiler.use_nvcc():
            opts += ["-default-device", f"-I{shims}", f"-I{patched}"]
            # EFA GDA backend (2.29+): GNU statement expressions and flexible arrays, not NVRTC-clean.
            if not any(o.startswith("-DNCCL_GIN_EFA_GDA_ENABLE") for o in opts):
                opts.append("-DNCCL_GIN_EFA_GDA_ENABLE=0")
        else:
            opts.append(f"-I{patched}")
    if not compiler.use_nvcc():
        opts += [f"-I{locate.cuda_include_dir()}", f"-I{locate.cccl_include_dir()}"]
    opts += list(extra_options)
    return opts


def _key(source: str, options: list[str], arch: str, include_digests: dict, use_nccl: bool,
         nccl_version: int | None) -> str:
    # Include paths are machine-specific; what matters is their content (digests below).
    portable = [o for o in options if not o.startswith("-I")]
    material = {
        "format": CACHE_FORMAT,
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "options": portable,
        "arch": arch,
        "compiler": compiler.compiler_version(),
        "includes": include_digests,
        "nccl_version": nccl_version,
        "use_nccl": use_nccl,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# build

_build_locks: dict[str, threading.Lock] = {}
_build_locks_lock = threading.Lock()


def _check_spills(module: Module, source_path: str | None) -> None:
    bad = {k: v for k, v in module.info.items()
           if v.get("spill_stores") or v.get("spill_loads") or v.get("stack")}
    if bad:
        detail = "; ".join(f"{k}: {v['stack']} B stack, {v['spill_stores']} B spill stores, "
                           f"{v['spill_loads']} B spill loads, {v['registers']} registers" for k, v in bad.items())
        raise SpillError(f"{module.name}: kernel(s) use local memory (spill check on): {detail}",
                         name=module.name, log=module.log, source_path=source_path, options=module.options)


def build(name: str, source: str, *, defines: dict | None = None, use_nccl: bool = False, arch: str | None = None,
          extra_options: tuple = (), include_dirs: tuple = (), check_spills: bool | None = None,
          nccl_include_dir: str | os.PathLike | None = None) -> Module:
    """Compile CUDA C++ ``source`` to a cubin (cached) and return a :class:`Module`.

    Args:
        name: a short identifier (file names, logs, errors); letters, digits, ``_-.``.
        source: full CUDA C++ text with ``extern "C" __global__`` kernels. ``#include <deep_ep/...>``
            (``deep_ep/include``), CUDA runtime headers and CCCL (``cuda/std/...``) always work.
        defines: ``{NAME: value}`` → ``-DNAME=value`` (``True``/``None`` → ``-DNAME``, ``False`` → ``=0``).
        use_nccl: put NCCL's device headers (``nccl_device.h``, ``nccl.h``) on the include path through
            the NVRTC compatibility layer; checks them against the loaded libnccl's version.
        arch: ``sm_90``, ``sm_90a``, ``90``...; default :func:`default_arch`.
        extra_options: appended compiler options (NVRTC spelling).
        include_dirs: extra include directories; their whole content is part of the cache key.
        check_spills: fail if a kernel spills or has a stack frame (default: env ``EP_JIT_CHECK_SPILLS``).
        nccl_include_dir: NCCL include directory to use (default: ``EP_NCCL_INCLUDE_DIR`` or the
            ``nvidia-nccl-cu*`` wheel).

    Returns:
        Module: ``.cubin``, ``.cache_path``, ``.kernel_names()``, ``.function(name)``...

    Raises:
        CompileError: the compiler rejected the source (``.log``, ``.source_path``).
        SpillError: ``check_spills`` and a kernel uses local memory.
        JitEnvironmentError: NVRTC/headers missing (says which pip package), or
            ``NcclVersionMismatch`` (headers differ from the loaded libnccl).
    """
    fast_key = (name, source, tuple(sorted((defines or {}).items(), key=lambda kv: kv[0])), use_nccl, arch,
                tuple(extra_options), tuple(str(d) for d in include_dirs), check_spills,
                str(nccl_include_dir) if nccl_include_dir else None,
                tuple(envs.get(k) for k in _ENV_KEYS))
    try:
        module = _fast.get(fast_key)
    except TypeError:  # unhashable define values
        fast_key, module = None, None
    if module is not None:
        _count("memory_hits")
        return module
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(f"jit.build: name {name!r} must match [A-Za-z0-9_.-]+")
    given = arch
    arch = _normalize_arch(arch or default_arch())
    if not compiler.use_nvcc():   # nvcc names the archs it lacks itself
        compiler.check_nvrtc_arch(arch, lambda: "passed to jit.build" if given else _arch_source())
    if check_spills is None:
        check_spills = _flag("EP_JIT_CHECK_SPILLS")

    includes = {"deep_ep": _dir_digest(locate.deep_ep_include_dir())}
    overlay = locate.include_overlay_dir()
    if overlay is not None:  # a build against an overlay never shares an entry with a plain one
        includes["overlay"] = _dir_digest(overlay)
    for i, d in enumerate(include_dirs):
        includes[f"user{i}"] = _dir_digest(Path(d))
    nccl_dirs, nccl_version = None, None
    if use_nccl:
        src_dir = Path(nccl_include_dir).resolve() if nccl_include_dir else locate.nccl_include_dir()
        nccl_version = nccl_headers.nccl_header_version(src_dir)
        _check_nccl_versions(src_dir, nccl_version)
        if compiler.use_nvcc():
            nccl_dirs = (src_dir, None)
            includes["nccl"] = nccl_headers.tree_digest(src_dir)
        else:
            patched, shims, digest, _report = _prepare_nccl(src_dir)
            nccl_dirs = (patched, shims)
            includes["nccl"] = digest
    if not compiler.use_nvcc():
        cuda_inc, cccl_inc = locate.cuda_include_dir(), locate.cccl_include_dir()
        includes["cuda"] = _header_set_version(cuda_inc, "cuda.h", r"#define\s+CUDA_VERSION\s+(\d+)")
        includes["cccl"] = _header_set_version(cccl_inc, "cuda/std/__cccl/version.h", r"#define\s+CCCL_VERSION\s+(\d+)")
    options = compile_options(arch=arch, defines=defines, use_nccl=use_nccl, include_dirs=include_dirs,
                              extra_options=extra_options, nccl_dirs=nccl_dirs)
    key = _key(source, options, arch, includes, use_nccl, nccl_version)

    module = _memory.get(key)
    if module is not None:
        _count("memory_hits")
        if check_spills:
            _check_spills(module, None)
        return module

    with _build_locks_lock:
        tlock = _build_locks.setdefault(key, threading.Lock())
    with tlock:
        module = _memory.get(key)
        if module is None:
            module = _build_uncached(name, source, options, arch, key)
            _memory[key] = module
        else:
            _count("memory_hits")
    if check_spills:
        _check_spills(module, module.cache_path and str(Path(module.cache_path) / "source.cu"))
    if fast_key is not None:
        _fast[fast_key] = module
    return module


def _module_from_entry(name, cubin, meta, key, path, options, arch) -> Module:
    return Module(name, cubin, key, path, meta.get("kernels", {}), meta.get("log", ""), options, arch)


_warned_roots: set = set()
_private_dir: Path | None = None


def _cache_unwritable(root: Path, exc: OSError) -> None:
    """Warn once per cache root that it cannot be written (kernels are then built in memory)."""
    if str(root) not in _warned_roots:
        _warned_roots.add(str(root))
        warnings.warn(f"deep_ep.jit: the kernel cache {root} is not writable ({exc}); kernels are compiled "
                      f"in memory and not cached. Set EP_JIT_CACHE_DIR to a writable directory.",
                      RuntimeWarning, stacklevel=4)


def _private_root() -> Path:
    """A process-private scratch directory (removed at exit), used when the cache is not writable."""
    global _private_dir
    if _private_dir is None:
        import atexit
        _private_dir = Path(tempfile.mkdtemp(prefix="deep_ep-jit-"))
        atexit.register(shutil.rmtree, _private_dir, True)
    return _private_dir


def _prepare_nccl(src_dir: Path):
    """``nccl_headers.prepare`` in the cache, or in a private directory when the cache is not writable."""
    try:
        return nccl_headers.prepare(src_dir, cache_root())
    except OSError as exc:
        _cache_unwritable(cache_root(), exc)
        return nccl_headers.prepare(src_dir, _private_root())


def _build_uncached(name: str, source: str, options: list[str], arch: str, key: str) -> Module:
    disk = DiskCache(cache_root())
    hit = disk.load(key)
    if hit is not None:
        _count("disk_hits")
        _debug("%s: disk cache hit %s", name, key[:16])
        return _module_from_entry(name, *hit, key, disk.entry_dir(key), options, arch)
    try:
        lock = disk.lock(key)
        lock.acquire()
    except OSError as exc:  # read-only or damaged cache (a file where a directory belongs, ...)
        _cache_unwritable(disk.root, exc)
        return _compile(name, source, options, arch, key, None)
    try:
        hit = disk.load(key)
        if hit is not None:  # another process built it while we waited
            _count("disk_hits")
            _debug("%s: disk cache hit after wait %s", name, key[:16])
            return _module_from_entry(name, *hit, key, disk.entry_dir(key), options, arch)
        return _compile(name, source, options, arch, key, disk)
    finally:
        lock.release()


def _compile(name: str, source: str, options: list[str], arch: str, key: str, disk: DiskCache | None) -> Module:
    """Compile and, when ``disk`` is given (its lock held), store the entry; else an in-memory module."""
    try:
        source_path = dumps.dump_source(name, key, source, options)
    except OSError:  # the cache (or EP_JIT_DUMP_DIR) is not writable
        try:
            source_path = dumps.dump_source(name, key, source, options, base=dumps.kept_sources_dir())
        except OSError:  # nor the temporary directory: a private one, gone at exit
            source_path = dumps.dump_source(name, key, source, options, base=_private_root())
    use_nvcc = compiler.use_nvcc()
    if _flag("EP_JIT_PRINT_CMD"):
        cmd = compiler.nvcc_command(options, source_path, f"{name}.cubin") if use_nvcc \
            else ["nvrtc", *options, source_path]
        print("[deep_ep.jit] " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    result = (compiler.compile_nvcc if use_nvcc else compiler.compile_nvrtc)(name, source, options, source_path)
    dt = time.perf_counter() - t0
    _count("builds")
    _count("compile_seconds", dt)
    _debug("%s: compiled in %.2f s (%s, %s) key %s", name, dt, compiler.compiler_version(), arch, key[:16])
    if _flag("EP_JIT_PTXAS_VERBOSE"):
        print(f"[deep_ep.jit] {name} ptxas:\n{result.log}", flush=True)
    try:
        dumps.dump_artifacts(name, key, result)
    except OSError as exc:  # an unwritable EP_JIT_DUMP_DIR costs the dumps, not the build
        _debug("%s: could not dump artifacts to %s: %s", name, dumps.dump_dir(), exc)
    meta = {"name": name, "arch": arch, "options": options, "kernels": result.kernels, "log": result.log,
            "compiler": compiler.compiler_version(), "compile_seconds": dt, "created": time.time()}
    path = None
    if disk is not None:
        try:
            path = disk.store(key, result.cubin, meta)
        except OSError as exc:  # e.g. the cache became read-only or the disk is full
            _cache_unwritable(disk.root, exc)
    if path is not None:
        try:  # keep the source next to the entry (debugging); not part of validation
            shutil.copyfile(source_path, path / "source.cu")
        except OSError:
            pass
    return Module(name, result.cubin, key, path, result.kernels, result.log, options, arch)
