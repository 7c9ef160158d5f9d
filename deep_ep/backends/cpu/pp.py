"""Pipeline-parallel send/recv of the CPU backend: CPU tensors between ring neighbours over gloo
point-to-point messages.

Each ordered pair of neighbours is a *channel*, first in, first out. Per tensor the sender posts a
header (int64 ``[2]``: byte count, sequence number) and the payload bytes; the receiver answers
with an acknowledgement (int64 ``[1]``: the sequence number) once the tensor is in place. The
sender copies each tensor before `CPUPipeline.send` returns (the caller may reuse it at once) and
keeps the copy until its acknowledgement; a send finding ``num_max_inflight_tensors`` copies
unacknowledged on its channel first waits for the oldest one. `configure` (collective) gathers
every rank's per-peer counts, refuses on every rank while a tensor sent has not been received, and
otherwise drains the acknowledgements and starts fresh channels. A group of one rank loops back in
memory. Every wait is bounded by the buffer's ``num_cpu_timeout_secs``; gloo closes a connection
that timed out, so after a timeout every later PP call raises.
"""
from __future__ import annotations

import collections
import datetime
import itertools
from typing import Optional

import torch

from . import collectives
from .collectives import Collectives

__all__ = ["CPUPipeline", "configure"]

_TAG_BASE = 0x50500000            # gloo point-to-point tags of PP traffic (0 <= tag < 2**31)
_HEADER, _PAYLOAD, _ACK = range(3)
_TAGS_PER_CONFIGURATION = 4
# pp_set_config's fields in the common call header (`deep_ep.backends.cpu.collectives`); its tail
# holds the tensors this rank sent to, then received from, every rank.
_SLOT_BYTES, _INFLIGHT = 1, 2

#: PP configurations made so far per process group (by name): the n-th has the same number on every
#: rank (pp_set_config is collective), which keeps two buffers' channels on one group apart.
_configurations_per_group: dict = {}


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """uint8 ``[t.nbytes]`` sharing ``t``'s memory (``t`` contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


class _Sent:
    """A tensor sent on a channel and not yet acknowledged: the copy and the pending messages."""

    __slots__ = ("sequence", "staging", "header", "send_works", "ack", "ack_work")

    def __init__(self, sequence, staging, header, send_works, ack, ack_work) -> None:
        self.sequence = sequence
        self.staging = staging
        self.header = header
        self.send_works = send_works
        self.ack = ack
        self.ack_work = ack_work


class CPUPipeline:
    """The PP channels of one buffer on one rank, for one configuration (see the module docstring).

    Args:
        comm: the buffer's `Collectives` (group, rank, ranks, timeout).
        num_slot_bytes: the largest tensor in bytes (``num_max_tensor_bytes`` rounded up to 32).
        num_max_inflight_tensors: unacknowledged tensors allowed per channel.
        configuration: this configuration's number on the group (same on every rank).
    """

    def __init__(self, comm: Collectives, num_slot_bytes: int, num_max_inflight_tensors: int,
                 configuration: int) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.num_ranks = comm.num_ranks
        self.num_slot_bytes = num_slot_bytes
        self.num_max_inflight_tensors = num_max_inflight_tensors
        self.prev_rank = (self.rank - 1) % self.num_ranks
        self.next_rank = (self.rank + 1) % self.num_ranks
        self._tag = _TAG_BASE + (configuration % (1 << 16)) * _TAGS_PER_CONFIGURATION
        self._timeout = datetime.timedelta(seconds=comm.timeout_secs)
        self.sent = [0] * self.num_ranks       # tensors sent to each rank
        self.received = [0] * self.num_ranks   # tensors received from each rank
        self._pending = {peer: collections.deque() for peer in {self.prev_rank, self.next_rank}}
        self._loopback: collections.deque = collections.deque()   # a group of one rank
        self.broken: Optional[str] = None

    # ------------------------------------------------------------------ errors
    def _check_usable(self) -> None:
        if self.broken is not None:
            raise self.comm.error(f"pipeline send/recv can no longer be used on this buffer after an earlier "
                                  f"failure ({self.broken}); destroy the buffer and the process group")

    def _wait(self, work, what: str, peer: int) -> None:
        try:
            work.wait(self._timeout)
        except Exception as exc:
            timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
            self.broken = f"{what} with rank {peer} failed"
            if timed_out:
                raise TimeoutError(
                    f"deep_ep CPU timeout on rank {self.rank}: {what} with rank {peer} did not complete within "
                    f"{self.comm.timeout_secs} s; the peer did not make the matching pp_send / pp_recv. Every "
                    f"pp_send needs a pp_recv on the destination, in the same order. This buffer's pipeline "
                    f"send/recv cannot be used any more (destroy the buffer and the process group)") from exc
            raise self.comm.error(f"{what} with rank {peer} failed: {exc}. A peer may have crashed; destroy the "
                                  f"buffer and the process group") from exc

    # ------------------------------------------------------------------ send / recv
    def num_inflight(self, peer: int) -> int:
        """Tensors this rank sent to ``peer`` whose acknowledgement it has not consumed yet."""
        if self.num_ranks == 1:
            return len(self._loopback)
        return len(self._pending[peer])

    def _retire_oldest(self, peer: int) -> None:
        sent = self._pending[peer][0]
        self._wait(sent.ack_work, "waiting for the receiver to take the oldest tensor in flight", peer)
        for work in sent.send_works:
            self._wait(work, "pp_send", peer)
        if int(sent.ack.item()) != sent.sequence:
            self.broken = "acknowledgements out of order"
            raise self.comm.error(f"rank {peer} acknowledged tensor #{int(sent.ack.item())} where #{sent.sequence} "
                                  f"was expected; destroy the buffer and the process group")
        self._pending[peer].popleft()

    def send(self, t: torch.Tensor, peer: int) -> None:
        """Send the bytes of contiguous CPU tensor ``t`` to neighbour ``peer`` (checked by the caller)."""
        self._check_usable()
        if self.num_ranks == 1:
            if len(self._loopback) >= self.num_max_inflight_tensors:
                raise RuntimeError(
                    f"deep_ep: pp_send on a group of one rank with {len(self._loopback)} tensors in flight "
                    f"(num_max_inflight_tensors={self.num_max_inflight_tensors}) would wait for itself forever; "
                    f"pp_recv the oldest first")
            self._loopback.append(byte_view(t).clone())
            self.sent[peer] += 1
            return
        pending = self._pending[peer]
        while len(pending) >= self.num_max_inflight_tensors:
            self._retire_oldest(peer)
        group = self.comm.group
        sequence = self.sent[peer]
        staging = byte_view(t).clone()
        header = torch.tensor([staging.numel(), sequence], dtype=torch.int64, device="cpu")
        ack = torch.full((1,), -1, dtype=torch.int64, device="cpu")
        # The acknowledgement's receive is posted first, so that the receiver's answer never waits.
        ack_work = group.recv([ack], peer, self._tag + _ACK)
        send_works = [group.send([header], peer, self._tag + _HEADER)]
        if staging.numel():
            send_works.append(group.send([staging], peer, self._tag + _PAYLOAD))
        pending.append(_Sent(sequence, staging, header, send_works, ack, ack_work))
        self.sent[peer] += 1

    def recv(self, t: torch.Tensor, peer: int) -> None:
        """Receive the oldest tensor ``peer`` sent to this rank into contiguous CPU tensor ``t``.

        Raises:
            ValueError: the tensor sent has a different byte count than ``t`` (it is consumed and
                acknowledged all the same, so the channel stays in order; ``t`` is left unchanged).
        """
        self._check_usable()
        if self.num_ranks == 1:
            if not self._loopback:
                raise RuntimeError("deep_ep: pp_recv on a group of one rank with nothing in flight would wait for "
                                   "itself forever; pp_send first")
            payload = self._loopback.popleft()
            self.received[peer] += 1
            self._fill(t, payload, peer)
            return
        group = self.comm.group
        header = torch.empty(2, dtype=torch.int64, device="cpu")
        self._wait(group.recv([header], peer, self._tag + _HEADER), "pp_recv", peer)
        num_bytes, sequence = (int(value) for value in header.tolist())
        if sequence != self.received[peer]:
            self.broken = "tensors out of order"
            raise self.comm.error(f"rank {peer} sent tensor #{sequence} where #{self.received[peer]} was expected; "
                                  f"destroy the buffer and the process group")
        target = byte_view(t) if num_bytes == t.nbytes else torch.empty(num_bytes, dtype=torch.uint8, device="cpu")
        if num_bytes:
            self._wait(group.recv([target], peer, self._tag + _PAYLOAD), "pp_recv", peer)
        self.received[peer] += 1
        ack = torch.tensor([sequence], dtype=torch.int64, device="cpu")
        # The sender posted this receive with its send, so the wait ends as soon as the bytes leave.
        self._wait(group.send([ack], peer, self._tag + _ACK), "acknowledging a pp_recv", peer)
        if num_bytes != t.nbytes:
            self._fill(t, target, peer)

    @staticmethod
    def _fill(t: torch.Tensor, payload: torch.Tensor, peer: int) -> None:
        if payload.numel() != t.nbytes:
            raise ValueError(f"pp_recv: rank {peer} sent a tensor of {payload.numel()} bytes, but t holds {t.nbytes} "
                             f"bytes (shape {tuple(t.shape)}, {t.dtype}); the receiving tensor must have the sent "
                             f"tensor's byte size (that tensor was consumed; t is unchanged)")
        byte_view(t).copy_(payload)

    # ------------------------------------------------------------------ flush
    def drain(self) -> None:
        """Wait for every acknowledgement (every tensor sent was received: checked by `configure`)."""
        for peer, pending in self._pending.items():
            while pending:
                self._retire_oldest(peer)
        self._loopback.clear()


def configure(comm: Collectives, call: int, old: Optional[CPUPipeline], num_slot_bytes: int,
              num_max_inflight_tensors: int) -> CPUPipeline:
    """Collective: flush ``old`` (None: never configured) and return fresh channels.

    Raises, on every rank, `RuntimeError` when ranks disagree on the configuration or a tensor sent
    was not received (``old`` is then kept, unchanged: receive the rest and call again).
    """
    if old is not None:
        old._check_usable()
    num_ranks = comm.num_ranks
    comm.begin(collectives.OP_PP_SET_CONFIG, call)
    fields = collectives.new_fields()
    fields[_SLOT_BYTES], fields[_INFLIGHT] = num_slot_bytes, num_max_inflight_tensors
    counts = torch.zeros(2 * num_ranks, dtype=torch.int64, device="cpu")
    if old is not None:
        counts[:num_ranks] = torch.tensor(old.sent, dtype=torch.int64, device="cpu")
        counts[num_ranks:] = torch.tensor(old.received, dtype=torch.int64, device="cpu")
    headers = comm.exchange_header(fields, counts)
    for column, name in ((_SLOT_BYTES, "num_max_tensor_bytes (rounded up to 32)"),
                         (_INFLIGHT, "num_max_inflight_tensors")):
        values = headers[:, column]
        if (values != values[0]).any():
            raise comm.error(f"pp_set_config: ranks disagree on {name}: per-rank values {values.tolist()}; "
                             f"every rank must pass the same values")
    sent = headers[:, collectives.HEADER_FIELDS:collectives.HEADER_FIELDS + num_ranks]
    received = headers[:, collectives.HEADER_FIELDS + num_ranks:]
    missing = [(src, dst, int(sent[src, dst] - received[dst, src]))
               for src in range(num_ranks) for dst in range(num_ranks) if sent[src, dst] != received[dst, src]]
    if missing:
        where = ", ".join(f"{count} from rank {src} to rank {dst}" for src, dst, count in missing)
        raise comm.error(f"pp_set_config: tensors sent and not received ({where}). Make the matching pp_recv "
                         f"calls, then call pp_set_config again on every rank")
    if old is not None:
        old.drain()
    name = str(getattr(comm.group, "group_name", "") or id(comm.group))
    counter = _configurations_per_group.setdefault(name, itertools.count())
    return CPUPipeline(comm, num_slot_bytes, num_max_inflight_tensors, next(counter))
