"""The bench's graph of every emulated rank's call (`deep_ep.bench.rank_graphs`), on CPU stand-ins.

The real thing needs a GPU (``python -m deep_ep bench --virtual-ranks 8``). Here CUDA's graphs,
events and streams are stand-ins that record what the code asks for: a stand-in graph keeps the
"kernels" launched while it captures and runs them again at each replay. Tested: the captured
graph's structure (one branch per rank, forked from the capture stream before any call and joined
after the last), the replays' median, the floor of every rank's bytes, the report's lines and JSON
keys, and the check of a replay (a "kernel" that leaves a row alone in replays is caught) through
``cli.main`` with ``--virtual-ranks``. Also `EmulatedGroup.acting_as`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import threading
import types

import pytest
import torch

from deep_ep import emulated
from deep_ep.backends import outputs
from deep_ep.bench import cli, config, rank_graphs, report, runner_gpu, session


def _args(argv=()):
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


# ---------------------------------------------------------------------------------------------
# Stand-ins for CUDA's graphs, events and streams
# ---------------------------------------------------------------------------------------------


class _Stream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_event(self, event):
        self.cuda.log.append(("wait", self.name, event.index))


class _StandInCuda:
    """What `rank_graphs` and the stand-in buffer use of ``torch.cuda``; ``log`` records stream
    operations in order; a launch made while a graph captures is kept by the graph (a kernel node)."""

    def __init__(self, elapsed_ms=(1.5,)):
        self.log = []
        self.local = threading.local()
        self.capturing = None
        self.events = 0
        self.elapsed = list(elapsed_ms)
        self.lock = threading.Lock()
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                with cuda.lock:
                    self.index = cuda.events
                    cuda.events += 1

            def record(self, stream=None):
                stream = stream or cuda.current_stream()
                cuda.log.append(("record", self.index, stream.name))

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                with cuda.lock:
                    return cuda.elapsed.pop(0) if len(cuda.elapsed) > 1 else cuda.elapsed[0]

        class CUDAGraph:
            def __init__(self):
                self.kernels = []
                self.replays = 0

            def replay(self):
                self.replays += 1
                for kernel in self.kernels:
                    kernel()

        self.Event, self.CUDAGraph = Event, CUDAGraph
        self.capture_stream = _Stream(self, "capture")

    def current_stream(self, device=None):
        return getattr(self.local, "stream", None) or _Stream(self, "default")

    @contextlib.contextmanager
    def stream(self, stream):
        previous = getattr(self.local, "stream", None)
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = previous

    @contextlib.contextmanager
    def graph(self, graph):
        self.log.append(("begin",))
        self.capturing = graph
        try:
            with self.stream(self.capture_stream):
                yield
        finally:
            self.capturing = None
            self.log.append(("end",))

    def launch(self, rank, kernel, defective_kernel=None):
        """A "kernel" of ``rank`` on the current stream: run now, or kept by the capturing graph."""
        self.log.append(("kernel", rank, self.current_stream().name))
        if self.capturing is not None:
            self.capturing.kernels.append(defective_kernel or kernel)
        else:
            kernel()

    def install(self, monkeypatch):
        for name in ("Event", "CUDAGraph", "current_stream", "graph", "stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(rank_graphs, "spin_up", lambda: None)


class _StandInGroup:
    """An `EmulatedGroup` on CPU: a thread per rank, a host barrier, a stream per rank, `acting_as`."""

    cuda = None   # the `_StandInCuda` of the test

    def __init__(self, num_ranks, device=None):
        self.num_ranks = num_ranks
        self._barrier = threading.Barrier(num_ranks, timeout=120)
        self.compute_streams = [_Stream(self.cuda, f"rank{r}") for r in range(num_ranks)]
        self.ranks = [types.SimpleNamespace(rank=lambda r=r: r, size=lambda: num_ranks, barrier=self.barrier)
                      for r in range(num_ranks)]
        self.acted = []

    def barrier(self):
        self._barrier.wait()

    @contextlib.contextmanager
    def acting_as(self, rank, stream=None):
        stream = stream or self.compute_streams[rank]
        self.acted.append((rank, stream.name, threading.current_thread().name))
        self.cuda.log.append(("acting", rank, stream.name))
        with self.cuda.stream(stream):
            yield self.ranks[rank]

    def run(self, fn):
        errors = []

        def worker(rank):
            try:
                with self.cuda.stream(self.compute_streams[rank]):
                    fn(self.ranks[rank])
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                self._barrier.abort()
        threads = [threading.Thread(target=worker, args=(r,), name=f"rank{r}") for r in range(self.num_ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]


class _StandInBuffer:
    """An `ElasticBuffer` whose "kernels" write the reference's outputs (``expected``, by rank) into
    freshly allocated outputs; ``skip_row``: a row its kernels leave alone when replayed from a graph."""

    cuda = None
    expected = None
    skip_row = None

    def __init__(self, group, **kwargs):
        self.rank = group.rank()

    def _write(self, dst, src):
        def kernel(skip=None):
            keep = torch.ones(dst.shape[0], dtype=torch.bool)
            if skip is not None:
                keep[skip] = False
            dst[keep] = src[keep]
        defect = None if self.skip_row is None else (lambda: kernel(self.skip_row))
        self.cuda.launch(self.rank, kernel, defect)
        return dst

    def dispatch(self, x, topk_idx=None, topk_weights=None, handle=None, do_cpu_sync=True, **kwargs):
        exp = self.expected[self.rank]
        want = exp.dispatch if handle is not None or do_cpu_sync else exp.dispatch_no_sync
        recv_x = self._write(outputs.empty(tuple(want.recv_x.shape), want.recv_x.dtype, "cpu"), want.recv_x)
        if handle is not None:
            return recv_x, want.recv_topk_idx, None, handle, None
        return recv_x, want.recv_topk_idx.clone(), want.recv_topk_weights.clone(), want.handle, None

    def combine(self, y, handle, bias=None, num_sms=0, **kwargs):
        want = self.expected[self.rank].combined_x
        return self._write(outputs.empty(tuple(want.shape), want.dtype, "cpu"), want), None, None

    def get_theoretical_num_sms(self, num_experts, num_topk):
        return 16

    def destroy(self):
        pass


class _StandInCudaClock(session.HostClock):
    def time_call(self, fn):
        out, sample = super().time_call(fn)
        return out, {**sample, "host_s": sample["sync_s"] / 2, "event_s": sample["sync_s"]}


# ---------------------------------------------------------------------------------------------
# The captured graph
# ---------------------------------------------------------------------------------------------


def test_capture_makes_one_branch_per_rank_forked_and_joined_on_the_capture_stream(monkeypatch):
    cuda = _StandInCuda()
    cuda.install(monkeypatch)
    _StandInGroup.cuda = cuda
    group = _StandInGroup(4)

    def call(rank):
        return lambda: cuda.launch(rank, lambda: None) or f"outputs of rank {rank}"
    with cuda.stream(group.compute_streams[0]):   # the capturing thread is rank 0's
        graph, outs = rank_graphs.capture_rank_calls(group, [call(r) for r in range(4)])
    assert outs == [f"outputs of rank {r}" for r in range(4)] and len(graph.kernels) == 4
    branches = [f"rank{r}" for r in range(4)]
    fork, joins = 0, [1, 2, 3, 4]
    assert cuda.log == (
        [("begin",), ("record", fork, "capture")]
        + [("wait", b, fork) for b in branches]                          # every branch forks before any call
        + [x for r, b in enumerate(branches) for x in (("acting", r, b), ("kernel", r, b))]
        + [x for b, j in zip(branches, joins) for x in (("record", j, b), ("wait", "capture", j))]
        + [("end",)])
    # no branch waits on another: the only event a branch waits for is the fork
    recorded_on = {index: stream for op, index, stream in (e for e in cuda.log if e[0] == "record")}
    assert {recorded_on[e[2]] for e in cuda.log if e[0] == "wait" and e[1] != "capture"} == {"capture"}
    assert sorted(recorded_on[e[2]] for e in cuda.log if e[0] == "wait" and e[1] == "capture") == branches


def test_a_failed_capture_is_a_warning(monkeypatch, capsys):
    cuda = _StandInCuda()
    cuda.install(monkeypatch)
    _StandInGroup.cuda = cuda

    def refused():
        raise RuntimeError("operation not permitted when stream is capturing")
    assert rank_graphs.capture_rank_calls(_StandInGroup(2), [lambda: 1, refused]) is None
    assert "warning: capturing the 2 emulated ranks in one CUDA graph failed" in capsys.readouterr().out


def test_replays_are_timed_each_between_events_after_a_warm_up(monkeypatch, capsys):
    # ms per replay: the first warm-up replay (checked for a stall), then five timed ones
    cuda = _StandInCuda(elapsed_ms=[3.0, 1.0, 4.0, 2.0, 5.0, 3.0])
    cuda.install(monkeypatch)
    graph = cuda.CUDAGraph()
    assert rank_graphs.time_replays(graph, 5) == [1000.0, 4000.0, 2000.0, 5000.0, 3000.0]
    assert graph.replays == rank_graphs.REPLAY_WARMUP + 5
    # a first replay that waited for the GPU-side timeout: the ranks did not run concurrently
    cuda.elapsed = [rank_graphs.STALLED_SECS * 1e3 + 1]
    assert rank_graphs.time_replays(graph, 5) is None
    assert "their kernels did not run concurrently" in capsys.readouterr().out


def test_floor_bytes_are_the_sum_over_ranks():
    cfg = config.make_config(_args(["--model", "qwen3-30b-a3b", "--tokens", "24", "--mask-prob", "0.1"]), 4,
                             gpu=True)
    idxs = [config.make_rank_inputs(cfg, r)["topk_idx"] for r in range(4)]
    alone = [config.floor_bytes(cfg, [idx], 4) for idx in idxs]
    together = config.floor_bytes(cfg, idxs, 4)
    for name in ("dispatch", "combine"):
        for i in (0, 1):
            assert together[name][i] == sum(a[name][i] for a in alone) > 0
    # one rank: a read of each token with a selection, one row written per copy (dispatch) or token (combine)
    copies, tokens = config.written_rows(idxs[1], cfg.num_experts, 4, False)
    row = 2 * cfg.hidden
    assert alone[1] == {"dispatch": ((copies + tokens) * row // 2, copies * row),
                        "combine": ((copies + tokens) * row // 2, tokens * row)}


def test_report_lines_of_the_rank_graphs():
    graphs = {"ranks": 8, "replays": 20, "floor_dispatch_us": 800.0, "floor_combine_us": 1000.0,
              "cached_dispatch_us": 960.0, "cached_dispatch_ratio": 1.2, "combine_us": None, "combine_ratio": None}
    assert report.format_rank_graphs(graphs).splitlines() == [
        "all 8 emulated ranks' calls in one CUDA graph, device time of one replay (median of 20; (x): ratio to "
        "the floor of every rank's bytes on one GPU: dispatch 800.0 us, combine 1000.0 us):",
        "graph cached dispatch 960.0 us (1.20x)",
        "graph combine n/a"]


# ---------------------------------------------------------------------------------------------
# The whole pass: `python -m deep_ep bench --virtual-ranks 4` on stand-ins
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_row", [None, 3])
def test_virtual_ranks_run_prints_times_checks_and_writes_the_rank_graphs(skip_row, monkeypatch, capsys, tmp_path):
    R = 4
    cuda = _StandInCuda(elapsed_ms=(1.5,))
    cuda.install(monkeypatch)
    for name in ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS"):   # cli.main sets them: restored after
        monkeypatch.setenv(name, "")
    argv = ["--virtual-ranks", str(R), "--model", "qwen3-30b-a3b", "--tokens", "16", "--iters", "2",
            "--json", str(tmp_path / "out.json")]
    cfg = config.make_config(_args(argv), R, gpu=True)
    from deep_ep.bench.check import reference_outputs
    expected = reference_outputs(cfg, [config.make_rank_inputs(cfg, r) for r in range(R)])
    _StandInGroup.cuda = cuda
    monkeypatch.setattr(_StandInBuffer, "cuda", cuda)
    monkeypatch.setattr(_StandInBuffer, "expected", expected)
    monkeypatch.setattr(_StandInBuffer, "skip_row", skip_row)
    groups = []
    monkeypatch.setattr(emulated, "EmulatedGroup", lambda n, device=None: groups.append(_StandInGroup(n)) or groups[-1])
    import deep_ep.buffer
    monkeypatch.setattr(deep_ep.buffer, "ElasticBuffer", _StandInBuffer)
    monkeypatch.setattr(cli, "gpu_available", lambda: True)
    monkeypatch.setattr(runner_gpu, "setup", lambda args: runner_gpu.GpuSetup(
        device=torch.device("cpu"), num_ranks=R, rank=0, emulated=True, multiprocess=False,
        runner=f"gpu/emulated x{R}", device_name="stand-in"))
    monkeypatch.setattr(runner_gpu, "CudaClock", _StandInCudaClock)
    floor_args = []
    monkeypatch.setattr(runner_gpu, "floor_us", lambda moved, written, device: floor_args.append(
        (moved, written)) or {"floor": 1000.0, "copy": 1000.0, "write": 600.0})

    code = cli.main(_args(argv))
    out = capsys.readouterr().out
    assert code == (0 if skip_row is None else 1), out
    lines = out.splitlines()
    assert f"[gpu] all {R} ranks in one CUDA graph per call: timed and checked" in lines
    title = next(i for i, line in enumerate(lines) if line.startswith(f"all {R} emulated ranks' calls in one CUDA graph"))
    assert "median of 20;" in lines[title] and "dispatch 1000.0 us, combine 1000.0 us" in lines[title]
    assert lines[title + 1: title + 3] == ["graph cached dispatch 1500.0 us (1.50x)", "graph combine 1500.0 us (1.50x)"]

    # captured by one thread (rank 0's), each rank acting on its own stream; no graph per rank
    (group,) = groups
    assert group.acted == [(r, f"rank{r}", "rank0") for r in range(R)] * 2
    begins = [i for i, e in enumerate(cuda.log) if e[0] == "begin"]
    ends = [i for i, e in enumerate(cuda.log) if e[0] == "end"]
    assert len(begins) == len(ends) == 2
    for begin, end in zip(begins, ends):   # each graph: one kernel per rank, on that rank's branch
        assert [e for e in cuda.log[begin:end] if e[0] == "kernel"] == [("kernel", r, f"rank{r}") for r in range(R)]
    result = json.loads((tmp_path / "out.json").read_text())
    graphs = result["gpu"]["rank_graphs"]
    assert {k: graphs[k] for k in ("ranks", "replays", "floor_dispatch_us", "cached_dispatch_us",
                                   "cached_dispatch_ratio", "combine_us", "combine_ratio")} == {
        "ranks": R, "replays": 20, "floor_dispatch_us": 1000.0, "cached_dispatch_us": 1500.0,
        "cached_dispatch_ratio": 1.5, "combine_us": 1500.0, "combine_ratio": 1.5}
    assert graphs["cached_dispatch_us_all"] == [1500.0] * 20
    assert all(row["calls"]["cached_dispatch"]["graph_us"] is None for row in result["rows"])
    # the floor: one copy (and one write) of every rank's bytes
    nbytes = config.floor_bytes(cfg, [config.make_rank_inputs(cfg, r)["topk_idx"] for r in range(R)], R)
    assert floor_args == [nbytes["dispatch"], nbytes["combine"]]
    assert (result["gpu"]["floor_dispatch_moved_bytes"], result["gpu"]["floor_dispatch_written_bytes"]) == \
        nbytes["dispatch"]
    assert result["gpu"]["floor_combine_written_bytes"] == nbytes["combine"][1]

    checked = [c["call"] for c in result["check"]["checked"] if c["when"] == "graph-replay"]
    assert checked == ["cached dispatch", "combine"]
    if skip_row is None:
        assert result["check"]["passed"], result["check"]["failures"]
    else:
        # only the replays leave the row alone: every rank's poisoned row shows, nothing else
        rows = {r: expected[r].dispatch.num_valid_rows for r in range(R)}
        assert sorted(result["check"]["failures"]) == sorted(
            [f"rank {r}, graph-replay cached dispatch: recv_x: 1 of {rows[r]} rows differ, first rows 3"
             for r in range(R)]
            + [f"rank {r}, graph-replay combine: combined_x: 1 of {cfg.tokens} rows differ, first rows 3"
               for r in range(R)])


# ---------------------------------------------------------------------------------------------
# EmulatedGroup.acting_as
# ---------------------------------------------------------------------------------------------


def test_acting_as_makes_the_rank_s_stream_current_and_refuses_host_barriers(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(("device", d))
        yield

    @contextlib.contextmanager
    def stream(s):
        entered.append(("stream", s))
        yield
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    group = object.__new__(emulated.EmulatedGroup)   # no CUDA here: the fields acting_as reads
    group.num_ranks, group.device = 3, torch.device("cuda", 0)
    group.compute_streams = ["stream of rank 0", "stream of rank 1", "stream of rank 2"]
    group.ranks = [emulated.EmulatedRankGroup(group, r) for r in range(3)]
    group._barrier = threading.Barrier(1)

    with group.acting_as(2) as rank_group:
        assert rank_group.rank() == 2 and rank_group.size() == 3
        assert entered == [("device", torch.device("cuda", 0)), ("stream", "stream of rank 2")]
        for barrier in (group.barrier, rank_group.barrier, lambda: rank_group.load_collectively("key", lambda: None)):
            with pytest.raises(RuntimeError, match=r"host barrier .* inside EmulatedGroup.acting_as\(2\)"):
                barrier()
        with pytest.raises(RuntimeError, match=r"acting_as\(1\) inside acting_as\(2\)"):
            with group.acting_as(1):
                pass
    with group.acting_as(0, stream="a branch") as rank_group:
        assert rank_group.rank() == 0 and entered[-1] == ("stream", "a branch")
    group.barrier()                        # outside acting_as: a plain barrier again
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got 3"):
        with group.acting_as(3):
            pass
    seen = []
    worker = threading.Thread(target=lambda: seen.append(emulated._acting.__dict__.get("rank")))
    with group.acting_as(1):
        worker.start()
        worker.join()
    assert seen == [None]                  # per thread: another thread is no rank's stand-in
