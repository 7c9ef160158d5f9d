"""Errors the kernels record, and how the host learns of them and reports them.

A kernel that gives up waiting for a peer, or that finds more rows than the outputs hold, records
(code, rank, peer, phase) in its window's control region (``comm/window.cuh``); the last block of a
data kernel also copies a recorded error to page-locked host memory mapped into the device
(`ErrorRecord`), so the host sees an asynchronous call's error at its next call without any
operation on the stream. `raise_recorded` turns a record into the exception users see.
"""
from __future__ import annotations

import ctypes

import torch

from ...cuda.driver import ensure_context
from .abi import ERR_CAPACITY, PHASES

__all__ = ["ErrorRecord", "raise_recorded"]


class ErrorRecord:
    """Four int32 words of page-locked host memory mapped into ``device``'s address space.

    Freed with the buffer (a graph replayed after that is invalid anyway: the window is gone too).

    Raises:
        RuntimeError: the driver refused the allocation.
    """

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # torch's primary context exists
            ensure_context(device.index)
            err, host = driver.cuMemHostAlloc(16, driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE)
            if int(err) != 0:
                raise RuntimeError(f"cuMemHostAlloc of the error record failed: {err}")
            err, dev = driver.cuMemHostGetDevicePointer(host, 0)
            if int(err) != 0:
                driver.cuMemFreeHost(host)
                raise RuntimeError(f"cuMemHostGetDevicePointer of the error record failed: {err}")
        self.host_ptr, self.device_ptr = int(host), int(dev)
        ctypes.memset(self.host_ptr, 0, 16)
        self.words = (ctypes.c_int32 * 4).from_address(self.host_ptr)

    def read(self) -> tuple:
        """(code, rank, peer, phase); the kernel writes the code last."""
        return tuple(self.words)

    def free(self) -> None:
        """Release the memory (the buffer's kernels must have finished)."""
        if self.host_ptr:
            from cuda.bindings import driver
            self.words = None
            driver.cuMemFreeHost(self.host_ptr)
            self.host_ptr = self.device_ptr = 0


def raise_recorded(record: tuple, timeout_secs: float, num_max_tokens_per_rank: int) -> None:
    """Raise the exception for a recorded (code, rank, peer, phase); the caller marks the buffer broken.

    Raises:
        RuntimeError: a receive that would not fit (code 2). TimeoutError: a peer did not arrive.
    """
    code, rank, peer, phase = record
    if code == ERR_CAPACITY:
        raise RuntimeError(
            f"deep_ep: rank {rank} would receive more rows than its do_cpu_sync=False outputs hold "
            f"(sized for num_max_tokens_per_rank={num_max_tokens_per_rank} per rank): every rank must pass the "
            f"same num_max_tokens_per_rank, and in the expanded layout a token must not name the same expert "
            f"twice. Nothing was written; this buffer is no longer usable")
    raise TimeoutError(
        f"deep_ep GPU timeout on rank {rank}: peer rank {peer} did not arrive within "
        f"{timeout_secs} s in phase {PHASES.get(phase, phase)}. A rank skipped a "
        f"call or failed; this buffer is no longer usable (destroy it and create a new one)")
