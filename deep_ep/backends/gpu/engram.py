"""Engram storage of the GPU backend: each rank's shard in pinned host memory or in its window,
fetched one-sided.

Where the shard lives is chosen by each `engram_write` (every rank the same): ``"host"`` (DeepEP's
place for it) keeps it in ``num_cpu_bytes`` of pinned host memory the rank allocates at its first
such write, mapped into the device so peers' gather kernels read it over PCIe or C2C; ``"device"``
keeps it in the last ``num_cpu_bytes`` bytes of the rank's window (`storage_offset`; dispatch and
combine lay their rows out before it, `GPUBackend.layout`), read over NVLink. Ranks of one process
(emulated ranks, a one-rank group) share host memory by address; ranks in separate processes share
it through the driver's virtual memory API (`deep_ep.backends.gpu.engram_host`). Either way
`engram_write`'s header takes the `HEADER_BYTES` of the window just below the storage.

`GPUEngramTable.write` is collective and blocks the host: every rank waits for its earlier fetches
and kernels and meets the others; each stores a header (the call, the shard's format and place, a
digest of ``sf``, how to reach its host shard) into its window, gathers every rank's header and
checks that they agree (the same `RuntimeError` on every rank otherwise, and the old table stays),
stores its shard and meets the others again, so every rank can fetch every rank's new entries once
it returns. `GPUEngramTable.fetch` is local: one gather kernel on the caller's stream reads the rows
from their owners' shards (host addresses, NVLink LSA pointers, or slices of one allocation for
emulated ranks) and the scale factors from this rank's copy. Indices are checked on the GPU: an
out-of-range one is never read, its row is zeroed and the host raises `ValueError` at this rank's
next fetch (`raise_bad_index`).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from .. import outputs
from ..engram_table import AGREED_FIELDS, STORAGE_FORMATS, EngramTableState
from ... import jit, shapes
from ...cuda.streams import poll_event
from .abi import _read_constants
from .engram_host import DESCRIPTION_WORDS, copy_bytes, create_host_shard, reach_host_shards
from .errors import MappedWords
from .modules import ENGRAM_GATHER_KERNEL, ENGRAM_STORE_KERNEL

__all__ = ["ENGRAM_CONSTANTS", "EngramArgs", "GPUEngramTable", "HEADER_BYTES", "storage_offset"]

ENGRAM_CONSTANTS = _read_constants(Path(__file__).resolve().parents[2] / "include" / "deep_ep" / "impls" /
                                   "engram.cuh")
ENGRAM_THREADS = ENGRAM_CONSTANTS["kEngramThreads"]
_ROWS_PER_BLOCK = ENGRAM_CONSTANTS["kEngramWarps"]
HEADER_BYTES = ENGRAM_CONSTANTS["kEngramHeaderBytes"]
_MAX_BLOCKS = 65535

# engram_write's header: int32 words (HEADER_BYTES in all).
_MAGIC, _CALL, _NUM_ENTRIES, _HIDDEN, _FORMAT, _NUM_SF_PACKS, _SF_ROWS, _SF_DIGEST = range(8)   # digest: 2 words
_LOCATION, _SHARD = 9, 10   # the shard's place; how peers reach a host shard (4 words: `engram_host`)
_HEADER_WORDS = HEADER_BYTES // 4
_MAGIC_VALUE = 0x456E6772   # "Engr": a header that was stored, not a leftover of another use of the window
_AGREE = tuple(zip((_NUM_ENTRIES, _HIDDEN, _FORMAT, _NUM_SF_PACKS, _SF_ROWS, _SF_DIGEST, _LOCATION), AGREED_FIELDS))
_LOCATION_CODES = {"device": 0, "host": 1}   # `engram_write`'s storage_location -> its header's number


class EngramArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::EngramArgs`` (include/deep_ep/impls/engram.cuh)."""
    _fields_ = [("storage_offset", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("sf_token_stride", ctypes.c_int64), ("sf_column_stride", ctypes.c_int64),
                ("indices", ctypes.c_void_p), ("out", ctypes.c_void_p), ("sf", ctypes.c_void_p),
                ("out_sf", ctypes.c_void_p), ("bad_index_host", ctypes.c_void_p), ("shards", ctypes.c_void_p),
                ("num_entries", ctypes.c_int),
                ("num_fetched", ctypes.c_int), ("num_per_token", ctypes.c_int), ("num_sf_packs", ctypes.c_int)]


def storage_offset(backend) -> int:
    """Byte offset of the Engram shard in every window of ``backend``: its last ``num_cpu_bytes``."""
    return backend.transport.num_bytes - backend.config.num_cpu_bytes


def _sf_digest(sf: torch.Tensor) -> torch.Tensor:
    """int32 ``[2]`` on ``sf``'s device: a position-weighted sum of its words (int64, wrapping; exact,
    so every rank computes the same value for the same bytes), computed on the stream."""
    words = sf.reshape(-1).view(torch.int32).to(torch.int64)
    weights = torch.arange(1, 2 * words.numel(), 2, dtype=torch.int64, device=sf.device)
    return ((words + 0x9E3779B9) * weights).sum().reshape(1).view(torch.int32)


class GPUEngramTable(EngramTableState):
    """One buffer's Engram table on one rank of a GPU buffer (see the module docstring)."""

    def __init__(self, backend) -> None:
        super().__init__(backend.rank, backend.num_ranks)
        self.backend = backend
        self.bad_index = MappedWords(backend.device, 2)   # one u64: (position + 1) | index << 32
        # every fetch not known to be done: fetches may run on several streams, and a write must wait
        # for all of them (finished ones are dropped at each fetch, so the list stays short)
        self.fetches: list = []
        self.location = "device"   # where the current table's shards are
        self.one_process = backend.emulated or backend.num_ranks == 1
        self.host_shard = None     # this rank's host memory (allocated at the first write to "host")
        # every rank's shard as this rank reaches it (by rank; this rank's own None across processes)
        self.peer_shards: Optional[list] = None
        self.shard_addresses: Optional[torch.Tensor] = None   # int64 [num_ranks] on the device

    def _wait_for_fetches(self) -> None:
        """Poll until every fetch kernel of this rank finished, whichever stream it ran on."""
        while self.fetches:
            self._poll(self.fetches[0], "an earlier engram_fetch")
            self.fetches.pop(0)

    def _poll(self, event, what: str) -> None:
        backend = self.backend
        if not poll_event(event, backend.config.num_cpu_timeout_secs, backend.spin_secs):
            backend.broken = "host timeout"
            raise TimeoutError(f"deep_ep: rank {self.rank} waited {backend.config.num_cpu_timeout_secs} s on the "
                               f"host for {what} (num_cpu_timeout_secs); the buffer can no longer be used")

    def _wait_stream(self, stream, what: str) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self._poll(event, what)

    def release(self) -> None:
        """Forget the table, free the mapped word and let go of the host shards (after this rank's last
        fetch kernel finished; a peer's host shard is freed when its last reader lets go)."""
        try:
            self._wait_for_fetches()
        finally:
            self.bad_index.free()
            self._forget_table()
            # the holds on every rank's shard (this rank's among them only in one process), then its own
            shards = [shard for shard in (self.peer_shards or []) + [self.host_shard] if shard is not None]
            self.host_shard = self.peer_shards = self.shard_addresses = None
            for shard in shards:
                shard.drop()

    # ------------------------------------------------------------------ bad indices (found on the GPU)
    def raise_bad_index(self) -> None:
        """Raise `ValueError` for an out-of-range index an earlier fetch's kernel found (and forget it).

        Raises:
            ValueError: naming the index, its position and the valid range.
        """
        word = ctypes.c_uint64.from_address(self.bad_index.host_ptr)
        record = word.value
        if record == 0:
            return
        word.value = 0
        position = (record & 0xFFFFFFFF) - 1
        index = ctypes.c_int32(record >> 32).value
        num_total = self.num_ranks * self.num_entries
        raise ValueError(f"an earlier engram_fetch on rank {self.rank} had entry {index} at flat position {position} "
                         f"of its indices (row-major [T, E]): entries must be in [0, {num_total}) ({self.num_ranks} "
                         f"ranks x {self.num_entries} entries). The GPU checks indices while it gathers: that row "
                         f"(and its scale factors) came back zeroed; nothing else was affected")

    # ------------------------------------------------------------------ write (collective)
    def write(self, call: int, storage: torch.Tensor, sf: Optional[torch.Tensor], location: str = "host") -> None:
        """Replace this rank's shard with ``storage`` (validated by the caller) and make every rank's
        new shard fetchable; ``location``: "host" (pinned host memory) or "device" (the window).
        Collective; see the module docstring.

        Raises (on every rank): RuntimeError when ranks disagree on the format or place or are at
        different calls; TimeoutError when a host wait exceeds ``num_cpu_timeout_secs``. On this rank
        only (its peers then time out): RuntimeError / OSError when host memory cannot be allocated,
        shared or mapped."""
        backend = self.backend
        device, stream = backend.device, torch.cuda.current_stream(backend.device)
        module = backend.module("engram", ())   # first use: loaded collectively before any Engram kernel
        offset = storage_offset(backend)
        header_offset = offset - HEADER_BYTES
        if location == "host" and self.host_shard is None:
            num_bytes = backend.config.num_cpu_bytes
            self.host_shard = create_host_shard(device, num_bytes, self.one_process)
        # 1. Every rank's earlier fetches (they read peers' shards) and kernels are done (a peer's
        # combine may still read rows of this window until then).
        self._wait_for_fetches()
        self._wait_stream(stream, "its stream in engram_write")
        if backend.emulated:
            self._wait_stream(backend.comm_stream, "its communication stream in engram_write")
        else:
            backend.drain()   # also calls that ran on other caller streams
        backend.transport.host_barrier()
        num_entries, hidden = storage.shape
        words = [0] * _HEADER_WORDS
        words[_MAGIC], words[_CALL] = _MAGIC_VALUE, call & 0x7FFFFFFF
        words[_NUM_ENTRIES], words[_HIDDEN] = num_entries, hidden
        words[_FORMAT] = STORAGE_FORMATS[(storage.dtype, None if sf is None else sf.dtype)]
        words[_NUM_SF_PACKS], words[_SF_ROWS] = (0, 0) if sf is None else sf.shape
        words[_LOCATION] = _LOCATION_CODES[location]
        if location == "host":
            words[_SHARD:_SHARD + DESCRIPTION_WORDS] = self.host_shard.description()
        header = torch.tensor(words, dtype=torch.int32, device="cpu").pin_memory().to(device, non_blocking=True)
        if sf is not None:
            header[_SF_DIGEST:_SF_DIGEST + 2] = _sf_digest(sf)
        self._store(module, stream, header_offset, header)
        self._wait_stream(stream, "its header in engram_write")
        backend.transport.host_barrier()
        # 2. Every rank's header, gathered like a fetch of one entry per rank; read, then a barrier
        # before anything is written again.
        headers = torch.empty((self.num_ranks, _HEADER_WORDS), dtype=torch.int32, device=device)
        self._gather(module, stream, torch.arange(self.num_ranks, dtype=torch.int32, device=device), headers,
                     header_offset, HEADER_BYTES, 1, 1, None, None, 0, 0, None)
        values = backend.host_read(headers.view(-1), stream)
        backend.transport.host_barrier()
        rows = [values[peer * _HEADER_WORDS:(peer + 1) * _HEADER_WORDS] for peer in range(self.num_ranks)]
        self._check_headers(rows)
        if location == "host" and self.peer_shards is None:   # (each rank keeps its host shard with its table)
            self.peer_shards = reach_host_shards(device, self.rank, self.one_process,
                                                 [row[_SHARD:_SHARD + DESCRIPTION_WORDS] for row in rows])
            addresses = [self.host_shard.address if shard is None else shard.address for shard in self.peer_shards]
            # on the stream, from pinned memory (as the header): the wait for the shard covers it
            self.shard_addresses = torch.tensor(addresses, dtype=torch.int64, device="cpu").pin_memory().to(device, non_blocking=True)
        # 3. The shard, then every rank's before any rank fetches.
        if location == "host":
            copy_bytes(device, self.host_shard.address, storage, stream)
        else:
            self._store(module, stream, offset, storage)
        self.location = location
        self.num_entries, self.hidden, self.dtype = num_entries, hidden, storage.dtype
        self.sf = None if sf is None else sf.clone()
        self._wait_stream(stream, "its shard in engram_write")
        backend.transport.host_barrier()
        stop_serving = getattr(self.host_shard, "stop_serving", None)
        if stop_serving is not None:   # every peer holds its copy of the descriptor by now
            stop_serving()

    def _check_headers(self, rows: list) -> None:
        prefix = f"deep_ep (GPU backend, rank {self.rank} of {self.num_ranks}): engram_write"
        calls = [row[_CALL] for row in rows]
        if any(row[_MAGIC] != _MAGIC_VALUE for row in rows) or len(set(calls)) > 1:
            self.backend.broken = "ranks at different calls"
            raise RuntimeError(f"{prefix}: ranks are at different calls of this buffer (per-rank call numbers "
                               f"{calls}; a rank that is in another collective call shows a wrong one): a rank "
                               f"skipped or repeated a call. The buffer can no longer be used")
        for field, name in _AGREE:
            width = 2 if field == _SF_DIGEST else 1
            values = [tuple(row[field:field + width]) if width > 1 else row[field] for row in rows]
            if len(set(values)) > 1:
                shown = values if width == 1 else [f"{value[0] & 0xFFFFFFFF:08x}{value[1] & 0xFFFFFFFF:08x}"
                                                   for value in values]
                raise RuntimeError(f"{prefix}: ranks disagree on {name}: per-rank values {shown}")

    def _store(self, module, stream, offset: int, source: torch.Tensor) -> None:
        backend = self.backend
        num_bytes = source.numel() * source.element_size()
        blocks = max(1, min(4 * backend.num_device_sms, -(-num_bytes // (16 * ENGRAM_THREADS))))
        module.function(ENGRAM_STORE_KERNEL).launch(
            blocks, ENGRAM_THREADS, (backend.transport_args, jit.i64(offset), source, jit.i64(num_bytes)),
            stream=stream.cuda_stream, device=backend.device.index)

    def _gather(self, module, stream, indices, out, offset, row_bytes, num_entries, num_per_token, sf, out_sf,
                sf_token_stride, sf_column_stride, bad_index_host, shards=None) -> None:
        backend = self.backend
        count = indices.numel()
        args = EngramArgs(offset, row_bytes, sf_token_stride, sf_column_stride, indices.data_ptr(), out.data_ptr(),
                          None if sf is None else sf.data_ptr(), None if out_sf is None else out_sf.data_ptr(),
                          bad_index_host, None if shards is None else shards.data_ptr(), num_entries, count,
                          num_per_token, 0 if sf is None else sf.shape[1])
        blocks = max(1, min(_MAX_BLOCKS, -(-count // _ROWS_PER_BLOCK)))
        module.function(ENGRAM_GATHER_KERNEL).launch(blocks, ENGRAM_THREADS, (backend.transport_args, args),
                                                     stream=stream.cuda_stream, device=backend.device.index)

    # ------------------------------------------------------------------ fetch (local, one-sided)
    def fetch(self, indices: torch.Tensor, use_tma_aligned_col_major_sf: bool) -> tuple:
        """``(data [T, E * H], sf or None, event)`` of int32 ``indices [T, E]`` (validated but for the
        range, which the kernel checks): one gather kernel on the current stream; ``event`` is recorded
        after it. The outputs are allocated on the current stream; ``sf`` row-major or TMA-aligned
        column-major (strides ``(1, align(T, 4))``). No communication with the other ranks' hosts."""
        backend = self.backend
        device, stream = backend.device, torch.cuda.current_stream(backend.device)
        module = backend.module("engram", ())
        num_tokens, num_per_token = indices.shape
        data = outputs.empty((num_tokens, num_per_token * self.hidden), self.dtype, device)
        sf = None
        token_stride = column_stride = 0
        if self.sf is not None:
            columns = num_per_token * self.num_sf_packs
            if use_tma_aligned_col_major_sf:
                token_stride, column_stride = 1, shapes.align_up(num_tokens, 4)
                room = outputs.empty((columns * column_stride,), self.sf.dtype, device)
                sf = room.as_strided((num_tokens, columns), (token_stride, column_stride))
            else:
                token_stride, column_stride = columns, 1
                sf = outputs.empty((num_tokens, columns), self.sf.dtype, device)
        if indices.numel():
            self._gather(module, stream, indices, data, storage_offset(backend), self.hidden * data.element_size(),
                         self.num_entries, num_per_token, self.sf, sf, token_stride, column_stride,
                         self.bad_index.device_ptr, self.shard_addresses if self.location == "host" else None)
        done = torch.cuda.Event()
        done.record(stream)
        self.fetches = [event for event in self.fetches if not event.query()] + [done]
        return data, sf, done
