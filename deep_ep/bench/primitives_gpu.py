"""GPU runner of ``python -m deep_ep bench --primitive`` (`deep_ep.bench.primitives` holds the cases,
the byte counts and the report).

Ranks: EP=1 through a one-rank NCCL group, one rank per GPU under torchrun (rank 0 prints), or
``--virtual-ranks N`` emulated ranks on one GPU. Per primitive every rank creates and configures its
buffer in its own thread (collective calls); per case every rank makes one call, its outputs
poisoned first, and compares them byte for byte with the expected bytes. Then the calls are timed:
with emulated ranks rank 0's thread makes every rank's calls on that rank's stream
(`deep_ep.emulated.EmulatedGroup.acting_as`: no call of a primitive waits for a peer on the host
once the buffer is configured) while the other threads wait at a host barrier.

A round: a sleep kernel on a timing stream (the gate), then an event; every rank's stream and the
matmul's stream wait for that event before their calls, so the host queues a whole round while the
gate holds the GPU and the device times are not the host's pace. The gate lasts twice the round's
expected queueing time (calls x ranks x the host's time per call, measured in the case's earlier
rounds) plus 5 ms. Per case: the transfer alone; for each overlap matmul (compute-bound and
memory-bound, `primitives.MATMULS`) the matmul alone, repeated to last about as long as the
transfer's round, and both together, 3 rounds each (medians); the matmul's slowdown beside the
transfer; the floor, a device copy of the same bytes.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .primitives import (COLUMNS, DEFAULT_ITERS, MATMULS, Case, Matmul, bandwidth_gbps, build_result, cases,
                         format_case, format_header, matmul_count, peer_bytes, prepare, process_bytes, ratio,
                         reduce_scatter_rows, slowdown_percent, sms_held)

__all__ = ["run"]

ROUNDS = 3
PP_INFLIGHT = 2
ENGRAM_ENTRIES_PER_RANK = 1024
TIMEOUT_SECS = 300.0
PROBE_MATMULS = 8
MIN_GATE_US, MAX_GATE_US = 5_000.0, 500_000.0
#: The host's time to queue one call or one matmul before a case has measured it (generous: a gate
#: too long only idles the GPU, one too short makes the round host-bound).
HOST_GUESS_US = {"transfer": 2_000.0, "matmul": 100.0}


def _wait(stream=None) -> None:
    """Poll until ``stream``'s queued work is done (never a blocking driver wait: `deep_ep.emulated`)."""
    from ..emulated import wait_for_stream
    wait_for_stream(stream, timeout_secs=TIMEOUT_SECS)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _generator(device, *parts: int) -> torch.Generator:
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (1 << 62)
    return torch.Generator(device=device).manual_seed(seed)


def _random_bits(shape, dtype: torch.dtype, device, *seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (made on the device: no host copy, which would wait for the stream)."""
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, device=device,
                        generator=_generator(device, *seed))
    return raw.view(dtype)


def _compare(got: Optional[torch.Tensor], want: Optional[torch.Tensor], what: str) -> Optional[str]:
    """None when ``got`` holds ``want``'s bytes, else the first difference (read after a polled wait)."""
    if got is None or want is None:
        return None if got is None and want is None else f"{what}: {'missing' if got is None else 'unexpected'}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: shape {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    got_bytes, want_bytes = _bytes(got), _bytes(want)
    differ = got_bytes != want_bytes
    count, first = differ.sum(), differ.to(torch.uint8).argmax()
    _wait()
    if int(count.item()) == 0:
        return None
    index = int(first.item())
    return (f"{what}: {int(count.item())} of {got_bytes.numel()} bytes differ, first at byte {index} "
            f"(got {int(got_bytes[index].item())}, expected {int(want_bytes[index].item())})")


class _PpBench:
    """pp_send to the next rank and pp_recv from the previous one, per call."""

    def __init__(self, group, context, all_cases: List[Case]) -> None:
        import deep_ep
        self.rank, self.num_ranks, self.context = group.rank(), group.size(), context
        self.max_bytes = max(case.num_bytes for case in all_cases)
        hint = deep_ep.ElasticBuffer.get_pp_buffer_size_hint(self.max_bytes, PP_INFLIGHT)
        self.buffer = deep_ep.ElasticBuffer(group, num_bytes=hint, explicitly_destroy=True,
                                            num_cpu_timeout_secs=TIMEOUT_SECS)
        self.buffer.pp_set_config(self.max_bytes, PP_INFLIGHT)

    def prepare(self, case: Case, index: int):
        device, num_sms = self.context.device, self.context.num_sms
        rows = case.num_bytes // (2 * COLUMNS)
        next_rank, prev_rank = (self.rank + 1) % self.num_ranks, (self.rank - 1) % self.num_ranks
        sent = _random_bits((rows, COLUMNS), torch.bfloat16, device, self.context.seed, 1, index, self.rank)
        expected = _random_bits((rows, COLUMNS), torch.bfloat16, device, self.context.seed, 1, index, prev_rank)
        received = torch.empty_like(sent)

        def call():
            self.buffer.pp_send(sent, next_rank, num_sms=num_sms)
            self.buffer.pp_recv(received, prev_rank, num_sms=num_sms)

        def check() -> Optional[str]:
            received.view(torch.uint8).fill_(0xFF)
            call()
            return _compare(received, expected, "pp_recv's tensor")
        return call, check

    def close(self) -> None:
        try:
            self.buffer.pp_set_config(self.max_bytes, PP_INFLIGHT)   # flush: every tensor sent was received
        finally:
            self.buffer.destroy()


class _AgrsBench:
    """One session per call: create, all_gather (or reduce_scatter), the handle, destroy."""

    def __init__(self, group, context, all_cases: List[Case]) -> None:
        import deep_ep
        self.rank, self.num_ranks, self.context = group.rank(), group.size(), context
        size = deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes
        self.session_bytes = max(size(group, self._shape(case)[1], torch.bfloat16) for case in all_cases)
        hint = deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(group, self.session_bytes)
        self.buffer = deep_ep.ElasticBuffer(group, num_bytes=hint, explicitly_destroy=True,
                                            num_cpu_timeout_secs=TIMEOUT_SECS)
        self.buffer.agrs_set_config(self.session_bytes, 1)

    def _shape(self, case: Case) -> tuple:
        """(input shape, the shape whose all-gather room the call takes)."""
        if case.op == "all_gather":
            shape = (case.num_bytes // (2 * COLUMNS), COLUMNS)
            return shape, shape
        rows = reduce_scatter_rows(case.num_bytes, self.num_ranks)
        return (rows, COLUMNS), (rows // self.num_ranks, COLUMNS)

    def prepare(self, case: Case, index: int):
        device, seed, buffer, num_ranks = self.context.device, self.context.seed, self.buffer, self.num_ranks
        shape, _ = self._shape(case)
        if case.op == "all_gather":
            inputs = [_random_bits(shape, torch.bfloat16, device, seed, 2, index, rank) for rank in range(num_ranks)]
            expected = torch.stack(inputs)
            method = buffer.all_gather
        else:
            inputs = [torch.randn(shape, dtype=torch.float32, device=device, generator=_generator(device, seed, 3, index, rank)).to(
                torch.bfloat16) for rank in range(num_ranks)]
            chunk = shape[0] // num_ranks
            mine = slice(self.rank * chunk, (self.rank + 1) * chunk)
            total = inputs[0][mine].to(torch.float32, copy=True)
            for rank in range(1, num_ranks):   # rank order, in float32: the primitive's sum
                total.add_(inputs[rank][mine])
            expected = total.to(torch.bfloat16)
            method = buffer.reduce_scatter
        local = inputs[self.rank]
        del inputs

        def call():
            buffer.create_agrs_session()
            output, handle = method(local)
            handle()
            buffer.destroy_agrs_session()
            return output

        def check() -> Optional[str]:
            space = getattr(getattr(buffer, "_agrs_session", None), "space", None)
            if space is not None:
                space.fill_(0xFF)   # before the session: peers write into it only after this rank entered
            return _compare(call(), expected, f"{case.op}'s output")
        return call, check

    def close(self) -> None:
        self.buffer.destroy()


class _EngramBench:
    """engram_fetch of random entries of every rank's shard, and its hook, per call."""

    def __init__(self, group, context, all_cases: List[Case]) -> None:
        import deep_ep
        self.rank, self.num_ranks, self.context = group.rank(), group.size(), context
        max_rows = max(case.tokens * case.entries for case in all_cases)
        hidden = max(case.hidden for case in all_cases)
        gpu_bytes, cpu_bytes = deep_ep.ElasticBuffer.get_engram_storage_size_hint(
            ENGRAM_ENTRIES_PER_RANK, hidden, max_rows, torch.bfloat16)
        self.buffer = deep_ep.ElasticBuffer(group, num_bytes=gpu_bytes + cpu_bytes, num_cpu_bytes=cpu_bytes,
                                            explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT_SECS)

    def prepare(self, case: Case, index: int):
        from ..primitives.engram import engram_fetch_reference
        device, seed, num_ranks, entries = self.context.device, self.context.seed, self.num_ranks, \
            ENGRAM_ENTRIES_PER_RANK
        dtype = torch.float8_e4m3fn if case.dtype == "fp8" else torch.bfloat16
        table = torch.cat([_random_bits((entries, case.hidden), dtype, device, seed, 4, index, owner)
                           for owner in range(num_ranks)])
        sf_table = None
        if case.dtype == "fp8":   # float32 factors, one per 128 channels, replicated on every rank
            sf_table = _random_bits((num_ranks * entries, case.hidden // 128), torch.float32, device, seed, 5, index)
        self.buffer.engram_write(table[self.rank * entries:(self.rank + 1) * entries].contiguous(), sf_table)
        indices = torch.randint(0, num_ranks * entries, (case.tokens, case.entries), dtype=torch.int32,
                                device=device, generator=_generator(device, seed, 6, index, self.rank))
        want_data, want_sf = engram_fetch_reference(table, sf_table, indices)
        del table

        def call():
            return self.buffer.engram_fetch(indices)()

        def check() -> Optional[str]:
            data, sf = call()
            return _compare(data, want_data, "engram data") or _compare(sf, want_sf, "engram scale factors")
        return call, check

    def close(self) -> None:
        self.buffer.destroy()


_BENCHES = {"pp": _PpBench, "agrs": _AgrsBench, "engram": _EngramBench}


class _Timer:
    """Rounds of calls behind a gate kernel (see the module docstring), in the measuring thread."""

    def __init__(self, context, enter: Callable[[int], Any]) -> None:
        from .gpu_timing import spin_up
        self.context, self.device, self.enter = context, context.device, enter
        self.timing = torch.cuda.Stream(self.device)
        self.matmul_stream = torch.cuda.Stream(self.device)
        self.operands = {}   # Matmul.key: (activations, weight), made on the matmul stream
        with torch.cuda.stream(self.matmul_stream):
            for matmul in MATMULS:
                generator = _generator(self.device, context.seed, 7, matmul.rows, matmul.width)
                self.operands[matmul.key] = tuple(
                    torch.randn(shape, dtype=torch.float32, device=self.device, generator=generator)
                    .to(torch.bfloat16) for shape in ((matmul.rows, matmul.width), (matmul.width, matmul.width)))
        _wait(self.matmul_stream)
        self.host_per_call_us: Dict[str, float] = {}   # measured in the current case, per call or matmul
        spin_up()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        with torch.cuda.stream(self.timing):
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
        _wait(self.timing)
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
            _wait(stream)
        if matmul_end is not None:
            _wait(self.matmul_stream)
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

    def overlap(self, calls: List[Callable[[], Any]], iters: int, time_us: float,
                matmul: Matmul) -> Dict[str, Any]:
        """``matmul`` alone and beside the transfer, repeated to last about as long as a round of
        ``iters`` calls of ``time_us`` (medians of `ROUNDS` rounds); ``(figures, rounds beside)``."""
        probe = self.round([], iters, matmul, PROBE_MATMULS)
        count = matmul_count(time_us * iters, probe["matmul_us"])
        alone = [self.round([], iters, matmul, count) for _ in range(ROUNDS)]
        both = [self.round(calls, iters, matmul, count) for _ in range(ROUNDS)]
        matmul_us = statistics.median(r["matmul_us"] for r in alone)
        matmul_both_us = statistics.median(r["matmul_us"] for r in both)
        return {"matmul_rows": matmul.rows, "matmul_width": matmul.width, "matmuls_per_round": count,
                "matmul_us": matmul_us, "matmul_both_us": matmul_both_us,
                "transfer_both_us": statistics.median(r["transfer_us"] for r in both),
                "matmul_round_us": statistics.median(r["both_us"] for r in alone),
                "both_round_us": statistics.median(r["both_us"] for r in both),
                "slowdown_percent": slowdown_percent(matmul_both_us, matmul_us)}, both

    def measure(self, case: Case, calls: List[Callable[[], Any]], iters: int) -> Dict[str, Any]:
        """Every figure of one case (a row of the report, without the check)."""
        from .gpu_timing import copy_floor_us
        context = self.context
        nbytes = process_bytes(case, context.num_ranks, context.emulated)
        self.host_per_call_us = {}   # a case's calls cost the host their own time
        self.round(calls, 2)   # warm-up; learns how long the host takes to queue a call
        rounds = [self.round(calls, iters) for _ in range(ROUNDS)]
        time_us = statistics.median(r["transfer_us"] for r in rounds)
        overlap, timed = {}, list(rounds)
        for matmul in MATMULS:
            overlap[matmul.key], both = self.overlap(calls, iters, time_us, matmul)
            timed += both
        floor = copy_floor_us(nbytes, self.device)
        held = sms_held(case, context.num_sms, context.device_sms)
        row = {"primitive": case.primitive, "op": case.op, "label": case.label, "dtype": case.dtype,
               "tensor_bytes": case.num_bytes, "tokens": case.tokens, "entries": case.entries, "hidden": case.hidden,
               "iters": iters, "time_us": time_us, "time_us_all": [r["transfer_us"] for r in rounds], "bytes": nbytes,
               "gbps": bandwidth_gbps(nbytes, time_us), "floor_us": floor, "floor_ratio": ratio(time_us, floor),
               "sms_held": held, "host_bound": any(r["host_us"] > r["gate_us"] for r in timed),
               "overlap": overlap}
        if context.multiprocess:
            row.update(_nvlink_floor(case, context))
        return row


def _nvlink_floor(case: Case, context) -> Dict[str, Any]:
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


class _Context:
    """What every rank of this process shares: options, the per-rank calls of the case being timed,
    the report's rows and the check's findings."""

    def __init__(self, args, gs, primitives: List[str]) -> None:
        self.primitives, self.device, self.seed = primitives, gs.device, args.seed
        self.num_ranks, self.emulated, self.multiprocess = gs.num_ranks, gs.emulated, gs.multiprocess
        self.iters = args.iters or DEFAULT_ITERS
        self.num_sms, self.check = args.num_sms, args.check
        self.device_sms = torch.cuda.get_device_properties(gs.device).multi_processor_count
        self.calls: List[Optional[Callable[[], Any]]] = [None] * (gs.num_ranks if gs.emulated else 1)
        self.problems: List[Optional[str]] = list(self.calls)
        self.rows: List[Dict[str, Any]] = []
        self.failures: List[str] = []
        self.timer: Optional[_Timer] = None
        self.group = None         # the EmulatedGroup
        self.stream = None        # the process's stream for its calls (one rank per process)

    def barrier(self) -> None:
        if self.multiprocess:
            import torch.distributed as dist
            dist.barrier()

    def enter(self, rank: int):
        return self.group.acting_as(rank) if self.emulated else torch.cuda.stream(self.stream)


def _rank_body(group, context: _Context) -> None:
    """Every primitive and case on one rank (its thread, or the process)."""
    from ..backends import outputs
    rank = group.rank()
    slot = rank if context.emulated else 0
    host_barrier = group.barrier if context.emulated else (lambda: None)
    for primitive in context.primitives:
        all_cases = cases(primitive)
        bench = _BENCHES[primitive](group, context, all_cases)
        try:
            for index, case in enumerate(all_cases):
                call, check = bench.prepare(case, index)
                if context.check:
                    with outputs.poisoned():
                        problem = check()
                    context.problems[slot] = problem
                    if problem:
                        context.failures.append(f"rank {rank}, {case.label}: {problem}")
                else:
                    call()
                _wait()
                context.calls[slot] = call
                host_barrier()
                if slot == 0:
                    if context.timer is None:
                        context.timer = _Timer(context, context.enter)
                    row = context.timer.measure(case, list(context.calls), context.iters)
                    found = [problem for problem in context.problems if problem]
                    row["check"] = None if not context.check else \
                        "check passed" if not found else f"check: FAILED: {found[0]}"
                    context.rows.append(row)
                    if rank == 0:
                        print("\n".join(format_case(row)), flush=True)
                host_barrier()
        finally:
            bench.close()


def run(args) -> int:
    """Run ``--primitive`` for parsed ``args`` (``--virtual-ranks``, ``--iters``, ``--seed``,
    ``--num-sms``, ``--json``, ``--no-check`` are read); returns the exit code (1: a check failed).

    Raises:
        SystemExit: no CUDA device, bad options, ``--virtual-ranks`` under torchrun.
    """
    primitives = prepare(args)
    from .report import write_json
    from .runner_gpu import setup
    gs = setup(args)
    context = _Context(args, gs, primitives)
    if gs.emulated and args.num_sms and args.num_sms > context.device_sms // gs.num_ranks:
        raise SystemExit(f"error: {gs.num_ranks} emulated ranks x --num-sms {args.num_sms} > {context.device_sms} "
                         f"SMs: every rank's PP blocks must be resident at once; use --num-sms <= "
                         f"{context.device_sms // gs.num_ranks}")
    where = f"{gs.num_ranks} emulated ranks on one GPU" if gs.emulated else \
        f"{gs.num_ranks} rank(s), one per GPU, NCCL" + (" (rank 0's figures)" if gs.multiprocess else "")
    if gs.rank == 0:
        print(format_header(primitives, where, gs.device_name, context.iters), flush=True)
    if gs.emulated:
        from .. import emulated
        group = context.group = emulated.EmulatedGroup(gs.num_ranks, device=gs.device)
        group.run(lambda rank_group: _rank_body(rank_group, context))
        failures = context.failures
    else:
        from .gpu_timing import single_rank_nccl_group
        context.stream = torch.cuda.Stream(gs.device)
        process_group = single_rank_nccl_group(gs.device)   # torchrun's group when there is one
        with torch.cuda.stream(context.stream):
            _rank_body(process_group, context)
        failures = context.failures
        if gs.multiprocess:
            import torch.distributed as dist
            gathered = [None] * gs.num_ranks if gs.rank == 0 else None
            dist.gather_object(context.failures, gathered, dst=0)
            if gs.rank != 0:
                return 0
            failures = [failure for found in gathered for failure in found]
    result = build_result(primitives, context.rows, failures, runner=gs.runner, device=gs.device_name,
                          num_ranks=gs.num_ranks, emulated=gs.emulated, iters=context.iters, checked=args.check)
    if not args.check:
        print("check: not checked (--no-check)")
    elif failures:
        print(f"check: FAILED: {len(failures)} output(s) differ from the expected bytes")
        print("\n".join("  " + failure for failure in failures[:20]))
    else:
        print("check: all outputs match the expected bytes")
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 1 if failures else 0
