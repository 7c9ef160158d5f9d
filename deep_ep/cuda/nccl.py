"""The libnccl torch loaded into this process: where it is, its ctypes handle, its version.

deep_ep never brings its own NCCL: it opens the library torch already mapped (``RTLD_NOLOAD``), so
the version is whatever torch ships, and it borrows the communicator of the user's
``torch.distributed`` NCCL group (`deep_ep.comm.nccl`).
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import Optional

__all__ = ["NcclError", "Team", "loaded_libnccl_path", "libnccl", "nccl_version", "check"]


class NcclError(RuntimeError):
    """An NCCL call failed; the message names the call and NCCL's error string."""


class Team(ctypes.Structure):
    """``ncclTeam_t``: a set of ranks (size, this rank's index, stride in the world)."""
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
        lib.ncclTeamLsa.restype = Team
        lib.ncclTeamLsa.argtypes = [ctypes.c_void_p]
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
