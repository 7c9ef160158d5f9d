"""CPU runner of ``python -m deep_ep bench``: ``cfg.num_ranks`` processes joined by a gloo group.

The parent spawns the processes and prints what they report: progress lines as they come (rank 0's),
then rank 0's gathered results. Each process regenerates every rank's inputs from the seed,
evaluates `deep_ep.reference` for its own rank, and runs `deep_ep.bench.session.RankSession` on the
CPU backend through the public API.
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .check import reference_outputs
from .config import BenchConfig, Workload
from .progress import Progress
from .report import rank_row
from .session import HostClock, RankSession

__all__ = ["run_cpu", "run_gloo_ranks"]


def run_cpu(cfg: BenchConfig, works: Sequence[Workload], progress: Progress,
            worker_setup: Optional[Callable[[], None]] = None) -> List[Dict[str, Any]]:
    """Run every pass of ``works`` on ``cfg.num_ranks`` gloo processes; returns one dict per pass:
    ``{"name", "rows", "mismatches", "checked", "floors": {}, "baselines": {}}``.

    ``worker_setup``: a picklable no-argument function each process calls first (tests use it to
    alter the CPU backend inside the processes).

    Raises:
        SystemExit: a rank failed (its traceback in the message) or the processes died.
    """
    progress.say(f"starting {cfg.num_ranks} gloo processes")
    passes = run_gloo_ranks(cfg.num_ranks, _cpu_passes, (cfg, list(works)), progress, "deep_ep_bench_", worker_setup)
    out = []
    for work, results in zip(works, passes):
        out.append({"name": work.name, "rows": [rank_row(work.run_cfg, r) for r in results],
                    "mismatches": [m for r in results for m in r["mismatches"]],
                    "checked": results[0]["checked"], "floors": {}, "baselines": {}})
    return out


def run_gloo_ranks(num_ranks: int, body: Callable[..., Any], args: tuple, progress: Progress, prefix: str,
                   setup: Optional[Callable[[], None]] = None) -> Any:
    """Spawn ``num_ranks`` processes joined by a gloo group (rendezvous in a temporary directory named
    with ``prefix``, the CPU's threads shared among them); each calls ``setup()`` first (if given),
    then ``body(rank, progress, *args)`` with a `Progress` that reaches ``progress`` from rank 0
    only. ``body``, ``args`` and ``setup`` must be picklable (module-level functions). Returns what
    rank 0's ``body`` returned.

    Raises:
        SystemExit: a rank raised (its traceback in the message) or the processes died without a
            result.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    threads = max(1, (os.cpu_count() or 1) // num_ranks)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_gloo_worker, args=(rank, num_ranks, body, args, setup, init_method, threads,
                                                        queue), daemon=True)
                 for rank in range(num_ranks)]
        for p in procs:
            p.start()
        result, errors = None, []
        received = False
        try:
            # Rank 0 sends progress lines and the result; any rank may send an error first.
            while not received and not errors:
                if queue.empty():
                    if not any(p.is_alive() for p in procs) and queue.empty():
                        errors.append("bench processes exited without a result (exit codes "
                                      f"{[p.exitcode for p in procs]})")
                        break
                    time.sleep(0.02)
                    continue
                kind, payload = queue.get()
                if kind == "progress":
                    progress.say(payload)
                elif kind == "result":
                    result, received = payload, True
                else:
                    errors.append(payload)
        finally:
            if errors:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
            for p in procs:
                p.join(timeout=30)
    del queue  # its locks are released now, not reported as leaked at exit
    if errors:
        raise SystemExit("error: a bench rank failed:\n" + errors[0])
    return result


def _gloo_worker(rank: int, num_ranks: int, body: Callable[..., Any], args: tuple,
                 setup: Optional[Callable[[], None]], init_method: str, threads: int, queue) -> None:
    import torch.distributed as dist

    try:
        if setup is not None:
            setup()
        torch.set_num_threads(threads)
        progress = Progress("", sink=lambda line: queue.put(("progress", line)), enabled=rank == 0)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=num_ranks,
                                timeout=datetime.timedelta(seconds=300))
        result = body(rank, progress, *args)
        if rank == 0:
            queue.put(("result", result))
    except BaseException:
        # Report at once, and leave the process group alone: peers may be waiting in a collective
        # (destroying it could wait for them); the parent terminates every process.
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        return
    dist.destroy_process_group()
    # Everything is delivered (the queue writes synchronously); skip the interpreter's teardown,
    # which takes seconds here with torch and gloo loaded, while the parent waits to print.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _cpu_passes(rank: int, progress: Progress, cfg: BenchConfig, works: List[Workload]) -> list:
    """Every pass of ``works`` on this rank; on rank 0 each pass's gathered results."""
    import torch.distributed as dist

    progress.say(f"rank {rank}: process group ready ({cfg.num_ranks} ranks)")
    passes = []
    for work in works:
        step = progress if work.name == "logical" else progress.child(work.name)
        passes.append(_cpu_pass(work, rank, dist.group.WORLD, step))
    return passes


def _cpu_pass(work: Workload, rank: int, group, progress: Progress) -> Optional[List[Dict[str, Any]]]:
    """One pass on this rank; rank 0 returns every rank's `RankSession.result`."""
    import torch.distributed as dist

    from ..buffer import ElasticBuffer

    cfg = work.run_cfg
    expected = None
    if cfg.check:
        inputs = [work.inputs(s) for s in range(cfg.num_ranks)]
        expected = reference_outputs(cfg, inputs, ranks=[rank])[rank]
        del inputs
        progress.say(f"rank {rank}: reference computed")
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=cfg.max_tokens, hidden=cfg.hidden, num_topk=cfg.top_k,
                           use_fp8_dispatch=cfg.fp8, explicitly_destroy=True, device="cpu")
    try:
        sess = RankSession(work, rank, buffer, torch.device("cpu"), lambda: dist.barrier(group), HostClock(),
                           progress, expected)
        sess.first_calls()
        sess.timed_loop()
        sess.checked_iteration()
        result = sess.result()
    finally:
        buffer.destroy()
    gathered = [None] * cfg.num_ranks if rank == 0 else None
    dist.gather_object(result, gathered, dst=0, group=group)
    return gathered
