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

__all__ = ["run_cpu"]


def run_cpu(cfg: BenchConfig, works: Sequence[Workload], progress: Progress,
            worker_setup: Optional[Callable[[], None]] = None) -> List[Dict[str, Any]]:
    """Run every pass of ``works`` on ``cfg.num_ranks`` gloo processes; returns one dict per pass:
    ``{"name", "rows", "mismatches", "checked", "floors": {}, "baselines": {}}``.

    ``worker_setup``: a picklable no-argument function each process calls first (tests use it to
    alter the CPU backend inside the processes).

    Raises:
        SystemExit: a rank failed (its traceback in the message) or the processes died.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    threads = max(1, (os.cpu_count() or 1) // cfg.num_ranks)
    progress.say(f"starting {cfg.num_ranks} gloo processes")
    with tempfile.TemporaryDirectory(prefix="deep_ep_bench_") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_cpu_worker, args=(rank, cfg, list(works), init_method, threads, queue,
                                                       worker_setup), daemon=True)
                 for rank in range(cfg.num_ranks)]
        for p in procs:
            p.start()
        passes, errors = None, []
        try:
            # Rank 0 sends progress lines and the result; any rank may send an error first.
            while passes is None and not errors:
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
                    passes = payload
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
    out = []
    for work, results in zip(works, passes):
        out.append({"name": work.name, "rows": [rank_row(work.run_cfg, r) for r in results],
                    "mismatches": [m for r in results for m in r["mismatches"]],
                    "checked": results[0]["checked"], "floors": {}, "baselines": {}})
    return out


def _cpu_worker(rank: int, cfg: BenchConfig, works: List[Workload], init_method: str, threads: int, queue,
                worker_setup) -> None:
    import torch.distributed as dist

    try:
        if worker_setup is not None:
            worker_setup()
        torch.set_num_threads(threads)
        progress = Progress("", sink=lambda line: queue.put(("progress", line)), enabled=rank == 0)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=cfg.num_ranks,
                                timeout=datetime.timedelta(seconds=300))
        progress.say(f"rank {rank}: process group ready ({cfg.num_ranks} ranks)")
        passes = []
        for work in works:
            step = progress if work.name == "logical" else progress.child(work.name)
            passes.append(_cpu_pass(work, rank, dist.group.WORLD, step))
        if rank == 0:
            queue.put(("result", passes))
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
