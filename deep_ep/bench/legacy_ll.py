"""``python -m deep_ep bench --legacy-ll``: DeepEP's V1 low-latency decode step (`deep_ep.Buffer`'s
``low_latency_dispatch`` / ``low_latency_combine``) on the GPU, EP=1 (a one-rank NCCL group), one
rank per GPU under torchrun, or ``--virtual-ranks N`` emulated ranks on one GPU.

The shape is DeepEP's decode benchmark: 128 tokens per rank, hidden 7168, top-8 of 256 experts, FP8
dispatch, BF16 combine. Printed, as device times from CUDA graphs (emulated ranks: every rank's
calls in one graph, `deep_ep.bench.rank_graphs`): dispatch and combine each; then the receive-hook
variant of each call with a matmul issued between the call (the send half) and the hook (the
receive half), its time against the larger of the matmul alone and the call with its hook alone
(``overlap ratio``: 1.0 is a perfect overlap, the sum of both over the larger is none). The matmul is
sized to take about as long as the call. With ``--profile`` (EP=1 or emulated ranks), each call's
graph is captured again and replayed under torch.profiler: per call, every kernel the graph holds
(launches, device time per launch and per call) and every torch op the capture recorded.
Results are not checked here (the GPU tests do).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch

from .progress import Progress

__all__ = ["TOKENS", "HIDDEN", "TOP_K", "NUM_EXPERTS", "PROFILE_REPLAYS", "run", "profile_graph"]

TOKENS = 128
HIDDEN = 7168
TOP_K = 8
NUM_EXPERTS = 256
CALLS_PER_GRAPH = 10
PROFILE_REPLAYS = 20            # graph replays of each call under the profiler (--profile)


def run(args) -> int:
    """Run the low-latency bench for parsed ``args`` (``--virtual-ranks``, ``--iters``, ``--seed``,
    ``--num-sms``, ``--profile`` are read); returns the exit code.

    Raises:
        SystemExit: no CUDA device, or ``--virtual-ranks`` under torchrun.
    """
    if not torch.cuda.is_available():
        raise SystemExit("error: --legacy-ll runs on the GPU; no CUDA device is visible")
    from .runner_gpu import setup
    gs = setup(args)
    iters = max(20, args.iters or 50)
    do_profile = bool(getattr(args, "profile", False))
    if args.num_sms:
        import deep_ep
        deep_ep.Buffer.set_num_sms(args.num_sms)
    results: List[Optional[Dict[str, float]]] = [None] * gs.num_ranks
    if gs.emulated:
        from .. import emulated
        group = emulated.EmulatedGroup(gs.num_ranks, device=gs.device)
        _limit_sms(gs.num_ranks)
        group.run(lambda rank_group: _emulated_body(rank_group, group, gs.num_ranks, args.seed, iters, results,
                                                    do_profile, Progress("gpu")))
    else:
        import torch.distributed as dist
        from .gpu_timing import single_rank_nccl_group
        process_group = single_rank_nccl_group(gs.device)
        barrier = (lambda: dist.barrier()) if gs.multiprocess else (lambda: None)
        results[gs.rank] = _process_body(process_group, gs.num_ranks, gs.rank, args.seed, iters, barrier, do_profile)
        if gs.multiprocess and gs.rank != 0:
            return 0
    _print(gs, results[0])
    return 0


def _limit_sms(num_ranks: int) -> None:
    """Emulated ranks share the device: every rank's blocks must be resident at once."""
    import deep_ep
    per_rank = torch.cuda.get_device_properties(0).multi_processor_count // num_ranks // 2 * 2
    deep_ep.Buffer.set_num_sms(max(2, min(deep_ep.Buffer.num_sms, per_rank)))


class _Step:
    """One rank's buffer, inputs and calls."""

    def __init__(self, group, num_ranks: int, rank: int, seed: int) -> None:
        import deep_ep
        device = torch.device("cuda", torch.cuda.current_device())
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, num_ranks, NUM_EXPERTS)
        self.buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
        generator = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
        self.x = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float32, device="cpu").to(torch.bfloat16).to(device)
        self.topk_idx = torch.rand(TOKENS, NUM_EXPERTS, generator=generator, dtype=torch.float32, device="cpu").topk(TOP_K, dim=1).indices.to(
            deep_ep.topk_idx_t).to(device)
        self.topk_weights = torch.rand(TOKENS, TOP_K, generator=generator, dtype=torch.float32, device="cpu").to(device)
        num_local = NUM_EXPERTS // num_ranks
        self.expert_x = torch.randn(num_local, num_ranks * TOKENS, HIDDEN, generator=generator, dtype=torch.float32, device="cpu").to(
            torch.bfloat16).to(device)
        self.handle = None
        self.weight = torch.randn(HIDDEN, HIDDEN, generator=generator, dtype=torch.float32, device="cpu").to(torch.bfloat16).to(device)
        self.activations = torch.randn(1024, HIDDEN, generator=generator, dtype=torch.float32, device="cpu").to(torch.bfloat16).to(device)

    def dispatch(self, use_hook: bool = False):
        return self.buffer.low_latency_dispatch(self.x, self.topk_idx, TOKENS, NUM_EXPERTS, use_fp8=True,
                                                return_recv_hook=use_hook)

    def first_dispatch(self) -> None:
        """A dispatch outside any graph, whose handle every combine uses."""
        self.handle = self.dispatch()[2]

    def combine(self, use_hook: bool = False):
        return self.buffer.low_latency_combine(self.expert_x, self.topk_idx, self.topk_weights, self.handle,
                                               return_recv_hook=use_hook)

    def matmul(self):
        return self.activations @ self.weight

    def calls(self) -> Dict[str, Callable[[], Any]]:
        """The timed calls: each low-latency call alone (with its hook called at once), the matmul
        alone, and each call with the matmul between the call and its hook."""
        def with_hook(call, matmul: bool):
            def step():
                hook = call(True)[-1]
                if matmul:
                    self.matmul()
                hook()
            return step

        return {"dispatch": lambda: self.dispatch(), "combine": lambda: self.combine(),
                "dispatch_hook": with_hook(self.dispatch, False), "combine_hook": with_hook(self.combine, False),
                "matmul": self.matmul,
                "dispatch_hook_matmul": with_hook(self.dispatch, True),
                "combine_hook_matmul": with_hook(self.combine, True)}

    def size_matmul(self, rows: int) -> None:
        generator = torch.Generator(device="cpu").manual_seed(rows)
        self.activations = torch.randn(rows, HIDDEN, generator=generator, dtype=torch.float32, device="cpu").to(torch.bfloat16).to(self.x.device)


def _matmul_rows(calls_us: tuple, matmul_us: float, rows: int) -> int:
    """Rows of the matmul that takes about as long as the longest of ``calls_us`` (it took
    ``matmul_us`` with ``rows``); call times missing (NaN: no graph timing) are left out, and ``rows``
    is kept when every call time or the matmul's is missing."""
    call_us = max((us for us in calls_us if math.isfinite(us) and us > 0), default=math.nan)
    if not (math.isfinite(call_us) and math.isfinite(matmul_us) and matmul_us > 0):
        print(f"warning: no graph timing of the calls or the matmul: the matmul keeps {rows} rows", flush=True)
        return rows
    return max(64, min(16384, int(rows * call_us / matmul_us) // 64 * 64))


def _process_body(group, num_ranks: int, rank: int, seed: int, iters: int, barrier,
                  do_profile: bool = False) -> Dict[str, Any]:
    """One rank per process: each call captured CALLS_PER_GRAPH times in a graph and timed; then,
    with ``do_profile`` and one rank, each call's graph profiled (`profile_graph`)."""
    from .gpu_timing import graph_time_us
    step = _Step(group, num_ranks, rank, seed)
    try:
        step.first_dispatch()
        torch.cuda.synchronize()
        times: Dict[str, float] = {}
        calls = step.calls()
        for name in ("dispatch", "combine", "dispatch_hook", "combine_hook", "matmul"):
            times[name] = graph_time_us(calls[name], iters, barrier, CALLS_PER_GRAPH) or float("nan")
        step.size_matmul(_matmul_rows((times["dispatch_hook"], times["combine_hook"]), times["matmul"], 1024))
        times["matmul"] = graph_time_us(calls["matmul"], iters, barrier, CALLS_PER_GRAPH) or float("nan")
        for name in ("dispatch_hook_matmul", "combine_hook_matmul"):
            times[name] = graph_time_us(calls[name], iters, barrier, CALLS_PER_GRAPH) or float("nan")
        times["matmul_rows"] = step.activations.shape[0]
        if do_profile and num_ranks == 1:      # (ranks in step: each replay is a collective)
            for name in ("dispatch", "combine"):
                times[f"{name}_profile"] = profile_graph(lambda: _capture_calls(calls[name], CALLS_PER_GRAPH),
                                                         CALLS_PER_GRAPH)
        return times
    finally:
        step.buffer.destroy()


def _emulated_body(rank_group, group, num_ranks: int, seed: int, iters: int, results: list,
                   do_profile: bool = False, progress: Optional[Progress] = None) -> None:
    """Emulated ranks: each rank makes its calls once in its thread (windows, plans, modules), then
    rank 0's thread captures every rank's call in one graph per call while the others wait at a host
    barrier (with ``do_profile`` once more, profiled: `profile_graph`): a CUDA call of theirs, such as
    their buffer's destruction, would invalidate the capture. After a failed capture nothing more is
    captured (the ranks captured before the failure made one call more than the others). ``progress``
    (rank 0's lines): a line per stage, so a log shows where a run stopped."""
    from .rank_graphs import capture_rank_calls, time_replays
    rank = rank_group.rank()
    say = progress.say if progress is not None and rank == 0 else (lambda message: None)
    step = _Step(rank_group, num_ranks, rank, seed)
    say("rank 0: buffer made")
    steps = group.__dict__.setdefault("_legacy_ll_steps", [None] * num_ranks)
    steps[rank] = step
    try:
        step.first_dispatch()
        for name, call in step.calls().items():
            call()
            say(f"rank 0: {name} made outside a graph")
        torch.cuda.current_stream().synchronize()
        rank_group.barrier()
        if rank == 0:
            say(f"{num_ranks} emulated ranks: buffers made, every call made once outside a graph")
            times: Dict[str, float] = {}
            failed = []

            def capture(name: str):
                captured = None if failed else capture_rank_calls(group, [s.calls()[name] for s in steps])
                if captured is None:
                    failed.append(name)
                return captured

            def measure(name: str) -> float:
                captured = capture(name)
                say(f"{name}: captured" if captured is not None else f"{name}: not captured")
                replays = None if captured is None else time_replays(captured[0], iters)
                value = float("nan") if not replays else sorted(replays)[len(replays) // 2]
                say(f"{name}: {value:.1f} us per replay of every rank's call")
                return value

            for name in ("dispatch", "combine", "dispatch_hook", "combine_hook", "matmul"):
                times[name] = measure(name)
            rows = _matmul_rows((times["dispatch_hook"], times["combine_hook"]), times["matmul"], 1024)
            for s in steps:
                s.size_matmul(rows)
            times["matmul"] = measure("matmul")
            for name in ("dispatch_hook_matmul", "combine_hook_matmul"):
                times[name] = measure(name)
            times["matmul_rows"] = rows
            if do_profile:
                for name in ("dispatch", "combine"):
                    times[f"{name}_profile"] = profile_graph(lambda: (capture(name) or (None,))[0], num_ranks)
            results[0] = times
        rank_group.barrier()           # rank 0's captures are done: buffers may go
    finally:
        step.buffer.destroy()


def _device_us(event) -> float:
    """An averaged profiler event's own device time in us (named per torch version)."""
    for key in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, key, None)
        if value is not None:
            return float(value)
    return 0.0


def _profiled(activity, run: Callable[[], Any]):
    """``(profiler, result)``: ``run()`` under torch.profiler recording ``activity``."""
    from torch.profiler import profile
    with profile(activities=[activity]) as profiler:
        result = run()
        torch.cuda.synchronize()
    return profiler, result


def profile_graph(capture: Callable[[], Any], calls_in_graph: int, replays: int = PROFILE_REPLAYS) -> Dict[str, list]:
    """Where one call's device time goes, as a CUDA graph replays it: ``capture()`` (returning the
    graph, or None when capture failed) runs under the profiler's CPU activity (the torch ops the
    graph holds: argument checks that read the host are skipped while capturing), then ``replays``
    replays of the graph under its CUDA activity (the graph's kernels). ``calls_in_graph``: the calls
    one replay makes (emulated ranks: one per rank), the divisor of every count.

    Returns ``{"kernels": [(name, launches per call, us per launch, us per call)], "ops": [(torch op,
    per call)]}``, kernels by device time per call, largest first (empty lists when capture failed).
    """
    from torch.profiler import ProfilerActivity
    captured, graph = _profiled(ProfilerActivity.CPU, capture)
    if graph is None:
        return {"kernels": [], "ops": []}
    graph.replay()
    torch.cuda.synchronize()
    replayed, _ = _profiled(ProfilerActivity.CUDA, lambda: [graph.replay() for _ in range(replays)])
    per_call = replays * calls_in_graph
    cuda_type = torch.autograd.DeviceType.CUDA
    kernels = [(event.key, event.count / per_call, _device_us(event) / max(event.count, 1),
                _device_us(event) / per_call) for event in replayed.key_averages()
               if getattr(event, "device_type", None) == cuda_type and _device_us(event) > 0]
    ops = [(event.key, event.count / calls_in_graph) for event in captured.key_averages()
           if event.key.startswith("aten::")]
    kernels.sort(key=lambda row: -row[3])
    ops.sort(key=lambda row: (-row[1], row[0]))
    return {"kernels": kernels, "ops": ops}


def _capture_calls(call: Callable[[], Any], calls: int):
    """A CUDA graph of ``calls`` calls of ``call`` (warmed up before), or None (a warning printed)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                call()
    except RuntimeError as exc:
        print(f"warning: CUDA-graph capture for the profile failed: {exc}", flush=True)
        return None
    return graph


def _print_profile(name: str, table: Optional[Dict[str, list]], num_ranks: int, emulated: bool) -> None:
    if not table:
        return
    scope = f"per rank's call ({num_ranks} emulated ranks at once)" if emulated else "per call"
    kernels = table["kernels"]
    launches = sum(row[1] for row in kernels)
    total = sum(row[3] for row in kernels)
    if not kernels:
        print(f"  {name}: the profiler saw no kernel of the graph's replays")
    print(f"  {name}: {launches:.1f} kernel launches and {total:.1f} us of kernels {scope}")
    for kernel, count, per_launch, per_call in kernels:
        print(f"    {per_call:8.1f} us  {count:5.2f} x {per_launch:8.1f} us  {kernel[:90]}")
    if table["ops"]:
        print(f"  {name}: torch ops per call: " + ", ".join(f"{op[len('aten::'):]} x{count:g}"
                                                          for op, count in table["ops"]))


def _us(value: float) -> str:
    return f"{value:9.1f} us" if math.isfinite(value) else "no graph timing"


def _print(gs, times: Dict[str, float]) -> None:
    where = f"{gs.num_ranks} emulated ranks on one GPU" if gs.emulated else f"{gs.num_ranks} rank(s), NCCL"
    per = "per replay of every rank's call" if gs.emulated else "per call"
    print(f"legacy low-latency decode ({where}; {gs.device_name}): {TOKENS} tokens per rank, hidden {HIDDEN}, "
          f"top-{TOP_K} of {NUM_EXPERTS} experts, FP8 dispatch, BF16 combine; CUDA-graph device time {per}")
    print(f"  dispatch                  {_us(times['dispatch'])}")
    print(f"  combine                   {_us(times['combine'])}")
    print(f"  matmul [{int(times['matmul_rows'])}, {HIDDEN}] x [{HIDDEN}, {HIDDEN}] alone {_us(times['matmul'])}")
    for name in ("dispatch", "combine"):
        comm, both = times[f"{name}_hook"], times[f"{name}_hook_matmul"]
        ratio = both / max(comm, times["matmul"])
        overlap = f"overlap ratio {ratio:.2f}" if math.isfinite(ratio) else "no overlap ratio"
        print(f"  {name} with hook: call + hook {_us(comm)}; call, matmul, hook {_us(both)}; "
              f"{overlap} (total / max(matmul, call + hook))")
    if "dispatch_profile" in times:
        print("profile (CUDA-graph replays under torch.profiler; each kernel's own device time):")
        for name in ("dispatch", "combine"):
            _print_profile(name, times.get(f"{name}_profile"), gs.num_ranks, gs.emulated)
