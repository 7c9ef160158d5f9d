"""The GPU backend's kernel modules: their sources, build-time defines, building and loading.

A module is one of ``include/deep_ep/kernels/*.cuh`` compiled for one structural configuration
(row bytes, scale factors, top-k, layout, transport); token counts, rank counts and sizes are run-time
arguments, so a new batch size never compiles. Modules are built once per process (and cached on
disk by `deep_ep.jit`) and loaded on the buffer's device before their first launch.
"""
from __future__ import annotations

import threading

from ... import envs, jit

__all__ = ["THREADS", "SEND_PHASE", "RECEIVE_PHASE", "BOTH_PHASES", "DeferredReceive", "launch_send_phase",
           "NOTIFY_KERNEL", "DISPATCH_KERNEL", "CACHED_DISPATCH_KERNEL", "COMBINE_KERNEL",
           "BARRIER_KERNEL", "PP_SEND_KERNEL", "PP_RECV_KERNEL", "PP_FLUSH_KERNEL", "AGRS_PEERS_KERNEL",
           "AGRS_WAIT_KERNEL", "AGRS_FLAGS_KERNEL", "AGRS_COPY_KERNEL",
           "ENGRAM_GATHER_KERNEL", "ENGRAM_STORE_KERNEL", "TUNABLES", "kernel_source", "tunable_defines",
           "dispatch_defines", "combine_defines", "SINGLE_REDUCTION", "UNREDUCED_RANKS", "combine_layout", "barrier_defines",
           "pp_defines", "agrs_defines", "engram_defines", "build_module", "launch_control", "load_module",
           "num_modules_built"]

THREADS = 512           # threads of the data kernels (EP_THREADS)

# The phases a data kernel runs (EP_DATA_PHASES, a bit mask: kernels/dispatch.cuh): the send phase
# alone (rows out, then the signal; it never waits), the receive phase alone (the wait, rows in), or
# both in one launch (every call but a V1 low-latency call with a receive hook, which goes through
# `launch_send_phase`).
SEND_PHASE = 1
RECEIVE_PHASE = 2
BOTH_PHASES = SEND_PHASE | RECEIVE_PHASE

# The kernels every rank count launches (entry points of include/deep_ep/kernels/*.cuh).
# DeepEP V2's test (tests/elastic/test_ep.py) times a dispatch by the kernels whose names contain
# "dispatch_impl" and "dispatch_copy_epilogue_impl", a combine by "combine_impl" and
# "combine_reduce_epilogue_impl". Each data kernel here does both phases, so its name contains both
# of its call's substrings; the notify kernel and the barrier contain none (tests/test_kernel_names.py).
# DeepEP's V1 test (tests/legacy/test_low_latency.py) times a receive hook's two halves by the
# kernels whose profiler names contain "::dispatch" and "::combine": the data kernels are C++
# kernels in namespace deep_ep, named here by their qualified names.
NOTIFY_KERNEL = "deep_ep_notify"   # a fresh dispatch's numbering and layout
DISPATCH_KERNEL = "deep_ep::dispatch_impl_with_dispatch_copy_epilogue_impl"   # a fresh dispatch's rows
CACHED_DISPATCH_KERNEL = "deep_ep::cached_dispatch_impl_with_dispatch_copy_epilogue_impl"
COMBINE_KERNEL = "deep_ep::combine_impl_with_combine_reduce_epilogue_impl"
BARRIER_KERNEL = "deep_ep_barrier"   # `ElasticBuffer.barrier`
PP_SEND_KERNEL = "deep_ep_pp_send"     # `ElasticBuffer.pp_send`
PP_RECV_KERNEL = "deep_ep_pp_recv"     # `ElasticBuffer.pp_recv`
PP_FLUSH_KERNEL = "deep_ep_pp_flush"   # `ElasticBuffer.pp_set_config`'s steps
AGRS_PEERS_KERNEL = "deep_ep_agrs_peers"   # `ElasticBuffer.agrs_set_config`: the peers' window addresses
AGRS_WAIT_KERNEL = "deep_ep_agrs_wait"     # emulated ranks' AGRS waits (stream waits elsewhere)
AGRS_FLAGS_KERNEL = "deep_ep_agrs_flags"   # emulated ranks' AGRS flags (stream writes elsewhere)
AGRS_COPY_KERNEL = "deep_ep_agrs_copy"     # emulated ranks' AGRS copies (copy engines elsewhere)
ENGRAM_GATHER_KERNEL = "deep_ep_engram_gather"   # `ElasticBuffer.engram_fetch`
ENGRAM_STORE_KERNEL = "deep_ep_engram_store"     # `ElasticBuffer.engram_write`

# Build-time tunables of the data kernels, each #defined with its default in
# include/deep_ep/common/tunables.cuh (tests/test_kernels_compile.py holds the two lists equal): they
# change how bytes move, never which, so the host needs no matching change and never reads their
# values. Structural defines (EP_THREADS, EP_TOPK...) are not among them: overriding those would
# break the host's view of the kernels.
TUNABLES = frozenset({"EP_SEND_UNROLL", "EP_COMBINE_UNROLL", "EP_COMBINE_SINGLE_UNROLL", "EP_LOAD_NO_L1",
                      "EP_STORE_STREAMING"})


def kernel_source(kind: str) -> str:
    """The CUDA source of a ``kind`` module ("dispatch", "combine", "barrier", "pp", "agrs", "engram" or
    "gin_nic"); the structure comes in as defines."""
    if kind not in ("dispatch", "combine", "barrier", "pp", "agrs", "engram", "gin_nic"):
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
    for item in filter(None, (p.strip() for p in (envs.get("DEEP_EP_KERNEL_DEFINES") or "").split(","))):
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


def _gin(transport_gin: int) -> dict:
    # emulated nodes (comm/transport.cuh): 1 direct mode, 2 hybrid mode
    if not transport_gin:
        return {}
    return {"EP_TRANSPORT_GIN": int(transport_gin)}


def _common(transport_nccl: bool, transport_gin: int = 0) -> dict:
    return {"EP_TRANSPORT_NCCL": int(transport_nccl), "EP_THREADS": THREADS, **_gin(transport_gin),
            **tunable_defines()}


def dispatch_defines(data_bytes: int, num_sf: int, num_topk: int, expand: bool, phases: int = BOTH_PHASES,
                     transport_nccl: bool = False, transport_gin: int = 0) -> dict:
    """Defines of the dispatch module (notify-and-layout and dispatch kernels) for one structure;
    ``phases``: what its data kernels run (`SEND_PHASE`, `RECEIVE_PHASE` or `BOTH_PHASES`);
    ``transport_gin``: 0, or the emulated GIN's mode (1 direct, 2 hybrid: both phases only)."""
    return {"EP_DATA_BYTES": data_bytes, "EP_NUM_SF": num_sf, "EP_TOPK": num_topk, "EP_EXPAND": int(expand),
            **_phases_define(phases), **_common(transport_nccl, transport_gin)}


# The combine module's ``expand`` for an expanded handle of a buffer with allow_multiple_reduction=False:
# every (token, slot) row reaches the source unreduced (impls/combine_single.cuh; in hybrid mode across
# nodes impls/combine_hybrid_single.cuh).
SINGLE_REDUCTION = 2
# ... and for a non-expanded handle of such a buffer in hybrid mode across nodes: the forwarders pass
# every rank's row on unreduced, the source adds them in the flat order (impls/combine_hybrid_single.cuh).
# Elsewhere a non-expanded combine has no reduction to leave out (the module of ``False``).
UNREDUCED_RANKS = 3


def combine_layout(do_expand: bool, allow_multiple_reduction: bool, hybrid: bool = False):
    """The ``expand`` of the combine module that combines a handle of layout ``do_expand`` on a buffer
    with ``allow_multiple_reduction``, ``hybrid``: in hybrid mode across nodes (forwarders in each
    node): ``False`` (non-expanded, which reduces per rank), `UNREDUCED_RANKS` (non-expanded, hybrid,
    without multiple reduction), ``True`` (expanded, multiple reduction) or `SINGLE_REDUCTION`."""
    if not do_expand:
        return UNREDUCED_RANKS if hybrid and not allow_multiple_reduction else False
    return True if allow_multiple_reduction else SINGLE_REDUCTION


def combine_defines(hidden: int, num_topk: int, expand, phases: int = BOTH_PHASES,
                    transport_nccl: bool = False, transport_gin: int = 0) -> dict:
    """Defines of the combine module for one structure (``phases`` as in `dispatch_defines`);
    ``expand`` as `combine_layout` gives it (`SINGLE_REDUCTION` and `UNREDUCED_RANKS` add
    ``EP_SINGLE_REDUCTION=1``, the latter with ``EP_EXPAND=0``; the other modules keep their names and
    cache keys)."""
    unreduced = expand in (SINGLE_REDUCTION, UNREDUCED_RANKS)
    expanded = bool(expand) and expand != UNREDUCED_RANKS
    single = {"EP_SINGLE_REDUCTION": 1} if unreduced else {}
    return {"EP_HIDDEN": hidden, "EP_TOPK": num_topk, "EP_EXPAND": int(expanded), **single,
            **_phases_define(phases), **_common(transport_nccl, transport_gin)}


def _phases_define(phases: int) -> dict:
    # Only a half is named: the kernels' default is both, so the usual modules keep their cache keys.
    if phases not in (SEND_PHASE, RECEIVE_PHASE, BOTH_PHASES):
        raise ValueError(f"phases must be SEND_PHASE, RECEIVE_PHASE or BOTH_PHASES, got {phases!r}")
    return {} if phases == BOTH_PHASES else {"EP_DATA_PHASES": int(phases)}


def gin_nic_defines(transport_nccl: bool = False, transport_gin: int = 1) -> dict:
    """Defines of the emulated NIC's module (kernels/gin_nic.cuh; emulated nodes only)."""
    return {"EP_TRANSPORT_NCCL": 0, "EP_TRANSPORT_GIN": 1}


def barrier_defines(transport_nccl: bool = False, transport_gin: int = 0) -> dict:
    """Defines of the control module (the GPU barrier); ``transport_gin`` as in `dispatch_defines`."""
    return {"EP_TRANSPORT_NCCL": int(transport_nccl), **_gin(transport_gin)}


def pp_defines(transport_nccl: bool = False) -> dict:
    """Defines of the pipeline send/recv module (kernels/pp.cuh)."""
    return {"EP_TRANSPORT_NCCL": int(transport_nccl)}


def agrs_defines(transport_nccl: bool = False) -> dict:
    """Defines of the all-gather / reduce-scatter module (kernels/agrs.cuh)."""
    return {"EP_TRANSPORT_NCCL": int(transport_nccl)}


def engram_defines(transport_nccl: bool = False) -> dict:
    """Defines of the Engram module (kernels/engram.cuh)."""
    return {"EP_TRANSPORT_NCCL": int(transport_nccl)}


_DEFINES = {"dispatch": dispatch_defines, "combine": combine_defines, "barrier": barrier_defines,
            "pp": pp_defines, "agrs": agrs_defines, "engram": engram_defines, "gin_nic": gin_nic_defines}
_GIN_KINDS = ("dispatch", "combine", "barrier", "gin_nic")   # the kinds built for the emulated GIN
_modules: dict = {}
_modules_lock = threading.Lock()


def build_module(kind: str, structure: tuple, transport_nccl: bool, transport_gin: int = 0):
    """``(key, module)`` for ``kind`` and ``structure`` (the arguments of its ``*_defines``), built once
    per process. Modules of the NCCL transport compile against NCCL's device headers; with
    ``transport_gin`` (emulated nodes: 1 direct mode, 2 hybrid mode) the data kernels use the
    emulated GIN (the NIC's module is the same for both)."""
    gin = {"transport_gin": int(transport_gin)} if transport_gin and kind in _GIN_KINDS else {}
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


def launch_control(backend, stream: int, num_blocks: int, launch) -> None:
    """Call ``launch()``, which launches a control kernel of ``backend`` (a dispatch's notify kernel,
    the GPU barrier) of ``num_blocks`` blocks on the raw stream ``stream``. On emulated nodes the
    kernel's puts to other nodes need this rank's emulated NIC, which runs only beside a kernel that
    counts its blocks in it (comm/gin_control.cuh's ``end_block``): it is launched as a data kernel's is (`deep_ep.comm.gin.EmulatedGinDirectTransport.launch_data`)."""
    if backend.transport_gin and not getattr(backend, "transport_nccl", False):   # NCCL's GIN has no NIC kernel
        backend.transport.launch_data(backend.module("gin_nic", ()), stream, num_blocks, launch)
    else:
        launch()


def load_module(mod, device_index: int) -> None:
    """Load every kernel of ``mod`` on the device now (not at its first launch). The module itself is
    loaded first: that is the step that waits for the device, and a cached module may list no kernels."""
    mod.load(device_index)
    for name in mod.kernel_names():
        mod.function(name).handle(device_index)


def num_modules_built() -> int:
    """Distinct kernel modules this process has built or loaded (the bench reports it)."""
    return len(_modules)


class DeferredReceive:
    """The receive phase of a data kernel whose send phase `launch_send_phase` launched alone: a launch
    of the receive-only variant with a copy of the send's arguments (the same outputs, layout and
    call tag), made when the send was. ``keep`` holds the tensors the receive still reads."""

    __slots__ = ("backend", "prepared", "num_blocks", "call", "keep")

    def __init__(self, backend, prepared, num_blocks: int, call: int, keep: tuple) -> None:
        self.backend, self.prepared, self.num_blocks, self.call, self.keep = backend, prepared, num_blocks, call, keep

    def launch(self) -> None:
        """Launch the receive phase on the backend's current launch stream (once). An error a kernel
        recorded meanwhile does not stop it: its wait keeps the window's epochs in step with the
        peers' (it moves nothing then), and the error is raised at the next call, as without a split.

        Raises:
            RuntimeError: launched before, or the buffer is unusable after an earlier GPU error.
        """
        if self.prepared is None:
            raise RuntimeError("deep_ep: this receive phase was launched already")
        prepared, self.prepared, self.keep = self.prepared, None, ()
        backend = self.backend
        if backend.broken is not None:
            backend.raise_if_broken()
        backend.launch_data(prepared, self.num_blocks)
        backend.call_record.launched_call = self.call   # errors name the call the send belonged to


def launch_send_phase(backend, kind: str, structure: tuple, prepared, num_blocks: int, keep: tuple = ()):
    """Launch the send phase alone of the data kernel of ``prepared`` (a launch of the ``kind``
    module of ``structure`` with both phases, its arguments set for this call): the send-only
    variant with the same arguments. Returns the `DeferredReceive` of the receive-only variant.
    With the default `BOTH_PHASES` a call launches ``prepared`` itself; these are the only other
    variants launched.

    Raises:
        jit.LaunchError: as `GPUBackend.launch_data`.
    """
    name, device, cooperative = prepared.function.name, backend.device.index, backend.cooperative
    send = backend.module(kind, tuple(structure) + (SEND_PHASE,)).function(name).prepare(
        num_blocks, THREADS, prepared.args, device=device, cooperative=cooperative)
    # The arguments as they are now: the next call through ``prepared`` may change them before the receive.
    snapshot = tuple(type(arg).from_buffer_copy(arg) for arg in prepared.args)
    receive = backend.module(kind, tuple(structure) + (RECEIVE_PHASE,)).function(name).prepare(
        num_blocks, THREADS, snapshot, device=device, cooperative=cooperative)
    backend.launch_data(send, num_blocks)
    return DeferredReceive(backend, receive, num_blocks, backend.calls, keep)
