"""`deep_ep.ElasticBuffer`'s pipeline-parallel send/recv (pp_set_config, pp_send, pp_recv, get_pp_buffer_size_hint)."""
from __future__ import annotations

__all__ = ["PipelineMixin"]


class PipelineMixin:
    """Methods of `deep_ep.ElasticBuffer` (a mixin: it uses the buffer's backend and window)."""
