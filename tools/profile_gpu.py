"""Where the time of a dispatch / combine goes, on one GPU (EP=1 through NCCL, or emulated ranks).

Prints (1) the host-side profile (cProfile) of cached dispatches and combines, (2) every kernel's
device time from torch.profiler, for the DeepSeek-V3 shapes and a decode batch, and (3) the time of
cached dispatch and combine replayed from CUDA graphs (no host work in the loop).

Usage: python tools/profile_gpu.py [--tokens 4096] [--decode-tokens 128] [--iters 50]
"""
import argparse
import cProfile
import io
import os
import pstats
import tempfile

import torch
import torch.distributed as dist

import deep_ep


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=a.tokens, hidden=a.hidden,
                                num_topk=a.topk, explicitly_destroy=True)
    for T, label in ((a.tokens, "prefill"), (a.decode_tokens, "decode")):
        for expand in (False, True):
            x = torch.randn((T, a.hidden), device=dev).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(a.experts, device=dev)[:a.topk] for _ in range(T)])
            w = torch.rand((T, a.topk), device=dev)
            recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=a.experts, do_expand=expand)
            y = recv_x.clone()
            tag = f"{label} T={T} {'expanded' if expand else 'non-expanded'}"
            for _ in range(3):
                buf.dispatch(x, handle=handle)
                buf.combine(y, handle)
            torch.cuda.synchronize()
            # (1) host profile
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.iters):
                buf.dispatch(x, handle=handle)
                buf.combine(y, handle)
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
            print(f"===== {tag}: host profile of {a.iters} x (cached dispatch + combine)")
            print("\n".join(s.getvalue().splitlines()[:45]))
            # (2) kernel times
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    buf.dispatch(x, idx, w, num_experts=a.experts, do_expand=expand)
                    buf.dispatch(x, handle=handle)
                    buf.combine(y, handle)
                torch.cuda.synchronize()
            print(f"===== {tag}: device time per kernel (10 x full dispatch, cached dispatch, combine)")
            for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0)):
                t = getattr(e, "self_device_time_total", 0)
                if t > 0:
                    print(f"  {e.key[:60]:60s} calls {e.count:4d}  avg {t / max(e.count, 1):9.1f} us")
            # (3) graphs
            from deep_ep.bench_gpu import graph_time_us
            for name, fn in (("cached dispatch", lambda: buf.dispatch(x, handle=handle)),
                             ("combine", lambda: buf.combine(y, handle))):
                us = graph_time_us(fn, a.iters, lambda: None)
                print(f"===== {tag}: {name} from a CUDA graph: " + ("capture failed" if us is None else f"{us:.1f} us per call"))
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
