"""One eager call at a time, traced: where the wall time of a dispatch / combine goes (EP=1, one GPU).

For each call kind (full dispatch with and without CPU sync, cached dispatch, combine) at the given
size: a few warm calls, then ``--calls`` calls, each after a device sync, under torch.profiler (CPU
and CUDA). Prints, per call, every host-side event inside it (torch ops, CUDA runtime and driver
calls) and every kernel and copy it queued, with its start relative to the call's start and its
duration, in microseconds; then the medians per kind. Then a cProfile of each kind (50 calls,
synchronised), by cumulative time, with --cprofile. Writes the Chrome trace to ``--trace`` if given.

Usage: python tools/trace_calls.py [--tokens 4096] [--calls 3] [--trace trace.json] [--cprofile]
"""
import argparse
import cProfile
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import deep_ep
from deep_ep.bench.gpu_timing import single_rank_nccl_group
from profile_gpu import call_kinds, print_profile   # tools/ is the script's directory


def _timeline(trace: dict, names: list) -> None:
    """Print each ``call i: <kind>`` range of the Chrome trace with its host events and device work,
    then the medians per kind of ``names``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    calls = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("call ")),
                   key=lambda e: e["ts"])
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    per_kind: dict = {}
    for i, c in enumerate(calls):
        # Calls are separated by device syncs: a call's device work is what runs before the next starts.
        t0, t1 = c["ts"], c["ts"] + c["dur"]
        t_next = calls[i + 1]["ts"] if i + 1 < len(calls) else float("inf")
        kind = c["name"].split(": ", 1)[1]
        print(f"--- {c['name']}  host {c['dur']:.1f} us")
        inside = [e for e in events if t0 <= e["ts"] <= t1 and e.get("tid") == c.get("tid") and (
            e.get("cat") in ("cuda_runtime", "cuda_driver") or (e.get("cat") == "cpu_op" and e["dur"] >= 3))]
        for e in sorted(inside, key=lambda e: e["ts"]):
            print(f"  h +{e['ts'] - t0:7.1f} {e['dur']:7.1f} {e.get('cat')[:8]:8s} {e['name'][:60]}")
        end = None
        for e in sorted((e for e in device if t0 <= e["ts"] < t_next), key=lambda e: e["ts"]):
            end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
            print(f"  d +{e['ts'] - t0:7.1f} {e['dur']:7.1f} {e.get('cat')[:8]:8s} {e['name'][:60]}")
        if end is not None:
            print(f"  last device work ends at +{end - t0:.1f} us")
            per_kind.setdefault(kind, []).append((c["dur"], end - t0))
    print("===== medians per call kind: host time, end of its last device work (us, from the call's start)")
    for kind in names:
        v = per_kind.get(kind, [])
        if v:
            print(f"  {kind:30s} host {statistics.median(h for h, _ in v):8.1f}   "
                  f"device done {statistics.median(d for _, d in v):8.1f}")


def main() -> None:
    """Parse the arguments, time and trace each call kind, print the results."""
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--trace", default="", help="where to write the Chrome trace (default: a temporary file)")
    p.add_argument("--cprofile", action="store_true", help="also a cProfile of each call kind")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    group = single_rank_nccl_group(dev)
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=a.tokens, hidden=a.hidden, num_topk=a.topk,
                                explicitly_destroy=True)
    calls = call_kinds(buf, dev, a.tokens, a)
    for _, f in calls:
        for _ in range(5):
            f()
    torch.cuda.synchronize()
    # Plain synchronised wall time per call, without any profiler.
    print(f"===== T={a.tokens}: synchronised calls, no profiler (median of 20, us): host / until the device is done")
    for name, f in calls:
        hs, ss = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            hs.append((t1 - t0) * 1e6)
            ss.append((t2 - t0) * 1e6)
        print(f"  {name:30s} {statistics.median(hs):8.1f} {statistics.median(ss):8.1f}")
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, f in calls:
            for i in range(a.calls):
                torch.cuda.synchronize()
                with record_function(f"call {i}: {name}"):
                    f()
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = a.trace or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            _timeline(json.load(fh), [n for n, _ in calls])
    if a.cprofile:
        for name, f in calls:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                f()
                torch.cuda.synchronize()
            pr.disable()
            print_profile(pr, f"{name}: cProfile of 50 synchronised calls, by cumulative time", "cumulative", 35)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
