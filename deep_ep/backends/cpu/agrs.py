"""The CPU backend's moves for all-gather / reduce-scatter sessions (`deep_ep.primitives.agrs` keeps
the session's bookkeeping and checks; this module moves bytes over gloo).

The session space is a uint8 host tensor. An all-gather of ``k`` tensors is one asynchronous gloo
all-gather per tensor, each straight into its ``[R, nbytes]`` room of the space (an in-place tensor
already sits at its rank's row). A reduce-scatter is one asynchronous gloo all-to-all per tensor
into a ``[R, chunk]`` room (chunk ``r`` of every rank lands on rank ``r``), summed in float32 in rank
order when its handle is waited. Before any data moves, each call exchanges the buffer's common
header (`deep_ep.backends.cpu.collectives`), so ranks making different calls raise the same
`RuntimeError` instead of hanging; each wait is bounded by the buffer's ``num_cpu_timeout_secs``.
"""
from __future__ import annotations

import datetime
import hashlib

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from .collectives import (OP_AGRS_SET_CONFIG, OP_ALL_GATHER, OP_DESTROY_AGRS_SESSION, OP_REDUCE_SCATTER,
                          new_fields, operation_name)

__all__ = ["CPUAgrsMoves"]

# Fields of an AGRS call's header (int64, slots of the common header of
# `deep_ep.backends.cpu.collectives`), each equal on every rank.
SESSION, NUM_OPS, OFFSET, VALUE, DIGEST = range(1, 6)
_FIELD_NAMES = {SESSION: "session number", NUM_OPS: "calls earlier in the session",
                OFFSET: "session bytes used", VALUE: "size in bytes", DIGEST: "tensor shapes and dtypes"}


def _digest(tensors: list, extra: str = "") -> int:
    """A signed 64-bit digest of the tensors' dtypes and shapes (what every rank must agree on)."""
    text = ";".join(f"{tensor.dtype}{list(tensor.shape)}" for tensor in tensors) + extra
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _describe(tensors: list) -> str:
    return ", ".join(f"{str(tensor.dtype).replace('torch.', '')} {list(tensor.shape)}" for tensor in tensors)


class CPUAgrsMoves:
    """AGRS data moves of one CPU buffer on one rank (see the module docstring)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.comm = backend.comm

    # ------------------------------------------------------------------ agreement
    def _agree(self, op: int, call: int, session: int, num_ops: int, offset: int, value: int, digest: int,
               detail: str = "", names: dict = _FIELD_NAMES) -> None:
        """Exchange this call's header; raise the same `RuntimeError` on every rank when they differ."""
        comm = self.comm
        comm.begin(op, call)
        fields = new_fields()
        fields[SESSION], fields[NUM_OPS], fields[OFFSET], fields[VALUE], fields[DIGEST] = \
            session, num_ops, offset, value, digest
        headers = comm.exchange_header(fields)
        for field, name in names.items():
            column = headers[:, field]
            if (column != column[0]).any():
                values = "differ" if field == DIGEST else f"per-rank values {column.tolist()}"
                raise comm.error(f"ranks disagree on the {name} of {operation_name(op)} ({values}; this rank: "
                                 f"{detail or fields[field]}). Every rank raises this; nothing was sent")

    def _wait(self, phase: str, works: list) -> None:
        for work in works:
            self.comm._wait(phase, work)

    def _work(self, phase: str, start):
        """``start()`` (a gloo call returning its work), failures reported like every CPU collective."""
        try:
            return start()
        except Exception as exc:
            raise self.comm._failed(phase, exc) from exc

    # ------------------------------------------------------------------ calls
    def configure(self, num_bytes: int, num_max_ops: int, call: int, space_bytes: int) -> torch.Tensor:
        """Agree on the configuration (a flush: every rank reaches this point); the new space of
        ``space_bytes`` (``num_bytes`` on CPU)."""
        self._agree(OP_AGRS_SET_CONFIG, call, 0, num_max_ops, 0, num_bytes, 0,
                    names={NUM_OPS: "num_max_all_gathers_per_session", VALUE: "num_max_session_bytes"})
        return torch.empty(space_bytes, dtype=torch.uint8, device="cpu")

    def end_session(self, session: int, num_ops: int, offset: int, call: int) -> None:
        """Agree that every rank's session held the same calls."""
        self._agree(OP_DESTROY_AGRS_SESSION, call, session, num_ops, offset, 0, 0)

    def all_gather(self, session, tensors: list, offsets: list, in_place: list, call: int):
        """Start the all-gathers of ``tensors`` into their rooms at ``offsets``; the wait function."""
        num_ranks = self.comm.num_ranks
        sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
        self._agree(OP_ALL_GATHER, call, session.index, session.num_ops, session.offset, sum(sizes),
                    _digest(tensors), _describe(tensors))
        options = AllgatherOptions()
        options.timeout = datetime.timedelta(seconds=self.comm.timeout_secs)
        phase = f"all_gather #{session.num_ops + 1} of AGRS session #{session.index}"
        works = []
        for tensor, offset, nbytes, local in zip(tensors, offsets, sizes, in_place):
            room = session.space[offset:offset + nbytes * num_ranks]
            if local:
                send = room[nbytes * self.comm.rank:nbytes * (self.comm.rank + 1)]
            else:
                send = tensor.reshape(-1).view(torch.uint8) if nbytes else room[:0]
            works.append(self._work(phase, lambda room=room, send=send: self.comm.group._allgather_base(
                room, send, options)))
        return lambda: self._wait(phase, works)

    def reduce_scatter(self, session, tensors: list, offsets: list, average: bool, call: int):
        """Start the all-to-alls of ``tensors`` into their rooms at ``offsets``; ``(outputs, wait)``,
        the outputs filled by the wait."""
        num_ranks = self.comm.num_ranks
        sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
        self._agree(OP_REDUCE_SCATTER, call, session.index, session.num_ops, session.offset, sum(sizes),
                    _digest(tensors, f"average={average}"), _describe(tensors))
        options = dist.AllToAllOptions()
        options.timeout = datetime.timedelta(seconds=self.comm.timeout_secs)
        phase = f"reduce_scatter #{session.num_ops + 1} of AGRS session #{session.index}"
        works, rooms, outputs = [], [], []
        splits = [1] * num_ranks
        for tensor, offset, nbytes in zip(tensors, offsets, sizes):
            chunk = nbytes // num_ranks
            flat = session.space[offset:offset + nbytes]
            if nbytes:
                room = flat.view(num_ranks, chunk)
                send = tensor.reshape(-1).view(torch.uint8).view(num_ranks, chunk)
                works.append(self._work(phase, lambda room=room, send=send: self.comm.group.alltoall_base(
                    room, send, splits, splits, options)))
            rooms.append(flat)
            outputs.append(torch.empty((tensor.shape[0] // num_ranks, *tensor.shape[1:]), dtype=tensor.dtype,
                                       device="cpu"))

        def wait() -> None:
            self._wait(phase, works)
            for room, output in zip(rooms, outputs):
                received = room.view(output.dtype).view(num_ranks, *output.shape)
                total = received[0].to(torch.float32, copy=True)
                for rank in range(1, num_ranks):   # rank order: the same bits on every run
                    total.add_(received[rank])
                if average:
                    total.div_(num_ranks)
                output.copy_(total)
        return outputs, wait
