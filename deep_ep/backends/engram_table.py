"""What every backend's Engram table holds the same way (`deep_ep.backends.cpu.engram`,
`deep_ep.backends.gpu.engram`): the shard's shape and format once written, the replicated scale
factors, and the storage formats a write accepts. How the shards are stored and fetched is each
backend's own."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["AGREED_FIELDS", "EngramTableState", "STORAGE_FORMATS", "STORAGE_LOCATIONS"]

#: ``(storage dtype, sf dtype or None)`` -> the format number `engram_write`'s header carries:
#: 0 bf16, 1 FP8 with float32 scale factors, 2 FP8 with UE8M0 exponents packed four to an int32.
STORAGE_FORMATS = {(torch.bfloat16, None): 0, (torch.float8_e4m3fn, torch.float32): 1,
                   (torch.float8_e4m3fn, torch.int32): 2}

#: What every rank's `engram_write` must agree on, in the order each backend's header lists them
#: (named in the error when ranks disagree). The last, the storage's place, only GPU buffers check:
#: on the CPU backend every shard is in host memory whatever the write asks.
AGREED_FIELDS = ("num_entries (rows of each rank's storage)", "hidden",
                 "storage format (0 bf16, 1 FP8 + float32 sf, 2 FP8 + packed UE8M0 int32 sf)",
                 "num_sf_packs (columns of sf)", "rows of sf",
                 "the values of sf (a digest; the table is replicated: every rank passes the same)",
                 "storage_location (0 device, 1 host)")

#: The places `engram_write` accepts for a shard (``storage_location``).
STORAGE_LOCATIONS = ("host", "device")


class EngramTableState:
    """One buffer's Engram table on rank ``rank`` of ``num_ranks``, as far as every backend shares it:
    ``num_entries`` rows per rank of ``hidden`` columns in ``dtype`` (0 / None until the first
    write), and ``sf``, this rank's copy of the replicated scale factors (``[num_ranks *
    num_entries, num_sf_packs]``, None without FP8 storage)."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        self.rank, self.num_ranks = rank, num_ranks
        self.num_entries, self.hidden = 0, 0
        self.dtype: Optional[torch.dtype] = None
        self.sf: Optional[torch.Tensor] = None

    def _forget_table(self) -> None:
        """Back to no table (a backend's ``release`` frees its storage too)."""
        self.sf = None
        self.num_entries, self.hidden, self.dtype = 0, 0, None

    @property
    def written(self) -> bool:
        """Whether a write stored a table (a fetch needs one)."""
        return self.num_entries > 0

    @property
    def num_sf_packs(self) -> int:
        """Columns of ``sf`` (0 without scale factors)."""
        return 0 if self.sf is None else self.sf.shape[1]
