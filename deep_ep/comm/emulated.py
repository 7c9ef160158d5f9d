"""The transport of ranks emulated on one GPU (`deep_ep.emulated`): slices of one allocation.

The kernels are the ones a real multi-GPU run uses (built with ``EP_TRANSPORT_NCCL=0``); only the
way they find the peers' windows differs: a device table of the slices' addresses.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

from .transport import Transport

__all__ = ["EmulatedWindowSet", "EmulatedTransport", "EmulatedTransportArgs"]


class EmulatedTransportArgs(ctypes.Structure):
    """Host mirror of the emulated ``deep_ep::comm::TransportArgs`` (comm/transport.cuh)."""
    _fields_ = [("peers", ctypes.c_void_p), ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int)]


class EmulatedWindowSet:
    """The windows of N emulated ranks: one zeroed allocation on one GPU, N equal slices.

    Created once per `deep_ep.emulated.EmulatedGroup` and buffer; every rank's transport points into it.
    """

    def __init__(self, num_ranks: int, num_bytes: int, device: torch.device) -> None:
        self.num_ranks = num_ranks
        self.num_bytes = num_bytes
        self.device = device
        self.storage = torch.zeros(num_ranks * num_bytes, dtype=torch.uint8, device=device)
        # Zeroed before any rank's stream can signal into it. A stream-level wait: a device-wide one
        # could wait on another rank's kernels that wait on this rank.
        torch.cuda.current_stream(device).synchronize()
        base = self.storage.data_ptr()
        self.peers = torch.tensor([base + r * num_bytes for r in range(num_ranks)], dtype=torch.int64,
                                  device=device)
        self.refs = num_ranks
        self.lock = threading.Lock()
        self.ok_words = [True] * num_ranks   # `EmulatedTransport.first_failed_rank`'s, one per rank


class EmulatedTransport(Transport):
    """One emulated rank's view of an `EmulatedWindowSet`."""

    kernel_define = 0

    def __init__(self, windows: EmulatedWindowSet, rank: int, host_barrier) -> None:
        self.windows = windows
        self.rank = rank
        self.num_ranks = windows.num_ranks
        self.num_bytes = windows.num_bytes
        self.device = windows.device
        self._barrier = host_barrier
        self._args = EmulatedTransportArgs(windows.peers.data_ptr(), rank, windows.num_ranks)

    def kernel_args(self):
        return self._args

    def window_tensor(self) -> torch.Tensor:
        return self.windows.storage[self.rank * self.num_bytes:(self.rank + 1) * self.num_bytes]

    def host_barrier(self) -> None:
        self._barrier()

    def first_failed_rank(self, ok: bool) -> Optional[int]:
        # every rank's word in the window set, read between two barriers (none is written again
        # before every rank has read them)
        words = self.windows.ok_words
        words[self.rank] = bool(ok)
        self._barrier()
        failed = next((rank for rank, good in enumerate(words) if not good), None)
        self._barrier()
        return failed

    def destroy(self) -> None:
        with self.windows.lock:
            self.windows.refs -= 1
            if self.windows.refs == 0:
                self.windows.storage = None
                self.windows.peers = None
