"""Backends: the runtime behind `deep_ep.ElasticBuffer`.

`make_backend(group, config, device)` picks one (`is_cpu_group`, docs/design.md "Which backend"):

* ``device="cpu"``, or any torch group when torch sees no CUDA device →
  `deep_ep.backends.cpu.CPUBackend`, CPU tensors through ``torch.distributed`` collectives (the group
  must carry CPU tensors: gloo);
* otherwise (``device=None`` with CUDA available, as DeepEP V2 does for any group, or
  ``device="cuda"``; an emulated-rank group from `deep_ep.emulated` always) →
  `deep_ep.backends.gpu.GPUBackend`, imported lazily, on the current CUDA device. A torch NCCL group
  lends its communicator; any other group (gloo) gets a private one (`deep_ep.comm.nccl`).
"""
from __future__ import annotations

from typing import Optional

from .. import envs, topology
from .base import Backend, BufferConfig

__all__ = ["Backend", "BufferConfig", "make_backend", "is_cpu_group", "check_device", "group_rank_and_size",
           "group_domain_sizes", "group_domains"]


def group_rank_and_size(group) -> tuple:
    """``(rank, size)`` of a torch ``ProcessGroup`` or any group object with ``rank()``/``size()``."""
    try:
        return int(group.rank()), int(group.size())
    except AttributeError as exc:
        raise TypeError(f"group must be a torch.distributed ProcessGroup or an emulated group with "
                        f"rank() and size(), got {type(group).__name__}") from exc


def group_domain_sizes(group, allow_hybrid_mode: bool = True, device=None) -> tuple:
    """``((num_rdma_ranks, num_nvlink_ranks) physical, (num_scaleout_ranks, num_scaleup_ranks) logical)``
    of ``group`` (`deep_ep.topology` says how each kind of group gets them; ``allow_hybrid_mode=False``
    makes the logical split ``(1, R)``; ``device`` as in `is_cpu_group`).

    Raises:
        TypeError: not a group. ValueError: a bad ``EP_CPU_NUM_NVLINK_RANKS``, or NVLink domains that
        do not split the group evenly.
    """
    return group_domains(group, allow_hybrid_mode, device)[:2]


def group_domains(group, allow_hybrid_mode: bool = True, device=None) -> tuple:
    """``(physical, logical, topology.Domains)`` of this rank of ``group`` (see `group_domain_sizes`)."""
    rank, size = group_rank_and_size(group)
    domains = topology.group_domains(group, rank, size, is_cpu_group(group, device), allow_hybrid_mode)
    return domains.physical, domains.logical, domains


def _backend_name(group) -> str:
    import torch.distributed as dist
    if isinstance(group, dist.ProcessGroup):
        try:
            return str(dist.get_backend(group)).lower()
        except Exception:  # a group that torch.distributed does not know by name
            return ""
    return ""


def check_device(device) -> Optional[str]:
    """``ElasticBuffer``'s ``device`` keyword as ``None`` (automatic), ``"cpu"`` or ``"cuda"``.

    Args:
        device: None, a string or a ``torch.device`` of type ``cpu`` or ``cuda``; a CUDA index must be
            the current device (a GPU buffer works on the current device).

    Raises:
        TypeError: not None, a string or a ``torch.device``. ValueError: another device type, an
        unknown device string, or a CUDA index other than the current device.
    """
    import torch
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be None, 'cpu', 'cuda' or a torch.device, got {type(device).__name__}")
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {exc}") from exc
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be of type 'cpu' or 'cuda', got {str(parsed)!r}")
    if parsed.type == "cuda" and parsed.index is not None and torch.cuda.is_available() \
            and parsed.index != torch.cuda.current_device():
        raise ValueError(f"device={str(parsed)!r}: a GPU buffer works on the current CUDA device "
                         f"(cuda:{torch.cuda.current_device()}); call torch.cuda.set_device first")
    return parsed.type


def is_cpu_group(group, device=None) -> bool:
    """Whether `make_backend` gives ``group`` the CPU backend.

    ``device="cpu"``: yes; ``device="cuda"``: no; ``device=None``: yes exactly when torch sees no CUDA
    device (DeepEP V2 runs every group on the GPU: a gloo group too, with a private NCCL communicator).
    An emulated-rank group never.

    Raises:
        TypeError / ValueError: a bad ``device`` (`check_device`), ``device="cpu"`` for an emulated
        group or for a group whose collectives take CUDA tensors only (NCCL).
    """
    import torch
    import torch.distributed as dist
    kind = check_device(device)
    if not isinstance(group, dist.ProcessGroup):
        if kind == "cpu":
            raise ValueError("device='cpu': an emulated-rank group runs on the GPU only")
        return False
    if kind == "cpu":
        name = _backend_name(group)
        if "nccl" in name and "gloo" not in name:
            raise ValueError(f"device='cpu' needs a group that carries CPU tensors (gloo); this one's backend is "
                             f"{name!r}")
        return True
    if kind == "cuda":
        return False
    return not torch.cuda.is_available()


def make_backend(group, config: BufferConfig, device=None) -> Backend:
    """The backend for ``group`` (``device`` as in `is_cpu_group`); raises `NotImplementedError` when
    the GPU backend is not built yet. With ``EP_BUFFER_DEBUG`` set, prints what was made (one line per
    rank)."""
    if is_cpu_group(group, device):
        from .cpu import CPUBackend
        backend = CPUBackend(group, config)
    else:
        try:
            from .gpu import GPUBackend
        except ImportError as exc:
            raise NotImplementedError(
                f"group {type(group).__name__} (backend {_backend_name(group) or 'emulated'}) needs the GPU "
                f"backend (deep_ep.backends.gpu), which could not be imported: {exc}. "
                f"Use a gloo group with device='cpu' and CPU tensors meanwhile.") from exc
        backend = GPUBackend(group, config)
    if envs.flag("EP_BUFFER_DEBUG"):
        print(f"[deep_ep] ElasticBuffer #{config.buffer_id} on rank {config.rank}/{config.num_ranks}: "
              f"{type(backend).__name__} on {backend.device}, {config.num_bytes} bytes "
              f"(host: {config.num_cpu_bytes})", flush=True)
    return backend
