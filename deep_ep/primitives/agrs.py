"""`deep_ep.ElasticBuffer`'s all-gather / reduce-scatter sessions (agrs_*, all_gather, reduce_scatter)."""
from __future__ import annotations

__all__ = ["AllGatherReduceScatterMixin"]


class AllGatherReduceScatterMixin:
    """Methods of `deep_ep.ElasticBuffer` (a mixin: it uses the buffer's backend and window)."""
