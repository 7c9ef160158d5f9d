"""DeepEP's V1 low-latency layouts as torch ops on any device: the RDMA size hint, the FP8 cast, the
handle and the receive hook, and the per-expert receive layout from an expanded `ElasticBuffer`
dispatch of (token, top-k slot) pairs (`deep_ep.legacy.low_latency`), whose received rows and scales
(UE8M0-packed or not) are scattered into it: the work scales with the rows received, not the layout.
The cast, the pairs and the layout here specify the kernels of `deep_ep.legacy.ll_layout` bit for
bit, and are its path off the GPU."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import checks
from ..event import EventHandle, EventOverlap
from .exchange import settle

__all__ = ["LowLatencyHandle", "ReceiveHook", "host_reads_allowed", "low_latency_rdma_size_hint", "cast_to_fp8",
           "receive_storage", "scale_storage", "row_targets", "place_rows", "place_scales", "raw_bits", "per_pair",
           "per_expert_layout", "DispatchReceive", "dispatch_receive", "check_combine_inputs", "NUM_CHANNELS_PER_SCALE"]

NUM_CHANNELS_PER_SCALE = 128      # FP8 scales cover 128 channels of a token
FP8_MARGIN = 1e-4                 # the smallest amax a scale is computed from
FP8_MAX = 448.0                   # largest finite float8_e4m3fn
BUFFER_ALIGNMENT_BYTES = 128


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                               num_experts: int) -> int:
    """DeepEP's RDMA bytes of low-latency mode: two (send, receive, signal) buffer sets sized for BF16
    or FP8 dispatch messages and BF16 combine messages, rounded up past a multiple of 128."""
    num_scales = hidden // NUM_CHANNELS_PER_SCALE
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(num_max_dispatch_tokens_per_rank * dispatch_msg, num_experts * num_max_dispatch_tokens_per_rank *
               combine_msg)
    recv = num_experts * num_max_dispatch_tokens_per_rank * max(dispatch_msg, combine_msg)
    signal = -(-(num_experts * 4) // BUFFER_ALIGNMENT_BYTES) * BUFFER_ALIGNMENT_BYTES
    total = 2 * (send + recv + signal)
    return (total + BUFFER_ALIGNMENT_BYTES) // BUFFER_ALIGNMENT_BYTES * BUFFER_ALIGNMENT_BYTES


def _ceil_log2(values: torch.Tensor) -> torch.Tensor:
    """Exponent of the smallest power of two >= each positive normal float32 (exact, from the bits)."""
    bits = values.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(exponents: torch.Tensor) -> torch.Tensor:
    return ((exponents + 127) << 23).to(torch.int32).view(torch.float32)


def cast_to_fp8(x: torch.Tensor, round_scale: bool) -> tuple:
    """DeepEP's per-token, per-128-channel FP8 cast of bf16 ``[T, H]``.

    Returns ``(float8_e4m3fn [T, H], scale_inv float32 [T, H/128])``: amax is the channels' largest
    magnitude (at least 1e-4); ``scale_inv = amax * (1 / 448)`` and data ``x * (448 / amax)`` in float32
    (``round_scale``: ``scale_inv`` the power of two at or above ``amax * (1 / 448)``, data ``x /
    scale_inv``, exact), rounded to nearest, saturated to +-448.
    """
    num_tokens, hidden = x.shape
    values = x.float().view(num_tokens, hidden // NUM_CHANNELS_PER_SCALE, NUM_CHANNELS_PER_SCALE)
    amax = values.abs().amax(dim=-1).clamp(min=FP8_MARGIN)
    # full_like, not torch.tensor(..., device=): a fill kernel, which CUDA graph capture allows
    if round_scale:
        exponent = _ceil_log2(amax * torch.full_like(amax, 1.0 / FP8_MAX))
        scale, scale_inv = _pow2(-exponent), _pow2(exponent)
    else:
        scale_inv = amax * torch.full_like(amax, 1.0 / FP8_MAX)
        scale = torch.full_like(amax, FP8_MAX) / amax       # a true division (a scalar over a tensor is not)
    data = (values * scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(checks.FP8).view(num_tokens, hidden)
    return data, scale_inv.contiguous()


def receive_storage(num_local_experts: int, num_rows: int, hidden: int, dtype: torch.dtype,
                    device: torch.device) -> tuple:
    """A dispatch's receive rows: ``(storage [L * N + 1, H], view [L, N, H])``; the storage's last row
    is the spare that `place_rows` sends the rows without a place to."""
    storage = torch.empty((num_local_experts * num_rows + 1, hidden), dtype=dtype, device=device)
    return storage, storage[:-1].view(num_local_experts, num_rows, hidden)


def scale_storage(num_local_experts: int, num_rows: int, num_scales: int, use_ue8m0: bool,
                  device: torch.device) -> tuple:
    """A dispatch's received scales, DeepEP's layouts: ``(storage, view)``, the view float32 ``[L, N, S]``
    or (``use_ue8m0``) int32 ``[L, N, S/4]``, column-major in the last two dims; with UE8M0 byte ``j``
    (little-endian) of word ``p`` holds the biased exponent of scale ``4p + j``. The storage (flat) has
    one spare element (word) past the view for `place_scales`."""
    num_columns = num_scales // 4 if use_ue8m0 else num_scales
    storage = torch.empty(num_local_experts * num_columns * num_rows + 1,
                          dtype=torch.int32 if use_ue8m0 else torch.float32, device=device)
    view = storage[:-1].view(num_local_experts, num_columns, num_rows).transpose(1, 2)
    return storage, view


class DispatchReceive(NamedTuple):
    """What a V1 low-latency dispatch receives into, made before it is sent (uninitialised):
    ``recv_data`` bf16 or FP8 ``[L, N, H]`` over ``data_storage`` (`receive_storage`), with FP8
    ``recv_scales`` over ``scales_storage`` (`scale_storage`; else both None), ``recv_count`` int32
    ``[L]``, ``src_info`` int32 ``[L, N]`` and ``layout_range`` int64 ``[L, R]`` (N = R * T_max)."""
    recv_data: torch.Tensor
    data_storage: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    scales_storage: Optional[torch.Tensor]
    recv_count: torch.Tensor
    src_info: torch.Tensor
    layout_range: torch.Tensor

    def results(self, x: torch.Tensor, topk_idx: torch.Tensor, stats: Optional[torch.Tensor], handle,
                async_finish: bool, hook) -> tuple:
        """`deep_ep.Buffer.low_latency_dispatch`'s return: ``(recv_x, recv_count, handle, event, hook)``,
        ``recv_x`` the rows (with FP8 ``(rows, scales)``); with ``async_finish`` the event keeps the
        call's tensors (``x``, ``topk_idx``, the outputs, ``stats``) alive."""
        recv_x = (self.recv_data, self.recv_scales) if self.recv_scales is not None else self.recv_data
        event = EventOverlap(EventHandle(), (x, topk_idx, self.recv_data, self.recv_scales, self.recv_count,
                                             self.src_info, self.layout_range, stats)) \
            if async_finish else EventOverlap()
        return recv_x, self.recv_count, handle, event, hook


def dispatch_receive(num_local_experts: int, num_ranks: int, num_slots: int, hidden: int, use_fp8: bool,
                     use_ue8m0: bool, device: torch.device) -> DispatchReceive:
    """The `DispatchReceive` of a dispatch of ``num_slots`` (T_max) tokens per rank of ``hidden``
    channels, FP8 (scales as ``use_ue8m0`` says) or bf16, on ``device``."""
    num_rows = num_ranks * num_slots
    data_storage, recv_data = receive_storage(num_local_experts, num_rows, hidden,
                                              checks.FP8 if use_fp8 else torch.bfloat16, device)
    scales_storage = recv_scales = None
    if use_fp8:
        scales_storage, recv_scales = scale_storage(num_local_experts, num_rows, hidden // NUM_CHANNELS_PER_SCALE,
                                                    use_ue8m0, device)
    return DispatchReceive(recv_data, data_storage, recv_scales, scales_storage,
                           torch.empty(num_local_experts, dtype=torch.int32, device=device),
                           torch.empty((num_local_experts, num_rows), dtype=torch.int32, device=device),
                           torch.empty((num_local_experts, num_ranks), dtype=torch.int64, device=device))


def row_targets(row_expert: torch.Tensor, row_slot: torch.Tensor, row_kept: torch.Tensor, num_local_experts: int,
                num_rows: int) -> torch.Tensor:
    """int64 ``[rows]``: each expanded row's row in the flat ``[L * N]`` layout, ``L * N`` (the spare)
    for rows without a place."""
    return torch.where(row_kept, row_expert * num_rows + row_slot, num_local_experts * num_rows)


def place_rows(storage: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> None:
    """Scatter expanded rows ``[>= len(targets), H]`` into ``storage`` (`receive_storage`) bit for bit:
    only the rows received move; rows of the layout no row targets keep what they held."""
    raw_bits(storage).index_copy_(0, targets, raw_bits(rows)[:targets.numel()])


def place_scales(storage: torch.Tensor, scales: torch.Tensor, row_expert: torch.Tensor, row_slot: torch.Tensor,
                 row_kept: torch.Tensor, num_local_experts: int, num_rows: int, use_ue8m0: bool) -> None:
    """Scatter expanded float32 scales ``[>= rows, S]`` into ``storage`` (`scale_storage`): straight into
    the column-major layout, UE8M0 as exponent bytes; scales without a place go to the spare."""
    num_expanded = row_expert.numel()
    num_scales = scales.shape[1]
    scales = scales[:num_expanded]
    columns = torch.arange(num_scales, device=scales.device)
    if use_ue8m0:
        target = storage.view(torch.uint8)
        values = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        num_words = num_local_experts * (num_scales // 4) * num_rows
        base = (row_expert * (num_scales // 4) * num_rows + row_slot) * 4
        offsets = columns // 4 * num_rows * 4 + columns % 4
        spare = num_words * 4
    else:
        target, values = storage, scales
        base = row_expert * num_scales * num_rows + row_slot
        offsets = columns * num_rows
        spare = num_local_experts * num_scales * num_rows
    index = torch.where(row_kept.unsqueeze(1), base.unsqueeze(1) + offsets, spare)
    target.index_copy_(0, index.reshape(-1), values.reshape(-1))


class ReceiveHook:
    """A receive hook: the first call runs ``receive`` (the results become visible), a second call
    raises RuntimeError; ``release`` runs first, once (the V1 layer frees the call's buffer half).

    On a CUDA device its work goes to the stream that was current when the call made it (DeepEP's
    hook launches there too), whichever stream is current when it is called: that work reads what
    the call's kernels wrote on that stream."""

    def __init__(self, receive, name: str, device: torch.device, release=None) -> None:
        self._receive = receive
        self._release = release
        self._name = name
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def __call__(self) -> None:
        if self._receive is None:
            raise RuntimeError(f"the receive hook of this {self._name} was already called")
        receive, self._receive = self._receive, None
        release, self._release = self._release, None
        if release is not None:
            release()
        if self._stream is None:
            receive()
            return
        with torch.cuda.stream(self._stream):
            receive()


def host_reads_allowed(device: torch.device) -> bool:
    """Whether argument checks may read tensors on the host: always on CPU; on a CUDA device after
    the current stream's work is done (`deep_ep.legacy.exchange.settle`, so that no read blocks
    inside the driver), and never while a CUDA graph is being captured (the checks are skipped)."""
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    settle(device)
    return True


def check_combine_inputs(topk_idx: torch.Tensor, num_tokens: int, num_topk: int, num_experts: int,
                         out: Optional[torch.Tensor], hidden: int, device: torch.device) -> None:
    """A low-latency combine's ``topk_idx`` (the dispatch's shape ``[num_tokens, num_topk]``, ids below
    ``num_experts`` where `host_reads_allowed` on ``device``) and ``out`` (None or bf16
    ``[num_tokens, hidden]`` on ``device``).

    Raises:
        ValueError: a shape, an id, a dtype or a device that differs.
    """
    if tuple(topk_idx.shape) != (num_tokens, num_topk):
        raise ValueError(f"topk_idx must have the dispatch's shape [{num_tokens}, {num_topk}], got "
                         f"{list(topk_idx.shape)}")
    if host_reads_allowed(device):
        checks.check_topk_values(topk_idx, num_experts)
    if out is not None:
        checks.check_tensor("out", out, dtype=torch.bfloat16, shape=(num_tokens, hidden), device=device)


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle, the 5-tuple ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``, plus what its combine needs: the
    `EPHandle` of the pair dispatch behind it (``ep_handle``), the top-k width (``num_topk``), the
    buffer half (``slot``, 0 or 1) the dispatch used, which its combine uses too, and, for every
    expanded receive row of that dispatch, its place in the per-expert layout (``row_expert``,
    ``row_slot``: int64 ``[rows]``; ``row_kept``: bool ``[rows]``, False for rows left out by the rank
    mask, which go back as zeros). Those three are None until the dispatch's receive is done (with a
    receive hook: until the hook is called). ``mask``: the rank mask as the dispatch found it (int32
    ``[R]``, a copy; None without ``enable_shrink``, and for a dispatch of the direct kernels, whose
    combine follows ``direct.present``), which its combine uses."""

    def __new__(cls, items: tuple, ep_handle, num_topk: int, slot: int = 0):
        handle = super().__new__(cls, items)
        handle.ep_handle = ep_handle
        handle.num_topk = num_topk
        handle.slot = slot
        handle.row_expert = handle.row_slot = handle.row_kept = None
        handle.mask = None
        return handle

    def set_rows(self, row_expert: torch.Tensor, row_slot: torch.Tensor, row_kept: torch.Tensor) -> None:
        """Record every expanded row's place in the per-expert layout (`per_expert_layout`)."""
        self.row_expert, self.row_slot, self.row_kept = row_expert, row_slot, row_kept


def raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor (bf16 / fp8 rows move bit for bit through gathers)."""
    return tensor.view(torch.int16) if tensor.element_size() == 2 else tensor.view(torch.uint8) \
        if tensor.element_size() == 1 else tensor


def per_pair(rows: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Each row repeated ``num_topk`` times in a row (a copy through a broadcast view, no host sync)."""
    rows = raw_bits(rows)
    # contiguous(): with one row, reshape returns the broadcast view itself (row stride 0), not a copy
    return rows.unsqueeze(1).expand(rows.shape[0], num_topk, rows.shape[1]).reshape(-1, rows.shape[1]).contiguous()


def per_expert_layout(ep_handle, num_ranks: int, num_slots: int, num_topk: int,
                      masked: Optional[torch.Tensor] = None) -> tuple:
    """DeepEP's per-expert receive layout from the expanded pair dispatch's handle, device ops only.

    The pair dispatch sends ``(token, slot)`` pair ``p = t * K + k`` of rank ``s`` to the owner of its
    expert; its expanded receive rows are grouped by local expert, then ordered by ``(s, p)``, hence
    by ``(s, t)`` since a token names an expert once: DeepEP's order. ``masked``: int32 ``[R]``, the
    rank mask; rows from masked source ranks are left out (the later rows move up).

    Returns ``(recv_count int32 [L], src_info int32 [L, R*T_max] (-1 past the count), layout_range
    int64 [L, R], row_expert int64 [rows], row_slot int64 [rows], row_kept bool [rows])``: the last
    three give every expanded row's place in DeepEP's layout, and whether it has one. Nothing here is
    as large as the layout's rows times H.
    """
    num_local_experts = ep_handle.num_local_experts
    num_rows = num_ranks * num_slots
    max_pairs = num_slots * num_topk
    device = ep_handle.device
    metadata = ep_handle.recv_src_metadata.long()                      # [received pairs, 3]
    received = metadata[:, 0] >= 0
    source_rank = torch.where(received, metadata[:, 0] // max_pairs, 0)
    source_token = torch.where(received, metadata[:, 0] % max_pairs // num_topk, -1)
    expanded_row = metadata[:, 2]
    ends = ep_handle.psum_num_recv_tokens_per_expert.long()            # alignment 1: inclusive prefix sums
    starts = ends - ep_handle.num_unaligned_recv_tokens_per_expert.long()
    expert = torch.searchsorted(ends, expanded_row.clamp(min=0), right=True).clamp(max=num_local_experts - 1)
    slot = expanded_row - starts[expert]
    # per-expert tables, one spare entry taking what has no place
    pair_counts = torch.zeros(num_local_experts * num_ranks + 1, dtype=torch.int64, device=device)
    pair_counts.index_add_(0, torch.where(received, expert * num_ranks + source_rank, num_local_experts * num_ranks),
                           torch.ones_like(source_rank))
    pair_counts = pair_counts[:-1].view(num_local_experts, num_ranks)
    kept = received
    if masked is not None:
        dropped = masked.to(torch.bool)
        kept = received & ~dropped[source_rank]
        dropped_counts = torch.where(dropped.unsqueeze(0), pair_counts, 0)
        slot = slot - (dropped_counts.cumsum(1) - dropped_counts)[expert, source_rank]
        pair_counts = pair_counts - dropped_counts
    recv_count = pair_counts.sum(1).to(torch.int32)
    layout_range = ((pair_counts.cumsum(1) - pair_counts) << 32) | pair_counts
    flat = torch.where(kept, expert * num_rows + slot, num_local_experts * num_rows)
    src_info = torch.full((num_local_experts * num_rows + 1,), -1, dtype=torch.int32, device=device)
    src_info.index_copy_(0, flat, source_token.to(torch.int32))
    num_expanded = ep_handle.num_expanded_tokens
    target = torch.where(kept, expanded_row, num_expanded)
    row_expert = torch.zeros(num_expanded + 1, dtype=torch.int64, device=device).index_copy_(0, target, expert)
    row_slot = torch.zeros(num_expanded + 1, dtype=torch.int64, device=device).index_copy_(0, target, slot)
    row_kept = torch.zeros(num_expanded + 1, dtype=torch.bool, device=device).index_fill_(0, target, True)
    return (recv_count, src_info[:-1].view(num_local_experts, num_rows), layout_range, row_expert[:-1],
            row_slot[:-1], row_kept[:-1])
