"""`CPUBackend`: dispatch and combine of CPU tensors over a gloo group through ``torch.distributed``.

This is the executable specification run distributed: its outputs are bit-identical to
`deep_ep.reference` (same row order, same float32 summation order). The protocol of each call is in
`deep_ep.backends.cpu.dispatch` and `deep_ep.backends.cpu.combine`; timeouts, failure reports and
the configuration header every call exchanges first are in `deep_ep.backends.cpu.collectives`.
"""
from __future__ import annotations

import torch

from ... import topology
from ..base import Backend, BufferConfig
from . import combine as combine_impl
from . import dispatch as dispatch_impl
from .collectives import Collectives

__all__ = ["CPUBackend"]


class CPUBackend(Backend):
    """Dispatch/combine of CPU tensors over a gloo (or any CPU-capable) process group."""

    def __init__(self, group, config: BufferConfig) -> None:
        super().__init__(group, config)
        self.rank = config.rank
        self.num_ranks = config.num_ranks
        self.comm = Collectives(group, config.rank, config.num_ranks, config.num_cpu_timeout_secs)
        # Handles follow DeepEP's hybrid layout when the group acts as several nodes (`deep_ep.topology`).
        domains = topology.group_domains(group, config.rank, config.num_ranks, True, config.allow_hybrid_mode)
        self.num_scaleup_ranks = domains.num_scaleup_ranks
        # a rank of another mode or split would sum in another order: every dispatch and combine checks
        self.comm.domains = (int(bool(config.allow_hybrid_mode) and domains.physical[0] > 1), domains.physical[1])

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def barrier(self) -> None:
        self.comm.barrier(self.calls)

    def destroy(self) -> None:
        """Drop the process group: a destroyed buffer must not keep the group (and its gloo threads)
        alive past ``destroy_process_group``, into interpreter teardown, where their destruction can
        abort the process. (The buffer refuses every later call.)"""
        self.group = None
        self.comm.group = None

    def dispatch(self, data, sf, topk_idx, topk_weights, *, num_experts, num_max_tokens_per_rank,
                 expert_alignment, num_sms, handle, do_handle_copy, do_cpu_sync, do_expand,
                 do_zero_padding, use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats, num_qps=0):
        del num_sms, num_qps  # no SMs or QPs on the CPU
        return dispatch_impl.dispatch(
            self.comm, self.config.buffer_id, data, sf, topk_idx, topk_weights, num_experts=num_experts,
            num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment, handle=handle,
            do_handle_copy=do_handle_copy, do_cpu_sync=do_cpu_sync, do_expand=do_expand,
            do_zero_padding=do_zero_padding, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, call=self.calls,
            num_scaleup_ranks=self.num_scaleup_ranks)

    def combine(self, x, handle, topk_weights, bias, *, num_sms, apply_dispatch_weights=False, num_qps=0):
        del num_sms, num_qps
        return combine_impl.combine(self.comm, x, handle, topk_weights, bias,
                                    allow_multiple_reduction=self.config.allow_multiple_reduction,
                                    apply_dispatch_weights=apply_dispatch_weights, call=self.calls,
                                    num_scaleup_ranks=self.num_scaleup_ranks)
