"""``python -m deep_ep bench --primitive pp|agrs|engram|all``: the experimental primitives on the GPU.

This module holds what needs no GPU: the option checks (a clear refusal without CUDA), the cases
(sizes, shapes), the byte counts, the floor and overlap arithmetic, the report lines and the JSON
result. `deep_ep.bench.primitives_gpu` runs the cases (EP=1 through a one-rank NCCL group, one rank
per GPU under torchrun, or ``--virtual-ranks N`` emulated ranks on one GPU).

Conventions: a case's ``bytes`` are the payload its calls move in this process per call (emulated
ranks: every rank's together, as they share one GPU); the floor is a device copy of those bytes
measured in the same run (`deep_ep.bench.gpu_timing.copy_floor_us`); GB/s is bytes / 1e9 / time.
The overlap floor of a transfer that holds no SM is the matmul beside plain copy-engine copies of
the call's moves (`plain_copies`); with emulated ranks the 5% bound judges the call's slowdown in
excess of it (one GPU's HBM and copy engines carry every rank's bytes), else the slowdown itself.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["PRIMITIVES", "DEFAULT_ITERS", "HIDDEN", "ZERO_SM_SLOWDOWN_BOUND", "MATMULS", "Matmul", "Case", "cases",
           "prepare", "reduce_scatter_rows", "bytes_per_rank", "process_bytes", "peer_bytes", "sms_held",
           "plain_copies", "bandwidth_gbps", "ratio", "slowdown_percent", "matmul_count", "bound_applies",
           "bound_verdict", "format_case", "format_header", "build_result"]

PRIMITIVES = ("pp", "agrs", "engram")
DEFAULT_ITERS = 20
#: DeepSeek-V3's hidden size: the Engram rows and the memory-bound overlap matmul's width.
HIDDEN = 7168
#: Columns of the bf16 tensors PP and AGRS move (a tensor of ``n`` bytes is ``[n / 2048, 1024]``).
COLUMNS = 1024
#: The compute-bound matmul beside a transfer that holds no SM should run at most this much slower (percent).
ZERO_SM_SLOWDOWN_BOUND = 5.0
#: Matmuls in one overlap round, at most.
MAX_MATMULS_PER_ROUND = 4096
KIB, MIB = 1 << 10, 1 << 20
#: Blocks of the Engram gather kernel: one warp per fetched row, 8 warps per block.
ENGRAM_ROWS_PER_BLOCK = 8
#: Bytes one PP block copies per step (512 threads, 16-byte stores).
PP_BYTES_PER_BLOCK_STEP = 16 * 512


@dataclasses.dataclass(frozen=True)
class Matmul:
    """A bf16 matmul ``[rows, width] x [width, width]`` of the overlap lines, repeated to last about as
    long as the transfer. ``kind``: ``compute-bound`` (its arithmetic, not HBM, limits it: what competes
    with a transfer only for SMs) or ``memory-bound`` (it streams its weights from HBM: what competes
    with the copies for bandwidth)."""

    kind: str
    rows: int
    width: int

    @property
    def key(self) -> str:
        """Its key in a row's ``overlap``: ``compute_bound`` or ``memory_bound``."""
        return self.kind.replace("-", "_")

    @property
    def shape(self) -> str:
        return f"[{self.rows}, {self.width}] x [{self.width}, {self.width}]"


#: The overlap matmuls: 2048 x 4096 x 4096 does about 1000 flops per byte it moves, well above an
#: H200's ratio of compute to HBM bandwidth; 64 x 7168 x 7168 streams 100 MB of weights for 6.6 Gflop.
MATMULS = (Matmul("compute-bound", 2048, 4096), Matmul("memory-bound", 64, HIDDEN))


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed transfer.

    ``primitive``: ``pp``, ``agrs`` or ``engram``; ``op``: ``send_recv`` (pp_send to the next rank,
    pp_recv from the previous one), ``all_gather``, ``reduce_scatter`` or ``fetch`` (engram_fetch and
    its hook). ``num_bytes``: PP / AGRS, the bf16 tensor's bytes per rank (reduce_scatter: its
    input, rounded down to whole rows per rank). Engram: ``tokens`` x ``entries`` rows of ``hidden``
    in ``dtype`` (``bf16``, or ``fp8`` with float32 scale factors, one per 128 channels)."""

    primitive: str
    op: str
    num_bytes: int = 0
    dtype: str = "bf16"
    tokens: int = 0
    entries: int = 0
    hidden: int = 0

    @property
    def label(self) -> str:
        if self.primitive == "engram":
            return f"engram fetch {self.tokens} tokens x {self.entries} entries, hidden {self.hidden} {self.dtype}"
        size = f"{self.num_bytes // MIB} MiB" if self.num_bytes >= MIB else f"{self.num_bytes // KIB} KiB"
        name = {"send_recv": "pp send+recv", "all_gather": "agrs all_gather",
                "reduce_scatter": "agrs reduce_scatter"}[self.op]
        return f"{name} {size} {self.dtype}" + (" (input per rank)" if self.op == "reduce_scatter" else " per rank")


def cases(primitive: str) -> List[Case]:
    """The cases of ``primitive`` (``pp``, ``agrs`` or ``engram``), smallest first.

    Raises:
        ValueError: an unknown primitive.
    """
    if primitive == "pp":
        return [Case("pp", "send_recv", size) for size in (64 * KIB, MIB, 16 * MIB)]
    if primitive == "agrs":
        return ([Case("agrs", "all_gather", size) for size in (MIB, 16 * MIB)]
                + [Case("agrs", "reduce_scatter", size) for size in (MIB, 16 * MIB)])
    if primitive == "engram":
        return [Case("engram", "fetch", dtype="bf16", tokens=128, entries=4, hidden=HIDDEN),
                Case("engram", "fetch", dtype="bf16", tokens=128, entries=16, hidden=HIDDEN),
                Case("engram", "fetch", dtype="fp8", tokens=128, entries=4, hidden=HIDDEN)]
    raise ValueError(f"unknown primitive {primitive!r}; expected one of {PRIMITIVES}")


def prepare(args) -> List[str]:
    """Check the options of ``--primitive`` before CUDA starts; returns the primitives to run.

    Emulated ranks need eager kernel loading and enough hardware queues, set here before CUDA
    initialises (`deep_ep.emulated`).

    Raises:
        SystemExit: no CUDA device (or a CPU build of torch), ``--device cpu``, ``--virtual-ranks``
            or ``--iters`` below 1, or an option of the dispatch/combine bench that does not apply.
    """
    for flag, given in (("--legacy-ll", getattr(args, "legacy_ll", False)), ("--eplb", getattr(args, "eplb", 0)),
                        ("--sm-sweep", getattr(args, "sm_sweep", None)), ("--plot", getattr(args, "plot", None))):
        if given:
            raise SystemExit(f"error: --primitive cannot be combined with {flag}; run them separately")
    if args.iters is not None and args.iters < 1:
        raise SystemExit(f"error: --iters must be >= 1, got {args.iters}")
    if args.virtual_ranks is not None and args.virtual_ranks < 1:
        raise SystemExit(f"error: --virtual-ranks must be >= 1, got {args.virtual_ranks}")
    if args.device == "cpu":
        raise SystemExit("error: --primitive times the primitives' GPU paths; drop --device cpu (their CPU "
                         "backend is covered by the tests, not timed)")
    if args.virtual_ranks is not None:
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    if not _cuda_visible():
        raise SystemExit("error: --primitive runs on the GPU (copy kernels, copy engines, the Engram gather); "
                         "no CUDA device is visible (or torch is a CPU build)")
    return list(PRIMITIVES) if args.primitive == "all" else [args.primitive]


def _cuda_visible() -> bool:
    import torch
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken driver counts as none
        return False


def reduce_scatter_rows(num_bytes: int, num_ranks: int) -> int:
    """Rows (of `COLUMNS` bf16) of a reduce_scatter input of about ``num_bytes``: a multiple of
    ``num_ranks``, at least ``num_ranks``."""
    rows = num_bytes // (2 * COLUMNS)
    return max(num_ranks, rows // num_ranks * num_ranks)


def _engram_row_bytes(case: Case) -> int:
    if case.dtype == "fp8":
        return case.hidden + 4 * (case.hidden // 128)   # the entry and its float32 scale factors
    return 2 * case.hidden


def bytes_per_rank(case: Case, num_ranks: int) -> int:
    """Payload bytes one rank's call moves: PP, the tensor (sent once, received once); all_gather,
    the tensor to every rank, its own row included (``num_ranks`` x); reduce_scatter, the input (a
    chunk to every rank); Engram, every fetched row (and its scale factors)."""
    if case.op == "send_recv":
        return case.num_bytes
    if case.op == "all_gather":
        return num_ranks * case.num_bytes
    if case.op == "reduce_scatter":
        return reduce_scatter_rows(case.num_bytes, num_ranks) * COLUMNS * 2
    if case.op == "fetch":
        return case.tokens * case.entries * _engram_row_bytes(case)
    raise ValueError(f"unknown op {case.op!r}")


def process_bytes(case: Case, num_ranks: int, emulated: bool) -> int:
    """Bytes per call this process's GPU moves: every rank's with emulated ranks, else this rank's."""
    return bytes_per_rank(case, num_ranks) * (num_ranks if emulated else 1)


def peer_bytes(case: Case, num_ranks: int) -> int:
    """Of one rank's bytes, those that leave its GPU (one rank per GPU): all but its own row or
    chunk; PP's whole tensor when there is a peer; Engram's rows owned by the others on average."""
    total = bytes_per_rank(case, num_ranks)
    if num_ranks <= 1:
        return 0
    if case.op == "send_recv":
        return total
    return total * (num_ranks - 1) // num_ranks


def plain_copies(case: Case, num_ranks: int) -> List[Tuple[int, int, int]]:
    """The copy-engine moves one rank's call queues, without the stream memory operations around
    them, as ``(source offset, target offset, bytes)`` in the call's order: what the overlap floor
    copies. PP (its copy-engine path, ``num_sms=0``): the tensor into the receiver's ring slot, then
    a slot out into the received tensor; all_gather: the tensor into every rank's row (one source,
    ``num_ranks`` targets); reduce_scatter: chunk ``p`` of the input to rank ``p``; Engram: none (a
    gather kernel on SMs).

    Raises:
        ValueError: an unknown op.
    """
    if case.op == "send_recv":
        size = case.num_bytes // (2 * COLUMNS) * COLUMNS * 2
        return [(0, 0, size), (size, size, size)]
    if case.op == "all_gather":
        size = case.num_bytes // (2 * COLUMNS) * COLUMNS * 2
        return [(0, rank * size, size) for rank in range(num_ranks)]
    if case.op == "reduce_scatter":
        chunk = reduce_scatter_rows(case.num_bytes, num_ranks) // num_ranks * COLUMNS * 2
        return [(rank * chunk, rank * chunk, chunk) for rank in range(num_ranks)]
    if case.op == "fetch":
        return []
    raise ValueError(f"unknown op {case.op!r}")


def sms_held(case: Case, num_sms: int, device_sms: int, emulated_ranks: int = 0) -> int:
    """SMs one rank's transfer holds while it runs: 0 for the copy-engine paths (AGRS; the
    reduce_scatter's fp32 sum in the handle runs one kernel afterwards; PP with ``num_sms=0``),
    PP's blocks (``num_sms``, no more than its 16-byte steps), the Engram gather's blocks (8 rows per
    block). AGRS on ``emulated_ranks`` ranks of one GPU copies with a kernel, one piece (a rank's
    tensor or chunk) at a time (`deep_ep.backends.gpu.agrs`): that kernel's blocks."""
    if case.primitive == "agrs":
        if not emulated_ranks:
            return 0
        from ..backends.gpu.agrs import copy_blocks
        piece = case.num_bytes if case.op == "all_gather" else \
            bytes_per_rank(case, emulated_ranks) // emulated_ranks
        return copy_blocks(piece, max(1, device_sms // emulated_ranks))
    if case.op == "send_recv":
        return min(num_sms or 0, max(1, math.ceil(case.num_bytes / PP_BYTES_PER_BLOCK_STEP)))
    return min(device_sms, math.ceil(case.tokens * case.entries / ENGRAM_ROWS_PER_BLOCK))


def bandwidth_gbps(num_bytes: int, time_us: Optional[float]) -> Optional[float]:
    """``num_bytes`` moved in ``time_us`` microseconds, in GB/s (1e9 bytes); None without a time."""
    if not time_us or time_us <= 0 or math.isnan(time_us):
        return None
    return num_bytes / (time_us * 1e3)


def ratio(time_us: Optional[float], floor_us: Optional[float]) -> Optional[float]:
    """``time_us`` over ``floor_us`` (1.0: as fast as a device copy of the same bytes); None if either is missing."""
    if time_us is None or not floor_us or math.isnan(time_us):
        return None
    return time_us / floor_us


def slowdown_percent(with_transfer_us: Optional[float], alone_us: Optional[float]) -> Optional[float]:
    """How much slower the matmul ran beside the transfer than alone, in percent (negative: faster)."""
    if with_transfer_us is None or not alone_us:
        return None
    return (with_transfer_us / alone_us - 1.0) * 100.0


def matmul_count(round_us: float, matmul_us: float) -> int:
    """Matmuls of ``matmul_us`` each that fit in a transfer round of ``round_us``: at least 1, at most
    `MAX_MATMULS_PER_ROUND`; rounded down, so that every matmul but a last single one runs beside the
    transfer."""
    if not matmul_us or matmul_us <= 0 or math.isnan(matmul_us) or math.isnan(round_us):
        return 1
    return max(1, min(MAX_MATMULS_PER_ROUND, int(round_us / matmul_us)))


def _held_note(row: Dict[str, Any]) -> str:
    """What moves the bytes of ``row``'s call, after its SMs held."""
    movers = "copy engines" if row["sms_held"] == 0 else \
        "a copy kernel: emulated ranks" if row["primitive"] == "agrs" else ""
    extra = "the fp32 sum in the handle runs one kernel" if row["op"] == "reduce_scatter" else ""
    note = "; ".join(part for part in (movers, extra) if part)
    return f" ({note})" if note else ""


def bound_applies(row: Dict[str, Any]) -> bool:
    """Whether `ZERO_SM_SLOWDOWN_BOUND` judges a row: its transfer holds no SM at any time (a
    reduce_scatter's copies hold none, but the sum in its handle runs a kernel on SMs)."""
    return row["sms_held"] == 0 and row["op"] != "reduce_scatter"


def bound_verdict(row: Dict[str, Any], matmul: Matmul, emulated: bool) -> Optional[Dict[str, Any]]:
    """`ZERO_SM_SLOWDOWN_BOUND`'s verdict on ``matmul``'s overlap in ``row``: None where no bound
    applies (the memory-bound matmul, a transfer on SMs, a reduce_scatter), the figure is missing or
    a round of it was host-bound;
    else ``{"judged_on", "percent", "within"}``. With ``emulated`` ranks it judges ``excess`` (the
    call's slowdown in excess of the plain copy's: the ranks' bytes share one GPU's HBM and copy
    engines, which separate GPUs would not), else the ``slowdown`` itself."""
    overlap = (row.get("overlap") or {}).get(matmul.key)
    if matmul.kind != "compute-bound" or not overlap or not bound_applies(row) or overlap.get("host_bound"):
        return None
    judged_on = "excess" if emulated else "slowdown"
    percent = overlap.get("excess_percent" if emulated else "slowdown_percent")
    if percent is None or math.isnan(percent):
        return None
    return {"judged_on": judged_on, "percent": percent, "within": percent <= ZERO_SM_SLOWDOWN_BOUND}


def _cell(value: Optional[float], fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def format_header(primitives: Sequence[str], where: str, device: str, iters: int) -> str:
    """The first line of the report."""
    return (f"primitives bench ({', '.join(primitives)}; {where}; {device}): device time per call, {iters} calls "
            f"per round back to back after a gate kernel, median of 3 rounds; bytes = payload moved per call by "
            f"this GPU; floor = a device copy of the same bytes in this run")


def _bound_words(verdict: Dict[str, Any]) -> str:
    return f"{'within' if verdict['within'] else 'OVER'} the {ZERO_SM_SLOWDOWN_BOUND:.0f}% bound of a zero-SM transfer"


def _format_overlap(row: Dict[str, Any], matmul: Matmul, overlap: Dict[str, Any]) -> List[str]:
    """The overlap lines of one matmul: alone and beside the transfer, per matmul, and its slowdown;
    then, for a transfer that holds no SM, the same matmul beside plain copy-engine copies of the
    call's moves and the call's slowdown in excess of theirs."""
    slow, emulated = overlap.get("slowdown_percent"), bool(row.get("emulated"))
    verdict = bound_verdict(row, matmul, emulated)
    if overlap.get("host_bound"):
        note = " (not judged: the host queued a round slower than the gate held the GPU)"
    elif matmul.kind == "memory-bound":
        note = " (informational: it shares HBM bandwidth with the transfer's copies)"
    elif bound_applies(row) and emulated:
        note = f" (emulated ranks: the {ZERO_SM_SLOWDOWN_BOUND:.0f}% bound judges the excess over a plain copy, below)"
    elif verdict is not None:
        note = f" ({_bound_words(verdict)})"
    elif row["sms_held"] == 0:
        note = " (no bound: the sum in the handle runs on SMs)"
    else:
        note = ""
    calls = overlap.get("calls_per_round")
    per_round = f"x {overlap['matmuls_per_round']} per round" + (f" of {calls} calls" if calls else "")
    line = (f"  overlap, {matmul.kind} matmul {matmul.shape} bf16 {per_round}: "
            f"alone {_cell(overlap['matmul_us'], '{:.1f}')} us each; beside the transfer "
            f"{_cell(overlap['matmul_both_us'], '{:.1f}')} us each (transfer "
            f"{_cell(overlap['transfer_both_us'], '{:.1f}')} us/call, alone {_cell(row['time_us'], '{:.1f}')}); "
            f"round {_cell(overlap['both_round_us'], '{:.1f}')} us; {matmul.kind} matmul slowdown "
            f"{_cell(slow, '{:+.1f}')}%{note}")
    lines = [line]
    plain = overlap.get("plain_copy")
    if plain:
        if verdict is not None and emulated:
            floor_note = (f" ({_bound_words(verdict)}, judged on the excess: emulated ranks share one GPU's HBM "
                          f"and copy engines)")
        elif bound_applies(row) and matmul.kind == "compute-bound" and not emulated:
            floor_note = " (informational: at one rank per GPU the bound judges the slowdown)"
        else:
            floor_note = ""
        lines.append(f"    plain copy floor: {plain['copies_per_call']} cuMemcpyDtoDAsync per rank per call "
                     f"({plain['bytes'] / 1e6:.2f} MB per call on this GPU, "
                     f"{_cell(plain['copy_both_us'], '{:.1f}')} us/call beside the matmul); {matmul.kind} matmul "
                     f"{_cell(plain['matmul_both_us'], '{:.1f}')} us each; matmul slowdown beside a plain "
                     f"copy-engine copy of the same bytes: {_cell(plain['slowdown_percent'], '{:+.1f}')}%; the "
                     f"call's slowdown in excess of it: {_cell(overlap.get('excess_percent'), '{:+.1f}')}%"
                     f"{floor_note}")
    return lines


def format_case(row: Dict[str, Any]) -> List[str]:
    """The lines of one measured case (a row of `build_result`'s ``cases``)."""
    lines = [f"{row['label']}: {_cell(row['time_us'], '{:.1f}')} us/call, {row['bytes'] / 1e6:.2f} MB, "
             f"{_cell(row['gbps'], '{:.1f}')} GB/s; copy floor {_cell(row['floor_us'], '{:.1f}')} us "
             f"(ratio {_cell(row['floor_ratio'], '{:.2f}')}); SMs held {row['sms_held']} per rank"
             + _held_note(row)]
    if row.get("nvlink_floor_us") is not None:
        lines.append(f"  NVLink floor: a peer copy of the {row['peer_bytes'] / 1e6:.2f} MB leaving this GPU "
                     f"{row['nvlink_floor_us']:.1f} us")
    for matmul in MATMULS:
        overlap = (row.get("overlap") or {}).get(matmul.key)
        if overlap:
            lines += _format_overlap(row, matmul, overlap)
    if row.get("host_bound"):
        lines.append("  warning: the host queued the calls slower than the gate held the GPU: times are host-bound")
    if row.get("check") is not None:
        lines.append(f"  {row['check']}")
    return lines


def build_result(primitives: Sequence[str], rows: List[Dict[str, Any]], failures: List[str], *, runner: str,
                 device: str, num_ranks: int, emulated: bool, iters: int, checked: bool) -> Dict[str, Any]:
    """The JSON result: the run's facts, one row per case (each overlap given its ``bound``, see
    `bound_verdict`) and the check's verdict."""
    import torch
    for row in rows:
        for matmul in MATMULS:
            overlap = (row.get("overlap") or {}).get(matmul.key)
            if overlap:
                overlap["bound"] = bound_verdict(row, matmul, emulated)
    return {"mode": "primitives", "primitives": list(primitives), "runner": runner, "device": device,
            "num_ranks": num_ranks, "emulated": emulated, "iters": iters, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "zero_sm_slowdown_bound_percent": ZERO_SM_SLOWDOWN_BOUND,
            "zero_sm_bound_judges": "excess over a plain copy-engine copy" if emulated else "slowdown",
            "overlap_matmuls": {matmul.key: {"rows": matmul.rows, "width": matmul.width, "dtype": "bf16"}
                                for matmul in MATMULS},
            "cases": rows,
            "check": {"enabled": checked, "passed": not failures, "failures": list(failures)}}
