"""How the custom operators reach Python objects that are not tensors: the `ElasticBuffer` (by its
``buffer_id``) and the `EPHandle` of a dispatch (through a *handle token*).

A custom operator takes and returns tensors and numbers only. The buffer is named by its
``buffer_id``, an int the graph holds as a constant (a model keeps its buffer); the operator looks it
up among the live buffers.

The handle is data that flows from a dispatch to its combine and to both backward passes, so it
travels as a tensor: the *token*, int64 ``[1]`` on the CPU, holding a key of this registry. The
token's memory is a small Python buffer object that also holds the `EPHandle`, so:

* every tensor sharing the token's storage (the op's output, the copy autograd saves for backward,
  views made by a compiler) keeps the handle alive, and when the last one is gone the handle goes
  with it (nothing to release by hand, no leak across training steps);
* the lookup goes by the key in the token's value, which survives any copy of the token; a copy
  alone does not keep the handle alive (no compiler copies a CPU int64 tensor between two
  operators, and autograd never does).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Optional

import torch

from .. import buffer as buffer_module
from ..handle import EPHandle, collect_tensors

__all__ = ["find_buffer", "new_token", "handle_of", "num_live_handles", "handle_tensors"]

_buffers: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_buffers_lock = threading.Lock()


def find_buffer(buffer_id: int):
    """The live `ElasticBuffer` whose ``buffer_id`` is ``buffer_id``.

    Raises:
        RuntimeError: no such buffer (it was garbage-collected), or it was destroyed.
    """
    buf = _buffers.get(buffer_id)
    if buf is None:
        with _buffers_lock:
            for candidate in list(buffer_module._live_buffers):
                _buffers[candidate.buffer_id] = candidate
            buf = _buffers.get(buffer_id)
    if buf is None:
        raise RuntimeError(f"deep_ep.ops: ElasticBuffer #{buffer_id} no longer exists (a compiled graph or "
                           f"a handle outlived the buffer it was made with)")
    if buf.is_destroyed:
        raise RuntimeError(f"deep_ep.ops: ElasticBuffer #{buffer_id} was destroyed; create a new one")
    return buf


class _TokenMemory(bytearray):
    """The 8 bytes of a token's storage, holding the handle for as long as any tensor uses them."""
    __slots__ = ("handle", "__weakref__")


_tokens: "weakref.WeakValueDictionary[int, _TokenMemory]" = weakref.WeakValueDictionary()
_keys = itertools.count(1)


def new_token(handle: EPHandle) -> torch.Tensor:
    """A fresh token (int64 ``[1]``, CPU) for ``handle``: its storage keeps ``handle`` alive."""
    key = next(_keys)   # atomic under the GIL: emulated ranks dispatch from several threads
    memory = _TokenMemory(key.to_bytes(8, "little", signed=True))
    memory.handle = handle
    _tokens[key] = memory
    return torch.frombuffer(memory, dtype=torch.int64)


def handle_of(token: torch.Tensor) -> EPHandle:
    """The `EPHandle` a token names.

    Raises:
        TypeError: ``token`` is not an int64 CPU tensor of one element.
        RuntimeError: the handle no longer exists (only a copy of its token is left).
    """
    if not isinstance(token, torch.Tensor) or token.dtype != torch.int64 or token.numel() != 1 \
            or token.device.type != "cpu":
        raise TypeError(f"a handle token is an int64 CPU tensor of one element, got "
                        f"{token.dtype if isinstance(token, torch.Tensor) else type(token).__name__}")
    key = int(token.reshape(()).item())
    memory = _tokens.get(key)
    if memory is None:
        raise RuntimeError(f"deep_ep.ops: the handle of token {key} no longer exists: keep the handle (or an "
                           f"output that holds its token) alive while its combine or backward runs")
    return memory.handle


def num_live_handles() -> int:
    """How many handles tokens keep alive now (for tests: handles must not leak across steps)."""
    return len(_tokens)


def handle_tensors(handle: Optional[EPHandle]) -> list:
    """Every tensor an `EPHandle` holds (its backend state included): an operator must not return
    one of them (an output is the caller's to free or overwrite)."""
    return collect_tensors(handle) if handle is not None else []
