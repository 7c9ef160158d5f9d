"""The two steps of DeepEP's V1 low-latency combine (`deep_ep.legacy.low_latency`) around its pair
combine: the gather of the rows it sends (`gather_rows`: every received pair's row from the per-expert
layout, zeros for a masked rank's pair), and the weighted top-k sum of the rows that come back
(`weighted_sum`: per token, the float32 sum in top-k slot order of ``topk_weights[t, k] * pairs[t, k]``
over the selected slots (an expert id >= 0 whose rank is not masked), each product rounded to float32
before it is added, rounded once to bf16). The torch ops here are the specifications and the CPU
path; on a CUDA device one NVRTC kernel each (``include/deep_ep/kernels/ll_reduce.cuh``) computes the
same bits in one pass. No host reads: graph capturable."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .. import jit
from ..backends.gpu.abi import _read_constants

__all__ = ["weighted_sum", "weighted_sum_torch", "gather_rows", "gather_rows_torch", "load_kernel", "KERNEL_NAME",
           "GATHER_KERNEL", "KERNEL_NAMES"]

KERNEL_NAME, GATHER_KERNEL = "deep_ep_ll_reduce", "deep_ep_ll_gather"
KERNEL_NAMES = (KERNEL_NAME, GATHER_KERNEL)
# the kernel's own constants, read from its header (one source for host and device)
_CONSTANTS = _read_constants(Path(__file__).resolve().parents[1] / "include" / "deep_ep" / "impls" / "ll_reduce.cuh")
_THREADS = _CONSTANTS["kLlReduceThreads"]
_CHANNELS_PER_THREAD = _CONSTANTS["kLlReduceChannels"]   # one 16-byte load per slot
_GATHER_THREADS = _CONSTANTS["kLlGatherThreads"]
_GATHER_WARPS = _CONSTANTS["kLlGatherWarps"]
_MAX_BLOCKS = 4096
_MAX_GATHER_BLOCKS = 1024       # a warp per row: past this, warps take several rows
_INT32_LIMIT = 2 ** 31
# one module, two entry points: the builds share it (same name and source)
_kernel = jit.LazyKernel("deep_ep_ll_reduce", "deep_ep/kernels/ll_reduce.cuh", KERNEL_NAME)
_gather_kernel = jit.LazyKernel("deep_ep_ll_reduce", "deep_ep/kernels/ll_reduce.cuh", GATHER_KERNEL)


def load_kernel(device: torch.device) -> None:
    """Build (once per process) and load the kernels on a CUDA ``device`` now, not at a first launch
    that may come while a CUDA graph is being captured; nothing on other devices or during a capture."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        _kernel().handle(device.index)
        _gather_kernel().handle(device.index)


def gather_rows_torch(source: torch.Tensor, row_expert: torch.Tensor, row_slot: torch.Tensor,
                      row_kept: torch.Tensor, masked: Optional[torch.Tensor]) -> torch.Tensor:
    """The specification of `gather_rows`, in torch ops (any device): every row, those past the
    received pairs included (they take layout row ``(0, 0)``, or zeros with a mask)."""
    rows = source[row_expert, row_slot]
    if masked is not None:                     # rows of masked ranks go back as zeros
        rows = torch.where(row_kept.unsqueeze(1), rows, 0)
    return rows


def _gather_ready(source: torch.Tensor, ends: torch.Tensor, row_expert: torch.Tensor, row_slot: torch.Tensor,
                  row_kept: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: on a CUDA device, rows in 16-byte chunks, 32-bit row counts."""
    item = source.element_size()
    return (source.device.type == "cuda" and source.stride(2) == 1 and source.data_ptr() % 16 == 0
            and source.stride(0) * item % 16 == 0 and source.stride(1) * item % 16 == 0
            and source.shape[2] * item % 16 == 0 and ends.dtype == torch.int32 and ends.is_contiguous()
            and row_expert.dtype == torch.int64 and row_slot.dtype == torch.int64 and row_kept.dtype == torch.bool
            and row_expert.is_contiguous() and row_slot.is_contiguous() and row_kept.is_contiguous()
            and row_expert.numel() < _INT32_LIMIT)


def gather_rows(source: torch.Tensor, ends: torch.Tensor, row_expert: torch.Tensor, row_slot: torch.Tensor,
                row_kept: torch.Tensor, masked: Optional[torch.Tensor],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows a low-latency combine's pair combine sends, on the current stream: expanded row ``r``
    is the layout row ``source[row_expert[r], row_slot[r]]``, or zeros where ``row_kept[r]`` is False
    (a pair from a masked rank).

    Args:
        source: bf16 ``[L, N, H]`` (any strides on the CPU; on the GPU the kernel takes rows whose
            channels are contiguous and 16-byte aligned, others go through `gather_rows_torch`).
        ends: int32 ``[L]``, the pair dispatch's ``psum_num_recv_tokens_per_expert`` (alignment 1:
            the received pairs are the expanded rows before ``ends[L - 1]``).
        row_expert, row_slot: int64 ``[rows]``; row_kept: bool ``[rows]`` (`LowLatencyHandle`).
        masked: the rank mask (int32 ``[R]``) or None; without one, every received row is kept.
        out: bf16 ``[rows, H]`` contiguous to write into (default: a new tensor).

    Returns:
        ``out`` or a new bf16 ``[rows, H]``: the received pairs' rows. On the GPU, rows past the received pairs are
        not written (the pair combine does not read them); `gather_rows_torch` writes them too.

    The caller checks the arguments (`low_latency_combine`); on a CUDA device one kernel, elsewhere
    `gather_rows_torch`, equal bit for bit on the received rows.
    """
    if not _gather_ready(source, ends, row_expert, row_slot, row_kept) or \
            (out is not None and (not out.is_contiguous() or out.data_ptr() % 16)):
        rows = gather_rows_torch(source, row_expert, row_slot, row_kept, masked)
        return rows if out is None else out.copy_(rows)
    num_local_experts, _, hidden = source.shape
    num_rows = row_expert.numel()
    rows = torch.empty((num_rows, hidden), dtype=source.dtype, device=source.device) if out is None else out
    if num_rows == 0 or num_local_experts == 0:
        return rows
    item = source.element_size()
    blocks = max(1, min((num_rows + _GATHER_WARPS - 1) // _GATHER_WARPS, _MAX_GATHER_BLOCKS))
    _gather_kernel().launch(blocks, _GATHER_THREADS,
                            (source, jit.i64(source.stride(0) * item // 16), jit.i64(source.stride(1) * item // 16),
                             hidden * item // 16, ends, num_local_experts, row_expert, row_slot, row_kept, rows,
                             num_rows),
                            stream=torch.cuda.current_stream(source.device), device=source.device.index)
    return rows


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
