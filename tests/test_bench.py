"""Tests of the main job (`python -m deep_ep bench`) on CPU gloo ranks, and of its helpers.

The check is tested by altering the CPU backend inside the bench's processes (``cpu_worker_setup``)
with the defects the GPU kernels can be built with: the bench must name the rank, call, output and
rows, print no "all outputs match" line and exit 1.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from deep_ep import reference as ref
from deep_ep.bench import check as bench_check
from deep_ep.bench import cli, config, eplb as bench_eplb, fp8, progress, report, runner_gpu, session, sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
if not HAVE_MPL and os.environ.get("DEEP_EP_ALLOW_NO_MATPLOTLIB") != "1":
    # The plot tests must not pass by skipping: the test extra installs matplotlib.
    raise ImportError("tests/test_bench.py needs matplotlib (pip install -e '.[test]'); set "
                      "DEEP_EP_ALLOW_NO_MATPLOTLIB=1 to run the rest without the plot checks")
SMALL = ["--model", "qwen3-30b-a3b", "--ranks", "2", "--tokens", "48", "--iters", "2"]


def _run(args, tmp_path, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU machine
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "deep_ep", "bench", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def _args(argv=()):
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def _main_in_process(argv, capsys, monkeypatch, setup=None):
    """Run the bench in this process (its ranks are spawned processes); returns (exit code, stdout)."""
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    code = cli.main(_args(argv), cpu_worker_setup=setup)
    return code, capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------


def test_bench_cpu_default_model_json_and_plot(tmp_path):
    args = ["--ranks", "2", "--tokens", "64", "--iters", "2", "--json", "out.json"]
    if HAVE_MPL:
        args += ["--plot", "out.png"]
    proc, _wall = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    assert lines[0].startswith("deep_ep bench: deepseek-v3") and lines[1].startswith("runner: cpu/gloo")
    assert "dispatch GB/s" in out and "calls on rank 0" in out
    assert lines[-2 if not HAVE_MPL else -3] == "check: all outputs match deep_ep.reference"

    result = json.loads((tmp_path / "out.json").read_text())
    cfg = result["config"]
    assert (cfg["hidden"], cfg["num_experts"], cfg["top_k"], cfg["num_ranks"], cfg["tokens"]) == (7168, 256, 8, 2, 64)
    chk = result["check"]
    assert chk["enabled"] and chk["passed"] and chk["failures"] == [] and chk["mismatches"] == []
    assert [(c["when"], c["call"]) for c in chk["checked"]] == [
        (when, session.CALL_TITLES[name]) for when in ("first", "timed-loop") for name in session.CALLS]
    assert result["runner"] == "cpu/gloo"
    rows = result["rows"]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["check"] is True
        assert 64 <= r["sent"] <= 64 * 2  # each token reaches 1 or 2 ranks
        assert r["dispatch_bytes"] == r["sent"] * 2 * 7168
        assert r["combine_bytes"] == r["sent"] * 2 * 7168
        assert r["dispatch_us"] > 0 and r["combine_us"] > 0 and len(r["dispatch_us_all"]) == 2
        assert r["dispatch_gbps"] == pytest.approx(r["dispatch_bytes"] / 1e9 / (r["dispatch_us"] * 1e-6))
        assert r["floor_us"] is None and r["dispatch_ratio"] is None
        assert set(r["calls"]) == set(session.CALLS)
        for stats in r["calls"].values():
            assert stats["sync_us"] > 0 and len(stats["sync_us_all"]) == 2
            assert stats["host_us"] is None and stats["graph_us"] is None and stats["sync_ratio"] is None
        assert r["calls"]["full_dispatch_cpu_sync"]["sync_us"] == pytest.approx(r["dispatch_us"])
        assert r["calls"]["combine"]["sync_us"] == pytest.approx(r["combine_us"])
    # Everything sent is received somewhere.
    assert sum(r["sent"] for r in rows) == sum(r["received"] for r in rows)
    if HAVE_MPL:
        png = (tmp_path / "out.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cpu_fp8_expanded_imbalanced_bias(tmp_path):
    proc, _ = _run(["--model", "qwen3-30b-a3b", "--ranks", "2", "--tokens", "48", "--fp8", "--fp8-scale", "ue8m0",
                    "--expand", "--alignment", "16", "--routing", "imbalanced", "--hot-ratio", "1.5",
                    "--mask-prob", "0.2", "--bias", "2", "--iters", "1", "--json", "o.json"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "combine bias: 2 tensor(s)" in proc.stdout
    result = json.loads((tmp_path / "o.json").read_text())
    assert result["check"]["passed"] and result["config"]["bias"] == 2
    rows = result["rows"]
    assert sum(r["sent"] for r in rows) == sum(r["received"] for r in rows)
    for r in rows:
        assert r["received_rows"] % 16 == 0 and r["received_rows"] >= r["received"]
        assert r["dispatch_bytes"] == r["sent"] * (2048 + 4 * (2048 // 512))


def test_a_node_split_in_the_environment_is_timed_and_checked_as_nodes(tmp_path, monkeypatch):
    """EP_CPU_NUM_NVLINK_RANKS makes the gloo ranks act as nodes: the plain bench runs as with
    --nvlink-ranks (its check then holds the hybrid order), saying so."""
    monkeypatch.setenv("EP_CPU_NUM_NVLINK_RANKS", "2")
    proc, _ = _run(["--ranks", "4", "--tokens", "32", "--iters", "1"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "act as nodes of 2 (as with --nvlink-ranks 2)" in proc.stdout and "check: passed" in proc.stdout


def test_bench_bad_arguments_fail_fast(tmp_path):
    proc, wall = _run(["--model", "mixtral-8x7b", "--ranks", "3"], tmp_path)
    assert proc.returncode != 0 and "not divisible by 3 ranks" in proc.stderr
    proc, _ = _run(["--model", "gpt-oss-120b", "--fp8"], tmp_path)
    assert proc.returncode != 0 and "hidden % 128" in proc.stderr
    proc, _ = _run(["--routing", "imbalanced", "--hot-ratio", "9"], tmp_path)
    assert proc.returncode != 0 and "--hot-ratio" in proc.stderr
    proc, _ = _run(["--eplb", "3", "--ranks", "2"], tmp_path)
    assert proc.returncode != 0 and "259 physical slots, not divisible by 2 ranks" in proc.stderr


def test_progress_lines_come_first_and_in_order(capsys, monkeypatch):
    code, out = _main_in_process(SMALL + ["--warmup", "1"], capsys, monkeypatch)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("deep_ep bench: qwen3-30b-a3b") and lines[1].startswith("runner: cpu/gloo")
    assert lines[2] == "[cpu] starting 2 gloo processes"
    order = ["[cpu] rank 0: process group ready (2 ranks)", "[cpu] rank 0: reference computed",
             "[cpu] rank 0: first calls done and checked", "[cpu] rank 0: warm-up done",
             "[cpu] iteration 1/2", "[cpu] iteration 2/2", "[cpu] rank 0: timed-loop calls checked"]
    assert [line for line in lines if line.startswith("[cpu]")][1:] == order
    table = next(i for i, line in enumerate(lines) if line.startswith("rank  tokens"))
    assert table > lines.index(order[-1])


# ---------------------------------------------------------------------------------------------
# Checks that fail: defects of the CPU backend, applied inside the bench's processes
# ---------------------------------------------------------------------------------------------


def _defects_drop_row_and_combine_ulp():
    """Rank 1: a cached dispatch leaves received row 5 unwritten (it keeps the correct value unless
    outputs are poisoned: a stale correct value). Rank 0: combine's row 3 one bf16 ulp off; a full
    dispatch without CPU sync writes received row 7 to row 6 (a wrong row)."""
    from deep_ep.backends import cpu, outputs
    real_dispatch, real_combine = cpu.CPUBackend.dispatch, cpu.CPUBackend.combine

    def dispatch(self, data, sf, topk_idx, topk_weights, **kw):
        out = real_dispatch(self, data, sf, topk_idx, topk_weights, **kw)
        if self.rank == 0 and not kw["do_cpu_sync"] and kw.get("handle") is None:
            out[0][6] = out[0][7]
        if kw.get("handle") is None or self.rank != 1:
            return out
        recv_x = out[0]
        fresh = outputs.empty(tuple(recv_x.shape), recv_x.dtype, "cpu")
        keep = torch.ones(recv_x.shape[0], dtype=torch.bool)
        keep[5] = not outputs.is_poisoning()
        fresh[keep] = recv_x[keep]
        return (fresh,) + tuple(out[1:])

    def combine(self, x, handle, topk_weights, bias, **kw):
        combined, w = real_combine(self, x, handle, topk_weights, bias, **kw)
        if self.rank == 0:
            combined = combined.clone()
            combined.view(torch.int16)[3, 7] += 1
        return combined, w

    cpu.CPUBackend.dispatch, cpu.CPUBackend.combine = dispatch, combine


def test_check_reports_rows_of_defects_and_exits_nonzero(capsys, monkeypatch, tmp_path):
    code, out = _main_in_process(SMALL + ["--json", str(tmp_path / "o.json")], capsys, monkeypatch,
                                 _defects_drop_row_and_combine_ulp)
    assert code == 1, out
    assert "all outputs match" not in out
    assert "check: FAILED: 6 output(s) differ from deep_ep.reference" in out
    for line in ("rank 1, first cached dispatch: recv_x: 1 of ",
                 "rank 0, first full dispatch (no CPU sync): recv_x: 1 of ",
                 "rank 0, timed-loop full dispatch (no CPU sync): recv_x: 1 of ",
                 "rank 1, timed-loop cached dispatch: recv_x: 1 of ",
                 "rank 0, first combine: combined_x: 1 of 48 rows differ, first rows 3",
                 "rank 0, timed-loop combine: combined_x: 1 of 48 rows differ, first rows 3"):
        assert line in out, out
    assert out.count("rows differ, first rows 5") == 2 and out.count("rows differ, first rows 6") == 2
    result = json.loads((tmp_path / "o.json").read_text())
    assert not result["check"]["passed"] and [r["check"] for r in result["rows"]] == [False, False]
    m = result["check"]["mismatches"]
    assert {(x["rank"], x["call"], x["output"], x["count"], tuple(x["first_rows"])) for x in m} == {
        (1, "first cached dispatch", "recv_x", 1, (5,)), (1, "timed-loop cached dispatch", "recv_x", 1, (5,)),
        (0, "first combine", "combined_x", 1, (3,)), (0, "timed-loop combine", "combined_x", 1, (3,)),
        (0, "first full dispatch (no CPU sync)", "recv_x", 1, (6,)),
        (0, "timed-loop full dispatch (no CPU sync)", "recv_x", 1, (6,))}


def _defects_fp8_expanded():
    """Rank 0: cached FP8 dispatch skips scale factors of rows % 8 == 3; rank 1: combine ignores bias 0,
    full dispatch doubles the weights of top-k slot 0 (expanded: the rows of pairs from slot 0) and
    writes no rows for local expert 1."""
    from deep_ep.backends import cpu, outputs
    real_dispatch, real_combine = cpu.CPUBackend.dispatch, cpu.CPUBackend.combine

    def dispatch(self, data, sf, topk_idx, topk_weights, **kw):
        recv_x, idx, w, handle = real_dispatch(self, data, sf, topk_idx, topk_weights, **kw)
        if kw.get("handle") is not None and self.rank == 0:
            sf_out = outputs.empty(tuple(recv_x[1].shape), recv_x[1].dtype, "cpu")
            keep = torch.arange(sf_out.shape[0]) % 8 != 3
            sf_out[keep] = recv_x[1][keep]
            recv_x = (recv_x[0], sf_out)
        if kw.get("handle") is None and self.rank == 1:
            data_out = outputs.empty(tuple(recv_x[0].shape), recv_x[0].dtype, "cpu")
            from deep_ep import shapes
            experts = shapes.expanded_row_experts(handle.psum_num_recv_tokens_per_expert,
                                                  handle.num_unaligned_recv_tokens_per_expert, recv_x[0].shape[0])
            keep = experts != 1
            data_out[keep] = recv_x[0][keep]
            recv_x = (data_out, recv_x[1])
            w = w * 2   # every weight of the expanded rows (slot 0 of each pair)
        return recv_x, idx, w, handle

    def combine(self, x, handle, topk_weights, bias, **kw):
        return real_combine(self, x, handle, topk_weights, bias[1:] if self.rank == 1 else bias, **kw)

    cpu.CPUBackend.dispatch, cpu.CPUBackend.combine = dispatch, combine


def test_check_catches_stale_scale_factor_missing_bias_scaled_weight_skipped_expert(capsys, monkeypatch):
    code, out = _main_in_process(SMALL + ["--fp8", "--expand", "--bias", "1", "--iters", "1"], capsys, monkeypatch,
                                 _defects_fp8_expanded)
    assert code == 1, out
    assert "all outputs match" not in out
    fails = [line.strip() for line in out.splitlines() if line.startswith("  rank ")]
    assert any(f.startswith("rank 0, timed-loop cached dispatch: recv_x scale factors:") and "first rows 3, 11" in f
               for f in fails), fails
    assert any(f.startswith("rank 1, timed-loop combine: combined_x:") for f in fails), fails
    for call in ("first full dispatch (CPU sync)", "timed-loop full dispatch (no CPU sync)"):
        assert any(f.startswith(f"rank 1, {call}: recv_topk_weights:") for f in fails), fails
        assert any(f.startswith(f"rank 1, {call}: recv_x:") for f in fails), fails
    assert not any(f.startswith("rank 0, first full dispatch") for f in fails)


def _defect_rank1_raises():
    from deep_ep.backends import cpu
    real = cpu.CPUBackend.dispatch

    def dispatch(self, *args, **kw):
        if self.rank == 1:
            raise RuntimeError("injected failure on rank 1")
        return real(self, *args, **kw)
    cpu.CPUBackend.dispatch = dispatch


def test_a_failing_rank_is_reported_not_waited_for(capsys, monkeypatch):
    """Rank 1 raises inside its first (checked, poisoned) dispatch while rank 0 waits in the same
    call: the error reaches the parent at once (no barrier on the error path), naming the rank."""
    with pytest.raises(SystemExit, match=r"(?s)a bench rank failed:\nrank 1:.*injected failure on rank 1"):
        _main_in_process(SMALL, capsys, monkeypatch, _defect_rank1_raises)


# ---------------------------------------------------------------------------------------------
# EPLB pass, with a stand-in deep_ep.eplb (the real one is written separately)
# ---------------------------------------------------------------------------------------------


def _fake_eplb_module():
    def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus):
        E = weight.shape[1]
        count = torch.ones(E, dtype=torch.int64)
        for _ in range(num_replicas - E):          # replicate the expert with the most load per copy
            count[int(torch.argmax(weight[0] / count))] += 1
        slots = sorted(((float(weight[0, e]) / int(count[e]), e) for e in range(E) for _ in range(int(count[e]))),
                       reverse=True)
        per_gpu = num_replicas // num_gpus
        gpus = [[] for _ in range(num_gpus)]
        load = [0.0] * num_gpus
        for w, e in slots:                          # heaviest slot to the least-loaded GPU with room
            g = min((g for g in range(num_gpus) if len(gpus[g]) < per_gpu), key=lambda g: load[g])
            gpus[g].append(e)
            load[g] += w
        p2l = torch.tensor([e for g in gpus for e in g], dtype=torch.int64)
        l2p = torch.full((E, int(count.max())), -1, dtype=torch.int64)
        seen = [0] * E
        for p, e in enumerate(p2l.tolist()):
            l2p[e, seen[e]] = p
            seen[e] += 1
        return p2l.view(1, -1), l2p.view(1, E, -1), count.view(1, E)

    class ReplicaMap:
        def __init__(self, physical_to_logical, logical_to_physical, logical_count):
            self.l2p, self.count = logical_to_physical[0], logical_count[0]

        def map(self, topk_idx):
            flat = topk_idx.flatten()
            valid = flat >= 0
            e = flat.clamp_min(0)
            pick = torch.arange(flat.numel()) % self.count[e]
            return torch.where(valid, self.l2p[e, pick], flat).view_as(topk_idx)

    return types.SimpleNamespace(rebalance_experts=rebalance_experts, ReplicaMap=ReplicaMap)


def test_eplb_pass_balances_and_is_checked(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deep_ep.eplb", _fake_eplb_module())
    code, out = _main_in_process(SMALL + ["--tokens", "64", "--routing", "zipf", "--zipf-alpha", "1.2", "--eplb", "16",
                                          "--iters", "1", "--json", str(tmp_path / "o.json")], capsys, monkeypatch)
    assert code == 0, out
    assert "EPLB: 16 redundant expert slots" in out and "[cpu] eplb: rank 0: first calls done and checked" in out
    assert "EPLB: 16 redundant slots, 144 physical experts" in out
    assert "check: all outputs match deep_ep.reference" in out
    result = json.loads((tmp_path / "o.json").read_text())
    sec = result["eplb"]
    assert sec["num_physical_experts"] == 144 and len(sec["ranks"]) == 2
    assert sum(r["pairs_before"] for r in sec["ranks"]) == sum(r["pairs_after"] for r in sec["ranks"])
    assert sec["pairs_max_over_mean_after"] < sec["pairs_max_over_mean_before"]
    assert [r["received"] for r in result["passes"]["eplb"]["rows"]] == [r["received_after"] for r in sec["ranks"]]
    assert {c["phase"] for c in result["check"]["checked"]} == {"logical", "eplb"}


def test_eplb_missing_module_or_names_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep.eplb", None)
    with pytest.raises(SystemExit, match="--eplb needs deep_ep.eplb"):
        bench_eplb.require_eplb()
    monkeypatch.setitem(sys.modules, "deep_ep.eplb", types.SimpleNamespace(rebalance_experts=None))
    with pytest.raises(SystemExit, match="deep_ep.eplb.ReplicaMap"):
        bench_eplb.require_eplb()


def test_eplb_mapping_validation():
    logical = torch.tensor([[0, 1, -1], [2, 2, 3]])
    p2l = torch.tensor([[0, 1, 2, 3, 2]])
    bench_eplb.check_mapping(torch.tensor([[0, 1, -1], [2, 4, 3]]), logical, p2l, 5)
    for bad, match in ((torch.tensor([[0, 1, 0], [2, 4, 3]]), "-1 entries"),
                       (torch.tensor([[0, 1, -1], [2, 5, 3]]), "outside"),
                       (torch.tensor([[0, 1, -1], [3, 4, 3]]), "another expert"),
                       (torch.tensor([[0, 1, -1], [2, 4, 3]], dtype=torch.int32), "returned")):
        with pytest.raises(SystemExit, match=match):
            bench_eplb.check_mapping(bad, logical, p2l, 5)


# ---------------------------------------------------------------------------------------------
# Helpers (no processes)
# ---------------------------------------------------------------------------------------------


def test_token_copies_and_bytes():
    idx = torch.tensor([[0, 1, 5], [4, 7, -1], [-1, -1, -1], [2, 6, 3]])
    # 8 experts over 2 ranks: rank 0 owns 0-3, rank 1 owns 4-7.
    assert config.token_copies(idx, 8, 2, expand=False) == [2, 3]
    assert config.token_copies(idx, 8, 2, expand=True) == [4, 4]
    assert config.logical_bytes(idx, 8, 2, False, 10) == 50
    assert config.bandwidth_gbps(2e9, 0.5) == 4.0


def test_fp8_roundtrip():
    x = torch.randn(5, 1024).to(torch.bfloat16)
    for fmt in ("fp32", "ue8m0"):
        data, sf = fp8.quantize_fp8(x, fmt)
        assert data.dtype == torch.float8_e4m3fn
        assert sf.dtype == (torch.float32 if fmt == "fp32" else torch.int32)
        assert sf.shape == (5, 8 if fmt == "fp32" else 2)
        back = fp8.dequantize_fp8((data, sf), fmt).float()
        assert ((back - x.float()).abs() <= 0.07 * x.float().abs().amax(-1, keepdim=True)).all()


def test_config_defaults_new_options_and_table():
    cfg = config.make_config(_args(), 4, gpu=False)
    assert (cfg.tokens, cfg.iters, cfg.hidden) == (config.CPU_DEFAULT_TOKENS, config.CPU_DEFAULT_ITERS, 7168)
    assert (cfg.bias, cfg.combine_check, cfg.eplb) == (0, "exact", 0)
    assert config.make_config(_args(), 8, gpu=True).tokens == config.GPU_DEFAULT_TOKENS
    cfg2 = config.make_config(_args(["--bias", "2", "--combine-check", "tolerant", "--eplb", "32"]), 4, gpu=False)
    assert (cfg2.bias, cfg2.combine_check, cfg2.eplb) == (2, "tolerant", 32)
    with pytest.raises(SystemExit):
        _args(["--bias", "3"])
    inputs = config.make_rank_inputs(config.make_config(_args(["--model", "qwen3-30b-a3b", "--tokens", "6",
                                                                "--bias", "2"]), 2, gpu=False), 1)
    assert len(inputs["biases"]) == 2 and inputs["biases"][1].shape == (6, 2048)
    assert not torch.equal(inputs["biases"][0], inputs["biases"][1])
    row = report.make_row(cfg, 0, sent=10, received=12, received_rows=12, dispatch_times=[1e-3, 3e-3, 2e-3],
                          combine_times=[1e-3], check=True)
    assert row["dispatch_us"] == pytest.approx(2000.0)
    assert row["dispatch_gbps"] == pytest.approx(10 * 2 * 7168 / 1e9 / 2e-3)
    table = report.format_table([row])
    assert "n/a" in table and "ok" in table and "dispatch GB/s" in table
    gpu_row = report.make_row(cfg, 1, sent=1, received=1, received_rows=1, dispatch_times=[2e-6],
                              combine_times=[4e-6], check=None, floor_us=1.0)
    assert gpu_row["dispatch_ratio"] == pytest.approx(2.0) and gpu_row["combine_ratio"] == pytest.approx(4.0)


def _fake_samples(sync, host=None, event=None, n=3):
    return [{"sync_s": sync * (1 + i % 2), "host_s": None if host is None else host,
             "event_s": None if event is None else event * (1 + i % 2)} for i in range(n)]


def test_call_stats_rows_and_calls_table_from_fake_timings():
    """The GPU path's per-call numbers and ratios, from fake timings (the GPU runner feeds real ones)."""
    cfg = config.make_config(_args(["--tokens", "64"]), 1, gpu=True)
    samples = {"full_dispatch_cpu_sync": _fake_samples(400e-6, 50e-6, 390e-6),
               "full_dispatch_no_cpu_sync": _fake_samples(150e-6, 30e-6, 140e-6),
               "cached_dispatch": _fake_samples(50e-6, 20e-6, 45e-6),
               "combine": _fake_samples(60e-6, 15e-6, 55e-6)}
    extra = {name: {"b2b_s": 40e-6, "b2b_host_s": 18e-6} for name in session.CALLS}
    extra["cached_dispatch"]["graph_us"] = 35.0
    extra["combine"]["graph_us"] = 42.0
    res = {"rank": 0, "sent": 64, "received": 64, "received_rows": 64, "samples": samples, "extra": extra,
           "checked": [], "mismatches": []}
    floors = {"dispatch": 20.0, "combine": 30.0}
    row = report.rank_row(cfg, res, floors)
    row.update(runner_gpu.legacy_keys(row))
    c = row["calls"]
    # medians of [x, 2x, x] = x
    assert c["full_dispatch_cpu_sync"]["sync_us"] == pytest.approx(400.0)
    assert c["full_dispatch_cpu_sync"]["sync_ratio"] == pytest.approx(20.0)
    assert c["full_dispatch_no_cpu_sync"]["host_ratio"] == pytest.approx(1.5)
    assert c["cached_dispatch"]["graph_ratio"] == pytest.approx(35.0 / 20.0)
    assert c["combine"]["graph_ratio"] == pytest.approx(42.0 / 30.0)
    assert c["combine"]["b2b_us"] == pytest.approx(40.0) and c["combine"]["b2b_ratio"] == pytest.approx(40 / 30)
    assert c["full_dispatch_cpu_sync"]["graph_us"] is None and c["full_dispatch_cpu_sync"]["graph_ratio"] is None
    # The main table: event times; the combine ratio against the combine floor.
    assert row["dispatch_us"] == pytest.approx(390.0) and row["combine_us"] == pytest.approx(55.0)
    assert row["dispatch_ratio"] == pytest.approx(390 / 20) and row["combine_ratio"] == pytest.approx(55 / 30)
    assert row["cached_dispatch_graph_us"] == 35.0 and row["combine_host_b2b_us"] == pytest.approx(18.0)
    text = report.format_calls(row, floors, {"torch_permute_us": 337.0, "torch_unpermute_us": 90.0})
    lines = text.splitlines()
    assert "dispatch 20.0 us, combine 30.0 us" in lines[0]
    assert lines[1].split() == ["call", "synchronised", "back", "to", "back", "graph", "replay", "host"]
    cached = next(line for line in lines if line.startswith("cached dispatch "))
    assert cached.split()[2:] == ["50.0", "(2.50x)", "40.0", "(2.00x)", "35.0", "(1.75x)", "20.0", "(1.00x)"]
    full = next(line for line in lines if line.startswith("full dispatch (CPU sync)"))
    assert full.split()[4:] == ["400.0", "(20.00x)", "40.0", "(2.00x)", "n/a", "50.0", "(2.50x)"]
    assert lines[-1] == "plain torch at EP=1: permute 337.0 us (16.85x), weighted un-permute 90.0 us (3.00x)"
    ref = report.format_calls(row, floors, {"torch_permute_us": 337.0, "torch_unpermute_us": 90.0,
                                            "host_ref_alloc_us": 2.54, "host_ref_launch_us": 4.06})
    assert ref.splitlines()[-1] == ("host reference (this process, for the host column): a cached torch.empty "
                                    "2.5 us, a torch kernel launch 4.1 us")
    # No floor (CPU): plain numbers.
    cpu_text = report.format_calls(report.rank_row(cfg, res, None), None, None)
    assert "no floor on CPU" in cpu_text and "x)" not in cpu_text


def test_back_to_back_timing_with_a_fake_session():
    calls = []

    class FakeSession:
        rank = 0
        clock = session.HostClock()
        barrier = staticmethod(lambda: calls.append("barrier"))
        progress = progress.Progress("gpu", enabled=False)
        extra = {name: {} for name in session.CALLS}

        def call(self, name):
            calls.append(name)

    sess = FakeSession()
    runner_gpu._back_to_back(sess, 3)
    assert calls == [x for name in session.CALLS for x in ["barrier", name, name, name]]
    for name in session.CALLS:
        assert sess.extra[name]["b2b_s"] >= sess.extra[name]["b2b_host_s"] >= 0


class _StandInGraph:
    """A CUDA graph stand-in: a replay calls ``fn`` again and copies its fresh outputs into the static
    outputs of the capture (``skip_row``: a row the copy leaves alone, a defect)."""

    def __init__(self, fn, static, skip_row):
        self.fn, self.static, self.skip_row = fn, static, skip_row

    def replay(self):
        fresh = self.fn()
        pairs = []
        for dst, src in zip(self.static[:3], fresh[:3]):   # received / combined rows, indices, weights
            if isinstance(src, tuple):
                pairs += list(zip(dst, src))
            elif isinstance(src, torch.Tensor):
                pairs.append((dst, src))
        if len(fresh) == 5 and fresh[3].topk_idx is not self.static[3].topk_idx:
            self.static[3].topk_idx.copy_(fresh[3].topk_idx)   # a fresh dispatch's copy of the routing
        for dst, src in pairs:
            keep = torch.ones(dst.shape[0], dtype=torch.bool)
            if self.skip_row is not None:
                keep[self.skip_row] = False
            dst[keep] = src[keep]


class _StandInCudaClock(session.HostClock):
    def time_call(self, fn):
        out, sample = super().time_call(fn)
        return out, {**sample, "host_s": sample["sync_s"] / 2, "event_s": sample["sync_s"]}


@pytest.mark.parametrize("skip_row", [None, 7])
def test_gpu_runner_pass_with_cpu_stand_ins(skip_row, monkeypatch, tmp_path, capsys):
    """`runner_gpu.run_pass` end to end on a one-rank gloo group, with CPU stand-ins for CUDA events,
    graphs and the floor: the calls table, the legacy keys, and the check of a graph replay (whose
    static outputs are poisoned first, so a replay that leaves a row alone is caught)."""
    import torch.distributed as dist

    def capture_calls(fn, calls):
        static = fn()
        return _StandInGraph(fn, static, skip_row if len(static) == 5 else None), static

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        monkeypatch.setattr(runner_gpu, "single_rank_nccl_group", lambda device: dist.group.WORLD)
        monkeypatch.setattr(runner_gpu, "CudaClock", _StandInCudaClock)
        # the floor's two parts, the slower taken (the run also records each); the bytes asked for
        floor_args = []
        monkeypatch.setattr(runner_gpu, "floor_us", lambda moved, written, device: floor_args.append(
            (moved, written)) or {"floor": 10.0 if moved else 0.0, "copy": 10.0 if moved else 0.0,
                                  "write": 8.0 if written else 0.0})
        monkeypatch.setattr(runner_gpu, "torch_baselines_us",
                            lambda cfg, inputs, device: {"torch_permute_us": 30.0, "torch_unpermute_us": 20.0})
        monkeypatch.setattr(runner_gpu, "capture_calls", capture_calls)
        monkeypatch.setattr(runner_gpu, "time_graph", lambda graph, calls, iters, barrier: 12.5)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        cfg = config.make_config(_args(["--model", "qwen3-30b-a3b", "--tokens", "32", "--iters", "2",
                                        "--bias", "1"]), 1, gpu=True)
        gs = runner_gpu.GpuSetup(device=torch.device("cpu"), num_ranks=1, rank=0, emulated=False,
                                 multiprocess=False, runner="gpu/nccl x1", device_name="stand-in")
        p = runner_gpu.run_pass(cfg, gs, config.Workload(cfg), progress.Progress("gpu"))
    finally:
        dist.destroy_process_group()
    out = capsys.readouterr().out
    assert "[gpu] rank 0: back-to-back calls done (20 of each)" in out
    assert "[gpu] rank 0: CUDA graphs timed and checked" in out
    result = report.assemble(cfg, [p], runner=gs.runner, device=gs.device_name)
    row = result["rows"][0]
    assert row["cached_dispatch_graph_us"] == 12.5 and row["combine_graph_us"] == 12.5
    assert row["calls"]["combine"]["graph_ratio"] == pytest.approx(1.25)
    assert row["calls"]["cached_dispatch"]["host_us"] == pytest.approx(row["calls"]["cached_dispatch"]["sync_us"] / 2)
    assert row["calls"]["full_dispatch_cpu_sync"]["graph_us"] is None
    text = report.format_report(result)
    assert "plain torch at EP=1: permute 30.0 us (3.00x), weighted un-permute 20.0 us (2.00x)" in text
    assert ("floor (the slower of a D2D copy with the same HBM traffic and a write of the same output bytes): "
            "dispatch 10.0 us (copy 10.0, write 8.0), combine 10.0 us (copy 10.0, write 8.0)") in text
    assert result["gpu"]["floor_dispatch_write_us"] == 8.0 and result["gpu"]["floor_combine_copy_us"] == 10.0
    # dispatch: a copy of (tokens + copies) / 2 rows each way, a write of one row per copy; combine:
    # the same copy, a write of one row per token
    idx = config.Workload(cfg).inputs(0)["topk_idx"]
    copies, tokens = config.written_rows(idx, cfg.num_experts, 1, cfg.expand)
    moved = config.floor_rows(idx, cfg.num_experts, 1, cfg.expand)
    assert floor_args == [(int(moved * cfg.dispatch_bytes_per_token), copies * cfg.dispatch_bytes_per_token),
                          (int(moved * cfg.combine_bytes_per_token), tokens * cfg.combine_bytes_per_token)]
    # the host's yardstick, measured in the same process (here on the CPU stand-in)
    assert result["baselines"]["host_ref_alloc_us"] > 0 and result["baselines"]["host_ref_launch_us"] > 0
    assert "host reference (this process, for the host column): a cached torch.empty" in text
    graph_checks = [c for c in result["check"]["checked"] if c["when"] == "graph-replay"]
    # at EP=1 the full dispatch without CPU sync is replayed from a graph too
    assert [c["call"] for c in graph_checks] == ["cached dispatch", "combine", "full dispatch (no CPU sync)"]
    assert row["calls"]["full_dispatch_no_cpu_sync"]["graph_us"] == 12.5
    if skip_row is None:
        assert result["check"]["passed"], result["check"]["failures"]
    else:
        # every output the replay rewrites was poisoned: the row left alone shows in each
        rows = row["received_rows"]
        assert result["check"]["failures"] == [
            f"rank 0, graph-replay cached dispatch: recv_x: 1 of {rows} rows differ, first rows 7"] + [
            f"rank 0, graph-replay full dispatch (no CPU sync): {name}: 1 of {rows} rows differ, first rows 7"
            for name in ("recv_x", "recv_topk_idx", "recv_topk_weights")]


def test_check_verdict_text():
    base = {"enabled": True, "comparison": "bit for bit",
            "checked": [{"when": "first", "call": "combine", "phase": "logical"},
                        {"when": "graph-replay", "call": "combine", "phase": "logical"},
                        {"when": "first", "call": "combine", "phase": "eplb"}]}
    ok = report.format_check({**base, "passed": True, "failures": []})
    assert ok.splitlines() == ["checked on every rank (bit for bit, outputs poisoned): first: combine; "
                               "graph-replay: combine; first [eplb]: combine",
                               "check: all outputs match deep_ep.reference"]
    failures = [f"rank 0, first combine: combined_x: 1 of 9 rows differ, first rows {i}" for i in range(25)]
    bad = report.format_check({**base, "passed": False, "failures": failures}).splitlines()
    assert bad[1] == "check: FAILED: 25 output(s) differ from deep_ep.reference"
    assert len(bad) == 2 + report.MAX_MISMATCH_LINES + 1 and bad[-1].startswith("  ... and 5 more")
    assert "all outputs match" not in "\n".join(bad)
    assert report.format_check({"enabled": False}) == "check: not checked (--no-check)"


def test_progress_marks_and_sink():
    assert progress.iteration_marks(5) == {1, 2, 3, 4, 5}
    marks = progress.iteration_marks(50)
    assert len(marks) <= 11 and 50 in marks and 5 in marks
    got = []
    p = progress.Progress("cpu", sink=got.append)
    p.say("rank 0: warm-up done")
    p.child("eplb").say("x")
    done = p.loop("iteration", 3)
    for i in (1, 2, 3):
        done(i)
    progress.Progress("cpu", sink=got.append, enabled=False).say("hidden")
    assert got == ["[cpu] rank 0: warm-up done", "[cpu] eplb: x", "[cpu] iteration 1/3", "[cpu] iteration 2/3",
                   "[cpu] iteration 3/3"]


def test_gpu_hook_errors_cleanly(monkeypatch):
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        cli.use_gpu_runner(_args(["--device", "cuda"]))
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        cli.use_gpu_runner(_args(["--virtual-ranks", "8"]))
    assert not cli.use_gpu_runner(_args())
    monkeypatch.setattr(cli, "gpu_available", lambda: True)
    assert cli.use_gpu_runner(_args(["--virtual-ranks", "8"]))


def _expected(cfg, rank):
    inputs = [config.make_rank_inputs(cfg, s) for s in range(cfg.num_ranks)]
    return inputs, bench_check.reference_outputs(cfg, inputs)[rank]


@pytest.mark.parametrize("expand,fp8_on", [(False, False), (True, True)])
def test_checker_detects_every_kind_of_difference(expand, fp8_on):
    argv = ["--model", "qwen3-30b-a3b", "--tokens", "16", "--alignment", "4", "--mask-prob", "0.2", "--bias", "1"]
    cfg = config.make_config(_args(argv + (["--expand"] if expand else []) + (["--fp8"] if fp8_on else [])), 2,
                             gpu=False)
    inputs, exp = _expected(cfg, 1)
    assert torch.equal(inputs[1]["topk_idx"], config.make_rank_inputs(cfg, 1)["topk_idx"])  # shared seed
    good = exp.dispatch.as_tuple()

    def run(fn, *args, **kw):
        c = bench_check.Checker(cfg, 1, exp)
        getattr(c, fn)("first", "x", *args, **kw)
        return c.mismatches

    assert run("dispatch", good) == [] and run("combine", (exp.combined_x, None)) == []
    assert run("dispatch", exp.dispatch_no_sync.as_tuple(), cpu_sync=False) == []
    cached = (good[0], good[1], None, good[3])
    assert run("dispatch", cached, cached=True) == []       # a cached dispatch given no weights returns None
    (m,) = run("dispatch", good, cached=True)
    assert m.output == "recv_topk_weights" and "must return None" in m.note

    data = good[0][0] if fp8_on else good[0]
    bad_data = data.clone()
    bad_data.view(torch.uint8)[2, 0] ^= 1
    bad_data.view(torch.uint8)[5, 3] ^= 1
    bad_x = (bad_data, good[0][1]) if fp8_on else bad_data
    (m,) = run("dispatch", (bad_x, *good[1:]))
    assert (m.rank, m.call, m.output, m.count, m.first_rows) == (1, "first x", "recv_x", 2, [2, 5])
    assert str(m) == f"rank 1, first x: recv_x: 2 of {exp.dispatch.num_valid_rows} rows differ, first rows 2, 5"
    handle = good[3].clone()
    handle.recv_src_metadata[0, 0] += 1
    handle.num_recv_tokens += 1
    names = {m.output for m in run("dispatch", (*good[:3], handle))}
    assert names == {"handle.recv_src_metadata", "handle.num_recv_tokens"}
    handle = good[3].clone()
    handle.num_recv_tokens_per_expert_list = torch.tensor(handle.num_recv_tokens_per_expert_list)
    (m,) = run("dispatch", (*good[:3], handle))
    assert m.output == "handle.num_recv_tokens_per_expert_list" and m.note == "got Tensor, expected list"
    (m,) = run("dispatch", (good[0], good[1], None, good[3]))
    assert m.output == "recv_topk_weights" and "got None" in m.note
    if fp8_on:
        sf = good[0][1].clone()
        sf.view(torch.uint8)[3, 0] ^= 1
        (m,) = run("dispatch", ((good[0][0], sf), good[1], None, good[3]), cached=True)
        assert m.output == "recv_x scale factors" and m.first_rows == [3]
    off = exp.combined_x.clone()
    off.view(torch.int16)[4, 1] += 1                           # one ulp
    (m,) = run("combine", (off, None))
    assert m.output == "combined_x" and m.first_rows == [4]
    tolerant = bench_check.Checker(config.BenchConfig(**{**cfg.__dict__, "combine_check": "tolerant"}), 1, exp)
    tolerant.combine("first", "x", (off, None))
    assert tolerant.mismatches == []
    off[6, 0] = float("nan")
    tolerant.combine("first", "x", (off, None))
    assert [m.first_rows for m in tolerant.mismatches] == [[6]]


def test_reference_outputs_match_reference_module():
    cfg = config.make_config(_args(["--model", "qwen3-30b-a3b", "--tokens", "8", "--bias", "2"]), 2, gpu=False)
    inputs, exp = _expected(cfg, 0)
    sync = ref.reference_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                                  [i["topk_weights"] for i in inputs], cfg.num_experts,
                                  num_max_tokens_per_rank=cfg.max_tokens)
    ys = [config.expert_output(cfg, r.recv_x, rank) for rank, r in enumerate(sync)]
    want = ref.reference_combine(ys, [r.handle for r in sync], biases=[i["biases"] for i in inputs])[0][0]
    assert torch.equal(exp.combined_x.view(torch.int16), want.view(torch.int16))
    # each rank's expert outputs: its received rows times 1 + (rank + 1) / 16, so ranks' rows differ
    assert torch.equal(exp.combine_input.view(torch.int16),
                       (sync[0].recv_x.float() * 1.0625).to(torch.bfloat16).view(torch.int16))
    assert not torch.equal(ys[1], (sync[1].recv_x.float() * 1.0625).to(torch.bfloat16))
    assert exp.dispatch_no_sync.recv_topk_idx.shape[0] == 2 * cfg.max_tokens


def test_poison_in_place_and_differing_rows():
    a = torch.zeros(4, 3, dtype=torch.bfloat16)
    i = torch.zeros(4, dtype=torch.int32)
    bench_check.poison_in_place((a, None), i, None)
    assert torch.isnan(a.float()).all() and (i == -1515870811).all()
    want = torch.zeros(4, 3)
    got = want.clone()
    got[1, 2] = -0.0                                         # bitwise different, numerically equal
    assert bench_check.differing_rows(got, want).tolist() == [1]
    assert bench_check.differing_rows(got, want, tolerant=True).tolist() == []


def test_floor_rows_counts_reads_and_writes():
    """The floor copy matches a dispatch's HBM traffic: each selected token read once, one row
    written per copy; a copy reads and writes each row, so (tokens + copies) / 2 rows."""
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [-1, -1, -1, -1], [0, 7, 7, -1]])
    # 8 experts on 2 ranks (4 each): non-expanded copies = tokens per destination rank
    assert config.token_copies(idx, 8, 2, False) == [2, 2]          # rank 0: tokens 0, 3; rank 1: tokens 1, 3
    assert config.floor_rows(idx, 8, 2, False) == (4 + 3) / 2       # 3 tokens with a selection
    assert config.token_copies(idx, 8, 2, True) == [5, 4]           # valid pairs per rank
    assert config.floor_rows(idx, 8, 2, True) == (9 + 3) / 2
    assert config.floor_rows(idx, 8, 1, False) == 3                 # EP=1: one copy per token
    assert config.floor_rows(idx[:0], 8, 2, False) == 0


def test_sm_sweep_parse_table_and_cpu_refusal(tmp_path, monkeypatch):
    assert sweep.parse_sm_sweep("16,32,64") == [16, 32, 64] and sweep.parse_sm_sweep(None) == []
    for bad in ("16,x", "0", "8,-2"):
        with pytest.raises(SystemExit, match="--sm-sweep takes positive SM counts"):
            sweep.parse_sm_sweep(bad)
    points = [{"num_sms": n, "dispatch_us_max": 700.0 - n, "combine_us_max": 800.0 - n, "dispatch_gbps_mean": 100.0 + n,
               "combine_gbps_mean": 90.0 + n, "cached_dispatch_graph_us": 600.0 - n, "combine_graph_us": None,
               "check_passed": True} for n in (18, 32, 64)]
    table = sweep.format_sm_sweep(points).splitlines()
    assert len(table) == 5 and table[2].split()[0] == "18" and table[4].split()[-1] == "ok"
    assert "n/a" in table[3]  # combine graph time missing
    if HAVE_MPL:
        from deep_ep.bench import plot
        plot.plot_sm_sweep(str(tmp_path / "sweep.png"), points, "test")
        assert (tmp_path / "sweep.png").stat().st_size > 1000
    monkeypatch.setattr(cli, "gpu_available", lambda: False)
    with pytest.raises(SystemExit, match="needs the GPU runner"):
        cli.main(_args(["--device", "cpu", "--sm-sweep", "16,32"]))


def test_fp8_scale_without_fp8_refused():
    with pytest.raises(SystemExit, match="add --fp8"):
        config.make_config(_args(["--device", "cpu", "--fp8-scale", "ue8m0"]), 2, gpu=False)


def test_floor_is_the_slower_of_copy_and_write(monkeypatch):
    """`gpu_timing.floor_us`: the slower of a copy with the operation's traffic and a fill of its
    written bytes (whichever is slower on the card: an operation that mostly writes may be bound by
    the write)."""
    from deep_ep.bench import gpu_timing
    seen = []
    monkeypatch.setattr(gpu_timing, "copy_floor_us", lambda n, device: seen.append(("copy", n)) or 128.2)
    monkeypatch.setattr(gpu_timing, "write_floor_us", lambda n, device: seen.append(("write", n)) or 140.7)
    assert gpu_timing.floor_us(100, 800, "dev") == {"floor": 140.7, "copy": 128.2, "write": 140.7}
    assert seen == [("copy", 100), ("write", 800)]
    monkeypatch.setattr(gpu_timing, "write_floor_us", lambda n, device: 17.6)
    assert gpu_timing.floor_us(100, 50, "dev")["floor"] == 128.2


def test_written_rows_counts_copies_and_tokens():
    """`config.written_rows`: a dispatch writes one row per copy (per destination rank, or per valid
    pair when expanded), combine one per token with a valid expert."""
    idx = torch.tensor([[0, 1, 5], [4, 6, -1], [-1, -1, -1], [2, 7, 3]])   # 8 experts on 2 ranks
    assert config.written_rows(idx, 8, 2, expand=False) == (2 + 1 + 0 + 2, 3)
    assert config.written_rows(idx, 8, 2, expand=True) == (3 + 2 + 0 + 3, 3)


def test_the_floors_time_their_operations_back_to_back(monkeypatch):
    """`copy_floor_us` / `write_floor_us` on CPU with stand-in CUDA events: each rotates over its
    buffers (8 of 16 bytes for a small size), runs its operation ``iters`` times per round, and
    returns the median round divided by ``iters``."""
    from deep_ep.bench import gpu_timing
    elapsed = iter([4.0, 8.0, 6.0, 2.0, 10.0] * 2)   # ms per round; median 6.0

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return next(elapsed)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(gpu_timing, "spin_up", lambda: None)
    fills = []
    real_fill = torch.Tensor.fill_
    monkeypatch.setattr(torch.Tensor, "fill_",
                        lambda t, v: fills.append((t.data_ptr(), int(v), t.dtype, t.nbytes)) or real_fill(t, v))
    assert gpu_timing.copy_floor_us(10, "cpu", iters=4) == pytest.approx(6.0 * 1e3 / 4)
    assert gpu_timing.write_floor_us(10, "cpu", iters=3) == pytest.approx(6.0 * 1e3 / 3)
    assert len(fills) == 15 and [f[1] for f in fills[:3]] == [0, 1, 2]
    # 8-byte elements (the fastest fill measured), covering at least the bytes asked for
    assert all(f[2] == torch.int64 and f[3] >= 10 for f in fills)
    ptrs = [f[0] for f in fills]
    assert len(set(ptrs[:3])) == 3 and ptrs[3:6] == ptrs[:3]   # buffers 0, 1, 2 again each round
