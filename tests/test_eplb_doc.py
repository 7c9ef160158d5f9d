"""docs/eplb.md's example runs as written (2 gloo ranks, spawned by the program itself) and prints
the lines the page shows, so the page cannot rot."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "eplb.md"


def _program_and_output() -> tuple:
    text = PAGE.read_text()
    match = re.search(r"```python\n(.*?)```\s*\n[^`]*?```\n(.*?)```", text, flags=re.S)
    assert match and 'if __name__ == "__main__":' in match.group(1), "docs/eplb.md: no complete program"
    return match.group(1), match.group(2)


def test_eplb_doc_example_prints_what_the_page_shows(tmp_path):
    program, shown = _program_and_output()
    script = tmp_path / "eplb_example.py"
    script.write_text(program)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    want = sorted(line for line in shown.splitlines() if line.strip())
    assert len(want) == 2
    # (the ranks share the pipe: a line's newline may come after the other rank's line)
    for line in want:
        assert line in result.stdout, f"{line!r} not printed:\n{result.stdout[-3000:]}"
