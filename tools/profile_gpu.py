"""Where the time of a dispatch / combine goes, on one GPU (EP=1 through NCCL, or emulated ranks).

Prints (0) the host cost of each piece of a cached call, timed alone in a loop, (1) the host-side profile (cProfile) of cached dispatches and combines, (2) every kernel's
device time from torch.profiler, for the DeepSeek-V3 shapes and a decode batch, and (3) the time of
cached dispatch and combine replayed from CUDA graphs (no host work in the loop).

Usage: python tools/profile_gpu.py [--tokens 4096] [--decode-tokens 128] [--iters 50]
       [--host-only: only (0)] [--host-profile: (0), then a cProfile of each call kind at the decode
       size: full dispatch with and without CPU sync, cached dispatch, combine]
"""
import argparse
import cProfile
import ctypes
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import deep_ep
from deep_ep.bench.gpu_timing import graph_time_us, single_rank_nccl_group


def _us(fn, n: int = 2000) -> float:
    """Median over 5 rounds of the mean host time of ``fn`` in microseconds (device work queued,
    not waited for, except between rounds)."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def _arg_structs(T: int):
    """The three argument structs a fresh dispatch builds, with plausible values."""
    from deep_ep.backends.gpu.abi import DispatchArgs, LayoutArgs, NotifyArgs, call_tag
    tag = call_tag(1, 14336, 0, 8, 0, 1, 256, 1, 1, 0)
    return (NotifyArgs(topk_idx=1, num_tokens=T, num_experts=256, tokens_per_group=4, counts_offset=64, pos_tok=2,
                       pos_pair=None, scratch=3, timeout_ns=10 ** 11, tag=tag),
            LayoutArgs(num_experts=256, alignment=1, counts_offset=64, layout=4, cumulative_stats=None,
                       out_capacity=T, tok_capacity=T, timeout_ns=10 ** 11, host_out=5, seq=1, err_host=6, tag=tag),
            DispatchArgs(x=1, sf=None, topk_idx=2, topk_weights=None, num_tokens=T, pos_tok=3, pos_pair=None,
                         out_x=4, out_sf=None, sf_ld=0, out_topk_idx=5, out_weights=None, src_meta=6, max_tokens=T,
                         out_capacity=T, tok_capacity=T, layout=7, num_experts=256, alignment=1, recv_offset=0,
                         half_bytes=1 << 20, row_stride=14400, timeout_ns=10 ** 11, err_host=8, tag=tag))


def _layout_views(handle):
    lay = handle.backend_state.layout
    return lay[0:8], lay[8:16], lay[16:24], lay[24:32], lay[32:40]


def host_pieces(buf, dev, a) -> None:
    """(0) The host time of a cached dispatch and a combine at the decode size, and of the pieces
    they are made of, each timed alone (so the pieces need not add up exactly)."""
    from deep_ep import checks, jit
    T = a.decode_tokens
    x = torch.randn((T, a.hidden), device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(a.experts, device=dev)[:a.topk] for _ in range(T)])
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, num_experts=a.experts)
    y = recv_x.clone()
    x8 = (x.to(torch.float8_e4m3fn), torch.rand((T, a.hidden // 128), device=dev))
    handle8 = buf.dispatch(x8, idx, num_experts=a.experts)[3]
    backend = buf._backend
    comm = backend.get_comm_stream()
    compute = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    mod = jit.build("profile_empty", 'extern "C" __global__ void empty_kernel(int a, void* p) {}')
    fn = mod.function("empty_kernel")
    pieces = [
        ("cached dispatch (whole call)", lambda: buf.dispatch(x, handle=handle)),
        ("combine (whole call)", lambda: buf.combine(y, handle)),
        ("cached FP8 dispatch, fp32 scales (whole call)", lambda: buf.dispatch(x8, handle=handle8)),
        ("cached FP8 dispatch, col-major scales (whole call)", lambda: buf.dispatch(
            x8, handle=handle8, use_tma_aligned_col_major_sf=True)),
        ("full dispatch, no CPU sync (whole call)", lambda: buf.dispatch(
            x, idx, num_experts=a.experts, do_cpu_sync=False, num_max_tokens_per_rank=T)),
        ("full dispatch, CPU sync (whole call, waits for the device)", lambda: buf.dispatch(
            x, idx, num_experts=a.experts)),
        ("checks.validate_dispatch (full)", lambda: checks.validate_dispatch(
            buf, x, idx, None, None, a.experts, T, None, 0, 0, None, None, False, False, None, True, False,
            False, False, False)),
        ("backend.dispatch (full, no CPU sync, no stream logic)", lambda: backend.dispatch(
            x, None, idx, None, num_experts=a.experts, num_max_tokens_per_rank=T, expert_alignment=1,
            num_sms=0, handle=None, do_handle_copy=True, do_cpu_sync=False, do_expand=False,
            do_zero_padding=False, use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=None)),
        ("checks.validate_dispatch (cached)", lambda: checks.validate_dispatch(
            buf, x, None, None, None, None, None, None, 0, 0, None, None, False, False, handle, True, None,
            False, False, False)),
        ("backend.dispatch (cached, no stream logic)", lambda: backend.dispatch(
            x, None, None, None, num_experts=None, num_max_tokens_per_rank=handle.num_max_tokens_per_rank,
            expert_alignment=None, num_sms=0, handle=handle, do_handle_copy=True, do_cpu_sync=False,
            do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False,
            cumulative_local_expert_recv_stats=None)),
        ("empty kernel launch (jit Function.launch, 2 args)", lambda: fn.launch(1, 32, (1, None), stream=comm)),
        ("empty kernel launch, cooperative (as the notify kernel)", lambda: fn.launch(
            1, 32, (1, None), stream=comm, cooperative=True)),
        ("NotifyArgs + LayoutArgs + DispatchArgs construction", lambda: _arg_structs(T)),
        ("the handle's five layout views (tensor slices)", lambda: _layout_views(handle)),
        ("torch.empty [T, hidden] bf16", lambda: torch.empty((T, a.hidden), dtype=torch.bfloat16, device=dev)),
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("comm.wait_stream(compute)", lambda: comm.wait_stream(compute)),
        ("torch.cuda.Event() + record(comm)", lambda: torch.cuda.Event().record(comm)),
        ("reused event record(comm)", lambda: ev.record(comm)),
        ("compute.wait_event(ev)", lambda: compute.wait_event(ev)),
        ("StreamJoin.wait (driver record + wait, used instead)", lambda: backend.stream_join.wait(
            comm.cuda_stream, compute.cuda_stream)),
        ("torch._C._cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(dev.index)),
        ("backend.module lookup", lambda: backend.module("dispatch", (a.hidden * 2, 0, a.topk, False))),
        ("backend.check_errors()", backend.check_errors),
    ]
    from deep_ep.cuda import driver as cuda_driver
    prepared = fn.prepare(1, 32, (ctypes.c_int(1), ctypes.c_void_p()), device=dev.index)
    pieces += [
        ("prepared launch of the empty kernel", lambda: prepared.launch(comm.cuda_stream)),
        ("enter_context + leave_context (already current)", lambda: cuda_driver.leave_context(
            cuda_driver.enter_context(dev.index))),
    ]
    print(f"===== host cost of the pieces of a cached call (T={T}, hidden {a.hidden}), microseconds")
    for name, f in pieces:
        print(f"  {name:55s} {_us(f):8.2f}")


def call_kinds(buf, dev, T: int, a) -> list:
    """The four kinds of call at ``T`` tokens (``a``: hidden, experts, topk), as ``(name, no-argument
    callable)``: full dispatch with and without CPU sync, cached dispatch, combine."""
    x = torch.randn((T, a.hidden), device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(a.experts, device=dev)[:a.topk] for _ in range(T)])
    w = torch.rand((T, a.topk), device=dev)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=a.experts)
    y = recv_x.clone()
    return [
        ("full dispatch, CPU sync", lambda: buf.dispatch(x, idx, w, num_experts=a.experts)),
        ("full dispatch, no CPU sync", lambda: buf.dispatch(x, idx, w, num_experts=a.experts, do_cpu_sync=False,
                                                             num_max_tokens_per_rank=T)),
        ("cached dispatch", lambda: buf.dispatch(x, handle=handle)),
        ("combine", lambda: buf.combine(y, handle, topk_weights=recv_w)),
    ]


def print_profile(pr: cProfile.Profile, title: str, key: str, n: int) -> None:
    """Print the ``n`` top rows of ``pr`` sorted by ``key`` under a ``===== title`` line."""
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(key).print_stats(n)
    print(f"===== {title}")
    lines = s.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    print("\n".join(line for line in lines[start:] if line.strip()))


def call_profiles(buf, dev, a) -> None:
    """(1') cProfile of each kind of call at the decode size, 200 calls each: where the host time goes,
    by own time and by cumulative time."""
    for name, f in call_kinds(buf, dev, a.decode_tokens, a):
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            f()
        pr.disable()
        torch.cuda.synchronize()
        for key, n in (("tottime", 22), ("cumulative", 30)):
            print_profile(pr, f"{name}: cProfile of 200 calls, by {key}", key, n)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--host-only", action="store_true", help="only (0): the host cost of the pieces")
    p.add_argument("--host-profile", action="store_true",
                   help="only (0) and the cProfile of each call kind at the decode size (full dispatch included)")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    group = single_rank_nccl_group(dev)
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=a.tokens, hidden=a.hidden,
                                num_topk=a.topk, explicitly_destroy=True)
    host_pieces(buf, dev, a)
    if a.host_profile:
        call_profiles(buf, dev, a)
    if a.host_only or a.host_profile:
        buf.destroy()
        dist.destroy_process_group()
        return
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
            for name, fn in (("cached dispatch", lambda: buf.dispatch(x, handle=handle)),
                             ("combine", lambda: buf.combine(y, handle))):
                us = graph_time_us(fn, a.iters, lambda: None)
                print(f"===== {tag}: {name} from a CUDA graph: " + ("capture failed" if us is None else f"{us:.1f} us per call"))
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
