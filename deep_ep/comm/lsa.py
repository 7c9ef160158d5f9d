"""The scale-up transport of a torch process group on GPUs: a symmetric window reached over NVLink (LSA).

The communicator is the group's (`deep_ep.comm.nccl.acquire_communicator`): torch's for an NCCL
group, a private one for any other (a gloo group whose ranks hold GPU tensors) or with
``EP_REUSE_NCCL_COMM=0``. Every rank allocates and registers its window on it (`SymmetricWindow`),
and a device communicator (`DeviceCommunicator`) is made from it. The kernels receive both and
resolve each peer's window with NCCL's device API (``ncclTeamLsa``, ``ncclGetLsaPointer``).

Only ranks of one LSA team (one NVLink domain) are reachable this way; a group that spans more
(other nodes, reached over RDMA through GIN) raises `NotImplementedError` until the scale-out
transport exists.
"""
from __future__ import annotations

from typing import Optional

import torch

from .devcomm import DeviceCommunicator
from .nccl import SymmetricWindow, acquire_communicator, first_failed_rank, lsa_team
from .transport import Transport

__all__ = ["NcclLsaTransport"]


class _DeviceBytes:
    """Exposes device memory that torch did not allocate through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class NcclLsaTransport(Transport):
    """A symmetric window of ``num_bytes`` per rank on ``group``'s communicator, and its device
    communicator. Collective: every rank of ``group`` creates it with the same ``num_bytes``; it holds
    a lease on the communicator until `destroy`.

    Raises:
        NotImplementedError: some ranks of the group are outside this rank's NVLink (LSA) domain.
        deep_ep.cuda.nccl.NcclError: an NCCL call failed.
    """

    kernel_define = 1

    def __init__(self, group, num_bytes: int, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank, self.num_ranks = int(group.rank()), int(group.size())
        self.num_bytes = int(num_bytes)
        self.window = self.devcomm = None
        self._window_view = None
        self.lease = acquire_communicator(group, device)
        self.comm = self.lease.comm
        try:
            team_size, team_rank = lsa_team(self.comm)
            refusal = None
            if team_size != self.num_ranks:
                refusal = (f"rank {self.rank}: only {team_size} of the group's {self.num_ranks} ranks share this "
                           f"GPU's NVLink (LSA) domain: such a group takes deep_ep.comm.nccl_gin's transport")
            elif team_rank != self.rank:
                refusal = (f"LSA rank {team_rank} differs from group rank {self.rank}: a group whose NVLink domain "
                           f"is permuted is not supported yet")
            # every rank raises (the others would wait in the window's collective registration)
            failed = first_failed_rank(group, device, refusal is None)
            if failed is not None:
                raise NotImplementedError(refusal or f"rank {failed} of the group cannot use the NVLink (LSA) "
                                                     f"transport (it says why)")
            self.window = SymmetricWindow(self.comm, self.num_bytes, device,
                                          agree=lambda ok: first_failed_rank(group, device, ok))
            self.devcomm = DeviceCommunicator(self.comm, self.num_ranks)
            self._args = self.devcomm.transport_args(self.window.handle)
        except BaseException:
            self._release_resources()
            raise

    @property
    def private_communicator(self) -> bool:
        """Whether the communicator was created by deep_ep (not torch's NCCL group's)."""
        return self.lease.private

    def _release_resources(self) -> None:
        if self.devcomm is not None:
            self.devcomm.destroy()
            self.devcomm = None
        if self.window is not None:
            self.window.destroy()
            self.window = None
        self.lease.release()

    def kernel_args(self):
        return self._args

    def window_tensor(self) -> torch.Tensor:
        """The control region (first 64 KiB) of this rank's window as a uint8 tensor view."""
        if self._window_view is None:
            self._window_view = torch.as_tensor(_DeviceBytes(self.window.ptr, 64 * 1024), dtype=torch.uint8,
                                                device=self.device)
        return self._window_view

    def host_barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier(group=self.group)

    def first_failed_rank(self, ok: bool) -> Optional[int]:
        return first_failed_rank(self.group, self.device, ok)

    def destroy(self) -> None:
        """Destroy the device communicator, deregister and free the window, release the communicator
        (a private one is destroyed with its last lease). Collective: a barrier first, so that no peer
        is still reading this rank's window (combine pulls from peers). Idempotent."""
        if self.window is not None and self.window.handle:
            self.host_barrier()
        self._release_resources()
