"""Domains of a group: physical ``(RDMA ranks, NVLink ranks)`` and logical ``(scale-out, scale-up)``.

Physical: the group's ``R`` ranks form ``R / N`` NVLink domains of ``N`` ranks each, reached from one
another over RDMA. ``N`` is

* on a torch group on GPUs: the size of NCCL's LSA team (``ncclTeamLsa``) on the buffer's
  communicator (torch's NCCL one, or a private one: `deep_ep.comm.nccl`), which must divide ``R``, with
  the ranks of one domain consecutive (rank ``r`` is NVLink rank ``r % N`` of RDMA rank ``r // N``);
* on a group on the CPU backend: ``R`` (one domain), unless ``EP_CPU_NUM_NVLINK_RANKS`` declares ``N``, so
  that the CPU backend can act as ``R / N`` nodes;
* on an emulated-rank group (`deep_ep.emulated.EmulatedGroup`): its ``num_nvlink_ranks`` (default
  ``R``; ``EP_EMULATED_NUM_NVLINK_RANKS`` or the constructor's argument make one GPU act as several
  nodes, whose ranks reach each other through an emulated GIN).

Logical: what the algorithms use. With ``allow_hybrid_mode`` (hybrid: RDMA between nodes, then
NVLink forwarding inside a node) it is the physical split; without (direct: every rank reaches every
rank itself) it is ``(1, R)``. Rank ``r`` is scale-out rank ``r // S`` and scale-up rank ``r % S``
(``S`` scale-up ranks).

GPU buffers spanning more than one NVLink domain need NCCL GIN (GPU-initiated networking, NCCL >=
2.28.7); `require_scaleout_support` names the versions before anything is made, and
`require_gin_features` what the NCCL GIN transport (`deep_ep.comm.nccl_gin`) needs of the loaded
NCCL and of its communicator before it allocates anything. On such buffers the experimental
primitives refuse to run (`require_one_nvlink_domain`): their GPU paths stay within one domain.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import envs

__all__ = ["Domains", "NCCL_GIN_MIN_VERSION", "NCCL_GIN_FEATURES", "domains_from_nvlink_ranks",
           "cpu_num_nvlink_ranks", "group_num_nvlink_ranks", "group_domains", "nccl_version_text",
           "require_scaleout_support", "require_gin_features", "NCCL_GIN_QUERY_VERSION",
           "NCCL_GIN_TRAFFIC_CLASS_VERSION", "MAX_HYBRID_NODE_RANKS", "require_one_nvlink_domain"]

#: The first NCCL whose device API has GIN (``nccl_device/gin.h``), as ``ncclGetVersion`` codes it.
NCCL_GIN_MIN_VERSION = 22807

#: NCCL versions that bring the GIN features a scale-out transport may use (docs/scaleout.md).
NCCL_GIN_FEATURES = {
    "GIN put, signal, counter, flush; World / LSA / Rail teams": 22807,
    "communicator properties (ncclCommQueryProperties: whether the communicator has GIN)": 22900,
    "GIN connection types (FULL / RAIL), exclusive contexts, queue depth, VA signals, the rails' GIN type": 22907,
    "GIN traffic class (RDMA service level)": 23003,
}
#: The NCCL GIN transport asks the communicator whether it has GIN (else it cannot tell a missing
#: NIC from a working one before the first wait times out).
NCCL_GIN_QUERY_VERSION = 22900
#: ``sl_idx`` becomes GIN's traffic class (``ginTrafficClass``); earlier releases cannot set it.
NCCL_GIN_TRAFFIC_CLASS_VERSION = 23003

#: The most ranks of a node in hybrid mode across nodes: the forwarding kernels
#: (``impls/dispatch_forward.cuh``, ``impls/combine_forward.cuh``) give each rank of a node a warp lane.
MAX_HYBRID_NODE_RANKS = 32

_CPU_VARIABLE = "EP_CPU_NUM_NVLINK_RANKS"


@dataclass(frozen=True)
class Domains:
    """One rank's place in its group's domains (every field is DeepEP's buffer attribute of that name)."""
    num_rdma_ranks: int
    num_nvlink_ranks: int
    num_scaleout_ranks: int
    num_scaleup_ranks: int
    scaleout_rank_idx: int
    scaleup_rank_idx: int

    @property
    def physical(self) -> tuple:
        """``(num_rdma_ranks, num_nvlink_ranks)``."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    @property
    def logical(self) -> tuple:
        """``(num_scaleout_ranks, num_scaleup_ranks)``."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks


def domains_from_nvlink_ranks(num_ranks: int, rank: int, num_nvlink_ranks: int,
                              allow_hybrid_mode: bool = True) -> Domains:
    """The domains of rank ``rank`` of ``num_ranks`` when NVLink domains hold ``num_nvlink_ranks``.

    Raises:
        ValueError: ``num_nvlink_ranks`` is not in ``[1, num_ranks]`` or does not divide ``num_ranks``,
        or ``rank`` is not in ``[0, num_ranks)``.
    """
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside a group of {num_ranks} ranks")
    if not 1 <= num_nvlink_ranks <= num_ranks or num_ranks % num_nvlink_ranks:
        raise ValueError(f"NVLink domains of {num_nvlink_ranks} ranks cannot split a group of {num_ranks} "
                         f"ranks evenly")
    num_rdma_ranks = num_ranks // num_nvlink_ranks
    if allow_hybrid_mode:
        scaleout, scaleup = num_rdma_ranks, num_nvlink_ranks
    else:
        scaleout, scaleup = 1, num_ranks
    return Domains(num_rdma_ranks=num_rdma_ranks, num_nvlink_ranks=num_nvlink_ranks, num_scaleout_ranks=scaleout,
                   num_scaleup_ranks=scaleup, scaleout_rank_idx=rank // scaleup, scaleup_rank_idx=rank % scaleup)


def cpu_num_nvlink_ranks(num_ranks: int) -> int:
    """NVLink ranks of a CPU group of ``num_ranks``: ``EP_CPU_NUM_NVLINK_RANKS`` when set, else all.

    Raises:
        ValueError: the variable is not a positive integer dividing ``num_ranks``.
    """
    text = envs.get(_CPU_VARIABLE)
    if text is None:
        return num_ranks
    value = text.strip()
    if not value.isdigit() or int(value) < 1 or num_ranks % int(value):
        raise ValueError(f"{_CPU_VARIABLE}={text!r}: expected the ranks of one emulated NVLink domain, a "
                         f"positive integer dividing the group's {num_ranks} ranks")
    return int(value)


def _nccl_lsa_team(group) -> tuple:
    """``(LSA team size, this rank's index in it)`` on the NCCL communicator a GPU buffer of the torch
    group ``group`` uses (`deep_ep.comm.nccl.group_lsa_team`: torch's, or a private one)."""
    import torch
    from .comm.nccl import group_lsa_team
    return group_lsa_team(group, torch.device("cuda", torch.cuda.current_device()))


def group_num_nvlink_ranks(group, rank: int, num_ranks: int, is_cpu: bool) -> int:
    """Ranks of ``group``'s NVLink domains (the module docstring says how each kind of group gets it).

    Raises:
        ValueError: a bad ``EP_CPU_NUM_NVLINK_RANKS``, or NCCL LSA teams that do not split the group
        into consecutive, equal domains.
    """
    if is_cpu:
        return cpu_num_nvlink_ranks(num_ranks)
    import torch.distributed as dist
    if not isinstance(group, dist.ProcessGroup):
        nvlink = getattr(group, "num_nvlink_ranks", None)   # emulated ranks: one GPU, maybe several nodes
        return nvlink() if callable(nvlink) else num_ranks
    team_size, team_rank = _nccl_lsa_team(group)
    if team_size < 1 or num_ranks % team_size or team_rank != rank % team_size:
        raise ValueError(f"rank {rank}: NCCL's LSA team ({team_size} ranks, this rank's index {team_rank}) does "
                         f"not split the group of {num_ranks} ranks into NVLink domains of consecutive ranks")
    return team_size


def group_domains(group, rank: int, num_ranks: int, is_cpu: bool, allow_hybrid_mode: bool = True) -> Domains:
    """`Domains` of rank ``rank`` of ``group`` (``is_cpu``: the group runs on the CPU backend)."""
    num_nvlink_ranks = group_num_nvlink_ranks(group, rank, num_ranks, is_cpu)
    return domains_from_nvlink_ranks(num_ranks, rank, num_nvlink_ranks, allow_hybrid_mode)


def nccl_version_text(code: int) -> str:
    """``ncclGetVersion``'s code as ``major.minor.patch`` (22809 -> ``2.28.9``)."""
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def require_scaleout_support(domains: Domains, rank: int, nccl_version: int, emulated: bool = False) -> None:
    """Refuse a GPU buffer over more than one NVLink domain that the kernels cannot run: hybrid mode
    on nodes of more than `MAX_HYBRID_NODE_RANKS` ranks (real or emulated nodes), or an NCCL without
    GIN (older than 2.28.7). Emulated nodes (``emulated``) run both modes, hybrid and direct, over
    the emulated GIN; an NCCL group runs them over NCCL's GIN, whose transport checks the rest
    (`require_gin_features`). Every rank of a refused group raises the same error (each sees the
    same domains), before anything is allocated.

    Args:
        domains: the rank's `Domains`. rank: for the message. nccl_version: the loaded libnccl's
            ``ncclGetVersion`` code (not read when ``emulated``). emulated: the group is an
            `deep_ep.emulated.EmulatedGroup`'s.

    Raises:
        NotImplementedError: hybrid mode across nodes of more than 32 ranks (direct mode,
            ``allow_hybrid_mode=False``, has no such limit).
        RuntimeError: more than one NVLink domain on an NCCL group and an NCCL older than 2.28.7.
    """
    if domains.num_rdma_ranks <= 1:
        return
    if domains.num_scaleout_ranks > 1 and domains.num_nvlink_ranks > MAX_HYBRID_NODE_RANKS:
        raise NotImplementedError(
            f"rank {rank}: hybrid mode supports nodes of at most {MAX_HYBRID_NODE_RANKS} ranks (its forwarding "
            f"kernels give each rank of a node a lane of a warp), and this group spans {domains.num_rdma_ranks} "
            f"nodes (NVLink domains) of {domains.num_nvlink_ranks} ranks; pass allow_hybrid_mode=False (direct "
            f"mode, which has no such limit)")
    if emulated:
        return
    if nccl_version < NCCL_GIN_MIN_VERSION:
        raise RuntimeError(f"{_spans(domains, rank)}: GIN needs NCCL >= {nccl_version_text(NCCL_GIN_MIN_VERSION)}, "
                           f"and the NCCL torch loaded is {nccl_version_text(nccl_version)}; install a newer "
                           f"nvidia-nccl wheel (docs/scaleout.md)")


def require_one_nvlink_domain(method: str, primitive: str, backend) -> None:
    """Refuse an experimental primitive (pipeline send/recv, all-gather / reduce-scatter, Engram) on
    a GPU buffer whose group spans several NVLink domains: its GPU path reaches the peers by loads,
    stores and copy engines only, so it runs within one NVLink domain. ``backend`` is the buffer's
    `deep_ep.backends.gpu.GPUBackend`; its ``transport_gin`` (nonzero: a GIN transport, NCCL's across
    real nodes or the emulated one across emulated nodes) tells. Every rank raises alike (each sees
    the same transport), before the primitive allocates or launches anything.

    Args:
        method: the public method called (for the message). primitive: the primitive's name.

    Raises:
        NotImplementedError: the buffer's group spans several NVLink domains.
    """
    if not getattr(backend, "transport_gin", 0):
        return
    raise NotImplementedError(
        f"ElasticBuffer.{method}: {primitive} runs within one NVLink domain only on GPU buffers (its peers are "
        f"reached by loads, stores and copy engines), and this buffer's group of {backend.num_ranks} ranks spans "
        f"several NVLink domains (nodes, real or emulated). DeepEP's version goes over GIN across nodes; deep_ep's "
        f"does not yet. Use a buffer on a group within one NVLink domain for it, or the CPU backend")


def _spans(domains: Domains, rank: int) -> str:
    return (f"rank {rank}: the group spans {domains.num_rdma_ranks} NVLink domains of {domains.num_nvlink_ranks} "
            f"ranks, which needs the scale-out path over NCCL GIN")


def require_gin_features(domains: Domains, rank: int, nccl_version: int, gin_type: int, sl_idx: int) -> None:
    """What the NCCL GIN transport needs before it allocates anything, checked on every rank: an
    NCCL that can report GIN (`NCCL_GIN_QUERY_VERSION`), a communicator that reports it (on rails in
    hybrid mode: ``domains.num_scaleout_ranks > 1``), and an NCCL that can set ``sl_idx`` as GIN's
    traffic class (`NCCL_GIN_TRAFFIC_CLASS_VERSION`).

    Args:
        domains: the rank's `Domains` (one NVLink domain: nothing is needed). rank: for the message.
        nccl_version: the loaded libnccl's ``ncclGetVersion`` code. gin_type: the communicator's GIN
            type for the mode (`deep_ep.comm.devcomm.comm_gin_types`; 0: none). sl_idx: the buffer's.

    Raises:
        RuntimeError: a feature the loaded NCCL lacks (naming the version that brings it), or a
            communicator without GIN.
    """
    if domains.num_rdma_ranks <= 1:
        return
    where, found = _spans(domains, rank), nccl_version_text(nccl_version)
    require_scaleout_support(domains, rank, nccl_version)
    for needed, what in ((NCCL_GIN_QUERY_VERSION, "to report whether its communicator has GIN "
                                                  "(ncclCommQueryProperties)"),
                         (NCCL_GIN_TRAFFIC_CLASS_VERSION, f"to set sl_idx={sl_idx} as GIN's traffic class")):
        if nccl_version < needed:
            raise RuntimeError(f"{where}: NCCL >= {nccl_version_text(needed)} is needed {what}, and the NCCL "
                               f"torch loaded is {found}; install a newer nvidia-nccl wheel (docs/scaleout.md)")
    if gin_type == 0:
        mode = "hybrid mode (GIN on rails)" if domains.num_scaleout_ranks > 1 else "direct mode (GIN to every rank)"
        raise RuntimeError(f"{where}: the NCCL communicator ({found}) reports no GIN for {mode}: NCCL found no "
                           f"network it can drive from the GPU (an RDMA NIC with GPUDirect, or its proxy); "
                           f"NCCL_DEBUG=INFO says why")
