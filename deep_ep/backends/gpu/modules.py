"""The GPU backend's kernel modules: their sources, build-time defines, building and loading.

A module is one of ``include/deep_ep/kernels/*.cuh`` compiled for one structural configuration
(row bytes, scale factors, top-k, layout, transport); token counts, rank counts and sizes are run-time
arguments, so a new batch size never compiles. Modules are built once per process (and cached on
disk by `deep_ep.jit`) and loaded on the buffer's device before their first launch.
"""
from __future__ import annotations

import os
import threading

from ... import jit

__all__ = ["THREADS", "ALONE_THREADS", "TUNABLES", "NOTIFY_SINGLE_RANK_DEFAULT",
           "NOTIFY_TOKEN_SCAN_DEFAULT", "DISPATCH_ALONE_FUSED_DEFAULT", "EXPAND_ALONE_CACHED_DEFAULT",
           "EXPAND_ALONE_FRESH_DEFAULT", "kernel_source", "notify_single_rank", "notify_token_scan",
           "dispatch_alone_fused", "expand_alone_cached", "expand_alone_fresh", "tunable_defines",
           "dispatch_defines", "combine_defines", "barrier_defines", "build_module",
           "load_module", "num_modules_built"]

THREADS = 512           # threads of the data kernels (EP_THREADS)
ALONE_THREADS = 1024    # threads of a rank alone's expanded dispatch kernels (EP_ALONE_THREADS)

# Build-time tunables of the data kernels (include/deep_ep/common/{ptx,copy}.cuh, comm/window.cuh)
# and of the notify kernel (EP_NOTIFY_SINGLE_RANK, impls/layout_alone.cuh; EP_NOTIFY_TOKEN_SCAN,
# impls/notify_alone.cuh; EP_DISPATCH_ALONE_FUSED, impls/dispatch_alone.cuh): they change how bytes
# move, never which, so the host needs no matching change (but for which kernels a rank alone
# launches, and their grids: see `dispatch.notify_groups`, `dispatch.notify_scan_grid` and
# `dispatch_alone_fused`). Structural defines (EP_THREADS, EP_TOPK...) are not among them:
# overriding those would break the host's view of the kernels.
TUNABLES = frozenset({"EP_SEND_UNROLL", "EP_COMBINE_UNROLL", "EP_COMBINE_COMPACT", "EP_COMBINE_SINGLE_UNROLL",
                      "EP_LOAD_NO_L1", "EP_STORE_STREAMING", "EP_BLOCK_FENCE", "EP_NOTIFY_SINGLE_RANK",
                      "EP_NOTIFY_TOKEN_SCAN", "EP_DISPATCH_ALONE_FUSED", "EP_EXPAND_ALONE_CACHED",
                      "EP_EXPAND_ALONE_FRESH"})


def kernel_source(kind: str) -> str:
    """The CUDA source of a ``kind`` module ("dispatch", "combine" or "barrier"); the structure comes
    in as defines."""
    if kind not in ("dispatch", "combine", "barrier"):
        raise ValueError(f"unknown kernel module kind {kind!r}")
    return f"#include <deep_ep/kernels/{kind}.cuh>\n"


# EP_NOTIFY_SINGLE_RANK when DEEP_EP_KERNEL_DEFINES does not set it: the #define's default in
# impls/layout_alone.cuh (tests/test_gpu_host_path.py holds the two equal). The host's notify grid
# for a rank alone follows it (`dispatch.notify_groups`).
NOTIFY_SINGLE_RANK_DEFAULT = 1


def notify_single_rank() -> bool:
    """Whether the notify kernels are built with their single-rank end (EP_NOTIFY_SINGLE_RANK)."""
    return tunable_defines().get("EP_NOTIFY_SINGLE_RANK", NOTIFY_SINGLE_RANK_DEFAULT) != 0


# EP_NOTIFY_TOKEN_SCAN's default, likewise (impls/notify_alone.cuh; the same test): with the
# single-rank end, a rank alone in the non-expanded layout numbers its tokens with a token scan,
# whose grid is `dispatch.notify_scan_grid`.
NOTIFY_TOKEN_SCAN_DEFAULT = 1


def notify_token_scan() -> bool:
    """Whether a rank alone's notify kernel without the expanded layout is the token scan
    (EP_NOTIFY_TOKEN_SCAN, which takes effect only with EP_NOTIFY_SINGLE_RANK)."""
    return notify_single_rank() and tunable_defines().get("EP_NOTIFY_TOKEN_SCAN", NOTIFY_TOKEN_SCAN_DEFAULT) != 0


# EP_DISPATCH_ALONE_FUSED's default, likewise (impls/dispatch_alone.cuh; the same test): with the
# token scan, a rank alone's non-expanded fresh dispatch is one kernel, deep_ep_dispatch_alone,
# instead of the notify and data kernels: without CPU sync at 1, with and without it at 2.
DISPATCH_ALONE_FUSED_DEFAULT = 1


def dispatch_alone_fused(cpu_sync: bool = False) -> bool:
    """Whether a rank alone's non-expanded fresh dispatch, with CPU sync when ``cpu_sync``, takes the
    one-kernel path (EP_DISPATCH_ALONE_FUSED: 1 without CPU sync, 2 with it too; it takes effect only
    with the token scan, `notify_token_scan`)."""
    value = tunable_defines().get("EP_DISPATCH_ALONE_FUSED", DISPATCH_ALONE_FUSED_DEFAULT)
    return notify_token_scan() and (value >= 2 if cpu_sync else value != 0)


# EP_EXPAND_ALONE_CACHED's default, likewise (impls/dispatch_expand_alone.cuh; the same test): a rank
# alone's cached dispatch in the expanded layout is deep_ep_dispatch_cached_alone, ALONE_THREADS per
# block, instead of the cached data kernel.
EXPAND_ALONE_CACHED_DEFAULT = 1


def expand_alone_cached() -> bool:
    """Whether a rank alone's cached expanded dispatch takes its own kernel (EP_EXPAND_ALONE_CACHED)."""
    return tunable_defines().get("EP_EXPAND_ALONE_CACHED", EXPAND_ALONE_CACHED_DEFAULT) != 0


# EP_EXPAND_ALONE_FRESH's default, likewise (the same file and test): a rank alone's fresh dispatch
# in the expanded layout moves its rows with deep_ep_dispatch_fresh_alone, ALONE_THREADS per block,
# after the notify kernel, instead of the data kernel.
EXPAND_ALONE_FRESH_DEFAULT = 1


def expand_alone_fresh() -> bool:
    """Whether a rank alone's fresh expanded dispatch takes its own data kernel (EP_EXPAND_ALONE_FRESH)."""
    return tunable_defines().get("EP_EXPAND_ALONE_FRESH", EXPAND_ALONE_FRESH_DEFAULT) != 0


def tunable_defines() -> dict:
    """Build-time tunables from ``DEEP_EP_KERNEL_DEFINES`` (e.g. ``"EP_BLOCK_FENCE=1,EP_SEND_UNROLL=4"``),
    added to every data module: for running the GPU tests against a variant before it becomes the
    default (tools/tune_gpu.py times them).

    Raises:
        ValueError: an item is not ``<tunable>=<integer>`` with a name in `TUNABLES`.
    """
    out = {}
    for item in filter(None, (p.strip() for p in os.environ.get("DEEP_EP_KERNEL_DEFINES", "").split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in TUNABLES:
            raise ValueError(f"DEEP_EP_KERNEL_DEFINES: expected <tunable>=<integer> with a tunable of "
                             f"{sorted(TUNABLES)}, got {item!r}")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"DEEP_EP_KERNEL_DEFINES: {name} needs an integer, got {value.strip()!r}") from None
    return out


def _common(transport_nccl: bool) -> dict:
    return {"EP_TRANSPORT_NCCL": int(transport_nccl), "EP_THREADS": THREADS,
            **tunable_defines()}


def dispatch_defines(data_bytes: int, num_sf: int, num_topk: int, expand: bool, transport_nccl: bool = False) -> dict:
    """Defines of the dispatch module (notify-and-layout and dispatch kernels) for one structure."""
    return {"EP_DATA_BYTES": data_bytes, "EP_NUM_SF": num_sf, "EP_TOPK": num_topk, "EP_EXPAND": int(expand),
            "EP_ALONE_THREADS": ALONE_THREADS, **_common(transport_nccl)}


def combine_defines(hidden: int, num_topk: int, expand: bool, transport_nccl: bool = False) -> dict:
    """Defines of the combine module for one structure."""
    return {"EP_HIDDEN": hidden, "EP_TOPK": num_topk, "EP_EXPAND": int(expand), **_common(transport_nccl)}


def barrier_defines(transport_nccl: bool = False) -> dict:
    """Defines of the control module (the GPU barrier)."""
    return {"EP_TRANSPORT_NCCL": int(transport_nccl)}


_DEFINES = {"dispatch": dispatch_defines, "combine": combine_defines, "barrier": barrier_defines}
_modules: dict = {}
_modules_lock = threading.Lock()


def build_module(kind: str, structure: tuple, transport_nccl: bool):
    """``(key, module)`` for ``kind`` and ``structure`` (the arguments of its ``*_defines``), built once
    per process. Modules of the NCCL transport compile against NCCL's device headers."""
    defines = _DEFINES[kind](*structure, transport_nccl=transport_nccl)
    key = (kind, tuple(sorted(defines.items())))
    mod = _modules.get(key)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(key)
            if mod is None:
                name = f"deep_ep_{kind}_" + "_".join(f"{v}" for _, v in sorted(defines.items()))
                mod = jit.build(name, kernel_source(kind), defines=defines, use_nccl=transport_nccl)
                _modules[key] = mod
    return key, mod


def load_module(mod, device_index: int) -> None:
    """Load every kernel of ``mod`` on the device now (not at its first launch)."""
    for name in mod.kernel_names():
        mod.function(name).handle(device_index)


def num_modules_built() -> int:
    """Distinct kernel modules this process has built or loaded (the bench reports it)."""
    return len(_modules)
