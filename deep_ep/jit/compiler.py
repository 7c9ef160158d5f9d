"""Compiling CUDA C++ to a cubin: NVRTC (default) or nvcc (``EP_JIT_USE_NVCC=1``).

Both back ends take the same option list (NVRTC spelling); :func:`compile_nvcc` translates the
few NVRTC-only options. ptxas always runs verbose (``--ptxas-options=-v``) so that registers, stack
and spills of every kernel are known (:func:`parse_ptxas_info`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import envs
from . import locate

__all__ = ["CompileError", "SpillError", "CompileResult", "compile_nvrtc", "compile_nvcc",
           "compiler_version", "use_nvcc", "parse_ptxas_info", "nvrtc_archs", "check_nvrtc_arch"]


class CompileError(RuntimeError):
    """A kernel failed to compile.

    Attributes:
        name: the module name given to :func:`deep_ep.jit.build`.
        log: the compiler's full log (NVRTC program log, or nvcc's stderr).
        source_path: where the source was dumped (a file that exists after the error).
        options: the option list used.
    """

    def __init__(self, message: str, *, name: str, log: str, source_path: str | None, options: list[str]):
        super().__init__(message)
        self.name, self.log, self.source_path, self.options = name, log, source_path, options


class SpillError(CompileError):
    """A kernel spills registers or uses a stack frame while the spill check is on."""


@dataclasses.dataclass
class CompileResult:
    """What a compiler produced.

    Attributes:
        cubin: the ELF image.
        ptx: the PTX text when available (NVRTC), else None.
        log: compiler log (includes ptxas -v output).
        kernels: ``{kernel: {"registers", "stack", "spill_stores", "spill_loads"}}`` from ptxas -v.
    """
    cubin: bytes
    ptx: str | None
    log: str
    kernels: dict


def use_nvcc() -> bool:
    """True when ``EP_JIT_USE_NVCC`` is set to a true value (1/true/yes/on)."""
    return envs.flag("EP_JIT_USE_NVCC")


@functools.lru_cache(maxsize=None)
def _nvrtc_version() -> str:
    locate.nvrtc_library()
    from cuda.bindings import nvrtc
    _err, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc-{major}.{minor}"


@functools.lru_cache(maxsize=None)
def nvrtc_archs() -> tuple:
    """The ``sm_XY`` numbers this NVRTC compiles for, e.g. ``(75, 80, ..., 121)`` (NVRTC 13.0)."""
    locate.nvrtc_library()
    from cuda.bindings import nvrtc
    return tuple(int(a) for a in _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def check_nvrtc_arch(arch: str, where) -> None:
    """Raise before any compile when NVRTC cannot compile for ``arch`` (``sm_XY`` or ``sm_XYa``);
    ``where()`` says where the arch came from (called only then).

    Raises:
        locate.JitEnvironmentError: an arch this NVRTC does not know, naming the ones it does.
    """
    supported = nvrtc_archs()
    number = int(re.sub(r"\D", "", arch))
    if number not in supported:
        names = ", ".join(f"sm_{a}" for a in supported)
        raise locate.JitEnvironmentError(
            f"deep_ep.jit: {_nvrtc_version()} cannot compile for {arch} ({where()}); it compiles for {names}. "
            f"Set EP_JIT_ARCH to one of those where torch sees no GPU, or install the NVRTC of a CUDA version "
            f"that supports this GPU")


@functools.lru_cache(maxsize=None)
def _nvcc_path() -> str:
    path = locate.find_tool("nvcc")
    if not path:
        raise locate.JitEnvironmentError("EP_JIT_USE_NVCC=1 but nvcc was not found (set CUDA_HOME or PATH)")
    return path


@functools.lru_cache(maxsize=None)
def _nvcc_version() -> str:
    out = subprocess.run([_nvcc_path(), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return f"nvcc-{m.group(1) if m else out.strip().splitlines()[-1]}"


def compiler_version() -> str:
    """Identifier of the active compiler, e.g. ``nvrtc-13.0`` or ``nvcc-13.0.88`` (part of the cache key)."""
    return _nvcc_version() if use_nvcc() else _nvrtc_version()


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas_info(log: str) -> dict:
    """Per-kernel ``registers``, ``stack``, ``spill_stores``, ``spill_loads`` from ptxas -v output."""
    kernels: dict = {}
    current = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = kernels.setdefault(m.group(1), {"registers": None, "stack": 0, "spill_stores": 0,
                                                       "spill_loads": 0})
            continue
        if current is None:
            continue
        m = _STACK.search(line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        m = _REGS.search(line)
        if m:
            current["registers"] = int(m.group(1))
    return kernels


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        from cuda.bindings import nvrtc
        _e, msg = nvrtc.nvrtcGetErrorString(err)
        raise RuntimeError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def compile_nvrtc(name: str, source: str, options: list[str], source_path: str | None) -> CompileResult:
    """Compile ``source`` with NVRTC to a cubin.

    Args:
        name: module name (used as the program's file name, ``<name>.cu``).
        source: CUDA C++ text.
        options: NVRTC options, must include ``-arch=sm_XX`` (a real architecture).
        source_path: where the source was dumped, for the error message.

    Raises:
        CompileError: compilation failed (carries NVRTC's log and ``source_path``).
    """
    locate.nvrtc_library()
    from cuda.bindings import nvrtc
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\0").decode(errors="replace")
        if int(err) != 0:
            raise CompileError(
                f"NVRTC failed to compile {name!r} (source dumped to {source_path}):\n{_tail(log)}",
                name=name, log=log, source_path=source_path, options=list(options))
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        ptx = None
        res = nvrtc.nvrtcGetPTXSize(prog)
        if int(res[0]) == 0 and res[1] > 0:
            pbuf = b" " * res[1]
            nvrtc.nvrtcGetPTX(prog, pbuf)
            ptx = pbuf.rstrip(b"\0").decode(errors="replace")
        return CompileResult(cubin=bytes(cubin), ptx=ptx, log=log, kernels=parse_ptxas_info(log))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _tail(log: str, n: int = 60) -> str:
    lines = [ln for ln in log.replace("\0", "").splitlines() if ln.strip()]
    return "\n".join(lines[-n:]) if len(lines) > n else "\n".join(lines)


_NVRTC_ONLY = ("-default-device", "--device-as-default-execution-space")


def nvcc_command(options: list[str], src: str, out: str) -> list[str]:
    """The nvcc command line equivalent to NVRTC ``options`` compiling ``src`` to cubin ``out``."""
    cmd = [_nvcc_path(), "-cubin", "-o", out]
    for o in options:
        if o in _NVRTC_ONLY:
            continue
        if o.startswith("--ptxas-options="):
            cmd += ["-Xptxas", o.split("=", 1)[1]]
        elif o.startswith("-arch="):
            cmd.append("-arch=" + o.split("=", 1)[1])
        else:
            cmd.append(o)
    cmd.append(src)
    return cmd


def compile_nvcc(name: str, source: str, options: list[str], source_path: str | None) -> CompileResult:
    """Compile ``source`` with nvcc (``-cubin``); same contract as :func:`compile_nvrtc`.

    Raises:
        CompileError: nvcc failed (carries its stderr and ``source_path``).
        JitEnvironmentError: nvcc not found.
    """
    tmp = tempfile.mkdtemp(prefix="deep_ep_nvcc_")
    try:
        src = os.path.join(tmp, f"{name}.cu")
        Path(src).write_text(source)
        out = os.path.join(tmp, f"{name}.cubin")
        cmd = nvcc_command(options, src, out)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed to compile {name!r} (source dumped to {source_path}):\n{_tail(log)}",
                               name=name, log=log, source_path=source_path, options=list(options))
        return CompileResult(cubin=Path(out).read_bytes(), ptx=None, log=log, kernels=parse_ptxas_info(log))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
