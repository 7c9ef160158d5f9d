"""Who uses a buffer's window. Dispatch/combine and each primitive share one window, as DeepEP's
buffer does, one user at a time: a primitive with work in flight (PP tensors sent and not yet
received, an open all-gather session, fetched Engram entries not yet waited for) holds the window,
and any other use raises a clear error on every rank (every rank makes the same calls, so every
rank sees the same state) instead of overwriting bytes a peer still reads."""
from __future__ import annotations

from typing import Optional

__all__ = ["WindowUse"]


class WindowUse:
    """The window's current holder: None (free, or used only by calls that finish before they
    return, such as dispatch and combine) or the name of a primitive with work in flight."""

    __slots__ = ("holder", "detail")

    def __init__(self) -> None:
        self.holder: Optional[str] = None
        self.detail = ""

    def check_free(self, user: str) -> None:
        """Raise unless ``user`` may use the window now (free, or ``user`` holds it).

        Raises:
            RuntimeError: another user holds the window; the message names both and how to release it.
        """
        if self.holder is not None and self.holder != user:
            raise RuntimeError(f"deep_ep: {user} cannot use the buffer's window while {self.holder} holds it "
                               f"({self.detail}); the two share one window, one at a time")

    def hold(self, user: str, detail: str) -> None:
        """``user`` has work in flight (``detail``: what, and what ends it)."""
        self.check_free(user)
        self.holder, self.detail = user, detail

    def release(self, user: str) -> None:
        """``user``'s work in flight is over."""
        if self.holder == user:
            self.holder, self.detail = None, ""
