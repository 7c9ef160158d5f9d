"""Bounded gloo collectives of the CPU backend, and the header every call exchanges first.

Every collective (each *phase* of a call) is issued with the buffer's ``num_cpu_timeout_secs`` as its
own timeout (gloo honours a per-operation timeout), independent of the process group's. On entry to
each call a rank also writes "I am in call #n of this buffer" into the group's store (one small
``set``, no wait). When a phase fails (timeout, or a peer that crashed), the rank reads those stamps
to find which peer never reached the call and raises
``TimeoutError("deep_ep CPU timeout on rank r: peer rank p did not arrive within T s in phase ...")``
(or a `RuntimeError` naming the phase, when every peer arrived and the connection failed). Gloo
closes its connections after a timeout, so the buffer is then unusable: every later call raises a
`RuntimeError` saying so; destroy the buffer and the process group (both return promptly).
The stamps assume SPMD buffer creation: ranks create the buffers of one group in the same order.

The header (int64 ``[F + 2R]``): the call's configuration, this rank's token count, and two rows of
``R`` counts (what this rank sends to every rank, and what it expects from every rank). Every rank
checks that all ranks agree on the configuration; any violation raises the same `RuntimeError` on
every rank, before data moves.
"""
from __future__ import annotations

import datetime
import itertools
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["Collectives", "HEADER_FIELDS"]

# Header fields (int64). The ones in _AGREE must be equal on every rank.
OP, E, H, K, XKIND, NSF, EXPAND, ALIGN, M, SYNC, HASW, T, REDUCE, SEQ = range(14)
HEADER_FIELDS = 14
_AGREE = {OP: "operation", E: "num_experts", H: "hidden", K: "num_topk",
          XKIND: "x format (0 bf16, 1 FP8 + float32 sf, 2 FP8 + packed UE8M0 sf)",
          NSF: "number of scale factors", EXPAND: "do_expand", ALIGN: "expert_alignment",
          SYNC: "do_cpu_sync", HASW: "weights given",
          REDUCE: "combine reduction (allow_multiple_reduction, apply_dispatch_weights)"}
OP_DISPATCH, OP_COMBINE = 1, 2

#: Buffers created so far per process group (by group name): the n-th buffer of a group has the same
#: number on every rank, which names its arrival stamps in the group's store.
_buffers_per_group: dict = {}


class Collectives:
    """The bounded collectives of one buffer on one rank (see the module docstring)."""

    def __init__(self, group, rank: int, num_ranks: int, timeout_secs: float) -> None:
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.timeout_secs = timeout_secs
        self._timeout = datetime.timedelta(seconds=timeout_secs)
        self.calls = 0               # calls (dispatch / combine / barrier) entered on this rank
        self._op = ""                # the current (or last) call
        self._broken: Optional[str] = None   # the failure that made the group unusable
        name = str(getattr(group, "group_name", "") or id(group))
        counter = _buffers_per_group.setdefault(name, itertools.count())
        self._stamp_prefix = f"deep_ep/cpu/group{name}/buffer{next(counter)}/rank"
        self._use_store = True       # False once the store failed (it only serves diagnostics)

    # ------------------------------------------------------------------ errors
    def error(self, msg: str) -> RuntimeError:
        """A `RuntimeError` naming this rank (raised by every rank for conditions they all see)."""
        return RuntimeError(f"deep_ep (CPU backend, rank {self.rank} of {self.num_ranks}): {msg}")

    def begin(self, op: str, call: int) -> None:
        """Start ``op``, this rank's call number ``call`` of the buffer (counted by the buffer, refused
        calls included): refuse if an earlier failure broke the group, stamp the arrival."""
        if self._broken is not None:
            raise self.error(f"this buffer can no longer communicate after an earlier failure "
                             f"({self._broken}); destroy it and the process group, and start again")
        self.calls = call
        self._op = op
        store = self._store()
        if store is not None:
            try:
                store.set(self._stamp_prefix + str(self.rank), f"{self.calls} {op}")
            except Exception:  # the store is only used to name a missing peer
                self._use_store = False

    def _store(self):
        """The group's key-value store, looked up on each use and never kept: a reference held past
        the process group's destruction keeps the store client (and its threads) alive until
        interpreter teardown, where it can abort the process."""
        if not self._use_store or self.group is None:
            return None
        try:
            return self.group.get_group_store()
        except Exception:  # an older torch, a group without a store, or a destroyed group
            self._use_store = False
            return None

    def _peer_stamps(self) -> dict:
        """``{peer: (calls entered, last op)}`` from the store; peers without a stamp map to (0, '')."""
        out = {}
        store = self._store()
        for p in range(self.num_ranks):
            if p == self.rank or store is None:
                continue
            key = self._stamp_prefix + str(p)
            try:
                value = store.get(key).decode() if store.check([key]) else "0 "
                n, op = value.split(" ", 1)
                out[p] = (int(n), op)
            except Exception:
                return {}
        return out

    def _failed(self, phase: str, exc: Exception) -> Exception:
        """The error to raise when collective ``phase`` of the current call failed with ``exc``."""
        secs = self.timeout_secs
        where = f"{self._op} (call #{self.calls} of this buffer on this rank), phase {phase}"
        stamps = self._peer_stamps()
        missing = sorted(p for p, (n, _) in stamps.items() if n < self.calls)
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        if missing:
            seen = ", ".join(f"rank {p} last entered call #{stamps[p][0]}" +
                             (f" ({stamps[p][1]})" if stamps[p][1] else "") for p in missing)
            msg = (f"deep_ep CPU timeout on rank {self.rank}: peer rank{'s' if len(missing) > 1 else ''} "
                   f"{', '.join(map(str, missing))} did not arrive within {secs} s in {where} ({seen}). "
                   f"A rank skipped or failed a call: check its log; this buffer and its process group "
                   f"cannot be used any more (destroy them)")
            err: Exception = TimeoutError(msg)
        elif timed_out:
            who = ("every peer had entered the call, so one stopped or failed inside it" if stamps else
                   "a peer did not arrive or stopped inside the call (no store to tell which)")
            msg = (f"deep_ep CPU timeout on rank {self.rank}: {where} did not complete within {secs} s; "
                   f"{who}. This buffer and its process group cannot be used any more (destroy them). "
                   f"gloo: {exc}")
            err = TimeoutError(msg)
        else:
            msg = (f"communication failed in {where}: {exc}. A peer may have crashed: check the other "
                   f"ranks' logs; this buffer and its process group cannot be used any more (destroy them)")
            err = self.error(msg)
        self._broken = f"{type(err).__name__} in {where}"
        return err

    # ------------------------------------------------------------------ collectives
    def _wait(self, phase: str, work) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise self._failed(phase, exc) from exc

    def all_to_all(self, phase: str, out: torch.Tensor, inp: torch.Tensor, out_splits: list,
                   in_splits: list) -> None:
        """``all_to_all_single`` bounded by ``num_cpu_timeout_secs`` (``out_splits``: rows received
        from each rank, ``in_splits``: rows sent to each rank)."""
        opts = dist.AllToAllOptions()
        opts.timeout = self._timeout
        try:
            work = self.group.alltoall_base(out, inp, out_splits, in_splits, opts)
        except Exception as exc:
            raise self._failed(phase, exc) from exc
        self._wait(phase, work)

    def all_gather(self, t: torch.Tensor, phase: str) -> torch.Tensor:
        """``[R, *t.shape]``: every rank's ``t`` (an all-to-all of ``R`` copies, so that it takes the
        public per-operation timeout option)."""
        R = self.num_ranks
        flat = t.reshape(1, -1)
        out = torch.empty((R, flat.shape[1]), dtype=t.dtype, device="cpu")
        self.all_to_all(phase, out, flat.expand(R, -1).contiguous(), [1] * R, [1] * R)
        return out.view(R, *t.shape)

    def barrier(self, call: int) -> None:
        """A gloo barrier bounded by ``num_cpu_timeout_secs`` (call number ``call``)."""
        self.begin("barrier", call)
        opts = dist.BarrierOptions()
        opts.timeout = self._timeout
        try:
            work = self.group.barrier(opts)
        except Exception as exc:
            raise self._failed("barrier", exc) from exc
        self._wait("barrier", work)

    def exchange_header(self, fields: list, send_counts: torch.Tensor,
                        expect_counts: Optional[torch.Tensor]) -> torch.Tensor:
        """All ranks' headers ``[R, F + 2R]`` (same on every rank); raises on every rank when they
        disagree on a configuration field."""
        R = self.num_ranks
        header = torch.zeros(HEADER_FIELDS + 2 * R, dtype=torch.int64, device="cpu")
        fields = list(fields)
        fields[SEQ] = self.calls
        header[:HEADER_FIELDS] = torch.tensor(fields, dtype=torch.int64, device="cpu")
        header[HEADER_FIELDS:HEADER_FIELDS + R] = send_counts
        if expect_counts is not None:
            header[HEADER_FIELDS + R:] = expect_counts
        headers = self.all_gather(header, "header exchange")
        seqs = headers[:, SEQ]
        if (seqs != seqs[0]).any():
            ops = ["dispatch" if v == OP_DISPATCH else "combine" for v in headers[:, OP].tolist()]
            where = ", ".join(f"rank {p} at call #{n} ({op})" for p, (n, op) in enumerate(zip(seqs.tolist(), ops)))
            self._broken = "ranks at different calls"
            raise self.error(f"ranks are at different calls of this buffer ({where}): a rank skipped or repeated "
                             f"a call (a call refused for bad arguments counts on the rank that refused it). Every "
                             f"rank raises this; the buffer is no longer usable (destroy it on every rank)")
        for i, name in _AGREE.items():
            col = headers[:, i]
            if (col != col[0]).any():
                if i == OP:
                    ops = ["dispatch" if v == OP_DISPATCH else "combine" for v in col.tolist()]
                    raise self.error(f"ranks called different operations: {ops}")
                raise self.error(f"ranks disagree on {name}: per-rank values {col.tolist()}")
        return headers


def new_fields() -> list:
    """A zeroed header field list."""
    return [0] * HEADER_FIELDS
