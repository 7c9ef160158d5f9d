"""Backends: the runtime behind `deep_ep.ElasticBuffer`.

`make_backend(group, config)` picks one:

* a ``gloo`` process group (or any group when torch has no CUDA) → `deep_ep.backends.cpu.CPUBackend`,
  CPU tensors through ``torch.distributed`` collectives;
* otherwise (an NCCL group, or an emulated-rank group from `deep_ep.emulated`) →
  `deep_ep.backends.gpu.GPUBackend`, imported lazily.
"""
from __future__ import annotations

from .. import envs, topology
from .base import Backend, BufferConfig

__all__ = ["Backend", "BufferConfig", "make_backend", "is_cpu_group", "group_rank_and_size",
           "group_domain_sizes", "group_domains"]


def group_rank_and_size(group) -> tuple:
    """``(rank, size)`` of a torch ``ProcessGroup`` or any group object with ``rank()``/``size()``."""
    try:
        return int(group.rank()), int(group.size())
    except AttributeError as exc:
        raise TypeError(f"group must be a torch.distributed ProcessGroup or an emulated group with "
                        f"rank() and size(), got {type(group).__name__}") from exc


def group_domain_sizes(group, allow_hybrid_mode: bool = True) -> tuple:
    """``((num_rdma_ranks, num_nvlink_ranks) physical, (num_scaleout_ranks, num_scaleup_ranks) logical)``
    of ``group`` (`deep_ep.topology` says how each kind of group gets them; ``allow_hybrid_mode=False``
    makes the logical split ``(1, R)``).

    Raises:
        TypeError: not a group. ValueError: a bad ``EP_CPU_NUM_NVLINK_RANKS``, or NVLink domains that
        do not split the group evenly.
    """
    return group_domains(group, allow_hybrid_mode)[:2]


def group_domains(group, allow_hybrid_mode: bool = True) -> tuple:
    """``(physical, logical, topology.Domains)`` of this rank of ``group`` (see `group_domain_sizes`)."""
    rank, size = group_rank_and_size(group)
    domains = topology.group_domains(group, rank, size, is_cpu_group(group), allow_hybrid_mode)
    return domains.physical, domains.logical, domains


def _backend_name(group) -> str:
    import torch.distributed as dist
    if isinstance(group, dist.ProcessGroup):
        try:
            return str(dist.get_backend(group)).lower()
        except Exception:  # a group that torch.distributed does not know by name
            return ""
    return ""


def is_cpu_group(group) -> bool:
    """Whether `make_backend` would give this group the CPU backend."""
    import torch
    import torch.distributed as dist
    if not isinstance(group, dist.ProcessGroup):
        return False                       # emulated groups run on the GPU
    name = _backend_name(group)
    if "nccl" in name and torch.cuda.is_available():
        return False
    return "gloo" in name or not torch.cuda.is_available()


def make_backend(group, config: BufferConfig) -> Backend:
    """The backend for ``group``; raises `NotImplementedError` when the GPU backend is not built yet.
    With ``EP_BUFFER_DEBUG`` set, prints what was made (one line per rank)."""
    if is_cpu_group(group):
        from .cpu import CPUBackend
        backend = CPUBackend(group, config)
    else:
        try:
            from .gpu import GPUBackend
        except ImportError as exc:
            raise NotImplementedError(
                f"group {type(group).__name__} (backend {_backend_name(group) or 'emulated'}) needs the GPU "
                f"backend (deep_ep.backends.gpu), which could not be imported: {exc}. "
                f"Use a gloo group with CPU tensors meanwhile.") from exc
        backend = GPUBackend(group, config)
    if envs.flag("EP_BUFFER_DEBUG"):
        print(f"[deep_ep] ElasticBuffer #{config.buffer_id} on rank {config.rank}/{config.num_ranks}: "
              f"{type(backend).__name__} on {backend.device}, {config.num_bytes} bytes "
              f"(host: {config.num_cpu_bytes})", flush=True)
    return backend
