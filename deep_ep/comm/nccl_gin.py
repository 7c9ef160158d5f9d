"""The transport of a torch group on GPUs over several NVLink domains: NCCL's GIN between nodes.

`open_nccl_transport` picks a buffer's transport on a torch group: `deep_ep.comm.lsa.NcclLsaTransport`
when NCCL's LSA team holds every rank (one NVLink domain), else `NcclGinTransport`: the same
symmetric window and device communicator, whose kernels (built with ``EP_TRANSPORT_NCCL=1`` and
``EP_TRANSPORT_GIN=1`` direct or ``2`` hybrid) reach the ranks of their node by loads and stores and
every other rank through ``NcclGinTransport`` of comm/gin.cuh (`ncclGin` puts and signals).

What it asks of NCCL (`deep_ep.comm.devcomm.GinRequirements`): ``num_allocated_qps`` GIN contexts
(NCCL may give fewer; the kernels use those it gave), ``2 R`` signals per context (the scale-out
transports' [epoch parity][source rank] signals) and one counter, exclusive contexts and RAIL
connections in hybrid mode (FULL in direct mode) from NCCL 2.29.7, and ``sl_idx`` as the traffic
class from 2.30.3. Before anything is allocated, every rank checks the loaded NCCL and its
communicator (`deep_ep.topology.require_gin_features`), the ranks agree over the torch group that
every check passed (`agree_at_creation`: else every rank raises, naming the first rank that
refused) and on the least ``num_allocated_qps``, and every rank warns that this path has not run
on an RDMA NIC. After the device communicator they agree on the least number of GIN contexts NCCL
gave, which every rank's kernels use. The window is released before the device communicator it
was registered with.

The registered window is larger than ``num_bytes``: a GIN put reads its source from the registered
window, so the staging area (a receive half per rank: ``R * half_bytes``) follows the buffer's
bytes, and in hybrid mode the forwarding area and combine's inbox (two halves each) follow it.
"""
from __future__ import annotations

import ctypes
import functools
import warnings
from dataclasses import dataclass

import torch

from .. import jit, topology
from .devcomm import DeviceCommunicator, GinRequirements, comm_gin_types, devcomm_layout
from .gin import receive_halves
from .lsa import NcclLsaTransport
from .nccl import SymmetricWindow, acquire_communicator, first_failed_rank, group_lsa_team, lsa_team, nccl_version

__all__ = ["NcclGinFields", "NcclGinHybridFields", "ScaleoutWindow", "scaleout_window", "transport_args_type",
           "gin_args_layout", "GIN_PROBE_SOURCE", "NcclGinTransport", "open_nccl_transport", "UNVALIDATED_WARNING",
           "MAX_PUT_BYTES", "agree_at_creation"]

#: the largest single put the kernels issue (a row or slot is one put below it)
MAX_PUT_BYTES = 1 << 30
#: the window's parts start at multiples of this (NCCL_WIN_REQUIRED_ALIGNMENT), its size at 2 MiB
_ALIGN = 4096
_WINDOW_GRANULE = 2 << 20
#: what every rank of such a buffer is told at its creation
UNVALIDATED_WARNING = ("deep_ep: this buffer runs the scale-out kernels over NCCL's GIN across NVLink domains, a "
                       "path that compiles and whose kernels run on emulated nodes, but it has not been validated "
                       "on RDMA hardware; a wait for a peer gives up after num_gpu_timeout_secs and the next call "
                       "raises TimeoutError naming the rank, the peer and the phase (docs/scaleout.md)")


class NcclGinFields(ctypes.Structure):
    """Host mirror of the scale-out fields of ``deep_ep::comm::TransportArgs`` over NCCL
    (comm/transport.cuh, ``EP_TRANSPORT_NCCL=1`` and ``EP_TRANSPORT_GIN=1``), after the window."""
    _fields_ = [("gin_comm", ctypes.c_void_p), ("done", ctypes.c_void_p), ("recv_offset", ctypes.c_int64),
                ("half_bytes", ctypes.c_int64), ("stage_offset", ctypes.c_int64), ("max_put_bytes", ctypes.c_int),
                ("num_contexts", ctypes.c_int), ("node_ranks", ctypes.c_int)]


class NcclGinHybridFields(NcclGinFields):
    """`NcclGinFields`, then hybrid mode's (``EP_TRANSPORT_GIN=2``): the forwarding area and the inbox."""
    _fields_ = [("forward_offset", ctypes.c_int64), ("inbox_offset", ctypes.c_int64)]


def _field_list(struct: type) -> list:
    return [field for cls in reversed(struct.__mro__) for field in cls.__dict__.get("_fields_", ())]


@functools.lru_cache(maxsize=None)
def transport_args_type(window_offset: int, hybrid: bool) -> type:
    """The ctypes struct of the kernels' ``TransportArgs`` over NCCL's GIN: the ``ncclDevComm`` (its
    bytes up to the window handle at ``window_offset``, `deep_ep.comm.devcomm.DevCommLayout`), the
    window, then `NcclGinFields` (``hybrid``: `NcclGinHybridFields`)."""
    fields = _field_list(NcclGinHybridFields if hybrid else NcclGinFields)
    return type("NcclGinTransportArgs", (ctypes.Structure,),
                {"_fields_": [("comm", ctypes.c_uint8 * window_offset), ("window", ctypes.c_void_p)] + fields})


#: sizeof(TransportArgs) and the offset of each scale-out field, built with NCCL's GIN transport
GIN_PROBE_SOURCE = r"""
#include <cuda/std/cstddef>
#include <deep_ep/comm/transport.cuh>
#define EP_OFFSET(field) offsetof(deep_ep::comm::TransportArgs, field)
extern "C" __device__ const unsigned long long deep_ep_gin_args_layout[] = {
    sizeof(deep_ep::comm::TransportArgs), EP_OFFSET(window), EP_OFFSET(gin_comm), EP_OFFSET(done),
    EP_OFFSET(recv_offset), EP_OFFSET(half_bytes), EP_OFFSET(stage_offset), EP_OFFSET(max_put_bytes),
    EP_OFFSET(num_contexts), EP_OFFSET(node_ranks),
#if EP_TRANSPORT_GIN == 2
    EP_OFFSET(forward_offset), EP_OFFSET(inbox_offset),
#endif
};
"""


def gin_args_layout(gin_mode: int, nccl_include_dir=None) -> list:
    """``[sizeof, offset of window, of each scale-out field]`` of ``TransportArgs`` as NVRTC lays it
    out with ``EP_TRANSPORT_GIN=gin_mode`` (1 or 2) against the NCCL headers the kernels use (or
    ``nccl_include_dir``). Works without a GPU.

    Raises:
        deep_ep.jit.CompileError / JitEnvironmentError: the probe cannot be built.
    """
    import struct
    from ..jit.elf import symbol_bytes
    mod = jit.build(f"deep_ep_gin_args_probe_{gin_mode}", GIN_PROBE_SOURCE, use_nccl=True,
                    nccl_include_dir=str(nccl_include_dir) if nccl_include_dir else None,
                    defines={"EP_TRANSPORT_NCCL": 1, "EP_TRANSPORT_GIN": int(gin_mode)})
    raw = symbol_bytes(mod.cubin, "deep_ep_gin_args_layout")
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


@dataclass(frozen=True)
class ScaleoutWindow:
    """Where the scale-out parts lie in a rank's registered window (offsets from its start): the
    buffer's ``num_bytes``, the staging area (``num_ranks`` receive halves), in hybrid mode the
    forwarding area and the inbox (two halves each); ``window_bytes`` in all, a multiple of 2 MiB."""
    num_bytes: int
    recv_offset: int
    half_bytes: int
    stage_offset: int
    forward_offset: int
    inbox_offset: int
    window_bytes: int


def scaleout_window(num_ranks: int, num_bytes: int, hybrid: bool) -> ScaleoutWindow:
    """The `ScaleoutWindow` of a buffer of ``num_bytes`` for ``num_ranks`` ranks (``hybrid``: with
    the forwarding area and the inbox; else their offsets are 0)."""
    def align(value: int, granule: int = _ALIGN) -> int:
        return -(-value // granule) * granule

    recv_offset, half = receive_halves(num_ranks, num_bytes)
    stage = align(num_bytes)
    end = stage + num_ranks * half
    forward = inbox = 0
    if hybrid:
        forward = align(end)
        inbox = align(forward + 2 * half)
        end = inbox + 2 * half
    return ScaleoutWindow(num_bytes=num_bytes, recv_offset=recv_offset, half_bytes=half, stage_offset=stage,
                          forward_offset=forward, inbox_offset=inbox, window_bytes=align(end, _WINDOW_GRANULE))


def _gin_requirements(num_ranks: int, num_allocated_qps: int, allow_hybrid_mode: bool, sl_idx: int) -> GinRequirements:
    """What the scale-out kernels use of the device communicator's GIN (the emulated GIN allocates the
    same per context: `deep_ep.comm.gin.EmulatedGinState`)."""
    return GinRequirements(contexts=num_allocated_qps, signals=2 * num_ranks, counters=1,
                           rail=bool(allow_hybrid_mode), traffic_class=int(sl_idx))


#: why a rank refused the transport before the device communicator, by stage (the code gathered
#: from every rank is ``4 * (index + 1) + kind``, kind the index of its exception's class in
#: `_REFUSAL_KINDS`, anything else ``3``: a RuntimeError on the ranks that did not refuse)
_REFUSALS = ("NCCL's LSA team does not split the group into NVLink domains of consecutive ranks",
             "the group has more ranks than the kernels' peer table holds",
             "the layout probe of the NCCL headers failed",
             "the loaded NCCL, its communicator or the node size cannot run GIN in this mode",
             "num_bytes is too small for the scale-out window")
_REFUSAL_KINDS = (NotImplementedError, ValueError, RuntimeError)
#: what a rank reports of the device communicator: created with GIN contexts, failed, none given
_DEVCOMM_MADE, _DEVCOMM_FAILED, _DEVCOMM_NO_CONTEXT = 0, 1, 2


def _refusal_code(stage: int, error: Exception) -> int:
    kind = next((i for i, cls in enumerate(_REFUSAL_KINDS) if isinstance(error, cls)), len(_REFUSAL_KINDS))
    return 4 * (stage + 1) + kind


def _refusal_of(code: int) -> tuple:
    """``(exception class, reason)`` of a rank's refusal code (`_refusal_code`)."""
    kind = code % 4
    return (_REFUSAL_KINDS[kind] if kind < len(_REFUSAL_KINDS) else RuntimeError), _REFUSALS[code // 4 - 1]


def _all_reduce_max(words: torch.Tensor, group) -> None:
    import torch.distributed as dist
    dist.all_reduce(words, op=dist.ReduceOp.MAX, group=group)


def agree_at_creation(group, device: torch.device, code: int, value: int) -> tuple:
    """Collective over ``group``: ``(every rank's code, by rank; the least value any rank passed)``.

    One all-reduce (MAX) of ``R + 1`` int64 words, on ``device`` for a group that carries CUDA
    tensors only and on the CPU otherwise (as `deep_ep.comm.nccl.broadcast_unique_id` sends the
    unique id): this rank's word holds ``code``, the last one ``-value``.

    Args:
        group: the torch group. device: this rank's CUDA device. code: this rank's, ``>= 0``
            (0: nothing to report). value: this rank's, a non-negative int.
    """
    from .nccl import _carries_cpu_tensors
    num_ranks = int(group.size())
    words = torch.zeros(num_ranks + 1, dtype=torch.int64, device="cpu" if _carries_cpu_tensors(group) else device)
    words[int(group.rank())] = int(code)
    words[num_ranks] = -int(value)
    _all_reduce_max(words, group)
    gathered = [int(word) for word in words.tolist()]
    return gathered[:num_ranks], -gathered[num_ranks]


@dataclass(frozen=True)
class _Plan:
    """What every rank's checks found and the group agreed on, before the device communicator."""
    hybrid: bool
    node_ranks: int
    window: ScaleoutWindow
    num_allocated: int


class NcclGinTransport(NcclLsaTransport):
    """A buffer's transport on a torch group over several NVLink domains (collective: every rank of
    ``group`` creates it with the same arguments; it holds a lease on the communicator until
    `destroy`). Same interface as `NcclLsaTransport`, plus ``gin_define`` (the kernels'
    ``EP_TRANSPORT_GIN``: 2 hybrid mode with nodes of several ranks, else 1), ``state`` (its
    `ScaleoutWindow`, with ``node_ranks`` and ``num_contexts``) and ``num_nvlink_ranks``.

    Before each collective NCCL call the ranks agree over ``group`` (`agree_at_creation`), so that
    a refusal raises on every rank instead of leaving the others waiting in NCCL: on their checks
    and the least ``num_allocated_qps`` before the device communicator, on its creation and the
    least number of GIN contexts NCCL gave after it (every rank uses that many).

    Args:
        group: the torch group. num_bytes: the buffer's window bytes (`ElasticBuffer`'s).
        device: this rank's CUDA device. allow_hybrid_mode, sl_idx, num_allocated_qps: the buffer's
            (``num_allocated_qps`` 0: 129 hybrid, 17 direct).

    Raises (on every rank: a rank whose own check failed raises its error, the others the same
    class naming the first rank that refused and why):
        ValueError: LSA teams that do not split the group into consecutive, equal domains, more
            ranks than the kernels' peer table holds, or ``num_bytes`` too small for the window.
        NotImplementedError: hybrid mode on nodes of more than 32 ranks.
        RuntimeError: a feature the loaded NCCL lacks, or a communicator without GIN
            (`deep_ep.topology.require_gin_features`); NCCL gave some rank no GIN context; the
            device communicator failed on another rank.
        deep_ep.cuda.nccl.NcclError: an NCCL call failed on this rank (the device communicator's
            GIN requirements refused included).
    """

    kernel_define = 1

    def __init__(self, group, num_bytes: int, device: torch.device, allow_hybrid_mode: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0) -> None:
        self.group, self.device = group, device
        self.rank, self.num_ranks = int(group.rank()), int(group.size())
        self.num_bytes = int(num_bytes)
        self.window = self.devcomm = None
        self._window_view = None
        self._device_words = []
        self.lease = acquire_communicator(group, device)
        self.comm = self.lease.comm
        try:
            plan = self._agreed_plan(allow_hybrid_mode, sl_idx, num_allocated_qps)
            warnings.warn(UNVALIDATED_WARNING, RuntimeWarning, stacklevel=4)
            self.num_nvlink_ranks = plan.node_ranks
            self.gin_define = 2 if plan.hybrid else 1
            num_contexts = self._agreed_device_communicator(
                _gin_requirements(self.num_ranks, plan.num_allocated, allow_hybrid_mode, sl_idx))
            # after the device communicator, so that the window is registered with its GIN
            self.state = _State(plan.window, plan.node_ranks, num_contexts)
            self.window = SymmetricWindow(self.comm, self.state.window.window_bytes, device,
                                          agree=lambda ok: first_failed_rank(self.group, device, ok))
            self._args = self._pack_args(plan.hybrid)
        except BaseException:
            self._release_resources()
            raise

    def _agreed_plan(self, allow_hybrid_mode: bool, sl_idx: int, num_allocated_qps: int) -> _Plan:
        """This rank's checks, then the group's agreement on them (collective): every rank returns
        the same `_Plan` (the least ``num_allocated_qps``) or raises."""
        from ..backends.gpu.abi import MAX_RANKS
        from ..resources import DeviceResources, default_num_allocated_qps
        stage, error, plan = 0, None, None
        try:
            team_size, team_rank = lsa_team(self.comm)
            domains = topology.domains_from_nvlink_ranks(self.num_ranks, self.rank, team_size, allow_hybrid_mode)
            if team_rank != self.rank % team_size:
                raise ValueError(f"rank {self.rank}: NCCL's LSA team (index {team_rank} of {team_size}) does not "
                                 f"hold consecutive ranks of the group")
            stage = 1
            if self.num_ranks > MAX_RANKS:
                raise ValueError(f"{self.num_ranks} ranks exceed the kernels' peer table of {MAX_RANKS}")
            stage = 2
            layout = devcomm_layout()
            gin_type, railed_type = comm_gin_types(self.comm, layout)
            stage = 3
            topology.require_gin_features(domains, self.rank, nccl_version(),
                                          railed_type if allow_hybrid_mode else gin_type, sl_idx)
            stage = 4
            hybrid = bool(allow_hybrid_mode) and team_size > 1
            allocated = num_allocated_qps or default_num_allocated_qps(
                DeviceResources(num_device_sms=1, max_sms=1, nvlink_gbs=0.0), allow_hybrid_mode)
            plan = _Plan(hybrid, team_size, scaleout_window(self.num_ranks, self.num_bytes, hybrid), int(allocated))
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it before NCCL's collective calls
            error = exc
        codes, least_allocated = agree_at_creation(self.group, self.device,
                                                   0 if error is None else _refusal_code(stage, error),
                                                   0 if plan is None else plan.num_allocated)
        refused = [rank for rank, code in enumerate(codes) if code]
        if error is not None:
            if len(refused) > 1:
                error.add_note(f"ranks {refused} of the group refused the scale-out transport")
            raise error
        if refused:
            first = refused[0]
            cls, reason = _refusal_of(codes[first])
            raise cls(f"rank {self.rank}: rank {first} of the group refused the scale-out transport over NCCL's "
                      f"GIN ({reason}; its own error says more; refused on ranks {refused}), so no rank creates it")
        return _Plan(plan.hybrid, plan.node_ranks, plan.window, least_allocated)

    def _agreed_device_communicator(self, requirements: GinRequirements) -> int:
        """Create the device communicator (collective), then agree on it over the group: the least
        number of GIN contexts NCCL gave any rank, at most ``requirements.contexts`` (every rank's
        kernels use that many), or raise on every rank."""
        error, given, code = None, 0, _DEVCOMM_MADE
        try:
            self.devcomm = DeviceCommunicator(self.comm, self.num_ranks, gin=requirements)
            given = int(self.devcomm.gin_context_count)
            code = _DEVCOMM_MADE if given > 0 else _DEVCOMM_NO_CONTEXT
        except Exception as exc:  # noqa: BLE001 - the others must not go on to register the window
            error, code = exc, _DEVCOMM_FAILED
        codes, least_given = agree_at_creation(self.group, self.device, code, given)
        if error is not None:
            raise error
        failed = [rank for rank, rank_code in enumerate(codes) if rank_code == _DEVCOMM_FAILED]
        if failed:
            raise RuntimeError(f"rank {self.rank}: NCCL could not create the device communicator on ranks {failed} "
                               f"(their own errors say why), so no rank goes on")
        empty = [rank for rank, rank_code in enumerate(codes) if rank_code == _DEVCOMM_NO_CONTEXT]
        if empty:
            raise RuntimeError(f"rank {self.rank}: NCCL's device communicator holds no GIN context on ranks {empty} "
                               f"({requirements.contexts} asked for)")
        return min(requirements.contexts, least_given)

    def _release_resources(self) -> None:
        """Release in the reverse order of creation: the window (registered with the device
        communicator's GIN), the device communicator, then the lease on the communicator."""
        if self.window is not None:
            self.window.destroy()
            self.window = None
        self._device_words = []
        if self.devcomm is not None:
            self.devcomm.destroy()
            self.devcomm = None
        self.lease.release()

    def _pack_args(self, hybrid: bool):
        """The kernels' ``TransportArgs``: the device communicator and window (as on one node), then
        the scale-out fields; the GIN calls read a copy of the ``ncclDevComm`` in device memory."""
        devcomm = self.devcomm.devcomm_bytes()
        gin_comm, done = self._device_words = _device_words(devcomm, self.device)
        window = self.state.window
        layout = self.devcomm.layout
        args = transport_args_type(layout.window_offset, hybrid)()
        ctypes.memmove(args.comm, devcomm, layout.devcomm_size)
        args.window = int(self.window.handle)
        fields = dict(gin_comm=gin_comm.data_ptr(), done=done.data_ptr(), recv_offset=window.recv_offset,
                      half_bytes=window.half_bytes, stage_offset=window.stage_offset, max_put_bytes=MAX_PUT_BYTES,
                      num_contexts=self.state.num_contexts, node_ranks=self.state.node_ranks)
        if hybrid:
            fields.update(forward_offset=window.forward_offset, inbox_offset=window.inbox_offset)
        for name, value in fields.items():
            setattr(args, name, value)
        return args

def _device_words(devcomm: bytes, device: torch.device) -> tuple:
    """``(the ncclDevComm's bytes, the block counts [2] int32 zeroed)`` in device memory, written
    before any kernel runs."""
    gin_comm = torch.frombuffer(bytearray(devcomm), dtype=torch.uint8).to(device)
    done = torch.zeros(2, dtype=torch.int32, device=device)
    torch.cuda.current_stream(device).synchronize()
    return gin_comm, done


@dataclass(frozen=True)
class _State:
    """What the GPU backend reads of a scale-out transport: its window's parts, the ranks of a node,
    the contexts the kernels use."""
    window: ScaleoutWindow
    node_ranks: int
    num_contexts: int


def open_nccl_transport(group, num_bytes: int, device: torch.device, config):
    """The transport of a GPU buffer on the torch group ``group`` (collective): `NcclLsaTransport`
    when NCCL's LSA team holds every rank, else `NcclGinTransport` with ``config``'s
    (`deep_ep.backends.base.BufferConfig`) mode, ``sl_idx`` and ``num_allocated_qps``.

    Raises:
        what the transport raises.
    """
    team_size, _ = group_lsa_team(group, device)
    if team_size == int(group.size()):
        return NcclLsaTransport(group, num_bytes, device)
    return NcclGinTransport(group, num_bytes, device, allow_hybrid_mode=config.allow_hybrid_mode,
                            sl_idx=config.sl_idx, num_allocated_qps=config.num_allocated_qps)
