"""`EventOverlap`: a completion event of asynchronous communication, as in DeepEP.

`dispatch` and `combine` return one. With ``async_with_compute_stream=True`` on a GPU it holds a
CUDA event recorded on the communication stream; the caller makes its compute stream wait for it
when it needs the results, either explicitly::

    recv_x, ..., event = buffer.dispatch(..., async_with_compute_stream=True)
    ...                       # overlapped compute
    event.current_stream_wait()

or as a context manager, which waits when the block exits::

    with buffer.dispatch(..., async_with_compute_stream=True)[-1]:
        ...                   # overlapped compute

On CPU (and whenever the operation already completed in stream order) it holds no event and waiting
is a no-op. Hooks added with `add_hook` run right after the wait, once.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["EventOverlap"]


class EventOverlap:
    """A communication completion event plus the tensors that must stay alive until it completes.

    Args:
        event: a `torch.cuda.Event` (or any object with ``wait(stream)`` / ``synchronize()``), or
            None when there is nothing to wait for (CPU, or synchronous calls).
        extra_tensors: tensors (any nesting of tuples) kept referenced by this object so that their
            memory is not reused before the event completes.
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._hooks: list = []

    # ------------------------------------------------------------------
    def add_hook(self, hook: Callable[[], None]) -> None:
        """Register ``hook()`` to run (once) right after the next `current_stream_wait`."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self._hooks.append(hook)

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (no host blocking), then run the hooks.

        A no-op wait when the object holds no event.
        """
        if self.event is not None:
            if torch.cuda.is_available() and isinstance(self.event, torch.cuda.Event):
                torch.cuda.current_stream().wait_event(self.event)
            elif hasattr(self.event, "current_stream_wait"):
                self.event.current_stream_wait()
            else:
                self.event.wait()
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={'None' if self.event is None else type(self.event).__name__}, " \
               f"hooks={len(self._hooks)})"
