"""NCCL: the libnccl torch loaded, the user's communicator, and the symmetric window on it.

deep_ep never brings its own NCCL: it opens the library torch already loaded (so the version is
whatever torch ships, 2.28.9 for torch 2.11 / CUDA 13) and borrows the communicator of the user's
``torch.distributed`` NCCL group. On it, each `ElasticBuffer` allocates its window with
``ncclMemAlloc``, registers it as a symmetric window (``ncclCommWindowRegister`` with
``NCCL_WIN_COLL_SYMMETRIC``, collective over the group) and asks the device API for the address of
every peer's window in the NVLink (LSA) domain (``ncclGetLsaPointer``, in a one-thread-per-peer
kernel). Those addresses form the peer table the kernels use (`deep_ep.comm.transport`).

Only the LSA (load/store over NVLink) path exists today. Ranks outside the caller's LSA team (other
nodes, reached over RDMA through GIN) raise `NotImplementedError`.
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import Optional

import torch

from .transport import Transport

__all__ = ["NcclError", "NcclTransport", "loaded_libnccl_path", "libnccl", "nccl_version", "comm_ptr"]

NCCL_WIN_COLL_SYMMETRIC = 0x01


class NcclError(RuntimeError):
    """An NCCL call failed; the message names the call and NCCL's error string."""


class _Team(ctypes.Structure):
    _fields_ = [("nRanks", ctypes.c_int), ("rank", ctypes.c_int), ("stride", ctypes.c_int)]


def loaded_libnccl_path() -> Optional[str]:
    """Path of the libnccl mapped into this process (torch loads it with its CUDA build), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libnccl" in line and "/" in line}
    except OSError:
        return None
    for p in sorted(paths):
        if re.search(r"libnccl\.so", os.path.basename(p)):
            return p
    return None


_lib = None


def libnccl() -> ctypes.CDLL:
    """The loaded libnccl as a ctypes library (never loads a second copy).

    Raises:
        RuntimeError: torch has not loaded libnccl (a CPU build of torch, or no NCCL group yet).
    """
    global _lib
    if _lib is None:
        path = loaded_libnccl_path()
        if path is None:
            raise RuntimeError("libnccl is not loaded in this process: deep_ep uses the NCCL that torch loads "
                               "(create the torch.distributed NCCL group first, with a CUDA build of torch)")
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetLastError.restype = ctypes.c_char_p
        lib.ncclTeamLsa.restype = _Team
        lib.ncclTeamLsa.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


def _check(call: str, result: int, comm: Optional[int] = None) -> None:
    if result != 0:
        lib = libnccl()
        detail = lib.ncclGetErrorString(result).decode()
        last = lib.ncclGetLastError(ctypes.c_void_p(comm) if comm else None)
        raise NcclError(f"{call} failed: {detail} ({result})" + (f": {last.decode()}" if last else ""))


def nccl_version() -> int:
    """``ncclGetVersion`` of the loaded library, e.g. 22809 for 2.28.9."""
    v = ctypes.c_int()
    _check("ncclGetVersion", libnccl().ncclGetVersion(ctypes.byref(v)))
    return v.value


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
        t = torch.zeros(1, device=device)
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize(device)
        ptr = backend._comm_ptr()
    if not ptr:
        raise RuntimeError("the NCCL group has no communicator")
    return int(ptr)


_LSA_SOURCE = r"""
#include <nccl.h>
#include <nccl_device.h>
extern "C" __global__ void deep_ep_lsa_pointers(ncclWindow_t win, int num_peers, unsigned long long* out) {
    for (int p = threadIdx.x; p < num_peers; p += blockDim.x)
        out[p] = reinterpret_cast<unsigned long long>(ncclGetLsaPointer(win, 0, p));
}
"""


class _DeviceBytes:
    """Exposes device memory that torch did not allocate through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class NcclTransport(Transport):
    """A symmetric window on the user's NCCL communicator, reached over NVLink (LSA).

    Collective: every rank of ``group`` must create it with the same ``num_bytes``.

    Raises:
        NotImplementedError: some ranks of the group are outside this rank's NVLink (LSA) domain.
        NcclError: an NCCL call failed.
    """

    def __init__(self, group, num_bytes: int, device: torch.device) -> None:
        from .. import jit
        self.group = group
        self.device = device
        self.rank, self.num_ranks = int(group.rank()), int(group.size())
        self.num_bytes = int(num_bytes)
        lib = libnccl()
        self.comm = comm_ptr(group, device)
        team = lib.ncclTeamLsa(ctypes.c_void_p(self.comm))
        if team.nRanks != self.num_ranks:
            raise NotImplementedError(
                f"rank {self.rank}: only {team.nRanks} of the group's {self.num_ranks} ranks share this GPU's "
                f"NVLink (LSA) domain; scale-out over RDMA (NCCL GIN) is not implemented yet")
        if team.rank != self.rank:
            raise NotImplementedError(f"LSA rank {team.rank} differs from group rank {self.rank}: "
                                      f"a group whose NVLink domain is permuted is not supported yet")
        ptr = ctypes.c_void_p()
        _check("ncclMemAlloc", lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(self.num_bytes)))
        self.ptr = ptr.value
        # Zero the window (control counters start at 0) before anyone can signal into it.
        from cuda.bindings import driver
        (err,) = driver.cuMemsetD8(self.ptr, 0, self.num_bytes)
        if int(err) != 0:
            raise RuntimeError(f"cuMemsetD8 on the NCCL window failed: {err}")
        torch.cuda.synchronize(device)
        win = ctypes.c_void_p()
        _check("ncclCommWindowRegister",
               lib.ncclCommWindowRegister(ctypes.c_void_p(self.comm), ctypes.c_void_p(self.ptr),
                                          ctypes.c_size_t(self.num_bytes), ctypes.byref(win),
                                          NCCL_WIN_COLL_SYMMETRIC), self.comm)
        self.win = win.value
        self.peers = torch.empty(self.num_ranks, dtype=torch.int64, device=device)
        mod = jit.build("deep_ep_lsa_pointers", _LSA_SOURCE, use_nccl=True)
        mod.function("deep_ep_lsa_pointers").launch(1, 128, (jit.ptr(self.win), self.num_ranks, self.peers),
                                                     stream=torch.cuda.current_stream(device))
        torch.cuda.synchronize(device)
        self._window_view = None

    def window_ptr(self) -> int:
        return self.ptr

    def window_tensor(self) -> torch.Tensor:
        """The control region (first 64 KiB) of this rank's window as a uint8 tensor view."""
        if self._window_view is None:
            self._window_view = torch.as_tensor(_DeviceBytes(self.ptr, 64 * 1024), device=self.device)
        return self._window_view

    def host_barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier(group=self.group)

    def destroy(self) -> None:
        """Deregister and free the window. Collective: a barrier first, so that no peer is still
        reading this rank's window (combine pulls from peers' windows)."""
        lib = libnccl()
        if getattr(self, "win", None):
            self.host_barrier()
        if getattr(self, "win", None):
            _check("ncclCommWindowDeregister",
                   lib.ncclCommWindowDeregister(ctypes.c_void_p(self.comm), ctypes.c_void_p(self.win)), self.comm)
            self.win = None
        if getattr(self, "ptr", None):
            _check("ncclMemFree", lib.ncclMemFree(ctypes.c_void_p(self.ptr)))
            self.ptr = None
