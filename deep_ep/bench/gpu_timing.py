"""GPU timing for the bench and the tools: CUDA-event clock, CUDA graphs, the floor, baselines.

Everything here measures; nothing checks (`deep_ep.bench.check` does). Imported only on the GPU path
(and by ``tools/profile_gpu.py`` and ``tools/tune_gpu.py``).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .config import BenchConfig, token_copies

__all__ = ["CudaClock", "time_events", "single_rank_nccl_group", "spin_up", "capture_calls",
           "time_graph", "graph_time_us", "copy_floor_us", "torch_baselines_us",
           "best_host_us", "host_reference_us", "write_floor_us", "floor_us", "nvlink_floor_and_all_to_all_us"]


class CudaClock:
    """Times one call on the current CUDA stream (see `deep_ep.bench.session.HostClock`).

    ``time_call(fn)`` returns ``(outputs, sample)``: ``host_s`` from the call's start until it
    returned (the Python API down to its last launch); ``sync_s`` until the stream finished its work
    (a user's ``torch.cuda.synchronize()`` after the call); ``event_s`` between CUDA events recorded
    just before and just after the call (host time while the GPU waits, plus device time). Call
    ``sync()`` (and a barrier) first so the stream is idle when the call starts."""

    def sync(self) -> None:
        """Wait for the current stream."""
        torch.cuda.current_stream().synchronize()

    def time_call(self, fn: Callable[[], Any]):
        stream = torch.cuda.current_stream()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        b.record(stream)
        stream.synchronize()
        t2 = time.perf_counter()
        return out, {"sync_s": t2 - t0, "host_s": t1 - t0, "event_s": a.elapsed_time(b) / 1e3}


def time_events(fn: Callable[[], Any], iters: int, warmup: int, stream=None) -> List[float]:
    """Seconds per call of ``fn`` between CUDA events on ``stream`` (default: current), one call at a
    time, after ``warmup`` untimed calls."""
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


_spin_scratch: Dict[int, torch.Tensor] = {}


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


def capture_calls(fn: Callable[[], Any], calls: int = 10) -> Optional[Tuple[torch.cuda.CUDAGraph, Any]]:
    """Capture ``calls`` calls of ``fn`` back to back in one CUDA graph (after one warm-up call on a
    side stream). Returns ``(graph, outputs of the last captured call)`` (its static outputs, written
    again by every replay), or None when capture fails (a warning is printed)."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):  # warm-up outside capture
        fn()
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                out = fn()
    except RuntimeError as exc:  # reported, not fatal: the other numbers stand
        print(f"warning: CUDA-graph capture failed, no graph timing: {exc}", flush=True)
        return None
    return graph, out


def time_graph(graph: torch.cuda.CUDAGraph, calls_per_graph: int, iters: int, barrier: Callable[[], None]) -> float:
    """Mean device time of one call in us: ``graph`` (holding ``calls_per_graph`` calls) replayed
    ``ceil(iters / calls_per_graph)`` times between two events, after one untimed replay and a
    spin-up. One replay's host cost (several us) is spread over many calls, so a call shorter than a
    replay launch (decode sizes) is not timed at the host's pace."""
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


def graph_time_us(fn: Callable[[], Any], iters: int, barrier: Callable[[], None],
                  calls_per_graph: int = 10) -> Optional[float]:
    """Mean device time of one ``fn`` call replayed from a CUDA graph, in us (None if capture fails):
    :func:`capture_calls` then :func:`time_graph`."""
    captured = capture_calls(fn, calls_per_graph)
    if captured is None:
        return None
    return time_graph(captured[0], calls_per_graph, iters, barrier)


def _rotating_buffers(num_bytes: int, device, make) -> tuple:
    """``(n, buffers)``: ``num_bytes`` rounded to an even count ``n`` (at least 16), and 2 to 8 byte
    buffers of ``n`` from ``make(n)``, enough to rotate over 256 MB where each is smaller."""
    n = max(16, int(num_bytes) // 2 * 2)
    return n, [make(n) for _ in range(max(2, min(8, (256 << 20) // n + 1)))]


def _back_to_back_us(op: Callable[[int], Any], iters: int) -> float:
    """Device time of one ``op(i)`` in us: ``iters`` of them (``i`` = 0, 1, ...) back to back between
    two events on the current stream, after a spin-up; the median of 5 such rounds."""
    stream = torch.cuda.current_stream()
    spin_up()
    rounds = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for i in range(iters):
            op(i)
        b.record(stream)
        b.synchronize()
        rounds.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(rounds)


def copy_floor_us(num_bytes: int, device, iters: int = 20) -> float:
    """Time of a device-to-device copy moving ``num_bytes`` (read once, written once), in us.

    Copies run back to back between two events (``iters`` of them, after a warm-up), as the graph
    replays of the library's kernels do, so the floor excludes the idle time between separately
    timed launches; the median of 5 such rounds. Rotates over up to 8 sources, so that from about
    8 MB on (8 of them fill the H200's 60 MB L2 cache) repeats are not served from L2; below that
    the floor is an L2 copy, faster than HBM, which only makes it stricter."""
    n, srcs = _rotating_buffers(num_bytes, device,
                                lambda n: torch.randint(0, 255, (n,), dtype=torch.uint8, device=device))
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    return _back_to_back_us(lambda i: dst.copy_(srcs[i % len(srcs)]), iters)


def write_floor_us(num_bytes: int, device, iters: int = 20) -> float:
    """Time of writing ``num_bytes`` to device memory (torch's ``fill_`` on 8-byte elements, nothing
    read), in us, timed as `copy_floor_us` (back to back, median of 5 rounds, rotating over up to 8
    destinations: below about 8 MB the writes stay in L2, which only makes it faster). An operation
    that mostly writes, such as the expanded dispatch (each token read once, written once per
    expert), is bounded by this as well as by the copy of its traffic; `floor_us` takes the slower.
    The fastest writer measured on the H200 (torch's fill on bytes, the driver's memset and kernels
    of 16-byte stores were slower); a faster writer would lower this floor."""
    _n, dsts = _rotating_buffers(num_bytes, device,
                                 lambda n: torch.empty(-(-n // 8), dtype=torch.int64, device=device))
    return _back_to_back_us(lambda i: dsts[i % len(dsts)].fill_(i), iters)


def floor_us(moved_bytes: int, written_bytes: int, device) -> Dict[str, float]:
    """An operation's floor, in us: the slower of a copy with its HBM traffic (``moved_bytes`` each
    way, `copy_floor_us`) and a fill of the bytes it writes (``written_bytes``, `write_floor_us`).
    Returns ``{"floor": ..., "copy": ..., "write": ...}``."""
    copy = copy_floor_us(moved_bytes, device)
    write = write_floor_us(written_bytes, device)
    return {"floor": max(copy, write), "copy": copy, "write": write}


def torch_baselines_us(cfg: BenchConfig, inputs: Dict[str, Any], device, iters: int = 10) -> Dict[str, float]:
    """EP=1 plain-torch permute (sort by expert + ``index_select``) and weighted un-permute
    (``index_add_`` in fp32) of this rank's tokens, in us (median of ``iters`` event-timed calls)."""
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
    return {"torch_permute_us": statistics.median(time_events(permute, iters, 2)) * 1e6,
            "torch_unpermute_us": statistics.median(time_events(unpermute, iters, 2)) * 1e6}


def best_host_us(fn: Callable[[], Any], calls: int = 200, rounds: int = 5, warmup: int = 20) -> float:
    """Host (wall) time of one ``fn()`` in us: the best of ``rounds`` rounds of ``calls`` calls each,
    after ``warmup`` calls (the best round: the one least disturbed by the rest of the machine)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def host_reference_us(device, calls: int = 200, rounds: int = 5) -> Dict[str, float]:
    """How fast this process's host is, in us per call (best of ``rounds`` rounds of ``calls``): an
    allocation from torch's caching allocator (``torch.empty`` of a DeepSeek-V3 batch, 58.7 MB of bf16)
    and a torch kernel launch (an in-place add on one element). A call's host time depends on the
    host as much as on the code (the device's host was seen to run the same code 1.2-1.7x slower from
    one process to the next), so these two give its host times a yardstick measured alongside."""
    t = torch.zeros(1, dtype=torch.float32, device=device)
    ref = {"host_ref_alloc_us": best_host_us(lambda: torch.empty((4096, 7168), dtype=torch.bfloat16, device=device),
                                             calls, rounds),
           "host_ref_launch_us": best_host_us(lambda: t.add_(1), calls, rounds)}
    if t.is_cuda:
        torch.cuda.synchronize(device)
    return ref


def nvlink_floor_and_all_to_all_us(cfg: BenchConfig, inputs, rank: int, device) -> Dict[str, float]:
    """Multi-GPU floors measured in the same run (one process per GPU, torchrun).

    ``nvlink_copy_us``: a peer-to-peer copy of this rank's dispatch bytes to the next GPU (one
    direction of NVLink); ``all_to_all_dispatch_us``: ``torch.distributed.all_to_all_single`` moving
    the same rows (packed by destination rank), what a user writes without this library.
    """
    import torch.distributed as dist
    out: Dict[str, float] = {}
    copies = token_copies(inputs[rank]["topk_idx"], cfg.num_experts, cfg.num_ranks, cfg.expand)
    nbytes = sum(copies) * cfg.dispatch_bytes_per_token
    peer = (device.index + 1) % torch.cuda.device_count()
    if peer != device.index:
        src = torch.randint(0, 255, (max(16, nbytes),), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src, device=torch.device("cuda", peer))
        out["nvlink_copy_us"] = statistics.median(time_events(lambda: dst.copy_(src), 10, 2)) * 1e6
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
    out["all_to_all_dispatch_us"] = statistics.median(time_events(a2a, 10, 2)) * 1e6
    return out
