"""What a fresh dispatch on the GPU backend derives once per configuration (`FreshPlan`): the
checked limits, its prepared launches and the fields of the handles it makes; and the helpers the
per-call code of `deep_ep.backends.gpu.dispatch` shares with it.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ...handle import EPHandle
from ...shapes import worst_case_recv_rows, worst_case_recv_tokens
from .abi import CONSTANTS, MAX_EXPERTS, MAX_TOPK, DispatchArgs, LayoutArgs, NotifyArgs, call_tag, layout_index
from . import modules
from . import window

__all__ = ["FreshPlan", "check_config", "dispatch_tag", "sf_ld", "ptr"]

NOTIFY_WARPS = CONSTANTS["kNotifyWarps"]   # groups per block of the notify kernel
NOTIFY_TILE_PAIRS = CONSTANTS["kNotifyTilePairs"]   # its shared-memory tile of ids: top-k at most this
WARP_LANES = 32   # the data kernels give each top-k slot of a token a lane of a warp


def ptr(tensor: Optional[torch.Tensor]) -> Optional[int]:
    """A kernel argument's address: None for no tensor or an empty one (torch reports address 0 for
    any tensor without elements, a view into a larger storage too; the kernels would not touch one
    anyway, since its counts are zero)."""
    return None if tensor is None else tensor.data_ptr() or None


class FreshPlan:
    """What a fresh dispatch derives from its configuration (the key in `dispatch.run_dispatch`: not
    the token count, the tensors, ``do_handle_copy`` or the scale factors' layout, which each call
    handles): checked once, with its two prepared launches (the notify kernel with its layout stage,
    and the data kernel, the same for every rank count), whose constant arguments are set here and
    the rest by each call (`GPUBackend.fresh_plans`).

    Attributes: ``num_experts``, ``alignment``, ``num_local_experts``, ``hidden``,
    ``num_max_tokens`` (checked: ``num_max_tokens_per_rank`` or what the window holds), ``num_sms``
    (blocks of the data kernel), ``layout_index`` (`abi.layout_index`); ``out_capacity`` /
    ``tok_capacity`` (the outputs' rows and token rows: the worst case without CPU sync, no limit
    with it), ``expanded_capacity`` (the handle's expanded rows without CPU sync), ``meta_rows``
    (recv_src_metadata's rows known before a call: the worst case without CPU sync, else 0);
    ``notify`` / ``data`` (the prepared launches), ``notify_args`` / ``layout_args`` / ``data_args``
    (their argument structs, which each call fills), ``tags`` (their call tags), ``handle_fields``
    (`EPHandle.field_dict` with each call's own fields at placeholders) and ``per_tokens`` (what
    `dispatch` derives per token count, cached here).
    """

    __slots__ = ("num_experts", "alignment", "num_local_experts", "hidden", "layout_index", "num_max_tokens",
                 "num_sms", "out_capacity", "tok_capacity", "expanded_capacity", "meta_rows", "notify",
                 "data", "notify_args", "layout_args", "data_args", "per_tokens", "tags", "handle_fields")

    def __init__(self, backend, data, sf, num_topk, num_experts, alignment, num_max_tokens_per_rank, num_sms,
                 has_weights, do_cpu_sync, do_expand, do_zero_padding, num_qps=0):
        num_ranks = backend.num_ranks
        data_bytes, num_sf, layout, num_max_tokens = check_config(backend, data, sf, num_topk, num_experts,
                                                                  num_max_tokens_per_rank)
        self.num_experts, self.alignment, self.num_local_experts = num_experts, alignment, num_experts // num_ranks
        self.hidden, self.num_max_tokens = int(data.shape[1]), num_max_tokens
        self.layout_index = layout_index(num_ranks, self.num_local_experts, num_experts)
        # (tokens, the notify grid's settings) -> (word plan, blocks of the notify kernel, tokens per
        # group); the settings: the backend's cap on groups and the grouping
        # constant of `dispatch`
        self.per_tokens = {}
        self.num_sms = backend.num_sms(num_sms, num_experts, num_topk)
        # do_cpu_sync=False: outputs are sized now for the worst case; the layout stage refuses
        # (error code 2) a receive that would not fit, e.g. a peer with a larger M.
        no_limit = 2 ** 31 - 1
        self.out_capacity = no_limit if do_cpu_sync else worst_case_recv_rows(
            num_ranks, num_max_tokens, num_topk, self.num_local_experts, alignment, do_expand)
        self.tok_capacity = no_limit if do_cpu_sync else worst_case_recv_tokens(num_ranks, num_max_tokens)
        self.meta_rows = 0 if do_cpu_sync else self.tok_capacity
        self.expanded_capacity = worst_case_recv_rows(num_ranks, num_max_tokens, num_topk, self.num_local_experts,
                                                      alignment, True)   # the handle's, without CPU sync
        transport = backend.transport_args_for(num_qps)   # the data kernel's contexts
        tag = dispatch_tag(1, data_bytes, num_sf, num_topk, do_expand, alignment, num_experts, has_weights,
                           do_cpu_sync, num_max_tokens, getattr(transport, "num_contexts", 0))
        self._prepare_launches(backend, layout, (data_bytes, num_sf, num_topk, bool(do_expand)), tag,
                               num_max_tokens_per_rank, do_cpu_sync, do_zero_padding, transport)
        # The fields of the handles this configuration makes, each call's own ones at placeholders: a
        # call copies the dict and sets those (a dict copy is cheaper than building the dict anew).
        self.handle_fields = EPHandle.field_dict(
            do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment,
            num_max_tokens_per_rank=num_max_tokens_per_rank, num_sms=self.num_sms, topk_idx=None, num_recv_tokens=0,
            num_expanded_tokens=0, num_recv_tokens_per_expert_list=None, buffer_id=backend.config.buffer_id,
            num_ranks=num_ranks, rank=backend.rank, hidden=self.hidden, do_cpu_sync=do_cpu_sync,
            recv_topk_weights=None)

    def _prepare_launches(self, backend, layout, structure, tag, num_max_tokens_per_rank, do_cpu_sync,
                          do_zero_padding, data_transport) -> None:
        """Prepare the notify and data launches of the dispatch module of ``structure`` (with the
        window ``layout`` and the call ``tag`` of this configuration; the data kernel with
        ``data_transport``, `GPUBackend.transport_args_for`): ``notify``, ``data``, their argument
        structs and ``tags``."""
        num_experts, alignment, timeout_ns = self.num_experts, self.alignment, backend.timeout_ns
        device, transport = backend.device, backend.transport_args
        module = backend.module("dispatch", structure)
        # Struct fields are copies: one tag serves every struct (each call sets ``tag.seq``).
        notify_args = NotifyArgs(num_experts=num_experts, counts_offset=layout.counts_offset,
                                 scratch=backend.notify_scratch.data_ptr(), timeout_ns=timeout_ns, tag=tag)
        layout_args = LayoutArgs(num_experts=num_experts, alignment=alignment, counts_offset=layout.counts_offset,
                                 out_capacity=self.out_capacity, tok_capacity=self.tok_capacity,
                                 timeout_ns=timeout_ns, host_out=backend.readback.device_ptr if do_cpu_sync else None,
                                 err_host=backend.err_record.device_ptr, tag=tag)
        data_args = DispatchArgs(max_tokens=num_max_tokens_per_rank, num_experts=num_experts, alignment=alignment,
                                 recv_offset=layout.recv_offset, half_bytes=layout.half_bytes,
                                 row_stride=layout.row_stride, timeout_ns=timeout_ns,
                                 err_host=backend.err_record.device_ptr, tag=tag)
        self.notify = module.function(modules.NOTIFY_KERNEL).prepare(
            1, 32 * NOTIFY_WARPS, (notify_args, layout_args, transport), device=device.index,
            cooperative=backend.cooperative, smem=4 * NOTIFY_WARPS * (backend.num_ranks + num_experts))
        self.data = module.function(modules.DISPATCH_KERNEL).prepare(
            self.num_sms, modules.THREADS, (data_args, data_transport, ctypes.c_int(int(do_zero_padding))),
            device=device.index, cooperative=backend.cooperative)
        # the structs the launches read (each call sets its fields in them), and every struct's tag,
        # as views into their arguments (a ctypes field read makes a new view)
        self.notify_args, self.layout_args, self.data_args = notify_args, layout_args, data_args
        self.tags = (notify_args.tag, layout_args.tag, data_args.tag)


def dispatch_tag(kind: int, data_bytes, num_sf, num_topk, do_expand, alignment, num_experts, has_weights,
                 do_cpu_sync, num_max_tokens, num_contexts=0):
    """The tag of a dispatch (``kind`` 1: fresh, 2: cached) with call number 0: what every rank's
    call must agree on (sent with every signal, comm/window.cuh; across nodes the GIN contexts its
    data kernel uses too); each call sets its number."""
    return call_tag(0, kind, data_bytes, num_sf, num_topk, int(bool(do_expand)), alignment, num_experts, has_weights,
                    int(bool(do_cpu_sync)), 0 if do_cpu_sync else num_max_tokens, num_contexts)


def sf_ld(out_rows: int) -> int:
    """Leading dimension of column-major scale factors: the rows rounded up to 4 (TMA alignment)."""
    return (out_rows + 3) // 4 * 4


def check_config(backend, data, sf, num_topk, num_experts, num_max_tokens_per_rank) -> tuple:
    """The GPU-specific limits of a dispatch's configuration; returns ``(data_bytes, num_sf, window
    layout, num_max_tokens)`` (``num_max_tokens_per_rank``, or what the window holds per rank for 0).

    Raises:
        ValueError: too many experts or too large a top-k for the window or the kernels, a row that
            is not a multiple of 16 bytes, or more tokens per round than the window holds.
    """
    num_ranks, window_topk = backend.num_ranks, backend.config.num_topk
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts} exceeds the {MAX_EXPERTS} experts a window has room for")
    if num_topk > (window_topk or MAX_TOPK):
        raise ValueError(f"top-k {num_topk} exceeds the {window_topk or MAX_TOPK} the window rows were "
                         f"sized for: create the buffer with num_topk={num_topk}")
    if num_topk > min(NOTIFY_TILE_PAIRS, WARP_LANES):
        raise ValueError(f"top-k {num_topk} exceeds the {min(NOTIFY_TILE_PAIRS, WARP_LANES)} the GPU's dispatch "
                         f"supports (the kernels hold a token's top-k slots in the lanes of a warp)")
    hidden = int(data.shape[1])
    data_bytes = hidden * data.element_size()
    num_sf = 0 if sf is None else int(sf.shape[1])
    if data_bytes % 16:
        raise ValueError(f"a token row must be a multiple of 16 bytes on the GPU; got hidden={hidden} "
                         f"({data.dtype}): use a hidden size that is a multiple of 8 (bf16) / 16 (fp8)")
    layout = backend.layout(window.dispatch_row_stride(data_bytes, num_sf, window_topk))
    cap_tok_rows = layout.rows_per_half
    num_max_tokens = num_max_tokens_per_rank or (cap_tok_rows // num_ranks)
    if num_ranks * num_max_tokens > cap_tok_rows:
        raise ValueError(f"the window holds {cap_tok_rows} token rows per round, fewer than "
                         f"{num_ranks} ranks x num_max_tokens_per_rank={num_max_tokens}: create the buffer with a "
                         f"larger num_bytes (see ElasticBuffer.get_buffer_size_hint)")
    node_ranks = getattr(backend, "hybrid_node_ranks", 0)
    if node_ranks:   # hybrid mode across nodes (at most 32 ranks each: `topology.require_scaleout_support`):
        # each source node's slots in a forwarding area's half
        slot = window.forward_slot_bytes(data_bytes, num_sf, num_topk, node_ranks)
        node_bytes = backend.transport_args.half_bytes // (num_ranks // node_ranks) // 16 * 16
        if 16 + num_max_tokens * slot > node_bytes:
            raise ValueError(f"the forwarding area holds {(node_bytes - 16) // slot} tokens per source node, fewer "
                             f"than num_max_tokens_per_rank={num_max_tokens}: create the buffer with a larger "
                             f"num_bytes (see ElasticBuffer.get_buffer_size_hint)")
    return data_bytes, num_sf, layout, num_max_tokens
