"""``from deep_ep.buffers.legacy import Buffer`` as with DeepEP: DeepEP's V1 classes of
`deep_ep.legacy`."""
from ..event import EventHandle, EventOverlap
from ..legacy import Buffer, Config

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
