"""Where DeepEP's V1 callers import the event classes from (``from deep_ep.utils import EventHandle,
EventOverlap``): the same classes as `deep_ep.event`'s."""
from ..event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
