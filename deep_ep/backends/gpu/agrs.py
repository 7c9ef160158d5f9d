"""All-gather / reduce-scatter sessions of the GPU backend (`deep_ep.primitives.agrs` keeps the
session's bookkeeping and every check; this module moves the bytes).

No SM moves data: everything is queued on the caller's current stream with the CUDA driver. An
all-gather copies this rank's tensor with a copy engine (``cuMemcpyDtoDAsync``) into its row of the
call's room in every rank's window, then raises its flag word of that call in every window
(``cuStreamWriteValue32``, which fences the copies before the write); its handle makes the stream
wait (``cuStreamWaitValue32``) until every rank's flag of the call is raised. A reduce-scatter sends
chunk ``p`` of its input to rank ``p`` the same way; its handle waits, then sums the received chunks
in float32 in rank order with one kernel per tensor on the stream (`deep_ep.backends.gpu.agrs_reduce`:
the CPU backend's formula, so the same bits). The host never waits in a call or a handle. The flags
carry the session's number, which a CUDA graph's replays would repeat, so sessions refuse capture.

Ranks emulated on one GPU queue the AGRS module's kernels instead of driver operations: a copy
kernel per piece, a flag kernel for a row of flags, and a wait kernel (one block spinning on the
header row, which gives up after ``num_gpu_timeout_secs`` naming the peer). There, copy-engine
copies and stream memory operations of ranks that wait for each other stalled the whole GPU (about
one bench process in nine on the H200: every stream of the process stopped, the awaited words
written), with stream waits and with a wait kernel alike, while kernels alone (as the data kernels
of dispatch and combine) never did. Emulated ranks' transfers therefore hold SMs.

A stream wait has no GPU-side timeout: a stream whose peer never makes the call waits until it does.
The host notices without waiting: an event follows every wait it queues, and the next session or
call whose oldest unfinished wait is older than ``num_cpu_timeout_secs`` reads this rank's flags and
names the missing peers (TimeoutError); agrs_set_config and the buffer's destroy wait, polled, for
the queued waits and name them the same way.

Window: the AGRS region starts after the control region (`AGRS_OFFSET`): header words (layout in
``include/deep_ep/impls/agrs.cuh``), then the session space. Flags hold the number of the session,
so none is cleared between sessions. `GPUAgrsMoves.begin_session` writes this rank's "entered"
word into every window, and a call writes into rank ``p``'s space only after the stream saw ``p``
enter the session: ``p``'s work on the previous session's outputs, queued before, is done.
`GPUAgrsMoves.configure` (agrs_set_config: collective, blocking) compares the ranks' configurations,
zeroes the header and learns the peers' window addresses. Dispatch, combine and pipeline traffic
write over the region, so AGRS refuses after them until the next agrs_set_config.
"""
from __future__ import annotations

import collections
import ctypes
import time
from pathlib import Path

import torch

from ... import jit
from ...cuda.driver import can_flush_remote_writes, memcpy_async, stream_wait_u32, stream_write_u32
from ...cuda.streams import poll_event
from . import agrs_reduce
from .abi import CONSTANTS, CTRL_BYTES, _read_constants
from .errors import queue_driver_calls
from .modules import AGRS_COPY_KERNEL, AGRS_FLAGS_KERNEL, AGRS_PEERS_KERNEL, AGRS_WAIT_KERNEL

__all__ = ["AGRS_OFFSET", "AGRS_CONSTANTS", "AgrsWaitArgs", "AgrsFlagArgs", "space_offset", "window_bytes",
           "copy_blocks", "GPUAgrsMoves"]

AGRS_CONSTANTS = _read_constants(Path(__file__).resolve().parents[2] / "include" / "deep_ep" / "impls" / "agrs.cuh")
_ENTERED_ROW = AGRS_CONSTANTS["kAgrsEnteredRow"]
_CONFIG_ROW = AGRS_CONSTANTS["kAgrsConfigRow"]
_FLAG_ROW = AGRS_CONSTANTS["kAgrsFlagRow"]
_HEADER_ROWS = AGRS_CONSTANTS["kAgrsHeaderRows"]
_PHASE_ENTERED, _PHASE_CALL = CONSTANTS["kPhaseAgrsEntered"], CONSTANTS["kPhaseAgrsCall"]
#: Byte offset of the AGRS region in every window: right after the dispatch/combine control region.
AGRS_OFFSET = CTRL_BYTES
_SPACE_ALIGNMENT = 4096


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def space_offset(num_ranks: int) -> int:
    """Byte offset of the session space in every window of a group of ``num_ranks`` ranks."""
    return AGRS_OFFSET + _align(4 * _HEADER_ROWS * num_ranks, _SPACE_ALIGNMENT)


def window_bytes(num_ranks: int, num_max_session_bytes: int) -> int:
    """Window bytes a session space of ``num_max_session_bytes`` needs (control region and header included)."""
    return space_offset(num_ranks) + num_max_session_bytes


class AgrsWaitArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::AgrsWaitArgs`` (include/deep_ep/impls/agrs.cuh)."""
    _fields_ = [("row", ctypes.c_void_p), ("session", ctypes.c_uint32), ("phase", ctypes.c_int),
                ("timeout_ns", ctypes.c_uint64), ("err_host", ctypes.c_void_p)]


class AgrsFlagArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::AgrsFlagArgs`` (include/deep_ep/impls/agrs.cuh)."""
    _fields_ = [("row_offset", ctypes.c_int64), ("session", ctypes.c_uint32)]


#: 16-byte steps one block of the copy kernel takes per pass (threads x loads in flight)
_COPY_BYTES_PER_BLOCK = 16 * AGRS_CONSTANTS["kAgrsCopyThreads"] * AGRS_CONSTANTS["kAgrsCopyUnroll"]


def copy_blocks(num_bytes: int, sm_limit: int) -> int:
    """Blocks of the emulated ranks' copy kernel for a piece of ``num_bytes``: one per pass of
    `_COPY_BYTES_PER_BLOCK`, at most ``sm_limit`` (the SMs of the device over the ranks)."""
    return max(1, min(sm_limit, -(-num_bytes // _COPY_BYTES_PER_BLOCK)))


class _WindowBytes:
    """Device memory torch did not allocate (an NCCL window), exposed through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class GPUAgrsMoves:
    """AGRS data moves of one GPU buffer on one rank (see the module docstring).

    ``configured_call``: the buffer's call count when agrs_set_config last finished (or when this
    rank last queued AGRS work); a dispatch or combine launched after it wrote over the region.
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        self.rank, self.num_ranks = backend.rank, backend.num_ranks
        self.device = backend.device
        self.peers: list = []          # every rank's window base, as this GPU addresses it
        self.configured_call = -1
        self.space_offset = space_offset(self.num_ranks)
        self.by_kernels = bool(backend.emulated)   # see the module docstring
        # stream waits queued and maybe not done: (event after it, time queued, session, header row, what)
        self.pending: collections.deque = collections.deque()

    # ------------------------------------------------------------------ the window
    def _window_view(self, offset: int, num_bytes: int) -> torch.Tensor:
        """uint8 ``[num_bytes]`` view of this rank's window from ``offset``."""
        transport = self.backend.transport
        if self.backend.emulated:
            return transport.window_tensor()[offset:offset + num_bytes]
        return torch.as_tensor(_WindowBytes(transport.window.ptr + offset, num_bytes), dtype=torch.uint8,
                               device=self.device)

    def _word(self, rank: int, row: int, column: int) -> int:
        """Address of header word ``[row][column]`` in ``rank``'s window."""
        return self.peers[rank] + AGRS_OFFSET + 4 * (row * self.num_ranks + column)

    def _read_peers(self, stream) -> list:
        """Every rank's window base: the slices' addresses for emulated ranks, else NCCL's LSA pointers
        (one kernel, read back once)."""
        backend = self.backend
        if backend.emulated:
            base = backend.transport.windows.storage.data_ptr()
            return [base + rank * backend.transport.num_bytes for rank in range(self.num_ranks)]
        module = backend.module("agrs", ())
        out = torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
        module.function(AGRS_PEERS_KERNEL).launch(1, AGRS_CONSTANTS["kAgrsThreads"], (backend.transport_args, out),
                                                  stream=stream.cuda_stream, device=self.device.index)
        words = backend.host_read(out.view(torch.int32), stream)
        return [(words[2 * rank] & 0xFFFFFFFF) | ((words[2 * rank + 1] & 0xFFFFFFFF) << 32)
                for rank in range(self.num_ranks)]

    def _queue(self, what: str, calls: list) -> None:
        """`errors.queue_driver_calls` for this rank (RuntimeError, the buffer unusable, on a refusal)."""
        queue_driver_calls(self.backend, self.rank, what, calls)
        self.backend.call_record.launched_call = self.backend.calls
        self.configured_call = self.backend.calls

    def _flag_calls(self, stream: int, row: int, session: int) -> list:
        """The calls that write ``session`` into this rank's word of header row ``row`` in every window
        once the work queued before on raw ``stream`` is done: a stream write per rank, or the flag
        kernel."""
        if not self.by_kernels:
            return [(stream_write_u32, (stream, self._word(peer, row, self.rank), session))
                    for peer in range(self.num_ranks)]
        return [(self._launch_flags, (stream, row, session))]

    def _copy_calls(self, stream: int, pieces: list) -> list:
        """The calls that copy ``(destination, source, bytes)`` on raw ``stream``: copy-engine copies,
        or the copy kernel."""
        if not self.by_kernels:
            return [(memcpy_async, (dst, src, num_bytes, stream)) for dst, src, num_bytes in pieces if num_bytes]
        return [(self._launch_copy, (stream, dst, src, num_bytes)) for dst, src, num_bytes in pieces if num_bytes]

    def _launch(self, kernel: str, blocks: int, threads: int, args: tuple, stream: int) -> int:
        """Launch ``kernel`` of the AGRS module on raw ``stream``; 0, as a driver call returns."""
        self.backend.module("agrs", ()).function(kernel).launch(blocks, threads, args, stream=stream,
                                                                device=self.device.index)
        return 0

    def _launch_flags(self, stream: int, row: int, session: int) -> int:
        args = AgrsFlagArgs(AGRS_OFFSET + 4 * row * self.num_ranks, session & 0xFFFFFFFF)
        return self._launch(AGRS_FLAGS_KERNEL, 1, AGRS_CONSTANTS["kAgrsThreads"], (self.backend.transport_args, args),
                            stream)

    def _launch_copy(self, stream: int, dst: int, src: int, num_bytes: int) -> int:
        return self._launch(AGRS_COPY_KERNEL, copy_blocks(num_bytes, self.backend._sm_limit),
                            AGRS_CONSTANTS["kAgrsCopyThreads"],
                            (self.backend.transport_args, jit.ptr(dst), jit.ptr(src), jit.i64(num_bytes)), stream)

    def _wait_calls(self, stream: int, row: int, session: int, phase: int) -> list:
        """The driver calls that make raw ``stream`` wait until every rank's word of this rank's header
        row ``row`` reaches ``session``: a stream wait per rank, or on emulated ranks the wait kernel."""
        if not self.by_kernels:   # the rows a flag announces came from the peers' copy engines
            flush = can_flush_remote_writes(self.device.index)
            return [(stream_wait_u32, (stream, self._word(self.rank, row, peer), session, flush))
                    for peer in range(self.num_ranks)]
        return [(self._launch_wait, (stream, row, session, phase))]

    def _launch_wait(self, stream: int, row: int, session: int, phase: int) -> int:
        """The wait kernel (see the module docstring); a timeout it records is raised by the buffer's
        next call (`GPUBackend.raise_if_broken`, naming the peer and the phase)."""
        backend = self.backend
        args = AgrsWaitArgs(self._word(self.rank, row, 0), session & 0xFFFFFFFF, phase, backend.timeout_ns,
                            backend.err_record.device_ptr)
        return self._launch(AGRS_WAIT_KERNEL, 1, AGRS_CONSTANTS["kAgrsThreads"], (backend.transport_args, args), stream)

    def _wait_stream(self, stream) -> None:
        backend = self.backend
        event = torch.cuda.Event()
        event.record(stream)
        if not poll_event(event, backend.config.num_cpu_timeout_secs, backend.spin_secs):
            backend.broken = "host timeout"
            raise TimeoutError(f"deep_ep: rank {self.rank} waited {backend.config.num_cpu_timeout_secs} s on the "
                               f"host for its stream in agrs_set_config (num_cpu_timeout_secs)"
                               + self._missing_peers())

    # ------------------------------------------------------------------ peers that never arrived
    def _track(self, stream, session: int, row: int, what: str) -> None:
        """Remember a stream wait for header word ``[row][peer] >= session`` of every peer (an event
        after it: its completion says every peer arrived)."""
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(stream)
        self.pending.append((event, time.monotonic(), session, row, what))

    def _missing_peers(self) -> str:
        """What the unfinished stream waits still wait for, read from this rank's header (a copy on a
        stream of its own: the waiting streams cannot delay it): ``"; rank 2 never made ..."``, or ""."""
        pending = [entry for entry in self.pending if not entry[0].query()]
        if not pending or not self.peers:
            return ""
        num_ranks = self.num_ranks
        header = self._window_view(AGRS_OFFSET, 4 * _HEADER_ROWS * num_ranks).view(torch.int32)
        words = self.backend.host_read(header, torch.cuda.Stream(self.device))
        found = []
        for _, _, session, row, what in pending:
            for peer in range(num_ranks):
                # flags hold session numbers, compared as the stream does (wrapping at 2^32)
                if ((words[row * num_ranks + peer] - session) & 0xFFFFFFFF) >= 1 << 31:
                    found.append(f"rank {peer} never made its {what}")
        found = list(dict.fromkeys(found))
        more = f" (and {len(found) - 4} more)" if len(found) > 4 else ""
        waits = ("its wait kernel gives up after num_gpu_timeout_secs" if self.by_kernels else
                 "there is no GPU-side timeout, so this rank's stream waits for them")
        return ("; " + "; ".join(found[:4]) + more + f": every rank must make the same AGRS calls ({waits})"
                if found else "")

    def _check_peers(self, method: str) -> None:
        """Raise when the oldest unfinished stream wait was queued over ``num_cpu_timeout_secs`` ago
        and a peer's flag for it is still missing (nothing here waits for the GPU).

        Raises:
            TimeoutError: a peer never arrived; the buffer can no longer be used.
        """
        while self.pending and self.pending[0][0].query():
            self.pending.popleft()
        if not self.pending:
            return
        timeout = self.backend.config.num_cpu_timeout_secs
        if timeout is None or time.monotonic() - self.pending[0][1] < timeout:
            return
        missing = self._missing_peers()
        if missing:
            self.backend.broken = "an AGRS peer never arrived"
            raise TimeoutError(f"deep_ep: {method}: rank {self.rank}'s stream has waited over {timeout} s "
                               f"(num_cpu_timeout_secs) for its peers{missing}; this buffer can no longer be used")

    def release(self, method: str = "destroy") -> None:
        """Wait on the host, polled, up to ``num_cpu_timeout_secs`` for every stream wait of AGRS:
        before the buffer is destroyed (the window must outlive them) and before agrs_set_config
        clears the flags (a stream still waiting for one would wait forever).

        Raises:
            TimeoutError: a peer never arrived (named); the buffer can no longer be used, and after
            ``destroy`` its window is not released.
        """
        backend = self.backend
        limit = backend.config.num_cpu_timeout_secs
        deadline = None if limit is None else time.monotonic() + limit
        while self.pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not poll_event(self.pending[0][0], remaining, backend.spin_secs):
                missing = self._missing_peers()
                backend.broken = "an AGRS peer never arrived"
                raise TimeoutError(f"deep_ep: {method}: rank {self.rank}'s stream still waits after "
                                   f"{backend.config.num_cpu_timeout_secs} s (num_cpu_timeout_secs) for AGRS peers"
                                   f"{missing or ' (the header shows none missing: the stream is behind)'}; this "
                                   f"buffer can no longer be used" + ("; its window is not released, since the "
                                   "stream still addresses it" if method == "destroy" else ""))
            self.pending.popleft()

    # ------------------------------------------------------------------ calls
    def check(self, method: str) -> None:
        """What a session, a call or a handle checks on this rank before queueing anything.

        Raises:
            RuntimeError: an earlier GPU error, or a dispatch or combine since agrs_set_config.
            TimeoutError: a peer that never made a call this rank's stream waits for (`_check_peers`).
        """
        self.backend.raise_if_broken()
        self._check_peers(method)
        if self.backend.call_record.launched_call > self.configured_call:
            raise RuntimeError(f"deep_ep: {method}: dispatch, combine or another primitive ran on this buffer "
                               f"since the last agrs_set_config, and on a GPU buffer they write over the AGRS region "
                               f"of the window; call agrs_set_config on every rank after them, before the next "
                               f"session")

    def configure(self, num_bytes: int, num_max_ops: int, call: int, space_bytes: int) -> torch.Tensor:
        """Collective, blocks the host: every rank's earlier window work done, the configurations
        (``num_bytes`` as asked, ``num_max_ops``) compared, the header zeroed on every rank before any
        rank writes again; the session space (a uint8 view of ``space_bytes`` of this rank's window).

        Raises:
            RuntimeError: (on every rank) ranks that disagree on the values; an earlier GPU error.
            TimeoutError: a host wait beyond ``num_cpu_timeout_secs``.
        """
        backend = self.backend
        backend.raise_if_broken()
        num_ranks = self.num_ranks
        stream = torch.cuda.current_stream(self.device)
        self._wait_stream(stream)
        self.release("agrs_set_config")
        if backend.emulated:
            self._wait_stream(backend.comm_stream)   # polled: a blocking wait can stall the peers' threads
        else:
            backend.drain()
        backend.transport.host_barrier()
        # the sum kernel of reduce-scatter handles, loaded now that no rank has work in flight (emulated
        # ranks: together, as a module load waits for the GPU to drain) and not at a handle's first wait
        if backend.emulated:
            backend.group.load_collectively(("agrs_reduce",), lambda: agrs_reduce.load_kernel(self.device))
            backend.module("agrs", ())   # the module of its kernels, loaded with every rank at a barrier
        else:
            agrs_reduce.load_kernel(self.device)
        if not self.peers:
            self.peers = self._read_peers(stream)
        header = self._window_view(AGRS_OFFSET, 4 * _HEADER_ROWS * num_ranks).view(torch.int32)
        self._queue("agrs_set_config's report", [
            call for row, value in enumerate((num_bytes // 32, num_max_ops))
            for call in self._flag_calls(stream.cuda_stream, _CONFIG_ROW + row, value)])
        self._wait_stream(stream)
        backend.transport.host_barrier()
        reports = backend.host_read(header[_CONFIG_ROW * num_ranks:(_CONFIG_ROW + 2) * num_ranks], stream)
        with torch.cuda.stream(stream):
            header.zero_()
        self._wait_stream(stream)
        backend.transport.host_barrier()   # no rank writes into a header before every header is zeroed
        for row, name, scale in ((0, "num_max_session_bytes (rounded up to 32)", 32),
                                 (1, "num_max_all_gathers_per_session", 1)):
            values = [(value & 0xFFFFFFFF) * scale for value in reports[row * num_ranks:(row + 1) * num_ranks]]
            if any(value != values[0] for value in values):
                raise RuntimeError(f"deep_ep: ranks disagree on the {name} of agrs_set_config (per-rank values "
                                   f"{values}); every rank raises this")
        self.configured_call = backend.calls
        return self._window_view(self.space_offset, space_bytes)

    def begin_session(self, session: int) -> None:
        """Queue this rank's "entered session ``session``" word into every window (current stream)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._queue("create_agrs_session", self._flag_calls(stream, _ENTERED_ROW, session))

    def end_session(self, session: int, num_ops: int, offset: int, call: int) -> None:
        """Nothing to queue: the handles were waited; calls that differ between ranks are not detected
        on GPU (no exchange of the calls' shapes)."""

    def _send(self, session, pieces: list, what: str) -> int:
        """Queue, on the current stream, the waits for every rank to have entered the session, the
        copies ``(rank, offset in its window, source address, bytes)`` and this call's flag in every
        window; the call's flag row."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        row = _FLAG_ROW + session.num_ops
        calls = self._wait_calls(stream, _ENTERED_ROW, session.index, _PHASE_ENTERED)
        calls += self._copy_calls(stream, [(self.peers[peer] + offset, source, num_bytes)
                                           for peer, offset, source, num_bytes in pieces])
        calls += self._flag_calls(stream, row, session.index)
        self._queue(what, calls)
        self._track(torch.cuda.current_stream(self.device), session.index, _ENTERED_ROW,
                    f"create_agrs_session #{session.index} (awaited by {what})")
        return row

    def _waiter(self, session, row: int, what: str, then=None):
        """The handle's wait: the current stream (at the handle's call) waits for every rank's flag of
        ``row`` in this session, then runs ``then(stream)``."""
        index = session.index

        def wait() -> None:
            self.backend.raise_if_broken()
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"deep_ep: the handle of {what} cannot be waited during CUDA-graph capture on a "
                                   f"GPU buffer (a replay would not wait for the peers); wait it outside the capture")
            stream = torch.cuda.current_stream(self.device)
            self._queue(what, self._wait_calls(stream.cuda_stream, row, index, _PHASE_CALL))
            self._track(stream, index, row, what)
            if then is not None:
                then(stream)
        return wait

    def all_gather(self, session, tensors: list, offsets: list, in_place: list, call: int):
        """Queue the all-gathers of ``tensors`` into their rooms at ``offsets``; the wait function."""
        pieces = []
        space = self.space_offset
        for tensor, offset, local in zip(tensors, offsets, in_place):
            num_bytes = tensor.numel() * tensor.element_size()
            row_offset = space + offset + self.rank * num_bytes
            source = self.peers[self.rank] + row_offset if local else tensor.data_ptr()
            pieces += [(peer, row_offset, source, num_bytes) for peer in range(self.num_ranks)
                       if not (local and peer == self.rank)]
        what = f"all_gather #{session.num_ops + 1} of AGRS session #{session.index}"
        return self._waiter(session, self._send(session, pieces, what), what)

    def reduce_scatter(self, session, tensors: list, offsets: list, average: bool, call: int):
        """Queue the sends of ``tensors``' chunks into their rooms at ``offsets``; ``(outputs, wait)``,
        the outputs filled by work the wait queues."""
        num_ranks, space = self.num_ranks, self.space_offset
        pieces, rooms, outputs = [], [], []
        for tensor, offset in zip(tensors, offsets):
            chunk = tensor.numel() * tensor.element_size() // num_ranks
            pieces += [(peer, space + offset + self.rank * chunk, tensor.data_ptr() + peer * chunk, chunk)
                       for peer in range(num_ranks)]
            rooms.append(session.space[offset:offset + chunk * num_ranks])
            outputs.append(torch.empty((tensor.shape[0] // num_ranks, *tensor.shape[1:]), dtype=tensor.dtype,
                                       device=self.device))
        allocated_on = torch.cuda.current_stream(self.device)
        what = f"reduce_scatter #{session.num_ops + 1} of AGRS session #{session.index}"

        def reduce(stream) -> None:
            with torch.cuda.stream(stream):
                for room, output in zip(rooms, outputs):
                    if stream != allocated_on:
                        output.record_stream(stream)
                    # one kernel per tensor: the CPU backend's float32 sum in rank order, bit for bit
                    agrs_reduce.reduce(room.view(output.dtype).view(num_ranks, *output.shape), average, output)
        return outputs, self._waiter(session, self._send(session, pieces, what), what, reduce)
