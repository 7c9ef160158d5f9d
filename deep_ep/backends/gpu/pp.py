"""Pipeline send/recv of the GPU backend (`ElasticBuffer.pp_send` / `pp_recv` / `pp_set_config`).

A send waits on the GPU for a free slot in the receiver's ring, copies the bytes into the
receiver's window and publishes the slot; a receive waits for the slot, copies it out and hands the
slot back to the sender (protocol and words in ``include/deep_ep/impls/pp.cuh``). Everything is
queued on the caller's current stream; the host never waits for a send or a receive. Two paths
move the bytes, over the same words and slots, so calls may mix them on one channel:

* ``num_sms == 0``: the copy engine, holding no SM. Stream memory operations of the CUDA driver
  (``cuStreamWaitValue32`` GEQ, which compares wrapping u32 counters, and ``cuStreamWriteValue32``,
  which fences the copies queued before it) wait for and write the counters as absolute values; the
  host knows them because it counts the calls. A receive cannot compare byte counts on the GPU, so
  it copies the slot's byte count to mapped host memory (`ByteCountChecks`) and the host compares at
  its next PP call. No GPU-side timeout: a stream whose peer never sends waits until it does (the
  host wait of pp_set_config gives up after ``num_cpu_timeout_secs``). Not capturable in a CUDA
  graph (a replay would repeat the sequence numbers): inside a capture, and after one until the next
  pp_set_config (the replays moved the GPU's counters past the host's count), ``num_sms=0`` runs the
  kernel below with one block instead.
* ``num_sms > 0``: one kernel (``include/deep_ep/kernels/pp.cuh``) of that many blocks (fewer for a
  small tensor), which reads the counters on the GPU, so it can be captured in a CUDA graph and
  replayed; its waits give up after ``num_gpu_timeout_secs``.

Both serve ranks emulated on one GPU (the windows are slices of one allocation) and NCCL windows:
the kernels reach a peer through the transport table, the copy engine through the window bases that
pp_set_config reads once per configuration.

Window: the PP region starts after the control region (`PP_OFFSET`); see `pp_layout`. Dispatch and
combine write over it, so PP traffic needs a `configure` (pp_set_config) after any dispatch or
combine: `GPUPipeline.check` refuses otherwise. `configure` is collective and blocks the host: it
waits for this rank's streams, meets the other ranks (host barriers), exchanges every rank's
counters through the windows and, when every tensor sent was received, zeroes the counters.
"""
from __future__ import annotations

import collections
import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cuda.driver import can_flush_remote_writes, driver, memcpy_async, stream_wait_u32, stream_write_u32
from ...cuda.streams import poll_event
from .abi import CONSTANTS, CTRL_BYTES, ERR_TIMEOUT, _read_constants
from .errors import MappedWords, queue_driver_calls
from .modules import PP_FLUSH_KERNEL, PP_RECV_KERNEL, PP_SEND_KERNEL

__all__ = ["PP_OFFSET", "PP_CONSTANTS", "PpArgs", "PpLayout", "pp_layout", "ByteCountChecks", "GPUPipeline",
           "configure", "raise_errors"]

PP_CONSTANTS = _read_constants(Path(__file__).resolve().parents[2] / "include" / "deep_ep" / "impls" / "pp.cuh")
PP_THREADS = PP_CONSTANTS["kPpThreads"]
_FLUSH_WORDS = PP_CONSTANTS["kPpFlushWords"]
_ERR_BYTE_COUNT = CONSTANTS["kErrPpByteCount"]
_PHASE_SEND, _PHASE_RECV = CONSTANTS["kPhasePpSend"], CONSTANTS["kPhasePpRecv"]
_SENT, _FREED = PP_CONSTANTS["kPpSent"], PP_CONSTANTS["kPpFreed"]
_PUBLISHED, _CONSUMED = PP_CONSTANTS["kPpPublished"], PP_CONSTANTS["kPpConsumed"]
_U32 = 0xFFFFFFFF
#: Copy-engine receives whose byte count the host keeps for checking at once (`ByteCountChecks`).
BYTE_COUNT_CHECKS = 1024
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
            _raise_byte_count(backend, rank, peer, phase)
        if code == ERR_TIMEOUT and phase in (_PHASE_SEND, _PHASE_RECV):
            backend.broken = "pp timeout"
            what = (f"pp_send waited for rank {peer} to take an earlier tensor (num_max_inflight_tensors in flight)"
                    if phase == _PHASE_SEND else f"pp_recv waited for a tensor from rank {peer}")
            raise TimeoutError(f"deep_ep GPU timeout on rank {rank}: {what} for longer than "
                               f"{backend.config.num_gpu_timeout_secs} s (num_gpu_timeout_secs); every pp_send needs "
                               f"a pp_recv on the destination, in the same order. This buffer can no longer be used "
                               f"(destroy it and create a new one)")
    backend.raise_if_broken()


def _raise_byte_count(backend, rank: int, peer: int, sent_bytes: int, received_bytes=None) -> None:
    backend.broken = "pp_recv byte count"
    theirs = "another byte count" if received_bytes is None else f"{received_bytes} bytes"
    raise ValueError(f"pp_recv on rank {rank}: rank {peer} sent a tensor of {sent_bytes} bytes, but the receiving "
                     f"tensor had {theirs}; the receiving tensor must have the sent tensor's byte size. On a GPU "
                     f"buffer this is found after the call (the SM path leaves the tensor unchanged, the copy "
                     f"engine fills it with the slot's bytes), and the buffer can no longer be used (destroy it and "
                     f"create a new one)")


class ByteCountChecks:
    """The sent byte counts of copy-engine receives, compared on the host with no stream operation.

    Checked receive number ``index`` copies the slot's byte count into word ``index % capacity`` of
    mapped host memory, which the host set to ``0xFFFFFFFF`` (no tensor has that many bytes) when
    it queued the receive; `raise_mismatch` compares the words that changed, oldest first, stopping
    at the first one still on its way. A word is reused only after its check, so while ``capacity``
    receives are unchecked (the host ran that far ahead of the GPU) a further receive is not
    checked: its count goes to a spare word.
    """

    def __init__(self, device: torch.device, capacity: int = BYTE_COUNT_CHECKS) -> None:
        self.words = MappedWords(device, capacity + 1)   # the last: the spare word
        self.capacity = capacity
        self.booked = 0
        self.pending: collections.deque = collections.deque()   # (index, the receiving tensor's bytes, peer)
        self.streams: set = set()   # raw streams the counts were queued on (`free` looks at them)

    def entry(self, num_bytes: int, peer: int, stream: int) -> int:
        """Book a check of a receive into ``num_bytes`` from ``peer`` queued on ``stream``; the
        device address its byte count goes to."""
        self.streams.add(stream)
        if len(self.pending) >= self.capacity:
            return self.words.device_ptr + 4 * self.capacity
        index = self.booked
        self.booked += 1
        self.words.words[index % self.capacity] = -1
        self.pending.append((index, num_bytes, peer))
        return self.words.device_ptr + 4 * (index % self.capacity)

    def raise_mismatch(self, backend) -> None:
        """Compare every count that arrived, oldest first.

        Raises:
            ValueError: a receive whose tensor had another byte count than the one sent (the buffer
                is then unusable).
        """
        words = self.words.words
        while self.pending:
            index, num_bytes, peer = self.pending[0]
            sent_bytes = words[index % self.capacity] & _U32
            if sent_bytes == _U32:
                return
            self.pending.popleft()
            if sent_bytes != num_bytes:
                _raise_byte_count(backend, backend.rank, peer, sent_bytes, num_bytes)

    def free(self, device: torch.device) -> None:
        """Release the mapped words when the streams that write them have no work left; otherwise
        leave them allocated (a late write must land somewhere; a destroy does not wait for them)."""
        try:
            for stream in self.streams:
                event = torch.cuda.Event()
                event.record(torch.cuda.ExternalStream(stream, device=device))
                if not event.query():
                    return
        except RuntimeError:   # a stream destroyed since: nothing tells whether its work finished
            return
        self.words.free()


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
    are not counted; the GPU's counters are what `configure` checks). ``counts_exact``: no PP call
    was captured since `configure`, so they equal the GPU's counters (the copy engine's sequence
    numbers). ``peers``: every rank's window base as this GPU addresses it. ``byte_counts``: the
    copy-engine receives' checks (`ByteCountChecks`, kept across configurations).
    """

    def __init__(self, backend, layout: PpLayout, configured_call: int, peers: list,
                 byte_counts: ByteCountChecks) -> None:
        self.backend = backend
        self.peers = peers
        self.byte_counts = byte_counts
        self.counts_exact = True
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
        """Everything a send or receive checks before queueing; returns the blocks to launch, 0 for
        the copy engine (``num_sms == 0``).

        Raises:
            RuntimeError: a recorded error, a dispatch or combine since pp_set_config, or a one-rank
                group whose call would wait for itself. TimeoutError / ValueError: see `raise_errors`.
            ValueError: a copy-engine receive whose byte count differed; ``num_sms`` beyond what
                emulated ranks may hold at once.
        """
        backend = self.backend
        raise_errors(backend)
        self.byte_counts.raise_mismatch(backend)
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
        if num_sms == 0 and self.counts_exact and not torch.cuda.is_current_stream_capturing():
            return 0
        # Inside a capture (a replay would repeat the copy engine's sequence numbers, fixed when
        # queued) and after one until pp_set_config (the replays moved the GPU's counters past the
        # host's count), num_sms=0 takes the SM kernel with one block: it reads the counters on the GPU.
        blocks = max(1, num_sms)
        if blocks > backend._sm_limit:
            if backend.emulated:
                raise ValueError(f"{method}: {self.num_ranks} emulated ranks x num_sms={blocks} > "
                                 f"{backend.num_device_sms} SMs of the device: every rank's blocks must be resident "
                                 f"at once (ranks wait on each other); use num_sms <= {backend._sm_limit}")
            blocks = backend._sm_limit
        return max(1, min(blocks, -(-t.nbytes // _VEC_BYTES_PER_BLOCK)))

    def _channels(self, peer: int) -> tuple:
        """(this rank's channel towards ``peer``, ``peer``'s channel towards this rank)."""
        return 0 if peer == self.prev_rank else 1, 0 if self.rank == (peer - 1) % self.num_ranks else 1

    def _args(self, t: torch.Tensor, peer: int) -> PpArgs:
        layout, backend = self.layout, self.backend
        local_channel, remote_channel = self._channels(peer)
        return PpArgs(PP_OFFSET, layout.sizes_offset, layout.ring_offset, layout.slot_bytes, layout.num_slots, peer,
                      local_channel, remote_channel, t.nbytes, t.data_ptr() if t.nbytes else None,
                      backend.timeout_ns, backend.err_record.device_ptr)

    def _launch(self, kernel: str, blocks: int, args: PpArgs) -> None:
        backend = self.backend
        stream = torch.cuda.current_stream(backend.device)
        module = backend.module("pp", ())
        module.function(kernel).launch(blocks, PP_THREADS, (backend.transport_args, args), stream=stream.cuda_stream,
                                       device=backend.device.index)

    # ------------------------------------------------------------------ the copy engine's addresses
    def _word(self, rank: int, word: int) -> int:
        """Device address of PP header word ``word`` in ``rank``'s window."""
        return self.peers[rank] + PP_OFFSET + 4 * word

    def _slot_index(self, channel: int, seq: int) -> int:
        # the kernels take the slot from the u32 counter
        return channel * self.layout.num_slots + (seq & _U32) % self.layout.num_slots

    def _slot(self, rank: int, channel: int, seq: int) -> int:
        return self.peers[rank] + PP_OFFSET + self.layout.ring_offset + self._slot_index(channel, seq) * \
            self.layout.slot_bytes

    def _byte_count(self, rank: int, channel: int, seq: int) -> int:
        return self.peers[rank] + PP_OFFSET + self.layout.sizes_offset + 4 * self._slot_index(channel, seq)

    def _queue(self, what: str, calls: list) -> None:
        """`errors.queue_driver_calls` for this rank (RuntimeError, the buffer unusable, on a refusal)."""
        queue_driver_calls(self.backend, self.rank, what, calls)

    def _send_by_copy_engine(self, t: torch.Tensor, peer: int) -> None:
        """Tensor ``seq`` waits for the receiver to have freed tensor ``seq - num_slots`` (the slot's
        previous tenant), fills the slot and its byte count, then publishes ``seq + 1`` in the
        receiver's word and in this rank's own ``sent`` (what the kernels read)."""
        seq, num_slots = self.sent[peer], self.layout.num_slots
        local_channel, remote_channel = self._channels(peer)
        stream = torch.cuda.current_stream(self.backend.device).cuda_stream
        calls = []
        if seq >= num_slots:
            calls.append((stream_wait_u32, (stream, self._word(self.rank, _FREED + local_channel),
                                            seq + 1 - num_slots)))
        if t.nbytes:
            calls.append((memcpy_async, (self._slot(peer, remote_channel, seq), t.data_ptr(), t.nbytes, stream)))
        calls += [(stream_write_u32, (stream, self._byte_count(peer, remote_channel, seq), t.nbytes)),
                  (stream_write_u32, (stream, self._word(peer, _PUBLISHED + remote_channel), seq + 1)),
                  (stream_write_u32, (stream, self._word(self.rank, _SENT + local_channel), seq + 1))]
        self._queue(f"pp_send to rank {peer}", calls)

    def _recv_by_copy_engine(self, t: torch.Tensor, peer: int) -> None:
        """Tensor ``seq`` waits for the sender to have published ``seq + 1``, copies the slot out and
        its byte count to the host's check, then writes ``seq + 1`` into this rank's ``consumed`` and
        the sender's ``freed``."""
        seq = self.received[peer]
        local_channel, remote_channel = self._channels(peer)
        stream = torch.cuda.current_stream(self.backend.device).cuda_stream
        # the slot's bytes came from the sender's copy engine before the word that satisfies the wait
        flush = can_flush_remote_writes(self.backend.device.index)
        calls = [(stream_wait_u32, (stream, self._word(self.rank, _PUBLISHED + local_channel), seq + 1, flush))]
        if t.nbytes:
            calls.append((memcpy_async, (t.data_ptr(), self._slot(self.rank, local_channel, seq), t.nbytes, stream)))
        count_address = self.byte_counts.entry(t.nbytes, peer, stream)
        calls += [(_copy_async, (count_address, self._byte_count(self.rank, local_channel, seq), 4, stream)),
                  (stream_write_u32, (stream, self._word(self.rank, _CONSUMED + local_channel), seq + 1)),
                  (stream_write_u32, (stream, self._word(peer, _FREED + remote_channel), seq + 1))]
        self._queue(f"pp_recv from rank {peer}", calls)

    # ------------------------------------------------------------------ calls
    def send(self, t: torch.Tensor, peer: int, blocks: int) -> None:
        """Queue the send of contiguous ``t`` to neighbour ``peer`` on the current stream (checked by
        `check`, which gave ``blocks``; 0: the copy engine)."""
        if blocks:
            self._launch(PP_SEND_KERNEL, blocks, self._args(t, peer))
            self.counts_exact = self.counts_exact and not torch.cuda.is_current_stream_capturing()
        else:
            self._send_by_copy_engine(t, peer)
        self.sent[peer] += 1

    def recv(self, t: torch.Tensor, peer: int, blocks: int) -> None:
        """Queue the receive of the oldest tensor from ``peer`` into contiguous ``t`` on the current
        stream (``blocks`` as for `send`)."""
        if blocks:
            self._launch(PP_RECV_KERNEL, blocks, self._args(t, peer))
            self.counts_exact = self.counts_exact and not torch.cuda.is_current_stream_capturing()
        else:
            self._recv_by_copy_engine(t, peer)
        self.received[peer] += 1

    def release(self) -> None:
        """Free the copy-engine checks' host memory if the streams that write it are done
        (`ElasticBuffer.destroy`)."""
        self.byte_counts.free(self.backend.device)


def _copy_async(dst: int, src: int, num_bytes: int, stream: int) -> int:
    """``cuMemcpyAsync``: a copy between any addresses of the unified space (here into mapped host
    memory) on the raw ``stream``; the ``CUresult`` as an int."""
    (err,) = driver().cuMemcpyAsync(dst, src, num_bytes, stream)
    return int(err)


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
    if old is not None:
        old.byte_counts.raise_mismatch(backend)
    backend.transport.host_barrier()
    # 2. Every rank reports its counters and sizes into every window; 3. each reads all reports.
    valid = old is not None and backend.call_record.launched_call <= old.configured_call
    _flush_step(backend, module, layout, 0, valid, stream)
    _wait_stream(backend, stream)
    backend.transport.host_barrier()
    report = torch.empty(num_ranks * (_FLUSH_WORDS + 2), dtype=torch.int32, device=device)   # rows, then bases
    _flush_step(backend, module, layout, 1, valid, stream, report)
    words = [value & _U32 for value in backend.host_read(report, stream)]
    bases = words[num_ranks * _FLUSH_WORDS:]
    peers = [bases[2 * rank] | (bases[2 * rank + 1] << 32) for rank in range(num_ranks)]
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
    # allocated while no rank can queue PP traffic (the last barrier is ahead)
    byte_counts = ByteCountChecks(device) if old is None else old.byte_counts
    # 4. Fresh counters on every rank before any rank sends again.
    _flush_step(backend, module, layout, 2, valid, stream)
    _wait_stream(backend, stream)
    backend.transport.host_barrier()
    return GPUPipeline(backend, layout, backend.calls, peers, byte_counts)
