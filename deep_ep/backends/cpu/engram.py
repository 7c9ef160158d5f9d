"""Engram storage of the CPU backend: each rank's shard in a POSIX shared-memory segment, fetched
one-sided.

`EngramTable.write` is collective (every rank of the group calls it): the ranks exchange a header
(the call, the shard's format, the host), each rank creates a fresh segment under ``/dev/shm`` with
its shard, every rank maps every peer's segment, and each owner then unlinks its file (the mappings
stay; nothing is left behind in ``/dev/shm``, even if a process dies later). Each phase is a bounded
gloo exchange (`deep_ep.backends.cpu.collectives`), and any rank's failure in a phase is raised by
every rank at the end of that phase. `EngramTable.fetch` is local: it reads the owners' rows
straight from their mappings, with no communication, so ranks fetch independently, as DeepEP's
RDMA gets do. The ranks must share one ``/dev/shm``: a group spanning several hosts raises
`NotImplementedError` in `write`.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import socket
from typing import Optional

import torch

from .. import outputs
from ..engram_table import AGREED_FIELDS, STORAGE_FORMATS, EngramTableState
from ... import shapes
from .collectives import OP_ENGRAM_WRITE, Collectives, new_fields

__all__ = ["EngramTable", "SHM_DIR", "host_identity"]

SHM_DIR = "/dev/shm"

# engram_write's fields in the common call header (`deep_ep.backends.cpu.collectives`).
HOST, NUM_ENTRIES, HIDDEN, FORMAT, NUM_SF_PACKS, SF_ROWS, SF_DIGEST, PID, TOKEN = range(1, 10)
_AGREE = dict(zip((NUM_ENTRIES, HIDDEN, FORMAT, NUM_SF_PACKS, SF_ROWS, SF_DIGEST), AGREED_FIELDS))


def host_identity() -> str:
    """This process's host as far as shared memory goes: the running kernel's boot id (the same in
    every container of a host, whatever its host name), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return "boot " + boot.read().strip()
    except OSError:
        return "host " + socket.gethostname()


def _hash64(data) -> int:
    """A signed 64-bit digest of a string or a bytes-like object."""
    raw = data.encode() if isinstance(data, str) else data
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


def _segment_path(pid: int, token: int, rank: int) -> str:
    return os.path.join(SHM_DIR, f"deep_ep-engram-{pid}-{token & (2 ** 64 - 1):016x}-rank{rank}")


def _map(path: str, num_bytes: int) -> torch.Tensor:
    """uint8 ``[num_bytes]`` mapping (shared) of an existing file of exactly that size."""
    size = os.stat(path).st_size    # FileNotFoundError when the file is not visible here
    if size != num_bytes:
        raise RuntimeError(f"{path} holds {size} bytes, expected {num_bytes}")
    # from_file would create a missing file: the stat above makes sure it exists.
    return torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8, device="cpu")


class EngramTable(EngramTableState):
    """One buffer's Engram storage on one rank: every rank's shard (mapped), and the replicated
    scale factors of FP8 storage."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        super().__init__(rank, num_ranks)
        self._shards: list = []       # per rank: integer rows [num_entries, *] of its mapped segment

    def release(self) -> None:
        """Unmap the shards (the mappings go with their last tensor) and forget the table."""
        self._shards = []
        self._forget_table()

    # ------------------------------------------------------------------ write (collective)
    def write(self, comm: Collectives, call: int, storage: torch.Tensor, sf: Optional[torch.Tensor]) -> None:
        """Replace this rank's shard with ``storage`` (validated: bf16 / FP8 ``[N, H]``, contiguous;
        ``sf`` the replicated table, or None for bf16) and map every rank's. Collective.

        Raises (on every rank): RuntimeError when ranks disagree on the format or are at different
        calls, or a rank could not create its segment; NotImplementedError when the ranks do not
        share one host's shared memory; TimeoutError when a peer does not arrive."""
        comm.begin(OP_ENGRAM_WRITE, call)
        num_entries, hidden = storage.shape
        fields = new_fields()
        fields[HOST] = _hash64(host_identity())
        fields[NUM_ENTRIES], fields[HIDDEN] = num_entries, hidden
        fields[FORMAT] = STORAGE_FORMATS[(storage.dtype, None if sf is None else sf.dtype)]
        fields[NUM_SF_PACKS], fields[SF_ROWS] = (0, 0) if sf is None else sf.shape
        fields[SF_DIGEST] = 0 if sf is None else _hash64(sf.view(-1).view(torch.uint8).numpy())
        fields[PID], fields[TOKEN] = os.getpid(), secrets.randbits(63)
        headers = comm.exchange_header(fields)
        self._check_headers(comm, headers)

        path = _segment_path(fields[PID], fields[TOKEN], self.rank)
        num_bytes = storage.numel() * storage.element_size()
        created = False
        try:
            try:
                descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                created = True
                try:
                    os.ftruncate(descriptor, num_bytes)
                finally:
                    os.close(descriptor)
                own = _map(path, num_bytes)
                own.copy_(storage.view(-1).view(torch.uint8))
                problem = ""
            except (OSError, RuntimeError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            self._agree_or_raise(comm, "engram_write segments", problem, RuntimeError,
                                 f"could not create a shared-memory segment under {SHM_DIR}")

            row_bytes = hidden * storage.element_size()
            shards, problem = [], ""
            for peer in range(self.num_ranks):
                peer_path = _segment_path(int(headers[peer, PID]), int(headers[peer, TOKEN]), peer)
                try:
                    segment = own if peer == self.rank else _map(peer_path, num_bytes)
                except (OSError, RuntimeError) as exc:
                    problem = f"rank {peer}'s segment {peer_path}: {type(exc).__name__}: {exc}"
                    break
                shards.append(shapes.as_rows(segment.view(num_entries, row_bytes)))
            self._agree_or_raise(comm, "engram_write mappings", problem, NotImplementedError,
                                 f"could not map a peer's segment (the ranks must share one host's {SHM_DIR}; "
                                 f"Engram across hosts is not implemented on the CPU backend)")
        finally:
            if created:
                os.unlink(path)
        self.num_entries, self.hidden, self.dtype = num_entries, hidden, storage.dtype
        self.sf = None if sf is None else sf.clone()
        self._shards = shards

    def _check_headers(self, comm: Collectives, headers: torch.Tensor) -> None:
        """Raise (the same on every rank) unless all ranks (in this call of engram_write: checked by
        the header exchange) have the same format, on one host."""
        for field, name in _AGREE.items():
            values = headers[:, field].tolist()
            if len(set(values)) > 1:
                shown = [f"{value & 0xFFFFFFFFFFFFFFFF:016x}" for value in values] if field == SF_DIGEST else values
                raise comm.error(f"engram_write: ranks disagree on {name}: per-rank values {shown}")
        hosts = headers[:, HOST].tolist()
        if len(set(hosts)) > 1:
            groups: dict = {}
            for peer, host in enumerate(hosts):
                groups.setdefault(host, []).append(peer)
            raise NotImplementedError(
                f"deep_ep (CPU backend, rank {self.rank} of {self.num_ranks}): engram_write needs every rank "
                f"of the gloo group on one host (fetch reads the owners' shared memory, one-sided); the ranks "
                f"are on {len(groups)} hosts: {sorted(groups.values())}. Engram across hosts is not "
                f"implemented on the CPU backend")

    def _agree_or_raise(self, comm: Collectives, phase: str, problem: str, kind: type, what: str) -> None:
        """All-gather whether each rank met ``problem`` (empty: none) and raise ``kind`` on every rank
        if one did, naming the ranks (and this rank's own problem)."""
        failed = comm.all_gather(torch.tensor([1 if problem else 0], dtype=torch.int64, device="cpu"), phase)
        bad = [peer for peer, flag in enumerate(failed.view(-1).tolist()) if flag]
        if bad:
            mine = f"; here: {problem}" if problem else ""
            message = f"engram_write failed on rank(s) {bad}: {what}{mine}"
            if kind is RuntimeError:
                raise comm.error(message)
            raise kind(f"deep_ep (CPU backend, rank {self.rank} of {self.num_ranks}): {message}")

    # ------------------------------------------------------------------ fetch (local, one-sided)
    def fetch(self, indices: torch.Tensor, use_tma_aligned_col_major_sf: bool) -> tuple:
        """``(data [T, E * H], sf or None)`` of validated int32 ``indices [T, E]`` (every value in
        ``[0, num_ranks * num_entries)``): row ``t`` of ``data`` concatenates the entries
        ``indices[t]``; ``sf`` is ``[T, E * num_sf_packs]``, row-major or TMA-aligned column-major
        (strides ``(1, align(T, 4))``). No communication."""
        num_tokens, num_per_token = indices.shape
        count = num_tokens * num_per_token
        data = outputs.empty((num_tokens, num_per_token * self.hidden), self.dtype, "cpu")
        row_bytes = self.hidden * data.element_size()
        rows = shapes.as_rows(data.view(torch.uint8).view(count, row_bytes))
        flat = indices.view(-1)
        owners = torch.div(flat, self.num_entries, rounding_mode="floor")
        local = flat - owners * self.num_entries
        for owner in range(self.num_ranks):
            picks = (owners == owner).nonzero().view(-1)
            if picks.numel():
                rows.index_copy_(0, picks, self._shards[owner].index_select(0, local.index_select(0, picks)))
        if self.sf is None:
            return data, None
        columns = num_per_token * self.num_sf_packs
        if use_tma_aligned_col_major_sf:
            token_stride = shapes.align_up(num_tokens, 4)
            room = outputs.empty((columns * token_stride,), self.sf.dtype, "cpu")
            sf = room.as_strided((num_tokens, columns), (1, token_stride))
        else:
            sf = outputs.empty((num_tokens, columns), self.sf.dtype, "cpu")
        sf.copy_(self.sf.index_select(0, flat).view(num_tokens, columns))
        return data, sf
