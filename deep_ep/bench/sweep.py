"""``--sm-sweep N,N,...`` (GPU): the whole bench once per SM count, then time and bandwidth per count."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

from .config import BenchConfig
from .plot import plot_sm_sweep
from .report import assemble, format_summary, write_json

__all__ = ["parse_sm_sweep", "sm_sweep_point", "format_sm_sweep", "run_sm_sweep"]


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
    """One point of an SM sweep from a GPU bench result (the summary; rank 0's graph times, or with
    emulated ranks those of every rank's call in one graph)."""
    row0 = result["rows"][0]
    summ = result["summary"]
    graphs = result.get("gpu", {}).get("rank_graphs") or {}

    def graph_us(name: str) -> Optional[float]:
        value = row0.get(f"{name}_graph_us")
        return graphs.get(f"{name}_us") if value is None else value
    return {"num_sms": num_sms, "dispatch_us_max": summ["dispatch_us_max"], "combine_us_max": summ["combine_us_max"],
            "dispatch_gbps_mean": summ["dispatch_gbps_mean"], "combine_gbps_mean": summ["combine_gbps_mean"],
            "cached_dispatch_graph_us": graph_us("cached_dispatch"), "combine_graph_us": graph_us("combine"),
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


def run_sm_sweep(args: argparse.Namespace, cfg: BenchConfig, sweep: Sequence[int],
                 run_pass: Callable[[BenchConfig], Optional[Dict[str, Any]]], *, runner: str, device: str) -> int:
    """Run ``run_pass(cfg with num_sms=n)`` (a full checked GPU pass; None on ranks other than 0) for
    each SM count; rank 0 prints each run's summary and the table, writes the points to ``--json``
    and draws them with ``--plot``. Returns the exit code (1 when a run's check failed)."""
    points, result = [], None
    for n in sweep:
        c = dataclasses.replace(cfg, num_sms=n)
        p = run_pass(c)
        if p is None:
            continue
        result = assemble(c, [p], runner=runner, device=device)
        points.append(sm_sweep_point(result, n))
        print(f"--- {n} SMs: {format_summary(result)}", flush=True)
    if result is None:  # a non-zero rank of a multi-process run
        return 0
    print(format_sm_sweep(points))
    if args.json:
        write_json(args.json, {"config": result["config"], "runner": runner, "device": device, "sm_sweep": points})
        print(f"wrote {args.json}")
    if args.plot:
        plot_sm_sweep(args.plot, points, f"deep_ep bench SM sweep: {cfg.model}, {cfg.num_ranks} ranks x "
                                         f"{cfg.tokens} tokens ({runner})")
        print(f"wrote {args.plot}")
    return 0 if all(p["check_passed"] is not False for p in points) else 1
