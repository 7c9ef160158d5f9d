"""GPU runner of ``python -m deep_ep bench`` (see `deep_ep.bench` for the options and the table).

Ranks:
* started by ``torchrun`` (``WORLD_SIZE`` > 1): one rank per process/GPU, the real NCCL path; rank 0
  prints the table, with the NVLink floor (a peer-to-peer copy) and ``all_to_all_single`` measured
  in the same run;
* ``--virtual-ranks N``: N emulated ranks on one GPU (`deep_ep.emulated`), one thread per rank;
* otherwise: EP=1 through a one-rank NCCL group (torch's communicator, symmetric window).

Side by side in one run, per rank: dispatch and combine time (CUDA events on the compute stream,
median), a cached dispatch (handle reused: no host sync), cached dispatch and combine replayed from
CUDA graphs (device time without host work), the host time of one call, the floor (a
device-to-device copy with the same HBM traffic, measured in the same run: see ``floor_rows``
below), and, at EP=1,
plain torch's permute (sort by expert + ``index_select``) and weighted un-permute (``index_add_`` in
fp32), the code users write without this library. Every output is checked against
`deep_ep.reference` (computed on the GPU with the same torch code) before timing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Optional, Any, Dict, List

import torch

from . import bench as B
from . import reference as ref


def _time_events(fn, iters: int, warmup: int, stream=None) -> List[float]:
    """Seconds per call of ``fn`` with CUDA events on ``stream`` (default: current)."""
    stream = stream or torch.cuda.current_stream()
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def single_rank_nccl_group(device: torch.device):
    """A one-rank NCCL process group on ``device`` (torch's own communicator, as a user's job has),
    made with a file store unless a process group already exists; returns ``dist.group.WORLD``."""
    import torch.distributed as dist
    if not dist.is_initialized():
        torch.cuda.set_device(device)
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="deep_ep_store_"), "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    return dist.group.WORLD


def spin_up(ms: float = 20.0) -> None:
    """Keep the current GPU busy with copies for about ``ms`` milliseconds, then wait: an idle H200
    sits at a low clock and needs a few milliseconds of load to reach full speed, longer than a
    short timed loop lasts. Local work only (ranks may spin a different number of times)."""
    dev = torch.cuda.current_device()
    scratch = _spin_scratch.get(dev)
    if scratch is None:
        scratch = _spin_scratch[dev] = torch.empty((2, 32 << 20), dtype=torch.uint8, device="cuda")
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(8):
            scratch[1].copy_(scratch[0])
        torch.cuda.current_stream().synchronize()


_spin_scratch: Dict[int, torch.Tensor] = {}


def graph_time_us(fn, iters: int, barrier, calls_per_graph: int = 10) -> Optional[float]:
    """Mean device time of one ``fn`` call replayed from a CUDA graph, in us (None if capture fails).

    The graph holds ``calls_per_graph`` calls back to back and is replayed ``ceil(iters /
    calls_per_graph)`` times: one replay's host cost (several us) is then spread over many calls,
    so a call shorter than a replay launch (decode sizes) is not timed at the host's pace."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):  # warm-up outside capture
        fn()
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls_per_graph):
                fn()
    except RuntimeError as exc:  # reported, not fatal: the other numbers stand
        print(f"warning: CUDA-graph capture failed, no graph timing: {exc}")
        return None
    torch.cuda.synchronize()
    barrier()
    graph.replay()
    torch.cuda.synchronize()
    spin_up()
    barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = max(1, -(-iters // calls_per_graph))
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (replays * calls_per_graph)


def copy_floor_us(num_bytes: int, device, iters: int = 20) -> float:
    """Time of a device-to-device copy moving ``num_bytes`` (read once, written once), in us.

    Copies run back to back between two events (``iters`` of them, after a warm-up), as the graph
    replays of the library's kernels do, so the floor excludes the idle time between separately
    timed launches; the median of 5 such rounds. Rotates over enough sources that the L2 cache
    (60 MB on the H200) cannot serve repeats."""
    n = max(16, int(num_bytes) // 2 * 2)
    copies = max(2, min(8, (256 << 20) // n + 1))
    srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=device) for _ in range(copies)]
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream()
    spin_up()
    rounds = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for i in range(iters):
            dst.copy_(srcs[i % copies])
        b.record(stream)
        b.synchronize()
        rounds.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(rounds)


def torch_baselines_us(cfg: B.BenchConfig, inputs: Dict[str, Any], device, iters: int = 10) -> Dict[str, float]:
    """EP=1 plain-torch permute / weighted un-permute of this rank's tokens, in us (median)."""
    x = inputs["x"] if not cfg.fp8 else inputs["x"][0]
    idx = inputs["topk_idx"]
    w = inputs["topk_weights"]
    T, K = idx.shape
    flat = idx.flatten()
    valid = flat >= 0

    def permute():
        order = torch.argsort(torch.where(valid, flat, torch.full_like(flat, cfg.num_experts)), stable=True)
        return x.index_select(0, torch.div(order, K, rounding_mode="floor"))
    y = permute()
    order = torch.argsort(torch.where(valid, flat, torch.full_like(flat, cfg.num_experts)), stable=True)
    tok = torch.div(order, K, rounding_mode="floor")
    wf = (w.flatten() if w is not None else torch.ones_like(flat, dtype=torch.float32))[order]

    def unpermute():
        out = torch.zeros((T, cfg.hidden), dtype=torch.float32, device=device)
        out.index_add_(0, tok, y.float() * wf.unsqueeze(1))
        return out.to(torch.bfloat16)
    return {"torch_permute_us": statistics.median(_time_events(permute, iters, 2)) * 1e6,
            "torch_unpermute_us": statistics.median(_time_events(unpermute, iters, 2)) * 1e6}


def nvlink_floor_and_all_to_all_us(cfg: B.BenchConfig, inputs, rank: int, device) -> Dict[str, float]:
    """Multi-GPU floors measured in the same run (one process per GPU, torchrun).

    ``nvlink_copy_us``: a peer-to-peer copy of this rank's dispatch bytes to the next GPU (one
    direction of NVLink); ``all_to_all_dispatch_us``: ``torch.distributed.all_to_all_single`` moving
    the same rows (packed by destination rank), what a user writes without this library.
    """
    import torch.distributed as dist
    num_ranks = cfg.num_ranks
    out: Dict[str, float] = {}
    copies = B.token_copies(inputs[rank]["topk_idx"], cfg.num_experts, num_ranks, cfg.expand)
    nbytes = sum(copies) * cfg.dispatch_bytes_per_token
    peer = (device.index + 1) % torch.cuda.device_count()
    if peer != device.index:
        src = torch.randint(0, 255, (max(16, nbytes),), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src, device=torch.device("cuda", peer))
        out["nvlink_copy_us"] = statistics.median(_time_events(lambda: dst.copy_(src), 10, 2)) * 1e6
        del src, dst
    row = cfg.dispatch_bytes_per_token
    send = torch.randint(0, 255, (sum(copies), row), dtype=torch.uint8, device=device)
    counts = torch.tensor(copies, dtype=torch.int64, device=device)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    recv = torch.empty((int(recv_counts.sum()), row), dtype=torch.uint8, device=device)
    splits_out, splits_in = copies, recv_counts.tolist()

    def a2a():
        dist.all_to_all_single(recv, send, splits_in, splits_out)
    dist.barrier()
    out["all_to_all_dispatch_us"] = statistics.median(_time_events(a2a, 10, 2)) * 1e6
    return out


def _run_rank(cfg: B.BenchConfig, rank: int, group, device, barrier, expected, check: bool,
              results: list, emulated: bool) -> None:
    from .buffer import ElasticBuffer
    mine = B.make_rank_inputs(cfg, rank, device)
    buf = ElasticBuffer(group, num_max_tokens_per_rank=cfg.max_tokens, hidden=cfg.hidden, num_topk=cfg.top_k,
                        use_fp8_dispatch=cfg.fp8, explicitly_destroy=True)
    try:
        num_sms = cfg.num_sms  # 0: the buffer's default (the bandwidth model, capped for emulated ranks)

        def dispatch():
            return buf.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"],
                                num_experts=cfg.num_experts, num_max_tokens_per_rank=cfg.max_tokens,
                                expert_alignment=cfg.alignment, do_expand=cfg.expand,
                                do_zero_padding=cfg.expand, num_sms=num_sms)

        recv_x, recv_idx, recv_w, handle, _ = dispatch()
        y = B.expert_output(cfg, recv_x).contiguous()
        combined, _, _ = buf.combine(y, handle, num_sms=num_sms)
        torch.cuda.current_stream().synchronize()
        failures: List[str] = []
        if check:
            try:
                ref.check_dispatch((recv_x, recv_idx, recv_w, handle), expected["dispatch"][rank],
                                   do_zero_padding=cfg.expand, rank=rank)
            except AssertionError as exc:
                failures.append(f"dispatch: {exc}")
            msg = B.bf16_mismatch("combined_x", combined, expected["combine"][rank][0])
            if msg:
                failures.append(f"combine: rank {rank} {msg}")

        def timed(fn):
            barrier()
            return _time_events(fn, 1, 0)[0]

        def combine():
            return buf.combine(y, handle, num_sms=num_sms)

        def cached_dispatch():
            return buf.dispatch(mine["x"], handle=handle, num_sms=num_sms, do_zero_padding=cfg.expand)

        d_times, c_times, cd_times = [], [], []
        for i in range(cfg.warmup + cfg.iters):
            dt, ct, cdt = timed(dispatch), timed(combine), timed(cached_dispatch)
            if i >= cfg.warmup:
                d_times.append(dt)
                c_times.append(ct)
                cd_times.append(cdt)
        # Host (CPU) time of one call: the Python API down to the last launch, the GPU not waited for.
        host = {}
        for name, fn in (("cached_dispatch", cached_dispatch), ("combine", combine)):
            torch.cuda.current_stream().synchronize()
            barrier()
            samples = []
            for _ in range(max(5, cfg.iters)):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
                torch.cuda.current_stream().synchronize()
                barrier()
            host[name + "_host_us"] = statistics.median(samples) * 1e6
            # Back to back (no wait between calls, as in a model's loop): the host's steady state.
            n = max(20, cfg.iters)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host[name + "_host_b2b_us"] = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.current_stream().synchronize()
            barrier()
        # Device time without host work: cached dispatch and combine replayed from CUDA graphs (the
        # decode path). Not for emulated ranks: their threads would capture at the same time.
        if not emulated:
            for name, fn in (("cached_dispatch", cached_dispatch), ("combine", combine)):
                host[name + "_graph_us"] = graph_time_us(fn, max(50, cfg.iters), barrier)
        sent = sum(B.token_copies(mine["topk_idx"], cfg.num_experts, cfg.num_ranks, cfg.expand))
        received = int(handle.rank_prefix_sum[-1])
        results[rank] = dict(rank=rank, sent=sent, received=received, received_rows=B._num_rows(recv_x),
                             d_times=d_times, c_times=c_times, cd_times=cd_times, failures=failures, host=host,
                             num_sms=num_sms or buf.get_theoretical_num_sms(cfg.num_experts, cfg.top_k))
        barrier()
    finally:
        buf.destroy()


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the GPU bench; returns the result dict of `deep_ep.bench.build_result` plus GPU extras."""
    import torch.distributed as dist
    from . import jit
    from .backends import gpu as gpu_backend

    world = int(os.environ.get("WORLD_SIZE", "1"))
    multiprocess = world > 1
    if multiprocess:
        if args.virtual_ranks is not None:
            raise SystemExit("error: --virtual-ranks emulates ranks in one process; drop it under torchrun")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", torch.cuda.current_device())
    if multiprocess and not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    my_rank = dist.get_rank() if multiprocess else 0
    emulated = args.virtual_ranks is not None and args.virtual_ranks >= 1
    num_ranks = args.virtual_ranks if emulated else world
    cfg = B.make_config(args, num_ranks, gpu=True)
    jit.reset_stats()

    # Reference of every rank, computed once on the GPU (same torch code as on the CPU).
    inputs = [B.make_rank_inputs(cfg, s, device) for s in range(num_ranks)]
    expected = None
    if cfg.check:
        exp = ref.reference_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                                     [i["topk_weights"] for i in inputs], cfg.num_experts, do_expand=cfg.expand,
                                     expert_alignment=cfg.alignment, do_zero_padding=cfg.expand,
                                     num_max_tokens_per_rank=cfg.max_tokens)
        ys = [B.expert_output(cfg, e.recv_x) for e in exp]
        expected = {"dispatch": exp, "combine": ref.reference_combine(ys, [e.handle for e in exp])}

    # Floors and baselines, in the same run: a device copy with the operation's HBM traffic
    # (`deep_ep.bench.floor_rows`); emulated ranks share one GPU, so theirs is every rank's traffic.
    floor_rows = sum(B.floor_rows(inputs[r]["topk_idx"], cfg.num_experts, num_ranks, cfg.expand)
                     for r in (range(num_ranks) if emulated else [my_rank]))
    floor_d = copy_floor_us(int(floor_rows * cfg.dispatch_bytes_per_token), device)
    floor_c = copy_floor_us(int(floor_rows * cfg.combine_bytes_per_token), device)
    baselines = torch_baselines_us(cfg, inputs[0], device) if num_ranks == 1 else {}
    if multiprocess:
        baselines.update(nvlink_floor_and_all_to_all_us(cfg, inputs, my_rank, device))
    del inputs

    results: list = [None] * num_ranks
    if emulated:
        from .emulated import EmulatedGroup
        group = EmulatedGroup(num_ranks, device=device)
        group.run(lambda g: _run_rank(cfg, g.rank(), g, device, g.barrier, expected, cfg.check, results, True))
        runner = f"gpu/emulated x{num_ranks}"
    else:
        group = single_rank_nccl_group(device)  # torchrun already made the job's group
        barrier = (lambda: dist.barrier()) if multiprocess else (lambda: None)
        _run_rank(cfg, my_rank, group, device, barrier, expected, cfg.check, results, False)
        runner = f"gpu/nccl x{num_ranks}"
        if multiprocess:  # every rank's row to rank 0
            gathered = [None] * num_ranks if my_rank == 0 else None
            dist.gather_object(results[my_rank], gathered, dst=0)
            if my_rank != 0:
                return None
            results = gathered

    rows, failures = [], []
    for res in results:
        row = B.make_row(cfg, res["rank"], sent=res["sent"], received=res["received"],
                         received_rows=res["received_rows"], dispatch_times=res["d_times"],
                         combine_times=res["c_times"], check=(not res["failures"]) if cfg.check else None,
                         floor_us=floor_d,
                         extra={"cached_dispatch_us": statistics.median(res["cd_times"]) * 1e6,
                                "combine_floor_us": floor_c, "num_sms": res["num_sms"], **res["host"]})
        row["combine_ratio"] = row["combine_us"] / floor_c if floor_c else None
        rows.append(row)
        failures += res["failures"]
    props = torch.cuda.get_device_properties(device)
    result = B.build_result(cfg, rows, failures, runner=runner,
                            device=f"{props.name}, {props.multi_processor_count} SMs")
    st = jit.stats()
    result["gpu"] = {"floor_dispatch_us": floor_d, "floor_combine_us": floor_c, **baselines,
                     "kernel_modules": gpu_backend.num_modules_built(), "jit": st}
    print(f"floor (D2D copy with the same HBM traffic): dispatch {floor_d:.1f} us, combine {floor_c:.1f} us; "
          f"kernel modules built/loaded: {gpu_backend.num_modules_built()} "
          f"(compiled {st.get('builds', 0)}, disk hits {st.get('disk_hits', 0)})")
    for row in rows[:1]:
        print(f"rank 0: cached dispatch {row['cached_dispatch_us']:.1f} us; host time per call: cached dispatch "
              f"{row['cached_dispatch_host_us']:.1f} us, combine {row['combine_host_us']:.1f} us (back to back: "
              f"{row['cached_dispatch_host_b2b_us']:.1f} us, {row['combine_host_b2b_us']:.1f} us); "
              f"SMs per kernel: {row['num_sms']}")
        gd, gc = row.get("cached_dispatch_graph_us"), row.get("combine_graph_us")
        if gd is not None and gc is not None:
            print(f"rank 0, replayed from CUDA graphs (device time, no host work): cached dispatch {gd:.1f} us "
                  f"({gd / floor_d:.2f}x floor), combine {gc:.1f} us ({gc / floor_c:.2f}x floor)")
    if "all_to_all_dispatch_us" in baselines:
        print("rank 0 baselines: NVLink peer copy of its dispatch bytes {n} us; "
              "all_to_all_single dispatch {all_to_all_dispatch_us:.1f} us".format(
                  n=f"{baselines['nvlink_copy_us']:.1f}" if "nvlink_copy_us" in baselines else "n/a", **baselines))
    if "torch_permute_us" in baselines:
        print("plain torch at EP=1: permute {torch_permute_us:.1f} us, weighted un-permute "
              "{torch_unpermute_us:.1f} us".format(**baselines))
    return result
