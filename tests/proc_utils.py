"""Small helpers shared by tests that watch processes: resident memory, and waiting for a set of
subprocesses with a limit (a hang fails the test instead of blocking the run)."""
from __future__ import annotations

import os
import subprocess

import pytest


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
