"""Pipeline send/recv of the GPU backend (`ElasticBuffer.pp_send` / `pp_recv` / `pp_set_config`).

One kernel per tensor on the caller's current stream (``include/deep_ep/kernels/pp.cuh``, protocol
in ``impls/pp.cuh``): a send waits on the GPU for a free slot in the receiver's ring, copies the
bytes into the receiver's window and publishes the slot; a receive waits for the slot, copies it out
and hands the slot back to the sender. The host never waits for a send or a receive, so both can be
captured in a CUDA graph (the sequence counters live in the window). The same kernels serve ranks
emulated on one GPU and NCCL windows: they reach the peer only through the transport table.

Window: the PP region starts after the control region (`PP_OFFSET`); see `pp_layout`. Dispatch and
combine write over it, so PP traffic needs a `configure` (pp_set_config) after any dispatch or
combine: `GPUPipeline.check` refuses otherwise. `configure` is collective and blocks the host: it
waits for this rank's streams, meets the other ranks (host barriers), exchanges every rank's
counters through the windows and, when every tensor sent was received, zeroes the counters.

``num_sms``: blocks of the copy kernel; 0 means one block (a PP tensor is usually small next to the
work it overlaps with; pass more for large tensors). The copy-engine variant (no SM) is not done yet.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cuda.streams import poll_event
from .abi import CTRL_BYTES, ERR_TIMEOUT, _read_constants
from .modules import PP_FLUSH_KERNEL, PP_RECV_KERNEL, PP_SEND_KERNEL

__all__ = ["PP_OFFSET", "PP_CONSTANTS", "PpArgs", "PpLayout", "pp_layout", "GPUPipeline", "configure",
           "raise_errors"]

PP_CONSTANTS = _read_constants(Path(__file__).resolve().parents[2] / "include" / "deep_ep" / "impls" / "pp.cuh")
PP_THREADS = PP_CONSTANTS["kPpThreads"]
_FLUSH_WORDS = PP_CONSTANTS["kPpFlushWords"]
_ERR_BYTE_COUNT = PP_CONSTANTS["kErrPpByteCount"]
_PHASE_SEND, _PHASE_RECV = PP_CONSTANTS["kPhasePpSend"], PP_CONSTANTS["kPhasePpRecv"]
#: Byte offset of the PP region in every window: right after the dispatch/combine control region.
PP_OFFSET = CTRL_BYTES
_VEC_BYTES_PER_BLOCK = 16 * PP_THREADS   # bytes one block copies per step (16-byte stores)


class PpArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::PpArgs`` (include/deep_ep/impls/pp.cuh)."""
    _fields_ = [("pp_offset", ctypes.c_int64), ("sizes_offset", ctypes.c_int64), ("ring_offset", ctypes.c_int64),
                ("slot_bytes", ctypes.c_int64), ("num_slots", ctypes.c_int), ("peer", ctypes.c_int),
                ("local_channel", ctypes.c_int), ("remote_channel", ctypes.c_int), ("num_bytes", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64), ("err_host", ctypes.c_void_p)]


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class PpLayout:
    """The PP region of every window (byte offsets from `PP_OFFSET`): a header of u32 words (the
    counters, then every rank's flush report), the byte count of each slot ``[2][num_slots]``, then
    the receive rings ``[2][num_slots][slot_bytes]`` (channel 0: from the previous rank, 1: from the
    next). ``end``: the window bytes the region needs, `PP_OFFSET` included."""
    slot_bytes: int
    num_slots: int
    sizes_offset: int
    ring_offset: int
    end: int


def pp_layout(num_ranks: int, slot_bytes: int, num_slots: int) -> PpLayout:
    """The layout for ``num_ranks`` ranks, slots of ``slot_bytes`` (a multiple of 32) and
    ``num_slots`` tensors in flight per channel. A window of `get_pp_buffer_size_hint` bytes always
    holds it: the rings take half of the hint's four slot sets, the header and byte counts less than
    the rest."""
    header = _align(4 * (PP_CONSTANTS["kPpFlush"] + num_ranks * _FLUSH_WORDS), 256)
    ring_offset = header + _align(4 * 2 * num_slots, 256)
    return PpLayout(slot_bytes, num_slots, header, ring_offset, PP_OFFSET + ring_offset + 2 * num_slots * slot_bytes)


def raise_errors(backend) -> None:
    """Raise for an error a kernel of this rank recorded (read from the mapped host record: no stream
    operation); PP's own records get PP's messages, the others the backend's.

    Raises:
        TimeoutError: a PP wait gave up after ``num_gpu_timeout_secs``.
        ValueError: a pp_recv whose tensor had another byte count than the one sent.
        RuntimeError: an earlier error left the buffer unusable.
    """
    if backend.broken is None and backend.err_record.words[0] != 0:
        code, rank, peer, phase = backend.err_record.read()
        if code == _ERR_BYTE_COUNT:
            backend.broken = "pp_recv byte count"
            raise ValueError(f"pp_recv on rank {rank}: rank {peer} sent a tensor of {phase} bytes, but the receiving "
                             f"tensor had another byte count; the receiving tensor must have the sent tensor's byte "
                             f"size. On a GPU buffer this is found on the GPU after the call, and the buffer can no "
                             f"longer be used (destroy it and create a new one)")
        if code == ERR_TIMEOUT and phase in (_PHASE_SEND, _PHASE_RECV):
            backend.broken = "pp timeout"
            what = (f"pp_send waited for rank {peer} to take an earlier tensor (num_max_inflight_tensors in flight)"
                    if phase == _PHASE_SEND else f"pp_recv waited for a tensor from rank {peer}")
            raise TimeoutError(f"deep_ep GPU timeout on rank {rank}: {what} for longer than "
                               f"{backend.config.num_gpu_timeout_secs} s (num_gpu_timeout_secs); every pp_send needs "
                               f"a pp_recv on the destination, in the same order. This buffer can no longer be used "
                               f"(destroy it and create a new one)")
    backend.raise_if_broken()


def _wait_stream(backend, stream) -> None:
    """Poll until ``stream``'s work queued so far is done (never a blocking driver wait)."""
    event = torch.cuda.Event()
    event.record(stream)
    if not poll_event(event, backend.config.num_cpu_timeout_secs, backend.spin_secs):
        backend.broken = "host timeout"
        raise TimeoutError(f"deep_ep: rank {backend.rank} waited {backend.config.num_cpu_timeout_secs} s on the host "
                           f"for its stream in pp_set_config (num_cpu_timeout_secs); the GPU-side timeout did not fire")


class GPUPipeline:
    """The PP channels of one buffer on one rank for one configuration (see the module docstring).

    ``sent`` / ``received``: tensors this host queued to / from each rank (a CUDA graph's replays
    are not counted; the GPU's counters are what `configure` checks).
    """

    def __init__(self, backend, layout: PpLayout, configured_call: int) -> None:
        self.backend = backend
        self.rank, self.num_ranks = backend.rank, backend.num_ranks
        self.layout = layout
        self.num_slot_bytes = layout.slot_bytes
        self.num_max_inflight_tensors = layout.num_slots
        self.prev_rank = (self.rank - 1) % self.num_ranks
        self.next_rank = (self.rank + 1) % self.num_ranks
        self.configured_call = configured_call
        self.sent = [0] * self.num_ranks
        self.received = [0] * self.num_ranks

    def num_inflight(self, peer: int) -> int:
        """Tensors this host queued to ``peer`` minus those it queued from ``peer``: with one rank (the
        loopback), the tensors in flight."""
        return self.sent[peer] - self.received[peer]

    def check(self, method: str, t: torch.Tensor, peer: int, num_sms: int) -> int:
        """Everything a send or receive checks before its launch; returns the blocks to launch.

        Raises:
            RuntimeError: a recorded error, a dispatch or combine since pp_set_config, or a one-rank
                group whose call would wait for itself. TimeoutError / ValueError: see `raise_errors`.
            ValueError: ``num_sms`` beyond what emulated ranks may hold at once.
        """
        backend = self.backend
        raise_errors(backend)
        if backend.call_record.launched_call > self.configured_call:
            raise RuntimeError(f"{method}: dispatch, combine or another primitive ran on this buffer since the last "
                               f"pp_set_config, and on a GPU buffer they write over the pipeline's slots; call "
                               f"pp_set_config on every rank after them, before pipeline send/recv")
        if self.num_ranks == 1:
            inflight = self.num_inflight(peer)
            if method == "pp_send" and inflight >= self.num_max_inflight_tensors:
                raise RuntimeError(f"deep_ep: pp_send on a group of one rank with {inflight} tensors in flight "
                                   f"(num_max_inflight_tensors={self.num_max_inflight_tensors}) would wait for itself "
                                   f"forever; pp_recv the oldest first")
            if method == "pp_recv" and inflight <= 0:
                raise RuntimeError("deep_ep: pp_recv on a group of one rank with nothing in flight would wait for "
                                   "itself forever; pp_send first")
        blocks = num_sms or 1
        if blocks > backend._sm_limit:
            if backend.emulated:
                raise ValueError(f"{method}: {self.num_ranks} emulated ranks x num_sms={blocks} > "
                                 f"{backend.num_device_sms} SMs of the device: every rank's blocks must be resident "
                                 f"at once (ranks wait on each other); use num_sms <= {backend._sm_limit}")
            blocks = backend._sm_limit
        return max(1, min(blocks, -(-t.nbytes // _VEC_BYTES_PER_BLOCK)))

    def _args(self, t: torch.Tensor, peer: int) -> PpArgs:
        layout, backend = self.layout, self.backend
        local_channel = 0 if peer == self.prev_rank else 1
        remote_channel = 0 if self.rank == (peer - 1) % self.num_ranks else 1
        return PpArgs(PP_OFFSET, layout.sizes_offset, layout.ring_offset, layout.slot_bytes, layout.num_slots, peer,
                      local_channel, remote_channel, t.nbytes, t.data_ptr() if t.nbytes else None,
                      backend.timeout_ns, backend.err_record.device_ptr)

    def _launch(self, kernel: str, blocks: int, args: PpArgs) -> None:
        backend = self.backend
        stream = torch.cuda.current_stream(backend.device)
        module = backend.module("pp", ())
        module.function(kernel).launch(blocks, PP_THREADS, (backend.transport_args, args), stream=stream.cuda_stream,
                                       device=backend.device.index)

    def send(self, t: torch.Tensor, peer: int, blocks: int) -> None:
        """Queue the send of contiguous ``t`` to neighbour ``peer`` on the current stream (checked by
        `check`, which gave ``blocks``)."""
        self._launch(PP_SEND_KERNEL, blocks, self._args(t, peer))
        self.sent[peer] += 1

    def recv(self, t: torch.Tensor, peer: int, blocks: int) -> None:
        """Queue the receive of the oldest tensor from ``peer`` into contiguous ``t`` on the current stream."""
        self._launch(PP_RECV_KERNEL, blocks, self._args(t, peer))
        self.received[peer] += 1


def _flush_step(backend, module, layout: PpLayout, step: int, valid: bool, stream, data=None) -> None:
    args = PpArgs(PP_OFFSET, layout.sizes_offset, layout.ring_offset, layout.slot_bytes, layout.num_slots, 0, 0, 0,
                  0, None if data is None else data.data_ptr(), backend.timeout_ns, backend.err_record.device_ptr)
    module.function(PP_FLUSH_KERNEL).launch(1, PP_THREADS, (backend.transport_args, args, int(step), int(valid)),
                                            stream=stream.cuda_stream, device=backend.device.index)


def configure(backend, old, num_slot_bytes: int, num_max_inflight_tensors: int) -> GPUPipeline:
    """Collective: flush ``old`` (None: never configured) and return fresh channels (module docstring).

    Raises, on every rank, `RuntimeError` when ranks disagree on the sizes or a tensor sent was not
    received (``old`` is then kept: receive the rest and call again); `TimeoutError` / `ValueError`
    for an error a PP kernel recorded (`raise_errors`), or a host wait beyond ``num_cpu_timeout_secs``.
    """
    num_ranks, device = backend.num_ranks, backend.device
    layout = pp_layout(num_ranks, num_slot_bytes, num_max_inflight_tensors)
    module = backend.module("pp", ())   # first use: loaded collectively before any PP kernel runs
    stream = torch.cuda.current_stream(device)
    # 1. Every rank's earlier work on the window is done (PP kernels, dispatch, combine).
    _wait_stream(backend, stream)
    if backend.emulated:
        _wait_stream(backend, backend.comm_stream)   # polled: a blocking wait can stall the peers' threads
    else:
        backend.drain()
    raise_errors(backend)
    backend.transport.host_barrier()
    # 2. Every rank reports its counters and sizes into every window; 3. each reads all reports.
    valid = old is not None and backend.call_record.launched_call <= old.configured_call
    _flush_step(backend, module, layout, 0, valid, stream)
    _wait_stream(backend, stream)
    backend.transport.host_barrier()
    report = torch.empty(num_ranks * _FLUSH_WORDS, dtype=torch.int32, device=device)
    _flush_step(backend, module, layout, 1, valid, stream, report)
    words = [value & 0xFFFFFFFF for value in backend.host_read(report, stream)]
    rows = [words[r * _FLUSH_WORDS:(r + 1) * _FLUSH_WORDS] for r in range(num_ranks)]
    for column, name in ((4, "num_max_tensor_bytes (rounded up to 32)"), (5, "num_max_inflight_tensors")):
        values = [row[column] * (32 if column == 4 else 1) for row in rows]
        if any(value != values[0] for value in values):
            raise RuntimeError(f"pp_set_config: ranks disagree on {name}: per-rank values {values}; every rank must "
                               f"pass the same values")
    missing = []
    for src in range(num_ranks):
        for channel in ((0, 1) if num_ranks > 2 else (0,)):
            dst = (src - 1) % num_ranks if channel == 0 else (src + 1) % num_ranks
            dst_channel = 0 if src == (dst - 1) % num_ranks else 1
            count = (rows[src][channel] - rows[dst][2 + dst_channel]) & 0xFFFFFFFF
            if count:
                missing.append((src, dst, count - (1 << 32) if count >= 1 << 31 else count))
    if missing:
        where = ", ".join(f"{count} from rank {src} to rank {dst}" for src, dst, count in missing)
        raise RuntimeError(f"pp_set_config: tensors sent and not received ({where}). Make the matching pp_recv "
                           f"calls, then call pp_set_config again on every rank")
    # 4. Fresh counters on every rank before any rank sends again.
    _flush_step(backend, module, layout, 2, valid, stream)
    _wait_stream(backend, stream)
    backend.transport.host_barrier()
    return GPUPipeline(backend, layout, backend.calls)
