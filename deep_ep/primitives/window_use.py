"""Who uses a buffer's window. Dispatch/combine and each primitive share one window, as DeepEP's
buffer does, one user at a time: a primitive with work in flight (PP tensors sent and not yet
received, an open all-gather session, fetched Engram entries not yet waited for) holds the window,
and any other use raises a clear error on every rank (every rank makes the same calls, so every
rank sees the same state) instead of overwriting bytes a peer still reads."""
from __future__ import annotations

import gc
import weakref
from typing import Callable, Optional

__all__ = ["WindowUse"]


class WindowUse:
    """The window's current holder: None (free, or used only by calls that finish before they
    return, such as dispatch and combine) or the name of a primitive with work in flight."""

    __slots__ = ("holder", "detail", "_token", "_on_drop")

    def __init__(self) -> None:
        self.holder: Optional[str] = None
        self.detail = ""
        self._token = self._on_drop = None

    def settle(self) -> None:
        """Release a hold whose token (the object that was to end it, e.g. an Engram fetch's hook) was
        garbage-collected without ending it: ``on_drop()`` first orders what comes next after the
        held work, as ending it would have."""
        if self._token is not None and self._token() is not None:
            # Kept only by a reference cycle (e.g. an exception's frames) it would wait for the
            # collector, whose timing differs between ranks: collect now, so every rank that dropped
            # it sees the same state (rare: the window is held, and the call would be refused).
            gc.collect()
        if self._token is not None and self._token() is None:
            on_drop, self._token, self._on_drop = self._on_drop, None, None
            self.holder, self.detail = None, ""
            if on_drop is not None:
                on_drop()

    def check_free(self, user: str) -> None:
        """Raise unless ``user`` may use the window now (free, or ``user`` holds it).

        Raises:
            RuntimeError: another user holds the window; the message names both and how to release it.
        """
        self.settle()
        if self.holder is not None and self.holder != user:
            raise RuntimeError(f"deep_ep: {user} cannot use the buffer's window while {self.holder} holds it "
                               f"({self.detail}); the two share one window, one at a time")

    def hold(self, user: str, detail: str) -> None:
        """``user`` has work in flight (``detail``: what, and what ends it)."""
        self.check_free(user)
        self.holder, self.detail = user, detail

    def end_with(self, token, on_drop: Optional[Callable[[], None]] = None) -> None:
        """The current hold ends when ``token`` ends it, or (`settle`) once ``token`` is
        garbage-collected without having done so, after ``on_drop()``."""
        self._token, self._on_drop = weakref.ref(token), on_drop

    def release(self, user: str) -> None:
        """``user``'s work in flight is over."""
        if self.holder == user:
            self.holder, self.detail = None, ""
            self._token = self._on_drop = None
