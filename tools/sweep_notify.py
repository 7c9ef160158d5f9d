"""The notify kernel's grouping, swept on one GPU (EP=1 through NCCL).

For each token count, grid cap (groups at most) and pairs-per-group value: the groups it gives, the
device time of the notify kernel (with its layout stage) and of all the call's kernels together
(notify and data; torch.profiler, medians over ``--calls`` full dispatches without CPU sync), and
the time of a synchronised full dispatch with CPU sync (median; until the device is done, and until
the call returns: its host time). Every setting's outputs and handle (numbering, layout words, the
handle's copy of the routing, the host's readback of the counts, the cumulative stats), allocated
poisoned, with and without CPU sync and in the expanded layout, are compared bit for bit with those
of the default grouping; the names of those that differ are printed.

``--expand`` times expanded calls instead (alignment 1).

Usage: python tools/sweep_notify.py [--expand] [--tokens 128,4096] [--pairs 16,32,64,128,256,512]
       [--caps 64,128,256,528] [--calls 20] [--hidden 7168] [--experts 256] [--topk 8]
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import deep_ep
from deep_ep.backends import outputs
from deep_ep.backends.gpu import NOTIFY_GROUPS_PER_SM
from deep_ep.backends.gpu import dispatch as gpu_dispatch
from deep_ep.backends.gpu import modules
from deep_ep.bench.gpu_timing import single_rank_nccl_group, spin_up
from tune_gpu import bit_equal


NAMES = ("recv_x", "recv_topk_idx", "recv_topk_weights", "dst_buffer_slot_idx", "layout words", "handle topk_idx",
         "recv_src_metadata", "handle words (layout, pos_tok, pos_pair, metadata)", "readback", "stats")
MODES = ("sync", "no sync", "expanded")   # the calls compared: see `_snapshots`
KERNELS = (modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL)   # a fresh dispatch's


def _snapshot(call) -> list:
    """The outputs and handle tensors of ``call()`` (which returns them and its cumulative stats),
    every output allocated poisoned (words no kernel writes compare equal)."""
    with outputs.poisoned():
        (recv_x, recv_idx, recv_w, handle, _), stats = call()
    readback = torch.tensor([handle.num_recv_tokens, handle.num_expanded_tokens,
                             *handle.num_recv_tokens_per_expert_list], dtype=torch.int64)
    return [None if t is None else t.clone()
            for t in (recv_x, recv_idx, recv_w, handle.dst_buffer_slot_idx, handle.backend_state.layout,
                      handle.topk_idx, handle.recv_src_metadata, handle.backend_state.words, readback, stats)]


def _snapshots(buf, x, idx, w, experts: int) -> dict:
    """`_snapshot` of a dispatch with CPU sync, one without (worst-case outputs; no readback), and an
    expanded one with an alignment of 4 (pos_pair, padding), each with fresh cumulative stats."""
    T = int(x.shape[0])
    kwargs = {"sync": {}, "no sync": {"do_cpu_sync": False, "num_max_tokens_per_rank": T},
              "expanded": {"do_expand": True, "expert_alignment": 4}}

    def call(kw):
        stats = torch.zeros(experts, dtype=torch.int32, device=x.device)
        return buf.dispatch(x, idx, w, num_experts=experts, cumulative_local_expert_recv_stats=stats, **kw), stats
    return {m: _snapshot(lambda: call(kwargs[m])) for m in MODES}


def _differ(want: dict, got: dict) -> list:
    """``"mode: name"`` of every tensor that differs between two `_snapshots`."""
    out = []
    for m in MODES:
        for n, u, v in zip(NAMES, want[m], got[m]):
            if (u is None) != (v is None) or (u is not None and not bit_equal(u, v)):
                out.append(f"{m}: {n}")
    return out


def _kernel_medians(fn, calls: int, names: tuple) -> dict:
    """Median device time (us) of each kernel in ``names`` over ``calls`` synchronised calls of ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(prefix="deep_ep_sweep_"), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    os.remove(path)
    found = {n: [e["dur"] for e in events if e.get("cat") == "kernel" and e.get("name") == n] for n in names}
    return {n: (statistics.median(v) if v else float("nan")) for n, v in found.items()}


def _call_us(fn, calls: int) -> tuple:
    """Medians over ``calls`` synchronised calls of ``fn``: ``(until the device is done, until fn
    returns)``, us."""
    times, host = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
        host.append((t1 - t0) * 1e6)
    return statistics.median(times), statistics.median(host)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="128,4096")
    p.add_argument("--pairs", default="16,32,64,128,256,512")
    p.add_argument("--caps", default="64,128,256,528")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--expand", action="store_true", help="time expanded calls")
    a = p.parse_args()
    tokens = [int(v) for v in a.tokens.split(",")]
    dev = torch.device("cuda", 0)
    group = single_rank_nccl_group(dev)
    default_pairs = gpu_dispatch.NOTIFY_PAIRS_PER_GROUP
    inputs = {}
    for T in tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn((T, a.hidden), device=dev, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(a.experts, device=dev, generator=g)[:a.topk] for _ in range(T)])
        # masked slots (-1) and, every 37th token, none at all: rows that are numbered -1 or skipped
        idx[torch.rand(idx.shape, device=dev, generator=g) < 0.1] = -1
        idx[::37] = -1
        w = torch.rand((T, a.topk), device=dev, generator=g)
        inputs[T] = (x, idx, w)

    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max(tokens), hidden=a.hidden, num_topk=a.topk,
                                explicitly_destroy=True)
    backend = buf._backend
    default_cap = backend.notify_groups_max
    print(f"default: {default_pairs} pairs per group, at most {default_cap} groups "
          f"({NOTIFY_GROUPS_PER_SM} per SM, {backend.num_device_sms} SMs)")
    print(f"{'tokens':>6} {'cap':>6} {'pairs':>5} {'groups':>6} {'notify us':>9} {'kernels us':>10} "
          f"{'call us':>8} {'host us':>8}  same")
    try:
        reference = {T: _snapshots(buf, *inputs[T], a.experts) for T in tokens}   # the default grouping
        for T in tokens:
            x, idx, w = inputs[T]

            def sync_call():
                return buf.dispatch(x, idx, w, num_experts=a.experts, do_expand=a.expand)

            def no_sync_call():
                return buf.dispatch(x, idx, w, num_experts=a.experts, do_cpu_sync=False,
                                    num_max_tokens_per_rank=T, do_expand=a.expand)

            seen = set()
            settings = [(default_cap, default_pairs)] + [(int(c), int(q)) for c in a.caps.split(",")
                                                         for q in a.pairs.split(",")]
            for cap, pairs in settings:   # the default grouping first
                backend.set_notify_groups_max(cap)
                gpu_dispatch.NOTIFY_PAIRS_PER_GROUP = pairs
                groups = gpu_dispatch.notify_groups(T, a.topk, backend.notify_groups_max)
                if groups in seen:
                    continue
                seen.add(groups)
                differ = _differ(reference[T], _snapshots(buf, x, idx, w, a.experts))
                for _ in range(3):
                    no_sync_call()
                spin_up()
                k = _kernel_medians(no_sync_call, a.calls, KERNELS)
                spin_up()
                call, host = _call_us(sync_call, a.calls)
                print(f"{T:6d} {backend.notify_groups_max:6d} {pairs:5d} {groups:6d} "
                      f"{k[modules.NOTIFY_KERNEL]:9.1f} {sum(k.values()):10.1f} {call:8.1f} {host:8.1f}  "
                      f"{'yes' if not differ else 'NO: ' + ', '.join(differ)}",
                      flush=True)
    finally:
        gpu_dispatch.NOTIFY_PAIRS_PER_GROUP = default_pairs
        buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
