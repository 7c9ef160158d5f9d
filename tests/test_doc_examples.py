"""The docs' example programs run as written (CPU, gloo, under torchrun), so the docs cannot rot.

A page's ```python blocks form programs: a block that starts a process group begins one, a block
that does not continues the one before it (the docs split a program to explain its parts). A
program runs on the number of ranks its first line names (``# torchrun --nproc-per-node N``), else 2.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/primitives.md", "docs/scaleout.md", "docs/design.md")


def _programs(page: str) -> list:
    programs = []
    for block in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S):
        if "init_process_group" in block or not programs:
            programs.append(block)
        else:
            programs[-1] += block
    return programs


CASES = [(page, index) for page in PAGES for index in range(len(_programs(page)))]


@pytest.mark.parametrize("page,index", CASES, ids=[f"{page}#{index}" for page, index in CASES])
def test_doc_program_runs(page, index, tmp_path):
    program = _programs(page)[index]
    assert "init_process_group" in program, f"{page}: program {index} never starts a process group"
    match = re.match(r"# torchrun --nproc-per-node (\d+)", program)
    num_ranks = int(match.group(1)) if match else 2
    script = tmp_path / "example.py"
    # after the program's own end (its barrier and destroy_process_group), leave without the interpreter's
    # teardown, where torch's gloo sometimes aborts (docs/troubleshooting.md): a flake, not the docs' fault
    script.write_text(program + "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n"
                      "_os._exit(0)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_ranks}",
               str(script)]
    try:
        result = subprocess.run(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{page}: program {index} did not finish in 240 s:\n{(exc.output or '')[-3000:]}")
    assert result.returncode == 0, f"{page}: program {index} failed:\n{result.stdout[-3000:]}"
