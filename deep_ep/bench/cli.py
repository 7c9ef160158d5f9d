"""Command line of ``python -m deep_ep bench`` (also ``deep-ep bench``): options, runner choice, output.

Order of the output: the configuration lines at once, progress lines while it runs (``[cpu] ...`` /
``[gpu] ...``, on any output), then the per-rank table, rank 0's per-call table, the EPLB section
(``--eplb``), the summary and the check's verdict. The exit code is 1 when any checked output differs
from `deep_ep.reference`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable, Dict, Optional

import torch

from .. import envs, routing
from .eplb import format_section as format_eplb_section, make_workload as make_eplb_workload, section as eplb_section
from .config import CPU_DEFAULT_ITERS, CPU_DEFAULT_TOKENS, GPU_DEFAULT_ITERS, GPU_DEFAULT_TOKENS, Workload, make_config
from .plot import plot, require_matplotlib
from .progress import Progress
from .report import assemble, format_header, format_report, format_summary, write_json
from .sweep import parse_sm_sweep, run_sm_sweep

__all__ = ["add_arguments", "main", "report", "gpu_available", "use_gpu_runner"]

_DESCRIPTION = f"""\
Benchmark and check expert-parallel dispatch + combine.

With no GPU (or --device cpu) it spawns --ranks processes joined by a gloo group on this machine
(default {CPU_DEFAULT_TOKENS} tokens per rank, so the DeepSeek-V3 default finishes in well under a
minute on 2 cores). With a GPU it runs the GPU path: EP=1, one rank per GPU under torchrun, or --virtual-ranks N
emulated ranks on one GPU (default {GPU_DEFAULT_TOKENS} tokens per rank).

Calls, each timed alone after a barrier: full dispatch with and without CPU sync, cached dispatch
(the first dispatch's handle), combine. Times are medians over --iters iterations after --warmup.
On the GPU also: each call back to back, cached dispatch and combine replayed from CUDA graphs,
host time per call, each as a ratio to the floor (the slower of a device copy with the same HBM
traffic and a write of the same output bytes). With --virtual-ranks N, every rank's cached dispatch
(and combine) in one CUDA graph: the device time of one replay against the floor of every rank's
bytes (one GPU: no NVLink, one HBM and one set of SMs for all ranks).

Unless --no-check, the first calls, one more iteration of the timed loop and (GPU) one replay of
each graph are compared element by element with deep_ep.reference, outputs poisoned first (dispatch
bit for bit; combine bit for bit, or to bf16 tolerance with --combine-check tolerant); any
difference is listed by rank, call, output and rows, and the exit code is 1.

Logical bandwidth (DeepEP's "logical" convention: what the layer moves, self-copies included):
  dispatch GB/s = copies * bytes_per_token / 1e9 / dispatch time
  combine  GB/s = copies * 2 * hidden      / 1e9 / combine time
  copies = per (token, destination rank) without --expand, per valid (token, expert) with it;
  bytes_per_token = 2*hidden in bf16, hidden + 4*num_sf with --fp8.
The floor / ratio columns are filled on GPU only.
"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser`` (used by ``deep_ep.__main__``); returns it."""
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
    parser.add_argument("--bias", type=int, choices=(0, 1, 2), default=0,
                        help="bias tensors (bf16 [tokens, hidden]) given to combine (default 0)")
    parser.add_argument("--eplb", type=int, default=0, metavar="REDUNDANT",
                        help="after the plain run, balance experts with deep_ep.eplb over REDUNDANT extra "
                             "expert slots and run again on the replicas; report both (default 0: off)")
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
    parser.add_argument("--combine-check", choices=("exact", "tolerant"), default="exact",
                        help="compare combine outputs bit for bit (default) or to bf16 tolerance")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the comparison with deep_ep.reference")
    parser.add_argument("--legacy-ll", action="store_true",
                        help="GPU: DeepEP's V1 low-latency decode step instead (deep_ep.Buffer, 128 tokens per rank, "
                             "hidden 7168, top-8 of 256, FP8 dispatch, BF16 combine): graph times of dispatch and "
                             "combine, and of each with a receive hook and a matmul between call and hook "
                             "(deep_ep.bench.legacy_ll); reads --virtual-ranks, --iters, --seed, --num-sms, --profile")
    parser.add_argument("--profile", action="store_true",
                        help="with --legacy-ll: also profile each call (torch.profiler): its kernels with their "
                             "device times, and the torch ops it makes")
    parser.add_argument("--nvlink-ranks", type=int, default=None, metavar="N",
                        help="act as nodes of N ranks (CPU: --ranks gloo processes with EP_CPU_NUM_NVLINK_RANKS=N; "
                             "GPU: --virtual-ranks emulated ranks): per --scaleout-mode, times, bytes per "
                             "domain and DeepEP's SO / SU bandwidths (deep_ep.bench.scaleout)")
    parser.add_argument("--scaleout-mode", choices=("both", "hybrid", "direct"), default="both",
                        help="with --nvlink-ranks: allow_hybrid_mode of the buffers (default both, one after the other)")
    parser.add_argument("--scaleout-model", action="store_true",
                        help="print the scale-out paper model instead (bytes per link, predicted times and "
                             "bandwidths; deep_ep.bench.scaleout_model); reads --tokens, --seed; needs no GPU")
    parser.add_argument("--primitive", choices=("pp", "agrs", "engram", "all"), default=None,
                        help="GPU: time an experimental primitive instead (pipeline send/recv, all-gather / "
                             "reduce-scatter, Engram fetch): time and bandwidth per size against a device copy of "
                             "the same bytes, SMs held, and a matmul beside it (deep_ep.bench.primitives); reads "
                             "--virtual-ranks, --iters, --seed, --num-sms (PP blocks), --json, --no-check")
    return parser


def gpu_available() -> bool:
    """Whether torch sees a CUDA device (a broken driver counts as none)."""
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        return False


def use_gpu_runner(args: argparse.Namespace) -> bool:
    """The GPU path is taken with ``--virtual-ranks``, ``--device cuda``, or ``auto`` and a GPU.

    Raises:
        SystemExit: the GPU path is asked for and no CUDA device is visible, or ``--virtual-ranks``
            with ``--device cpu``.
    """
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


def report(args: argparse.Namespace, result: Dict[str, Any]) -> int:
    """Print the report of ``result`` (after the progress lines), write ``--json`` / ``--plot``;
    returns the exit code (1 when the check found a difference)."""
    print(format_report(result))
    if "eplb" in result:
        print(format_eplb_section(result["eplb"]))
    print(format_summary(result), flush=True)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, result)
        print(f"wrote {args.plot}")
    return 0 if (not result["check"]["enabled"] or result["check"]["passed"]) else 1


def main(args: argparse.Namespace, *, cpu_worker_setup: Optional[Callable[[], None]] = None) -> int:
    """Run the bench for parsed ``args``; returns the exit code.

    ``cpu_worker_setup``: see `deep_ep.bench.runner_cpu.run_cpu` (tests only).

    Raises:
        SystemExit: bad options (before any process or communication starts), a failed rank.
    """
    if getattr(args, "scaleout_model", False):
        defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args([]))
        ignored = [f"--{name.replace('_', '-')}" for name, value in sorted(vars(args).items())
                   if name in defaults and name not in ("scaleout_model", "tokens", "seed") and value != defaults[name]]
        if ignored:
            raise SystemExit(f"error: --scaleout-model computes its fixed table (DeepSeek-V3 on EP 8x2, 8x4, 8x16 and "
                             f"NVL72) from --tokens and --seed only; it would ignore {', '.join(ignored)}")
        from .scaleout_model import run_model  # noqa: WPS433
        return run_model(args.tokens, args.seed)
    if getattr(args, "primitive", None):
        from .primitives_gpu import run as run_primitives  # noqa: WPS433 (refuses without CUDA)
        return run_primitives(args)
    if args.plot:
        require_matplotlib()
    if getattr(args, "legacy_ll", False):
        if args.virtual_ranks is not None:
            os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
        from .legacy_ll import run as run_legacy_ll  # noqa: WPS433 (needs CUDA)
        return run_legacy_ll(args)
    if args.virtual_ranks is not None:
        # Emulated ranks need eager kernel loading and enough hardware queues, set before CUDA
        # initialises (deep_ep.emulated).
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    sweep = parse_sm_sweep(getattr(args, "sm_sweep", None))
    gpu = use_gpu_runner(args)
    split = envs.get("EP_CPU_NUM_NVLINK_RANKS") or ""
    if not gpu and split and getattr(args, "nvlink_ranks", 0) is None:
        # the gloo ranks act as nodes whatever the bench is told (deep_ep.topology): time and check them so
        try:
            args.nvlink_ranks = int(split)
        except ValueError:
            raise SystemExit(f"error: EP_CPU_NUM_NVLINK_RANKS={split!r} is not a number of ranks") from None
        print(f"EP_CPU_NUM_NVLINK_RANKS={split} is set: the {args.ranks} gloo ranks act as nodes of {split} "
              f"(as with --nvlink-ranks {split}); unset it for one node", flush=True)
    if getattr(args, "nvlink_ranks", None) is not None:
        from .scaleout import run as run_scaleout  # noqa: WPS433
        return run_scaleout(args, gpu=gpu)
    if sweep and not gpu:
        raise SystemExit("error: --sm-sweep varies the SMs of the GPU kernels; it needs the GPU runner "
                         "(a CUDA device, or --virtual-ranks N)")
    if sweep and args.eplb:
        raise SystemExit("error: --sm-sweep and --eplb cannot be combined; run them separately")
    if gpu:
        from .runner_gpu import run_pass, setup as gpu_setup  # noqa: WPS433 (needs CUDA)
        gs = gpu_setup(args)
        cfg = make_config(args, gs.num_ranks, gpu=True)
        runner, device, show = gs.runner, gs.device_name, gs.rank == 0
    else:
        cfg = make_config(args, args.ranks, gpu=False)
        threads = max(1, (os.cpu_count() or 1) // cfg.num_ranks)
        runner, device, show = "cpu/gloo", f"CPU, {cfg.num_ranks} gloo processes x {threads} thread(s)", True
    works = [Workload(cfg)]
    eplb_info = None
    if cfg.eplb:
        work, eplb_info = make_eplb_workload(cfg)
        works.append(work)
    progress = Progress("gpu" if gpu else "cpu", enabled=show)
    if show:
        print(format_header({"config": dataclasses.asdict(cfg), "runner": runner, "device": device}), flush=True)

    if sweep:
        return run_sm_sweep(args, cfg, sweep, lambda c: run_pass(c, gs, Workload(c), progress),
                            runner=runner, device=device)
    if gpu:
        passes = []
        for work in works:
            p = run_pass(cfg, gs, work, progress if work.name == "logical" else progress.child(work.name))
            if p is None:  # a non-zero rank of a torchrun job: rank 0 reports
                return 0
            passes.append(p)
    else:
        from .runner_cpu import run_cpu
        passes = run_cpu(cfg, works, progress, worker_setup=cpu_worker_setup)
    result = assemble(cfg, passes, runner=runner, device=device)
    if eplb_info is not None:
        result["eplb"] = eplb_section(eplb_info, passes[0]["rows"], passes[1]["rows"])
    return report(args, result)
