"""The user's NCCL communicator and symmetric windows on it.

`comm_ptr` borrows the ``ncclComm_t`` of a ``torch.distributed`` NCCL group (torch's own
communicator, on the libnccl torch loaded: `deep_ep.cuda.nccl`). `SymmetricWindow` allocates device
memory with ``ncclMemAlloc``, zeroes it and registers it as a symmetric window
(``ncclCommWindowRegister`` with ``NCCL_WIN_COLL_SYMMETRIC``, collective over the group), so that
kernels can reach every peer's window of the NVLink (LSA) team with loads and stores.
"""
from __future__ import annotations

import ctypes

import torch

from ..cuda.nccl import NcclError, check, libnccl, loaded_libnccl_path, nccl_version

__all__ = ["NcclError", "comm_ptr", "SymmetricWindow", "lsa_team", "libnccl", "loaded_libnccl_path",
           "nccl_version", "NCCL_WIN_COLL_SYMMETRIC"]

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


class SymmetricWindow:
    """``num_bytes`` of zeroed device memory registered as a symmetric window on ``comm``.

    Collective: every rank of the communicator creates it with the same size.

    Attributes:
        ptr: this rank's device address. handle: the ``ncclWindow_t`` (an int).

    Raises:
        NcclError: an NCCL call failed. RuntimeError: the memory could not be zeroed.
    """

    def __init__(self, comm: int, num_bytes: int, device: torch.device) -> None:
        from cuda.bindings import driver
        lib = libnccl()
        self.comm, self.num_bytes, self.device = comm, int(num_bytes), device
        self.ptr = self.handle = None
        ptr = ctypes.c_void_p()
        check("ncclMemAlloc", lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(self.num_bytes)))
        self.ptr = ptr.value
        # Zeroed (control counters start at 0) before anyone can signal into it.
        (err,) = driver.cuMemsetD8(self.ptr, 0, self.num_bytes)
        if int(err) != 0:
            raise RuntimeError(f"cuMemsetD8 on the NCCL window failed: {err}")
        torch.cuda.synchronize(device)
        win = ctypes.c_void_p()
        check("ncclCommWindowRegister",
              lib.ncclCommWindowRegister(ctypes.c_void_p(comm), ctypes.c_void_p(self.ptr),
                                         ctypes.c_size_t(self.num_bytes), ctypes.byref(win),
                                         NCCL_WIN_COLL_SYMMETRIC), comm)
        self.handle = win.value

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
