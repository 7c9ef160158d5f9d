"""The per-rank state of `deep_ep.ElasticBuffer`'s all-gather / reduce-scatter sessions (`_Session`),
their handles (`AgrsHandle`) and the parsing of shape arguments; `deep_ep.primitives.agrs` holds the
public methods."""
from __future__ import annotations

from typing import Optional

import torch

from .. import checks

__all__ = ["AgrsHandle"]


def _parse_shapes(name: str, shapes) -> tuple:
    """``(list of shape tuples, batched)``: one shape (a tuple, `torch.Size` or list of ints; ``()``
    is a scalar) or a non-empty sequence of shapes (batched mode), as DeepEP tells them apart."""
    if not isinstance(shapes, (tuple, list, torch.Size)):
        raise TypeError(f"{name} must be a shape (tuple of ints) or a sequence of shapes, got {type(shapes).__name__}")
    batched = len(shapes) > 0 and isinstance(shapes[0], (tuple, list, torch.Size))
    parsed = []
    for shape in (shapes if batched else (shapes,)):
        if not isinstance(shape, (tuple, list, torch.Size)):
            raise TypeError(f"{name}: every entry of a sequence of shapes must be a shape, got {shape!r}")
        parsed.append(tuple(checks.check_int(f"{name} entry {shape!r}", size, minimum=0, maximum=None)
                            for size in shape))
    if isinstance(shapes, list) and not shapes:
        raise ValueError(f"{name} must hold at least one shape, got an empty list")
    return parsed, batched


def _check_dtype(name: str, dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__} ({dtype!r})")
    return dtype


class _Session:
    """One buffer's AGRS bookkeeping on one rank (identical on every rank that makes the same calls)."""

    __slots__ = ("num_max_session_bytes", "num_max_ops", "open", "index", "offset", "num_ops", "handles", "space")

    def __init__(self) -> None:
        self.num_max_session_bytes = 0   # 0: agrs_set_config not called yet
        self.num_max_ops = 0
        self.open = False
        self.index = 0                   # sessions created so far
        self.offset = 0                  # bytes of the space the open session has used
        self.num_ops = 0                 # all-gathers / reduce-scatters in the open session
        self.handles: list = []          # handles of the open session not waited yet
        self.space: Optional[torch.Tensor] = None   # uint8 [num_max_session_bytes] (GPU: a view of the window)


class AgrsHandle:
    """Waits for the data of one `all_gather` / `reduce_scatter` call: call it (``handle()``).

    Calling it again is a no-op. Handles may be waited in any order. On a GPU buffer the wait is
    queued on the current stream (the host does not wait): work queued after it on that stream sees
    the data; a reduce-scatter's sum is queued there too.

    Raises:
        RuntimeError: called after its session ended (the session's end already waited for it; its
        outputs may be overwritten by a later session), as DeepEP's handle does; or a peer failed.
        TimeoutError: a peer did not arrive within the buffer's timeout.
    """

    __slots__ = ("_session", "_index", "_wait", "op")

    def __init__(self, session: _Session, op: str, wait) -> None:
        self._session = session
        self._index = session.index
        self._wait = wait
        self.op = op

    @property
    def done(self) -> bool:
        """Whether the handle, or its session's end, waited for the data."""
        return self._wait is None

    def __call__(self) -> None:
        if not self._session.open or self._session.index != self._index:
            raise RuntimeError(f"deep_ep: the handle of {self.op} in AGRS session #{self._index} was called after "
                               f"that session ended; wait handles inside their session")
        self._finish()

    def _finish(self) -> None:
        if self._wait is not None:
            wait, self._wait = self._wait, None
            self._session.handles.remove(self)
            wait()

    def __repr__(self) -> str:
        return f"AgrsHandle({self.op}, session #{self._index}, {'done' if self.done else 'in flight'})"
