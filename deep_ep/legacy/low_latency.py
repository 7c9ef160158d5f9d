"""DeepEP's V1 low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``) on the CPU backend.

Contract (docs/design.md, "DeepEP's V1 Buffer"): DeepEP's layouts exactly. A dispatch returns, per
local expert, ``num_ranks * num_max_dispatch_tokens_per_rank`` rows of which the first ``recv_count``
are valid, grouped by source rank in rank order, source tokens in order within a rank; FP8 is cast per
token and 128 channels with DeepEP's scale rule; the handle is ``(src_info, layout_range,
num_max_dispatch_tokens_per_rank, hidden, num_experts)``. A combine returns, per token, the top-k
weighted sum (float32, top-k slot order, one bf16 rounding) of the rows the experts send back.
Every rank exchanges fixed-size slots with every rank (gloo ``all_to_all_single``), as DeepEP's
RDMA buffers do. GPU tensors raise `NotImplementedError` (planned).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import checks
from ..event import EventHandle, EventOverlap
from .planned import _with_side_keywords, planned

__all__ = ["LowLatencyMethods", "low_latency_rdma_size_hint", "cast_to_fp8"]

NUM_CHANNELS_PER_SCALE = 128      # FP8 scales cover 128 channels of a token
FP8_MARGIN = 1e-4                 # the smallest amax a scale is computed from
FP8_MAX = 448.0                   # largest finite float8_e4m3fn
BUFFER_ALIGNMENT_BYTES = 128
HEADER_WORDS = 4                  # hidden, use_fp8, num_max_dispatch_tokens_per_rank, num_experts


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
    magnitude (at least 1e-4); ``scale_inv = amax / 448`` (``round_scale``: the power of two at or above
    it); data is ``x / scale_inv`` rounded to nearest, saturated to +-448.
    """
    num_tokens, hidden = x.shape
    values = x.float().view(num_tokens, hidden // NUM_CHANNELS_PER_SCALE, NUM_CHANNELS_PER_SCALE)
    amax = values.abs().amax(dim=-1).clamp(min=FP8_MARGIN)
    if round_scale:
        exponent = _ceil_log2(amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=amax.device))
        scale, scale_inv = _pow2(-exponent), _pow2(exponent)
    else:
        scale_inv = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=amax.device)
        scale = FP8_MAX / amax
    data = (values * scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(checks.FP8).view(num_tokens, hidden)
    return data, scale_inv.contiguous()


def _pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 powers of two ``[L, N, S]`` -> int32 ``[L, N, S/4]``, column-major in the last two
    dims, byte ``j`` (little-endian) of word ``p`` holding the biased exponent of scale ``4p + j``."""
    num_local_experts, num_rows, num_scales = scale_inv.shape
    exponents = ((scale_inv.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    words = exponents.view(num_local_experts, num_rows, num_scales // 4, 4).permute(0, 2, 1, 3).contiguous()
    return words.view(torch.int32).view(num_local_experts, num_scales // 4, num_rows).transpose(1, 2)


def _column_major(scales: torch.Tensor) -> torch.Tensor:
    return scales.transpose(1, 2).contiguous().transpose(1, 2)


class _Hook:
    """A receive hook: the first call makes the results visible, a second call raises RuntimeError."""

    def __init__(self, receive, name: str) -> None:
        self._receive = receive
        self._name = name

    def __call__(self) -> None:
        if self._receive is None:
            raise RuntimeError(f"the receive hook of this {self._name} was already called")
        receive, self._receive = self._receive, None
        receive()


def _exchange(group, send: torch.Tensor) -> torch.Tensor:
    """``all_to_all_single`` of equal blocks along dim 0 (raw bytes, so any dtype travels)."""
    raw = send.contiguous().view(torch.uint8)
    recv = torch.empty_like(raw)
    dist.all_to_all_single(recv, raw, group=group)
    return recv.view(send.dtype)


class LowLatencyMethods:
    """DeepEP's V1 low-latency methods (`deep_ep.Buffer` inherits them; CPU backend)."""

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """The RDMA bytes low-latency mode needs (``num_rdma_bytes`` of a low-latency `Buffer`),
        DeepEP's formula.

        Raises:
            TypeError / ValueError: non-int or non-positive arguments, ``hidden`` not a multiple of 128,
            ``num_experts`` not a multiple of ``num_ranks``.
        """
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            checks.check_int(name, value, minimum=1)
        if hidden % NUM_CHANNELS_PER_SCALE:
            raise ValueError(f"hidden={hidden} must be a multiple of {NUM_CHANNELS_PER_SCALE}")
        if num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
        return low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    # ------------------------------------------------------------------ checks and state
    def _low_latency_check(self, name: str, num_max_dispatch_tokens_per_rank: int, hidden: int,
                           num_experts: int) -> None:
        buffer = self._alive()
        if not self.low_latency_mode:
            raise RuntimeError(f"deep_ep.Buffer.{name} needs a Buffer made with low_latency_mode=True")
        if buffer.device.type != "cpu":
            planned(name, "low-latency kernels on the GPU")
        checks.check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
        checks.check_int("num_experts", num_experts, minimum=1)
        if hidden <= 0 or hidden % NUM_CHANNELS_PER_SCALE:
            raise ValueError(f"hidden={hidden} must be a positive multiple of {NUM_CHANNELS_PER_SCALE}")
        if num_experts % self.group_size:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the group size {self.group_size}")
        need = low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts)
        if need > self.num_rdma_bytes:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is less than the {need} bytes low-latency mode "
                             f"needs here (get_low_latency_rdma_size_hint({num_max_dispatch_tokens_per_rank}, "
                             f"{hidden}, {self.group_size}, {num_experts}))")

    def _combine_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> torch.Tensor:
        """The current (of two) zero-copy combine buffer: bf16 ``[L, R*T, hidden]`` with DeepEP's row
        stride (``hidden`` plus two bf16 per 128 channels)."""
        key = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        state = self.__dict__.setdefault("_low_latency_state", {"index": 0, "key": None, "buffers": None})
        if state["key"] != key:
            num_rows = self.group_size * num_max_dispatch_tokens_per_rank
            num_local_experts = num_experts // self.group_size
            row = hidden + 2 * (hidden // NUM_CHANNELS_PER_SCALE)
            state["buffers"] = [torch.zeros((num_local_experts, num_rows, row), dtype=torch.bfloat16, device="cpu")
                                for _ in range(2)]
            state["key"] = key
        return state["buffers"][state["index"]][:, :, :hidden]

    def _flip(self) -> None:
        state = self.__dict__.setdefault("_low_latency_state", {"index": 0, "key": None, "buffers": None})
        state["index"] ^= 1

    @staticmethod
    def _hook_flags(async_finish, return_recv_hook) -> tuple:
        async_finish = checks.check_bool("async_finish", async_finish)
        return_recv_hook = checks.check_bool("return_recv_hook", return_recv_hook)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (DeepEP's rule)")
        return async_finish, return_recv_hook

    def _check_stats(self, name: str, stats, dtype, size: int) -> None:
        if stats is not None:
            checks.check_tensor(name, stats, dtype=dtype, shape=(size,), device=self._alive().device)

    # ------------------------------------------------------------------ public methods
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the low-latency buffers (DeepEP needs it after normal-mode calls; here it zeroes the two
        zero-copy combine buffers, the only state kept between calls).

        Raises:
            RuntimeError: not a low-latency buffer. ValueError: bad sizes or too few ``num_rdma_bytes``.
            NotImplementedError: a GPU buffer (planned).
        """
        self._low_latency_check("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        for buffer in self._low_latency_state["buffers"]:
            buffer.zero_()

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The buffer the next `low_latency_combine` with ``zero_copy=True`` reads: bf16
        ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` (rows strided as
        DeepEP's), to be filled by the caller. Dispatch and combine alternate two such buffers.

        Raises:
            TypeError: not a low-latency handle. RuntimeError / ValueError / NotImplementedError: as
            `clean_low_latency_buffer`.
        """
        _, _, num_max_dispatch_tokens_per_rank, hidden, num_experts = self._unpack_handle(handle)
        self._low_latency_check("get_next_low_latency_combine_buffer", num_max_dispatch_tokens_per_rank, hidden,
                                num_experts)
        return self._combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, **side_branch_kwargs):
        """Send each token to every expert in its row of ``topk_idx`` (collective; every rank passes the
        same ``num_max_dispatch_tokens_per_rank``, ``num_experts``, hidden and ``use_fp8``).

        Args:
            x: bf16 ``[T, H]``, H a multiple of 128 (512 with ``use_ue8m0``), T <=
                ``num_max_dispatch_tokens_per_rank``.
            topk_idx: `deep_ep.topk_idx_t` ``[T, K]`` expert ids in ``[0, num_experts)`` or -1; a token
                names an expert at most once.
            num_max_dispatch_tokens_per_rank: T_max, the slots per (expert, source rank).
            num_experts: E, a multiple of the group size R; L = E / R local experts.
            cumulative_local_expert_recv_stats: optional int32 ``[L]``: the received counts are added.
            dispatch_wait_recv_cost_stats: optional int64 ``[R]`` (nothing waits on CPU: adds 0).
            use_fp8: cast to FP8 before sending. round_scale: power-of-two scales. use_ue8m0: scales
                as packed UE8M0 exponents (needs ``round_scale``).
            async_finish: return an event marking the end. return_recv_hook: the results are filled
                when the returned hook is called (once).

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``. ``recv_x``: bf16 ``[L, R*T_max, H]``; with
            ``use_fp8`` ``(float8_e4m3fn [L, R*T_max, H], scales)``, scales float32 ``[L, R*T_max,
            H/128]`` (scale_inv, column-major in the last two dims) or, with ``use_ue8m0``, int32
            ``[L, R*T_max, H/512]`` (four exponent bytes each, column-major). Rows past ``recv_count``
            are zero. ``recv_count`` int32 ``[L]``. ``handle``: ``(src_info int32 [L, R*T_max] (source
            token index, -1 past the count), layout_range int64 [L, R] (begin << 32 | count per source
            rank), T_max, H, E)``. ``hook``: a callable with ``return_recv_hook``, else None.

        Raises:
            TypeError / ValueError: bad arguments (before any communication); ValueError on every rank
            when ranks disagree on the sizes. RuntimeError: not a low-latency buffer.
            NotImplementedError: GPU tensors (planned), DeepEP's side-branch keywords.
        """
        if side_branch_kwargs:
            planned(_with_side_keywords("low_latency_dispatch", side_branch_kwargs))
        use_fp8 = checks.check_bool("use_fp8", use_fp8)
        round_scale = checks.check_bool("round_scale", round_scale)
        use_ue8m0 = checks.check_bool("use_ue8m0", use_ue8m0)
        async_finish, return_recv_hook = self._hook_flags(async_finish, return_recv_hook)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a bf16 torch.Tensor [T, hidden], got {type(x).__name__}")
        hidden = x.shape[-1] if x.dim() == 2 else -1
        self._low_latency_check("low_latency_dispatch", num_max_dispatch_tokens_per_rank, max(hidden, 128),
                                num_experts)
        device = self._alive().device
        checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None), device=device)
        if hidden % NUM_CHANNELS_PER_SCALE or hidden == 0:
            raise ValueError(f"x's hidden size {hidden} must be a positive multiple of {NUM_CHANNELS_PER_SCALE}")
        num_tokens = x.shape[0]
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise ValueError(f"x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_max_dispatch_tokens_per_rank}")
        checks.check_tensor("topk_idx", topk_idx, dtype=checks.topk_idx_t, shape=(num_tokens, None), device=device)
        checks.check_topk_values(topk_idx, num_experts)
        if topk_idx.shape[1] > 1:
            ordered = topk_idx.sort(dim=1).values
            repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
            if repeated.any():
                token = int(repeated.any(dim=1).nonzero()[0])
                raise ValueError(f"topk_idx row {token} names an expert twice: {topk_idx[token].tolist()}")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 scales are powers of two)")
        if use_fp8 and use_ue8m0 and hidden % (4 * NUM_CHANNELS_PER_SCALE):
            raise ValueError(f"use_ue8m0 packs four scales per int32: hidden={hidden} must be a multiple of 512")
        num_ranks = self.group_size
        num_local_experts = num_experts // num_ranks
        self._check_stats("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32,
                          num_local_experts)
        self._check_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, torch.int64, num_ranks)

        # The messages: source token index, then the data (bf16, or FP8 and float32 scale_inv).
        num_scales = hidden // NUM_CHANNELS_PER_SCALE
        if use_fp8:
            data, scale_inv = cast_to_fp8(x, round_scale)
            payload = torch.cat([data.view(torch.uint8), scale_inv.view(torch.uint8)], dim=1)
        else:
            payload = x.contiguous().view(torch.uint8)
        source_index = torch.arange(num_tokens, dtype=torch.int32, device="cpu").unsqueeze(1).view(torch.uint8)
        messages = torch.cat([source_index, payload], dim=1)
        num_slots = num_max_dispatch_tokens_per_rank
        send = torch.zeros((num_experts, num_slots, messages.shape[1]), dtype=torch.uint8, device="cpu")
        token_of_pair = torch.arange(num_tokens, device="cpu").repeat_interleave(topk_idx.shape[1])
        expert_of_pair = topk_idx.flatten()
        valid = expert_of_pair >= 0
        token_of_pair, expert_of_pair = token_of_pair[valid], expert_of_pair[valid]
        order = torch.sort(expert_of_pair, stable=True).indices      # by expert, then token
        token_of_pair, expert_of_pair = token_of_pair[order], expert_of_pair[order]
        sent_per_expert = torch.bincount(expert_of_pair, minlength=num_experts)
        group_start = torch.cumsum(sent_per_expert, 0) - sent_per_expert
        slot_of_pair = torch.arange(expert_of_pair.numel(), device=expert_of_pair.device) - group_start[expert_of_pair]
        send[expert_of_pair, slot_of_pair] = messages[token_of_pair]
        # Every rank's sizes first (fixed size, so a disagreement raises on every rank instead of
        # mismatching the exchanges), then expert e's counts and slots go to rank e / L.
        group = self.group
        header = torch.tensor([hidden, int(use_fp8), num_slots, num_experts], dtype=torch.int32, device="cpu")
        headers = _exchange(group, header.expand(num_ranks, HEADER_WORDS))
        if not bool((headers == header).all()):
            raise ValueError(f"deep_ep.Buffer.low_latency_dispatch: the ranks disagree on (hidden, use_fp8, "
                             f"num_max_dispatch_tokens_per_rank, num_experts): {headers.tolist()} by rank")
        counts = sent_per_expert.to(torch.int32).view(num_ranks, num_local_experts)
        recv_counts = _exchange(group, counts).T.contiguous()            # [L, source rank]
        recv_slots = _exchange(group, send).view(num_ranks, num_local_experts, num_slots, messages.shape[1])

        num_rows = num_ranks * num_slots
        recv_data = torch.zeros((num_local_experts, num_rows, hidden),
                                dtype=checks.FP8 if use_fp8 else torch.bfloat16, device="cpu")
        scale_rows = torch.zeros((num_local_experts, num_rows, num_scales), dtype=torch.float32, device="cpu")
        recv_count = torch.zeros(num_local_experts, dtype=torch.int32, device="cpu")
        src_info = torch.full((num_local_experts, num_rows), -1, dtype=torch.int32, device="cpu")
        layout_range = torch.zeros((num_local_experts, num_ranks), dtype=torch.int64, device="cpu")
        recv_scales = None
        if use_fp8:
            recv_scales = _pack_ue8m0(scale_rows) if use_ue8m0 else _column_major(scale_rows)

        def receive() -> None:
            data_bytes = hidden * (1 if use_fp8 else 2)
            begins = torch.cumsum(recv_counts, 1) - recv_counts
            for local_expert in range(num_local_experts):
                for source in range(num_ranks):
                    count, begin = int(recv_counts[local_expert, source]), int(begins[local_expert, source])
                    layout_range[local_expert, source] = (begin << 32) | count
                    block = recv_slots[source, local_expert, :count]
                    src_info[local_expert, begin:begin + count] = block[:, :4].contiguous().view(torch.int32)[:, 0]
                    rows = block[:, 4:4 + data_bytes].contiguous()
                    recv_data[local_expert, begin:begin + count] = rows.view(recv_data.dtype)
                    if use_fp8:
                        scale_rows[local_expert, begin:begin + count] = \
                            block[:, 4 + data_bytes:].contiguous().view(torch.float32)
            recv_count.copy_(recv_counts.sum(1, dtype=torch.int32))
            if use_fp8:
                recv_scales.copy_(_pack_ue8m0(scale_rows) if use_ue8m0 else scale_rows)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count)

        self._flip()
        hook = _Hook(receive, "low_latency_dispatch") if return_recv_hook else None
        if not return_recv_hook:
            receive()
        recv_x = (recv_data, recv_scales) if use_fp8 else recv_data
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        event = EventOverlap(EventHandle(), (x, topk_idx, recv_data, recv_scales, recv_count, src_info, layout_range,
                                             cumulative_local_expert_recv_stats)) if async_finish else EventOverlap()
        return recv_x, recv_count, handle, event, hook

    def _unpack_handle(self, handle) -> tuple:
        if not (isinstance(handle, tuple) and len(handle) == 5 and isinstance(handle[0], torch.Tensor)
                and isinstance(handle[1], torch.Tensor) and all(isinstance(v, int) for v in handle[2:])):
            raise TypeError("handle must be the (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, "
                            f"num_experts) tuple low_latency_dispatch returned, got {type(handle).__name__}")
        return handle

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None, **side_branch_kwargs):
        """Send each expert's rows back to their source ranks and reduce them there with the top-k
        weights (collective): ``combined[t] = sum_k topk_weights[t, k] * row(t, topk_idx[t, k])`` in
        float32, slots in order, -1 slots skipped, rounded once to bf16.

        Args:
            x: bf16 ``[L, R*T_max, H]`` contiguous, rows as `low_latency_dispatch` returned them (rows
                past ``recv_count`` are not read).
            topk_idx: `deep_ep.topk_idx_t` ``[T, K]``, the dispatch's (ids may be masked to -1).
            topk_weights: float32 ``[T, K]``.
            handle: the dispatch's handle on this rank.
            use_logfmt: must be False (NotImplementedError). zero_copy: read the rows from
                `get_next_low_latency_combine_buffer` instead of ``x``. async_finish,
                return_recv_hook: as in `low_latency_dispatch`.
            out: optional bf16 ``[T, H]`` contiguous, written and returned.
            combine_wait_recv_cost_stats: optional int64 ``[R]`` (adds 0 on CPU).

        Returns:
            ``(combined_x bf16 [T, H], event, hook)``.

        Raises:
            TypeError / ValueError: bad arguments (before any communication). RuntimeError: not a
            low-latency buffer. NotImplementedError: ``use_logfmt``, GPU tensors, side-branch keywords.
        """
        if side_branch_kwargs:
            planned(_with_side_keywords("low_latency_combine", side_branch_kwargs))
        if checks.check_bool("use_logfmt", use_logfmt):
            planned("low_latency_combine(use_logfmt=True)", "LogFMT combine messages")
        zero_copy = checks.check_bool("zero_copy", zero_copy)
        async_finish, return_recv_hook = self._hook_flags(async_finish, return_recv_hook)
        src_info, layout_range, num_slots, hidden, num_experts = self._unpack_handle(handle)
        self._low_latency_check("low_latency_combine", num_slots, hidden, num_experts)
        device = self._alive().device
        num_ranks = self.group_size
        num_local_experts = num_experts // num_ranks
        num_rows = num_ranks * num_slots
        checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(num_local_experts, num_rows, hidden), device=device)
        checks.check_tensor("topk_idx", topk_idx, dtype=checks.topk_idx_t, shape=(None, None), device=device)
        num_tokens, num_topk = topk_idx.shape
        if num_tokens > num_slots:
            raise ValueError(f"topk_idx has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_slots}")
        checks.check_topk_values(topk_idx, num_experts)
        checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, num_topk),
                            device=device)
        checks.check_tensor("src_info (handle[0])", src_info, dtype=torch.int32, shape=(num_local_experts, num_rows),
                            device=device)
        checks.check_tensor("layout_range (handle[1])", layout_range, dtype=torch.int64,
                            shape=(num_local_experts, num_ranks), device=device)
        if out is not None:
            checks.check_tensor("out", out, dtype=torch.bfloat16, shape=(num_tokens, hidden), device=device)
        self._check_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64, num_ranks)
        rows = self._combine_buffer(num_slots, hidden, num_experts) if zero_copy else x

        # Rank s gets, per local expert, its tokens' rows at their source token index.
        send = torch.zeros((num_ranks, num_local_experts, num_slots, hidden), dtype=torch.bfloat16, device="cpu")
        counts, begins = layout_range & 0xFFFFFFFF, layout_range >> 32
        for local_expert in range(num_local_experts):
            for source in range(num_ranks):
                count, begin = int(counts[local_expert, source]), int(begins[local_expert, source])
                tokens = src_info[local_expert, begin:begin + count].long()
                send[source, local_expert, tokens] = rows[local_expert, begin:begin + count]
        recv = _exchange(self.group, send.view(torch.int16)).view(torch.bfloat16)
        recv = recv.view(num_experts, num_slots, hidden)              # by global expert id

        combined_x = out if out is not None else torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device="cpu")

        def receive() -> None:
            total = torch.zeros((num_tokens, hidden), dtype=torch.float32, device="cpu")
            token_ids = torch.arange(num_tokens, device="cpu")
            for slot in range(num_topk):
                experts = topk_idx[:, slot]
                selected = experts >= 0
                gathered = recv[experts.clamp(min=0), token_ids].float()
                weight = torch.where(selected, topk_weights[:, slot], 0.0)
                total += torch.where(selected.unsqueeze(1), gathered * weight.unsqueeze(1), 0.0)
            combined_x.copy_(total.to(torch.bfloat16))

        self._flip()
        hook = _Hook(receive, "low_latency_combine") if return_recv_hook else None
        if not return_recv_hook:
            receive()
        event = EventOverlap(EventHandle(), (x, topk_idx, topk_weights, src_info, layout_range, combined_x)) \
            if async_finish else EventOverlap()
        return combined_x, event, hook
