"""What the GPU kernels need beyond the public fields of an `EPHandle`."""
from __future__ import annotations

from dataclasses import dataclass, field, fields as dc_fields
from typing import Optional

import torch

__all__ = ["GPUHandleState"]


@dataclass
class GPUHandleState:
    """What the kernels need beyond `EPHandle`'s public fields (device tensors).

    layout:        int32 layout words (common/abi.cuh), this rank as destination and as source
    pos_tok:       [T, R] int32 token row of each token at each destination (-1: not sent)
    pos_pair:      [T, K] int32 output row of each (token, expert) pair at its owner (expanded only)
    recv_topk_idx: the non-expanded dispatch's recv_topk_idx, returned again by a cached dispatch
    src_meta:      the handle's recv_src_metadata (its columns 2.. are the expanded rows of every
                   received token row, which cached dispatch and combine read)
    launches:      prepared kernel launches of cached dispatches and combines with this handle
                   (`jit.PreparedLaunch`, keyed by kernel structure and options; not copied by `clone`):
                   their arguments point at this handle's tensors, so a later call with the handle
                   only updates the per-call pointers (inputs, outputs)
    """
    layout: torch.Tensor
    pos_tok: torch.Tensor
    pos_pair: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    src_meta: torch.Tensor
    launches: dict = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the prepared launches behind (ctypes memory pointing at the
        original's tensors)."""
        state = dict(self.__dict__)
        state["launches"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def clone(self) -> "GPUHandleState":
        """A copy with every tensor cloned (for `EPHandle.clone`); no launches."""
        return GPUHandleState(**{f.name: (getattr(self, f.name).clone()
                                          if isinstance(getattr(self, f.name), torch.Tensor)
                                          else getattr(self, f.name)) for f in dc_fields(self)
                                 if f.name != "launches"})
