"""FP8 (e4m3) quantisation of the bench's inputs, and its inverse for the stand-in expert outputs."""
from __future__ import annotations

import torch

__all__ = ["quantize_fp8", "dequantize_fp8"]


def quantize_fp8(x: torch.Tensor, scale_format: str = "fp32"):
    """Per-token, per-128-channel FP8 (e4m3) quantisation of bf16 ``x [T, H]`` (H a multiple of 128;
    of 512 for ``"ue8m0"``).

    Returns ``(data float8_e4m3fn [T, H], sf)``: ``sf`` float32 ``[T, H/128]`` (``x ≈ data * sf``),
    or with ``"ue8m0"`` power-of-two scales stored as biased exponent bytes packed four to an int32
    ``[T, H/512]`` (byte ``j`` of element ``i`` is the scale of channel block ``4*i + j``,
    little-endian).
    """
    T, H = x.shape
    blocks = x.float().view(T, H // 128, 128)
    amax = blocks.abs().amax(dim=-1).clamp_min(1e-4)
    scale = amax / 448.0
    if scale_format == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    data = (blocks / scale.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn)
    if scale_format == "fp32":
        return data, scale.contiguous()
    exponents = (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8)  # [T, H/128]
    return data, exponents.contiguous().view(torch.int32)


def dequantize_fp8(x, scale_format: str = "fp32") -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``(data [rows, H], sf)`` → bf16 ``[rows, H]`` (``sf`` may be
    a column-major view)."""
    data, sf = x
    rows, H = data.shape
    if scale_format == "fp32":
        scale = sf.float()
    else:
        exps = sf.contiguous().view(torch.uint8).view(rows, -1)[:, : H // 128].to(torch.int32) - 127
        scale = torch.exp2(exps.float())
    out = data.float().view(rows, H // 128, 128) * scale.view(rows, -1, 1)
    return out.view(rows, H).to(torch.bfloat16)
