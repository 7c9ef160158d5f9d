"""DeepEP's V1 API, ``deep_ep.Buffer`` and ``deep_ep.Config``: its normal (high-throughput) and
low-latency modes, within one NVLink domain and across nodes (`deep_ep.legacy.internode`), built on
`ElasticBuffer`.

Contract (docs/design.md, "DeepEP's V1 Buffer"): the same signatures, defaults, outputs, dtypes and
receive order as DeepEP's V1 ``Buffer``; a dispatch returns rows grouped by source rank in rank order,
tokens in source order within a rank, ``recv_topk_idx`` as local expert ids (-1 for experts of other
ranks). Low-latency mode (`deep_ep.legacy.low_latency`: DeepEP's per-expert layouts, FP8 / UE8M0,
receive hooks, rank masks) runs on the same `ElasticBuffer` calls, CPU backend or GPU; across nodes
normal mode runs on `ElasticBuffer`'s hybrid mode and low-latency mode on its direct mode. Bad input
raises before any communication.
"""
from __future__ import annotations

from .buffer import Buffer
from .config import Config
from .handle import LegacyHandle
from .internode import InternodeHandle

__all__ = ["Buffer", "Config", "LegacyHandle", "InternodeHandle"]
