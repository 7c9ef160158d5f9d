"""DeepEP's V1 low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``) on the
`ElasticBuffer` of a `deep_ep.Buffer`: the CPU backend over gloo, or the GPU (one node, NVLink, or
emulated ranks), through the same code.

Contract (docs/design.md, "DeepEP's V1 Buffer"): DeepEP's layouts exactly. A dispatch returns, per
local expert, ``num_ranks * num_max_dispatch_tokens_per_rank`` rows of which the first ``recv_count``
are valid, grouped by source rank in rank order, source tokens in order within a rank; FP8 is cast per
token and 128 channels with DeepEP's scale rule; the handle is ``(src_info, layout_range,
num_max_dispatch_tokens_per_rank, hidden, num_experts)``. A combine returns, per token, the top-k
weighted sum (float32, top-k slot order, one bf16 rounding) of the rows the experts send back.

How: every (token, top-k slot) pair is one row of an expanded `ElasticBuffer.dispatch` without host
synchronisation (DeepEP sends one message per pair too), and comes back alone through
`ElasticBuffer.combine`. Around the pair dispatch, `deep_ep.legacy.ll_layout` casts and repeats the
rows (one kernel) and places the received rows into DeepEP's layouts (one kernel, two with a rank
mask; their work scales with the rows received); around the pair combine, `deep_ep.legacy.ll_reduce` gathers the received
pairs' rows from the per-expert layout (one kernel) and sums the pairs that come back with their
weights (one kernel); on the CPU the torch ops that specify those kernels run instead. Host reads remain only in
argument checks (skipped while a CUDA graph is captured).

Receive hooks (``return_recv_hook=True``) on the GPU: the call launches the send half of its data
kernel (`deep_ep.legacy.deferred`) and returns; the hook launches the receive half (the wait for the
peers' rows) and the layout work that reads it. Between the two no kernel of the call holds an SM;
a dispatch's notify kernel (the counts exchange) runs in the call and holds its SMs until every
peer's counts are in. Double buffering as DeepEP's: two buffer halves (on the GPU, two windows),
a dispatch takes a half no pending hook holds, preferring one whose last dispatch was combined (two
micro-batches interleave), and its combine takes the dispatch's; a call
that finds no free half (two results alive), or its half held, raises `RuntimeError` before any
communication, as does a combine before its dispatch's hook. On the CPU the data moves during the
call (the hook writes the results), with the same rules.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import checks
from ..event import EventHandle, EventOverlap
from .layouts import (NUM_CHANNELS_PER_SCALE, LowLatencyHandle, check_combine_inputs, dispatch_receive,
                      host_reads_allowed, low_latency_rdma_size_hint)
from . import ll_direct
from .deferred import launch_receive, send_combine, send_dispatch
from .exchange import settle
from .ll_layout import ReceiveOutputs, cast_pairs, count_scratch, receive_layout
from .ll_reduce import gather_rows, weighted_sum
from .ll_state import LowLatencyState, release_on_error
from .planned import planned, refuse_side_keywords

__all__ = ["LowLatencyMethods"]

class LowLatencyMethods(LowLatencyState):
    """DeepEP's V1 low-latency methods (`deep_ep.Buffer` inherits them), on the `ElasticBuffer` of
    the `Buffer` (CPU backend, or the GPU through `_low_latency_elastic_buffer`)."""

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int, *, eager_support: bool = False) -> int:
        """The RDMA bytes low-latency mode needs (``num_rdma_bytes`` of a low-latency `Buffer`),
        DeepEP's formula.

        Raises:
            TypeError / ValueError: non-int or non-positive arguments, ``hidden`` not a multiple of 128,
            ``num_experts`` not a multiple of ``num_ranks``. NotImplementedError: ``eager_support``
            (a keyword of DeepEP's side branches) set.
        """
        refuse_side_keywords("get_low_latency_rdma_size_hint", {"eager_support": eager_support})
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            checks.check_int(name, value, minimum=1)
        if hidden % NUM_CHANNELS_PER_SCALE:
            raise ValueError(f"hidden={hidden} must be a multiple of {NUM_CHANNELS_PER_SCALE}")
        if num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
        return low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    # ------------------------------------------------------------------ rank masks
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank for this rank's low-latency calls: this rank sends
        nothing to a masked rank and takes nothing from it (its rows are left out of the dispatch's
        layout, its experts' slots add nothing in combine). The mask is this rank's own (DeepEP's).
        A dispatch uses the mask as it was when called and its combine follows the dispatch, so a
        change takes effect at the next dispatch. On a GPU within one node (the direct kernels) a
        masked rank is not waited for, and a peer that does not arrive within
        ``num_gpu_timeout_secs`` is masked by the waiting rank instead of failing the call (DeepEP's
        failure detection: the peer is taken as failed and must be stopped; the waiting ranks' masks
        show it, and the combines of earlier dispatches leave it out too; unmasking it forgets
        that); a rank that skipped calls cannot rejoin this Buffer (its calls are counted behind its
        peers'). Unmask a rank only while no low-latency call of any rank is in flight (a rank
        that took up a peer again would write rows the peer may still be reading). On the CPU
        backend, across nodes and past the direct kernels' limits (1024 experts, top-16, 512
        ranks, 65535 tokens per rank), a masked rank must still make every call. A device write on
        the current stream, no host read.

        Raises:
            RuntimeError: no ``enable_shrink``. TypeError / ValueError: ``rank_to_mask`` outside
            ``[0, group_size)``, ``mask`` not a bool.
        """
        self._shrink_mask("low_latency_update_mask_buffer")
        checks.check_int("rank_to_mask", rank_to_mask, minimum=0, maximum=self.group_size - 1)
        if checks.check_bool("mask", mask):
            self._rank_state[rank_to_mask] = 1
        else:     # unmasked: no longer taken as failed either
            self._rank_state[rank_to_mask::self.group_size] = 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask into ``mask_status`` (int32 ``[group_size]`` on the buffer's device; 1 =
        masked), on the current stream.

        Raises:
            RuntimeError: no ``enable_shrink``. TypeError / ValueError: a bad ``mask_status``.
        """
        rank_mask = self._shrink_mask("low_latency_query_mask_buffer")
        checks.check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,),
                            device=self._alive().device)
        mask_status.copy_(rank_mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (and forget the ranks taken as failed). Raises RuntimeError without
        ``enable_shrink``."""
        self._shrink_mask("low_latency_clean_mask_buffer")
        self._rank_state.zero_()

    # ------------------------------------------------------------------ public methods
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """DeepEP's view of its local NVLink (or, ``use_rdma_buffer``, RDMA) buffer as ``dtype``: here a
        tensor of ``num_nvl_bytes`` (``num_rdma_bytes``) bytes on the buffer's device, kept by the
        Buffer and made on first use, which deep_ep's kernels do not read: callers that zero or fill
        it (vLLM zeroes the RDMA one) change nothing in the communication.

        Returns:
            ``dtype [(bytes - offset) / itemsize]`` from byte ``offset``, or the first
            ``size.numel()`` of those as ``size``.

        Raises:
            TypeError / ValueError: a bad ``dtype``, ``offset`` (negative, past the end, not a multiple of
            the item size) or a ``size`` larger than what is left.
        """
        device = self._alive().device
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        use_rdma_buffer = checks.check_bool("use_rdma_buffer", use_rdma_buffer)
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        checks.check_int("offset", offset, minimum=0, maximum=num_bytes)
        item_size = torch.empty(0, dtype=dtype, device="cpu").element_size()
        if offset % item_size:
            raise ValueError(f"offset={offset} must be a multiple of {dtype}'s {item_size} bytes")
        key = "_local_rdma_bytes" if use_rdma_buffer else "_local_nvl_bytes"
        storage = self.__dict__.get(key)
        if storage is None:
            storage = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
            self.__dict__[key] = storage
        tensor = storage[offset:offset + (num_bytes - offset) // item_size * item_size].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > tensor.numel():
            raise ValueError(f"size {list(size)} holds {size.numel()} elements, more than the {tensor.numel()} "
                             f"left from offset {offset}")
        return tensor[:size.numel()].view(size)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the low-latency buffers (DeepEP needs it after normal-mode calls; here it zeroes the two
        zero-copy combine buffers, the only state kept between calls, where they exist: they are made
        zeroed on first use, so a clean allocates nothing; buffers of other sizes are dropped).

        Raises:
            RuntimeError: not a low-latency buffer. ValueError: bad sizes or too few ``num_rdma_bytes``.
        """
        self._low_latency_check("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden, num_experts)
        state = self.__dict__.get("_low_latency_state")
        if state is not None and state["key"] == (num_max_dispatch_tokens_per_rank, hidden, num_experts):
            for buffer in state["buffers"]:
                buffer.zero_()
        elif state is not None:                    # other sizes: made again, zeroed, on first use
            state["key"], state["buffers"] = None, None

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The buffer the next `low_latency_combine` with ``zero_copy=True`` reads: bf16
        ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` (rows strided as
        DeepEP's), to be filled by the caller. Dispatch and combine alternate two such buffers.

        Raises:
            TypeError: not a low-latency handle. RuntimeError / ValueError: as `clean_low_latency_buffer`.
        """
        _, _, num_max_dispatch_tokens_per_rank, hidden, num_experts = self._unpack_handle(handle)
        self._low_latency_check("get_next_low_latency_combine_buffer", num_max_dispatch_tokens_per_rank, hidden,
                                num_experts)
        return self._combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @release_on_error
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, *, topk_weights=None,
                             x_global_scale=None, use_nvfp4: bool = False, use_ue8m0_for_sf: bool = False,
                             use_eager: bool = False):
        """Send each token to every expert in its row of ``topk_idx`` (collective; every rank passes the
        same ``num_max_dispatch_tokens_per_rank``, ``num_experts``, hidden, top-k width K and
        ``use_fp8``; unlike DeepEP, K too, as it sizes the pair dispatch underneath: the CPU backend
        raises on every rank, naming ``num_max_tokens_per_rank`` = ``T_max * K``).

        Args:
            x: bf16 ``[T, H]``, H a multiple of 128 (512 with ``use_ue8m0``), T <=
                ``num_max_dispatch_tokens_per_rank``.
            topk_idx: `deep_ep.topk_idx_t` ``[T, K]`` expert ids in ``[0, num_experts)`` or -1; a token
                names an expert at most once.
            num_max_dispatch_tokens_per_rank: T_max, the slots per (expert, source rank).
            num_experts: E, a multiple of the group size R; L = E / R local experts.
            cumulative_local_expert_recv_stats: optional int32 ``[L]``: the received counts are added.
            dispatch_wait_recv_cost_stats: optional int64 ``[R]`` (not measured: adds 0).
            use_fp8: cast to FP8 before sending. round_scale: power-of-two scales. use_ue8m0: scales
                as packed UE8M0 exponents (needs ``round_scale``).
            async_finish: return an event marking the end. return_recv_hook: return once the rows are
                sent; the returned hook (called once) receives them and writes the results, on the
                stream current at this call. On the GPU the call's kernels are the notify kernel
                (which waits for the peers' counts) and the send half; the hook's the receive half
                (which waits for the peers' rows): in between none holds an SM. The call holds one of
                two buffer halves until its hook is called (every rank passes the same flag).
            topk_weights, x_global_scale, use_nvfp4, use_ue8m0_for_sf, use_eager: keywords of DeepEP's
                side branches (`deep_ep.legacy.planned.SIDE_BRANCH_KEYWORDS`): only their defaults.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``. ``recv_x``: bf16 ``[L, R*T_max, H]``; with
            ``use_fp8`` ``(float8_e4m3fn [L, R*T_max, H], scales)``, scales float32 ``[L, R*T_max,
            H/128]`` (scale_inv, column-major in the last two dims) or, with ``use_ue8m0``, int32
            ``[L, R*T_max, H/512]`` (four exponent bytes each, column-major). Rows past
            ``recv_count`` and their scales are undefined (as DeepEP's: only the received rows are
            written). ``recv_count`` int32 ``[L]``. ``handle``: a `LowLatencyHandle`, the tuple
            ``(src_info int32 [L, R*T_max] (source token index, -1 past the count), layout_range int64
            [L, R] (begin << 32 | count per source rank), T_max, H, E)``. ``hook``: a callable with
            ``return_recv_hook``, else None.

        Raises:
            TypeError / ValueError: bad arguments (before any communication). RuntimeError: not a
            low-latency buffer; both buffer halves held by pending receive hooks (two results
            alive: call one of them first); on every rank, ranks that disagree on the sizes.
            NotImplementedError: DeepEP's side-branch keywords.
        """
        refuse_side_keywords("low_latency_dispatch", {
            "topk_weights": topk_weights, "x_global_scale": x_global_scale, "use_nvfp4": use_nvfp4,
            "use_ue8m0_for_sf": use_ue8m0_for_sf, "use_eager": use_eager})
        use_fp8 = checks.check_bool("use_fp8", use_fp8)
        round_scale = checks.check_bool("round_scale", round_scale)
        use_ue8m0 = checks.check_bool("use_ue8m0", use_ue8m0)
        async_finish, return_recv_hook = self._hook_flags(async_finish, return_recv_hook)
        self._refuse_hooks_over_gin(return_recv_hook)
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
                             f"{num_max_dispatch_tokens_per_rank}: raise it (and num_rdma_bytes) or split the batch")
        checks.check_tensor("topk_idx", topk_idx, dtype=checks.topk_idx_t, shape=(num_tokens, None), device=device)
        num_topk = topk_idx.shape[1]
        if num_topk == 0:
            raise ValueError("topk_idx must have at least one column")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 scales are powers of two)")
        if use_fp8 and use_ue8m0 and hidden % (4 * NUM_CHANNELS_PER_SCALE):
            raise ValueError(f"use_ue8m0 packs four scales per int32: hidden={hidden} must be a multiple of 512")
        num_ranks = self.group_size
        num_local_experts = num_experts // num_ranks
        self._check_stats("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32,
                          num_local_experts)
        self._check_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, torch.int64, num_ranks)
        if host_reads_allowed(device):
            checks.check_topk_values(topk_idx, num_experts)
            if num_topk > 1:
                ordered = topk_idx.sort(dim=1).values
                repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
                any_repeated = repeated.any()
                settle(device)                     # the read below then never waits inside the driver
                if any_repeated:
                    token = int(repeated.any(dim=1).nonzero()[0])
                    raise ValueError(f"topk_idx row {token} names an expert twice: {topk_idx[token].tolist()}")

        if ll_direct.applies(self, device, num_experts, num_topk, num_max_dispatch_tokens_per_rank):
            return ll_direct.dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                                      round_scale, use_ue8m0, async_finish, return_recv_hook,
                                      cumulative_local_expert_recv_stats)
        self._load_low_latency_kernels(device)     # its combine's and its own, before any launch or capture
        # One (token, slot) pair per row, each routed to its expert alone: the expanded receive is
        # then DeepEP's per-expert layout, and combine returns every pair's row unreduced.
        num_slots = num_max_dispatch_tokens_per_rank
        max_pairs = num_slots * num_topk
        half = self._free_half("low_latency_dispatch")
        buffer = self._low_latency_elastic_buffer(max_pairs, hidden, half)
        # nothing goes to a masked rank; the mask of the call (a copy), whenever the hook runs, and
        # of its combine
        masked = self._mask_if_shrink()
        masked = None if masked is None else masked.clone()
        # the receive layout's counts without a mask, zeroed by the cast (no launch of its own)
        scratch = count_scratch(num_local_experts, num_ranks, device) \
            if masked is None and device.type == "cuda" else None
        pairs_x, pairs_topk = cast_pairs(x, topk_idx, use_fp8, round_scale, masked, num_local_experts, scratch)
        deferred = None
        if return_recv_hook and device.type == "cuda":    # the send half now, the receive half in the hook
            recv, ep_handle, deferred = send_dispatch(buffer, pairs_x, pairs_topk, num_experts, max_pairs,
                                                      self._low_latency_num_sms(device))
        else:
            try:
                recv, _, _, ep_handle, _ = buffer.dispatch(
                    pairs_x, topk_idx=pairs_topk, num_experts=num_experts, num_max_tokens_per_rank=max_pairs,
                    expert_alignment=1, num_sms=self._low_latency_num_sms(device), do_expand=True,
                    do_cpu_sync=False)
            except RuntimeError as exc:
                if "disagree on num_max_tokens_per_rank" not in str(exc):
                    raise
                raise RuntimeError(
                    f"low_latency_dispatch: ranks disagree on num_max_dispatch_tokens_per_rank or the top-k width "
                    f"(this rank: {num_max_dispatch_tokens_per_rank} and {num_topk}); every rank must pass the same. "
                    f"The pair dispatch underneath, sized by their product ({max_pairs} here), reported: {exc}") from None

        received = dispatch_receive(num_local_experts, num_ranks, num_slots, hidden, use_fp8, use_ue8m0, device)
        outputs = ReceiveOutputs(received.recv_count, received.src_info, received.layout_range,
                                 received.data_storage, received.scales_storage, use_ue8m0,
                                 cumulative_local_expert_recv_stats, scratch)
        handle = LowLatencyHandle((received.src_info, received.layout_range, num_slots, hidden, num_experts),
                                  ep_handle, num_topk, half)
        handle.number = self._mark_dispatched(half)   # which half its combine finds waiting
        handle.mask = masked

        def receive() -> None:
            if deferred is not None:
                launch_receive(buffer, deferred)
            # The layout reads the handle's recv_src_metadata, which the receive writes; only the
            # received rows move (rows past a count are left as they were, as DeepEP's).
            handle.set_rows(*receive_layout(ep_handle, recv, num_ranks, num_slots, num_topk, masked, outputs))

        hook = self._receive_or_hook(receive, "low_latency_dispatch", device, half, return_recv_hook)
        return received.results(x, topk_idx, cumulative_local_expert_recv_stats, handle, async_finish, hook)

    def _unpack_handle(self, handle) -> tuple:
        if not (isinstance(handle, tuple) and len(handle) == 5 and isinstance(handle[0], torch.Tensor)
                and isinstance(handle[1], torch.Tensor) and all(isinstance(v, int) for v in handle[2:])):
            raise TypeError("handle must be the (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, "
                            f"num_experts) tuple low_latency_dispatch returned, got {type(handle).__name__}")
        return handle

    @release_on_error
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None, *, overlap: bool = False,
                            packed_recv_count=None, comp_signal=None, block_m: int = 64, threshold: int = 0,
                            num_sms: int = 3, src_signals=None, src_signal_expect_value: int = 0,
                            use_eager: bool = False):
        """Send each expert's rows back to their source ranks and reduce them there with the top-k
        weights (collective): ``combined[t] = sum_k topk_weights[t, k] * row(t, topk_idx[t, k])`` in
        float32, slots in order, -1 slots skipped, rounded once to bf16.

        Args:
            x: bf16 ``[L, R*T_max, H]``, rows as `low_latency_dispatch` returned them (rows past
                ``recv_count`` are not read).
            topk_idx: `deep_ep.topk_idx_t` ``[T, K]``, the dispatch's (ids may be masked to -1).
            topk_weights: float32 ``[T, K]``.
            handle: the dispatch's handle on this rank.
            use_logfmt: must be False (NotImplementedError). zero_copy: read the rows from
                `get_next_low_latency_combine_buffer` instead of ``x``. async_finish,
                return_recv_hook: as in `low_latency_dispatch`.
            out: optional bf16 ``[T, H]`` contiguous, written and returned.
            combine_wait_recv_cost_stats: optional int64 ``[R]`` (not measured: adds 0).
            overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms, src_signals,
                src_signal_expect_value, use_eager: keywords of DeepEP's side branches
                (`deep_ep.legacy.planned.SIDE_BRANCH_KEYWORDS`): only their defaults.

        Returns:
            ``(combined_x bf16 [T, H], event, hook)``.

        Raises:
            TypeError / ValueError: bad arguments (before any communication). RuntimeError: not a
            low-latency buffer; the dispatch's receive hook not called yet; the dispatch's buffer half
            held by another pending receive hook (call it first). NotImplementedError:
            ``use_logfmt``, side-branch keywords.
        """
        refuse_side_keywords("low_latency_combine", {
            "overlap": overlap, "packed_recv_count": packed_recv_count, "comp_signal": comp_signal, "block_m": block_m,
            "threshold": threshold, "num_sms": num_sms, "src_signals": src_signals,
            "src_signal_expect_value": src_signal_expect_value, "use_eager": use_eager})
        if checks.check_bool("use_logfmt", use_logfmt):
            planned("low_latency_combine(use_logfmt=True)", "LogFMT combine messages")
        zero_copy = checks.check_bool("zero_copy", zero_copy)
        async_finish, return_recv_hook = self._hook_flags(async_finish, return_recv_hook)
        self._refuse_hooks_over_gin(return_recv_hook)
        src_info, layout_range, num_slots, hidden, num_experts = self._unpack_handle(handle)
        self._low_latency_check("low_latency_combine", num_slots, hidden, num_experts)
        device = self._alive().device
        num_ranks = self.group_size
        num_local_experts = num_experts // num_ranks
        num_rows = num_ranks * num_slots
        checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(num_local_experts, num_rows, hidden), device=device,
                            contiguous=False)
        checks.check_tensor("topk_idx", topk_idx, dtype=checks.topk_idx_t, shape=(None, None), device=device)
        num_tokens, num_topk = topk_idx.shape
        if num_tokens > num_slots:
            raise ValueError(f"topk_idx has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_slots} of the dispatch that made the handle; pass that dispatch's topk_idx")
        checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, num_topk),
                            device=device)
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError("handle must be the handle low_latency_dispatch returned (passed back as it is), got a "
                            f"{type(handle).__name__} rebuilt from its items")
        if handle.row_expert is None:
            raise RuntimeError("low_latency_combine: the receive hook of the low_latency_dispatch that made this "
                               "handle was not called yet; call it first (its results are not there before)")
        holder = self._pending_hooks()[handle.slot]
        if holder is not None:
            raise RuntimeError(f"low_latency_combine: the buffer half of this handle's dispatch is held by a {holder} "
                               f"whose receive hook was not called yet: at most two low-latency results can be "
                               f"alive (DeepEP's double buffering); call that hook first. Nothing was sent")
        if getattr(handle, "direct", None) is not None:
            return ll_direct.combine(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                                     return_recv_hook, out)
        self._mark_combined(handle)
        ep_handle = handle.ep_handle
        buffer = next((b for b in self._low_latency_buffers() if b.buffer_id == ep_handle.buffer_id), self._alive())
        ep_handle.check_matches(buffer_id=buffer.buffer_id, num_ranks=buffer.num_ranks, rank=buffer.rank,
                                device=buffer.device, kind="deep_ep.Buffer")
        check_combine_inputs(topk_idx, ep_handle.num_tokens // handle.num_topk, handle.num_topk, num_experts, out,
                             hidden, device)
        self._check_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64, num_ranks)
        source = self._combine_buffer(num_slots, hidden, num_experts) if zero_copy else x

        # Every received pair's row, in the pair dispatch's expanded layout, goes back alone (rows of
        # masked ranks as zeros). The mask is the dispatch's: a combine exchanges with the ranks its
        # dispatch did (as the direct kernels), whatever changed since.
        masked = handle.mask
        rows = gather_rows(source, ep_handle.psum_num_recv_tokens_per_expert, handle.row_expert, handle.row_slot,
                           handle.row_kept, masked)
        deferred = None
        if return_recv_hook and device.type == "cuda":    # the send half now, the receive half in the hook
            pairs, deferred = send_combine(buffer, rows, ep_handle, self._low_latency_num_sms(device))
        else:
            pairs, _, _ = buffer.combine(rows, ep_handle, num_sms=self._low_latency_num_sms(device))
        pairs = pairs.view(num_tokens, num_topk, hidden)
        combined_x = out if out is not None else torch.empty((num_tokens, hidden), dtype=torch.bfloat16,
                                                             device=device)

        def receive() -> None:
            if deferred is not None:
                launch_receive(buffer, deferred)
            weighted_sum(pairs, topk_idx, topk_weights, masked, num_local_experts, combined_x)

        hook = self._receive_or_hook(receive, "low_latency_combine", device, handle.slot, return_recv_hook)
        event = EventOverlap(EventHandle(), (x, topk_idx, topk_weights, src_info, layout_range, combined_x)) \
            if async_finish else EventOverlap()
        return combined_x, event, hook
