"""What a build writes beside the cache: each build's source (for a `CompileError` report), and
with ``EP_JIT_DUMP_DIR`` (or DeepEP's dump switches) its PTX, cubin, ptxas log and SASS."""
from __future__ import annotations

import os
import subprocess
import tempfile
import warnings
from pathlib import Path

from .. import envs
from . import locate
from .cache import cache_root

__all__ = ["dump_dir", "dump_source", "dump_artifacts", "kept_sources_dir"]


def dump_dir() -> Path | None:
    """``EP_JIT_DUMP_DIR`` (DeepEP's dump switches name ``<cache>/dumps``, `deep_ep.envs`), or None."""
    d = envs.get("EP_JIT_DUMP_DIR")
    return Path(d).expanduser() if d else None


def dump_source(name: str, key: str, source: str, options: list[str], base: Path | None = None) -> str:
    """Write the source with a header naming the build and its options; return the path. ``base``
    defaults to EP_JIT_DUMP_DIR, else the cache's ``sources`` folder."""
    base = base or dump_dir() or (cache_root() / "sources")
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{name}-{key[:16]}.cu"
    tmp = path.with_suffix(f".cu.{os.getpid()}.tmp")
    tmp.write_text(f"// deep_ep.jit build of {name!r}\n// options: {' '.join(options)}\n{source}")
    os.replace(tmp, path)
    return str(path)


def dump_artifacts(name: str, key: str, result) -> None:
    """With `dump_dir` set: ``<name>-<key>.cubin``, ``.log``, ``.ptx`` (NVRTC) and ``.sass`` (when
    cuobjdump or nvdisasm runs; a RuntimeWarning, once, when neither does) of ``result``.

    Raises:
        OSError: the directory cannot be written (the caller skips the dumps).
    """
    base = dump_dir()
    if base is None:
        return
    stem = base / f"{name}-{key[:16]}"
    Path(str(stem) + ".cubin").write_bytes(result.cubin)
    Path(str(stem) + ".log").write_text(result.log)
    if result.ptx:
        Path(str(stem) + ".ptx").write_text(result.ptx)
    found = []
    for tool, args in (("cuobjdump", ["-sass"]), ("nvdisasm", ["-c"])):
        exe = locate.find_tool(tool)
        if exe:
            found.append(tool)
            proc = subprocess.run([exe, *args, str(stem) + ".cubin"], capture_output=True, text=True)
            if proc.returncode == 0:
                Path(str(stem) + ".sass").write_text(proc.stdout)
                return
    if "sass" not in _warned:   # once per process: the other dumps were written
        _warned.add("sass")
        why = f"{' and '.join(found)} failed on it" if found else \
            "neither cuobjdump nor nvdisasm was found (on PATH, under CUDA_HOME or in an NVIDIA wheel)"
        warnings.warn(f"deep_ep.jit: no .sass dump in {base}: {why}; the .cu, .ptx, .cubin and .log dumps "
                      f"are written", RuntimeWarning, stacklevel=4)


_warned: set = set()


def kept_sources_dir() -> Path:
    """Where a build's source goes when the cache cannot take it: a folder of the system's temporary
    directory, kept after the process exits (a CompileError names the file)."""
    return Path(tempfile.gettempdir()) / "deep_ep-jit-sources"
