"""`EPHandle`: the routing metadata of one dispatch.

A handle is made by `ElasticBuffer.dispatch` on every rank. It is what `combine` needs to send the
expert outputs back, and it can be passed back to `dispatch(handle=...)` to repeat the same layout
with new data (a *cached* dispatch: no routing input, no host synchronisation).

Field meanings are fixed by docs/design.md ("The handle"); they are restated here:

Configuration (host values)
    buffer_id                int   id of the `ElasticBuffer` that made the handle (-1: made by
                                   `deep_ep.reference`, belongs to no buffer)
    num_ranks, rank          int   group size and this rank
    num_experts, num_topk    int   E and K of the dispatch
    hidden                   int   H, channels per token
    do_expand                bool  expanded (one row per (token, local expert)) layout or not
    expert_alignment         int   A, per-expert groups are padded to a multiple of A
    num_max_tokens_per_rank  int   M used to size ``do_cpu_sync=False`` outputs (0 = not given)
    num_tokens               int   T_s, tokens this rank sent

Receive side (this rank as destination; tensors on the buffer's device)
    num_recv_tokens              int or None  received rows including padding (None when the
                                              dispatch ran with ``do_cpu_sync=False``)
    num_recv_tokens_gpu          [1] int32    the same count, always on the device
    rank_prefix_sum              [R] int32    inclusive prefix sum over source ranks of received
                                              tokens (non-expanded rows / expanded pairs, unpadded)
    num_recv_tokens_per_expert   [L] int32    received pairs per local expert, padded up to A
    num_recv_tokens_per_expert_list  list[int] or None  host copy (None without CPU sync)
    recv_src_rank, recv_src_token    [rows] int32   source of every allocated row, -1 on padding
                                              rows and rows past the true count
    recv_topk_weights            [rows] float32 or None  expanded mode only: the per-row weights
                                              combine applies

Send side (this rank as source)
    send_pos   non-expanded: [T_s, R] int32, the row of token t at rank d (-1 if not sent there);
               expanded: [T_s, K] int32, the row of pair (t, k) at the owner of its expert (-1)
    topk_idx   [T_s, K] int64, the routing that made the handle

Backend state
    backend_state  backend-private (GPU: `deep_ep.backends.gpu.GPUHandleState`), None elsewhere
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Optional

import torch

__all__ = ["EPHandle"]


@dataclass(eq=False)
class EPHandle:
    """Routing metadata of one dispatch; see the module docstring for every field."""

    # configuration
    buffer_id: int
    num_ranks: int
    rank: int
    num_experts: int
    num_topk: int
    hidden: int
    do_expand: bool
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_tokens: int
    # receive side
    num_recv_tokens: Optional[int]
    num_recv_tokens_gpu: torch.Tensor
    rank_prefix_sum: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    num_recv_tokens_per_expert_list: Optional[list]
    recv_src_rank: torch.Tensor
    recv_src_token: torch.Tensor
    # send side
    send_pos: torch.Tensor
    topk_idx: torch.Tensor
    recv_topk_weights: Optional[torch.Tensor] = None
    #: backend-private state a cached dispatch or combine needs (GPU: layout words, per-token rows);
    #: ``None`` for the CPU backend and the reference. Cloned with the handle when it has ``clone()``.
    backend_state: Optional[object] = None

    # ------------------------------------------------------------------ derived values
    @property
    def num_local_experts(self) -> int:
        """L = num_experts / num_ranks."""
        return self.num_experts // self.num_ranks

    @property
    def num_recv_rows(self) -> int:
        """Rows of the receive tensors as allocated (true count, or the worst case without CPU sync).

        This is the number of rows `combine` expects in its ``x``.
        """
        return int(self.recv_src_rank.shape[0])

    @property
    def do_cpu_sync(self) -> bool:
        """Whether the dispatch that made the handle synchronised with the host."""
        return self.num_recv_tokens is not None

    @property
    def device(self) -> torch.device:
        """The device of the handle's tensors (the buffer's device)."""
        return self.send_pos.device

    # ------------------------------------------------------------------ checks
    def check_matches(self, *, buffer_id: int, num_ranks: int, rank: int, device: torch.device,
                      what: str = "handle") -> None:
        """Raise `ValueError` unless this handle was made by the given buffer on this rank.

        Args:
            buffer_id: id of the buffer the handle is used with (`ElasticBuffer.buffer_id`).
            num_ranks, rank: that buffer's group size and rank.
            device: that buffer's device.
            what: the argument name used in the message.
        """
        if self.buffer_id != buffer_id:
            owner = ("deep_ep.reference (no buffer)" if self.buffer_id < 0
                     else f"ElasticBuffer #{self.buffer_id}")
            raise ValueError(f"{what} was made by {owner}, but is used with ElasticBuffer #{buffer_id}: "
                             f"a handle only works with the buffer whose dispatch made it")
        if self.num_ranks != num_ranks or self.rank != rank:
            raise ValueError(f"{what} was made on rank {self.rank} of {self.num_ranks}, "
                             f"but this is rank {rank} of {num_ranks}")
        if torch.device(self.device) != torch.device(device):
            raise ValueError(f"{what} tensors are on {self.device}, the buffer works on {device}")

    # ------------------------------------------------------------------ copies
    def clone(self) -> "EPHandle":
        """A deep copy: every tensor cloned, host values copied."""
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) or (f.name == "backend_state" and hasattr(v, "clone")):
                values[f.name] = v.clone()
            else:
                values[f.name] = copy.copy(v)
        return EPHandle(**values)

    def __repr__(self) -> str:  # compact: tensors by shape only
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                parts.append(f"{f.name}=<{str(v.dtype).replace('torch.', '')}{list(v.shape)}>")
            elif isinstance(v, list) and len(v) > 8:
                parts.append(f"{f.name}=<list[{len(v)}]>")
            else:
                parts.append(f"{f.name}={v!r}")
        return "EPHandle(" + ", ".join(parts) + ")"
