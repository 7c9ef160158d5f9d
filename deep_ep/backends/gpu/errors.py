"""Errors the kernels record, and how the host learns of them and reports them.

A kernel that gives up waiting for a peer, or that finds more rows than the outputs hold, records
(code, rank, peer, phase) in its window's control region (``comm/window.cuh``); the last block of a
data kernel that waited, and the notify kernel's layout stage, also copy a recorded error to
page-locked host memory mapped into the device (`ErrorRecord`), so the host sees an asynchronous
call's error at its next call without any operation on the stream. `raise_recorded` turns a record
into the exception users see. `queue_driver_calls` queues the driver calls of the copy-engine paths
(all-gather sessions, pipeline send/recv) and reports a refusal.
"""
from __future__ import annotations

import ctypes

import torch

from ...cuda.driver import ensure_context, enter_context, error_name, leave_context
from .abi import CONSTANTS, ERR_CAPACITY, ERR_FINGERPRINT, ERR_MISMATCH, PHASES

__all__ = ["CallRecord", "MappedWords", "ErrorRecord", "agree_at_barrier", "broken_label", "raise_recorded",
           "raise_bad_expert", "queue_driver_calls"]


class CallRecord:
    """What a backend keeps of its latest calls, for what comes after them: the report number of
    the layout stage's last report (`GPUBackend.wait_readback`), and, for an error a kernel records
    and the host finds later, the call number of the last kernels launched and the configuration
    of the last dispatch (its ``num_max_tokens_per_rank``, experts and top-k)."""

    __slots__ = ("readback_seq", "launched_call", "num_max_tokens", "num_experts", "num_topk")

    def __init__(self) -> None:
        self.readback_seq = 0      # 1 .. 2**31 - 1 once a dispatch with CPU sync ran
        self.launched_call = 0
        self.num_max_tokens = 0
        self.num_experts = self.num_topk = 0


class MappedWords:
    """``n`` int32 words of page-locked host memory mapped into ``device``'s address space: kernels
    write them, the host reads them with no operation on any stream (also under graph replay).

    Freed with the buffer (a graph replayed after that is invalid anyway: the window is gone too).

    Raises:
        RuntimeError: the driver refused the allocation.
    """

    def __init__(self, device: torch.device, n: int) -> None:
        from cuda.bindings import driver
        nbytes = 4 * n
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # torch's primary context exists
            ensure_context(device.index)
            err, host = driver.cuMemHostAlloc(nbytes, driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE)
            if int(err) != 0:
                raise RuntimeError(f"cuMemHostAlloc of {nbytes} mapped bytes failed: {err}")
            err, dev = driver.cuMemHostGetDevicePointer(host, 0)
            if int(err) != 0:
                driver.cuMemFreeHost(host)
                raise RuntimeError(f"cuMemHostGetDevicePointer failed: {err}")
        self.host_ptr, self.device_ptr = int(host), int(dev)
        ctypes.memset(self.host_ptr, 0, nbytes)
        self.words = (ctypes.c_int32 * n).from_address(self.host_ptr)
        # The same words as a native-int memoryview: a slice of it copies out with ``tolist()`` in
        # one C loop, about twice as fast as slicing the ctypes array (a few microseconds per call
        # for the readback's header and counts).
        self.ints = memoryview(self.words).cast("B").cast("i")

    def clear(self) -> None:
        """Zero every word (no kernel may be writing them)."""
        ctypes.memset(self.host_ptr, 0, 4 * len(self.words))

    def free(self) -> None:
        """Release the memory (the buffer's kernels must have finished)."""
        if self.host_ptr:
            from cuda.bindings import driver
            self.words = self.ints = None
            driver.cuMemFreeHost(self.host_ptr)
            self.host_ptr = self.device_ptr = 0


class ErrorRecord(MappedWords):
    """The four words the data kernels' last block copies an error to (``finish_wait``): code, rank,
    peer, phase; or, for an out-of-range expert id found without a host sync, code
    ``kErrBadExpert``, source rank, flat index, id."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, 4)

    def read(self) -> tuple:
        """(code, rank, peer, phase); the kernel writes the code last."""
        return tuple(self.words)


def broken_label(code: int) -> str:
    """What broke a buffer, from the error code its window recorded (a wait that gave up otherwise)."""
    return {ERR_CAPACITY: "capacity", ERR_MISMATCH: "ranks at different calls or disagreeing on one",
            ERR_FINGERPRINT: "ranks disagreeing on a call"}.get(code, "timeout")


def raise_bad_expert(source: int, index: int, value: int, num_experts: int, num_topk: int) -> None:
    """Raise the `ValueError` of an out-of-range expert id found by the kernels (on every rank)."""
    t, k = divmod(index, num_topk) if num_topk else (index, 0)
    raise ValueError(f"topk_idx on rank {source} holds expert id {value} at [{t}, {k}]: ids must be in "
                     f"[0, {num_experts}) or -1 (no selection). Every rank raises this; nothing was sent and "
                     f"the buffer stays usable")


def raise_recorded(record: tuple, timeout_secs: float, num_max_tokens_per_rank: int, calls: int = 0) -> None:
    """Raise the exception for a recorded (code, rank, peer, phase); the caller marks the buffer broken.
    ``calls``: this rank's call count (a mismatch record holds the peer's in its phase word).

    Raises:
        RuntimeError: a receive that would not fit (code 2), ranks at different calls / disagreeing
        on the call (code 4), or paired low-latency direct calls with different sizes (code 5).
        TimeoutError: a peer did not arrive.
    """
    code, rank, peer, phase = record
    if code == ERR_FINGERPRINT:
        # A low-latency direct flag from `peer` had the tag this rank waited for (the same count of
        # calls on that buffer half) but another call's fingerprint.
        call = {CONSTANTS["kPhaseDispatch"]: "low_latency_dispatch",
                CONSTANTS["kPhaseCombine"]: "low_latency_combine"}.get(phase, "low-latency call")
        raise RuntimeError(
            f"deep_ep: ranks {rank} and {peer} disagree on a {call}: rank {peer}'s call paired with rank "
            f"{rank}'s (the same number of low-latency calls on that buffer half) has other sizes (hidden, "
            f"top-k, num_max_dispatch_tokens_per_rank, num_experts, enable_shrink or, for a dispatch, "
            f"use_fp8). The ranks passed different sizes, or made calls of different sizes in different "
            f"orders. Both ranks raise "
            f"this; the buffer is no longer usable (destroy it and create a new one on every rank)")
    if code == ERR_MISMATCH:
        theirs = phase & 0xFFFFFFFF
        if theirs != calls & 0xFFFFFFFF:
            what = (f"rank {rank} is at call #{calls} of this buffer, rank {peer} at call #{theirs}: a rank "
                    f"skipped or repeated a call (a call refused for bad arguments counts on the rank that "
                    f"refused it)")
        else:
            what = (f"ranks {rank} and {peer} are both at call #{calls} but disagree on it (the operation, or "
                    f"its configuration: experts, hidden, top-k, FP8, layout, alignment, weights, do_cpu_sync, "
                    f"num_qps across nodes)")
        raise RuntimeError(f"deep_ep: {what}. Every rank of the call raises this; the buffer is no longer "
                           f"usable (destroy it and create a new one on every rank)")
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


def queue_driver_calls(backend, rank: int, what: str, calls) -> None:
    """Run driver calls ``(function, args)`` (each returning a ``CUresult`` int, or a kernel launch
    returning 0) in order in the context of ``backend``'s device. A refusal (an error code or an
    exception) leaves the peers waiting for this rank: ``backend`` is then marked unusable.

    Raises:
        RuntimeError: the driver refused a call (the message names ``what`` and the error); what a
        launch raised, as it raised it.
    """
    previous = enter_context(backend.device.index)
    try:
        for function, args in calls:
            try:
                err = function(*args)
            except BaseException:   # a kernel launch (emulated ranks' AGRS) raises instead: the peers wait
                backend.broken = f"{what} could not be queued"
                raise
            if err != 0:
                backend.broken = f"{what} could not be queued"
                raise RuntimeError(f"deep_ep: rank {rank}: queueing {what} failed: {error_name(err)}; this buffer "
                                   f"can no longer be used (destroy it and create a new one)")
    finally:
        leave_context(previous)


def agree_at_barrier(backend) -> None:
    """`GPUBackend.barrier`: wait for the rank's communication, then agree with every rank
    (`Transport.first_failed_rank`, itself a host barrier) on whether any rank failed; every rank
    raises then, the one that failed its own error, the others naming it. One rank raising alone
    would leave the others' next collective (a `destroy`'s barrier) paired with the wrong call."""
    err = local = None
    try:
        backend.drain()
        err = backend.read_error()
    except Exception as exc:   # e.g. a sticky CUDA error: told to the peers too, then raised
        local = exc
    failed = backend.transport.first_failed_rank(err is None and local is None)
    if local is not None:
        raise local
    if err is not None:
        backend._raise(err)
    if failed is not None:
        backend.broken = f"rank {failed} met a GPU error"
        raise RuntimeError(f"deep_ep (GPU backend, rank {backend.rank} of {backend.num_ranks}): barrier: rank "
                           f"{failed} met a GPU error (its kernels recorded one, or its wait failed), which that rank "
                           f"raises; this buffer's peers are no longer in step, so it is unusable too: destroy it "
                           f"and create a new one")
