"""The NCCL communicator a GPU buffer works on, and symmetric windows on it.

Which communicator (`acquire_communicator`): the ``ncclComm_t`` of a ``torch.distributed`` NCCL group
is borrowed (`comm_ptr`, torch's own, on the libnccl torch loaded: `deep_ep.cuda.nccl`). Any other
group (gloo: the CPU group an integration passes while its tensors are on the GPU), a torch that
cannot lend its communicator, or ``EP_REUSE_NCCL_COMM=0``, gets a private communicator instead: group
rank 0 makes an NCCL unique id, the group broadcasts its bytes (a CPU tensor where the group carries
CPU tensors), and every rank joins with ``ncclCommInitRank`` on its current CUDA device. A private
communicator is shared by the buffers of one group on one device and destroyed
(``ncclCommFinalize``, ``ncclCommDestroy``) when the last of them releases it.

`SymmetricWindow` allocates device memory with ``ncclMemAlloc``, zeroes it and registers it as a
symmetric window (``ncclCommWindowRegister`` with ``NCCL_WIN_COLL_SYMMETRIC``, collective over the
communicator), so that kernels can reach every peer's window of the NVLink (LSA) team with loads
and stores.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Optional

import torch

from .. import envs
from ..cuda import nccl as nccl_calls
from ..cuda.nccl import NcclError, check, libnccl, loaded_libnccl_path, nccl_version

__all__ = ["NcclError", "comm_ptr", "SymmetricWindow", "lsa_team", "libnccl", "loaded_libnccl_path",
           "nccl_version", "NCCL_WIN_COLL_SYMMETRIC", "CommunicatorLease", "reuses_torch_communicator",
           "acquire_communicator", "hold_communicator", "creation_hold", "group_lsa_team", "broadcast_unique_id",
           "private_communicators", "first_failed_rank"]

NCCL_WIN_COLL_SYMMETRIC = 0x01


def comm_ptr(group, device: torch.device) -> int:
    """The ``ncclComm_t`` of a torch NCCL process group (initialising it if torch has not yet).

    Raises:
        RuntimeError: the group is not an NCCL group, or this torch cannot lend its communicator.
    """
    import torch.distributed as dist
    backend = group._get_backend(device)
    if not hasattr(backend, "_comm_ptr"):
        raise RuntimeError(f"this torch ({torch.__version__}) cannot lend the communicator of its NCCL group "
                           f"(ProcessGroupNCCL._comm_ptr is missing); torch >= 2.6 is needed")
    ptr = backend._comm_ptr()
    if not ptr:
        # torch creates communicators lazily: one tiny collective initialises it.
        t = torch.zeros(1, dtype=torch.float32, device=device)
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize(device)
        ptr = backend._comm_ptr()
    if not ptr:
        raise RuntimeError("the NCCL group has no communicator")
    return int(ptr)


def lsa_team(comm: int) -> tuple:
    """``(ranks in this rank's LSA team, this rank's index in it)`` (``ncclTeamLsa``)."""
    team = libnccl().ncclTeamLsa(ctypes.c_void_p(comm))
    return int(team.nRanks), int(team.rank)


# ---------------------------------------------------------------------------------------------- which communicator
def reuses_torch_communicator(group, device: torch.device) -> bool:
    """Whether a GPU buffer of ``group`` borrows torch's NCCL communicator: the group's backend for
    ``device`` can lend one (a torch NCCL group, torch >= 2.6) and ``EP_REUSE_NCCL_COMM`` is not off
    (DeepEP's variable). Otherwise it gets a private communicator."""
    if not envs.flag("EP_REUSE_NCCL_COMM"):
        return False
    try:
        backend = group._get_backend(device)
    except Exception:  # noqa: BLE001 - a group without a backend for CUDA tensors: no communicator to borrow
        return False
    return hasattr(backend, "_comm_ptr")


def _carries_cpu_tensors(group) -> bool:
    """Whether ``group``'s collectives take CPU tensors (anything but an NCCL-only group)."""
    import torch.distributed as dist
    try:
        name = str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - a group torch.distributed does not know by name
        return True
    return "nccl" not in name or "gloo" in name


def broadcast_unique_id(group, device: torch.device) -> bytes:
    """An NCCL unique id made on group rank 0 (`deep_ep.cuda.nccl.get_unique_id`) and broadcast over
    ``group``: the same bytes on every rank (collective). The bytes travel in a CPU tensor, or on
    ``device`` for a group that carries CUDA tensors only."""
    import torch.distributed as dist
    on_cpu = _carries_cpu_tensors(group)
    payload = torch.zeros(nccl_calls.UNIQUE_ID_BYTES, dtype=torch.uint8, device="cpu" if on_cpu else device)
    if int(group.rank()) == 0:
        payload.copy_(torch.frombuffer(bytearray(nccl_calls.get_unique_id()), dtype=torch.uint8))
    dist.broadcast(payload, src=dist.get_global_rank(group, 0), group=group)
    return bytes(payload.cpu().tolist())


class _PrivateCommunicator:
    """A communicator deep_ep created for one group on one device, and how many leases hold it."""

    __slots__ = ("group", "device", "comm", "leases")

    def __init__(self, group, device: torch.device, comm: int) -> None:
        self.group, self.device, self.comm, self.leases = group, device, comm, 0


_lock = threading.Lock()
_private: dict = {}     # (id(group), device index) -> _PrivateCommunicator


class CommunicatorLease:
    """A hold on the communicator of a GPU buffer: ``comm`` (the ``ncclComm_t``, an int) and whether
    it is ``private`` (created by deep_ep, destroyed when the last lease is released) or torch's
    (borrowed: never destroyed here). `release` once; calling it again does nothing."""

    def __init__(self, comm: int, private: Optional[_PrivateCommunicator]) -> None:
        self.comm = comm
        self._private = private
        self.private = private is not None

    def release(self) -> None:
        """Drop this hold; the last hold on a private communicator destroys it (``ncclCommFinalize``,
        ``ncclCommDestroy``; every rank releases its last hold at the same point, as buffers are
        destroyed collectively).

        Raises:
            NcclError: destroying the communicator failed.
        """
        entry, self._private = self._private, None
        if entry is None:
            return
        with _lock:
            entry.leases -= 1
            last = entry.leases == 0
            if last:
                _private.pop((id(entry.group), entry.device.index), None)
        if last:
            with torch.cuda.device(entry.device):
                nccl_calls.destroy_comm(entry.comm)


def acquire_communicator(group, device: torch.device) -> CommunicatorLease:
    """A lease on the NCCL communicator a GPU buffer of ``group`` on ``device`` (this rank's current
    CUDA device) works on: torch's when `reuses_torch_communicator`, else the group's private one,
    created here when no lease holds it yet (collective over ``group``: every rank acquires it at the
    same point).

    Raises:
        RuntimeError: libnccl is not loaded, or the NCCL group has no communicator.
        NcclError: creating the private communicator failed.
    """
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if reuses_torch_communicator(group, device):
        return CommunicatorLease(comm_ptr(group, device), None)
    key = (id(group), device.index)
    with _lock:
        entry = _private.get(key)
        if entry is not None and entry.group is group:
            entry.leases += 1
            return CommunicatorLease(entry.comm, entry)
    unique_id = broadcast_unique_id(group, device)
    with torch.cuda.device(device):
        comm = nccl_calls.init_rank(unique_id, int(group.size()), int(group.rank()))
    if envs.flag("EP_BUFFER_DEBUG"):
        print(f"[deep_ep] rank {group.rank()}/{group.size()}: private NCCL communicator created on {device}",
              flush=True)
    entry = _PrivateCommunicator(group, device, comm)
    entry.leases = 1
    with _lock:
        _private[key] = entry
    return CommunicatorLease(comm, entry)


@contextlib.contextmanager
def hold_communicator(group, device: torch.device):
    """`acquire_communicator` for the duration of a ``with`` block (yields the lease): what is
    created inside (a buffer's transport, its domains) finds the same private communicator."""
    lease = acquire_communicator(group, device)
    try:
        yield lease
    finally:
        lease.release()


def creation_hold(group, on_cpu: bool):
    """While a GPU buffer of a torch group is made, a hold on its communicator (`hold_communicator`),
    so that its domains and its transport find the same private one, created once. Nothing for the
    CPU backend (``on_cpu``), emulated ranks, a process without CUDA (the GPU backend then says why
    it cannot run) or during CUDA-graph capture (the GPU backend refuses it)."""
    import torch.distributed as dist
    if on_cpu or not isinstance(group, dist.ProcessGroup) or not torch.cuda.is_available() \
            or torch.cuda.is_current_stream_capturing():
        return contextlib.nullcontext()
    return hold_communicator(group, torch.device("cuda", torch.cuda.current_device()))


def group_lsa_team(group, device: torch.device) -> tuple:
    """``(LSA team size, this rank's index in it)`` on the communicator a GPU buffer of ``group``
    would use (a private one is created and destroyed again when no buffer holds it; collective)."""
    with hold_communicator(group, device) as lease:
        return lsa_team(lease.comm)


def private_communicators() -> list:
    """``(group, device, ncclComm_t, leases)`` of each private communicator alive in this process."""
    with _lock:
        return [(entry.group, entry.device, entry.comm, entry.leases) for entry in _private.values()]


def first_failed_rank(group, device: torch.device, ok: bool) -> Optional[int]:
    """Collective over ``group``: the lowest rank that passed ``ok=False``, or None if none did. One
    all-reduce (MAX) of a word per rank, on ``device`` for an NCCL-only group and on the CPU
    otherwise (as `broadcast_unique_id`)."""
    import torch.distributed as dist
    num_ranks = int(group.size())
    words = torch.zeros(num_ranks, dtype=torch.int64, device="cpu" if _carries_cpu_tensors(group) else device)
    words[int(group.rank())] = 0 if ok else 1
    dist.all_reduce(words, op=dist.ReduceOp.MAX, group=group)
    failed = [rank for rank, word in enumerate(words.tolist()) if word]
    return failed[0] if failed else None


class SymmetricWindow:
    """``num_bytes`` of zeroed device memory registered as a symmetric window on ``comm``.

    Collective: every rank of the communicator creates it with the same size. ``agree`` (optional):
    called on every rank with whether this rank's allocation succeeded, returns the first rank whose
    did not, or None (`first_failed_rank`); with it, a failure raises on every rank before the
    collective registration.

    Attributes:
        ptr: this rank's device address. handle: the ``ncclWindow_t`` (an int).

    Raises:
        NcclError: an NCCL call failed. RuntimeError: the memory could not be zeroed.
    """

    def __init__(self, comm: int, num_bytes: int, device: torch.device, agree=None) -> None:
        lib = libnccl()
        self.comm, self.num_bytes, self.device = comm, int(num_bytes), device
        self.ptr = self.handle = None
        failure = None
        try:
            self._allocate(lib)
        except Exception as exc:  # noqa: BLE001 - told to the other ranks first, raised below
            failure = exc
        # The registration is collective: a rank whose allocation failed would leave the others
        # waiting in it, so the ranks agree first (`first_failed_rank`) and all raise alike.
        failed = agree(failure is None) if agree is not None else None
        if failure is None and failed is not None:
            failure = RuntimeError(f"rank {failed} could not allocate its {self.num_bytes}-byte NCCL window; no "
                                   f"rank registered one")
        if failure is not None:
            self.destroy()
            raise failure
        win = ctypes.c_void_p()
        check("ncclCommWindowRegister",
              lib.ncclCommWindowRegister(ctypes.c_void_p(comm), ctypes.c_void_p(self.ptr),
                                         ctypes.c_size_t(self.num_bytes), ctypes.byref(win),
                                         NCCL_WIN_COLL_SYMMETRIC), comm)
        self.handle = win.value

    def _allocate(self, lib) -> None:
        from cuda.bindings import driver
        ptr = ctypes.c_void_p()
        check("ncclMemAlloc", lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(self.num_bytes)))
        self.ptr = ptr.value
        # Zeroed (control counters start at 0) before anyone can signal into it.
        (err,) = driver.cuMemsetD8(self.ptr, 0, self.num_bytes)
        if int(err) != 0:
            raise RuntimeError(f"cuMemsetD8 on the NCCL window failed: {err}")
        torch.cuda.synchronize(self.device)

    def destroy(self) -> None:
        """Deregister (collective) and free. The caller makes sure no peer still reads the window."""
        lib = libnccl()
        if self.handle:
            check("ncclCommWindowDeregister",
                  lib.ncclCommWindowDeregister(ctypes.c_void_p(self.comm), ctypes.c_void_p(self.handle)), self.comm)
            self.handle = None
        if self.ptr:
            check("ncclMemFree", lib.ncclMemFree(ctypes.c_void_p(self.ptr)))
            self.ptr = None
