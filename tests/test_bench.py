"""Tests of the main job (`python -m deep_ep bench`) on CPU gloo ranks, and its helpers."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from deep_ep import bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _run(args, tmp_path, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU machine
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "deep_ep", "bench", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def test_bench_cpu_default_model_json_and_plot(tmp_path):
    args = ["--ranks", "2", "--tokens", "64", "--iters", "2", "--json", "out.json"]
    if HAVE_MPL:
        args += ["--plot", "out.png"]
    proc, wall = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert wall < 60
    out = proc.stdout
    assert "deepseek-v3" in out and "dispatch GB/s" in out and "all outputs match" in out

    result = json.loads((tmp_path / "out.json").read_text())
    cfg = result["config"]
    assert (cfg["hidden"], cfg["num_experts"], cfg["top_k"], cfg["num_ranks"], cfg["tokens"]) == (7168, 256, 8, 2, 64)
    assert result["check"] == {"enabled": True, "passed": True, "failures": []}
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
    # Everything sent is received somewhere.
    assert sum(r["sent"] for r in rows) == sum(r["received"] for r in rows)
    if HAVE_MPL:
        png = (tmp_path / "out.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cpu_fp8_expanded_imbalanced(tmp_path):
    proc, _ = _run(["--model", "qwen3-30b-a3b", "--ranks", "2", "--tokens", "48", "--fp8", "--fp8-scale", "ue8m0",
                    "--expand", "--alignment", "16", "--routing", "imbalanced", "--hot-ratio", "1.5",
                    "--mask-prob", "0.2", "--iters", "1", "--json", "o.json"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "o.json").read_text())
    assert result["check"]["passed"]
    rows = result["rows"]
    assert sum(r["sent"] for r in rows) == sum(r["received"] for r in rows)
    for r in rows:
        assert r["received_rows"] % 16 == 0 and r["received_rows"] >= r["received"]
        assert r["dispatch_bytes"] == r["sent"] * (2048 + 4 * (2048 // 512))


def test_bench_bad_arguments_fail_fast(tmp_path):
    proc, wall = _run(["--model", "mixtral-8x7b", "--ranks", "3"], tmp_path)
    assert proc.returncode != 0 and "not divisible by 3 ranks" in proc.stderr
    proc, _ = _run(["--model", "gpt-oss-120b", "--fp8"], tmp_path)
    assert proc.returncode != 0 and "hidden % 128" in proc.stderr
    proc, _ = _run(["--routing", "imbalanced", "--hot-ratio", "9"], tmp_path)
    assert proc.returncode != 0 and "--hot-ratio" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Helpers (no processes)
# ---------------------------------------------------------------------------------------------


def test_token_copies_and_bytes():
    idx = torch.tensor([[0, 1, 5], [4, 7, -1], [-1, -1, -1], [2, 6, 3]])
    # 8 experts over 2 ranks: rank 0 owns 0-3, rank 1 owns 4-7.
    assert bench.token_copies(idx, 8, 2, expand=False) == [2, 3]
    assert bench.token_copies(idx, 8, 2, expand=True) == [4, 4]
    assert bench.logical_bytes(idx, 8, 2, False, 10) == 50
    assert bench.bandwidth_gbps(2e9, 0.5) == 4.0


def test_fp8_roundtrip():
    x = torch.randn(5, 1024).to(torch.bfloat16)
    for fmt in ("fp32", "ue8m0"):
        data, sf = bench.quantize_fp8(x, fmt)
        assert data.dtype == torch.float8_e4m3fn
        assert sf.dtype == (torch.float32 if fmt == "fp32" else torch.int32)
        assert sf.shape == (5, 8 if fmt == "fp32" else 2)
        back = bench.dequantize_fp8((data, sf), fmt).float()
        assert ((back - x.float()).abs() <= 0.07 * x.float().abs().amax(-1, keepdim=True)).all()


def _args(**kw):
    parser = bench.add_arguments(argparse.ArgumentParser())
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_config_defaults_and_table():
    cfg = bench.make_config(_args(), 4, gpu=False)
    assert (cfg.tokens, cfg.iters, cfg.hidden) == (bench.CPU_DEFAULT_TOKENS, bench.CPU_DEFAULT_ITERS, 7168)
    assert bench.make_config(_args(), 8, gpu=True).tokens == bench.GPU_DEFAULT_TOKENS
    row = bench.make_row(cfg, 0, sent=10, received=12, received_rows=12, dispatch_times=[1e-3, 3e-3, 2e-3],
                         combine_times=[1e-3], check=True)
    assert row["dispatch_us"] == pytest.approx(2000.0)
    assert row["dispatch_gbps"] == pytest.approx(10 * 2 * 7168 / 1e9 / 2e-3)
    table = bench.format_table([row])
    assert "n/a" in table and "ok" in table and "dispatch GB/s" in table
    gpu_row = bench.make_row(cfg, 1, sent=1, received=1, received_rows=1, dispatch_times=[2e-6],
                             combine_times=[4e-6], check=None, floor_us=1.0)
    assert gpu_row["dispatch_ratio"] == pytest.approx(2.0) and gpu_row["combine_ratio"] == pytest.approx(4.0)


def test_gpu_hook_errors_cleanly(monkeypatch):
    monkeypatch.setattr(bench, "gpu_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.use_gpu_runner(_args(device="cuda"))
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        bench.use_gpu_runner(_args(virtual_ranks=8))
    assert not bench.use_gpu_runner(_args())
    monkeypatch.setattr(bench, "gpu_available", lambda: True)
    assert bench.use_gpu_runner(_args(virtual_ranks=8))


@pytest.mark.parametrize("expand,fp8", [(False, False), (True, True)])
def test_check_against_reference_detects_errors(expand, fp8):
    from deep_ep import reference as ref

    cfg = bench.make_config(_args(model="qwen3-30b-a3b", tokens=16, expand=expand, fp8=fp8, alignment=4,
                                  mask_prob=0.2), 2, gpu=False)
    inputs = [bench.make_rank_inputs(cfg, s) for s in range(2)]
    assert torch.equal(inputs[1]["topk_idx"], bench.make_rank_inputs(cfg, 1)["topk_idx"])  # shared seed
    exp = ref.reference_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                                 [i["topk_weights"] for i in inputs], cfg.num_experts, do_expand=expand,
                                 expert_alignment=4, num_max_tokens_per_rank=cfg.max_tokens)
    ys = [bench.expert_output(cfg, r.recv_x) for r in exp]
    combined = ref.reference_combine(ys, [r.handle for r in exp])[1][0]
    good = exp[1].as_tuple()
    assert bench.check_against_reference(cfg, 1, inputs, good, combined) == []

    data = good[0][0] if fp8 else good[0]
    bad_data = data.clone()
    bad_data.view(torch.uint8)[0, 0] ^= 1
    bad_x = (bad_data, good[0][1]) if fp8 else bad_data
    failures = bench.check_against_reference(cfg, 1, inputs, (bad_x, *good[1:]), combined)
    assert len(failures) == 1 and failures[0].startswith("dispatch")
    off = combined.clone()
    off[0, 0] += 1.0
    failures = bench.check_against_reference(cfg, 1, inputs, good, off)
    assert len(failures) == 1 and "combined_x" in failures[0]


def test_floor_rows_counts_reads_and_writes():
    """The floor copy matches a dispatch's HBM traffic: each selected token read once, one row
    written per copy; a copy reads and writes each row, so (tokens + copies) / 2 rows."""
    from deep_ep import bench as B
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [-1, -1, -1, -1], [0, 7, 7, -1]])
    # 8 experts on 2 ranks (4 each): non-expanded copies = tokens per destination rank
    assert B.token_copies(idx, 8, 2, False) == [2, 2]          # rank 0: tokens 0, 3; rank 1: tokens 1, 3
    assert B.floor_rows(idx, 8, 2, False) == (4 + 3) / 2       # 3 tokens with a selection
    assert B.token_copies(idx, 8, 2, True) == [5, 4]           # valid pairs per rank
    assert B.floor_rows(idx, 8, 2, True) == (9 + 3) / 2
    assert B.floor_rows(idx, 8, 1, False) == 3                 # EP=1: one copy per token
    assert B.floor_rows(idx[:0], 8, 2, False) == 0


def test_sm_sweep_parse_table_and_cpu_refusal(tmp_path):
    from deep_ep import bench as B
    assert B.parse_sm_sweep("16,32,64") == [16, 32, 64] and B.parse_sm_sweep(None) == []
    for bad in ("16,x", "0", "8,-2"):
        with pytest.raises(SystemExit, match="--sm-sweep takes positive SM counts"):
            B.parse_sm_sweep(bad)
    points = [{"num_sms": n, "dispatch_us_max": 700.0 - n, "combine_us_max": 800.0 - n, "dispatch_gbps_mean": 100.0 + n,
               "combine_gbps_mean": 90.0 + n, "cached_dispatch_graph_us": 600.0 - n, "combine_graph_us": None,
               "check_passed": True} for n in (18, 32, 64)]
    table = B.format_sm_sweep(points).splitlines()
    assert len(table) == 5 and table[2].split()[0] == "18" and table[4].split()[-1] == "ok"
    assert "n/a" in table[3]  # combine graph time missing
    if HAVE_MPL:
        B.plot_sm_sweep(str(tmp_path / "sweep.png"), points, "test")
        assert (tmp_path / "sweep.png").stat().st_size > 1000
    args = B.add_arguments(argparse.ArgumentParser()).parse_args(["--device", "cpu", "--sm-sweep", "16,32"])
    with pytest.raises(SystemExit, match="needs the GPU runner"):
        B.main(args)


def test_fp8_scale_without_fp8_refused():
    from deep_ep import bench as B
    args = B.add_arguments(argparse.ArgumentParser()).parse_args(["--device", "cpu", "--fp8-scale", "ue8m0"])
    with pytest.raises(SystemExit, match="add --fp8"):
        B.make_config(args, 2, gpu=False)
