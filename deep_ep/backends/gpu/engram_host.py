"""Pinned host memory for Engram shards that the GPUs of one node read (`deep_ep.backends.gpu.engram`).

A rank's shard is ``num_bytes`` of page-locked host memory mapped into its device. Ranks of one
process (emulated ranks, a one-rank group) share it by address (`LocalShard`, ``cuMemHostAlloc``);
ranks in separate processes through the driver's virtual memory API (`ProcessShard`: created on the
device's host NUMA node, exported as a POSIX file descriptor, which the owner serves over a Unix
socket (`deep_ep.comm.fd_share`) and peers receive, or else take with pidfd_getfd, and map). Each
kind describes itself in `DESCRIPTION_WORDS` int32 words (`engram_write`'s header carries them),
and a peer reaches it from that description (`reach_host_shards`). A shard is freed when the
last rank that may read it lets go, so it outlives its owner's buffer while a peer may still fetch.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

import torch

from ... import shapes
from ...comm.fd_share import FdServer, new_token, receive_fd
from ...cuda.driver import driver, enter_context, error_name, leave_context
from .errors import MappedWords

__all__ = ["DESCRIPTION_WORDS", "LocalShard", "ProcessShard", "copy_bytes", "create_host_shard", "reach_host_shards"]

DESCRIPTION_WORDS = 4
_SIZE_UNIT = 2 * 1024 * 1024   # a process shard's size goes in the description in these units
_SYS_PIDFD_GETFD = 438         # the same number on x86-64 and arm64


def _int32(value: int) -> int:
    return ctypes.c_int32(value).value


def _driver_check(err, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"deep_ep: Engram host storage: {what} failed: {error_name(err)}")


class LocalShard:
    """A shard's ``num_bytes`` of pinned host memory mapped into the device (``cuMemHostAlloc``), for
    ranks of one process. Every table that reads it holds it (`acquire`); freed when the last lets go,
    so a rank's shard outlives its own buffer while a peer's fetch may still read it."""

    _lock = threading.Lock()
    _live: dict = {}   # device address -> LocalShard

    def __init__(self, device: torch.device, num_bytes: int) -> None:
        self.memory = MappedWords(device, num_bytes // 4)
        self.address = self.memory.device_ptr
        self.users = 1
        with self._lock:
            self._live[self.address] = self

    def description(self) -> list:
        """The address, low and high halves."""
        return [_int32(self.address), _int32(self.address >> 32), 0, 0]

    @classmethod
    def acquire(cls, description: list) -> "LocalShard":
        """A hold on the shard of this process a `description` names."""
        address = (description[0] & 0xFFFFFFFF) | (description[1] & 0xFFFFFFFF) << 32
        with cls._lock:
            shard = cls._live.get(address)
            if shard is None:
                raise RuntimeError(f"deep_ep: no Engram host shard at {address:#x} in this process")
            shard.users += 1
            return shard

    def drop(self) -> None:
        """Let go of one hold; the last frees the memory."""
        with self._lock:
            self.users -= 1
            if self.users:
                return
            del self._live[self.address]
        self.memory.free()


class ProcessShard:
    """A shard's pinned host memory shared between the processes of one node with the driver's virtual
    memory API: created on the device's host NUMA node and exported as a POSIX file descriptor by its
    owner (`create`), which serves it to the processes of its user on the host (`FdServer`); every
    rank, the owner too, maps it at an address of its own with read and write access for its device
    (`open`, from the owner's process id, descriptor and socket token: received over the socket, or
    else taken with pidfd_getfd, which needs the permission to trace the owner). The memory lives
    until every mapping is gone."""

    def __init__(self, device: torch.device, handle, num_bytes: int, fd: int = -1) -> None:
        self.device, self.handle, self.num_bytes, self.fd = device, handle, num_bytes, fd
        self.address = self.mapped = 0
        self.server: Optional[FdServer] = None
        self.token = 0
        d = driver()
        try:
            err, address = d.cuMemAddressReserve(num_bytes, 0, 0, 0)
            _driver_check(err, f"cuMemAddressReserve of {num_bytes} bytes")
            self.address = int(address)
            (err,) = d.cuMemMap(self.address, num_bytes, 0, handle, 0)
            _driver_check(err, "cuMemMap")
            self.mapped = num_bytes
            access = d.CUmemAccessDesc()
            access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device.index
            access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            (err,) = d.cuMemSetAccess(self.address, num_bytes, [access], 1)
            _driver_check(err, "cuMemSetAccess")
        except BaseException:
            self.drop()
            raise

    @staticmethod
    def _prop(device: torch.device):
        d = driver()
        err, handle_device = d.cuDeviceGet(device.index)
        _driver_check(err, "cuDeviceGet")
        err, numa_node = d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, handle_device)
        _driver_check(err, "cuDeviceGetAttribute(HOST_NUMA_ID)")
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
        prop.location.id = max(0, int(numa_node))   # -1: a host without NUMA nodes
        prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    @classmethod
    def create(cls, device: torch.device, num_bytes: int) -> "ProcessShard":
        """This process's shard of at least ``num_bytes``, exported and mapped."""
        d = driver()
        previous = enter_context(device.index)
        try:
            prop = cls._prop(device)
            err, granularity = d.cuMemGetAllocationGranularity(
                prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
            _driver_check(err, "cuMemGetAllocationGranularity")
            # a whole number of size units (the header's), and of the granularity
            num_bytes = shapes.align_up(shapes.align_up(num_bytes, _SIZE_UNIT), int(granularity))
            err, handle = d.cuMemCreate(num_bytes, prop, 0)
            _driver_check(err, f"cuMemCreate of {num_bytes} bytes on host NUMA node {prop.location.id}")
            err, fd = d.cuMemExportToShareableHandle(
                handle, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            if int(err) != 0:
                d.cuMemRelease(handle)
                _driver_check(err, "cuMemExportToShareableHandle")
            shard = cls(device, handle, num_bytes, int(fd))
            try:
                shard.token = new_token()
                shard.server = FdServer(shard.fd, shard.token)
            except BaseException:
                shard.drop()
                raise
            return shard
        finally:
            leave_context(previous)

    @classmethod
    def open(cls, device: torch.device, description: list) -> "ProcessShard":
        """Map the shard of another process its `description` names."""
        pid, fd, num_bytes, token = description[0], description[1], description[2] * _SIZE_UNIT, description[3]
        d = driver()
        pidfd = local_fd = -1
        previous = enter_context(device.index)
        try:
            try:
                local_fd = receive_fd(pid, fd, token)
            except OSError as exc:   # e.g. another network namespace: take it with pidfd_getfd
                served = f"{type(exc).__name__}: {exc}"
                pidfd = os.pidfd_open(pid)
                libc = ctypes.CDLL(None, use_errno=True)
                local_fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
                if local_fd < 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"deep_ep: Engram host shard descriptor {fd} of process {pid}: not received "
                                        f"over its Unix socket ({served}), and pidfd_getfd failed "
                                        f"({os.strerror(code)}): ranks on one node must share a network namespace "
                                        f"or may trace each other (kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE "
                                        f"in a container); else pass storage_location='device'") from exc
            err, handle = d.cuMemImportFromShareableHandle(
                local_fd, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            _driver_check(err, f"cuMemImportFromShareableHandle (process {pid})")
            return cls(device, handle, num_bytes)
        finally:
            for descriptor in (local_fd, pidfd):
                if descriptor >= 0:
                    os.close(descriptor)
            leave_context(previous)

    def stop_serving(self) -> None:
        """Close the socket that serves the descriptor (once every peer took it)."""
        if self.server is not None:
            self.server.close()
            self.server = None

    def description(self) -> list:
        """The owner's process id, its descriptor of the memory, the size in 2 MiB units, the token of
        the socket that serves the descriptor."""
        return [os.getpid(), self.fd, self.num_bytes // _SIZE_UNIT, self.token]

    def drop(self) -> None:
        """Unmap and release this process's reference (the memory goes with the last one)."""
        self.stop_serving()
        d = driver()
        previous = enter_context(self.device.index)
        try:
            if self.mapped:
                d.cuMemUnmap(self.address, self.mapped)
            if self.address:
                d.cuMemAddressFree(self.address, self.num_bytes)
            self.address = self.mapped = 0
            if self.handle is not None:
                d.cuMemRelease(self.handle)
                self.handle = None
        finally:
            leave_context(previous)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def copy_bytes(device: torch.device, address: int, source: torch.Tensor, stream) -> None:
    """Queue a copy of ``source``'s bytes (contiguous, on ``device``) to the device-accessible
    ``address`` on ``stream`` (a copy engine)."""
    previous = enter_context(device.index)
    try:   # the unified-address copy: the driver sees the destination is host memory
        (err,) = driver().cuMemcpyAsync(address, source.data_ptr(), source.numel() * source.element_size(),
                                        stream.cuda_stream)
    finally:
        leave_context(previous)
    _driver_check(err, "the copy of the shard into host memory")


def create_host_shard(device: torch.device, num_bytes: int, one_process: bool):
    """This rank's shard of ``num_bytes``: a `LocalShard` for ranks of one process, else a `ProcessShard`.

    Raises:
        RuntimeError: the driver refused the allocation or its export.
    """
    return LocalShard(device, num_bytes) if one_process else ProcessShard.create(device, num_bytes)


def reach_host_shards(device: torch.device, rank: int, one_process: bool, descriptions: list) -> list:
    """Every rank's shard from its description (by rank): in one process a hold on each (this rank's
    too), else a mapping of each peer's (None at ``rank``: its own shard is mapped already). Each
    must be `drop`-ped once. On a failure, what was reached is let go and the error raised.

    Raises:
        RuntimeError: a shard this process does not hold, or the driver refused a mapping.
        OSError: a peer's descriptor could not be received nor taken (pidfd_getfd).
    """
    shards = []
    try:
        for peer, description in enumerate(descriptions):
            if one_process:
                shards.append(LocalShard.acquire(description))
            else:
                shards.append(None if peer == rank else ProcessShard.open(device, description))
    except BaseException:
        for shard in shards:
            if shard is not None:
                shard.drop()
        raise
    return shards
