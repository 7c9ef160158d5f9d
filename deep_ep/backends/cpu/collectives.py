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

Every collective call of a buffer (dispatch, combine, barrier and the primitives' collective calls,
`OPERATIONS`) first exchanges one header of the same size, int64 ``[F + 2R]``: the operation's code
at ``OP``, this rank's call number at ``SEQ``, the operation's own fields in the other ``F - 2``
slots, and two rows of ``R`` values (dispatch / combine: what this rank sends to every rank and
expects from every rank). Ranks at different calls, or in different operations, or that disagree on
a configuration all raise the same `RuntimeError` on every rank, naming each rank's operation and
call number, before data moves; the exchange never mismatches in size, whatever the calls.
"""
from __future__ import annotations

import datetime
import itertools
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["Collectives", "HEADER_FIELDS", "OPERATIONS", "operation_name"]

# Header fields (int64): OP and SEQ in every call's header; the others are dispatch's and combine's
# (other operations put their own fields in slots 1..12); HYBRID and SCALEUP, the buffer's domains,
# `exchange_header` fills for dispatch and combine. The ones in _AGREE must be equal on every rank.
OP, E, H, K, XKIND, NSF, EXPAND, ALIGN, M, SYNC, HASW, T, REDUCE, SEQ, HYBRID, SCALEUP = range(16)
HEADER_FIELDS = 16
_AGREE = {E: "num_experts", H: "hidden", K: "num_topk",
          XKIND: "x format (0 bf16, 1 FP8 + float32 sf, 2 FP8 + packed UE8M0 sf)",
          NSF: "number of scale factors", EXPAND: "do_expand", ALIGN: "expert_alignment",
          SYNC: "do_cpu_sync", HASW: "weights given",
          REDUCE: "combine reduction (allow_multiple_reduction, apply_dispatch_weights)",
          SCALEUP: "the ranks of a scale-up (NVLink) domain (EP_CPU_NUM_NVLINK_RANKS, the same on every rank)",
          HYBRID: "allow_hybrid_mode (the buffer's; 1 hybrid where the group acts as several nodes)"}

# The collective calls of a CPU buffer: the code each writes at OP (unique; 0 is no call).
(OP_DISPATCH, OP_COMBINE, OP_BARRIER, OP_PP_SET_CONFIG, OP_AGRS_SET_CONFIG, OP_ALL_GATHER, OP_REDUCE_SCATTER,
 OP_ENGRAM_WRITE, OP_DESTROY_AGRS_SESSION) = range(1, 10)
#: Operation code -> the public method's name, used in every message.
OPERATIONS = {OP_DISPATCH: "dispatch", OP_COMBINE: "combine", OP_BARRIER: "barrier",
              OP_PP_SET_CONFIG: "pp_set_config", OP_AGRS_SET_CONFIG: "agrs_set_config",
              OP_ALL_GATHER: "all_gather", OP_REDUCE_SCATTER: "reduce_scatter", OP_ENGRAM_WRITE: "engram_write",
              OP_DESTROY_AGRS_SESSION: "destroy_agrs_session"}


# torch's gloo worker thread frees each finished work item (and the tensors it holds) itself. Where
# that happens after the interpreter began to finalize (a busy machine delays the thread past a
# program's last line), freeing a tensor whose Python object is gone needs the GIL, the thread is made
# to exit, and the process aborts ("terminate called without an active exception") after its work
# was done. At exit, before finalization, a process that used a CPU buffer gives the thread a moment.
EXIT_GRACE_SECS = 0.2
_exit_grace_registered = False


def _register_exit_grace() -> None:
    global _exit_grace_registered
    if not _exit_grace_registered:
        import atexit
        import time
        atexit.register(time.sleep, EXIT_GRACE_SECS)
        _exit_grace_registered = True


def operation_name(code: int) -> str:
    """The name of operation ``code`` (`OPERATIONS`), or ``"unknown operation <code>"``."""
    return OPERATIONS.get(code, f"unknown operation {code}")

#: Buffers created so far per process group (by group name): the n-th buffer of a group has the same
#: number on every rank, which names its arrival stamps in the group's store.
_buffers_per_group: dict = {}


class Collectives:
    """The bounded collectives of one buffer on one rank (see the module docstring)."""

    def __init__(self, group, rank: int, num_ranks: int, timeout_secs: float) -> None:
        _register_exit_grace()
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.timeout_secs = timeout_secs
        self._timeout = datetime.timedelta(seconds=timeout_secs)
        self.calls = 0               # collective calls entered on this rank
        self._op = ""                # the current (or last) call's name
        self._op_code = 0            # and its code (`OPERATIONS`)
        self._broken: Optional[str] = None   # the failure that made the group unusable
        name = str(getattr(group, "group_name", "") or id(group))
        counter = _buffers_per_group.setdefault(name, itertools.count())
        self._stamp_prefix = f"deep_ep/cpu/group{name}/buffer{next(counter)}/rank"
        self._use_store = True       # False once the store failed (it only serves diagnostics)
        #: (hybrid, ranks per physical scale-up domain) of the buffer, which every rank's must equal
        self.domains = (0, num_ranks)

    # ------------------------------------------------------------------ errors
    def error(self, msg: str) -> RuntimeError:
        """A `RuntimeError` naming this rank (raised by every rank for conditions they all see)."""
        return RuntimeError(f"deep_ep (CPU backend, rank {self.rank} of {self.num_ranks}): {msg}")

    def begin(self, op: int, call: int) -> None:
        """Start operation ``op`` (a code of `OPERATIONS`), this rank's call number ``call`` of the
        buffer (counted by the buffer, refused calls included): refuse if an earlier failure broke the
        group, stamp the arrival. `exchange_header` then sends ``op`` and ``call``."""
        if self._broken is not None:
            # ranks out of step leave gloo's connections intact; a failed collective closes them
            what = "destroy it on every rank and create a new one" if self._broken == "ranks at different calls" \
                else "destroy it and the process group, and start again"
            raise self.error(f"this buffer can no longer communicate after an earlier failure "
                             f"({self._broken}); {what}")
        self.calls = call
        self._op_code = op
        self._op = operation_name(op)
        store = self._store()
        if store is not None:
            try:
                store.set(self._stamp_prefix + str(self.rank), f"{self.calls} {self._op}")
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
            seen = ", ".join(f"rank {p} has entered no call of this buffer" if stamps[p][0] == 0 else
                             f"rank {p} last entered call #{stamps[p][0]}" +
                             (f" ({stamps[p][1]})" if stamps[p][1] else "") for p in missing)
            how = f"within {secs} s" if timed_out else f"(the connection failed before the {secs} s timeout: {exc})"
            msg = (f"deep_ep CPU timeout on rank {self.rank}: peer rank{'s' if len(missing) > 1 else ''} "
                   f"{', '.join(map(str, missing))} did not arrive {how} in {where} ({seen}). "
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
        """Wait for every rank (call number ``call``), bounded by ``num_cpu_timeout_secs``: a header
        exchange, so that a rank in another call raises like any call's header (an all-to-all
        returns on a rank only once every rank's row has arrived)."""
        self.begin(OP_BARRIER, call)
        self.exchange_header(new_fields())

    def exchange_header(self, fields: list, tail: Optional[torch.Tensor] = None,
                        agree: Optional[dict] = None) -> torch.Tensor:
        """All ranks' headers ``[R, F + 2R]`` (the same on every rank) for the call `begin` started.

        Args:
            fields: ``F`` ints, the operation's own fields (``OP`` and ``SEQ`` are filled in here).
            tail: up to ``2R`` int64 values after the fields (zeros after them), or None.
            agree: ``{field: name}`` that must be equal on every rank; default: dispatch's and
                combine's configuration (`_AGREE`) for those two, none for other operations.

        Raises (the same on every rank, before data moves):
            RuntimeError: ranks at different calls (the buffer is then unusable), in different
                operations, or that disagree on a field of ``agree``.
        """
        R = self.num_ranks
        header = torch.zeros(HEADER_FIELDS + 2 * R, dtype=torch.int64, device="cpu")
        fields = list(fields)
        fields[OP], fields[SEQ] = self._op_code, self.calls
        if self._op_code in (OP_DISPATCH, OP_COMBINE):
            fields[HYBRID], fields[SCALEUP] = self.domains
        header[:HEADER_FIELDS] = torch.tensor(fields, dtype=torch.int64, device="cpu")
        if tail is not None:
            header[HEADER_FIELDS:HEADER_FIELDS + tail.numel()] = tail.reshape(-1)
        headers = self.all_gather(header, f"{self._op} header exchange")
        seqs, ops = headers[:, SEQ], headers[:, OP]
        if (seqs != seqs[0]).any() or (ops != ops[0]).any():
            where = ", ".join(f"rank {peer} at call #{seq} ({operation_name(code)})"
                              for peer, (seq, code) in enumerate(zip(seqs.tolist(), ops.tolist())))
            if (seqs != seqs[0]).any():
                self._broken = "ranks at different calls"
                raise self.error(f"ranks are at different calls of this buffer ({where}): a rank skipped or "
                                 f"repeated a call (a call refused for bad arguments counts on the rank that "
                                 f"refused it). Every rank raises this; the buffer is no longer usable (destroy "
                                 f"it on every rank and create a new one; the process group is fine)")
            raise self.error(f"ranks called different operations ({where}): every rank must make the same "
                             f"collective calls in the same order. Every rank raises this; nothing was sent")
        if agree is None:
            agree = _AGREE if self._op_code in (OP_DISPATCH, OP_COMBINE) else {}
        for field, name in agree.items():
            column = headers[:, field]
            if (column != column[0]).any():
                raise self.error(f"ranks disagree on {name}: per-rank values {column.tolist()}")
        return headers


def new_fields() -> list:
    """A zeroed header field list."""
    return [0] * HEADER_FIELDS
