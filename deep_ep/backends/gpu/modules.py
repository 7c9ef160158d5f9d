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

__all__ = ["THREADS", "NOTIFY_KERNEL", "DISPATCH_KERNEL", "CACHED_DISPATCH_KERNEL", "COMBINE_KERNEL",
           "BARRIER_KERNEL", "PP_SEND_KERNEL", "PP_RECV_KERNEL", "PP_FLUSH_KERNEL", "TUNABLES", "kernel_source",
           "tunable_defines", "dispatch_defines", "combine_defines", "barrier_defines", "pp_defines", "build_module",
           "load_module",
           "num_modules_built"]

THREADS = 512           # threads of the data kernels (EP_THREADS)

# The kernels every rank count launches (extern "C" entry points of include/deep_ep/kernels/*.cuh).
# DeepEP V2's test (tests/elastic/test_ep.py) times a dispatch by the kernels whose names contain
# "dispatch_impl" and "dispatch_copy_epilogue_impl", a combine by "combine_impl" and
# "combine_reduce_epilogue_impl". Each data kernel here does both phases, so its name contains both
# of its call's substrings; the notify kernel and the barrier contain none (tests/test_kernel_names.py).
NOTIFY_KERNEL = "deep_ep_notify"   # a fresh dispatch's numbering and layout
DISPATCH_KERNEL = "deep_ep_dispatch_impl_with_dispatch_copy_epilogue_impl"   # a fresh dispatch's rows
CACHED_DISPATCH_KERNEL = "deep_ep_cached_dispatch_impl_with_dispatch_copy_epilogue_impl"
COMBINE_KERNEL = "deep_ep_combine_impl_with_combine_reduce_epilogue_impl"
BARRIER_KERNEL = "deep_ep_barrier"   # `ElasticBuffer.barrier`
PP_SEND_KERNEL = "deep_ep_pp_send"     # `ElasticBuffer.pp_send`
PP_RECV_KERNEL = "deep_ep_pp_recv"     # `ElasticBuffer.pp_recv`
PP_FLUSH_KERNEL = "deep_ep_pp_flush"   # `ElasticBuffer.pp_set_config`'s steps

# Build-time tunables of the data kernels, each #defined with its default in
# include/deep_ep/common/tunables.cuh (tests/test_kernels_compile.py holds the two lists equal): they
# change how bytes move, never which, so the host needs no matching change and never reads their
# values. Structural defines (EP_THREADS, EP_TOPK...) are not among them: overriding those would
# break the host's view of the kernels.
TUNABLES = frozenset({"EP_SEND_UNROLL", "EP_COMBINE_UNROLL", "EP_COMBINE_SINGLE_UNROLL", "EP_LOAD_NO_L1",
                      "EP_STORE_STREAMING"})


def kernel_source(kind: str) -> str:
    """The CUDA source of a ``kind`` module ("dispatch", "combine", "barrier" or "pp"); the structure
    comes in as defines."""
    if kind not in ("dispatch", "combine", "barrier", "pp", "gin_nic"):
        raise ValueError(f"unknown kernel module kind {kind!r}")
    return f"#include <deep_ep/kernels/{kind}.cuh>\n"


def tunable_defines() -> dict:
    """Build-time tunables from ``DEEP_EP_KERNEL_DEFINES`` (e.g. ``"EP_LOAD_NO_L1=1,EP_SEND_UNROLL=4"``),
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


def _common(transport_nccl: bool, transport_gin: bool = False) -> dict:
    gin = {"EP_TRANSPORT_GIN": 1} if transport_gin else {}   # emulated nodes (comm/transport.cuh)
    return {"EP_TRANSPORT_NCCL": int(transport_nccl), "EP_THREADS": THREADS, **gin,
            **tunable_defines()}


def dispatch_defines(data_bytes: int, num_sf: int, num_topk: int, expand: bool, transport_nccl: bool = False,
                     transport_gin: bool = False) -> dict:
    """Defines of the dispatch module (notify-and-layout and dispatch kernels) for one structure."""
    return {"EP_DATA_BYTES": data_bytes, "EP_NUM_SF": num_sf, "EP_TOPK": num_topk, "EP_EXPAND": int(expand),
            **_common(transport_nccl, transport_gin)}


def combine_defines(hidden: int, num_topk: int, expand: bool, transport_nccl: bool = False,
                    transport_gin: bool = False) -> dict:
    """Defines of the combine module for one structure."""
    return {"EP_HIDDEN": hidden, "EP_TOPK": num_topk, "EP_EXPAND": int(expand),
            **_common(transport_nccl, transport_gin)}


def gin_nic_defines(transport_nccl: bool = False, transport_gin: bool = True) -> dict:
    """Defines of the emulated NIC's module (kernels/gin_nic.cuh; emulated nodes only)."""
    return {"EP_TRANSPORT_NCCL": 0, "EP_TRANSPORT_GIN": 1}


def barrier_defines(transport_nccl: bool = False) -> dict:
    """Defines of the control module (the GPU barrier)."""
    return {"EP_TRANSPORT_NCCL": int(transport_nccl)}


def pp_defines(transport_nccl: bool = False) -> dict:
    """Defines of the pipeline send/recv module (kernels/pp.cuh)."""
    return {"EP_TRANSPORT_NCCL": int(transport_nccl)}


_DEFINES = {"dispatch": dispatch_defines, "combine": combine_defines, "barrier": barrier_defines,
            "pp": pp_defines, "gin_nic": gin_nic_defines}
_GIN_KINDS = ("dispatch", "combine", "gin_nic")   # the kinds built for the emulated GIN
_modules: dict = {}
_modules_lock = threading.Lock()


def build_module(kind: str, structure: tuple, transport_nccl: bool, transport_gin: bool = False):
    """``(key, module)`` for ``kind`` and ``structure`` (the arguments of its ``*_defines``), built once
    per process. Modules of the NCCL transport compile against NCCL's device headers; with
    ``transport_gin`` (emulated nodes) the data kernels use the emulated GIN."""
    gin = {"transport_gin": True} if transport_gin and kind in _GIN_KINDS else {}
    defines = _DEFINES[kind](*structure, transport_nccl=transport_nccl, **gin)
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
