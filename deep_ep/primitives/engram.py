"""`deep_ep.ElasticBuffer`'s Engram remote-memory fetch (engram_write, engram_fetch, get_engram_storage_size_hint)."""
from __future__ import annotations

__all__ = ["EngramMixin"]


class EngramMixin:
    """Methods of `deep_ep.ElasticBuffer` (a mixin: it uses the buffer's backend and window)."""
