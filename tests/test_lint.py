"""Static check of the package, tools and tests with pyflakes: undefined names, unused imports and
variables. CPU CI cannot run the GPU code paths, so a name removed by a refactor (a helper still
called by a launch path) would otherwise only fail on a GPU machine."""
from __future__ import annotations

from pathlib import Path

from pyflakes import api, reporter

ROOT = Path(__file__).resolve().parents[1]


class _Collect(reporter.Reporter):
    def __init__(self):
        self.messages = []

    def unexpectedError(self, filename, msg):
        self.messages.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        self.messages.append(str(message))


def test_pyflakes_clean():
    out = _Collect()
    for folder in ("deep_ep", "tools", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            api.checkPath(str(path), out)
    assert not out.messages, "\n".join(out.messages)
