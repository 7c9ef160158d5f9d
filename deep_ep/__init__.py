"""deep_ep: expert-parallel dispatch/combine for Mixture-of-Experts models.

The API is DeepEP V2's: `ElasticBuffer` (dispatch / combine), `EPHandle`, `EventOverlap`,
`EventHandle`, `topk_idx_t`, `get_physical_domain_size`, `get_logical_domain_size`; and DeepEP's V1
`Buffer` and `Config` (normal and low-latency modes, within a node and across nodes, `deep_ep.legacy`), with `deep_ep.utils`
holding the event classes where V1 callers import them.
`deep_ep.reference` is the executable specification; `deep_ep.routing` holds gating and routing
generators; `deep_ep.eplb` expert load balancing; `deep_ep.ops` differentiable dispatch / combine
(torch.library operators that torch.compile traces); `deep_ep.moe` a reference MoE layer built on
them (each imported on first use).
"""
from __future__ import annotations

import importlib

from .buffer import ElasticBuffer, get_logical_domain_size, get_physical_domain_size, topk_idx_t
from .event import EventHandle, EventOverlap
from .handle import EPHandle
from .legacy import Buffer, Config

try:
    from importlib.metadata import version as _version
    __version__ = _version("deep-ep-nvrtc")   # the distribution; the import name is deep_ep
except Exception:  # not installed (run from a source tree)
    __version__ = "0.1.0"

__all__ = ["ElasticBuffer", "Buffer", "Config", "EPHandle", "EventOverlap", "EventHandle", "topk_idx_t",
           "get_physical_domain_size", "get_logical_domain_size", "routing", "reference", "eplb", "ops", "moe", "__version__"]


def __getattr__(name: str):
    # Submodules loaded lazily, so that importing deep_ep stays light.
    if name in ("routing", "reference", "eplb", "ops", "moe"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'deep_ep' has no attribute {name!r}")
