"""The notify kernel's grouping, swept on one GPU (EP=1 through NCCL).

For each token count, grid cap (groups at most) and pairs-per-group value: the groups it
gives, the device time of ``deep_ep_notify`` (with its layout stage; torch.profiler, median over
``--calls`` full dispatches without CPU sync), and the time of a synchronised full dispatch with
CPU sync (median). Every setting's outputs and handle (numbering, layout words, the handle's copy
of the routing), allocated poisoned, are compared bit for bit with those of the library's default
grouping; the names of those that differ are printed.

Usage: python tools/sweep_notify.py [--tokens 128,4096] [--pairs 16,32,64,128,256,512]
       [--caps 64,128,256,528] [--calls 20] [--hidden 7168] [--experts 256] [--topk 8]
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import deep_ep
from deep_ep.backends import outputs
from deep_ep.backends.gpu import NOTIFY_GROUPS_PER_SM
from deep_ep.backends.gpu import dispatch as gpu_dispatch
from deep_ep.bench.gpu_timing import single_rank_nccl_group, spin_up


NAMES = ("recv_x", "recv_topk_idx", "recv_topk_weights", "pos_tok", "layout words", "handle topk_idx",
         "recv_src_metadata")


def _snapshot(call) -> list:
    """The outputs and handle tensors of ``call()``, every output allocated poisoned (words no
    kernel writes compare equal)."""
    with outputs.poisoned():
        recv_x, recv_idx, recv_w, handle, _ = call()
    return [t.clone() for t in (recv_x, recv_idx, recv_w, handle.dst_buffer_slot_idx, handle.backend_state.layout,
                                handle.topk_idx, handle.recv_src_metadata)]


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


def _call_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="128,4096")
    p.add_argument("--pairs", default="16,32,64,128,256,512")
    p.add_argument("--caps", default="64,128,256,528")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    a = p.parse_args()
    tokens = [int(v) for v in a.tokens.split(",")]
    dev = torch.device("cuda", 0)
    group = single_rank_nccl_group(dev)
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max(tokens), hidden=a.hidden, num_topk=a.topk)
    backend = buf._backend
    default_pairs, default_cap = gpu_dispatch.NOTIFY_PAIRS_PER_GROUP, backend.notify_groups_max
    print(f"default: {default_pairs} pairs per group, at most {default_cap} groups "
          f"({NOTIFY_GROUPS_PER_SM} per SM, {backend.num_device_sms} SMs)")
    print(f"{'tokens':>6} {'cap':>6} {'pairs':>5} {'groups':>6} {'notify us':>9} {'call us':>8}  same")
    for T in tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn((T, a.hidden), device=dev, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(a.experts, device=dev, generator=g)[:a.topk] for _ in range(T)])
        w = torch.rand((T, a.topk), device=dev, generator=g)

        def sync_call():
            return buf.dispatch(x, idx, w, num_experts=a.experts)

        def no_sync_call():
            return buf.dispatch(x, idx, w, num_experts=a.experts, do_cpu_sync=False, num_max_tokens_per_rank=T)

        gpu_dispatch.NOTIFY_PAIRS_PER_GROUP = default_pairs
        backend.set_notify_groups_max(default_cap)
        want = _snapshot(sync_call)
        seen = set()
        for cap in (int(v) for v in a.caps.split(",")):
            backend.set_notify_groups_max(cap)
            for pairs in (int(v) for v in a.pairs.split(",")):
                gpu_dispatch.NOTIFY_PAIRS_PER_GROUP = pairs
                groups = gpu_dispatch.notify_groups(T, a.topk, backend.notify_groups_max)
                if groups in seen:
                    continue
                seen.add(groups)
                got = _snapshot(sync_call)
                differ = [n for n, u, v in zip(NAMES, want, got) if not torch.equal(u, v)]
                for _ in range(3):
                    no_sync_call()
                spin_up()
                k = _kernel_medians(no_sync_call, a.calls, ("deep_ep_notify",))
                spin_up()
                call = _call_us(sync_call, a.calls)
                print(f"{T:6d} {backend.notify_groups_max:6d} {pairs:5d} {groups:6d} {k['deep_ep_notify']:9.1f} "
                      f"{call:8.1f}  {'yes' if not differ else 'NO: ' + ', '.join(differ)}", flush=True)
    gpu_dispatch.NOTIFY_PAIRS_PER_GROUP = default_pairs
    backend.set_notify_groups_max(default_cap)
    buf.destroy()


if __name__ == "__main__":
    main()
