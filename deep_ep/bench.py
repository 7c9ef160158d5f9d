"""The main job: ``python -m deep_ep bench`` (also ``deep-ep bench``).

Runs ``ElasticBuffer.dispatch`` + ``combine`` for a model preset, checks every output element
against :mod:`deep_ep.reference`, and reports per rank: tokens sent / received, median dispatch and
combine time, logical bandwidth and (on GPU) the ratio to a same-bytes copy (the floor).

Runners
-------
* CPU (no GPU visible, or ``--device cpu``): spawns ``--ranks`` processes joined by a ``gloo``
  group; each runs the public API on CPU tensors (:func:`run_cpu`).
* GPU (a GPU is visible, or ``--virtual-ranks N``): delegated to ``deep_ep.bench_gpu.run(args)``,
  imported lazily. Contract: it receives the parsed ``argparse.Namespace`` (``args.tokens`` may be
  ``None``: use :data:`GPU_DEFAULT_TOKENS`) and returns the *result* dict described below; this
  module then prints, writes the JSON and plots it. It can reuse :func:`make_config`,
  :func:`make_rank_inputs`, :func:`logical_bytes`, :func:`bandwidth_gbps`, :func:`make_row`,
  :func:`format_table`, :func:`write_json` and :func:`plot`.

Logical bandwidth
-----------------
Following DeepEP's convention of counting *logical* bytes (what the layer asks to move, including a
rank's copies to itself, independent of how the transport routes them), for source rank ``s``::

    copies_s = sum_t |{d : token t has an expert on rank d}|      (non-expanded)
             = sum_t |{k : topk_idx_s[t, k] != -1}|                 (expanded: per (token, expert))
    dispatch_bytes_s = copies_s * bytes_per_token   (bf16: 2*H; FP8: H + 4*num_sf)
    combine_bytes_s  = copies_s * 2*H               (combine returns bf16)
    bandwidth (GB/s) = bytes / 1e9 / median time (s)

Result dict (``--json``)
------------------------
``{"config": {...}, "runner": str, "device": str, "torch": str, "date": str,
"bandwidth_formula": str, "check": {"enabled": bool, "passed": bool}, "rows": [row, ...],
"summary": {...}}`` with one ``row`` per rank as built by :func:`make_row`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import routing

CPU_DEFAULT_TOKENS = 512
GPU_DEFAULT_TOKENS = 4096
CPU_DEFAULT_ITERS = 5
GPU_DEFAULT_ITERS = 50

BANDWIDTH_FORMULA = (
    "logical bytes / median time; bytes of rank s = copies_s * bytes_per_token, copies_s = "
    "sum over tokens of the number of destination ranks (non-expanded) or of valid (token, expert) "
    "pairs (expanded), local copies included; bytes_per_token = 2*hidden (bf16), hidden + 4*num_sf "
    "(FP8 dispatch), 2*hidden for combine; GB = 1e9 bytes"
)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

_DESCRIPTION = f"""\
Benchmark and check expert-parallel dispatch + combine.

With no GPU (or --device cpu) it spawns --ranks processes joined by a gloo group on this machine
(default {CPU_DEFAULT_TOKENS} tokens per rank, so the DeepSeek-V3 default finishes in well under a
minute on 2 cores). With a GPU it runs the GPU path: EP=1, one rank per GPU under torchrun, or --virtual-ranks N
emulated ranks on one GPU (default {GPU_DEFAULT_TOKENS} tokens per rank).

Every output is checked against deep_ep.reference (dispatch exactly, combine to bf16 tolerance)
unless --no-check. Times are medians over --iters barrier-synchronised iterations after --warmup.

Logical bandwidth (DeepEP's "logical" convention: what the layer moves, self-copies included):
  dispatch GB/s = copies * bytes_per_token / 1e9 / dispatch time
  combine  GB/s = copies * 2 * hidden      / 1e9 / combine time
  copies = per (token, destination rank) without --expand, per valid (token, expert) with it;
  bytes_per_token = 2*hidden in bf16, hidden + 4*num_sf with --fp8.
The floor / ratio columns (time of a same-bytes device copy) are filled on GPU only.
"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser`` (used by ``deep_ep.__main__``)."""
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    presets = sorted(routing.MODEL_PRESETS)
    parser.add_argument("--model", default="deepseek-v3", choices=presets,
                        help="model preset (hidden, experts, top-k); default: deepseek-v3")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens per rank (default: {GPU_DEFAULT_TOKENS} on GPU, "
                             f"{CPU_DEFAULT_TOKENS} on CPU)")
    parser.add_argument("--ranks", type=int, default=4, help="CPU: number of gloo processes (default 4)")
    parser.add_argument("--virtual-ranks", type=int, default=None, metavar="N",
                        help="GPU: emulate N ranks on one GPU")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU path if a GPU is visible, else CPU (default)")
    parser.add_argument("--fp8", action="store_true", help="FP8 dispatch (e4m3 data + scale factors)")
    parser.add_argument("--fp8-scale", choices=("fp32", "ue8m0"), default="fp32",
                        help="FP8 scale format: fp32 per 128 channels, or UE8M0 packed 4 per int32")
    parser.add_argument("--expand", action="store_true",
                        help="expanded layout: one row per (token, local expert), grouped by expert")
    parser.add_argument("--alignment", type=int, default=1,
                        help="expert_alignment: pad each expert's rows to a multiple (default 1)")
    parser.add_argument("--routing", choices=("balanced", "imbalanced", "zipf", "gate"), default="balanced",
                        help="routing generator; 'gate' runs the preset's gate on random logits")
    parser.add_argument("--hot-ratio", type=float, default=2.0,
                        help="imbalanced: rank 0 receives this many times the mean (token, expert) pairs")
    parser.add_argument("--zipf-alpha", type=float, default=1.0, help="zipf: popularity exponent")
    parser.add_argument("--mask-prob", type=float, default=0.0,
                        help="probability of replacing each top-k entry by -1")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed iterations (default {GPU_DEFAULT_ITERS} GPU, {CPU_DEFAULT_ITERS} CPU)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of all inputs")
    parser.add_argument("--json", metavar="PATH", default=None, help="write all numbers as JSON")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="plot per-rank tokens sent/received and bandwidth (needs matplotlib)")
    parser.add_argument("--num-sms", type=int, default=0,
                        help="GPU: SMs (blocks) per dispatch/combine kernel (default 0: the buffer's bandwidth model)")
    parser.add_argument("--sm-sweep", metavar="N,N,...", default=None,
                        help="GPU: run the bench once per SM count and print (and with --plot, draw) "
                             "bandwidth against SMs")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the comparison with deep_ep.reference")
    return parser


def gpu_available() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken driver counts as no GPU
        return False


def use_gpu_runner(args: argparse.Namespace) -> bool:
    """The GPU path is taken with ``--virtual-ranks``, ``--device cuda``, or ``auto`` and a GPU."""
    if args.virtual_ranks is not None:
        if args.device == "cpu":
            raise SystemExit("error: --virtual-ranks needs the GPU path; drop --device cpu")
        if not gpu_available():
            raise SystemExit("error: --virtual-ranks emulates ranks on one GPU, but no CUDA device is visible "
                             "(or torch is a CPU build); without a GPU, use --ranks N (gloo processes)")
        return True
    if args.device == "cuda":
        if not gpu_available():
            raise SystemExit("error: --device cuda but no CUDA device is visible")
        return True
    return args.device == "auto" and gpu_available()


def main(args: argparse.Namespace) -> int:
    """Run the bench for parsed ``args``; print the table; write JSON / plot. Returns an exit code."""
    if args.plot:
        _require_matplotlib()
    if args.virtual_ranks is not None:
        # Emulated ranks need eager kernel loading and enough hardware queues, set before CUDA
        # initialises (deep_ep.emulated).
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    sweep = parse_sm_sweep(getattr(args, "sm_sweep", None))
    if sweep and not use_gpu_runner(args):
        raise SystemExit("error: --sm-sweep varies the SMs of the GPU kernels; it needs the GPU runner "
                         "(a CUDA device, or --virtual-ranks N)")
    if use_gpu_runner(args):
        try:
            from . import bench_gpu  # noqa: WPS433 (lazy: written separately, needs CUDA)
        except ModuleNotFoundError as exc:
            if exc.name not in ("deep_ep.bench_gpu",):
                raise
            raise SystemExit(
                "error: the GPU bench runner (deep_ep.bench_gpu) is not available in this build; "
                "run with --device cpu"
            ) from exc
        if sweep:
            return _run_sm_sweep(args, sweep, bench_gpu.run)
        result = bench_gpu.run(args)
        if result is None:  # a non-zero rank of a multi-process run: rank 0 reports
            return 0
    else:
        result = run_cpu(args)

    print(format_header(result))
    print(format_table(result["rows"]))
    print(format_summary(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, result)
        print(f"wrote {args.plot}")
    return 0 if (not result["check"]["enabled"] or result["check"]["passed"]) else 1


def parse_sm_sweep(text: Optional[str]) -> List[int]:
    """``"16,32,64"`` -> ``[16, 32, 64]``; None or empty -> ``[]``.

    Raises:
        SystemExit: a value that is not a positive integer.
    """
    if not text:
        return []
    out = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            n = 0
        if n < 1:
            raise SystemExit(f"error: --sm-sweep takes positive SM counts separated by commas, got {text!r}")
        out.append(n)
    return out


def sm_sweep_point(result: Dict[str, Any], num_sms: int) -> Dict[str, Any]:
    """One point of an SM sweep from a GPU bench result (rank 0's graph times, the summary)."""
    row0 = result["rows"][0]
    summ = result["summary"]
    return {"num_sms": num_sms, "dispatch_us_max": summ["dispatch_us_max"], "combine_us_max": summ["combine_us_max"],
            "dispatch_gbps_mean": summ["dispatch_gbps_mean"], "combine_gbps_mean": summ["combine_gbps_mean"],
            "cached_dispatch_graph_us": row0.get("cached_dispatch_graph_us"),
            "combine_graph_us": row0.get("combine_graph_us"),
            "check_passed": result["check"]["passed"] if result["check"]["enabled"] else None}


def format_sm_sweep(points: Sequence[Dict[str, Any]]) -> str:
    """The SM-sweep table: time and logical bandwidth per SM count."""
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)
    lines = ["SMs  dispatch us  combine us  dispatch GB/s  combine GB/s  graph: cached dispatch us  graph: combine us  check",
             "---  -----------  ----------  -------------  ------------  -------------------------  -----------------  -----"]
    for p in points:
        lines.append(f"{p['num_sms']:>3}  {f(p['dispatch_us_max'], '11.1f')}  {f(p['combine_us_max'], '10.1f')}  "
                     f"{f(p['dispatch_gbps_mean'], '13.2f')}  {f(p['combine_gbps_mean'], '12.2f')}  "
                     f"{f(p['cached_dispatch_graph_us'], '25.1f')}  {f(p['combine_graph_us'], '17.1f')}  "
                     f"{'n/a' if p['check_passed'] is None else ('ok' if p['check_passed'] else 'FAIL')}")
    return "\n".join(lines)


def plot_sm_sweep(path: str, points: Sequence[Dict[str, Any]], title: str) -> None:
    """Logical bandwidth (left) and device time from CUDA graphs (right) against SMs, to ``path``."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sms = [p["num_sms"] for p in points]
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    ax_bw.plot(sms, [p["dispatch_gbps_mean"] for p in points], "o-", label="dispatch")
    ax_bw.plot(sms, [p["combine_gbps_mean"] for p in points], "s-", label="combine")
    ax_bw.set_xlabel("SMs per kernel")
    ax_bw.set_ylabel("logical GB/s (mean over ranks, per call)")
    for key, label, mark in (("cached_dispatch_graph_us", "cached dispatch", "o-"), ("combine_graph_us", "combine", "s-")):
        ys = [p[key] for p in points]
        if all(y is not None for y in ys):
            ax_t.plot(sms, ys, mark, label=label)
    ax_t.set_xlabel("SMs per kernel")
    ax_t.set_ylabel("us, replayed from a CUDA graph (rank 0)")
    for ax in (ax_bw, ax_t):
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run_sm_sweep(args: argparse.Namespace, sweep: List[int], run_gpu) -> int:
    """Run the GPU bench once per SM count (``run_gpu(args)``, each a full checked run); rank 0 prints
    the table, writes the points to ``--json`` and draws them with ``--plot``."""
    points, result = [], None
    for n in sweep:
        args.num_sms = n
        result = run_gpu(args)
        if result is not None:
            points.append(sm_sweep_point(result, n))
            print(f"--- {n} SMs: {format_summary(result)}", flush=True)
    if result is None:  # a non-zero rank of a multi-process run
        return 0
    print(format_header(result))
    print(format_sm_sweep(points))
    if args.json:
        write_json(args.json, {"config": result["config"], "runner": result["runner"], "device": result["device"],
                               "sm_sweep": points})
        print(f"wrote {args.json}")
    if args.plot:
        c = result["config"]
        plot_sm_sweep(args.plot, points, f"deep_ep bench SM sweep: {c['model']}, {c['num_ranks']} ranks x "
                                         f"{c['tokens']} tokens ({result['runner']})")
        print(f"wrote {args.plot}")
    return 0 if all(p["check_passed"] is not False for p in points) else 1


# ---------------------------------------------------------------------------------------------
# Configuration and inputs (shared with the GPU runner)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BenchConfig:
    """Everything that determines a bench run's inputs and layout (JSON-serialisable)."""

    model: str
    hidden: int
    num_experts: int
    top_k: int
    num_ranks: int
    tokens: int
    fp8: bool
    fp8_scale: str
    expand: bool
    alignment: int
    routing: str
    hot_ratio: float
    zipf_alpha: float
    mask_prob: float
    iters: int
    warmup: int
    seed: int
    check: bool
    num_sms: int = 0

    @property
    def max_tokens(self) -> int:
        """``num_max_tokens_per_rank`` given to the buffer, dispatch and reference (at least 1)."""
        return max(self.tokens, 1)

    @property
    def num_sf(self) -> int:
        """Scale-factor elements (4 bytes each) per token in FP8 mode."""
        return self.hidden // 128 if self.fp8_scale == "fp32" else self.hidden // 512

    @property
    def dispatch_bytes_per_token(self) -> int:
        return self.hidden + 4 * self.num_sf if self.fp8 else 2 * self.hidden

    @property
    def combine_bytes_per_token(self) -> int:
        return 2 * self.hidden


def make_config(args: argparse.Namespace, num_ranks: int, *, gpu: bool) -> BenchConfig:
    """Validate ``args`` for ``num_ranks`` ranks and build the :class:`BenchConfig`.

    Raises ``SystemExit`` with a clear message on impossible combinations, before any process or
    communication starts.
    """
    preset = routing.get_preset(args.model)
    tokens = args.tokens if args.tokens is not None else (GPU_DEFAULT_TOKENS if gpu else CPU_DEFAULT_TOKENS)
    iters = args.iters if args.iters is not None else (GPU_DEFAULT_ITERS if gpu else CPU_DEFAULT_ITERS)
    cfg = BenchConfig(
        model=preset.name, hidden=preset.hidden, num_experts=preset.num_experts, top_k=preset.top_k,
        num_ranks=num_ranks, tokens=tokens, fp8=bool(args.fp8), fp8_scale=args.fp8_scale,
        expand=bool(args.expand), alignment=args.alignment, routing=args.routing,
        hot_ratio=args.hot_ratio, zipf_alpha=args.zipf_alpha, mask_prob=args.mask_prob,
        iters=iters, warmup=args.warmup, seed=args.seed, check=bool(args.check),
        num_sms=int(getattr(args, "num_sms", 0) or 0),
    )
    errors = []
    if num_ranks < 1:
        errors.append(f"need at least 1 rank, got {num_ranks}")
    elif cfg.num_experts % num_ranks:
        errors.append(f"{cfg.model} has {cfg.num_experts} experts, not divisible by {num_ranks} ranks")
    if cfg.tokens < 0:
        errors.append(f"--tokens must be >= 0, got {cfg.tokens}")
    if cfg.alignment < 1:
        errors.append(f"--alignment must be >= 1, got {cfg.alignment}")
    if cfg.num_sms < 0:
        errors.append(f"--num-sms must be >= 0, got {cfg.num_sms}")
    if cfg.iters < 1 or cfg.warmup < 0:
        errors.append("--iters must be >= 1 and --warmup >= 0")
    if not 0.0 <= cfg.mask_prob <= 1.0:
        errors.append(f"--mask-prob must be in [0, 1], got {cfg.mask_prob}")
    if getattr(args, "fp8_scale", "fp32") != "fp32" and not cfg.fp8:
        errors.append(f"--fp8-scale {args.fp8_scale} applies to FP8 dispatch: add --fp8")
    if cfg.fp8:
        unit = 128 if cfg.fp8_scale == "fp32" else 512
        if cfg.hidden % unit:
            errors.append(f"--fp8 with {cfg.fp8_scale} scales needs hidden % {unit} == 0; "
                          f"{cfg.model} has hidden {cfg.hidden}")
    if cfg.routing == "imbalanced" and not errors:
        try:
            routing.imbalanced_routing(1, cfg.num_experts, cfg.top_k, num_ranks=num_ranks,
                                       hot_rank_ratio=cfg.hot_ratio)
        except ValueError as exc:
            errors.append(f"--hot-ratio: {exc}")
    if cfg.routing == "zipf" and cfg.zipf_alpha < 0:
        errors.append("--zipf-alpha must be >= 0")
    if errors:
        raise SystemExit("error: " + "; ".join(errors))
    return cfg


def _generator(cfg: BenchConfig, rank: int, stream: int) -> torch.Generator:
    """A CPU generator for (seed, rank, stream): any rank can regenerate any rank's inputs."""
    return torch.Generator().manual_seed((cfg.seed * 1_000_003 + rank * 10_007 + stream) % (2**62))


def make_topk(cfg: BenchConfig, rank: int) -> Dict[str, torch.Tensor]:
    """Routing of source ``rank``: ``topk_idx [T, K]`` int64 and ``topk_weights [T, K]`` float32."""
    T, E, K, R = cfg.tokens, cfg.num_experts, cfg.top_k, cfg.num_ranks
    gen = _generator(cfg, rank, 1)
    if cfg.routing == "balanced":
        idx = routing.balanced_routing(T, E, K, generator=gen)
    elif cfg.routing == "imbalanced":
        idx = routing.imbalanced_routing(T, E, K, num_ranks=R, hot_rank_ratio=cfg.hot_ratio, hot_rank=0,
                                         generator=gen)
    elif cfg.routing == "zipf":
        # One popularity ranking for all ranks (seed only), tokens drawn per rank.
        order = torch.randperm(E, generator=torch.Generator().manual_seed(cfg.seed + 12345))
        idx = routing.zipf_routing(T, E, K, alpha=cfg.zipf_alpha, popularity_order=order, generator=gen)
    elif cfg.routing == "gate":
        preset = routing.get_preset(cfg.model)
        logits = torch.randn(T, E, generator=gen)
        bias = torch.randn(E, generator=torch.Generator().manual_seed(cfg.seed + 54321)) * 0.1
        idx, _ = routing.gate(preset, logits, bias if preset.gate_kind == "deepseek_v3" else None)
    else:
        raise ValueError(f"unknown routing {cfg.routing!r}")
    if cfg.mask_prob > 0:
        idx = routing.mask_routing(idx, cfg.mask_prob, generator=gen)
    weights = routing.random_weights(idx, generator=gen)
    return {"topk_idx": idx, "topk_weights": weights}


def make_rank_inputs(cfg: BenchConfig, rank: int, device="cpu") -> Dict[str, Any]:
    """All inputs of source ``rank``, regenerated identically on every rank from ``cfg.seed``.

    Returns ``{"x": bf16 [T, H] or (fp8 [T, H], sf [T, num_sf]), "x_bf16": bf16 [T, H],
    "topk_idx": int64 [T, K], "topk_weights": float32 [T, K]}`` on ``device``.
    """
    out = make_topk(cfg, rank)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=_generator(cfg, rank, 2)).to(torch.bfloat16)
    out["x_bf16"] = x
    out["x"] = quantize_fp8(x, cfg.fp8_scale) if cfg.fp8 else x
    return {k: _to(v, device) for k, v in out.items()}


def _to(v, device):
    if isinstance(v, tuple):
        return tuple(t.to(device) for t in v)
    return v.to(device)


def quantize_fp8(x: torch.Tensor, scale_format: str = "fp32"):
    """Per-token, per-128-channel FP8 (e4m3) quantisation of bf16 ``x [T, H]``.

    Returns ``(data float8_e4m3fn [T, H], sf)``: ``sf`` float32 ``[T, H/128]`` (``x ≈ data * sf``),
    or with ``"ue8m0"`` power-of-two scales stored as biased exponent bytes packed four to an int32
    ``[T, H/512]`` (byte ``j`` of element ``i`` is the scale of channel block ``4*i + j``,
    little-endian).
    """
    T, H = x.shape
    blocks = x.float().view(T, H // 128, 128)
    amax = blocks.abs().amax(dim=-1).clamp_min(1e-4)
    scale = amax / 448.0
    if scale_format == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    data = (blocks / scale.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn)
    if scale_format == "fp32":
        return data, scale.contiguous()
    exponents = (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8)  # [T, H/128]
    return data, exponents.contiguous().view(torch.int32)


def dequantize_fp8(x, scale_format: str = "fp32") -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` → bf16 ``[rows, H]`` (also accepts a column-major sf view)."""
    data, sf = x
    rows, H = data.shape
    if scale_format == "fp32":
        scale = sf.float()
    else:
        exps = sf.contiguous().view(torch.uint8).view(rows, -1)[:, : H // 128].to(torch.int32) - 127
        scale = torch.exp2(exps.float())
    out = data.float().view(rows, H // 128, 128) * scale.view(rows, -1, 1)
    return out.view(rows, H).to(torch.bfloat16)


def expert_output(cfg: BenchConfig, recv_x) -> torch.Tensor:
    """What the bench feeds to combine: the received rows themselves (bf16, FP8 dequantised),
    standing in for the experts' outputs."""
    return dequantize_fp8(recv_x, cfg.fp8_scale) if cfg.fp8 else recv_x


# ---------------------------------------------------------------------------------------------
# Bandwidth
# ---------------------------------------------------------------------------------------------


def token_copies(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, expand: bool) -> List[int]:
    """Copies of this rank's tokens per destination rank (``[num_ranks]`` ints).

    Non-expanded: the number of tokens with at least one expert on rank ``d``. Expanded: the number
    of valid ``(token, expert)`` pairs whose expert is on ``d``. ``-1`` entries are ignored.
    """
    local = num_experts // num_ranks
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // local, torch.full_like(topk_idx, num_ranks))
    if expand:
        counts = torch.bincount(dest.flatten(), minlength=num_ranks + 1)[:num_ranks]
    else:
        hit = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
        hit.scatter_(1, dest, True)
        counts = hit[:, :num_ranks].sum(dim=0)
    return [int(c) for c in counts.tolist()]


def floor_rows(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, expand: bool) -> float:
    """Rows a device copy must move to match one rank's dispatch (or combine) HBM traffic.

    A dispatch reads each token with at least one valid expert once and writes one row per copy
    (`token_copies`); combine reads the copies and writes each token once. A copy of ``n`` rows reads
    and writes ``n`` rows, so the matching copy moves ``(tokens + copies) / 2`` rows.
    """
    copies = sum(token_copies(topk_idx, num_experts, num_ranks, expand))
    tokens = int((topk_idx >= 0).any(dim=1).sum()) if topk_idx.numel() else 0
    return (copies + tokens) / 2


def logical_bytes(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, expand: bool,
                  bytes_per_token: int) -> int:
    """Logical bytes a source rank moves: ``sum(token_copies(...)) * bytes_per_token``."""
    return sum(token_copies(topk_idx, num_experts, num_ranks, expand)) * bytes_per_token


def bandwidth_gbps(num_bytes: float, seconds: float) -> float:
    """``num_bytes / 1e9 / seconds`` (``nan`` for a zero time)."""
    return num_bytes / 1e9 / seconds if seconds > 0 else float("nan")


def make_row(cfg: BenchConfig, rank: int, *, sent: int, received: int, received_rows: int,
             dispatch_times: Sequence[float], combine_times: Sequence[float],
             check: Optional[bool], floor_us: Optional[float] = None,
             extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One rank's row of the table / JSON (times in seconds in, microseconds out).

    ``sent``: copies of this rank's tokens (see :func:`token_copies`); ``received``: rows received
    before padding; ``received_rows``: rows including alignment padding; ``check``: ``None`` when not
    checked. ``floor_us``: the GPU runner's same-bytes copy time; ratios are time / floor.
    """
    d_med = statistics.median(dispatch_times)
    c_med = statistics.median(combine_times)
    d_bytes = sent * cfg.dispatch_bytes_per_token
    c_bytes = sent * cfg.combine_bytes_per_token
    row = {
        "rank": rank,
        "tokens": cfg.tokens,
        "sent": sent,
        "received": received,
        "received_rows": received_rows,
        "dispatch_bytes": d_bytes,
        "combine_bytes": c_bytes,
        "dispatch_us": d_med * 1e6,
        "combine_us": c_med * 1e6,
        "dispatch_us_all": [t * 1e6 for t in dispatch_times],
        "combine_us_all": [t * 1e6 for t in combine_times],
        "dispatch_gbps": bandwidth_gbps(d_bytes, d_med),
        "combine_gbps": bandwidth_gbps(c_bytes, c_med),
        "floor_us": floor_us,
        "dispatch_ratio": (d_med * 1e6 / floor_us) if floor_us else None,
        "combine_ratio": (c_med * 1e6 / floor_us) if floor_us else None,
        "check": check,
    }
    if extra:
        row.update(extra)
    return row


# ---------------------------------------------------------------------------------------------
# Output: table, JSON, plot (shared with the GPU runner)
# ---------------------------------------------------------------------------------------------

_COLUMNS = [
    ("rank", "rank", "{}"),
    ("tokens", "tokens", "{}"),
    ("sent", "sent", "{}"),
    ("received", "recv", "{}"),
    ("dispatch_us", "dispatch us", "{:.1f}"),
    ("combine_us", "combine us", "{:.1f}"),
    ("dispatch_gbps", "dispatch GB/s", "{:.2f}"),
    ("combine_gbps", "combine GB/s", "{:.2f}"),
    ("floor_us", "floor us", "{:.1f}"),
    ("dispatch_ratio", "disp/floor", "{:.2f}"),
    ("combine_ratio", "comb/floor", "{:.2f}"),
    ("check", "check", None),
]


def _cell(value, fmt) -> str:
    if fmt is None:  # check column
        return "n/a" if value is None else ("ok" if value else "FAIL")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return fmt.format(value)


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """Plain-text table of per-rank rows (see :func:`make_row`); ``None`` cells print ``n/a``."""
    header = [title for _, title, _ in _COLUMNS]
    body = [[_cell(row.get(key), fmt) for key, _, fmt in _COLUMNS] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def summarize(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Aggregate numbers: slowest rank's times, mean bandwidth, load imbalance of received rows."""
    if not rows:
        return {}
    recv = [r["received"] for r in rows]
    mean_recv = sum(recv) / len(recv)
    return {
        "dispatch_us_max": max(r["dispatch_us"] for r in rows),
        "combine_us_max": max(r["combine_us"] for r in rows),
        "dispatch_gbps_mean": statistics.fmean(r["dispatch_gbps"] for r in rows),
        "combine_gbps_mean": statistics.fmean(r["combine_gbps"] for r in rows),
        "recv_max_over_mean": (max(recv) / mean_recv) if mean_recv else float("nan"),
    }


def format_header(result: Dict[str, Any]) -> str:
    c = result["config"]
    mode = ("FP8 (" + c["fp8_scale"] + " scales)") if c["fp8"] else "BF16"
    layout = "expanded" if c["expand"] else "non-expanded"
    route = c["routing"]
    if route == "imbalanced":
        route += f" (hot rank 0 x{c['hot_ratio']:g})"
    elif route == "zipf":
        route += f" (alpha {c['zipf_alpha']:g})"
    if c["mask_prob"]:
        route += f", mask {c['mask_prob']:g}"
    return (
        f"deep_ep bench: {c['model']} (hidden {c['hidden']}, {c['num_experts']} experts, top-{c['top_k']}), "
        f"{c['num_ranks']} ranks x {c['tokens']} tokens, {mode} dispatch, {layout}, alignment {c['alignment']}\n"
        f"runner: {result['runner']} on {result['device']}; routing: {route}; "
        f"{c['iters']} iters (+{c['warmup']} warm-up), medians; seed {c['seed']}"
    )


def format_summary(result: Dict[str, Any]) -> str:
    s = result.get("summary", {})
    chk = result["check"]
    if not chk["enabled"]:
        check = "not checked (--no-check)"
    elif chk["passed"]:
        check = "all outputs match deep_ep.reference"
    else:
        check = "MISMATCH: " + "; ".join(chk.get("failures", []))[:2000]
    lines = []
    if s:
        lines.append(
            f"slowest rank: dispatch {s['dispatch_us_max']:.1f} us, combine {s['combine_us_max']:.1f} us; "
            f"mean logical bandwidth: dispatch {s['dispatch_gbps_mean']:.2f} GB/s, "
            f"combine {s['combine_gbps_mean']:.2f} GB/s; received max/mean "
            f"{_cell(s['recv_max_over_mean'], '{:.2f}')}"
        )
    lines.append(f"check: {check}")
    return "\n".join(lines)


def _jsonable(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str, result: Dict[str, Any]) -> None:
    """Write ``result`` as indented JSON (NaN / inf written as ``null``)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_jsonable(result), f, indent=2, sort_keys=False)
        f.write("\n")


def _require_matplotlib():
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(
            "error: --plot needs matplotlib, which is not installed; "
            "install it with `pip install matplotlib` (or `pip install deep_ep[plot]`)"
        )


def plot(path: str, result: Dict[str, Any]) -> None:
    """Bar charts per rank: tokens sent / received (left) and logical bandwidth (right), to ``path``."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ranks = [r["rank"] for r in rows]
    xs = list(range(len(ranks)))
    width = 0.4
    fig, (ax_load, ax_bw) = plt.subplots(1, 2, figsize=(11, 4))
    ax_load.bar([x - width / 2 for x in xs], [r["sent"] for r in rows], width, label="sent")
    ax_load.bar([x + width / 2 for x in xs], [r["received"] for r in rows], width, label="received")
    ax_load.set_xlabel("rank")
    ax_load.set_ylabel("token copies" if not result["config"]["expand"] else "(token, expert) pairs")
    ax_load.set_title("load per rank")
    ax_load.set_xticks(xs, [str(r) for r in ranks])
    nan_to_zero = lambda v: 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else v  # noqa: E731
    ax_bw.bar([x - width / 2 for x in xs], [nan_to_zero(r["dispatch_gbps"]) for r in rows], width, label="dispatch")
    ax_bw.bar([x + width / 2 for x in xs], [nan_to_zero(r["combine_gbps"]) for r in rows], width, label="combine")
    ax_bw.set_xlabel("rank")
    ax_bw.set_ylabel("logical GB/s")
    ax_bw.set_title("logical bandwidth per rank")
    ax_bw.set_xticks(xs, [str(r) for r in ranks])
    for ax in (ax_load, ax_bw):  # headroom so the legend does not cover the bars
        ax.set_ylim(0, max(ax.get_ylim()[1], 1e-9) * 1.25)
        ax.legend(loc="upper center", ncol=2)
    c = result["config"]
    fig.suptitle(f"deep_ep bench: {c['model']}, {c['num_ranks']} ranks x {c['tokens']} tokens, "
                 f"{'FP8' if c['fp8'] else 'BF16'}{', expanded' if c['expand'] else ''} ({result['runner']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Checking against deep_ep.reference
# ---------------------------------------------------------------------------------------------


def bf16_mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """``None`` if ``got`` matches ``want`` (bf16) within bf16 tolerance, else a short description.

    Tolerance per element: ``1e-2 + 2**-7 * |want|`` (a couple of bf16 ulps: rounding of an fp32 sum
    accumulated in another order).
    """
    if got is None or not isinstance(got, torch.Tensor):
        return f"{name}: got {type(got).__name__}, expected a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype} != expected {want.dtype}"
    gf, wf = got.cpu().float(), want.cpu().float()
    bad = ~((gf - wf).abs() <= 1e-2 + 2 ** -7 * wf.abs())  # NaN counts as bad
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        return (f"{name}: {int(bad.sum())} element(s) outside bf16 tolerance, first at {list(first)} "
                f"(got {gf[first].item()}, expected {wf[first].item()})")
    return None


def check_against_reference(cfg: BenchConfig, rank: int, inputs: Sequence[Dict[str, Any]],
                            dispatch_outputs: Sequence, combined_x: torch.Tensor) -> List[str]:
    """Compare one rank's outputs with :mod:`deep_ep.reference`; returns the failures (empty: ok).

    ``inputs[s]`` is :func:`make_rank_inputs` of every rank ``s`` (regenerated locally from the
    shared seed); ``dispatch_outputs`` is ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``
    as returned by ``dispatch`` on ``rank``; ``combined_x`` is what ``combine`` returned for the
    input :func:`expert_output` of ``recv_x``. Dispatch outputs and every handle field are compared
    bit for bit (``reference.check_dispatch``); ``combined_x`` to bf16 tolerance (the reference's
    fp32 sum rounded to bf16, so that kernels summing in another order still pass).
    """
    from . import reference as ref  # noqa: WPS433

    failures = []
    expected = ref.reference_dispatch(
        [i["x"] for i in inputs], [i["topk_idx"] for i in inputs], [i["topk_weights"] for i in inputs],
        cfg.num_experts, do_expand=cfg.expand, expert_alignment=cfg.alignment,
        do_zero_padding=cfg.expand, num_max_tokens_per_rank=cfg.max_tokens)
    try:
        ref.check_dispatch(tuple(dispatch_outputs[:4]), expected[rank], do_zero_padding=cfg.expand, rank=rank)
    except AssertionError as exc:
        failures.append(f"dispatch: {exc}")
    ys = [expert_output(cfg, res.recv_x) for res in expected]
    want = ref.reference_combine(ys, [res.handle for res in expected])[rank][0]
    msg = bf16_mismatch("combined_x", combined_x, want)
    if msg:
        failures.append(f"combine: rank {rank} {msg}")
    return failures


# ---------------------------------------------------------------------------------------------
# CPU runner: gloo processes
# ---------------------------------------------------------------------------------------------


def run_cpu(args: argparse.Namespace) -> Dict[str, Any]:
    """Spawn ``args.ranks`` gloo processes, run, check and time; return the result dict."""
    cfg = make_config(args, args.ranks, gpu=False)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="deep_ep_bench_") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        threads = max(1, (os.cpu_count() or 1) // cfg.num_ranks)
        procs = [ctx.Process(target=_cpu_worker, args=(rank, cfg, init_method, threads, queue), daemon=True)
                 for rank in range(cfg.num_ranks)]
        for p in procs:
            p.start()
        result, errors = None, []
        try:
            # Rank 0 sends the result; any rank may send an error first.
            while result is None and not errors:
                if queue.empty():
                    if not any(p.is_alive() for p in procs) and queue.empty():
                        errors.append("bench processes exited without a result (exit codes "
                                      f"{[p.exitcode for p in procs]})")
                        break
                    time.sleep(0.05)
                    continue
                kind, payload = queue.get()
                if kind == "result":
                    result = payload
                else:
                    errors.append(payload)
        finally:
            if errors:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
            for p in procs:
                p.join(timeout=30)
    if errors:
        raise SystemExit("error: a bench rank failed:\n" + errors[0])
    return result


def _cpu_worker(rank: int, cfg: BenchConfig, init_method: str, threads: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=cfg.num_ranks,
                                timeout=datetime.timedelta(seconds=300))
        group = dist.group.WORLD
        try:
            row, failures = _run_rank(cfg, rank, group, torch.device("cpu"))
            gathered = [None] * cfg.num_ranks if rank == 0 else None
            dist.gather_object((row, failures), gathered, dst=0, group=group)
            if rank == 0:
                rows = [g[0] for g in gathered]
                all_failures = [f for g in gathered for f in g[1]]
                queue.put(("result", build_result(
                    cfg, rows, all_failures, runner="cpu/gloo",
                    device=f"CPU, {cfg.num_ranks} gloo processes x {threads} thread(s)")))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, then let the parent stop the others
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def build_result(cfg: BenchConfig, rows: List[Dict[str, Any]], failures: List[str], *, runner: str,
                 device: str) -> Dict[str, Any]:
    """Assemble the result dict (schema in the module docstring)."""
    return {
        "config": dataclasses.asdict(cfg),
        "runner": runner,
        "device": device,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "bandwidth_formula": BANDWIDTH_FORMULA,
        "check": {"enabled": cfg.check, "passed": cfg.check and not failures, "failures": failures},
        "rows": sorted(rows, key=lambda r: r["rank"]),
        "summary": summarize(rows),
    }


def _run_rank(cfg: BenchConfig, rank: int, group, device) -> tuple:
    """One rank's work: dispatch + combine through the public API, check, time. Returns
    ``(row, failures)``."""
    import torch.distributed as dist

    from .buffer import ElasticBuffer  # noqa: WPS433

    mine = make_rank_inputs(cfg, rank, device)
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=cfg.max_tokens, hidden=cfg.hidden,
                           num_topk=cfg.top_k, use_fp8_dispatch=cfg.fp8, explicitly_destroy=True)
    try:
        def dispatch():
            return buffer.dispatch(mine["x"], topk_idx=mine["topk_idx"], topk_weights=mine["topk_weights"],
                                   num_experts=cfg.num_experts, num_max_tokens_per_rank=cfg.max_tokens,
                                   expert_alignment=cfg.alignment,
                                   do_expand=cfg.expand, do_zero_padding=cfg.expand)

        # Correctness run (untimed).
        recv_x, recv_topk_idx, recv_topk_weights, handle, _ = dispatch()
        combine_x = expert_output(cfg, recv_x)
        combined_x, _, _ = buffer.combine(combine_x, handle)
        failures = []
        if cfg.check:
            inputs = [mine if s == rank else make_rank_inputs(cfg, s, device) for s in range(cfg.num_ranks)]
            failures = check_against_reference(cfg, rank, inputs, (recv_x, recv_topk_idx, recv_topk_weights, handle),
                                               combined_x)
            del inputs

        received = int(handle.rank_prefix_sum[-1]) if cfg.num_ranks else 0
        received_rows = _num_rows(recv_x)
        sent = sum(token_copies(mine["topk_idx"], cfg.num_experts, cfg.num_ranks, cfg.expand))

        # Timed runs: barrier, time one op, barrier, time the other.
        d_times, c_times = [], []
        iterator = range(cfg.warmup + cfg.iters)
        if rank == 0 and sys.stderr.isatty() and cfg.warmup + cfg.iters >= 10:
            from tqdm import tqdm  # noqa: WPS433

            iterator = tqdm(iterator, desc="bench", unit="iter", leave=False)
        for i in iterator:
            dist.barrier(group)
            t0 = time.perf_counter()
            recv_x, _, _, handle, _ = dispatch()
            t1 = time.perf_counter()
            combine_x = expert_output(cfg, recv_x)  # untimed: the "experts"
            dist.barrier(group)
            t2 = time.perf_counter()
            buffer.combine(combine_x, handle)
            t3 = time.perf_counter()
            if i >= cfg.warmup:
                d_times.append(t1 - t0)
                c_times.append(t3 - t2)
        row = make_row(cfg, rank, sent=sent, received=received, received_rows=received_rows,
                       dispatch_times=d_times, combine_times=c_times,
                       check=(not failures) if cfg.check else None)
        return row, failures
    finally:
        if hasattr(buffer, "destroy"):
            buffer.destroy()


def _num_rows(recv_x) -> int:
    return int((recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0])
