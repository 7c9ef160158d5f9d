"""Progress lines of the bench: plain, flushed lines on any output (a terminal, a pipe, a log file).

``[cpu] rank 0: warm-up done``, ``[gpu] iteration 3/50``: one line per stage and a bounded number per
timed loop, so a run is seen to be alive within a second and a log shows where it stopped.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

__all__ = ["Progress", "iteration_marks"]


def iteration_marks(total: int, max_lines: int = 10) -> set:
    """The 1-based iteration numbers to report out of ``total``: every one up to ``max_lines``,
    otherwise about ``max_lines`` evenly spaced ones, the last always included."""
    if total <= max_lines:
        return set(range(1, total + 1))
    step = -(-total // max_lines)
    return set(range(step, total + 1, step)) | {total}


class Progress:
    """Writes ``[tag] message`` lines through ``sink`` (default: print to stdout, flushed).

    ``tag=""`` writes the bare message (the CPU runner's processes forward bare messages to the
    parent, which tags them). ``enabled=False`` (ranks other than 0) writes nothing. ``sink`` takes
    one string.
    """

    def __init__(self, tag: str, *, sink: Optional[Callable[[str], None]] = None, enabled: bool = True,
                 prefix: str = "") -> None:
        self.tag = tag
        self.enabled = enabled
        self.prefix = prefix
        self._sink = sink

    def child(self, name: str) -> "Progress":
        """The same output, each message prefixed with ``name: `` (a second pass of the bench)."""
        return Progress(self.tag, sink=self._sink, enabled=self.enabled, prefix=f"{self.prefix}{name}: ")

    def say(self, message: str) -> None:
        """One progress line."""
        if not self.enabled:
            return
        text = self.prefix + message
        line = f"[{self.tag}] {text}" if self.tag else text
        if self._sink is not None:
            self._sink(line)
        else:
            print(line, file=sys.stdout, flush=True)

    def loop(self, name: str, total: int, max_lines: int = 10) -> Callable[[int], None]:
        """A callback ``done(i)`` for a loop of ``total`` iterations (``i`` 1-based) that writes
        ``{name} i/total`` at the iterations of :func:`iteration_marks`."""
        marks = iteration_marks(total, max_lines)

        def done(i: int) -> None:
            if i in marks:
                self.say(f"{name} {i}/{total}")
        return done
