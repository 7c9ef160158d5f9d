"""GPU runner of ``python -m deep_ep bench --primitive`` (`deep_ep.bench.primitives` holds the cases,
the byte counts and the report).

Ranks: EP=1 through a one-rank NCCL group, one rank per GPU under torchrun (rank 0 prints), or
``--virtual-ranks N`` emulated ranks on one GPU. Per primitive every rank creates and configures its
buffer in its own thread (collective calls); per case every rank makes one call, its outputs
poisoned first, and compares them byte for byte with the expected bytes. Then the calls are timed:
with emulated ranks rank 0's thread makes every rank's calls on that rank's stream
(`deep_ep.emulated.EmulatedGroup.acting_as`: no call of a primitive waits for a peer on the host
once the buffer is configured) while the other threads wait at a host barrier.

The rounds that time them, the overlap matmuls and the floors are `deep_ep.bench.primitives_timing`'s.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from .primitives import (COLUMNS, DEFAULT_ITERS, Case, build_result, cases, format_case, format_header, prepare,
                         reduce_scatter_rows)
from .primitives_timing import TIMEOUT_SECS, Timer, generator, wait

__all__ = ["run"]

PP_INFLIGHT = 2
ENGRAM_ENTRIES_PER_RANK = 1024


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _random_bits(shape, dtype: torch.dtype, device, *seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (made on the device: no host copy, which would wait for the stream)."""
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, device=device,
                        generator=generator(device, *seed))
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
    wait()
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
            inputs = [torch.randn(shape, dtype=torch.float32, device=device, generator=generator(device, seed, 3, index, rank)).to(
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
                                device=device, generator=generator(device, seed, 6, index, self.rank))
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
        self.timer: Optional[Timer] = None
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
                wait()
                context.calls[slot] = call
                host_barrier()
                if slot == 0:
                    if context.timer is None:
                        context.timer = Timer(context, context.enter)
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
