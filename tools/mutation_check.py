"""Checks that can fail: the GPU suite and the bench's check against kernels built with a defect.

The shipped kernels carry no test hooks. Each defect of `DEFECTS` is a few explicit textual edits
(`Edit`: a search text found exactly once in a named header under ``deep_ep/include/deep_ep``, and
its replacement) planted in a temporary copy of the include tree; the runs of that defect compile
their kernels against the copy through ``EP_JIT_INCLUDE_OVERLAY`` (docs/jit.md), whose content is
part of the JIT cache key, so a defect's modules never mix with the clean build's. An edit whose
search text is missing or found more than once (the kernels changed) stops the check before any
run: a defect that plants nothing would prove nothing.

For the clean build and for each defect this runs

(a) a few cases of the GPU suite that exercise the defect (``pytest -x``; EP=1 on NCCL for the path
    a rank takes to itself, two emulated ranks for the peer path; `DEFECTS` lists them), and
(b) ``python -m deep_ep bench --iters 2`` with the configuration that exercises it,

and prints one line per defect::

    defect 3 (missing bias): suite FAILED as expected (1 failed), bench check FAILED as expected

or the same line ending in ``NOT CAUGHT``. The clean build runs the union of those suite cases and
every bench configuration used, and must pass them all (a run that fails without a defect would
prove nothing). Exit status 0 when the clean build passes and both checks catch every defect; 2 when
a defect's edits no longer apply.

Usage (the ``mutate`` step of tools/device_suite.sh, on a GPU machine)::

    python3 tools/mutation_check.py [--defects 1,3] [--out DIR] [--budget 480] [--dry-run]
    python3 tools/mutation_check.py --plant 3 DIR    # DIR: a copy of the include tree with defect 3

``--dry-run`` checks that every edit applies, prints the commands and runs nothing (no GPU needed).
Logs, JUnit XML files, bench JSON files, each defect's edits as ``defect<n>.diff`` and
``mutation.json`` (every verdict) go to ``--out`` (default ``$OUT/mutation``).

``python3 tools/mutation_check.py --write-summary DIR`` writes ``DIR/summary.txt`` for a device run
(the ``summary`` step): card, driver, torch, NCCL, commit, date, passed / failed per test file (from
the JUnit XML files ``DIR/*.xml``), the bench checks (``DIR/*.json``), the torchrun suite and this
check's lines (``DIR/mutation/mutation.json``).
"""
from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "deep_ep" / "include"       # the tree a defect's copy is made from
OVERLAY_VARIABLE = "EP_JIT_INCLUDE_OVERLAY"
SUITE_FILE = "tests/gpu/test_gpu_backend.py"
SUITE_NODES = (f"{SUITE_FILE}::test_ep1_real_nccl", f"{SUITE_FILE}::test_emulated[2]")


@dataclass(frozen=True)
class Edit:
    """One textual edit of a header: ``search`` (found exactly once in ``path``, relative to
    ``deep_ep/include/deep_ep``) becomes ``replace``."""
    path: str
    search: str
    replace: str


@dataclass(frozen=True)
class Defect:
    """One test-only kernel defect: what it breaks, the edits that plant it, and what must catch it.

    cases: base names of cases in tests/gpu_cases.py (run at EP=1 and on two emulated ranks).
    bench_args: arguments added to ``python -m deep_ep bench --iters 2``.
    """
    number: int
    name: str
    effect: str
    edits: tuple
    cases: tuple
    bench_args: tuple = ()


class PatchError(RuntimeError):
    """A defect's edit no longer applies: its search text is missing or not unique (the kernels changed)."""


_SEND, _RECV = "impls/dispatch_send.cuh", "impls/dispatch_recv.cuh"
# Lines of the kernels the edits search for (each edit checks that its text is found exactly once).
_SEND_ROW = "int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(row) * kDataBytes);"
_RECV_ROW = "int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(j) * kDataBytes);"
_PAIR_ROW = "int4* dst = reinterpret_cast<int4*>(a.out_x + static_cast<int64_t>(out) * kDataBytes);"
_SEND_SF = "if (lane + 32 * j < kNumSF) store_sf<kDataBytes, kNumSF>(a, row, lane + 32 * j, my_sf[j]);"
_RECV_SF = "for (int i = lane; i < kNumSF; i += 32) store_sf<kDataBytes, kNumSF>(a, j, i, __ldcg(row_sf + i));"
_RECV_PAIR_ROWS = ("if (kExpand && lane < K) out_row = kCached ? "
                   "a.src_meta[static_cast<int64_t>(j) * (K + 2) + 2 + lane] : __ldcg(meta + 1 + lane);")
_SEND_WEIGHT = "a.out_weights[static_cast<int64_t>(row) * K + lane] = "
_RECV_WEIGHT = "a.out_weights[static_cast<int64_t>(j) * K + lane] = "


def _doubled(value: str) -> str:
    return f"lane == 0 ? 2.0f * {value} : {value}"


#: The defects. A row written by the rank to itself goes through dispatch_send, one from a peer
#: through dispatch_recv, so each dispatch defect edits both; the row patterns fit the GPU suite's
#: cases (60 to 100 rows; tests/test_mutations_cpu.py applies the same patterns on the CPU).
DEFECTS = (
    Defect(1, "dropped row", "dispatch leaves every output row with row % 64 == 63 unwritten",
           (Edit(_SEND, _SEND_ROW, "if ((row & 63) == 63) continue; " + _SEND_ROW),
            Edit(_RECV, _RECV_ROW, "if ((j & 63) == 63) continue; " + _RECV_ROW)),
           ("bf16",)),
    Defect(2, "wrong row", "dispatch writes rows with row % 61 == 7 to row ^ 1 (odd rows: row - 1 stays in bounds)",
           (Edit(_SEND, _SEND_ROW, _SEND_ROW.replace("(row)", "(row % 61 == 7 ? row ^ 1 : row)")),
            Edit(_RECV, _RECV_ROW, _RECV_ROW.replace("(j)", "(j % 61 == 7 ? j ^ 1 : j)"))),
           ("bf16",)),
    Defect(3, "missing bias", "combine ignores bias 0",
           (Edit("impls/combine_reduce.cuh", "const __nv_bfloat16* b0 = a.bias0;",
                 "const __nv_bfloat16* b0 = nullptr;"),
            # the one-source path, taken without biases, is taken with bias 0 too
            Edit("impls/combine_recv.cuh", "a.bias0 == nullptr;", "true;")),
           ("bf16-noweights-bias2",), ("--bias", "1")),
    Defect(4, "scaled weight", "dispatch doubles the received weight of top-k slot 0",
           (Edit(_SEND, _SEND_WEIGHT + "local ? my_weight : 0.0f;",
                 _SEND_WEIGHT + f"local ? ({_doubled('my_weight')}) : 0.0f;"),
            Edit(_SEND, "a.out_weights[my_pair_row] = my_weight;",
                 f"a.out_weights[my_pair_row] = {_doubled('my_weight')};"),
            Edit(_RECV, _RECV_WEIGHT + "weight;", _RECV_WEIGHT + _doubled("weight") + ";"),
            Edit(_RECV, "a.out_weights[out_row] = weight;", f"a.out_weights[out_row] = {_doubled('weight')};")),
           ("bf16",)),
    Defect(5, "stale scale factor", "cached FP8 dispatch skips the scale factors of rows with row % 8 == 3",
           (Edit(_SEND, _SEND_SF, _SEND_SF.replace("if (lane + 32 * j < kNumSF)",
                                                   "if (lane + 32 * j < kNumSF && !(kCached && (row & 7) == 3))")),
            Edit(_RECV, _RECV_SF, "if (!(kCached && (j & 7) == 3)) " + _RECV_SF)),
           ("fp8-fp32",), ("--fp8",)),
    Defect(6, "skipped expert", "expanded dispatch writes no rows for local expert 1",
           (Edit(_SEND, _PAIR_ROW, "if (e - rank * L == 1) continue; " + _PAIR_ROW),
            # a fresh dispatch's rows from peers carry their local experts; a cached one's do not
            Edit(_RECV, _RECV_PAIR_ROWS,
                 _RECV_PAIR_ROWS + "\n            const int planted_expert = (!kCached && lane < K) ? "
                                   "__ldcg(meta + 1 + K + lane) : -1;"),
            Edit(_RECV, _PAIR_ROW, "if (__shfl_sync(0xffffffffu, planted_expert, k) == 1) continue; " + _PAIR_ROW)),
           ("bf16-expand",), ("--expand",)),
)


# ---------------------------------------------------------------------------------------- planting
def patched_texts(defect: Defect, include: Path = INCLUDE) -> dict:
    """``{path: (original text, patched text)}`` of the headers ``defect`` edits (paths relative to
    ``include/deep_ep``); nothing is written.

    Raises:
        PatchError: an edit's file is missing, or its search text is not found exactly once in it
            (after the defect's earlier edits of the same file).
    """
    texts: dict = {}
    for edit in defect.edits:
        if edit.path not in texts:
            header = include / "deep_ep" / edit.path
            if not header.is_file():
                raise PatchError(f"defect {defect.number} ({defect.name}): {header} does not exist")
            original = header.read_text()
            texts[edit.path] = (original, original)
        original, text = texts[edit.path]
        found = text.count(edit.search)
        if found != 1:
            raise PatchError(f"defect {defect.number} ({defect.name}): the search text is found {found} times in "
                             f"include/deep_ep/{edit.path}, not once (the kernels changed: update the defect's "
                             f"edits in tools/mutation_check.py):\n    {edit.search}")
        texts[edit.path] = (original, text.replace(edit.search, edit.replace))
    return texts


def plant(defect: Defect, tree: Path, include: Path = INCLUDE) -> Path:
    """Copy ``include`` to ``tree`` (which must not exist) and apply ``defect``'s edits there; returns
    ``tree``, the directory to give ``EP_JIT_INCLUDE_OVERLAY``.

    Raises:
        PatchError: as `patched_texts` (then nothing is copied).
    """
    texts = patched_texts(defect, include)
    shutil.copytree(include, tree)
    for path, (_original, patched) in texts.items():
        (tree / "deep_ep" / path).write_text(patched)
    return tree


def defect_diff(defect: Defect, include: Path = INCLUDE) -> str:
    """The unified diff of ``defect``'s edits against ``include``."""
    lines = []
    for path, (original, patched) in patched_texts(defect, include).items():
        lines += difflib.unified_diff(original.splitlines(True), patched.splitlines(True),
                                      f"a/deep_ep/include/deep_ep/{path}", f"b/deep_ep/include/deep_ep/{path}")
    return "".join(lines)


# ---------------------------------------------------------------------------------------- results
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)\b")
_SUMMARY_LINE = re.compile(r"^[=\s]*\d+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)\b"
                           r".* in [\d.]+s")


def pytest_counts(text: str, worst: bool = False) -> Optional[dict]:
    """Counts from the last summary line of pytest output (``1 failed, 3 passed in 2.10s``), as
    ``{"passed": 3, "failed": 1, "errors": 0, "skipped": 0, ...}``; None when there is no such line
    (pytest crashed or was killed). ``worst``: of every summary line (one per rank of a pytest run
    under torchrun), the one with the most failures and errors, then the fewest passed."""
    lines = [ln for ln in text.splitlines() if _SUMMARY_LINE.match(ln.strip())]
    if not lines:
        return None

    def counts_of(line: str) -> dict:
        counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        for number, what in _COUNT.findall(line):
            what = {"error": "errors", "warning": "warnings"}.get(what, what)
            counts[what] = counts.get(what, 0) + int(number)
        return counts
    if not worst:
        return counts_of(lines[-1])
    return max((counts_of(line) for line in lines), key=lambda c: (c["failed"] + c["errors"], -c["passed"]))


def _test_file(classname: str) -> str:
    """``tests.gpu.test_x`` or ``tests.gpu.test_x.TestCls`` -> ``tests/gpu/test_x.py``."""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_") or part.endswith("_test"):
            return "/".join(parts[:i + 1]) + ".py"
    return "/".join(parts) + ".py"


def junit_counts(path: Path) -> dict:
    """``{test file: {"passed", "failed", "errors", "skipped"}}`` from a pytest JUnit XML file."""
    per_file: dict = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = _test_file(case.get("classname", "") or "unknown")
        c = per_file.setdefault(name, {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
        tags = {child.tag for child in case}
        if "failure" in tags:
            c["failed"] += 1
        elif "error" in tags:
            c["errors"] += 1
        elif "skipped" in tags:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    return per_file


def total(per_file: dict) -> dict:
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for c in per_file.values():
        for k in out:
            out[k] += c.get(k, 0)
    return out


def format_counts(c: dict) -> str:
    """``3 passed, 1 failed`` (errors and skipped only when present)."""
    parts = [f"{c.get('passed', 0)} passed", f"{c.get('failed', 0)} failed"]
    parts += [f"{c[k]} {k}" for k in ("errors", "skipped") if c.get(k)]
    return ", ".join(parts)


def suite_verdict(rc: Optional[int], counts: Optional[dict], note: str = "") -> tuple:
    """``(verdict, detail)``: ``"passed"`` (exit 0, tests ran, none failed), ``"failed"`` (exit 1
    with failed tests: a check failed) or ``"error"`` (anything else: timeout, crash, collection or
    fixture errors, nothing ran), with a few words for the report."""
    if note:
        return "error", note
    if counts is None:
        return "error", f"pytest exited {rc} without a summary (crashed or killed)"
    if rc == 0 and counts["failed"] == 0 and counts["errors"] == 0 and counts["passed"] > 0:
        return "passed", format_counts(counts)
    if rc == 1 and counts["failed"] > 0:
        return "failed", format_counts(counts)
    return "error", f"pytest exited {rc}: {format_counts(counts)}"


def bench_verdict(rc: Optional[int], result: Optional[dict], log: str, note: str = "") -> tuple:
    """``(verdict, detail)`` of one bench run: ``"passed"`` (exit 0, check enabled and passed),
    ``"failed"`` (non-zero exit and the check failed, by the JSON's ``check.passed`` or a
    ``check: MISMATCH`` line) or ``"error"`` (timeout, crash, refused arguments, check disabled)."""
    if note:
        return "error", note
    check = (result or {}).get("check")
    mismatch = re.search(r"^check: MISMATCH.*$", log, re.M)
    if check is not None and not check.get("enabled", False):
        return "error", "the bench ran without its check"
    if rc == 0:
        if check is not None and check.get("passed") is True:
            return "passed", "check passed"
        return "error", "exit 0 without a passed check in its JSON"
    if (check is not None and check.get("passed") is False) or (check is None and mismatch):
        first = (check or {}).get("failures") or ([mismatch.group(0)] if mismatch else [])
        return "failed", (str(first[0])[:160] if first else "check failed")
    tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or [""]
    return "error", f"exit {rc} without a check verdict: {tail[0][:160]}"


# ---------------------------------------------------------------------------------------- runs
@dataclass
class Run:
    """One subprocess of the check: a suite subset or a bench configuration for a defect (0 = clean)."""
    kind: str                 # "suite" or "bench"
    defect: int
    argv: list
    env: dict                 # variables set (value None: removed)
    log: Path
    artifact: Path            # JUnit XML (suite) or JSON (bench)
    timeout: float
    label: str = ""
    rc: Optional[int] = None
    wall: float = 0.0
    note: str = ""
    verdict: str = ""
    detail: str = ""
    extra: dict = field(default_factory=dict)

    def command_line(self) -> str:
        sets = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items() if v is not None)
        unsets = " ".join(f"-u {k}" for k, v in self.env.items() if v is None)
        return f"env {unsets} {sets} {' '.join(shlex.quote(a) for a in self.argv)}".replace("  ", " ")


def plan(defects: list, out: Path, trees: Path, *, python: str = sys.executable, suite_timeout: float = 150,
         bench_timeout: float = 150, bench_extra: tuple = ()) -> list:
    """The runs: the clean build first (the union of the suite cases, every bench configuration),
    then a suite subset and a bench run per defect, built against ``trees/defect<n>`` (see `plant`).
    ``bench_extra`` is added to every bench run."""
    def overlay(n: int) -> dict:
        return {OVERLAY_VARIABLE: str(trees / f"defect{n}") if n else None}

    def suite(n: int, cases) -> Run:
        xml = out / f"suite_defect{n}.xml"
        return Run("suite", n, [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                f"--junitxml={xml}", *SUITE_NODES],
                   {**overlay(n), "DEEP_EP_GPU_CASES": ",".join(cases),
                    "DEEP_EP_CASE_LOG": str(out / f"suite_defect{n}_cases.log")},
                   out / f"suite_defect{n}.log", xml, suite_timeout, label=",".join(cases))

    def bench(n: int, args, tag: str) -> Run:
        js = out / f"bench_defect{n}{tag}.json"
        return Run("bench", n, [python, "-m", "deep_ep", "bench", "--iters", "2", *args, *bench_extra,
                                "--json", str(js)],
                   overlay(n),
                   out / f"bench_defect{n}{tag}.log", js, bench_timeout, label=" ".join(args) or "defaults")

    runs = []
    cases = sorted({c for d in defects for c in d.cases})
    runs.append(suite(0, cases))
    configs = []
    for d in defects:
        if d.bench_args not in configs:
            configs.append(d.bench_args)
    for i, args in enumerate(configs):
        runs.append(bench(0, args, f"_{i}"))
    for d in defects:
        runs += [suite(d.number, d.cases), bench(d.number, d.bench_args, "")]
    return runs


def execute(run: Run, deadline: float) -> None:
    """Run ``run`` (its own process group, killed at its timeout or at ``deadline``), then judge it."""
    left = deadline - time.monotonic()
    if left < 10:
        run.note = "not run: the time budget was spent"
    else:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        for k, v in run.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        for stale in (run.log, run.artifact):
            if stale.exists():
                stale.unlink()
        limit = min(run.timeout, left)
        start = time.monotonic()
        with open(run.log, "w") as log:
            proc = subprocess.Popen(run.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                run.rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)   # the group this run started, nothing else
                run.rc = proc.wait()
                run.note = f"timed out after {limit:.0f} s"
        run.wall = time.monotonic() - start
    judge(run)


def judge(run: Run) -> None:
    """Set ``run.verdict`` / ``run.detail`` from its exit status, log and artifact."""
    log = run.log.read_text(errors="replace") if run.log.exists() else ""
    if run.kind == "suite":
        counts = None
        if run.artifact.exists():
            try:
                counts = total(junit_counts(run.artifact))
            except ET.ParseError:
                counts = None
        if counts is None:
            counts = pytest_counts(log)
        run.extra["counts"] = counts
        run.verdict, run.detail = suite_verdict(run.rc, counts, run.note)
    else:
        result = None
        if run.artifact.exists():
            try:
                result = json.loads(run.artifact.read_text())
            except ValueError:
                result = None
        run.verdict, run.detail = bench_verdict(run.rc, result, log, run.note)


def defect_line(d: Defect, suite: Run, bench: Run) -> str:
    """The report line of one defect (see the module docstring)."""
    def half(run: Run, what: str) -> str:
        if run.verdict == "failed":
            return f"{what} FAILED as expected ({run.detail})" if run.kind == "suite" else f"{what} FAILED as expected"
        if run.verdict == "passed":
            return f"{what} passed ({run.detail})"
        return f"{what} gave no verdict ({run.detail})"
    caught = suite.verdict == "failed" and bench.verdict == "failed"
    line = f"defect {d.number} ({d.name}): {half(suite, 'suite')}, {half(bench, 'bench check')}"
    return line if caught else line + ": NOT CAUGHT"


def clean_line(suite: Run, benches: list) -> tuple:
    """``(line, passed)`` for the clean build."""
    ok = suite.verdict == "passed" and all(b.verdict == "passed" for b in benches)
    parts = [f"suite {'passed' if suite.verdict == 'passed' else 'FAILED'} ({suite.detail})"]
    bad = [b for b in benches if b.verdict != "passed"]
    if not bad:
        parts.append(f"bench check passed ({len(benches)} configuration{'s' if len(benches) != 1 else ''})")
    for b in bad:
        parts.append(f"bench [{b.label}] check FAILED ({b.detail})")
    line = "clean build: " + ", ".join(parts)
    return (line if ok else line + ": the checks fail without a defect"), ok


def report(defects: list, runs: list) -> tuple:
    """``(lines, passed)`` from judged runs (the clean build's and each defect's)."""
    clean_suite = next(r for r in runs if r.kind == "suite" and r.defect == 0)
    clean_benches = [r for r in runs if r.kind == "bench" and r.defect == 0]
    line, clean_ok = clean_line(clean_suite, clean_benches)
    lines, missed = [line], []
    for d in defects:
        suite = next(r for r in runs if r.kind == "suite" and r.defect == d.number)
        bench = next(r for r in runs if r.kind == "bench" and r.defect == d.number)
        lines.append(defect_line(d, suite, bench))
        if not (suite.verdict == "failed" and bench.verdict == "failed"):
            missed.append(d.number)
    passed = clean_ok and not missed
    if passed:
        lines.append(f"mutation check: passed (the clean build passes; the suite and the bench check catch "
                     f"all {len(defects)} defects)")
    else:
        why = ([] if clean_ok else ["the clean build fails"]) + \
              ([f"defect(s) {', '.join(map(str, missed))} not caught"] if missed else [])
        lines.append("mutation check: FAILED (" + "; ".join(why) + ")")
    return lines, passed


def main_check(args) -> int:
    wanted = {int(x) for x in args.defects.split(",")} if args.defects else None
    defects = [d for d in DEFECTS if wanted is None or d.number in wanted]
    if wanted and len(defects) != len(wanted):
        raise SystemExit(f"--defects: unknown defect(s) {sorted(wanted - {d.number for d in DEFECTS})}")
    out = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp/deep_ep_out"), "mutation"))
    try:
        diffs = {d.number: defect_diff(d) for d in defects}
    except PatchError as exc:
        line = f"mutation check: FAILED (a defect no longer applies: {exc})"
        print(line, flush=True)
        if not args.dry_run:
            out.mkdir(parents=True, exist_ok=True)
            (out / "mutation.json").write_text(json.dumps({"passed": False, "lines": [line], "runs": []}, indent=1))
        return 2
    if args.dry_run:
        runs = plan(defects, out, Path("<temporary copies>"), suite_timeout=args.suite_timeout,
                    bench_timeout=args.bench_timeout, bench_extra=tuple(shlex.split(args.bench_args)))
        for r in runs:
            print(f"[{r.kind} defect {r.defect}] {r.command_line()}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deep_ep_mutation_") as trees:
        for d in defects:
            plant(d, Path(trees) / f"defect{d.number}")
            (out / f"defect{d.number}.diff").write_text(diffs[d.number])
        runs = plan(defects, out, Path(trees), suite_timeout=args.suite_timeout, bench_timeout=args.bench_timeout,
                    bench_extra=tuple(shlex.split(args.bench_args)))
        start = time.monotonic()
        deadline = start + args.budget
        for r in runs:
            execute(r, deadline)
            print(f"  {r.kind} defect {r.defect} [{r.label}]: {r.verdict} ({r.detail}), {r.wall:.0f} s", flush=True)
        print(f"  all runs: {time.monotonic() - start:.0f} s (budget {args.budget:.0f} s)", flush=True)
    lines, passed = report(defects, runs)
    for line in lines:
        print(line, flush=True)
    (out / "mutation.json").write_text(json.dumps({
        "passed": passed, "lines": lines,
        "runs": [{"kind": r.kind, "defect": r.defect, "label": r.label, "command": r.command_line(),
                  "rc": r.rc, "wall_s": round(r.wall, 1), "verdict": r.verdict, "detail": r.detail,
                  "log": str(r.log)} for r in runs]}, indent=1))
    return 0 if passed else 1


# ---------------------------------------------------------------------------------------- run summary
def _command(argv: list) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return p.stdout.strip() if p.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _git_commit() -> str:
    head = _command(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    # The copy of .git on a device machine can lag its working tree: DEEP_EP_COMMIT says which it is.
    return f"{head} (device git; set DEEP_EP_COMMIT to record the commit run)" if head else "unknown"


def environment() -> dict:
    """Facts of this machine: card, driver, torch, CUDA, NCCL, commit (DEEP_EP_COMMIT or git), date."""
    smi = _command(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    cards = [ln.split(",")[0].strip() for ln in smi.splitlines() if ln.strip()]
    facts = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
             "commit": os.environ.get("DEEP_EP_COMMIT") or _git_commit(),
             "card": (f"{cards[0]} x{len(cards)}" if cards else "unknown (no nvidia-smi)"),
             "driver": smi.splitlines()[0].split(",")[1].strip() if cards else "unknown"}
    versions = _command([sys.executable, "-c", "import torch; print(torch.__version__); print(torch.version.cuda); "
                         "v = torch.cuda.nccl.version() if torch.cuda.is_available() else None; "
                         "print('.'.join(map(str, v)) if isinstance(v, tuple) else v)"]).splitlines()
    versions += ["unknown"] * (3 - len(versions))
    facts.update(torch=versions[0], cuda=versions[1], nccl=versions[2])
    return facts


#: The pytest steps of tools/device_suite.sh: ``<step>.log`` and ``<step>.xml`` under $OUT.
PYTEST_STEPS = ("jit_gpu", "gpu_tests", "gpu_extra", "coop_tests", "multi_gloo")
TORCHRUN_PYTEST_STEPS = ("multi_gloo",)


def summary_text(run_dir: Path, facts: dict) -> str:
    """The text of summary.txt for the device run whose outputs are in ``run_dir``."""
    lines = ["deep_ep device-suite run", f"date: {facts['date']}", f"commit: {facts['commit']}",
             f"card: {facts['card']}", f"driver: {facts['driver']}",
             f"torch: {facts['torch']} (CUDA {facts['cuda']})", f"NCCL (torch): {facts['nccl']}", "",
             "tests (per file: passed, failed; from the pytest JUnit XML of each step):"]
    header = len(lines)
    steps = sorted({x.stem for x in run_dir.glob("*.xml")} | {s for s in PYTEST_STEPS if (run_dir / f"{s}.log").exists()})
    for step in steps:
        xml, log = run_dir / f"{step}.xml", run_dir / f"{step}.log"
        per_file = None
        if xml.exists():
            try:
                per_file = junit_counts(xml)
            except ET.ParseError:
                per_file = None
        if per_file:
            lines += [f"  {step}: {name}: {format_counts(c)}" for name, c in sorted(per_file.items())]
            continue
        # a pytest under torchrun writes one summary line per rank into one log
        counts = pytest_counts(log.read_text(errors="replace"), worst=step in TORCHRUN_PYTEST_STEPS) \
            if log.exists() else None
        if counts is not None:
            lines.append(f"  {step}: {format_counts(counts)} (from {log.name}: no JUnit XML)")
        else:
            lines.append(f"  {step}: no result (pytest crashed or timed out: see {log.name})")
    torchrun = run_dir / "torchrun_suite.log"
    if torchrun.exists():
        text = torchrun.read_text(errors="replace")
        ok, bad = len(re.findall(r"^\S+: ok$", text, re.M)), len(re.findall(r"^\S+: FAIL", text, re.M))
        total = re.search(r"^torchrun suite, (\d+) ranks: (\d+) cases", text, re.M)
        ended = f"{total.group(2)} cases on {total.group(1)} ranks" if total else \
            "no final count: the suite stopped early (a hang, a crash or its timeout)"
        lines.append(f"  torchrun_suite: tools/torchrun_suite.py: {ok} passed, {bad} failed ({ended})")
    if len(lines) == header:
        lines.append("  (no test results)")
    lines += ["", "bench checks:"]
    any_bench = False
    for js in sorted(run_dir.glob("*.json")):
        try:
            result = json.loads(js.read_text())
        except ValueError:
            continue
        check = result.get("check") if isinstance(result, dict) else None
        if not isinstance(check, dict):
            continue
        any_bench = True
        if not check.get("enabled"):
            verdict = "not checked"
        elif check.get("passed"):
            verdict = "check passed"
        else:
            first = (check.get("failures") or ["?"])[0]
            verdict = f"check FAILED ({str(first)[:160]})"
        lines.append(f"  {js.stem}: {verdict}")
    if not any_bench:
        lines.append("  (no bench JSON files)")
    mutation = run_dir / "mutation" / "mutation.json"
    lines += ["", "mutation check (tools/mutation_check.py):"]
    if mutation.exists():
        try:
            lines += ["  " + ln for ln in json.loads(mutation.read_text())["lines"]]
        except (ValueError, KeyError):
            lines.append("  unreadable mutation.json")
    else:
        lines.append("  not run")
    return "\n".join(lines) + "\n"


def main_summary(run_dir: Path) -> int:
    text = summary_text(run_dir, environment())
    (run_dir / "summary.txt").write_text(text)
    sys.stdout.write(text)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--defects", default="", help="comma-separated defect numbers (default: all)")
    p.add_argument("--out", default=None, help="folder of logs and results (default: $OUT/mutation)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all runs (default 480)")
    p.add_argument("--suite-timeout", type=float, default=150.0, help="seconds per suite run")
    p.add_argument("--bench-timeout", type=float, default=150.0, help="seconds per bench run")
    p.add_argument("--bench-args", default="", help="arguments added to every bench run (e.g. \"--tokens 1024\")")
    p.add_argument("--dry-run", action="store_true",
                   help="check that every edit applies, print the commands, run nothing")
    p.add_argument("--plant", nargs=2, metavar=("N", "DIR"), default=None,
                   help="write a copy of the include tree with defect N planted to DIR (for EP_JIT_INCLUDE_OVERLAY)")
    p.add_argument("--write-summary", metavar="DIR", default=None,
                   help="write DIR/summary.txt for a device run instead of running the check")
    args = p.parse_args(argv)
    if args.write_summary:
        return main_summary(Path(args.write_summary))
    if args.plant:
        number, tree = args.plant
        defect = next((d for d in DEFECTS if str(d.number) == number), None)
        if defect is None:
            raise SystemExit(f"--plant: unknown defect {number!r} (known: {[d.number for d in DEFECTS]})")
        try:
            plant(defect, Path(tree))
        except PatchError as exc:
            print(f"mutation check: {exc}", file=sys.stderr)
            return 2
        print(f"defect {defect.number} ({defect.name}) planted in {tree}: {OVERLAY_VARIABLE}={Path(tree).resolve()}")
        return 0
    return main_check(args)


if __name__ == "__main__":
    sys.exit(main())
