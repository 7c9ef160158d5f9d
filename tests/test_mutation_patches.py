"""The mutation check's defects are planted outside the shipped kernels, and still plant something.

tools/mutation_check.py plants each defect as a few textual edits of a copy of ``deep_ep/include``
that the JIT compiles through ``EP_JIT_INCLUDE_OVERLAY``. On the CPU (NVRTC compiles, nothing is
launched): the shipped headers carry no defect hooks; every edit's search text is found exactly
once in the current headers; an edit that no longer applies stops the check; each patched tree
compiles, under a cache key of its own, to kernel code that differs from the clean build's.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from deep_ep import jit
from deep_ep.backends import gpu
from test_mutations_cpu import _tool

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "deep_ep" / "include"


TOOL = _tool()
NUMBERS = [d.number for d in TOOL.DEFECTS]


def _defect(number: int):
    return next(d for d in TOOL.DEFECTS if d.number == number)


def test_the_shipped_kernels_carry_no_defect_hooks():
    hooks = re.compile(r"EP_TEST_DEFECT|kDefect|defects\.cuh|defect_\w+\(")
    hits = [f"{path.relative_to(INCLUDE)}:{i}: {line.strip()}"
            for path in sorted(INCLUDE.rglob("*")) if path.is_file()
            for i, line in enumerate(path.read_text().splitlines(), 1) if hooks.search(line)]
    assert not hits, "test-only defect hooks in the shipped headers:\n" + "\n".join(hits)
    assert not (INCLUDE / "deep_ep" / "common" / "defects.cuh").exists()
    host = (ROOT / "deep_ep" / "backends" / "gpu").rglob("*.py")
    assert not [p for p in host if "DEEP_EP_TEST_DEFECT" in p.read_text() or "TEST_DEFECTS" in p.read_text()]


def test_the_catalogue():
    assert NUMBERS == [1, 2, 3, 4, 5, 6]
    assert [d.name for d in TOOL.DEFECTS] == ["dropped row", "wrong row", "missing bias", "scaled weight",
                                              "stale scale factor", "skipped expert"]
    for d in TOOL.DEFECTS:
        assert d.edits and d.effect and d.cases, d.number
        for edit in d.edits:
            assert edit.search != edit.replace, (d.number, edit)
            # the rank-alone kernels are not planted in (they are on their way out)
            assert edit.path.startswith(("impls/", "kernels/", "common/", "comm/")) and "_alone" not in edit.path


@pytest.mark.parametrize("number", NUMBERS)
def test_every_edit_applies_exactly_once(number):
    defect = _defect(number)
    texts = TOOL.patched_texts(defect)
    assert set(texts) == {e.path for e in defect.edits}
    for path, (original, patched) in texts.items():
        assert original == (INCLUDE / "deep_ep" / path).read_text() and patched != original
        for edit in defect.edits:
            if edit.path == path:
                assert original.count(edit.search) == 1, (path, edit.search)
                assert edit.replace in patched
    diff = TOOL.defect_diff(defect)   # what the check writes to defect<n>.diff
    assert {ln[len("+++ b/deep_ep/include/deep_ep/"):] for ln in diff.splitlines() if ln.startswith("+++ ")} == set(texts)


def test_an_edit_that_no_longer_applies_stops_the_check(tmp_path, capsys, monkeypatch):
    tree = tmp_path / "tree"
    defect = _defect(1)
    TOOL.plant(_defect(3), tree)          # a copy where defect 1's text is intact
    header = tree / "deep_ep" / defect.edits[0].path
    text = header.read_text()
    header.write_text(text.replace(defect.edits[0].search, "int4* dst = nullptr;"))
    with pytest.raises(TOOL.PatchError, match="found 0 times"):
        TOOL.patched_texts(defect, tree)
    header.write_text(text + "\n// " + defect.edits[0].search + "\n")
    with pytest.raises(TOOL.PatchError, match="found 2 times"):
        TOOL.patched_texts(defect, tree)
    gone = TOOL.Defect(9, "gone", "edits a missing header", (TOOL.Edit("impls/none.cuh", "x", "y"),), ("bf16",))
    with pytest.raises(TOOL.PatchError, match="does not exist"):
        TOOL.patched_texts(gone, tree)
    stale = TOOL.Defect(7, "stale", "an edit whose text the kernels lost",
                        (TOOL.Edit("impls/dispatch_send.cuh", "no such text in the kernels", "x"),), ("bf16",))
    monkeypatch.setattr(TOOL, "DEFECTS", TOOL.DEFECTS + (stale,))
    out = tmp_path / "out"
    assert TOOL.main(["--dry-run", "--out", str(out)]) == 2
    assert "mutation check: FAILED (a defect no longer applies: defect 7 (stale)" in capsys.readouterr().out
    assert not out.exists()
    assert TOOL.main(["--defects", "7", "--out", str(out)]) == 2
    assert "defect 7 (stale)" in (out / "mutation.json").read_text()
    assert not list(out.glob("*.log")), "no run starts when an edit does not apply"


def test_plant_writes_a_whole_copy_with_only_the_edits(tmp_path, capsys):
    tree = tmp_path / "defect6"
    assert TOOL.main(["--plant", "6", str(tree)]) == 0
    assert f"EP_JIT_INCLUDE_OVERLAY={tree.resolve()}" in capsys.readouterr().out
    clean = {p.relative_to(INCLUDE): p.read_bytes() for p in INCLUDE.rglob("*") if p.is_file()}
    copy = {p.relative_to(tree): p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    assert set(copy) == set(clean)
    changed = {str(p.relative_to("deep_ep")) for p in clean if clean[p] != copy[p]}
    assert changed == {e.path for e in _defect(6).edits}
    with pytest.raises(FileExistsError):
        TOOL.plant(_defect(6), tree)


# ------------------------------------------------------------------------------------ NVRTC builds
FLAT = ("dispatch", (7168, 56, 8, False))     # FP8 with scale factors: the stale-scale defect needs them
EXPANDED = ("dispatch", (7168, 56, 8, True))
COMBINE = ("combine", (7168, 8, False))
#: the modules whose kernel code each defect must change
CHANGES = {1: [FLAT], 2: [FLAT], 3: [COMBINE], 4: [FLAT, EXPANDED], 5: [FLAT], 6: [EXPANDED]}


def _kernel_code(cubin: bytes) -> dict:
    """``{".text.<kernel>": machine code}`` of an ELF64 cubin."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    code = {}
    for name_offset, _type, _flags, _addr, offset, size, *_rest in sections:
        name = cubin[names + name_offset:cubin.index(b"\0", names + name_offset)].decode()
        if name.startswith(".text."):
            code[name] = cubin[offset:offset + size]
    return code


def _build(kind: str, structure: tuple):
    defines = (gpu.dispatch_defines if kind == "dispatch" else gpu.combine_defines)(*structure)
    return jit.build(f"deep_ep_{kind}_mutation_test", gpu.kernel_source(kind), defines=defines)


def test_the_catalogue_of_builds_covers_every_defect():
    assert sorted(CHANGES) == NUMBERS


@pytest.mark.parametrize("number", NUMBERS)
def test_each_planted_tree_compiles_to_other_kernel_code(number, tmp_path, monkeypatch):
    monkeypatch.delenv("EP_JIT_INCLUDE_OVERLAY", raising=False)
    clean = {target: _build(*target) for target in CHANGES[number]}
    tree = TOOL.plant(_defect(number), tmp_path / f"defect{number}")
    monkeypatch.setenv("EP_JIT_INCLUDE_OVERLAY", str(tree))
    for target, plain in clean.items():
        patched = _build(*target)
        assert patched.key != plain.key, target
        code, plain_code = _kernel_code(patched.cubin), _kernel_code(plain.cubin)
        assert set(code) == set(plain_code) and code, target
        changed = [name for name in code if code[name] != plain_code[name]]
        assert changed, f"defect {number}: {target} compiles to the clean build's code"
