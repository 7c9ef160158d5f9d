"""The libnccl torch loaded into this process: where it is, its ctypes handle, its version, and the
calls that make and end a communicator of deep_ep's own.

deep_ep never brings its own NCCL: it opens the library torch already mapped (``RTLD_NOLOAD``), so
the version is whatever torch ships. It borrows the communicator of the user's ``torch.distributed``
NCCL group, or creates one of its own on that library for any other group (`deep_ep.comm.nccl`):
`get_unique_id` on one rank, `init_rank` on every rank with those bytes, `destroy_comm` at the end.
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import Optional

__all__ = ["NcclError", "Team", "UniqueId", "UNIQUE_ID_BYTES", "loaded_libnccl_path", "libnccl", "nccl_version",
           "check", "get_unique_id", "init_rank", "destroy_comm"]

#: ``sizeof(ncclUniqueId)``: NCCL_UNIQUE_ID_BYTES of nccl.h, the same in every NCCL 2 release
UNIQUE_ID_BYTES = 128


class NcclError(RuntimeError):
    """An NCCL call failed; the message names the call and NCCL's error string."""


class Team(ctypes.Structure):
    """``ncclTeam_t``: a set of ranks (size, this rank's index, stride in the world)."""
    _fields_ = [("nRanks", ctypes.c_int), ("rank", ctypes.c_int), ("stride", ctypes.c_int)]


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: the opaque bytes that name a communicator being created (passed by value)."""
    _fields_ = [("internal", ctypes.c_uint8 * UNIQUE_ID_BYTES)]


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
                               "(a CUDA build of torch maps it when imported)")
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetLastError.restype = ctypes.c_char_p
        lib.ncclTeamLsa.restype = Team
        lib.ncclTeamLsa.argtypes = [ctypes.c_void_p]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        _lib = lib
    return _lib


def check(call: str, result: int, comm: Optional[int] = None) -> None:
    """Raise `NcclError` naming ``call`` unless ``result`` is ``ncclSuccess`` (0)."""
    if result != 0:
        lib = libnccl()
        detail = lib.ncclGetErrorString(result).decode()
        last = lib.ncclGetLastError(ctypes.c_void_p(comm) if comm else None)
        raise NcclError(f"{call} failed: {detail} ({result})" + (f": {last.decode()}" if last else ""))


def nccl_version() -> int:
    """``ncclGetVersion`` of the loaded library, e.g. 22809 for 2.28.9."""
    v = ctypes.c_int()
    check("ncclGetVersion", libnccl().ncclGetVersion(ctypes.byref(v)))
    return v.value


def get_unique_id() -> bytes:
    """``ncclGetUniqueId``: the ``UNIQUE_ID_BYTES`` bytes one rank makes and every rank of the new
    communicator passes to `init_rank` (the rank that makes them hosts NCCL's bootstrap root).

    Raises:
        NcclError: the call failed. RuntimeError: libnccl is not loaded (`libnccl`).
    """
    unique_id = UniqueId()
    check("ncclGetUniqueId", libnccl().ncclGetUniqueId(ctypes.byref(unique_id)))
    return bytes(unique_id.internal)


def init_rank(unique_id: bytes, num_ranks: int, rank: int) -> int:
    """``ncclCommInitRank``: this rank's ``ncclComm_t`` (an int) of a new communicator of ``num_ranks``
    ranks named by ``unique_id``, on the calling thread's current CUDA device. Blocks until every rank
    called it with the same bytes.

    Raises:
        ValueError: ``unique_id`` is not ``UNIQUE_ID_BYTES`` bytes. NcclError: the call failed.
    """
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    packed = UniqueId()
    ctypes.memmove(packed.internal, bytes(unique_id), UNIQUE_ID_BYTES)
    comm = ctypes.c_void_p()
    check("ncclCommInitRank", libnccl().ncclCommInitRank(ctypes.byref(comm), int(num_ranks), packed, int(rank)))
    return int(comm.value)


def destroy_comm(comm: int) -> None:
    """``ncclCommFinalize`` then ``ncclCommDestroy`` of a communicator made by `init_rank` (every rank
    of it calls this; nothing may use it afterwards).

    Raises:
        NcclError: a call failed (the communicator is destroyed all the same when finalizing failed).
    """
    lib = libnccl()
    finalized = lib.ncclCommFinalize(ctypes.c_void_p(comm))
    check("ncclCommDestroy", lib.ncclCommDestroy(ctypes.c_void_p(comm)))
    check("ncclCommFinalize", finalized)
