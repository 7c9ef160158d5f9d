"""The bench's report: per-rank rows, the per-call table, the check's verdict, the JSON result.

Result dict (``--json``)::

    {"config": {...}, "runner": str, "device": str, "torch": str, "date": str,
     "bandwidth_formula": str,
     "check": {"enabled", "passed", "comparison", "failures": [str], "mismatches": [dict],
               "checked": [{"when", "call", "phase"}] (rank 0's list; every rank checks the same)},
     "rows": [row per rank], "summary": {...},
     "gpu": {...} (GPU runner; with emulated ranks "rank_graphs": `deep_ep.bench.rank_graphs`'s
            figures), "eplb": {...} (with --eplb)}

A row (:func:`make_row`) has the table's columns plus ``calls``: for each call of
`deep_ep.bench.session.CALLS`, the statistics of :func:`call_stats`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence

import torch

from .config import BANDWIDTH_FORMULA, BenchConfig, bandwidth_gbps
from .session import CALL_TITLES, CALLS

__all__ = ["make_row", "call_stats", "rank_row", "format_table", "summarize", "format_header",
           "format_calls", "format_check", "format_summary", "format_gpu", "format_rank_graphs", "format_report",
           "build_result", "assemble", "write_json", "cell", "text_table"]

MAX_MISMATCH_LINES = 20


def make_row(cfg: BenchConfig, rank: int, *, sent: int, received: int, received_rows: int,
             dispatch_times: Sequence[float], combine_times: Sequence[float],
             check: Optional[bool], floor_us: Optional[float] = None,
             extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One rank's row of the table / JSON (times in seconds in, microseconds out).

    ``sent``: copies of this rank's tokens (`deep_ep.bench.config.token_copies`); ``received``: rows
    received before padding; ``received_rows``: rows including alignment padding; ``check``: None
    when not checked. ``floor_us``: the GPU runner's floor (the slower of a same-traffic copy and a
    write of the output bytes); ratios are time / floor.
    """
    d_med = statistics.median(dispatch_times)
    c_med = statistics.median(combine_times)
    d_bytes = sent * cfg.dispatch_bytes_per_token
    c_bytes = sent * cfg.combine_bytes_per_token
    row = {
        "rank": rank, "tokens": cfg.tokens, "sent": sent, "received": received, "received_rows": received_rows,
        "dispatch_bytes": d_bytes, "combine_bytes": c_bytes,
        "dispatch_us": d_med * 1e6, "combine_us": c_med * 1e6,
        "dispatch_us_all": [t * 1e6 for t in dispatch_times],
        "combine_us_all": [t * 1e6 for t in combine_times],
        "dispatch_gbps": bandwidth_gbps(d_bytes, d_med), "combine_gbps": bandwidth_gbps(c_bytes, c_med),
        "floor_us": floor_us,
        "dispatch_ratio": (d_med * 1e6 / floor_us) if floor_us else None,
        "combine_ratio": (c_med * 1e6 / floor_us) if floor_us else None,
        "check": check,
    }
    if extra:
        row.update(extra)
    return row


def _ratio(us: Optional[float], floor_us: Optional[float]) -> Optional[float]:
    if us is None or not floor_us or (isinstance(us, float) and math.isnan(us)):
        return None
    return us / floor_us


def _median_us(samples: Sequence[Dict[str, Optional[float]]], key: str) -> Optional[float]:
    values = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(values) * 1e6 if values else None


def call_stats(samples: Sequence[Dict[str, Optional[float]]], extra: Dict[str, Optional[float]],
               floor_us: Optional[float]) -> Dict[str, Any]:
    """Statistics of one call, in us, each with its ratio to ``floor_us`` (None without a floor).

    ``samples``: the timed loop's samples (``sync_s``, ``host_s``, ``event_s`` in seconds, None when
    not measured); ``extra``: ``b2b_s``, ``b2b_host_s`` (seconds per call back to back: until the
    device is done / until the host returned), ``graph_us`` (device time per call replayed from a
    CUDA graph), each optional. Returns ``sync_us`` (median: a device sync before and after the call),
    ``event_us`` (median: device events around it), ``host_us`` (median host time of the call),
    ``b2b_us``, ``b2b_host_us``, ``graph_us``, the per-sample ``sync_us_all``, ``floor_us`` and
    ``sync_ratio``, ``event_ratio``, ``host_ratio``, ``b2b_ratio``, ``graph_ratio``.
    """
    def us(key):
        v = extra.get(key)
        return None if v is None else v * 1e6
    out: Dict[str, Any] = {
        "sync_us": _median_us(samples, "sync_s"),
        "event_us": _median_us(samples, "event_s"),
        "host_us": _median_us(samples, "host_s"),
        "b2b_us": us("b2b_s"),
        "b2b_host_us": us("b2b_host_s"),
        "graph_us": extra.get("graph_us"),
        "sync_us_all": [s["sync_s"] * 1e6 for s in samples],
        "floor_us": floor_us,
    }
    for key in ("sync", "event", "host", "b2b", "graph"):
        out[key + "_ratio"] = _ratio(out[key + "_us"], floor_us)
    return out


def _times(samples: Sequence[Dict[str, Optional[float]]]) -> List[float]:
    """Per-sample seconds of a call for the main table: device events where measured, else wall time."""
    return [s["event_s"] if s.get("event_s") is not None else s["sync_s"] for s in samples]


def rank_row(cfg: BenchConfig, res: Dict[str, Any], floors: Optional[Dict[str, float]] = None,
             extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The row of one rank from `RankSession.result` ``res``; ``floors``: ``{"dispatch": us,
    "combine": us}`` (GPU) or None. The table's dispatch / combine columns are the full dispatch with
    CPU sync and the combine of the timed loop."""
    floors = floors or {}
    calls = {name: call_stats(res["samples"][name], res["extra"].get(name, {}),
                              floors.get("combine" if name == "combine" else "dispatch"))
             for name in CALLS}
    row = make_row(cfg, res["rank"], sent=res["sent"], received=res["received"],
                   received_rows=res["received_rows"],
                   dispatch_times=_times(res["samples"]["full_dispatch_cpu_sync"]),
                   combine_times=_times(res["samples"]["combine"]),
                   check=(not res["mismatches"]) if cfg.check else None, floor_us=floors.get("dispatch"),
                   extra=extra)
    if floors.get("combine"):
        row["combine_ratio"] = row["combine_us"] / floors["combine"]
    row["calls"] = calls
    return row


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------

_COLUMNS = [
    ("rank", "rank", "{}"), ("tokens", "tokens", "{}"), ("sent", "sent", "{}"), ("received", "recv", "{}"),
    ("dispatch_us", "dispatch us", "{:.1f}"), ("combine_us", "combine us", "{:.1f}"),
    ("dispatch_gbps", "dispatch GB/s", "{:.2f}"), ("combine_gbps", "combine GB/s", "{:.2f}"),
    ("floor_us", "floor us", "{:.1f}"), ("dispatch_ratio", "disp/floor", "{:.2f}"),
    ("combine_ratio", "comb/floor", "{:.2f}"), ("check", "check", None),
]


def cell(value, fmt) -> str:
    """A table cell: ``n/a`` for None / NaN; ``fmt=None`` is the check column (ok / FAIL / n/a)."""
    if fmt is None:
        return "n/a" if value is None else ("ok" if value else "FAIL")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return fmt.format(value)


def text_table(header: Sequence[str], body: Sequence[Sequence[str]], left: int = 0) -> str:
    """Columns right-aligned (the first ``left`` ones left-aligned), a dashed rule under the header."""
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in body])


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """Plain-text table of per-rank rows (see :func:`make_row`); None cells print ``n/a``."""
    body = [[cell(row.get(key), fmt) for key, _, fmt in _COLUMNS] for row in rows]
    return text_table([title for _, title, _ in _COLUMNS], body)


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
    """The configuration lines (needs only ``config``, ``runner`` and ``device`` of ``result``)."""
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
    extras = ""
    if c.get("bias"):
        extras += f"; combine bias: {c['bias']} tensor(s)"
    if c.get("eplb"):
        extras += f"; EPLB: {c['eplb']} redundant expert slots"
    return (
        f"deep_ep bench: {c['model']} (hidden {c['hidden']}, {c['num_experts']} experts, top-{c['top_k']}), "
        f"{c['num_ranks']} ranks x {c['tokens']} tokens, {mode} dispatch, {layout}, alignment {c['alignment']}\n"
        f"runner: {result['runner']} on {result['device']}; routing: {route}{extras}; "
        f"{c['iters']} iters (+{c['warmup']} warm-up), medians; seed {c['seed']}"
    )


def _call_cell(stats: Dict[str, Any], key: str) -> str:
    us = stats.get(key + "_us")
    if us is None:
        return "n/a"
    ratio = stats.get(key + "_ratio")
    return f"{us:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def format_calls(row: Dict[str, Any], floors: Optional[Dict[str, float]] = None,
                 baselines: Optional[Dict[str, float]] = None) -> str:
    """The per-call table of one rank's row: synchronised, back-to-back, graph-replayed and host time
    per call, each with its ratio to the floor; then plain torch's permute / un-permute (EP=1)."""
    floors = floors or {}
    if floors.get("dispatch") and floors.get("combine"):
        floor_text = (f"(x): ratio to the floor, the slower of a device copy with the same HBM traffic and a "
                      f"write of the same output bytes: dispatch "
                      f"{floors['dispatch']:.1f} us, combine {floors['combine']:.1f} us")
    else:
        floor_text = "no floor on CPU"
    calls = row.get("calls", {})
    body = [[CALL_TITLES[name]] + [_call_cell(calls[name], k) for k in ("sync", "b2b", "graph", "host")]
            for name in CALLS if name in calls]
    lines = [f"calls on rank {row['rank']}, us per call (medians; {floor_text}):",
             text_table(["call", "synchronised", "back to back", "graph replay", "host"], body, left=1)]
    b = baselines or {}
    if "torch_permute_us" in b:
        def with_ratio(us, floor):
            return f"{us:.1f} us" + (f" ({us / floor:.2f}x)" if floor else "")
        lines.append(f"plain torch at EP=1: permute {with_ratio(b['torch_permute_us'], floors.get('dispatch'))}, "
                     f"weighted un-permute {with_ratio(b['torch_unpermute_us'], floors.get('combine'))}")
    if "host_ref_alloc_us" in b:
        lines.append(f"host reference (this process, for the host column): a cached torch.empty "
                     f"{b['host_ref_alloc_us']:.1f} us, a torch kernel launch {b['host_ref_launch_us']:.1f} us")
    return "\n".join(lines)


def _checked_text(checked: Sequence[Dict[str, str]]) -> str:
    groups: Dict[str, List[str]] = {}
    for entry in checked:
        key = entry["when"] + ("" if entry.get("phase", "logical") == "logical" else f" [{entry['phase']}]")
        groups.setdefault(key, []).append(entry["call"])
    return "; ".join(f"{when}: {', '.join(calls)}" for when, calls in groups.items())


def format_check(check: Dict[str, Any]) -> str:
    """The check's verdict; ``check: all outputs match deep_ep.reference`` only when every checked
    output of every rank matched."""
    if not check["enabled"]:
        return "check: not checked (--no-check)"
    lines = []
    if check.get("checked"):
        lines.append(f"checked on every rank ({check.get('comparison', 'bit for bit')}, outputs poisoned): "
                     + _checked_text(check["checked"]))
    if check["passed"]:
        lines.append("check: all outputs match deep_ep.reference")
        return "\n".join(lines)
    failures = check.get("failures", [])
    lines.append(f"check: FAILED: {len(failures)} output(s) differ from deep_ep.reference")
    lines += ["  " + f for f in failures[:MAX_MISMATCH_LINES]]
    if len(failures) > MAX_MISMATCH_LINES:
        lines.append(f"  ... and {len(failures) - MAX_MISMATCH_LINES} more (all of them in --json)")
    return "\n".join(lines)


def format_summary(result: Dict[str, Any]) -> str:
    """The lines below the table: slowest rank, mean bandwidths, load imbalance, the check."""
    s = result.get("summary", {})
    lines = []
    if s:
        lines.append(
            f"slowest rank: dispatch {s['dispatch_us_max']:.1f} us, combine {s['combine_us_max']:.1f} us; "
            f"mean logical bandwidth: dispatch {s['dispatch_gbps_mean']:.2f} GB/s, "
            f"combine {s['combine_gbps_mean']:.2f} GB/s; received max/mean "
            f"{cell(s['recv_max_over_mean'], '{:.2f}')}")
    lines.append(format_check(result["check"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Result and JSON
# ---------------------------------------------------------------------------------------------


def build_result(cfg: BenchConfig, rows: List[Dict[str, Any]], mismatches: List[Dict[str, Any]], *,
                 runner: str, device: str, checked: Sequence[Dict[str, str]] = ()) -> Dict[str, Any]:
    """Assemble the result dict (schema in the module docstring); ``mismatches``: `Mismatch.as_dict`
    of every rank, ``checked``: rank 0's checked calls."""
    comparison = "bit for bit" if cfg.combine_check == "exact" else \
        "dispatch bit for bit, combine to bf16 tolerance"
    return {
        "config": dataclasses.asdict(cfg),
        "runner": runner,
        "device": device,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "bandwidth_formula": BANDWIDTH_FORMULA,
        "check": {"enabled": cfg.check, "passed": cfg.check and not mismatches, "comparison": comparison,
                  "failures": [m["message"] for m in mismatches], "mismatches": list(mismatches),
                  "checked": list(checked)},
        "rows": sorted(rows, key=lambda r: r["rank"]),
        "summary": summarize(rows),
    }


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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_jsonable(result), f, indent=2, sort_keys=False)
        f.write("\n")


def format_gpu(gpu: Dict[str, Any]) -> str:
    """The GPU runner's lines: the floor, kernel modules, and under torchrun the NVLink baselines."""
    st = gpu.get("jit", {})
    def part(name: str) -> str:   # the floor's two measurements, when the run recorded them
        copy, write = gpu.get(f"floor_{name}_copy_us"), gpu.get(f"floor_{name}_write_us")
        return "" if copy is None or write is None else f" (copy {copy:.1f}, write {write:.1f})"
    lines = [f"floor (the slower of a D2D copy with the same HBM traffic and a write of the same output bytes): "
             f"dispatch {gpu['floor_dispatch_us']:.1f} us{part('dispatch')}, combine "
             f"{gpu['floor_combine_us']:.1f} us{part('combine')}; kernel modules built/loaded: "
             f"{gpu.get('kernel_modules')} (compiled {st.get('builds', 0)}, disk hits {st.get('disk_hits', 0)})"]
    if "all_to_all_dispatch_us" in gpu:
        nvlink = f"{gpu['nvlink_copy_us']:.1f}" if "nvlink_copy_us" in gpu else "n/a"
        lines.append(f"rank 0 baselines: NVLink peer copy of its dispatch bytes {nvlink} us; "
                     f"all_to_all_single dispatch {gpu['all_to_all_dispatch_us']:.1f} us")
    return "\n".join(lines)


def format_rank_graphs(graphs: Dict[str, Any]) -> str:
    """The lines of every emulated rank's call replayed from one CUDA graph (``gpu["rank_graphs"]``,
    `deep_ep.bench.rank_graphs.run_rank_graphs`): the median device time of one replay of each call,
    with its ratio to the floor of every rank's bytes."""
    def us(value) -> str:
        return "n/a" if value is None else f"{value:.1f} us"
    lines = [f"all {graphs['ranks']} emulated ranks' calls in one CUDA graph, device time of one replay (median of "
             f"{graphs['replays']}; (x): ratio to the floor of every rank's bytes on one GPU: dispatch "
             f"{us(graphs.get('floor_dispatch_us'))}, combine {us(graphs.get('floor_combine_us'))}):"]
    for name in ("cached_dispatch", "combine"):
        ratio = graphs.get(f"{name}_ratio")
        lines.append(f"graph {CALL_TITLES[name]} {us(graphs.get(f'{name}_us'))}"
                     + (f" ({ratio:.2f}x)" if ratio is not None else ""))
    return "\n".join(lines)


def assemble(cfg: BenchConfig, passes: Sequence[Dict[str, Any]], *, runner: str, device: str) -> Dict[str, Any]:
    """The result of a run from its passes (the runners' dicts: ``name``, ``rows``, ``mismatches``,
    ``checked``, ``floors``, ``baselines``, on GPU ``gpu``): the first pass gives the table; the
    check covers every pass; ``passes`` keeps the other passes' rows by name."""
    main = passes[0]
    result = build_result(cfg, main["rows"], [m for p in passes for m in p["mismatches"]], runner=runner,
                          device=device, checked=[c for p in passes for c in p["checked"]])
    result["floors"] = dict(main.get("floors") or {})
    result["baselines"] = dict(main.get("baselines") or {})
    if "gpu" in main:
        result["gpu"] = main["gpu"]
    result["passes"] = {p["name"]: {"rows": p["rows"], "floors": p.get("floors") or {}} for p in passes[1:]}
    return result


def format_report(result: Dict[str, Any]) -> str:
    """Everything printed after the progress lines, but the EPLB section (`deep_ep.bench.eplb`) and
    the summary: the per-rank table, the GPU lines, rank 0's per-call table and, with emulated ranks,
    the lines of every rank's call in one CUDA graph."""
    rows = result["rows"]
    parts = [format_table(rows)]
    if "gpu" in result:
        parts.append(format_gpu(result["gpu"]))
    if rows:
        parts.append(format_calls(rows[0], result.get("floors"), result.get("baselines")))
    if result.get("gpu", {}).get("rank_graphs"):
        parts.append(format_rank_graphs(result["gpu"]["rank_graphs"]))
    return "\n".join(parts)
