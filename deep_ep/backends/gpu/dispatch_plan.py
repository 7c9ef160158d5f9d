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
from . import window as wl

__all__ = ["FreshPlan", "check_config", "dispatch_tag", "sf_ld", "ptr"]

NOTIFY_WARPS = CONSTANTS["kNotifyWarps"]   # groups per block of the notify kernel
NOTIFY_TILE_PAIRS = CONSTANTS["kNotifyTilePairs"]   # its shared-memory tile of ids: top-k at most this


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    """A kernel argument's address: None for no tensor or an empty one (torch reports address 0 for
    any tensor without elements, a view into a larger storage too; the kernels would not touch one
    anyway, since its counts are zero)."""
    return None if t is None else t.data_ptr() or None


class FreshPlan:
    """What a fresh dispatch derives from its configuration (the key in `run_dispatch`: not the token
    count, the tensors, ``do_handle_copy`` or the scale factors' layout, which each call handles):
    checked once, with its two prepared launches (the notify kernel with its layout stage, and the
    data kernel, the same for every rank count), whose constant arguments are set here and the rest
    by each call (`GPUBackend.fresh_plans`)."""

    __slots__ = ("E", "A", "L", "H", "ix", "m", "n_sms", "out_cap", "tok_cap", "expanded_cap", "meta_rows",
                 "early", "notify", "data", "per_tokens", "tags", "handle_fields")

    def __init__(self, b, data, sf, K, E, A, num_max_tokens_per_rank, num_sms, has_weights, do_cpu_sync,
                 do_expand, do_zero_padding):
        R = b.num_ranks
        dev = b.device
        data_bytes, num_sf, layout, m = check_config(b, data, sf, K, E, num_max_tokens_per_rank)
        self.E, self.A, self.L, self.H, self.m = E, A, E // R, int(data.shape[1]), m
        self.ix = layout_index(R, E // R, E)
        # (tokens, early, the notify grid's settings) -> (word plan, blocks of the notify kernel,
        # tokens per group, early rows); the settings: the backend's cap on groups and the grouping
        # constant of `dispatch`
        self.per_tokens = {}
        self.n_sms = b.num_sms(num_sms, E, K)
        structure = (data_bytes, num_sf, K, bool(do_expand))
        mod = b.module("dispatch", structure)
        # A rank alone with CPU sync queues its data kernel before the wait (`early_rows`).
        self.early = R == 1 and bool(do_cpu_sync)
        # do_cpu_sync=False: outputs are sized now for the worst case; the layout stage refuses
        # (error code 2) a receive that would not fit, e.g. a peer with a larger M.
        big = 2 ** 31 - 1
        self.out_cap = big if do_cpu_sync else worst_case_recv_rows(R, m, K, self.L, A, do_expand)
        self.tok_cap = big if do_cpu_sync else worst_case_recv_tokens(R, m)
        self.meta_rows = 0 if do_cpu_sync else self.tok_cap
        self.expanded_cap = worst_case_recv_rows(R, m, K, self.L, A, True)   # the handle's, without CPU sync
        # Struct fields are copies: one tag serves every struct (each call sets ``tag.seq``).
        tag = dispatch_tag(1, data_bytes, num_sf, K, do_expand, A, E, has_weights, do_cpu_sync, m)
        transport = b.transport_args
        notify_args = NotifyArgs(num_experts=E, counts_offset=layout.counts_offset,
                                 scratch=b.notify_scratch.data_ptr(), timeout_ns=b.timeout_ns, tag=tag)
        layout_args = LayoutArgs(num_experts=E, alignment=A, counts_offset=layout.counts_offset,
                                 out_capacity=self.out_cap, tok_capacity=self.tok_cap, timeout_ns=b.timeout_ns,
                                 host_out=b.readback.device_ptr if do_cpu_sync else None,
                                 err_host=b.err_record.device_ptr, tag=tag)
        data_args = DispatchArgs(max_tokens=num_max_tokens_per_rank, num_experts=E, alignment=A,
                                 recv_offset=layout.recv_offset, half_bytes=layout.half_bytes,
                                 row_stride=layout.row_stride, timeout_ns=b.timeout_ns,
                                 err_host=b.err_record.device_ptr, tag=tag)
        self.notify = mod.function(modules.NOTIFY_KERNEL).prepare(
            1, 32 * NOTIFY_WARPS, (notify_args, layout_args, transport),
            device=dev.index, cooperative=b.cooperative, smem=4 * NOTIFY_WARPS * (R + E))
        self.data = mod.function(modules.DISPATCH_KERNEL).prepare(
            self.n_sms, modules.THREADS, (data_args, transport, ctypes.c_int(int(do_zero_padding))),
            device=dev.index, cooperative=b.cooperative)
        # every struct's tag, as views into their arguments (a ctypes field read makes a new view)
        self.tags = (self.notify.args[0].tag, self.notify.args[1].tag, self.data.args[0].tag)
        # The fields of the handles this configuration makes, each call's own ones at placeholders: a
        # call copies the dict and sets those (a dict copy is cheaper than building the dict anew).
        self.handle_fields = EPHandle.field_dict(
            do_expand=do_expand, num_experts=E, expert_alignment=A, num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_sms=self.n_sms, topk_idx=None, num_recv_tokens=0, num_expanded_tokens=0,
            num_recv_tokens_per_expert_list=None, buffer_id=b.config.buffer_id, num_ranks=R, rank=b.rank,
            hidden=self.H, do_cpu_sync=do_cpu_sync, recv_topk_weights=None)


def dispatch_tag(kind: int, data_bytes, num_sf, K, do_expand, A, E, has_weights, do_cpu_sync, m):
    """The tag of a dispatch (``kind`` 1: fresh, 2: cached) with call number 0: what every rank's
    call must agree on (sent with every signal, comm/window.cuh); each call sets its number."""
    return call_tag(0, kind, data_bytes, num_sf, K, int(bool(do_expand)), A, E, has_weights, int(bool(do_cpu_sync)),
                    0 if do_cpu_sync else m)


def sf_ld(out_rows: int) -> int:
    """Leading dimension of column-major scale factors: the rows rounded up to 4 (TMA alignment)."""
    return (out_rows + 3) // 4 * 4


def check_config(b, data, sf, K, E, num_max_tokens_per_rank) -> tuple:
    """The GPU-specific limits of a dispatch's configuration; returns ``(data_bytes, num_sf, window
    layout, M)``."""
    R = b.num_ranks
    if E > MAX_EXPERTS:
        raise ValueError(f"num_experts={E} exceeds the {MAX_EXPERTS} experts a window has room for")
    if K > (b.config.num_topk or MAX_TOPK):
        raise ValueError(f"top-k {K} exceeds the {b.config.num_topk or MAX_TOPK} the window rows were "
                         f"sized for: create the buffer with num_topk={K}")
    if K > NOTIFY_TILE_PAIRS:
        raise ValueError(f"top-k {K} exceeds the {NOTIFY_TILE_PAIRS} the GPU's dispatch supports")
    H = int(data.shape[1])
    data_bytes = H * data.element_size()
    num_sf = 0 if sf is None else int(sf.shape[1])
    if data_bytes % 16:
        raise ValueError(f"a token row must be a multiple of 16 bytes on the GPU; got hidden={H} "
                         f"({data.dtype}): use a hidden size that is a multiple of 8 (bf16) / 16 (fp8)")
    layout = b.layout(wl.dispatch_row_stride(data_bytes, num_sf, b.config.num_topk))
    cap_tok_rows = layout.rows_per_half
    m = num_max_tokens_per_rank or (cap_tok_rows // R)
    if R * m > cap_tok_rows:
        raise ValueError(f"the window holds {cap_tok_rows} token rows per round, fewer than "
                         f"{R} ranks x num_max_tokens_per_rank={m}: create the buffer with a larger "
                         f"num_bytes (see ElasticBuffer.get_buffer_size_hint)")
    return data_bytes, num_sf, layout, m
