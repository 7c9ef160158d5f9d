"""DeepEP's module paths for its two buffer classes (``deep_ep.buffers.elastic`` and
``deep_ep.buffers.legacy``), for code that imports them from there rather than from ``deep_ep``.
They hold the same classes; the implementations live in `deep_ep.buffer` and `deep_ep.legacy`."""
