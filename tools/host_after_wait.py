"""Host time of a call right after the host waited for the device, against the same call after a
short wait: does a long device wait make the next call's host work slower? (The expanded layout's
calls, whose kernels run 4x longer than the non-expanded ones, showed twice the host time in the
bench's synchronised samples with the same host code.)

For the cached dispatch and combine, expanded and not, at DeepSeek-V3 shapes (EP=1 through NCCL),
and for a plain torch launch (an in-place add on a tensor of the dispatch's size), prints the median
host time of one call (us) in three settings: after ``stream.synchronize()`` of the previous call
(the bench's way), after the same plus a host spin of 300 us, and back to back without a wait.

Usage: python tools/host_after_wait.py [--samples 50]
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import deep_ep
from deep_ep import routing
from deep_ep.bench.gpu_timing import single_rank_nccl_group


def host_us(fn, samples: int, mode: str) -> float:
    stream = torch.cuda.current_stream()
    out, times = fn(), []
    for _ in range(samples):
        if mode != "b2b":
            stream.synchronize()
        if mode == "spin":
            t = time.perf_counter() + 300e-6
            while time.perf_counter() < t:
                pass
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    del out
    stream.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=50)
    a = p.parse_args()
    preset = routing.get_preset("deepseek-v3")
    T, H, E, K = 4096, preset.hidden, preset.num_experts, preset.top_k
    dev = torch.device("cuda", 0)
    group = single_rank_nccl_group(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    idx = torch.argsort(torch.rand((T, E), device=dev, generator=g), dim=1)[:, :K].contiguous()
    w = torch.rand((T, K), device=dev, generator=g)
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
    modes = ("sync", "spin", "b2b")
    print(f"median host time of one call, us ({a.samples} samples): " + " / ".join(modes))
    try:
        for expand in (False, True):
            opts = dict(do_expand=True, do_zero_padding=True) if expand else {}
            recv, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E, **opts)
            y = (recv.float() * 0.5).to(torch.bfloat16)
            big = torch.empty_like(recv)
            rows = [("cached dispatch", lambda: buf.dispatch(x, topk_weights=w, handle=handle, **opts)),
                    ("combine", lambda: buf.combine(y, handle)),
                    ("torch add_ on recv_x's size", lambda: big.add_(1))]
            for name, fn in rows:
                print(f"  {'expanded' if expand else 'non-expanded':12s} {name:30s} " +
                      " / ".join(f"{host_us(fn, a.samples, m):6.1f}" for m in modes), flush=True)
    finally:
        buf.destroy()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
