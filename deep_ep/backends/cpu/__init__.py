"""CPU backend: dispatch and combine of CPU tensors over a gloo group (the executable spec, run
distributed; bit-identical to `deep_ep.reference`).

Modules: `backend` (the `CPUBackend` class), `dispatch` and `combine` (the protocol of each call),
`collectives` (bounded gloo collectives, failure reports, the configuration header), `wire` (byte
views rows travel in).
"""
from .backend import CPUBackend

__all__ = ["CPUBackend"]
