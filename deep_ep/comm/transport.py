"""Transports: how a rank's kernels reach the windows of the other ranks of its scale-up domain.

Kernels only see a *peer table*: a device array of ``num_ranks`` base pointers, entry ``p`` being
rank ``p``'s symmetric window as addressable from this GPU. Two transports fill it:

* `deep_ep.comm.nccl.NcclTransport`: the window is NCCL memory registered as a symmetric window on
  the user's communicator; entries come from ``ncclGetLsaPointer`` (NVLink load/store).
* `EmulatedTransport`: N ranks in one process on one GPU share one allocation; entry ``p`` points at
  rank ``p``'s slice. Same kernels, same window layout, same signals.
"""
from __future__ import annotations

import abc
import threading

import torch

__all__ = ["Transport", "EmulatedTransport", "EmulatedWindowSet"]


class Transport(abc.ABC):
    """What the GPU backend needs from the communication layer."""

    rank: int
    num_ranks: int
    num_bytes: int
    device: torch.device
    #: int64 [num_ranks] device tensor of window base addresses (the peer table).
    peers: torch.Tensor

    @abc.abstractmethod
    def window_ptr(self) -> int:
        """Address of this rank's own window."""

    @abc.abstractmethod
    def host_barrier(self) -> None:
        """Block the calling host thread until every rank reached it (no GPU work)."""

    def window_tensor(self) -> torch.Tensor:
        """This rank's window as a uint8 tensor (for host-side reads of the control region)."""
        raise NotImplementedError

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the window (collective where the transport needs it)."""


class EmulatedWindowSet:
    """The windows of N emulated ranks: one zeroed allocation on one GPU, N equal slices.

    Created once per `deep_ep.emulated.EmulatedGroup` and window size; every rank's transport points
    into it.
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


class EmulatedTransport(Transport):
    """One emulated rank's view of an `EmulatedWindowSet`."""

    def __init__(self, windows: EmulatedWindowSet, rank: int, host_barrier) -> None:
        self.windows = windows
        self.rank = rank
        self.num_ranks = windows.num_ranks
        self.num_bytes = windows.num_bytes
        self.device = windows.device
        self.peers = windows.peers
        self._barrier = host_barrier

    def window_ptr(self) -> int:
        return self.windows.storage.data_ptr() + self.rank * self.num_bytes

    def window_tensor(self) -> torch.Tensor:
        return self.windows.storage[self.rank * self.num_bytes:(self.rank + 1) * self.num_bytes]

    def host_barrier(self) -> None:
        self._barrier()

    def destroy(self) -> None:
        with self.windows.lock:
            self.windows.refs -= 1
            if self.windows.refs == 0:
                self.windows.storage = None
                self.windows.peers = None
