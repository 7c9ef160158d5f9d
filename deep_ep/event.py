"""Events of asynchronous communication, as in DeepEP V2: `EventHandle` and `EventOverlap`.

`EventHandle` is a point on a CUDA stream: ``EventHandle()`` (what `ElasticBuffer.capture` returns)
records one on the current stream, and ``dispatch(previous_event=...)`` makes the communication wait
for it. On the CPU, or before the process used CUDA at all, there is nothing to wait for and the
handle is a no-op.

`EventOverlap` is what `dispatch` and `combine` return. With ``async_with_compute_stream=True`` it
holds the `EventHandle` of the communication's end; the caller makes its compute stream wait when it
needs the results, either explicitly::

    recv_x, ..., event = buffer.dispatch(..., async_with_compute_stream=True)
    ...                       # overlapped compute
    event.current_stream_wait()

or as a context manager, which waits when the block exits::

    with buffer.dispatch(..., async_with_compute_stream=True)[-1]:
        ...                   # overlapped compute

A synchronous call returns an `EventOverlap` without an event, and waiting on it is a no-op (DeepEP
asserts instead). Hooks run right after the wait, once.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["EventHandle", "EventOverlap", "cuda_event_of"]


class EventHandle:
    """A CUDA event recorded on a stream, or a no-op where there is no CUDA work to wait for.

    Args:
        stream: the `torch.cuda.Stream` to record on; None (the default) records on the current
            stream when the process has initialised CUDA, and is a no-op otherwise.

    Attributes:
        event: the `torch.cuda.Event`, or None for a no-op handle.
    """

    def __init__(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if stream is None and not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return      # no CUDA work was ever issued by this process: nothing to wait for
        self.event = torch.cuda.Event()
        self.event.record(stream if stream is not None else torch.cuda.current_stream())

    @classmethod
    def completed(cls) -> "EventHandle":
        """A no-op handle (already complete), whatever the process did with CUDA."""
        handle = cls.__new__(cls)
        handle.event = None
        return handle

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (no host blocking); a no-op without one."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __repr__(self) -> str:
        return f"EventHandle({'no-op' if self.event is None else 'cuda'})"


def cuda_event_of(event) -> Optional["torch.cuda.Event"]:
    """The `torch.cuda.Event` inside an `EventHandle`, an `EventOverlap` or a bare CUDA event (None
    when it holds none)."""
    if isinstance(event, EventOverlap):
        event = event.event
    if isinstance(event, EventHandle):
        return event.event
    return event


class EventOverlap:
    """A communication completion event plus the tensors that must stay alive until it completes.

    Args:
        event: an `EventHandle` (or a `torch.cuda.Event`), or None when there is nothing to wait for.
        extra_tensors: tensors (any nesting of tuples) kept referenced by this object so that their
            memory is not reused before the event completes.
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._hooks: list = []
        self._release_handle_by_call = False

    # ------------------------------------------------------------------ hooks
    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """Register the hook that runs (once) right after the next `current_stream_wait`.

        Raises:
            TypeError: ``hook_after_wait`` is not callable. RuntimeError: a hook is already registered.
        """
        if not callable(hook_after_wait):
            raise TypeError(f"hook_after_wait must be callable, got {type(hook_after_wait).__name__}")
        if self._hooks:
            raise RuntimeError("a hook is already registered on this EventOverlap")
        self._hooks.append(hook_after_wait)

    def add_hook(self, hook: Callable[[], None]) -> None:
        """Add ``hook()`` to run (once, after the ones added before) right after the next
        `current_stream_wait`; unlike `register_hook_after_wait`, any number may be added."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self._hooks.append(hook)

    @property
    def hook_after_wait(self) -> Optional[Callable[[], None]]:
        """The first pending hook, or None."""
        return self._hooks[0] if self._hooks else None

    @hook_after_wait.setter
    def hook_after_wait(self, hook: Optional[Callable[[], None]]) -> None:
        # DeepEP's is a plain attribute: assigning replaces the registered hook, None removes it
        # (hooks added with `add_hook` after it stay).
        if hook is not None and not callable(hook):
            raise TypeError(f"hook_after_wait must be callable or None, got {type(hook).__name__}")
        rest = self._hooks[1:]
        self._hooks = ([hook] if hook is not None else []) + rest

    # ------------------------------------------------------------------ waiting
    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current CUDA stream wait for the event (no host blocking), then run the hooks.

        A no-op wait when the object holds no event. ``release_handle=True`` drops the event (and
        what it keeps alive) afterwards.
        """
        cuda_event = cuda_event_of(self.event)
        if cuda_event is not None:
            torch.cuda.current_stream().wait_event(cuda_event)
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()
        if release_handle:
            self.event = None

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True): ...``: the wait at the block's end also drops the event.
        Returns this object."""
        self._release_handle_by_call = release_handle
        return self

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False

    def __repr__(self) -> str:
        return f"EventOverlap(event={self.event!r}, hooks={len(self._hooks)})"
