"""Host side of the transports: how a buffer's kernels reach the windows of the other ranks.

Each rank of a buffer owns a window of the same size and layout (`deep_ep.backends.gpu.window`). A
transport makes the peers' windows reachable from this rank's kernels and gives the kernels one
argument, ``TransportArgs`` (`deep_ep/include/deep_ep/comm/transport.cuh`), passed by value:

* `deep_ep.comm.lsa.NcclLsaTransport`: a symmetric window on the user's NCCL communicator and the
  ``ncclDevComm`` made from it; kernels built with ``EP_TRANSPORT_NCCL=1`` find the peers' windows
  of the NVLink (LSA) team through NCCL's device API.
* `deep_ep.comm.emulated.EmulatedTransport`: N ranks in one process on one GPU share one
  allocation; kernels built with ``EP_TRANSPORT_NCCL=0`` get a table of its slices. Same kernels
  otherwise, same window layout, same signals.

A scale-out transport (RDMA through NCCL GIN) is a third implementation of the same interface.
"""
from __future__ import annotations

import abc
from typing import Optional

import torch

__all__ = ["Transport"]


class Transport(abc.ABC):
    """What the GPU backend needs from the communication layer, for one buffer on one rank."""

    rank: int
    num_ranks: int
    num_bytes: int
    device: torch.device
    #: kernels of this transport are built with ``EP_TRANSPORT_NCCL`` = this value (0 or 1)
    kernel_define: int

    @abc.abstractmethod
    def kernel_args(self):
        """The kernels' ``TransportArgs``, a ctypes object passed by value (fixed for the buffer's life)."""

    def gin_contexts(self) -> int:
        """The GIN contexts the data kernels may spread their puts over (0: no GIN, one node)."""
        return int(getattr(self.kernel_args(), "num_contexts", 0) or 0)

    def kernel_args_using(self, num_contexts: int):
        """`kernel_args` with the data kernels' puts spread over ``num_contexts`` GIN contexts (a copy
        per count, kept; every other field the same); `kernel_args` itself for ``num_contexts`` 0 (all
        of them: DeepEP derives a count from the SMs instead, which ranks may set apart, while the
        contexts must agree) or at least `gin_contexts`, and on a transport without GIN."""
        args = self.kernel_args()
        if not 0 < num_contexts < self.gin_contexts():
            return args
        by_count = self.__dict__.setdefault("_args_by_contexts", {})
        if num_contexts not in by_count:
            by_count[num_contexts] = type(args).from_buffer_copy(args)
            by_count[num_contexts].num_contexts = num_contexts
        return by_count[num_contexts]

    @abc.abstractmethod
    def window_tensor(self) -> torch.Tensor:
        """This rank's window (at least its 64 KiB control region) as a uint8 tensor view."""

    @abc.abstractmethod
    def host_barrier(self) -> None:
        """Block the calling host thread until every rank reached it (no GPU work)."""

    @abc.abstractmethod
    def first_failed_rank(self, ok: bool) -> Optional[int]:
        """Collective, a host barrier too: the lowest rank that passed ``ok=False``, or None."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the window (collective where the transport needs it)."""
