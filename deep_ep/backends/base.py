"""The interface every backend implements (CPU over gloo, GPU over NCCL, emulated ranks).

`deep_ep.ElasticBuffer` validates and normalises all arguments, handles streams and events, and then
calls a backend with:

* ``x`` split into ``data`` (bf16 or float8_e4m3fn ``[T, H]``, contiguous) and ``sf`` (``None`` or
  float32 / int32 ``[T, num_sf]``, row-major contiguous);
* ``topk_idx`` int64 ``[T, K]`` (values in ``[-1, E)``) and optional float32 ``topk_weights``, or a
  validated ``handle`` (an `EPHandle` made by this backend's buffer on this rank) for a cached dispatch;
* ``bias`` as a tuple of 0, 1 or 2 bf16 ``[T, H]`` tensors;
* every flag already resolved to a concrete value (no ``None`` defaults left); a cached dispatch may
  carry ``topk_weights`` (the backward of an expanded dispatch), laid out like the handle's.

The backend launches its work on its communication stream (`get_comm_stream`, or none on CPU; the
buffer has already made that stream wait for the compute stream or ``previous_event`` and for
``previous_event_before_epilogue``, and records the completion event after the call; outputs are
allocated on whatever stream is current) and returns the outputs described by docs/design.md. It
must fail with an exception on every rank, never hang, when ranks disagree or when a rank would
receive more than fits (conditions a single rank cannot see). Domain sizes come from
`deep_ep.backends.group_domain_sizes`; the SM and QP counts from `deep_ep.resources`, fed by
`device_resources`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

import torch

from ..handle import EPHandle
from ..resources import DeviceResources

__all__ = ["BufferConfig", "Backend"]


@dataclass(frozen=True)
class BufferConfig:
    """What `ElasticBuffer.__init__` was given, validated. ``num_bytes`` is the resolved window size
    in bytes (``0`` when it could not be estimated: the CPU backend needs no window)."""
    buffer_id: int
    rank: int
    num_ranks: int
    num_bytes: int
    num_max_tokens_per_rank: int
    hidden: int
    num_topk: int
    use_fp8_dispatch: bool
    deterministic: bool
    allow_hybrid_mode: bool
    allow_multiple_reduction: bool
    prefer_overlap_with_compute: bool
    num_gpu_timeout_secs: float
    num_cpu_timeout_secs: float
    explicitly_destroy: bool
    num_cpu_bytes: int = 0
    sl_idx: int = 3
    num_allocated_qps: int = 0


class Backend(abc.ABC):
    """Runs dispatch/combine for one `ElasticBuffer` on one rank. Created by `make_backend`."""

    def __init__(self, group, config: BufferConfig) -> None:
        self.group = group
        self.config = config

    # ------------------------------------------------------------------ properties
    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Device every tensor given to / returned by this backend lives on."""

    #: Collective calls (dispatch, combine, barrier) this rank's buffer has been asked to make, the
    #: refused ones included; counted by the buffer, sent with every exchange, so that a rank that
    #: skipped or repeated a call is found at the next one (docs/design.md, "Ranks that disagree").
    calls = 0

    #: GPU backends: a synchronous call may run on the caller's stream (`call_stream` set by the buffer).
    runs_on_caller_stream = False

    #: `deep_ep.cuda.streams.StreamJoin` ordering the comm stream with the caller's stream on the
    #: synchronous path, or None (CPU; the buffer then uses torch's stream objects).
    stream_join = None

    # Ordering of consecutive calls whose kernels run on different streams (GPU backends; the
    # buffer brackets each call with these, see `deep_ep.backends.gpu.GPUBackend`).
    def enter_caller_stream(self, stream: int) -> None:
        """Before a synchronous call on the caller's raw stream ``stream``."""
        self.call_stream = stream

    def leave_caller_stream(self, stream: int) -> None:
        """After it."""
        self.call_stream = None

    def enter_comm_stream(self) -> None:
        """Before a call on the communication stream."""

    def leave_comm_stream(self) -> None:
        """After it."""

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream communication kernels run on; ``None`` when there are no streams (CPU)."""
        return None

    def device_resources(self) -> Optional[DeviceResources]:
        """The device's SM count and link rates for `deep_ep.resources` (None: no SMs, e.g. CPU)."""
        return None

    # ------------------------------------------------------------------ collectives
    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group reached the barrier, with this rank's communication
        finished (the strongest of DeepEP's barrier variants: the buffer accepts their flags)."""

    @abc.abstractmethod
    def dispatch(self, data: torch.Tensor, sf: Optional[torch.Tensor],
                 topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], *,
                 num_experts: int, num_max_tokens_per_rank: int, expert_alignment: int, num_sms: int,
                 handle: Optional[EPHandle], do_handle_copy: bool, do_cpu_sync: bool,
                 do_expand: bool, do_zero_padding: bool, use_tma_aligned_col_major_sf: bool,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor], num_qps: int = 0) -> tuple:
        """Dispatch (docs/design.md "Semantics of dispatch and combine").

        With ``handle`` given (cached dispatch) ``topk_idx`` is None, ``topk_weights`` optional, and the layout
        flags (``num_experts``, ``expert_alignment``, ``num_max_tokens_per_rank``, ``do_expand``, and
        ``do_cpu_sync`` = ``handle.do_cpu_sync``, which here only says how the handle's outputs were
        sized) equal the handle's; a cached dispatch never waits for the host. ``num_max_tokens_per_rank`` is 0 when unknown (only allowed with
        ``do_cpu_sync=True``). ``num_qps``: the call's RDMA QPs, validated (0: automatic); across
        nodes the GIN contexts the data kernel uses, ignored elsewhere.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``; ``recv_x`` is a tensor for bf16
            input, the tuple ``(recv_data, recv_sf)`` for FP8 input; ``recv_topk_idx`` None in the
            expanded layout; ``recv_topk_weights`` None without ``topk_weights``; for a cached
            dispatch ``handle`` is the handle given. ``handle.num_sms`` is the SM count used.
        """

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor],
                bias: tuple, *, num_sms: int, apply_dispatch_weights: bool = False, num_qps: int = 0) -> tuple:
        """Combine (docs/design.md "Combine"), in `deep_ep.reference`'s order with the buffer's
        ``allow_multiple_reduction`` (``config``).

        Args:
            x: bf16 ``[handle.num_recv_rows, handle.hidden]``.
            handle: made by this backend's dispatch on this rank.
            topk_weights: None, float32 ``[rows, K]`` (non-expanded) or ``[rows]`` (expanded; only
                with ``allow_multiple_reduction``).
            bias: tuple of 0-2 bf16 ``[handle.num_tokens, hidden]`` tensors.
            num_sms: resolved SM count (``handle.num_sms`` when the caller passed 0).
            apply_dispatch_weights: expanded handles with dispatch weights only: multiply each row by
                ``handle.recv_topk_weights`` before reducing.
            num_qps: as in `dispatch`.

        Returns:
            ``(combined_x bf16 [T, H], combined_topk_weights float32 [T, K] or None)``.
        """

    def destroy(self) -> None:
        """Release every resource (windows, communicators, streams). Called once."""
