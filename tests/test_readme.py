"""The README's complete program runs as written (CPU, gloo), so the README cannot rot.

The program must pick a free rendezvous port rather than name one: two copies of a program with a
fixed port, started together, can cross-join (a rank of one job joins the other job, and the first
hangs). Whether that happens in a given run is a race, so the port is checked in the text, and two
copies are run at the same time, as two jobs on one machine would be.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _complete_program() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    programs = [b for b in blocks if 'if __name__ == "__main__":' in b]
    assert len(programs) == 1, f"expected one complete program in README.md, found {len(programs)}"
    return programs[0]


def test_readme_program_runs_twice_at_once(tmp_path):
    program = _complete_program()
    assert not re.search(r"tcp://[\w.]+:\d", program), "the README's program names a fixed port"
    script = tmp_path / "readme_program.py"
    script.write_text(program)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    jobs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = []
    try:
        for job in jobs:
            outs.append(job.communicate(timeout=300)[0])
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.communicate()
    for job, out in zip(jobs, outs):
        assert job.returncode == 0, out[-3000:]
        for rank in (0, 1):  # (the two ranks share the pipe: a line's newline may follow the other's line)
            assert re.search(rf"rank {rank}: received \d+ tokens; combine checked", out), out[-3000:]
