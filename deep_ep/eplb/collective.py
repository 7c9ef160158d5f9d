"""Small collectives of the load monitor and the weight mover, over a ``torch.distributed`` group.

gloo groups communicate CPU tensors, NCCL groups CUDA tensors: ``comm_device`` picks the device a
group's tensors must live on.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

__all__ = ["comm_device", "group_info", "vote", "fingerprint"]


def group_info(group) -> tuple:
    """``(group, rank in it, size)``; ``group=None`` is the default (world) group.

    Raises:
        ValueError: torch.distributed is not initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialised: create the process group first")
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def comm_device(group, preferred: torch.device | None = None) -> torch.device:
    """The device of the tensors ``group`` communicates: CUDA (current device) for NCCL, CPU for
    gloo; for a group with both backends, ``preferred``'s kind."""
    backend = str(dist.get_backend(group)).lower()
    has_nccl, has_gloo = "nccl" in backend, "gloo" in backend
    cuda = torch.device("cuda", torch.cuda.current_device()) if has_nccl else None
    if has_nccl and not has_gloo:
        return cuda
    if has_nccl and preferred is not None and preferred.type == "cuda":
        return preferred
    return torch.device("cpu")


def vote(group, ok: bool, device: torch.device, value: int = 0) -> tuple[bool, bool]:
    """Collective: ``(every rank ok, every rank passed the same value)``. ``value`` must fit in
    62 bits (see :func:`fingerprint`). Reads the result back to the host."""
    t = torch.tensor([0 if ok else 1, value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    flag, high, neg_low = t.tolist()
    return flag == 0, high == -neg_low


def fingerprint(*parts) -> int:
    """A 62-bit digest of ``parts`` (tensors by dtype, shape and content; anything else by repr)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, torch.Tensor):
            c = p.detach().to("cpu").contiguous()
            h.update(f"{c.dtype}{tuple(c.shape)}".encode())
            h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b"")
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little") >> 2
