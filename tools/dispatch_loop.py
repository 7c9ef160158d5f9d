"""Full dispatches (EP=1 through NCCL) in a loop, nothing else: a target for Nsight
Compute or compute-sanitizer, e.g.

    ncu --clock-control none -k regex:deep_ep_notify -s 5 -c 3 --section SpeedOfLight \
        --section WarpStateStats --section LaunchStats python3 tools/dispatch_loop.py --tokens 4096

Each call uses the DeepSeek-V3 shapes by default (hidden 7168, 256 experts, top-8) and random
routing made once; ``--no-sync`` passes ``do_cpu_sync=False``.

Usage: python tools/dispatch_loop.py [--tokens 4096] [--calls 10] [--hidden 7168] [--experts 256]
       [--topk 8] [--no-sync]
"""
import argparse

import torch
import torch.distributed

import deep_ep
from deep_ep.bench.gpu_timing import single_rank_nccl_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--no-sync", action="store_true")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    group = single_rank_nccl_group(dev)
    g = torch.Generator(device=dev).manual_seed(a.tokens)
    x = torch.randn((a.tokens, a.hidden), device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand((a.tokens, a.experts), device=dev, generator=g).argsort(1)[:, :a.topk].contiguous()
    w = torch.rand((a.tokens, a.topk), device=dev, generator=g)
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=a.tokens, hidden=a.hidden, num_topk=a.topk,
                                explicitly_destroy=True)
    kwargs = {"do_cpu_sync": False, "num_max_tokens_per_rank": a.tokens} if a.no_sync else {}
    try:
        for _ in range(a.calls):
            buf.dispatch(x, idx, w, num_experts=a.experts, **kwargs)
        torch.cuda.synchronize()
    finally:
        buf.destroy()
        torch.distributed.destroy_process_group()
    print(f"{a.calls} full dispatches of {a.tokens} tokens done")


if __name__ == "__main__":
    main()
