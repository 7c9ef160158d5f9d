"""Why do the expanded calls take twice the host time of the non-expanded ones in the bench's
back-to-back loop (cached dispatch about 39 against 22 us per call on the H200) when their host code
is the same? Times, in one process, at DeepSeek-V3 shapes (EP=1 through NCCL):

* ``torch.empty`` of the non-expanded and the expanded dispatch's received rows (58.7 / 469.8 MB),
  each dropped before the next, as the bench's loop drops each call's outputs;
* the cached dispatch and combine of both layouts, back to back (the bench's ``b2b_host``: host
  seconds per call over a loop of ``--calls``, the best of ``--rounds``), and the same with every
  call's outputs kept until the loop ends (no frees inside the loop);
* a torch ``add_`` on a tensor of each size, back to back (a plain launch while the GPU is busy for
  as long as the dispatch keeps it busy).

Usage: python tools/host_by_size.py [--calls 20] [--rounds 5]
"""
import argparse
import time

import torch
import torch.distributed as dist

import deep_ep
from deep_ep import routing
from deep_ep.bench.gpu_timing import single_rank_nccl_group


def per_call_us(fn, calls: int, rounds: int, keep: bool = False) -> float:
    """Best over ``rounds`` of the host time per call of ``calls`` back-to-back calls, in us."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        kept = []
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
            if keep:
                kept.append(out)
        t1 = time.perf_counter()
        del out, kept
        best = min(best, (t1 - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    preset = routing.get_preset("deepseek-v3")
    T, H, E, K = 4096, preset.hidden, preset.num_experts, preset.top_k
    group = single_rank_nccl_group(dev)
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand((T, E), device=dev, generator=g).topk(K, dim=1).indices
    w = torch.rand((T, K), device=dev, generator=g)
    c, r = a.calls, a.rounds
    print(f"host us per call, back to back, best of {r} loops of {c} (EP=1, T={T}, hidden {H}, top-{K} of {E})")
    for rows, label in ((T, "58.7 MB"), (T * K, "469.8 MB")):
        us = per_call_us(lambda: torch.empty((rows, H), dtype=torch.bfloat16, device=dev), c, r)
        print(f"  torch.empty {label:10s} {us:7.1f}")
        t = torch.empty((rows, H), dtype=torch.bfloat16, device=dev)
        print(f"  add_ on {label:14s} {per_call_us(lambda: t.add_(1), c, r):7.1f}")
    for expand in (False, True):
        recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E, do_expand=expand)
        y = recv_x.clone()
        name = "expanded" if expand else "non-expanded"
        for keep in (False, True):
            tag = " (outputs kept)" if keep else ""
            us = per_call_us(lambda: buf.dispatch(x, handle=handle), c, r, keep)
            print(f"  {name} cached dispatch{tag:16s} {us:7.1f}")
            us = per_call_us(lambda: buf.combine(y, handle), c, r, keep)
            print(f"  {name} combine{tag:24s} {us:7.1f}")
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
