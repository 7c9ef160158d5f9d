"""The environment variables deep_ep reads, in one place, with DeepEP V2's names as aliases.

Every read goes through `get` or `flag`: a variable's own name first, then each DeepEP name that
stands for it (``EP_JIT_WITH_LINEINFO`` for ``EP_JIT_LINEINFO``, ``EP_NCCL_ROOT_DIR`` for
``EP_NCCL_INCLUDE_DIR`` as ``<root>/include``...), then its default. An empty value counts as unset.
`VARIABLES` describes each one; docs/jit.md has them as a table. Nothing is cached: a change of the
environment shows at the next read (modules that memoise what they derive say so).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Variable", "Alias", "VARIABLES", "get", "flag", "origin", "names"]


def _as_is(value: str) -> Optional[str]:
    return value


@dataclass(frozen=True)
class Alias:
    """A DeepEP variable accepted for one of ours; ``convert`` maps its value onto ours (None: the
    alias counts as unset)."""
    name: str
    convert: Callable[[str], Optional[str]] = _as_is
    meaning: str = ""          # how the value maps, when it is not taken as it is


@dataclass(frozen=True)
class Variable:
    """One variable: its name, DeepEP's names for it, its default (None: unset) and what it does."""
    name: str
    default: Optional[str]
    effect: str
    aliases: tuple = ()


_FALSE = ("0", "false", "no", "off")


def _truthy(value: str) -> bool:
    return value.strip().lower() not in _FALSE


def _dumps_dir(value: str) -> Optional[str]:
    # DeepEP's dump switches are flags: they send the dumps to a folder of the cache.
    return os.path.join(get("EP_JIT_CACHE_DIR"), "dumps") if _truthy(value) else None


VARIABLES = {v.name: v for v in (
    Variable("EP_JIT_CACHE_DIR", "~/.cache/deep_ep/jit", "root of the JIT disk cache"),
    Variable("EP_JIT_ARCH", None, "target architecture when no CUDA device is visible (unset: `sm_90`)"),
    Variable("EP_NVRTC_PATH", None, "libnvrtc to use (a file, or a directory holding `libnvrtc.so*`); read "
             "before the first build"),
    Variable("EP_CUDA_INCLUDE_DIR", None, "directory with `cuda_runtime.h`, `cuda_bf16.h`, ..."),
    Variable("EP_CCCL_INCLUDE_DIR", None, "directory with `cuda/std/...`"),
    Variable("EP_NCCL_INCLUDE_DIR", None, "directory with `nccl.h` and `nccl_device.h` (must match the "
             "loaded libnccl)",
             (Alias("EP_NCCL_ROOT_DIR", lambda root: os.path.join(root, "include"), "`<root>/include`"),)),
    Variable("EP_JIT_INCLUDE_OVERLAY", None, "for tests: a directory holding a whole copy of `deep_ep/include` "
             "(`dir/deep_ep/...`), searched before the package's; its content is part of the cache key "
             "(`tools/mutation_check.py` plants its defects this way)"),
    Variable("EP_JIT_USE_NVCC", "0", "compile with nvcc (`-cubin`) instead of NVRTC; original NCCL headers, "
             "no shims"),
    Variable("EP_JIT_DEBUG", "0", "log builds and cache hits to stdout"),
    Variable("EP_JIT_PRINT_CMD", "0", "print the compile command (NVRTC options or the nvcc command line)",
             (Alias("EP_JIT_PRINT_COMPILER_COMMAND"),)),
    Variable("EP_JIT_DUMP_DIR", None, "write `<name>-<key>.cu`, `.ptx` (NVRTC), `.cubin`, `.log`, and `.sass` "
             "when `cuobjdump`/`nvdisasm` is found, into this directory",
             tuple(Alias(name, _dumps_dir, "a flag: dumps to `<EP_JIT_CACHE_DIR>/dumps`")
                   for name in ("EP_JIT_DUMP_PTX", "EP_JIT_DUMP_SASS", "EP_JIT_DUMP_ASM"))),
    Variable("EP_JIT_PTXAS_VERBOSE", "0", "print ptxas's register/stack/spill report of each build"),
    Variable("EP_JIT_LINEINFO", "0", "add `-lineinfo` (part of the cache key)", (Alias("EP_JIT_WITH_LINEINFO"),)),
    Variable("EP_JIT_CHECK_SPILLS", "0", "fail a build (`jit.SpillError`) whose kernel spills or has a stack "
             "frame (also `build(check_spills=True)`); kernels using NCCL's GIN API have a small stack frame "
             "(8-16 B) and fail it", (Alias("EP_JIT_PTXAS_CHECK"),)),
    Variable("DEEP_EP_KERNEL_DEFINES", None, "build-time tunables added to every dispatch/combine module, "
             "e.g. `EP_SEND_UNROLL=8` (`deep_ep.backends.gpu.modules`); for testing a variant"),
    Variable("DEEP_EP_COOPERATIVE", "1", "launch the data kernels cooperatively (`0`: plainly; emulated ranks "
             "always launch plainly); a plain grid that cannot be resident at once stalls until the GPU "
             "timeout instead of being refused"),
    Variable("EP_BUFFER_DEBUG", "0", "print each buffer's size, backend and device when it is made"),
    Variable("EP_CPU_NUM_NVLINK_RANKS", None, "ranks per NVLink domain a gloo (CPU) group acts as: the CPU "
             "backend then reports `R / N` RDMA ranks of `N` NVLink ranks (unset: one domain of every rank); "
             "must divide the group size and be equal on every rank"),
    Variable("EP_REUSE_NCCL_COMM", "1", "a GPU buffer of a torch NCCL group works on that group's communicator "
             "(`0`: on a private one, created from an NCCL unique id broadcast over the group, as for a gloo "
             "group; same name as DeepEP's)"),
    Variable("EP_EMULATED_NUM_NVLINK_RANKS", None, "ranks per node of an `EmulatedGroup` (unset: one node of "
             "every rank): several nodes on one GPU, reached through an emulated GIN (docs/scaleout.md)"),
    Variable("EP_OVERRIDE_RDMA_SL", None, "RDMA service level 0..15 for every buffer, over `sl_idx` (same "
             "name as DeepEP's)"),
    Variable("CUDA_HOME", None, "CUDA toolkit to search for headers and tools (after the pip wheels)"),
    Variable("CUDA_PATH", None, "as `CUDA_HOME`, when that is unset"),
    Variable("CUDA_MODULE_LOADING", None, "CUDA's; emulated ranks need `EAGER`, and set it when CUDA is not "
             "initialised yet"),
    Variable("CUDA_DEVICE_MAX_CONNECTIONS", None, "CUDA's hardware queues (unset: 8); emulated ranks need "
             "`2 * ranks + 2` (at most 32) and set 32 when CUDA is not initialised yet"),
    Variable("WORLD_SIZE", "1", "torchrun's: `python -m deep_ep bench` runs one rank per process when above 1"),
    Variable("LOCAL_RANK", "0", "torchrun's: the bench's GPU under torchrun"),
)}


def _lookup(name: str) -> tuple:
    """``(value, the variable that gave it)``; ``(default, None)`` when none is set."""
    variable = VARIABLES[name]
    value = os.environ.get(name)
    if value:
        return value, name
    for alias in variable.aliases:
        raw = os.environ.get(alias.name)
        if raw:
            value = alias.convert(raw)
            if value is not None:
                return value, alias.name
    return variable.default, None


def get(name: str) -> Optional[str]:
    """The value of variable ``name`` (one of `VARIABLES`): its own, else its first DeepEP alias
    that is set (converted), else its default.

    Raises:
        KeyError: ``name`` is not one of `VARIABLES` (every variable deep_ep reads is declared there).
    """
    return _lookup(name)[0]


def flag(name: str) -> bool:
    """`get` read as a switch: unset, empty, ``0``, ``false``, ``no`` and ``off`` (any case) are off,
    any other value is on (DeepEP's ``1``, ours ``true`` / ``yes`` / ``on``)."""
    value = get(name)
    return value is not None and value.strip() != "" and _truthy(value)


def origin(name: str) -> Optional[str]:
    """Which variable gave ``get(name)``'s value: ``name`` itself, a DeepEP alias, or None (the
    default), for messages that name what the user set."""
    return _lookup(name)[1]


def names(name: str) -> tuple:
    """``name`` and the names of its DeepEP aliases."""
    return (name,) + tuple(alias.name for alias in VARIABLES[name].aliases)
