"""The bench's check: every checked call's outputs against `deep_ep.reference`, element by element.

What is checked, per rank (`deep_ep.bench.session`): the first full dispatch (CPU sync) and combine,
a full dispatch without CPU sync, one more iteration of the timed loop (full dispatch, cached dispatch
on the first handle, combine), and on the GPU the outputs of one CUDA-graph replay of cached dispatch
and of combine. Eager checked calls run under `deep_ep.backends.outputs.poisoned`, graph outputs are
poisoned with `outputs.fill_poison` before the checked replay: an element a kernel does not write
then holds NaN / 0xA5 bytes, never a stale correct value.

Dispatch outputs (received rows with FP8 data and scale factors, indices, weights, every handle field
the reference defines) are compared bit for bit; combine outputs bit for bit too, or to bf16
tolerance with ``--combine-check tolerant``. Each difference becomes a :class:`Mismatch` naming the
rank, the call, the output, how many rows differ and the first few.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import reference as ref
from ..backends import outputs
from .config import BenchConfig, expert_output

__all__ = ["Mismatch", "RankExpected", "reference_outputs", "Checker", "differing_rows",
           "poison_in_place", "FIRST_ROWS_SHOWN"]

FIRST_ROWS_SHOWN = 5

# Outputs indexed by received row / source token, whose dimension 0 is a row (the rest: entries).
_ROW_INDEXED = {"recv_x", "recv_x scale factors", "recv_topk_idx", "recv_topk_weights", "combined_x",
                "handle.recv_src_rank", "handle.recv_src_token", "handle.send_pos", "handle.topk_idx",
                "handle.recv_topk_weights"}
# Handle fields not compared: the id of the buffer that made it (the reference's is -1), the SM count
# the backend resolved for the launch (a resource, not a result; the reference records 0) and the
# backend's private state.
_HANDLE_SKIP = {"buffer_id", "num_sms", "backend_state"}


@dataclasses.dataclass
class Mismatch:
    """One output of one call on one rank that differs from the reference.

    ``count`` rows (of ``total``) differ, the first ones being ``first_rows``; ``note`` replaces the
    row counts when the output cannot be compared row by row (shape, dtype, None, host value)."""

    rank: int
    call: str
    output: str
    count: int = 0
    total: int = 0
    first_rows: List[int] = dataclasses.field(default_factory=list)
    unit: str = "rows"
    note: str = ""

    def __str__(self) -> str:
        where = f"rank {self.rank}, {self.call}: {self.output}"
        if self.note:
            return f"{where}: {self.note}"
        more = ", ..." if self.count > len(self.first_rows) else ""
        return (f"{where}: {self.count} of {self.total} {self.unit} differ, first "
                f"{self.unit} {', '.join(map(str, self.first_rows))}{more}")

    def as_dict(self) -> Dict[str, Any]:
        """JSON form (every field, plus the message)."""
        return {**dataclasses.asdict(self), "message": str(self)}


@dataclasses.dataclass
class RankExpected:
    """The reference's outputs on one rank: dispatch with and without CPU sync, the combine input the
    bench gives (the reference's received rows as stand-in expert outputs) and its result."""

    dispatch: ref.ReferenceDispatch
    dispatch_no_sync: ref.ReferenceDispatch
    combine_input: torch.Tensor
    combined_x: torch.Tensor


def reference_outputs(cfg: BenchConfig, inputs: Sequence[Dict[str, Any]],
                      ranks: Optional[Sequence[int]] = None) -> Dict[int, RankExpected]:
    """`deep_ep.reference` evaluated on every rank's ``inputs`` (`Workload.inputs` of each source rank,
    on one device), kept for ``ranks`` (default: all). ``cfg`` is the pass's `Workload.run_cfg`."""
    ranks = list(range(len(inputs))) if ranks is None else list(ranks)
    xs = [i["x"] for i in inputs]
    idxs = [i["topk_idx"] for i in inputs]
    ws = [i["topk_weights"] for i in inputs]
    common = dict(do_expand=cfg.expand, expert_alignment=cfg.alignment, do_zero_padding=cfg.expand,
                  num_max_tokens_per_rank=cfg.max_tokens)
    sync = ref.reference_dispatch(xs, idxs, ws, cfg.num_experts, **common)
    ys = [expert_output(cfg, r.recv_x, rank) for rank, r in enumerate(sync)]
    biases = [i["biases"] or None for i in inputs]
    combined = ref.reference_combine(ys, [r.handle for r in sync], biases=biases)
    kept = {r: [sync[r], ys[r], combined[r][0]] for r in ranks}
    del sync, ys, combined
    no_sync = ref.reference_dispatch(xs, idxs, ws, cfg.num_experts, do_cpu_sync=False, **common)
    return {r: RankExpected(kept[r][0], no_sync[r], kept[r][1], kept[r][2]) for r in ranks}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (bit-for-bit comparison, NaN included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differing_rows(got: torch.Tensor, want: torch.Tensor, *, tolerant: bool = False) -> torch.Tensor:
    """Indices (int64, ascending) of the rows (dimension 0) where ``got`` and ``want`` differ.

    Bit for bit by default; ``tolerant``: per element ``|got - want| <= 1e-2 + 2**-7 * |want|``
    (a couple of bf16 ulps; NaN differs). Both must have the same shape and dtype."""
    want = want.to(got.device)
    if tolerant:
        g, w = got.float(), want.float()
        bad = ~((g - w).abs() <= 1e-2 + 2 ** -7 * w.abs())
    else:
        bad = _bits(got) != _bits(want)
    if bad.dim() == 0:
        bad = bad.view(1)
    elif bad.dim() > 1:
        bad = bad.flatten(1).any(dim=1)
    return bad.nonzero().flatten().cpu()


def poison_in_place(*tensors) -> None:
    """Fill each tensor (None skipped; FP8 ``(data, sf)`` tuples unpacked) with the poison pattern of
    `deep_ep.backends.outputs` (for the static outputs of a CUDA graph before a checked replay)."""
    for t in tensors:
        if isinstance(t, (tuple, list)):
            poison_in_place(*t)
        elif t is not None:
            outputs.fill_poison(t)


class Checker:
    """Compares one rank's outputs with its :class:`RankExpected`; collects :class:`Mismatch` es.

    ``checked`` lists the calls compared, in order (``{"when", "call", "phase"}``), ``mismatches``
    every difference found. ``phase``: the `Workload` name ("logical": the generated routing).
    """

    def __init__(self, cfg: BenchConfig, rank: int, expected: RankExpected, *, phase: str = "logical") -> None:
        self.cfg, self.rank, self.expected, self.phase = cfg, rank, expected, phase
        self.tolerant_combine = cfg.combine_check == "tolerant"
        self.suffix = "" if phase == "logical" else f" [{phase}]"
        self.checked: List[Dict[str, str]] = []
        self.mismatches: List[Mismatch] = []

    # ------------------------------------------------------------------ primitives
    def _add(self, call: str, output: str, **kw) -> None:
        self.mismatches.append(Mismatch(self.rank, call, output, **kw))

    def tensor(self, call: str, name: str, got, want, *, rows: Optional[int] = None,
               tolerant: bool = False) -> None:
        """Compare ``got`` with ``want`` (tensors or None); ``rows``: only the first rows (the rest are
        unspecified)."""
        if want is None or got is None:
            if (want is None) != (got is None):
                self._add(call, name, note=f"got {'None' if got is None else 'a tensor'}, expected "
                                           f"{'None' if want is None else 'a tensor'}")
            return
        if not isinstance(got, torch.Tensor):
            self._add(call, name, note=f"got {type(got).__name__}, expected a tensor")
            return
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            self._add(call, name, note=f"got {got.dtype} {list(got.shape)}, expected {want.dtype} "
                                       f"{list(want.shape)}")
            return
        total = int(got.shape[0]) if got.dim() else 1
        a, e = got, want
        if rows is not None:
            a, e, total = a[:rows], e[:rows], rows
        bad = differing_rows(a, e, tolerant=tolerant)
        if bad.numel():
            unit = "rows" if got.dim() >= 2 or name in _ROW_INDEXED else "entries"
            self._add(call, name, count=int(bad.numel()), total=total,
                      first_rows=bad[:FIRST_ROWS_SHOWN].tolist(), unit=unit)

    def value(self, call: str, name: str, got, want) -> None:
        """Compare host values (ints, bools, lists)."""
        if got != want:
            self._add(call, name, note=f"got {got!r}, expected {want!r}")

    # ------------------------------------------------------------------ calls
    def _begin(self, when: str, call: str) -> str:
        self.checked.append({"when": when, "call": call, "phase": self.phase})
        return f"{when} {call}{self.suffix}"

    def dispatch(self, when: str, call: str, result: Sequence, *, cpu_sync: bool = True,
                 cached: bool = False) -> None:
        """Check ``(recv_x, recv_topk_idx, recv_topk_weights, handle, ...)`` of a dispatch; ``when``
        (e.g. ``"first"``) and ``call`` (e.g. ``"cached dispatch"``) name it in the report.

        ``cpu_sync=False``: compared with the reference's worst-case-sized outputs (received rows past
        the true count are unspecified and not compared). ``cached``: a dispatch with ``handle=``; its
        handle is the one it was given (not compared again), and, given no topk_weights (the bench
        gives none), it returns None weights in both layouts, as DeepEP."""
        call = self._begin(when, call)
        exp = self.expected.dispatch if cpu_sync else self.expected.dispatch_no_sync
        recv_x, recv_idx, recv_w, handle = result[:4]
        data, sf = ref.split_x(recv_x)
        exp_data, exp_sf = ref.split_x(exp.recv_x)
        # Rows past the true count are unspecified; padding rows of the expanded layout are compared
        # (the bench asks for zero padding).
        valid = exp.num_valid_rows
        self.tensor(call, "recv_x", data, exp_data, rows=valid)
        if (sf is None) != (exp_sf is None):
            self._add(call, "recv_x", note="got a bf16 tensor, expected an FP8 (data, sf) tuple"
                      if sf is None else "got an FP8 tuple, expected a bf16 tensor")
        elif sf is not None:
            self.tensor(call, "recv_x scale factors", sf, exp_sf, rows=valid)
        self.tensor(call, "recv_topk_idx", recv_idx, exp.recv_topk_idx)
        if not cached:
            self.tensor(call, "recv_topk_weights", recv_w, exp.recv_topk_weights)
        elif recv_w is not None:
            self._add(call, "recv_topk_weights", note="a cached dispatch without topk_weights must return None")
        if not cached:
            self.handle(call, handle, exp.handle)

    def handle(self, call: str, got, want) -> None:
        """Every field of the reference's handle but the buffer id and the backend state."""
        for f in dataclasses.fields(want):
            if f.name in _HANDLE_SKIP:
                continue
            name = "handle." + f.name
            if not hasattr(got, f.name):
                self._add(call, name, note="missing")
                continue
            a, e = getattr(got, f.name), getattr(want, f.name)
            a_tensor, e_tensor = isinstance(a, torch.Tensor), isinstance(e, torch.Tensor)
            if (a_tensor or a is None) and (e_tensor or e is None) and (a_tensor or e_tensor):
                self.tensor(call, name, a, e)
            elif a_tensor or e_tensor:
                self._add(call, name, note=f"got {type(a).__name__}, expected {type(e).__name__}")
            else:
                self.value(call, name, a, e)

    def combine(self, when: str, call: str, result: Sequence) -> None:
        """Check ``combined_x`` of ``(combined_x, combined_topk_weights, ...)`` (bit for bit, or to
        bf16 tolerance with ``--combine-check tolerant``)."""
        call = self._begin(when, call)
        self.tensor(call, "combined_x", result[0], self.expected.combined_x, tolerant=self.tolerant_combine)
        self.tensor(call, "combined_topk_weights", result[1], None)
