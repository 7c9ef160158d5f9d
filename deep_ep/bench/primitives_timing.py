"""The clock of ``python -m deep_ep bench --primitive`` (`deep_ep.bench.primitives_gpu` runs the
cases; `deep_ep.bench.primitives` holds the arithmetic and the report).

A round: a sleep kernel on a timing stream (the gate), then an event; every rank's stream and the
matmul's stream wait for that event before their calls, so the host queues a whole round while the
gate holds the GPU and the device times are not the host's pace. The gate lasts twice the round's
expected queueing time (calls x ranks x the host's time per call, measured in the case's earlier
rounds) plus 5 ms. Per case: the transfer alone; for each overlap matmul (compute-bound and
memory-bound, `primitives.MATMULS`) the matmul alone, repeated to last about as long as the
transfer's round (a round of the transfer lasting at least 2 ms, more calls than ``--iters`` if
needed), and both together, 5 rounds each, taking turns (medians); the matmul's slowdown beside the
transfer; for a transfer that holds no SM, the same matmuls beside plain copy-engine copies of the
call's moves (`primitives.plain_copies`, the same number of calls per round on the same streams):
the overlap floor; the floor, a device copy of the same bytes.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .primitives import (MATMULS, Case, Matmul, bandwidth_gbps, matmul_count, peer_bytes, plain_copies,
                         process_bytes, ratio, slowdown_percent, sms_held)

__all__ = ["Timer", "PlainCopies", "nvlink_floor", "overlap_iters", "wait", "generator", "ROUNDS", "OVERLAP_ROUNDS",
           "TIMEOUT_SECS", "HOST_GUESS_US"]

ROUNDS = 3
#: rounds of each kind of an overlap measurement (the matmul alone, beside the call, beside plain
#: copies), taking turns so that a drift of the clocks shifts all three alike
OVERLAP_ROUNDS = 5
#: an overlap round's transfer lasts at least this long (more calls per round than ``--iters``):
#: with a round of a few matmuls, one matmul's luck moved the slowdown by several points
OVERLAP_ROUND_US = 2_000.0
MAX_OVERLAP_ITERS = 2_000
TIMEOUT_SECS = 300.0
PROBE_MATMULS = 8
MIN_GATE_US, MAX_GATE_US = 5_000.0, 500_000.0
#: The host's time to queue one call or one matmul before a case has measured it (generous: a gate
#: too long only idles the GPU, one too short makes the round host-bound).
HOST_GUESS_US = {"transfer": 2_000.0, "matmul": 100.0}


def wait(stream=None) -> None:
    """Poll until ``stream``'s queued work is done (never a blocking driver wait: `deep_ep.emulated`)."""
    from ..emulated import wait_for_stream
    wait_for_stream(stream, timeout_secs=TIMEOUT_SECS)


def generator(device, *parts: int) -> torch.Generator:
    """A generator on ``device`` seeded from the integers ``parts``."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (1 << 62)
    return torch.Generator(device=device).manual_seed(seed)


class PlainCopies:
    """One rank's stand-in for a call: its copy-engine moves (``(source offset, target offset,
    bytes)``, `primitives.plain_copies`) as plain ``cuMemcpyDtoDAsync`` between buffers of its own,
    on the current stream, with no stream memory operation around them. Calling it queues one
    call's copies."""

    def __init__(self, moves, device: torch.device) -> None:
        self.device = device
        self.source = torch.empty(max(offset + size for offset, _, size in moves), dtype=torch.uint8, device=device)
        self.target = torch.empty(max(offset + size for _, offset, size in moves), dtype=torch.uint8, device=device)
        self.moves = [(self.target.data_ptr() + target, self.source.data_ptr() + source, size)
                      for source, target, size in moves]

    def __call__(self) -> None:
        from ..cuda.driver import enter_context, error_name, leave_context, memcpy_async
        stream = torch.cuda.current_stream(self.device).cuda_stream
        previous = enter_context(self.device.index)
        try:
            for target, source, size in self.moves:
                err = memcpy_async(target, source, size, stream)
                if err != 0:
                    raise RuntimeError(f"deep_ep bench: queueing a plain cuMemcpyDtoDAsync of {size} bytes failed: "
                                       f"{error_name(err)}")
        finally:
            leave_context(previous)


class Timer:
    """Rounds of calls behind a gate kernel (see the module docstring), in the measuring thread.
    ``context``: the runner's shared state (device, ranks, seed, SMs, barrier); ``enter(rank)``: a
    context manager that makes ``rank``'s stream current."""

    def __init__(self, context, enter: Callable[[int], Any]) -> None:
        from .gpu_timing import spin_up
        self.context, self.device, self.enter = context, context.device, enter
        self.timing = torch.cuda.Stream(self.device)
        self.matmul_stream = torch.cuda.Stream(self.device)
        self.operands = {}   # Matmul.key: (activations, weight), made on the matmul stream
        with torch.cuda.stream(self.matmul_stream):
            for matmul in MATMULS:
                seeded = generator(self.device, context.seed, 7, matmul.rows, matmul.width)
                self.operands[matmul.key] = tuple(
                    torch.randn(shape, dtype=torch.float32, device=self.device, generator=seeded)
                    .to(torch.bfloat16) for shape in ((matmul.rows, matmul.width), (matmul.width, matmul.width)))
        wait(self.matmul_stream)
        self.host_per_call_us: Dict[str, float] = {}   # measured in the current case, per call or matmul
        spin_up()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        with torch.cuda.stream(self.timing):
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
        wait(self.timing)
        self.cycles_per_us = cycles / max(start.elapsed_time(end) * 1e3, 1.0)

    def _host_us(self, what: str, count: int) -> float:
        """The host's expected time to queue ``count`` calls (``transfer``) or matmuls (a `Matmul` key):
        the slowest per-call time seen in this case, or a generous guess before the first round."""
        return count * self.host_per_call_us.get(what, HOST_GUESS_US["transfer" if what == "transfer" else "matmul"])

    def round(self, calls: List[Callable[[], Any]], iters: int, matmul: Optional[Matmul] = None,
              count: int = 0) -> Dict[str, float]:
        """One round: ``iters`` calls of each rank's ``calls[r]`` on its stream, and / or ``count``
        ``matmul``s on the matmul stream, all released by one event after the gate. The gate lasts
        twice the host's expected queueing time of the round (every rank's calls and the matmuls, from
        the per-call times measured so far in this case) plus `MIN_GATE_US`. Device times in us:
        ``transfer_us`` per call (the slowest rank's stream), ``matmul_us`` per matmul, ``both_us``
        until the last stream finished (the whole round); ``host_us``, the host's queueing time, and
        ``gate_us``."""
        self.context.barrier()
        num_calls, count = len(calls) * iters, (count if matmul is not None else 0)
        gate_us = MIN_GATE_US + 2 * (self._host_us("transfer", num_calls) +
                                     (self._host_us(matmul.key, count) if count else 0.0))
        gate_us = min(MAX_GATE_US, gate_us)
        start = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.timing):
            torch.cuda._sleep(int(gate_us * self.cycles_per_us))
            start.record()
        ends, t0 = [], time.perf_counter()
        for rank, call in enumerate(calls):
            with self.enter(rank):
                stream = torch.cuda.current_stream()
                stream.wait_event(start)
                for _ in range(iters):
                    call()
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                ends.append((stream, end))
        t1 = time.perf_counter()
        matmul_end = None
        if count:
            activations, weight = self.operands[matmul.key]
            self.matmul_stream.wait_event(start)
            with torch.cuda.stream(self.matmul_stream):
                for _ in range(count):
                    torch.matmul(activations, weight)
                matmul_end = torch.cuda.Event(enable_timing=True)
                matmul_end.record()
        t2 = time.perf_counter()
        for what, num, seconds in (("transfer", num_calls, t1 - t0), (matmul and matmul.key, count, t2 - t1)):
            if num:   # the slowest per-call time of the case: a round's hiccup lengthens the later gates
                self.host_per_call_us[what] = max(seconds * 1e6 / num, self.host_per_call_us.get(what, 0.0))
        for stream, _ in ends:
            wait(stream)
        if matmul_end is not None:
            wait(self.matmul_stream)
        out = {"host_us": (t2 - t0) * 1e6, "gate_us": gate_us}
        totals = []
        if ends:
            total = max(start.elapsed_time(end) for _, end in ends) * 1e3
            out["transfer_us"] = total / iters
            totals.append(total)
        if matmul_end is not None:
            total = start.elapsed_time(matmul_end) * 1e3
            out["matmul_us"] = total / count
            totals.append(total)
        out["both_us"] = max(totals)
        return out

    def overlap(self, calls: List[Callable[[], Any]], iters: int, time_us: float, matmul: Matmul,
                copies: Optional[List[PlainCopies]] = None) -> tuple:
        """``matmul`` alone and beside the transfer, repeated to last about as long as a round of the
        transfer: ``iters`` calls of ``time_us``, more if that is under `OVERLAP_ROUND_US` (at most
        `MAX_OVERLAP_ITERS`); with ``copies`` (one per rank), the same matmuls beside as many of each
        rank's plain copies. Medians of `OVERLAP_ROUNDS` rounds of each kind, the kinds taking turns.
        Returns ``(figures, rounds beside)``."""
        warm = self.__dict__.setdefault("_warm_matmuls", set())
        if matmul.key not in warm:   # a shape's first matmul pays cuBLAS's set-up: it would size the rounds
            self.round([], iters, matmul, 1)
            warm.add(matmul.key)
        probe = self.round([], iters, matmul, PROBE_MATMULS)
        # no more calls than the host queues well within the longest gate: past it the matmuls, queued
        # after the calls, would start late and the slowdown read low
        host_us = self.host_per_call_us.get("transfer", 0.0) * max(len(calls), 1)
        host_cap = int((MAX_GATE_US / 2 - MIN_GATE_US) / host_us) if host_us > 0 else MAX_OVERLAP_ITERS
        iters = self._fit_host(calls, max(iters, min(overlap_iters(iters, time_us), host_cap)), iters)
        count = matmul_count(time_us * iters, probe["matmul_us"])
        alone, both, beside_copies = [], [], []
        for _ in range(OVERLAP_ROUNDS):
            alone.append(self.round([], iters, matmul, count))
            both.append(self.round(calls, iters, matmul, count))
            if copies:
                beside_copies.append(self.round(copies, iters, matmul, count))
        matmul_us = statistics.median(r["matmul_us"] for r in alone)
        matmul_both_us = statistics.median(r["matmul_us"] for r in both)
        figures = {"matmul_rows": matmul.rows, "matmul_width": matmul.width, "matmuls_per_round": count,
                   "calls_per_round": iters,
                   "matmul_us": matmul_us, "matmul_both_us": matmul_both_us,
                   "transfer_both_us": statistics.median(r["transfer_us"] for r in both),
                   "matmul_round_us": statistics.median(r["both_us"] for r in alone),
                   "both_round_us": statistics.median(r["both_us"] for r in both),
                   "slowdown_percent": slowdown_percent(matmul_both_us, matmul_us),
                   "host_bound": any(r["host_us"] > r["gate_us"] for r in alone + both + beside_copies),
                   "plain_copy": None, "excess_percent": None}
        if copies:
            copy_matmul_us = statistics.median(r["matmul_us"] for r in beside_copies)
            figures["plain_copy"] = {
                "copies_per_call": len(copies[0].moves),
                "bytes": sum(size for copy in copies for _, _, size in copy.moves),
                "copy_both_us": statistics.median(r["transfer_us"] for r in beside_copies),
                "matmul_both_us": copy_matmul_us,
                "round_us": statistics.median(r["both_us"] for r in beside_copies),
                "slowdown_percent": slowdown_percent(copy_matmul_us, matmul_us)}
            figures["excess_percent"] = slowdown_percent(matmul_both_us, copy_matmul_us)
        return figures, both + beside_copies

    def _fit_host(self, calls: List[Callable[[], Any]], iters: int, least: int) -> int:
        """``iters`` halved (never below ``least``) while a round of the transfer alone is host-bound.
        While the gate holds the GPU the host can queue only what a stream's queue holds: a call of
        several driver operations (copies, stream writes and waits, events) fills it after a few
        hundred calls, the host then waits for the GPU, and the matmuls, queued after the calls,
        start late (on the H200, 243 all-gathers of 1 MiB per round read a compute-bound slowdown
        of +295 % that plain copies did not show)."""
        while iters > least:
            seen = dict(self.host_per_call_us)
            trial = self.round(calls, iters)
            if trial["host_us"] <= trial["gate_us"]:
                break
            self.host_per_call_us = seen   # that round's time per call was the GPU's pace, not the host's
            iters = max(least, iters // 2)
        return iters

    def measure(self, case: Case, calls: List[Callable[[], Any]], iters: int) -> Dict[str, Any]:
        """Every figure of one case (a row of the report, without the check)."""
        from .gpu_timing import copy_floor_us
        context = self.context
        nbytes = process_bytes(case, context.num_ranks, context.emulated)
        held = sms_held(case, context.num_sms, context.device_sms, context.num_ranks if context.emulated else 0)
        moves = plain_copies(case, context.num_ranks) if held == 0 else []
        copies = [PlainCopies(moves, self.device) for _ in calls] if moves else None
        self.host_per_call_us = {}   # a case's calls cost the host their own time
        self.round(calls, 2)   # warm-up; learns how long the host takes to queue a call
        if copies:
            self.round(copies, 2)   # the copies' warm-up: their host time only lowers the slowest seen
        rounds = [self.round(calls, iters) for _ in range(ROUNDS)]
        time_us = statistics.median(r["transfer_us"] for r in rounds)
        overlap, timed = {}, list(rounds)
        for matmul in MATMULS:
            overlap[matmul.key], beside = self.overlap(calls, iters, time_us, matmul, copies)
            timed += beside
        del copies
        floor = copy_floor_us(nbytes, self.device)
        row = {"primitive": case.primitive, "op": case.op, "label": case.label, "dtype": case.dtype,
               "tensor_bytes": case.num_bytes, "tokens": case.tokens, "entries": case.entries, "hidden": case.hidden,
               "iters": iters, "time_us": time_us, "time_us_all": [r["transfer_us"] for r in rounds], "bytes": nbytes,
               "gbps": bandwidth_gbps(nbytes, time_us), "floor_us": floor, "floor_ratio": ratio(time_us, floor),
               "sms_held": held, "emulated": context.emulated,
               "host_bound": any(r["host_us"] > r["gate_us"] for r in timed), "overlap": overlap}
        if context.multiprocess:
            row.update(nvlink_floor(case, context))
        return row


def overlap_iters(iters: int, time_us: float) -> int:
    """Calls per overlap round: ``iters``, or enough calls of ``time_us`` to last `OVERLAP_ROUND_US`
    (at most `MAX_OVERLAP_ITERS`)."""
    if not time_us or time_us <= 0 or time_us != time_us:
        return iters
    return max(iters, min(MAX_OVERLAP_ITERS, -int(-OVERLAP_ROUND_US // time_us)))


def nvlink_floor(case: Case, context) -> Dict[str, Any]:
    """One rank per GPU: a peer copy to the next GPU of the bytes that leave this one."""
    from .gpu_timing import time_events
    nbytes = peer_bytes(case, context.num_ranks)
    peer = (context.device.index + 1) % torch.cuda.device_count()
    if not nbytes or peer == context.device.index:
        return {"peer_bytes": nbytes, "nvlink_floor_us": None}
    source = torch.empty(nbytes, dtype=torch.uint8, device=context.device)
    target = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", peer))
    times = time_events(lambda: target.copy_(source), 10, 2)
    return {"peer_bytes": nbytes, "nvlink_floor_us": statistics.median(times) * 1e6}
