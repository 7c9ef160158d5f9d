"""The layouts around the expanded pair dispatch of DeepEP's V1 low-latency dispatch
(`deep_ep.legacy.low_latency`): the pairs sent (every token's row top-k times, cast to FP8 or not, and
their experts, rank mask applied) and the per-expert receive layout the received pairs are placed
into (counts, ``src_info``, ``layout_range``, rows and scales, every expanded row's place).
`cast_pairs_torch` and `receive_layout_torch` (torch ops, mostly those of `deep_ep.legacy.layouts`)
are the specification and the path off the GPU; on a CUDA device NVRTC kernels
(``include/deep_ep/kernels/ll_layout.cuh``) write the same bits: one launch for the pairs, and for the
layout one without a rank mask (the counts gathered in a scratch the pairs' launch zeroed:
`count_scratch`), two with one. No host reads: graph capturable."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import torch

from .. import checks, jit
from ..backends.gpu.abi import _read_constants
from .layouts import NUM_CHANNELS_PER_SCALE, cast_to_fp8, per_expert_layout, per_pair, place_rows, place_scales, \
    row_targets

__all__ = ["ReceiveOutputs", "cast_pairs", "cast_pairs_torch", "count_scratch", "receive_layout",
           "receive_layout_torch", "load_kernels", "KERNEL_NAMES"]

_CONSTANTS = _read_constants(Path(__file__).resolve().parents[1] / "include" / "deep_ep" / "impls" / "ll_layout.cuh")
_THREADS = _CONSTANTS["kLlLayoutThreads"]
_COUNT_THREADS = _CONSTANTS["kLlCountThreads"]
_CAST_CHANNELS = _CONSTANTS["kLlCastChannels"]
_WARPS = _CONSTANTS["kLlLayoutWarps"]
_MAX_BLOCKS = 4096
_INT32_LIMIT = 2 ** 31

CAST_KERNEL, COUNT_KERNEL, PLACE_KERNEL = "deep_ep_ll_cast_pairs", "deep_ep_ll_count", "deep_ep_ll_place"
PLACE_COUNTED_KERNEL = "deep_ep_ll_place_counted"
KERNEL_NAMES = (CAST_KERNEL, COUNT_KERNEL, PLACE_KERNEL, PLACE_COUNTED_KERNEL)
# one module, three entry points: the builds share it (same name and source)
_kernels = {name: jit.LazyKernel("deep_ep_ll_layout", "deep_ep/kernels/ll_layout.cuh", name) for name in KERNEL_NAMES}


class ReceiveOutputs(NamedTuple):
    """Where a dispatch's receive writes (`receive_layout`): ``recv_count`` int32 ``[L]``, ``src_info``
    int32 ``[L, N]``, ``layout_range`` int64 ``[L, R]`` (N = R * T_max), the storages of
    `deep_ep.legacy.layouts.receive_storage` and (FP8, else None) `scale_storage`, ``use_ue8m0``,
    ``stats`` (int32 ``[L]`` the counts are added to, or None) and ``scratch`` (`count_scratch`, zeroed
    by `cast_pairs` before the pair dispatch; None: the layout makes a zeroed one)."""
    recv_count: torch.Tensor
    src_info: torch.Tensor
    layout_range: torch.Tensor
    data_storage: torch.Tensor
    scales_storage: Optional[torch.Tensor]
    use_ue8m0: bool
    stats: Optional[torch.Tensor]
    scratch: Optional[torch.Tensor] = None


def count_scratch(num_local_experts: int, num_ranks: int, device: torch.device) -> torch.Tensor:
    """The scratch of a receive layout without a rank mask on a CUDA device: int32 ``[L * R + 1]``
    (the received pairs per (expert, source rank), and the ticket of the last block), uninitialised:
    `cast_pairs` zeroes it."""
    return torch.empty(num_local_experts * num_ranks + 1, dtype=torch.int32, device=device)


def load_kernels(device: torch.device) -> None:
    """Build (once per process) and load the kernels on a CUDA ``device`` now, not at a first launch
    that may come while a CUDA graph is being captured; nothing on other devices or during a capture."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        for kernel in _kernels.values():
            kernel().handle(device.index)


def _launch(name: str, blocks: int, threads: int, args: tuple, device: torch.device, smem: int = 0) -> None:
    _kernels[name]().launch(blocks, threads, args, smem=smem, stream=torch.cuda.current_stream(device),
                            device=device.index)


def cast_pairs_torch(x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool, round_scale: bool,
                     masked: Optional[torch.Tensor] = None, num_local_experts: int = 1) -> tuple:
    """The specification of `cast_pairs`, in torch ops (any device)."""
    num_topk = topk_idx.shape[1]
    pairs_topk = topk_idx.reshape(-1, 1)
    if masked is not None:                     # nothing goes to a masked rank
        owner_masked = masked[(pairs_topk // num_local_experts).clamp(min=0)] != 0
        pairs_topk = torch.where(owner_masked, -1, pairs_topk)
    if not use_fp8:
        return per_pair(x, num_topk).view(torch.bfloat16), pairs_topk
    data, scale_inv = cast_to_fp8(x, round_scale)
    return (per_pair(data, num_topk).view(checks.FP8), per_pair(scale_inv, num_topk)), pairs_topk


def cast_pairs(x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool, round_scale: bool,
               masked: Optional[torch.Tensor] = None, num_local_experts: int = 1,
               scratch: Optional[torch.Tensor] = None) -> tuple:
    """The rows and routing of the pair dispatch: every token's row ``K`` times in a row (row
    ``t * K + k``), and each pair's expert.

    Args:
        x: bf16 ``[T, H]`` contiguous, H a multiple of 128 (T may be 0).
        topk_idx: int64 ``[T, K]`` contiguous, expert ids in ``[0, E)`` or -1, K >= 1.
        use_fp8: cast with `deep_ep.legacy.layouts.cast_to_fp8` (``round_scale``: power-of-two scales).
        masked: int32 ``[R]`` rank mask (1: pairs to that rank's experts get -1) or None.
        num_local_experts: experts per rank (an expert's rank is ``id // num_local_experts``).
        scratch: a `count_scratch` to zero on the way (one launch fewer than a fill of its own), or None.

    Returns:
        ``(pairs_x, pairs_topk)``: bf16 ``[T*K, H]``, or with ``use_fp8`` ``(float8_e4m3fn [T*K, H],
        float32 [T*K, H/128])``; int64 ``[T*K, 1]`` (a view of ``topk_idx`` without a mask).

    The caller checks the arguments (`low_latency_dispatch`); on a CUDA device one kernel, elsewhere
    `cast_pairs_torch`, equal bit for bit.
    """
    if x.device.type != "cuda" or x.data_ptr() % 16 or not x.is_contiguous() or not topk_idx.is_contiguous() \
            or (masked is not None and (masked.dtype != torch.int32 or not masked.is_contiguous())):
        if scratch is not None:
            scratch.zero_()
        return cast_pairs_torch(x, topk_idx, use_fp8, round_scale, masked, num_local_experts)
    num_tokens, hidden = x.shape
    num_topk = topk_idx.shape[1]
    device = x.device
    num_pairs = num_tokens * num_topk
    if use_fp8:
        data = torch.empty((num_pairs, hidden), dtype=checks.FP8, device=device)
        scales = torch.empty((num_pairs, hidden // NUM_CHANNELS_PER_SCALE), dtype=torch.float32, device=device)
        result, outputs = (data, scales), (None, data, scales)
    else:
        result = torch.empty((num_pairs, hidden), dtype=torch.bfloat16, device=device)
        outputs = (result, None, None)
    if masked is None:
        pairs_topk = topk_idx.reshape(-1, 1)
    else:
        pairs_topk = torch.empty((num_pairs, 1), dtype=topk_idx.dtype, device=device)
    num_chunks = num_tokens * hidden // _CAST_CHANNELS
    scratch_words = 0 if scratch is None else scratch.numel()
    if num_chunks or scratch_words:
        blocks = max(1, min((num_chunks + _THREADS - 1) // _THREADS, _MAX_BLOCKS))
        _launch(CAST_KERNEL, blocks, _THREADS,
                (x, *outputs, topk_idx, masked, pairs_topk if masked is not None else None, num_tokens, hidden,
                 num_topk, bool(round_scale), num_local_experts, 0 if masked is None else masked.numel(), scratch,
                 scratch_words), device)
    return result, pairs_topk


def receive_layout_torch(ep_handle, recv, num_ranks: int, num_slots: int, num_topk: int,
                         masked: Optional[torch.Tensor], outputs: ReceiveOutputs) -> tuple:
    """The specification of `receive_layout`, in torch ops (any device)."""
    num_local_experts = ep_handle.num_local_experts
    num_rows = num_ranks * num_slots
    count, sources, ranges, row_expert, row_slot, row_kept = per_expert_layout(ep_handle, num_ranks, num_slots,
                                                                               num_topk, masked)
    outputs.recv_count.copy_(count)
    outputs.src_info.copy_(sources)
    outputs.layout_range.copy_(ranges)
    use_fp8 = outputs.scales_storage is not None
    place_rows(outputs.data_storage, recv[0] if use_fp8 else recv,
               row_targets(row_expert, row_slot, row_kept, num_local_experts, num_rows))
    if use_fp8:
        place_scales(outputs.scales_storage, recv[1], row_expert, row_slot, row_kept, num_local_experts, num_rows,
                     outputs.use_ue8m0)
    if outputs.stats is not None:
        outputs.stats.add_(outputs.recv_count)
    return row_expert, row_slot, row_kept


def _kernel_ready(ep_handle, rows: torch.Tensor, scales: Optional[torch.Tensor], masked: Optional[torch.Tensor],
                  outputs: ReceiveOutputs, num_rows: int) -> bool:
    """Whether the kernels take these tensors: on a CUDA device, rows in 16-byte chunks, 32-bit indices."""
    metadata = ep_handle.recv_src_metadata
    row_bytes = rows.shape[1] * rows.element_size()
    return (rows.device.type == "cuda" and rows.stride(1) == 1 and rows.data_ptr() % 16 == 0
            and rows.stride(0) * rows.element_size() % 16 == 0 and row_bytes % 16 == 0
            and metadata.dim() == 2 and metadata.shape[1] >= 3 and metadata.stride(1) == 1
            and ep_handle.psum_num_recv_tokens_per_expert.is_contiguous()
            and ep_handle.num_unaligned_recv_tokens_per_expert.is_contiguous()
            and outputs.data_storage.data_ptr() % 16 == 0
            and ep_handle.num_local_experts * num_rows < _INT32_LIMIT and ep_handle.num_expanded_tokens < _INT32_LIMIT
            and (scales is None or scales.dtype == torch.float32)
            and (masked is None or masked.dtype == torch.int32))


def receive_layout(ep_handle, recv, num_ranks: int, num_slots: int, num_topk: int, masked: Optional[torch.Tensor],
                   outputs: ReceiveOutputs) -> tuple:
    """Place the received pairs of the expanded pair dispatch into DeepEP's per-expert layout.

    Args:
        ep_handle: the pair dispatch's `EPHandle` (expanded, alignment 1, one expert per row; its
            ``recv_src_metadata`` written, i.e. the receive done).
        recv: the pair dispatch's received rows: bf16 ``[rows, H]``, or FP8 ``(data [rows, H],
            float32 scales [rows, H/128])``.
        num_ranks: R. num_slots: T_max. num_topk: K of the pairs (pair ``t * K + k`` of a rank).
        masked: int32 ``[R]`` rank mask (1: rows from that rank are left out) or None.
        outputs: where the layout goes (`ReceiveOutputs`); only the received rows of the storages are
            written.

    Returns:
        ``(row_expert int64 [rows], row_slot int64 [rows], row_kept bool [rows])``: every expanded
        row's place in the layout (`deep_ep.legacy.layouts.per_expert_layout`).

    The caller checks the arguments; on a CUDA device one kernel (two with a rank mask), elsewhere
    `receive_layout_torch`, equal bit for bit (rows past a count keep what they held).
    """
    num_local_experts = ep_handle.num_local_experts
    num_rows = num_ranks * num_slots
    use_fp8 = outputs.scales_storage is not None
    rows, scales = (recv[0], recv[1]) if use_fp8 else (recv, None)
    if not _kernel_ready(ep_handle, rows, scales, masked, outputs, num_rows):
        return receive_layout_torch(ep_handle, recv, num_ranks, num_slots, num_topk, masked, outputs)
    device = rows.device
    num_expanded = ep_handle.num_expanded_tokens
    metadata = ep_handle.recv_src_metadata
    ends = ep_handle.psum_num_recv_tokens_per_expert
    unaligned = ep_handle.num_unaligned_recv_tokens_per_expert
    max_pairs = num_slots * num_topk
    num_metadata_rows = metadata.shape[0]
    row_expert = torch.empty(num_expanded, dtype=torch.int64, device=device)
    row_slot = torch.empty(num_expanded, dtype=torch.int64, device=device)
    row_kept = torch.empty(num_expanded, dtype=torch.bool, device=device)
    row_chunks = rows.shape[1] * rows.element_size() // 16
    row_stride = rows.stride(0) * rows.element_size() // 16
    num_scales = scales.shape[1] if use_fp8 else 0
    scale_strides = (scales.stride(0), scales.stride(1)) if use_fp8 else (0, 0)
    blocks = max(1, min((num_metadata_rows + _WARPS - 1) // _WARPS, _MAX_BLOCKS))
    rows_args = (rows, jit.i64(row_stride), row_chunks, scales, jit.i64(scale_strides[0]), jit.i64(scale_strides[1]),
                 num_scales, bool(outputs.use_ue8m0), outputs.data_storage, outputs.scales_storage, outputs.src_info,
                 row_expert, row_slot, row_kept, num_expanded, num_ranks, num_local_experts, num_slots, num_topk,
                 max_pairs)
    if masked is None:
        # one launch: no row moves up, so the placement needs no count; the counts come together in
        # the scratch and the last block writes them out
        scratch = outputs.scratch
        if scratch is None or scratch.numel() != num_local_experts * num_ranks + 1:
            scratch = torch.zeros(num_local_experts * num_ranks + 1, dtype=torch.int32, device=device)
        _launch(PLACE_COUNTED_KERNEL, blocks, _THREADS,
                (metadata, metadata.stride(0), num_metadata_rows, ends, unaligned, scratch, outputs.recv_count,
                 outputs.layout_range, outputs.stats) + rows_args, device)
        return row_expert, row_slot, row_kept
    mask = masked.contiguous()
    slot_shift = torch.empty(num_local_experts * num_ranks, dtype=torch.int32, device=device)
    smem = (num_local_experts * num_ranks + num_local_experts) * 4
    _launch(COUNT_KERNEL, 1, _COUNT_THREADS,
            (metadata, metadata.stride(0), num_metadata_rows, ends, mask, outputs.recv_count, outputs.layout_range,
             slot_shift, outputs.stats, num_ranks, num_local_experts, max_pairs), device, smem)
    _launch(PLACE_KERNEL, blocks, _THREADS,
            (metadata, metadata.stride(0), num_metadata_rows, ends, unaligned, mask, slot_shift, outputs.recv_count)
            + rows_args, device)
    return row_expert, row_slot, row_kept
