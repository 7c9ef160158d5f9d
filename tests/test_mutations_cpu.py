"""Mutation tests on the CPU: the checks the test suites rely on must fail when the backend is wrong.

The CPU backend is wrapped, one defect at a time, so that its outputs carry the same kinds of
defects as those tools/mutation_check.py plants in the GPU kernels (its `DEFECTS`): a dropped row,
a row written beside its place, a missing bias, a doubled top-k weight, stale scale factors in a
cached FP8 dispatch, an expert that receives no rows. A row "not written" holds the poison pattern
under `deep_ep.backends.outputs.poisoned` (what a kernel leaves there), zeros otherwise; a "stale"
scale factor holds the previous dispatch's.

- `test_cpu_suite_checks_catch_each_defect`: with small row patterns (the CPU suite's cases have a
  dozen rows), the case function of tests/test_cpu_backend.py raises, and so do the checks it is
  made of (`deep_ep.reference.check_dispatch` / `check_combine`, tests/ep_cases.py's loop spec and
  cached-dispatch check). The clean backend passes the same cases.
- `test_gpu_suite_cases_catch_each_defect`: with the GPU defects' own row patterns, the GPU suite's
  case driver (tests/gpu/test_gpu_backend.py ``run_case``) on two CPU ranks fails every case that
  tools/mutation_check.py runs for the defect, and passes them all on the clean backend.
- The result parsing and the reports of tools/mutation_check.py (tests/test_mutation_patches.py
  checks its edits of the kernels' headers).

The wrapper patches the class of the running backend (`deep_ep.backends.cpu.CPUBackend`, a module or
a package exporting it).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch

from deep_ep import shapes
import torch.distributed as dist

from proc_utils import run_gloo_ranks

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    """tools/mutation_check.py as a module."""
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "tools" / "mutation_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutation_check", mod)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------ the defects
#: Row patterns: the GPU kernels' (tools/mutation_check.py's cases have 60 to 100 rows) and small
#: ones for the CPU suite's dozen rows. Wrong rows are odd, so ``row ^ 1`` is the row before.
PATTERNS = {"gpu": {"drop": (64, 63), "wrong": (61, 7), "stale": (8, 3)},
            "small": {"drop": (4, 3), "wrong": (6, 5), "stale": (4, 1)}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _unwritten_like(rows: torch.Tensor) -> torch.Tensor:
    """What rows a kernel does not write hold: the poison pattern when poisoning, else zeros."""
    from deep_ep.backends import outputs
    out = torch.zeros_like(rows)
    return outputs.fill_poison(out) if outputs.is_poisoning() else out


class Defect:
    """Wraps ``cls.dispatch`` / ``cls.combine`` so that their outputs carry defect ``number``
    (tools/mutation_check.py's `DEFECTS`); ``changed`` counts the rows or values it altered."""

    def __init__(self, number: int, pattern: str):
        self.number, self.pattern, self.changed = number, PATTERNS[pattern], 0
        self._sf_of = weakref.WeakKeyDictionary()   # handle -> scale factors of its own dispatch

    def _rows(self, n_rows: int, valid: torch.Tensor, kind: str) -> torch.Tensor:
        mod, rem = self.pattern[kind]
        rows = torch.arange(n_rows)
        return rows[(rows % mod == rem) & valid]

    def _set_rows(self, t: torch.Tensor, rows: torch.Tensor, value: torch.Tensor) -> None:
        if rows.numel():
            bits = _bits(t)
            self.changed += int((bits[rows] != _bits(value)).flatten(1).any(1).sum())
            bits[rows] = _bits(value)

    def after_dispatch(self, out, kwargs):
        recv_x, recv_idx, recv_w, handle = out
        data, sf = (recv_x if isinstance(recv_x, tuple) else (recv_x, None))
        cached = kwargs.get("handle") is not None
        expand = handle.do_expand
        valid = handle.recv_src_rank >= 0          # rows that hold a token (not padding, not past the count)
        n = int(data.shape[0])
        # the local expert of every row: the ids (non-expanded) or the handle's per-expert counts (expanded)
        row_experts = recv_idx if not expand else shapes.expanded_row_experts(
            handle.psum_num_recv_tokens_per_expert, handle.num_unaligned_recv_tokens_per_expert, n)
        if self.number == 1 and not expand:        # dropped row
            rows = self._rows(n, valid, "drop")
            self._set_rows(data, rows, _unwritten_like(data[rows]))
        elif self.number == 2 and not expand:      # wrong row: written to row ^ 1, its own row unwritten
            rows = self._rows(n, valid, "wrong")
            moved = data[rows].clone()
            self._set_rows(data, rows, _unwritten_like(moved))
            self._set_rows(data, rows ^ 1, moved)
        elif self.number == 4 and not cached and recv_w is not None:   # scaled weight, top-k slot 0
            if not expand:
                slot0 = valid & (recv_idx[:, 0] >= 0)
                self._set_rows(recv_w, slot0.nonzero().flatten(), recv_w[slot0] * 2)
            else:  # the pair's slot, known for rows this rank sent itself
                L, r = handle.num_local_experts, handle.rank
                rows = (valid & (handle.recv_src_rank == r)).nonzero().flatten()
                tok = handle.recv_src_token[rows].long()
                first = handle.topk_idx[tok, 0] == row_experts[rows] + r * L
                rows = rows[first]
                self._set_rows(recv_w, rows, recv_w[rows] * 2)
        elif self.number == 5 and sf is not None:  # stale scale factors of a cached dispatch
            if not cached:
                self._sf_of[handle] = sf.clone()
            elif not expand:
                rows = self._rows(n, valid, "stale")
                from deep_ep.backends import outputs
                previous = self._sf_of.get(handle)
                stale = previous[rows] if previous is not None and not outputs.is_poisoning() \
                    else _unwritten_like(sf[rows])
                self._set_rows(sf, rows, stale)
        elif self.number == 6 and expand:          # local expert 1 receives no rows
            rows = (valid & (row_experts == 1)).nonzero().flatten()
            self._set_rows(data, rows, _unwritten_like(data[rows]))
        return out

    @contextlib.contextmanager
    def applied(self, cls):
        """Patch ``cls`` (the running backend's class) for the duration."""
        own = {name: cls.__dict__[name] for name in ("dispatch", "combine") if name in cls.__dict__}
        dispatch, combine = cls.dispatch, cls.combine
        defect = self

        def patched_dispatch(backend, *args, **kwargs):
            return defect.after_dispatch(dispatch(backend, *args, **kwargs), kwargs)

        def patched_combine(backend, x, handle, topk_weights, bias, *args, **kwargs):
            if defect.number == 3 and bias:        # the first bias is not added
                defect.changed += 1
                bias = tuple(bias)[1:]
            return combine(backend, x, handle, topk_weights, bias, *args, **kwargs)

        cls.dispatch, cls.combine = patched_dispatch, patched_combine
        try:
            yield self
        finally:
            for name in ("dispatch", "combine"):
                if name in own:
                    setattr(cls, name, own[name])
                else:
                    delattr(cls, name)


def backend_class(buf):
    """The class of ``buf``'s running backend (a `CPUBackend`)."""
    from deep_ep.backends.cpu import CPUBackend
    running = type(getattr(buf, "_backend", None))
    return running if isinstance(running, type) and issubclass(running, CPUBackend) else CPUBackend


def _raises(fn, *args, **kwargs):
    """The AssertionError message ``fn`` raises, or None."""
    try:
        fn(*args, **kwargs)
    except AssertionError as exc:
        return str(exc) or type(exc).__name__
    return None


# ------------------------------------------------------------------------------------ the CPU suite
def _cpu_cases():
    """One-rank cases of tests/ep_cases.py (a defect on one of several ranks would make the ranks'
    calls diverge after a failed check); the defects each case carries: see `CPU_CASE_OF`."""
    from ep_cases import Case
    common = dict(num_ranks=1, num_tokens=[12], num_topk=4, num_experts=8, mask_prob=0.2, max_tokens=12)
    return {"flat": Case("R1-bf16-flat", hidden=256, num_bias=2, seed=31, **common),
            "fp8": Case("R1-fp8-flat", hidden=512, x_format="fp8", seed=32, **common),
            "expand": Case("R1-bf16-expand", hidden=256, do_expand=True, alignment=2, seed=33, **common)}


CPU_CASE_OF = {1: "flat", 2: "flat", 3: "flat", 4: "flat", 5: "fp8", 6: "expand"}


def _direct_checks(buf, number: int, case) -> dict:
    """Each check the CPU suite is made of, on the (defective) outputs of ``case``: name -> the
    AssertionError message, or None when the check passed."""
    from ep_cases import bits_equal, check_against_loop, check_cached_dispatch, loop_combine, \
        make_combine_inputs, make_inputs
    from deep_ep.reference import check_combine, check_dispatch, reference_combine, reference_dispatch

    E, M = case.num_experts, case.max_tokens
    xs, idxs, ws = make_inputs(case)
    out = buf.dispatch(xs[0], idxs[0], ws[0] if ws else None, num_experts=E, num_max_tokens_per_rank=M,
                       expert_alignment=case.alignment, do_expand=case.do_expand)
    ref = reference_dispatch(xs, idxs, ws, E, do_expand=case.do_expand, expert_alignment=case.alignment,
                             num_max_tokens_per_rank=M)
    found = {}
    if number in (1, 2, 4, 6):
        found["check_dispatch"] = _raises(check_dispatch, out, ref[0])
        found["check_against_loop"] = _raises(check_against_loop, {0: out}, xs, idxs, ws, E, case.do_expand,
                                              case.alignment)
    elif number == 3:
        valid = [r.handle.recv_src_rank >= 0 for r in ref]
        ys, tws, biases = make_combine_inputs(case, [v.numel() for v in valid], valid)
        got = buf.combine(ys[0], out[3], topk_weights=tws[0] if tws else None, bias=biases[0])
        found["check_combine"] = _raises(check_combine, got, reference_combine(ys, [r.handle for r in ref],
                                                                               tws, biases)[0])
        loop = loop_combine(ys, [r.handle for r in ref], tws, biases)[0]
        found["loop_combine"] = "combined_x differs" if not bits_equal(got[0], loop[0]) else None
    elif number == 5:
        found["check_cached_dispatch"] = _raises(check_cached_dispatch, buf, case, 0, out[3], idxs, ws, E, M,
                                                 seed_offset=4242)
    return found


def _cpu_suite_worker(rank, world_size):
    from test_cpu_backend import _run_case

    import deep_ep
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=12, hidden=512, num_topk=8)
    cls = backend_class(buf)
    cases = _cpu_cases()
    for case in cases.values():   # the clean backend passes (an error here fails the test)
        _run_case(buf, case, rank)
    results = {}
    for number, name in CPU_CASE_OF.items():
        with Defect(number, "small").applied(cls) as defect:
            suite = _raises(_run_case, buf, cases[name], rank)
            direct = _direct_checks(buf, number, cases[name])
        results[number] = {"suite": suite, "direct": direct, "changed": defect.changed}
    buf.destroy()
    return results


def test_cpu_suite_checks_catch_each_defect(tmp_path):
    results = run_gloo_ranks(_cpu_suite_worker, 1, tmp_path, deadline=240)[0]
    assert sorted(results) == [1, 2, 3, 4, 5, 6]
    for number, res in results.items():
        assert res["changed"] > 0, f"defect {number}: the wrapper altered nothing (the case cannot show it)"
        assert res["suite"], f"defect {number}: tests/test_cpu_backend.py's case passed with the defect"
        assert res["direct"], number
        passed = [name for name, message in res["direct"].items() if message is None]
        assert not passed, f"defect {number}: {passed} passed with the defect"


# ------------------------------------------------------------------------------------ the GPU suite's cases
def _gpu_cases_worker(rank, world_size, plan):
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import test_gpu_backend as gpu_suite
    from gpu_cases import cases_for

    import deep_ep
    probe = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=4, hidden=128, num_topk=4)
    cls = backend_class(probe)
    probe.destroy()
    cases = {c.name.split("-", 1)[1]: c for c in cases_for(world_size)}
    results = []
    for number, names in plan:
        for name in names:
            defect = Defect(number, "gpu")
            with (defect.applied(cls) if number else contextlib.nullcontext()):
                message = _raises(gpu_suite.run_case, cases[name], lambda body: {rank: body(dist.group.WORLD)},
                                  torch.device("cpu"))
            results.append((number, name, message, defect.changed))
    return results


def test_gpu_suite_cases_catch_each_defect(tmp_path):
    """The cases tools/mutation_check.py runs for each defect fail on a CPU backend carrying the
    defect with the GPU kernels' row patterns (so the GPU runs can fail too), and pass without."""
    tool = _tool()
    plan = [(0, sorted({c for d in tool.DEFECTS for c in d.cases}))] + [(d.number, d.cases) for d in tool.DEFECTS]
    by_rank = run_gloo_ranks(_gpu_cases_worker, 2, tmp_path, plan, deadline=400)
    for rank, results in by_rank.items():
        for number, name, message, changed in results:
            if number == 0:
                assert message is None, f"rank {rank}: clean case {name} failed: {message}"
            else:
                assert changed > 0, f"rank {rank}: defect {number} altered nothing in case {name}"
                assert message is not None, f"rank {rank}: case {name} passed with defect {number}"


# ------------------------------------------------------------------------------------ tools/mutation_check.py
def test_defect_table_matches_the_cpu_defects():
    tool = _tool()
    assert [d.number for d in tool.DEFECTS] == sorted(CPU_CASE_OF)
    from gpu_cases import _BASE
    names = {c.name for c in _BASE}
    for d in tool.DEFECTS:
        assert set(d.cases) <= names, d


def test_pytest_and_junit_parsing(tmp_path):
    tool = _tool()
    log = "....F\n!!!!!!!!!! stopping after 1 failures !!!!!!!!!!\n1 failed, 4 passed, 1 skipped in 12.34s\n"
    assert tool.pytest_counts(log) == {"passed": 4, "failed": 1, "errors": 0, "skipped": 1}
    assert tool.pytest_counts("==== 2 passed, 1 error, 3 warnings in 1.0s ====") == \
        {"passed": 2, "failed": 0, "errors": 1, "skipped": 0, "warnings": 3}
    assert tool.pytest_counts("Segmentation fault (core dumped)\n") is None
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="tests.gpu.test_a" name="t1"/>'
                   '<testcase classname="tests.gpu.test_a" name="t2"><failure message="x"/></testcase>'
                   '<testcase classname="tests.gpu.test_b.TestK" name="t3"><skipped/></testcase>'
                   '<testcase classname="tests.gpu.test_b" name="t4"><error message="e"/></testcase>'
                   '</testsuite></testsuites>')
    per_file = tool.junit_counts(xml)
    assert per_file == {"tests/gpu/test_a.py": {"passed": 1, "failed": 1, "errors": 0, "skipped": 0},
                        "tests/gpu/test_b.py": {"passed": 0, "failed": 0, "errors": 1, "skipped": 1}}
    assert tool.total(per_file) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}


def test_verdicts():
    tool = _tool()
    c = {"passed": 3, "failed": 0, "errors": 0, "skipped": 0}
    assert tool.suite_verdict(0, c)[0] == "passed"
    assert tool.suite_verdict(1, dict(c, failed=1)) == ("failed", "3 passed, 1 failed")
    assert tool.suite_verdict(1, dict(c, errors=1))[0] == "error"          # a fixture error is no catch
    assert tool.suite_verdict(5, {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})[0] == "error"
    assert tool.suite_verdict(0, {"passed": 0, "failed": 0, "errors": 0, "skipped": 4})[0] == "error"
    assert tool.suite_verdict(None, None, "timed out after 150 s") == ("error", "timed out after 150 s")
    assert tool.suite_verdict(-11, None)[0] == "error"
    ok = {"check": {"enabled": True, "passed": True, "failures": []}}
    bad = {"check": {"enabled": True, "passed": False, "failures": ["rank 0: recv_x: 64 element(s) differ"]}}
    assert tool.bench_verdict(0, ok, "")[0] == "passed"
    assert tool.bench_verdict(1, bad, "") == ("failed", "rank 0: recv_x: 64 element(s) differ")
    assert tool.bench_verdict(1, None, "check: MISMATCH: rank 0 ...\n")[0] == "failed"
    assert tool.bench_verdict(2, None, "error: unrecognized arguments: --bias 1\n")[0] == "error"
    assert tool.bench_verdict(1, ok, "Traceback ...\nRuntimeError: boom\n")[0] == "error"
    assert tool.bench_verdict(0, {"check": {"enabled": False, "passed": False}}, "")[0] == "error"
    assert tool.bench_verdict(0, None, "")[0] == "error"


def _judged(tool, kind, defect, verdict, detail="", label=""):
    run = tool.Run(kind, defect, [], {}, Path("/nonexistent"), Path("/nonexistent"), 1.0, label=label)
    run.verdict, run.detail = verdict, detail
    return run


def test_report_lines_and_exit_status():
    tool = _tool()
    defects = [tool.DEFECTS[2], tool.DEFECTS[4]]
    runs = [_judged(tool, "suite", 0, "passed", "2 passed, 0 failed"),
            _judged(tool, "bench", 0, "passed", label="--bias 1"),
            _judged(tool, "bench", 0, "passed", label="--fp8"),
            _judged(tool, "suite", 3, "failed", "1 failed"), _judged(tool, "bench", 3, "failed"),
            _judged(tool, "suite", 5, "failed", "1 failed"), _judged(tool, "bench", 5, "passed", "check passed")]
    lines, passed = tool.report(defects, runs)
    assert lines[0] == "clean build: suite passed (2 passed, 0 failed), bench check passed (2 configurations)"
    assert lines[1] == "defect 3 (missing bias): suite FAILED as expected (1 failed), bench check FAILED as expected"
    assert lines[2].startswith("defect 5 (stale scale factor): suite FAILED as expected") and \
        lines[2].endswith("bench check passed (check passed): NOT CAUGHT")
    assert not passed and lines[-1] == "mutation check: FAILED (defect(s) 5 not caught)"
    runs[-1].verdict = "failed"
    lines, passed = tool.report(defects, runs)
    assert passed and lines[-1].startswith("mutation check: passed")
    runs[2].verdict, runs[2].detail = "error", "exit 2 without a check verdict"
    lines, passed = tool.report(defects, runs)
    assert not passed and lines[0].endswith(": the checks fail without a defect")
    assert "bench [--fp8] check FAILED" in lines[0] and lines[-1] == "mutation check: FAILED (the clean build fails)"


def test_dry_run_plan(capsys, tmp_path):
    tool = _tool()
    assert tool.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 + 4 + 2 * 6       # clean suite, four clean bench configurations, two runs per defect
    assert out[0].startswith("[suite defect 0] env -u EP_JIT_INCLUDE_OVERLAY DEEP_EP_GPU_CASES=")
    assert any("EP_JIT_INCLUDE_OVERLAY='<temporary copies>/defect3'" in ln and "bench --iters 2 --bias 1" in ln
               for ln in out)
    assert any("/defect5'" in ln and "DEEP_EP_GPU_CASES=fp8-fp32" in ln and " -x " in ln for ln in out)
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


def test_runs_are_judged_from_their_output(tmp_path):
    """`execute` runs a command in its own process group, stops it at its time limit, and judges it
    from its exit status, log and artifact."""
    tool = _tool()
    py = sys.executable
    fail = tool.Run("suite", 1, [py, "-c", "print('1 failed, 2 passed in 0.1s'); raise SystemExit(1)"], {},
                    tmp_path / "a.log", tmp_path / "a.xml", 30)
    tool.execute(fail, deadline=float("inf"))
    assert (fail.rc, fail.verdict, fail.detail) == (1, "failed", "2 passed, 1 failed")
    js = tmp_path / "b.json"
    bench = tool.Run("bench", 1, [py, "-c", f"import json; json.dump({{'check': {{'enabled': True, 'passed': False, "
                                            f"'failures': ['row 63 differs']}}}}, open({str(js)!r}, 'w')); "
                                            f"raise SystemExit(1)"], {}, tmp_path / "b.log", js, 30)
    tool.execute(bench, deadline=float("inf"))
    assert (bench.verdict, bench.detail) == ("failed", "row 63 differs")
    slow = tool.Run("suite", 2, [py, "-c", "import time; time.sleep(60)"], {}, tmp_path / "c.log",
                    tmp_path / "c.xml", 1)
    tool.execute(slow, deadline=float("inf"))
    assert slow.verdict == "error" and "timed out" in slow.detail
    late = tool.Run("suite", 3, [py, "-c", "pass"], {}, tmp_path / "d.log", tmp_path / "d.xml", 30)
    tool.execute(late, deadline=0.0)
    assert late.rc is None and late.verdict == "error" and "budget" in late.detail


def test_run_summary(tmp_path):
    tool = _tool()
    (tmp_path / "gpu_tests.xml").write_text('<testsuite><testcase classname="tests.gpu.test_gpu_backend" name="a"/>'
                                            '<testcase classname="tests.gpu.test_gpu_backend" name="b"/></testsuite>')
    (tmp_path / "gpu_tests.log").write_text("..\n2 passed in 3.0s\n")
    (tmp_path / "jit_gpu.log").write_text("........\n8 passed in 2.0s\n")
    (tmp_path / "gpu_extra.log").write_text("..Segmentation fault\n")
    (tmp_path / "torchrun_suite.log").write_text("ep2-bf16: ok\nep2-fp8: FAIL on rank 1: AssertionError\n")
    (tmp_path / "bench_ep1.json").write_text(json.dumps({"check": {"enabled": True, "passed": True}}))
    (tmp_path / "bench_ep8.json").write_text(json.dumps({"check": {"enabled": True, "passed": False,
                                                                   "failures": ["rank 3: combined_x differs"]}}))
    (tmp_path / "mutation").mkdir()
    (tmp_path / "mutation" / "mutation.json").write_text(json.dumps({"lines": ["clean build: ...", "defect 1 ..."]}))
    facts = {"date": "2026-12-01 10:00:00 UTC", "commit": "abc1234", "card": "NVIDIA H200 x1",
             "driver": "580.1", "torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.9"}
    text = tool.summary_text(tmp_path, facts)
    assert "commit: abc1234" in text and "card: NVIDIA H200 x1" in text and "NCCL (torch): 2.28.9" in text
    assert "  gpu_tests: tests/gpu/test_gpu_backend.py: 2 passed, 0 failed" in text
    assert "  jit_gpu: 8 passed, 0 failed (from jit_gpu.log: no JUnit XML)" in text
    assert "  gpu_extra: no result (pytest crashed or timed out: see gpu_extra.log)" in text
    assert "  torchrun_suite: tools/torchrun_suite.py: 1 passed, 1 failed (no final count: the suite stopped " \
        "early" in text
    (tmp_path / "torchrun_suite.log").write_text("ep2-bf16: ok\nv1-low-latency: ok\n"
                                                 "torchrun suite, 2 ranks: 2 cases, 2 ok, 0 failed\n")
    assert "  torchrun_suite: tools/torchrun_suite.py: 2 passed, 0 failed (2 cases on 2 ranks)" in \
        tool.summary_text(tmp_path, facts)
    # a pytest under torchrun: one summary line per rank; a failure on any rank shows
    (tmp_path / "multi_gloo.log").write_text("....\n4 passed in 9.0s\n.F..\n1 failed, 3 passed in 9.1s\n"
                                             "....\n4 passed in 9.2s\n")
    assert "  multi_gloo: 3 passed, 1 failed (from multi_gloo.log: no JUnit XML)" in tool.summary_text(tmp_path, facts)
    assert "  bench_ep1: check passed" in text and "  bench_ep8: check FAILED (rank 3: combined_x differs)" in text
    assert "  defect 1 ..." in text
    assert tool.summary_text(tmp_path / "mutation", facts).count("not run") == 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
