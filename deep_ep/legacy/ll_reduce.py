"""The weighted top-k sum of DeepEP's V1 low-latency combine (`deep_ep.legacy.low_latency`): per token,
the float32 sum in top-k slot order of ``topk_weights[t, k] * pairs[t, k]`` over the selected slots (an
expert id >= 0 whose rank is not masked), each product rounded to float32 before it is added, rounded
once to bf16. The torch loop here is the specification and the CPU path; on a CUDA device one NVRTC
kernel (``include/deep_ep/kernels/ll_reduce.cuh``) computes the same bits in one pass."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .. import jit
from ..backends.gpu.abi import _read_constants

__all__ = ["weighted_sum", "weighted_sum_torch", "load_kernel", "KERNEL_NAME"]

KERNEL_NAME = "deep_ep_ll_reduce"
# the kernel's own constants, read from its header (one source for host and device)
_CONSTANTS = _read_constants(Path(__file__).resolve().parents[1] / "include" / "deep_ep" / "impls" / "ll_reduce.cuh")
_THREADS = _CONSTANTS["kLlReduceThreads"]
_CHANNELS_PER_THREAD = _CONSTANTS["kLlReduceChannels"]   # one 16-byte load per slot
_MAX_BLOCKS = 4096
_kernel = jit.LazyKernel("deep_ep_ll_reduce", "deep_ep/kernels/ll_reduce.cuh", KERNEL_NAME)


def load_kernel(device: torch.device) -> None:
    """Build (once per process) and load the kernel on a CUDA ``device`` now, not at a first launch that
    may come while a CUDA graph is being captured; nothing on other devices or during a capture."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        _kernel().handle(device.index)


def _selected(topk_idx: torch.Tensor, slot: int, masked: Optional[torch.Tensor], num_local_experts: int):
    selected = topk_idx[:, slot] >= 0
    if masked is not None:                 # nothing comes from a masked rank
        selected &= masked[(topk_idx[:, slot] // num_local_experts).clamp(min=0)] == 0
    return selected


def weighted_sum_torch(pairs: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       masked: Optional[torch.Tensor], num_local_experts: int, out: torch.Tensor) -> torch.Tensor:
    """The specification, in torch ops (any device); arguments as `weighted_sum`."""
    num_tokens, num_topk, hidden = pairs.shape
    total = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=pairs.device)
    for slot in range(num_topk):
        selected = _selected(topk_idx, slot, masked, num_local_experts)
        weight = torch.where(selected, topk_weights[:, slot], 0.0)
        total += torch.where(selected.unsqueeze(1), pairs[:, slot].float() * weight.unsqueeze(1), 0.0)
    return out.copy_(total.to(torch.bfloat16))


def weighted_sum(pairs: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 masked: Optional[torch.Tensor], num_local_experts: int, out: torch.Tensor) -> torch.Tensor:
    """Write the weighted top-k sum of ``pairs`` into ``out`` and return it, on the current stream.

    Args:
        pairs: bf16 ``[T, K, H]``, H a multiple of 8: the row each (token, slot) pair came back with.
            Rows of unselected slots are not read on the GPU (they may hold anything).
        topk_idx: int64 ``[T, K]`` expert ids, -1 for no expert (the slot adds nothing).
        topk_weights: float32 ``[T, K]``.
        masked: int32 ``[R]`` rank mask (1 = masked: that rank's experts' slots add nothing) or None.
        num_local_experts: experts per rank (an expert's rank is ``id // num_local_experts``).
        out: bf16 ``[T, H]`` contiguous, on the device of ``pairs``.

    The caller checks the arguments (`low_latency_combine`); on a CUDA device one kernel, elsewhere
    `weighted_sum_torch`, equal bit for bit.
    """
    pairs = pairs.contiguous()
    # the kernel moves 16 bytes at a time: a view of out (or pairs) off that alignment takes the torch path
    if pairs.device.type != "cuda" or pairs.data_ptr() % 16 or out.data_ptr() % 16:
        return weighted_sum_torch(pairs, topk_idx, topk_weights, masked, num_local_experts, out)
    num_tokens, num_topk, hidden = pairs.shape
    num_chunks = num_tokens * hidden // _CHANNELS_PER_THREAD
    if num_chunks == 0:
        return out
    blocks = min((num_chunks + _THREADS - 1) // _THREADS, _MAX_BLOCKS)
    num_ranks = masked.numel() if masked is not None else 0
    _kernel().launch(blocks, _THREADS, (pairs, topk_idx.contiguous(), topk_weights.contiguous(), masked,
                                        out, num_tokens, num_topk, hidden, num_local_experts, num_ranks),
                     stream=torch.cuda.current_stream(pairs.device), device=pairs.device.index)
    return out
