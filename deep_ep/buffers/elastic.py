"""``from deep_ep.buffers.elastic import ElasticBuffer, EPHandle`` as with DeepEP: the classes of
`deep_ep.buffer` and `deep_ep.handle`."""
from ..buffer import ElasticBuffer, topk_idx_t
from ..event import EventHandle, EventOverlap
from ..handle import EPHandle

__all__ = ["ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "topk_idx_t"]
