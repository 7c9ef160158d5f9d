"""Byte views the CPU backend moves rows with (gloo sends integer tensors)."""
from __future__ import annotations

import torch

from ...shapes import as_rows

__all__ = ["as_bytes", "typed", "wire", "pack", "unpack"]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A ``[rows, n]`` tensor viewed as ``[rows, n * itemsize]`` uint8 (no copy when it is dense)."""
    t = t.contiguous()
    if t.dim() and t.stride(-1) != 1:
        # An empty tensor counts as contiguous whatever its strides (``torch.rand(0, 1) + 0.5`` has
        # strides (1, 0)), but a dtype-changing view needs a unit last stride: make a dense copy.
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def typed(b: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    """uint8 ``[rows, width * itemsize]`` columns -> ``[rows, width]`` of ``dtype``."""
    # A fresh copy: `contiguous()` may return a strided view for 0 or 1 rows, which `view` rejects.
    return b.clone(memory_format=torch.contiguous_format).view(dtype).reshape(b.shape[0], width)


def wire(t: torch.Tensor) -> torch.Tensor:
    """`as_rows` limited to the integer types gloo sends (int64, int32, else uint8)."""
    return as_rows(t, (torch.int64, torch.int32))


def pack(parts: list, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of each uint8 ``[n, w]`` part, side by side: ``[len(rows), sum w]`` uint8."""
    width = sum(w for _, w in parts)
    buf = torch.empty((rows.numel(), width), dtype=torch.uint8, device="cpu")
    col = 0
    for b, w in parts:
        buf[:, col:col + w] = b.index_select(0, rows)
        col += w
    return buf


def unpack(buf: torch.Tensor, layout: list) -> list:
    """The inverse of `pack`: ``layout`` is ``[(dtype, width), ...]``; returns one tensor per entry
    (``[rows, width]`` of ``dtype``)."""
    out, col = [], 0
    for dtype, width in layout:
        nbytes = width * dtype.itemsize
        out.append(typed(buf[:, col:col + nbytes], dtype, width))
        col += nbytes
    return out
