"""Small helpers shared by tests that watch processes: resident memory, waiting for a set of
subprocesses with a limit, and running a function on several gloo ranks with a deadline (a hang
fails the test instead of blocking the run)."""
from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

PG_TIMEOUT = 60          # the process group's own timeout: a buffer's timeouts must act long before it


def rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def communicate_all(procs: list, timeout: float, hang_message: str) -> list:
    """``(stdout, stderr)`` of every ``subprocess.Popen`` in ``procs``; kills them all and fails the
    test with ``hang_message`` if one runs past ``timeout`` seconds."""
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(hang_message)
    return outs


def case_log(line: str) -> None:
    """Append ``line`` to $DEEP_EP_CASE_LOG (if set) and flush: a trail of a device run's tests that
    survives a crashed process (tools/device_suite.sh sets it)."""
    path = os.environ.get("DEEP_EP_CASE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _entry(fn, rank, world_size, init_file, queue, args, leave_together=True):
    """Process body: init gloo, run ``fn``, report ``(rank, 'ok', result)`` or the traceback."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=PG_TIMEOUT))
        result = fn(rank, world_size, *args)
        if leave_together:
            dist.barrier()   # a rank tearing gloo down while a peer still talks can abort
        # Drop every reference to the process group the body left behind (buffers, handles, autograd
        # graphs) before the group goes: one destructed at interpreter teardown can abort the process.
        gc.collect()
        if "deep_ep.buffer" in sys.modules:
            sys.modules["deep_ep.buffer"]._release_live_buffers()
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_gloo_ranks(fn, world_size, tmp_path, *args, deadline=120.0, leave_together=True):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes, each in a gloo process
    group (initialised before ``fn``, destroyed after); returns ``fn``'s results by rank. ``fn``
    must be a module-level function (spawn pickles it).

    Fails (and kills the processes) if any rank raises, exits non-zero or is still running after
    ``deadline`` seconds. ``leave_together``: the ranks meet in a gloo barrier after ``fn`` (False for
    tests whose ranks leave the process group unusable on purpose)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = tmp_path / f"init-{fn.__name__}-{time.monotonic_ns()}"
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, str(init), queue, args, leave_together))
             for r in range(world_size)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    results, errors = {}, []
    while len(results) + len(errors) < world_size and time.monotonic() < end:
        try:
            rank, status, value = queue.get(timeout=0.5)
        except Exception:  # queue.Empty
            if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                time.sleep(0.5)
                if queue.empty():
                    break
            continue
        (results.__setitem__(rank, value) if status == "ok" else errors.append(f"rank {rank}:\n{value}"))
    for p in procs:
        p.join(timeout=max(0.1, end - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in hung:
        procs[i].kill()
        procs[i].join()
    assert not errors, "\n".join(errors)
    assert not hung, f"ranks {hung} still running after {deadline} s (hang)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results
