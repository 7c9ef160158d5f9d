"""``from deep_ep.utils.event import EventOverlap`` as with DeepEP: the classes of `deep_ep.event`."""
from ..event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
