"""One rank's pass of the bench, shared by the CPU and GPU runners.

A :class:`RankSession` drives the public API only (`ElasticBuffer.dispatch` / `combine`) with four
calls, named as in the report and the JSON (:data:`CALLS`):

* ``full_dispatch_cpu_sync``: ``dispatch(x, topk_idx, topk_weights, ...)`` (host waits for the counts);
* ``full_dispatch_no_cpu_sync``: the same with ``do_cpu_sync=False`` (worst-case-sized outputs);
* ``cached_dispatch``: ``dispatch(x, handle=first_handle)``;
* ``combine``: ``combine(y, first_handle, bias=...)``, ``y`` standing in for the experts' outputs.

Order: :meth:`first_calls` (one checked call of each), :meth:`timed_loop` (``warmup + iters``
iterations, each call timed on its own after a barrier), :meth:`checked_iteration` (one more
iteration with poisoned outputs, compared with the reference, not part of the medians). The GPU
runner adds back-to-back calls and CUDA graphs (`deep_ep.bench.runner_gpu`).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional

from ..backends import outputs
from .check import Checker, RankExpected
from .config import Workload, expert_output, num_rows, token_copies
from .progress import Progress

__all__ = ["CALLS", "CALL_TITLES", "HostClock", "RankSession"]

CALLS = ("full_dispatch_cpu_sync", "full_dispatch_no_cpu_sync", "cached_dispatch", "combine")
CALL_TITLES = {
    "full_dispatch_cpu_sync": "full dispatch (CPU sync)",
    "full_dispatch_no_cpu_sync": "full dispatch (no CPU sync)",
    "cached_dispatch": "cached dispatch",
    "combine": "combine",
}


class HostClock:
    """Wall time of one call (CPU backend: calls are synchronous, so that is the whole call).

    A clock has ``sync()`` (wait for the device; nothing here) and ``time_call(fn) -> (result,
    sample)`` where ``sample`` has ``sync_s`` (seconds from the call's start until its work is done),
    ``host_s`` (seconds until it returned; None when equal to ``sync_s``) and ``event_s`` (device
    events around the call; None here)."""

    def sync(self) -> None:
        """Nothing to wait for on CPU."""

    def time_call(self, fn: Callable[[], Any]):
        t0 = time.perf_counter()
        out = fn()
        return out, {"sync_s": time.perf_counter() - t0, "host_s": None, "event_s": None}


class RankSession:
    """One rank's calls, timings and checks for one :class:`Workload` pass.

    Args:
        work: the pass (its ``run_cfg`` gives layout and expert count).
        rank: this rank. buffer: its `ElasticBuffer`. device: where its inputs live.
        barrier: a no-argument callable that waits for every rank.
        clock: :class:`HostClock` or the GPU runner's CUDA clock.
        progress: where stage lines go (rank 0 only, usually).
        expected: the reference's outputs on this rank, or None to skip the check.
    """

    def __init__(self, work: Workload, rank: int, buffer, device, barrier: Callable[[], None], clock,
                 progress: Progress, expected: Optional[RankExpected] = None) -> None:
        self.work, self.cfg = work, work.run_cfg
        self.rank, self.buffer, self.device = rank, buffer, device
        self.barrier, self.clock, self.progress = barrier, clock, progress
        self.mine = work.inputs(rank, device)
        self.checker = Checker(self.cfg, rank, expected, phase=work.name) if expected is not None else None
        self.samples: Dict[str, List[Dict[str, Optional[float]]]] = {name: [] for name in CALLS}
        self.extra: Dict[str, Dict[str, Optional[float]]] = {name: {} for name in CALLS}
        self.handle = None
        self.first_recv_x = None
        self.y = None

    # ------------------------------------------------------------------ the calls
    def full_dispatch(self, cpu_sync: bool = True):
        cfg, m = self.cfg, self.mine
        return self.buffer.dispatch(
            m["x"], topk_idx=m["topk_idx"], topk_weights=m["topk_weights"], num_experts=cfg.num_experts,
            num_max_tokens_per_rank=cfg.max_tokens, expert_alignment=cfg.alignment, do_expand=cfg.expand,
            do_zero_padding=cfg.expand, num_sms=cfg.num_sms, do_cpu_sync=cpu_sync)

    def cached_dispatch(self):
        return self.buffer.dispatch(self.mine["x"], handle=self.handle, num_sms=self.cfg.num_sms,
                                    do_zero_padding=self.cfg.expand)

    def combine(self):
        biases = self.mine["biases"]
        return self.buffer.combine(self.y, self.handle, bias=biases if biases else None, num_sms=self.cfg.num_sms)

    def call(self, name: str):
        """Run the call named ``name`` (one of :data:`CALLS`) once; returns its outputs."""
        if name == "full_dispatch_cpu_sync":
            return self.full_dispatch(True)
        if name == "full_dispatch_no_cpu_sync":
            return self.full_dispatch(False)
        if name == "cached_dispatch":
            return self.cached_dispatch()
        if name == "combine":
            return self.combine()
        raise ValueError(f"unknown call {name!r}")

    # ------------------------------------------------------------------ checking
    @contextlib.contextmanager
    def poisoned(self):
        """Outputs allocated inside are poisoned when checking. Barriers around it: the poisoning
        switch is process-wide, and emulated ranks (threads) must not time calls while it is on."""
        if self.checker is None:
            yield
            return
        self.clock.sync()
        self.barrier()
        with outputs.poisoned():
            yield
            self.clock.sync()
        self.barrier()  # not on an error: the peers may never arrive

    def check(self, name: str, result, when: str) -> None:
        """Compare the outputs ``result`` of call ``name`` with the reference (no-op without check)."""
        if self.checker is None:
            return
        if name == "combine":
            self.checker.combine(when, CALL_TITLES[name], result)
        else:
            self.checker.dispatch(when, CALL_TITLES[name], result, cpu_sync=name != "full_dispatch_no_cpu_sync",
                                  cached=name == "cached_dispatch")

    # ------------------------------------------------------------------ phases
    def first_calls(self) -> None:
        """One call of each kind (the first dispatch makes the handle every later call uses)."""
        with self.poisoned():
            first = self.full_dispatch(True)
        self.handle, self.first_recv_x = first[3], first[0]
        self.check("full_dispatch_cpu_sync", first, "first")
        exp = self.checker.expected if self.checker is not None else None
        if exp is not None and tuple(exp.combine_input.shape) == (self.handle.num_recv_rows, self.cfg.hidden):
            # The reference's received rows: a dispatch defect then shows in the dispatch check only.
            self.y = exp.combine_input.contiguous()
        else:
            self.y = expert_output(self.cfg, first[0], self.rank).contiguous()
        del first
        for name in CALLS[1:]:
            with self.poisoned():
                out = self.call(name)
            self.check(name, out, "first")
            del out
        self.progress.say(f"rank {self.rank}: first calls done" +
                          (" and checked" if self.checker is not None else ""))

    def timed_loop(self) -> None:
        """``warmup + iters`` iterations; each call timed alone, after a device sync and a barrier."""
        cfg = self.cfg
        done = self.progress.loop("iteration", cfg.iters)
        for i in range(cfg.warmup + cfg.iters):
            for name in CALLS:
                self.clock.sync()
                self.barrier()
                _, sample = self.clock.time_call(lambda: self.call(name))
                if i >= cfg.warmup:
                    self.samples[name].append(sample)
            if i + 1 == cfg.warmup:
                self.progress.say(f"rank {self.rank}: warm-up done")
            elif i >= cfg.warmup:
                done(i + 1 - cfg.warmup)
        self.clock.sync()

    def checked_iteration(self) -> None:
        """The timed loop's calls once more, outputs poisoned, each compared with the reference."""
        if self.checker is None:
            return
        with self.poisoned():
            results = {name: self.call(name) for name in CALLS}
        for name in CALLS:
            self.check(name, results[name], "timed-loop")
        self.progress.say(f"rank {self.rank}: timed-loop calls checked")

    # ------------------------------------------------------------------ results
    def result(self) -> Dict[str, Any]:
        """This rank's numbers (picklable): loads, samples per call, extras, the check's findings."""
        cfg = self.cfg
        return {
            "rank": self.rank,
            "sent": sum(token_copies(self.mine["topk_idx"].cpu(), cfg.num_experts, cfg.num_ranks, cfg.expand)),
            "received": int(self.handle.rank_prefix_sum[-1]) if cfg.num_ranks else 0,
            "received_rows": num_rows(self.first_recv_x),
            "samples": self.samples,
            "extra": self.extra,
            "checked": list(self.checker.checked) if self.checker is not None else [],
            "mismatches": [m.as_dict() for m in self.checker.mismatches] if self.checker is not None else [],
        }
