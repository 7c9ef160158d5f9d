"""Every emulated rank's kernels of one call in one CUDA graph: the device time of a multi-rank call.

Emulated ranks (`deep_ep.emulated`) cannot each capture a graph of their own: their threads would
capture at the same time, and a rank's kernels wait for its peers', so no rank's graph replays
alone. Here one thread captures every rank's cached dispatch (and, in a second graph, combine): one
event recorded on the capture stream forks a branch to each rank's compute stream, the rank's call
is made there (`EmulatedGroup.acting_as`), and the capture stream joins every branch at the end. A
replay runs every rank's kernels concurrently, as they must (they spin on each other's signals; the
backend splits the SMs so that every rank's blocks are resident at once).

Contract: call `run_rank_graphs` from one rank's thread while every other rank's thread waits at a
host barrier, after the calls were made in the ranks' threads (kernels loaded, launches prepared),
with every rank's session at the same call. Measured: the median device time of one replay; then
one replay with poisoned outputs, compared with the reference like the bench's other checks.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .check import poison_in_place
from .gpu_timing import spin_up

__all__ = ["GRAPH_CALLS", "REPLAY_WARMUP", "STALLED_SECS", "capture_rank_calls", "time_replays",
           "poison_outputs", "run_rank_graphs"]

GRAPH_CALLS = ("cached_dispatch", "combine")
REPLAY_WARMUP = 2
#: A first replay slower than this (seconds) means the ranks' kernels did not run concurrently: they
#: waited for each other until the GPU-side timeout.
STALLED_SECS = 5.0


def capture_rank_calls(group, calls: Sequence[Callable[[], Any]]) -> Optional[Tuple[Any, List[Any]]]:
    """Capture ``calls[r]()`` (rank ``r``'s call) for every rank of the emulated ``group`` in one CUDA
    graph, each rank on its own branch: its compute stream (``group.compute_streams[r]``) waits for
    one fork event recorded on the capture stream before any call, the call is made acting as the
    rank, and the capture stream waits for every branch after the last call.

    Returns ``(graph, [outputs of rank r's call])`` (the static outputs every replay rewrites), or
    None when capture fails (a warning is printed).
    """
    graph = torch.cuda.CUDAGraph()
    outs: List[Any] = []
    try:
        with torch.cuda.graph(graph):
            capture = torch.cuda.current_stream()
            fork = torch.cuda.Event()
            fork.record(capture)
            branches = [group.compute_streams[rank] for rank in range(len(calls))]
            for branch in branches:
                branch.wait_event(fork)
            for rank, (call, branch) in enumerate(zip(calls, branches)):
                with group.acting_as(rank, branch):
                    outs.append(call())
            for branch in branches:
                join = torch.cuda.Event()
                join.record(branch)
                capture.wait_event(join)
    except RuntimeError as exc:  # reported, not fatal: the other numbers stand
        print(f"warning: capturing the {len(calls)} emulated ranks in one CUDA graph failed, no graph timing: "
              f"{exc}", flush=True)
        return None
    return graph, outs


def time_replays(graph, replays: int, warmup: int = REPLAY_WARMUP) -> Optional[List[float]]:
    """Device time of each of ``replays`` replays of ``graph`` in us, between CUDA events around each
    replay on the current stream (the replays back to back, one host wait at the end), after
    ``warmup`` untimed replays and a spin-up. None (a warning printed) when the first warm-up replay
    took longer than `STALLED_SECS`: the ranks' kernels did not run at the same time."""
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    for i in range(max(1, warmup)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        if i == 0 and start.elapsed_time(end) / 1e3 > STALLED_SECS:
            print(f"warning: one replay of the emulated ranks' CUDA graph took {start.elapsed_time(end) / 1e3:.1f} s: "
                  f"their kernels did not run concurrently; no graph timing", flush=True)
            return None
    spin_up()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in pairs:
        start.record(stream)
        graph.replay()
        end.record(stream)
    pairs[-1][1].synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in pairs]


def poison_outputs(name: str, out) -> None:
    """Poison what a replay of call ``name`` rewrites: a cached dispatch's received rows (its indices
    are the handle's, which later calls read; the bench gives it no weights), combine's rows and
    weights."""
    poison_in_place(out[0], out[1] if name == "combine" else None)


def run_rank_graphs(group, sessions: Sequence[Any], floors: Dict[str, float], replays: int,
                    progress) -> Dict[str, Any]:
    """Capture, time and check each call of `GRAPH_CALLS` for every rank at once (see the module).

    Args:
        group: the `deep_ep.emulated.EmulatedGroup` (``compute_streams``, ``acting_as``).
        sessions: every rank's `deep_ep.bench.session.RankSession`, by rank.
        floors: ``{"dispatch": us, "combine": us}``, the floor of every rank's bytes together.
        replays: timed replays per graph.
        progress: where the stage line goes.

    Returns:
        ``{"ranks", "replays", "floor_dispatch_us", "floor_combine_us"}`` and per call ``name``:
        ``name_us`` (median device time of one replay; None when not measured), ``name_ratio`` (to
        its floor) and ``name_us_all`` (every replay).
    """
    result: Dict[str, Any] = {"ranks": len(sessions), "replays": replays,
                              "floor_dispatch_us": floors.get("dispatch"), "floor_combine_us": floors.get("combine")}
    checked = any(sess.checker is not None for sess in sessions)
    for name in GRAPH_CALLS:
        result.update({f"{name}_us": None, f"{name}_ratio": None, f"{name}_us_all": []})
        captured = capture_rank_calls(group, [lambda sess=sess, name=name: sess.call(name) for sess in sessions])
        if captured is None:
            # The ranks captured before the failure counted one more call than the others: their
            # next kernels would not pair.
            break
        graph, outs = captured
        times = time_replays(graph, replays)
        if times:
            us = statistics.median(times)
            floor = floors.get("combine" if name == "combine" else "dispatch")
            result.update({f"{name}_us": us, f"{name}_ratio": us / floor if floor else None, f"{name}_us_all": times})
        if checked:
            for out in outs:
                poison_outputs(name, out)
            graph.replay()
            torch.cuda.synchronize()
            for sess, out in zip(sessions, outs):
                sess.check(name, out, "graph-replay")
        del graph, outs, captured
    progress.say(f"all {len(sessions)} ranks in one CUDA graph per call: timed" + (" and checked" if checked else ""))
    return result
