"""``python -m deep_ep bench --nvlink-ranks N``: dispatch and combine across emulated nodes, per mode.

The ranks act as ``R / N`` nodes of ``N`` ranks: gloo processes with ``EP_CPU_NUM_NVLINK_RANKS=N``
on CPU (``--ranks R``), or ``EmulatedGroup(R, num_nvlink_ranks=N)`` on one GPU (``--virtual-ranks
R``). For each mode of ``--scaleout-mode`` (hybrid, direct, or both) every rank makes the bench's
calls (`deep_ep.bench.session.RankSession`: checked first calls, the timed loop, a checked
iteration) on a buffer made with that ``allow_hybrid_mode``; combine is checked against the
reference in the mode's order (the hybrid order across nodes). A mode the buffer refuses is
reported as refused, with the reason.

Reported per rank and mode: the median full dispatch (CPU sync) and combine times (CUDA events on
the GPU, wall time on CPU); the bytes each puts on NVLink and RDMA, computed from the routing and
the GPU kernels' layouts (`deep_ep.bench.link_bytes`; the CPU backend moves no bytes over links);
DeepEP V2's logical "SO" and "SU" bandwidths (scale-out and scale-up bytes over the measured time).
On emulated nodes also the bytes the emulated NICs carried (`deep_ep.comm.gin.byte_counters`)
around one more full dispatch, cached dispatch and combine, beside the computed RDMA bytes of each.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import reference as ref
from .check import RankExpected
from .config import BenchConfig, Workload, expert_output, make_config
from .link_bytes import deepep_logical_bytes, link_bytes_of_counts, route_counts
from .progress import Progress
from .report import cell, text_table
from .runner_cpu import run_gloo_ranks
from .session import HostClock, RankSession

__all__ = ["MODES", "MEASURED_CALLS", "run", "expected_outputs", "summarize_mode", "format_mode"]

MODES = ("hybrid", "direct")
#: the calls whose NIC bytes are measured on emulated nodes, in order (`deep_ep.bench.session.CALLS` names)
MEASURED_CALLS = ("full_dispatch_cpu_sync", "cached_dispatch", "combine")


def expected_outputs(cfg: BenchConfig, inputs: Sequence[Dict[str, Any]], ranks: Sequence[int],
                     num_scaleup_ranks: int) -> Dict[int, RankExpected]:
    """`deep_ep.reference` on every rank's ``inputs``, kept for ``ranks``; combine in the order of
    ``num_scaleup_ranks`` (the buffer's: ``R`` flat, fewer for hybrid mode across nodes)."""
    xs, idxs, ws = [i["x"] for i in inputs], [i["topk_idx"] for i in inputs], [i["topk_weights"] for i in inputs]
    common = dict(do_expand=cfg.expand, expert_alignment=cfg.alignment, do_zero_padding=cfg.expand,
                  num_max_tokens_per_rank=cfg.max_tokens)
    sync = ref.reference_dispatch(xs, idxs, ws, cfg.num_experts, **common)
    ys = [expert_output(cfg, r.recv_x, rank) for rank, r in enumerate(sync)]
    combined = ref.reference_combine(ys, [r.handle for r in sync], biases=[i["biases"] or None for i in inputs],
                                     num_scaleup_ranks=num_scaleup_ranks)
    no_sync = ref.reference_dispatch(xs, idxs, ws, cfg.num_experts, do_cpu_sync=False, **common)
    if num_scaleup_ranks < len(inputs):
        # Across nodes in hybrid mode the handle counts per scale-up rank (docs/scaleout.md, "Handles
        # across nodes"): the tokens from rank j of every node together.
        for result in [sync[r] for r in ranks] + [no_sync[r] for r in ranks]:
            psum = result.handle.psum_num_recv_tokens_per_scaleup_rank.to(torch.int64)
            per_source = torch.diff(psum, prepend=psum.new_zeros(1))
            result.handle.psum_num_recv_tokens_per_scaleup_rank = torch.cumsum(
                per_source.view(-1, num_scaleup_ranks).sum(0), 0).to(torch.int32)
    return {r: RankExpected(sync[r], no_sync[r], ys[r], combined[r][0]) for r in ranks}


def _rank_pass(cfg: BenchConfig, mode: str, rank: int, group, barrier, clock, progress: Progress,
               expected: Optional[RankExpected], device, buffer_device: Optional[str] = None) -> Dict[str, Any]:
    """One rank's calls in ``mode`` on a fresh buffer; ``{"refused": message}`` when the buffer refuses it."""
    from ..buffer import ElasticBuffer

    try:
        buffer = ElasticBuffer(group, num_max_tokens_per_rank=cfg.max_tokens, hidden=cfg.hidden, num_topk=cfg.top_k,
                               use_fp8_dispatch=cfg.fp8, allow_hybrid_mode=mode == "hybrid", explicitly_destroy=True,
                               **({"device": buffer_device} if buffer_device else {}))
    except NotImplementedError as exc:
        return {"rank": rank, "refused": str(exc)}
    try:
        sess = RankSession(Workload(cfg), rank, buffer, device, barrier, clock, progress, expected)
        sess.first_calls()
        sess.timed_loop()
        sess.checked_iteration()
        measured = _measure_nic_bytes(sess, group)
        result = sess.result()
        if measured is not None:
            result["measured_bytes"] = measured
        result["logical_domains"] = [buffer.num_scaleout_ranks, buffer.num_scaleup_ranks]
        result["num_sms"] = cfg.num_sms or buffer.get_theoretical_num_sms(cfg.num_experts, cfg.top_k)
    finally:
        buffer.destroy()
    return result


def _measure_nic_bytes(sess: RankSession, group) -> Optional[Dict[str, list]]:
    """On emulated nodes (an emulated group of several nodes): one more call of each of
    `MEASURED_CALLS`, each between barriers that drain every rank, and on rank 0 the bytes the
    emulated NICs carried during it, ``{call: [R][R]}`` (`deep_ep.comm.gin.byte_counters`); None
    elsewhere and on the other ranks."""
    parent = getattr(group, "parent", None)
    if parent is None or getattr(parent, "num_nvlink_ranks", parent.num_ranks) >= parent.num_ranks:
        return None
    from ..comm import gin
    readings = []

    def settle() -> None:
        sess.buffer.barrier()   # this rank's kernels, its NIC kernels with them, done; then the host barrier
        if sess.rank == 0:
            readings.append(gin.byte_counters(group))
        sess.barrier()

    settle()
    for name in MEASURED_CALLS:
        sess.call(name)
        settle()
    if sess.rank != 0:
        return None
    return {name: (after - before).tolist() for name, before, after in zip(MEASURED_CALLS, readings, readings[1:])}


def _measured_summary(measured: Dict[str, list], counts, cfg: BenchConfig, hybrid: bool, num_sf: int,
                      calls: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per measured call: the NIC's bytes between nodes (``rdma``) and between ranks of one node
    (``nvlink_by_nic``, 0 unless the GIN reaches them), link_bytes' RDMA bytes of the same call
    (``computed_rdma``; the fresh dispatch with its notify stage) and whether every link agrees."""
    fresh = link_bytes_of_counts(counts, cfg.top_k, hybrid=hybrid, hidden=cfg.hidden, fp8=cfg.fp8, num_sf=num_sf,
                                 notify=True)["dispatch"]
    computed = {"full_dispatch_cpu_sync": fresh.rdma, "cached_dispatch": calls["dispatch"].rdma,
                "combine": calls["combine"].rdma}
    num_ranks = counts.tokens.shape[0]
    ranks = torch.arange(num_ranks, dtype=torch.int64, device=torch.device("cpu"))
    same_node = (ranks[:, None] // counts.num_nvlink_ranks) == (ranks[None, :] // counts.num_nvlink_ranks)
    out = {}
    for name, matrix in measured.items():
        carried = torch.tensor(matrix, dtype=torch.int64, device=torch.device("cpu"))
        out[name] = {"rdma": int(carried[~same_node].sum()), "nvlink_by_nic": int(carried[same_node].sum()),
                     "computed_rdma": int(computed[name].sum()), "per_link_equal": torch.equal(carried, computed[name])}
    return out


def _median_s(samples: List[Dict[str, Optional[float]]]) -> float:
    values = [s["event_s"] if s.get("event_s") is not None else s["sync_s"] for s in samples]
    return statistics.median(values) if values else float("nan")


def summarize_mode(cfg: BenchConfig, mode: str, num_nvlink_ranks: int, results: Sequence[Dict[str, Any]],
                   topk_idxs: Sequence[torch.Tensor]) -> Dict[str, Any]:
    """One mode's report: per rank times, computed bytes per domain and DeepEP's SO / SU bandwidths.

    Returns ``{"mode", "refused" (str or None), "logical_domains", "rows": [per rank], "totals":
    {call: {domain: bytes}}, "mismatches": [...], "checked": [...]}``.
    """
    refused = next((r["refused"] for r in results if "refused" in r), None)
    out: Dict[str, Any] = {"mode": mode, "refused": refused, "rows": [], "totals": {}, "mismatches": [],
                           "checked": []}
    if refused is not None:
        return out
    hybrid = mode == "hybrid"
    counts = route_counts(topk_idxs, cfg.num_experts, num_nvlink_ranks)
    num_sf = cfg.num_sf if cfg.fp8 else 0
    calls = link_bytes_of_counts(counts, cfg.top_k, hybrid=hybrid, hidden=cfg.hidden, fp8=cfg.fp8, num_sf=num_sf)
    domains = results[0]["logical_domains"]
    logical = deepep_logical_bytes(counts, cfg.top_k, domains[0], hidden=cfg.hidden, fp8=cfg.fp8, num_sf=num_sf)
    per_rank = {name: call.per_rank() for name, call in calls.items()}
    for res in results:
        rank = res["rank"]
        row = {"rank": rank, "num_sms": res.get("num_sms"),
               "check": (not any(m["rank"] == rank for m in res["mismatches"])) if res["checked"] else None}
        for name, key in (("dispatch", "full_dispatch_cpu_sync"), ("combine", "combine")):
            seconds = _median_s(res["samples"][key])
            row[f"{name}_us"] = seconds * 1e6
            for domain in ("nvlink", "rdma"):
                row[f"{name}_{domain}_sent_bytes"] = per_rank[name][domain]["sent"][rank]
                row[f"{name}_{domain}_received_bytes"] = per_rank[name][domain]["received"][rank]
            scaleout, scaleup = logical[name]["scaleout"][rank], logical[name]["scaleup"][rank]
            row[f"{name}_so_bytes"], row[f"{name}_su_bytes"] = scaleout, scaleup
            row[f"{name}_so_gbps"] = scaleout / 1e9 / seconds if domains[0] > 1 and seconds > 0 else None
            row[f"{name}_su_gbps"] = scaleup / 1e9 / seconds if seconds > 0 else None
        out["rows"].append(row)
        out["mismatches"].extend(res["mismatches"])
    out["checked"] = results[0]["checked"]
    out["logical_domains"] = domains
    out["totals"] = {name: call.totals() for name, call in calls.items()}
    measured = next((r["measured_bytes"] for r in results if r.get("measured_bytes")), None)
    if measured is not None:
        out["measured"] = _measured_summary(measured, counts, cfg, hybrid, num_sf, calls)
    return out


def format_mode(summary: Dict[str, Any]) -> str:
    """The mode's lines: its rank table, or why the buffer refused it."""
    mode = summary["mode"]
    if summary["refused"] is not None:
        return f"{mode} mode: refused by the buffer: {summary['refused']}"
    so, su = summary["logical_domains"]
    header = ["rank", "dispatch us", "NVLink MB", "RDMA MB", "SO GB/s", "SU GB/s",
              "combine us", "NVLink MB", "RDMA MB", "SO GB/s", "SU GB/s", "SMs", "check"]
    body = []
    for row in summary["rows"]:
        cells = [str(row["rank"])]
        for name in ("dispatch", "combine"):
            cells += [cell(row[f"{name}_us"], "{:.1f}"), cell(row[f"{name}_nvlink_sent_bytes"] / 1e6, "{:.2f}"),
                      cell(row[f"{name}_rdma_sent_bytes"] / 1e6, "{:.2f}"), cell(row[f"{name}_so_gbps"], "{:.1f}"),
                      cell(row[f"{name}_su_gbps"], "{:.1f}")]
        cells += [cell(row["num_sms"], "{}"), cell(row["check"], None)]
        body.append(cells)
    totals = "; ".join(f"{name}: NVLink {t['nvlink'] / 1e6:.2f} MB, RDMA {t['rdma'] / 1e6:.2f} MB"
                       for name, t in summary["totals"].items())
    verdict = "check: n/a" if not summary["checked"] else (
        "check: passed" if not summary["mismatches"] else
        "check: FAILED:\n" + "\n".join(f"  {m['message']}" for m in summary["mismatches"][:20]))
    lines = [f"{mode} mode (logical domains {so} x {su}):", text_table(header, body), f"all ranks, computed: {totals}"]
    if summary.get("measured"):
        lines.append("all ranks, measured by the emulated NICs: " + "; ".join(
            f"{name}: RDMA {m['rdma'] / 1e6:.4f} MB (computed {m['computed_rdma'] / 1e6:.4f} MB, per link "
            f"{'equal' if m['per_link_equal'] else 'DIFFERENT'})"
            + (f", NVLink through the NIC {m['nvlink_by_nic'] / 1e6:.4f} MB" if m["nvlink_by_nic"] else "")
            for name, m in summary["measured"].items()))
    return "\n".join(lines + [verdict])


def run(args: argparse.Namespace, *, gpu: bool) -> int:
    """Run ``--nvlink-ranks`` for parsed ``args``; returns the exit code (1: a checked output differs).

    Raises:
        SystemExit: bad options, a failed rank.
    """
    num_ranks = args.virtual_ranks if gpu else args.ranks
    if gpu and args.virtual_ranks is None:
        raise SystemExit("error: --nvlink-ranks on the GPU emulates nodes on one GPU: add --virtual-ranks R")
    cfg = make_config(args, num_ranks, gpu=gpu)
    nvlink_ranks = args.nvlink_ranks
    if nvlink_ranks < 1 or num_ranks % nvlink_ranks:
        raise SystemExit(f"error: --nvlink-ranks {nvlink_ranks} must divide the {num_ranks} ranks")
    if args.eplb or getattr(args, "sm_sweep", None) or args.plot:
        raise SystemExit("error: --nvlink-ranks cannot be combined with --eplb, --sm-sweep or --plot")
    modes = MODES if args.scaleout_mode == "both" else (args.scaleout_mode,)
    progress = Progress("gpu" if gpu else "cpu")
    where = f"{num_ranks} {'emulated ranks on one GPU' if gpu else 'gloo processes'}"
    print(f"scale-out bench: {where} as {num_ranks // nvlink_ranks} nodes x {nvlink_ranks}; {cfg.model} "
          f"(hidden {cfg.hidden}, top-{cfg.top_k} of {cfg.num_experts}), {cfg.tokens} tokens per rank, "
          f"{'FP8' if cfg.fp8 else 'BF16'} dispatch, modes: {', '.join(modes)}", flush=True)
    per_mode = _run_gpu(cfg, modes, nvlink_ranks, progress) if gpu else _run_cpu(cfg, modes, nvlink_ranks, progress)
    topk_idxs = [Workload(cfg).inputs(rank)["topk_idx"] for rank in range(num_ranks)]
    summaries = [summarize_mode(cfg, mode, nvlink_ranks, per_mode[mode], topk_idxs) for mode in modes]
    for summary in summaries:
        print(format_mode(summary))
    print("NVLink / RDMA MB: bytes each rank sends per call, computed from the routing and the GPU kernels' row "
          "layouts (deep_ep.bench.link_bytes); SO / SU: DeepEP V2's logical scale-out / scale-up bytes over the "
          "measured time (SO only with several scale-out ranks, i.e. hybrid mode across nodes)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "num_nvlink_ranks": nvlink_ranks, "runner": "gpu/emulated" if gpu else "cpu/gloo",
                       "modes": summaries}, f, indent=1)
        print(f"wrote {args.json}")
    failed = any(s["mismatches"] for s in summaries)
    return 1 if failed else 0


def _run_gpu(cfg: BenchConfig, modes: Sequence[str], nvlink_ranks: int, progress: Progress) -> Dict[str, list]:
    from .. import emulated
    from .gpu_timing import CudaClock

    device = torch.device("cuda", torch.cuda.current_device())
    inputs = [Workload(cfg).inputs(rank, device) for rank in range(cfg.num_ranks)]
    silent = Progress(progress.tag, enabled=False)
    out = {}
    for mode in modes:
        scaleup = nvlink_ranks if mode == "hybrid" else cfg.num_ranks
        expected = expected_outputs(cfg, inputs, range(cfg.num_ranks), scaleup) if cfg.check else None
        progress.say(f"{mode} mode: reference ready" if cfg.check else f"{mode} mode")
        group = emulated.EmulatedGroup(cfg.num_ranks, device=device, num_nvlink_ranks=nvlink_ranks)
        out[mode] = group.run(lambda g: _rank_pass(
            cfg, mode, g.rank(), g, g.barrier, CudaClock(), progress if g.rank() == 0 else silent,
            expected[g.rank()] if expected is not None else None, device))
    return out


def _run_cpu(cfg: BenchConfig, modes: Sequence[str], nvlink_ranks: int, progress: Progress) -> Dict[str, list]:
    return run_gloo_ranks(cfg.num_ranks, _cpu_modes, (cfg, tuple(modes), nvlink_ranks), progress, "deep_ep_scaleout_",
                          functools.partial(_set_nvlink_ranks, nvlink_ranks))


def _set_nvlink_ranks(nvlink_ranks: int) -> None:
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = str(nvlink_ranks)


def _cpu_modes(rank: int, progress: Progress, cfg: BenchConfig, modes: Sequence[str], nvlink_ranks: int) -> dict:
    """Every mode of ``modes`` on this rank; on rank 0 each mode's gathered results."""
    import torch.distributed as dist

    group = dist.group.WORLD
    inputs = [Workload(cfg).inputs(source) for source in range(cfg.num_ranks)] if cfg.check else None
    out = {}
    for mode in modes:
        scaleup = nvlink_ranks if mode == "hybrid" else cfg.num_ranks
        expected = expected_outputs(cfg, inputs, [rank], scaleup)[rank] if cfg.check else None
        progress.say(f"{mode} mode: rank {rank} starts")
        result = _rank_pass(cfg, mode, rank, group, lambda: dist.barrier(group), HostClock(), progress, expected,
                            torch.device("cpu"), buffer_device="cpu")
        gathered = [None] * cfg.num_ranks if rank == 0 else None
        dist.gather_object(result, gathered, dst=0, group=group)
        out[mode] = gathered
    return out
