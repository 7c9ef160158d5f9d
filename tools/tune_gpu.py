"""Build-time variants of the data kernels, timed side by side on one GPU (EP=1 through NCCL).

Each variant adds build-time tunables to the kernel modules (`deep_ep.backends.gpu.modules.TUNABLES`,
passed as ``DEEP_EP_KERNEL_DEFINES``; their defaults are in include/deep_ep/common/tunables.cuh),
sets THREADS, the threads per block of the data kernels (`deep_ep.backends.gpu.modules.THREADS`), or
COOPERATIVE (0: plain launches). For every variant and batch size it prints the CUDA-graph replay time of a cached dispatch and a combine, their ratio to the
bench's floor (`deep_ep.bench.gpu_timing.floor_us`), and whether the outputs equal the default build's
bit for bit (they must: the variants change how bytes move, not which; the comparison covers the received
rows of a bf16 dispatch without weights, and the combined rows).

The shapes are a model preset's (`deep_ep.routing.MODEL_PRESETS`, as the bench's ``--model``;
default DeepSeek-V3), or --hidden/--experts/--topk, which override the preset's. ``--expand`` times
the expanded layout (one row per (token, expert), do_zero_padding, alignment 1). The floor is the
bench's (`deep_ep.bench.gpu_timing.floor_us`: the slower of a copy with the dispatch's traffic and a
fill of the rows it writes); both parts are printed.

Usage: python tools/tune_gpu.py [--model qwen3-235b-a22b] [--tokens 4096,128] [--iters 50] [--expand]
       [--variants "SEND_UNROLL=16;LOAD_NO_L1=1"]
"""
import argparse
import os

import torch
import torch.distributed as dist

import deep_ep
from deep_ep import routing
from deep_ep.backends import gpu
from deep_ep.backends.gpu import modules
from deep_ep.bench.gpu_timing import floor_us, graph_time_us, single_rank_nccl_group

DEFAULT_VARIANTS = ("", "SEND_UNROLL=16", "THREADS=256", "THREADS=256,SEND_UNROLL=16",
                    "THREADS=1024,SEND_UNROLL=4,COMBINE_UNROLL=2", "THREADS=1024,SEND_UNROLL=4",
                    "LOAD_NO_L1=1,STORE_STREAMING=1")


def parse_variant(text: str) -> dict:
    """``"SEND_UNROLL=16,LOAD_NO_L1=1"`` -> ``{"EP_SEND_UNROLL": 16, "EP_LOAD_NO_L1": 1}``."""
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, value = item.split("=")
        out["EP_" + name.strip().upper()] = int(value)
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (NaN words, such as the test poison's,
    compare equal to themselves; ``torch.equal`` says they differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="4096,128")
    p.add_argument("--model", default="deepseek-v3", choices=sorted(routing.MODEL_PRESETS))
    p.add_argument("--hidden", type=int, default=None, help="default: the model's")
    p.add_argument("--experts", type=int, default=None, help="default: the model's")
    p.add_argument("--topk", type=int, default=None, help="default: the model's")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--expand", action="store_true", help="the expanded layout (do_expand, zero padding)")
    p.add_argument("--variants", default=";".join(DEFAULT_VARIANTS), help="';'-separated; '' = default build")
    a = p.parse_args()
    preset = routing.get_preset(a.model)
    a.hidden = a.hidden or preset.hidden
    a.experts = a.experts or preset.num_experts
    a.topk = a.topk or preset.top_k
    for text in a.variants.split(";"):   # a malformed variant fails before anything runs
        unknown = set(parse_variant(text)) - modules.TUNABLES - {"EP_THREADS", "EP_COOPERATIVE"}
        if unknown:
            raise SystemExit(f"--variants: {sorted(unknown)} are not tunables of {sorted(modules.TUNABLES)} "
                             f"(nor THREADS / COOPERATIVE)")
    dev = torch.device("cuda", 0)
    group = single_rank_nccl_group(dev)
    sizes = [int(t) for t in a.tokens.split(",")]
    base_threads, base_defines = modules.THREADS, os.environ.get("DEEP_EP_KERNEL_DEFINES", "")
    base_cooperative = gpu.COOPERATIVE
    inputs = {}
    for T in sizes:
        g = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn((T, a.hidden), device=dev, generator=g).to(torch.bfloat16)
        idx = torch.argsort(torch.rand((T, a.experts), device=dev, generator=g), dim=1)[:, :a.topk].contiguous()
        inputs[T] = (x, idx)
    # The bench's floor (`floor_us`): the slower of a copy with the dispatch's traffic and a fill of
    # the rows it writes; expanded, (tokens + pairs) / 2 rows each way and one row written per pair
    # (every id is valid and distinct here).
    floor_rows = {T: (T + T * a.topk) // 2 if a.expand else T for T in sizes}
    parts = {T: floor_us(floor_rows[T] * a.hidden * 2, (T * a.topk if a.expand else T) * a.hidden * 2, dev)
             for T in sizes}
    floors = {T: p["floor"] for T, p in parts.items()}
    # combine writes each token once: its floor is the copy (non-expanded, the same as the dispatch's;
    # expanded, a write of T rows is well below the copy of T * (K + 1) / 2 rows each way)
    combine_floors = {T: max(p["copy"], p["write"] if not a.expand else 0.0) for T, p in parts.items()}
    print("floor (the slower of a back-to-back D2D copy of the rows and a write of the output rows): " +
          ", ".join(f"T={T} dispatch {p['floor']:.1f} us (copy {p['copy']:.1f}, write {p['write']:.1f}), "
                    f"combine {combine_floors[T]:.1f} us" for T, p in parts.items()))
    opts = dict(do_expand=True, do_zero_padding=True) if a.expand else {}
    print(f"{'variant':40s} {'T':>5s} {'dispatch us':>11s} {'ratio':>6s} {'combine us':>10s} {'ratio':>6s}  same")
    reference = {}
    for text in a.variants.split(";"):
        extra = parse_variant(text)
        modules.THREADS = extra.pop("EP_THREADS", base_threads)  # threads per block of the data kernels
        gpu.COOPERATIVE = bool(extra.pop("EP_COOPERATIVE", base_cooperative))  # host side: launch kind
        os.environ["DEEP_EP_KERNEL_DEFINES"] = ",".join(f"{k}={v}" for k, v in extra.items())
        buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max(sizes), hidden=a.hidden,
                                    num_topk=a.topk, explicitly_destroy=True)
        try:
            for T in sizes:
                x, idx = inputs[T]
                recv_x, _, _, handle, _ = buf.dispatch(x, idx, num_experts=a.experts, **opts)
                y = (recv_x.float() * 0.5).to(torch.bfloat16)
                d_us = graph_time_us(lambda: buf.dispatch(x, handle=handle, **opts), a.iters, lambda: None) \
                    or float("nan")
                c_us = graph_time_us(lambda: buf.combine(y, handle), a.iters, lambda: None) or float("nan")
                got = (buf.dispatch(x, handle=handle, **opts)[0].clone(), buf.combine(y, handle)[0].clone())
                if T not in reference:
                    reference[T] = got
                same = all(bit_equal(u, v) for u, v in zip(got, reference[T]))
                f, cf = floors[T], combine_floors[T]
                print(f"{text or '(default)':40s} {T:5d} {d_us:11.1f} {d_us / f:6.2f} {c_us:10.1f} {c_us / cf:6.2f}  "
                      f"{'yes' if same else 'NO'}", flush=True)
        finally:
            buf.destroy()
    modules.THREADS, gpu.COOPERATIVE = base_threads, base_cooperative
    os.environ["DEEP_EP_KERNEL_DEFINES"] = base_defines
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
