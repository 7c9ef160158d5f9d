"""`ElasticBuffer`: the public API of deep_ep, a drop-in for DeepEP V2's (same arguments in the same
order, same defaults, same outputs; extensions are keyword arguments that are off by default).

Each public method validates its arguments first (`deep_ep.checks`; dispatch and combine once per
call signature, `deep_ep.call_plans`), then runs the backend inside a thin stream/event layer
(`deep_ep.call_streams`). Nothing is communicated before validation passes.
Exceptions, all raised on the rank that received the bad argument, before any communication:
`TypeError` / `ValueError` (see `deep_ep.checks`); `RuntimeError` when the buffer was destroyed, or,
raised by the backend on *every* rank, a condition no single rank can see (ranks disagreeing on the
configuration, a receive that would not fit). A rank whose peers raised while its own arguments were
fine waits in the collective until the buffer's timeout (``num_cpu_timeout_secs`` on CPU,
``num_gpu_timeout_secs`` on GPU), then raises `TimeoutError` naming the peer that did not arrive and
the phase.
"""
from __future__ import annotations

import atexit
import itertools
import warnings
import weakref
from typing import Optional

import torch

from . import call_plans, call_streams, checks, envs, resources, topology
from .backends import (BufferConfig, group_domain_sizes, group_domains, group_rank_and_size, is_cpu_group,
                       make_backend)
from .comm.nccl import creation_hold
from .event import EventHandle
from .handle import EPHandle
from .primitives import AllGatherReduceScatterMixin, EngramMixin, PipelineMixin, WindowUse

__all__ = ["ElasticBuffer", "topk_idx_t", "get_physical_domain_size", "get_logical_domain_size"]

topk_idx_t = checks.topk_idx_t
"""dtype of ``topk_idx`` tensors (int64)."""

_buffer_ids = itertools.count()

#: Buffers not destroyed yet. At interpreter exit their references to the process group (and its
#: store) are dropped while the interpreter is still whole: a process group that lives on into
#: interpreter teardown can abort the process ("terminate called without an active exception").
_live_buffers: "weakref.WeakSet[ElasticBuffer]" = weakref.WeakSet()


@atexit.register
def _release_live_buffers() -> None:
    for buf in list(_live_buffers):
        buf._backend = None
        buf.group = None


def get_physical_domain_size(group) -> tuple:
    """``(num_rdma_ranks, num_nvlink_ranks)`` of ``group``'s hardware (`deep_ep.topology`): NCCL's LSA
    team on GPU; one domain on a gloo group unless ``EP_CPU_NUM_NVLINK_RANKS`` declares its size; one
    domain for emulated ranks.

    Raises:
        TypeError: ``group`` is not a process group or an emulated group. ValueError: a bad
        ``EP_CPU_NUM_NVLINK_RANKS``, or NVLink domains that do not split the group evenly.
    """
    return group_domain_sizes(group)[0]


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> tuple:
    """``(num_scaleout_ranks, num_scaleup_ranks)`` the algorithms use for ``group``: the physical split
    with ``allow_hybrid_mode`` (hybrid), ``(1, R)`` without (direct).

    Raises:
        TypeError: a bad ``group`` or an ``allow_hybrid_mode`` that is not a flag (`checks.check_bool`).
        ValueError: as `get_physical_domain_size`.
    """
    allow_hybrid_mode = checks.check_bool("allow_hybrid_mode", allow_hybrid_mode)
    return group_domain_sizes(group, allow_hybrid_mode)[1]


def _buffer_size_hint(num_ranks: int, on_cpu: bool, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                      use_fp8_dispatch: bool, allow_hybrid_mode: bool, allow_multiple_reduction: bool) -> int:
    """`ElasticBuffer.get_buffer_size_hint` for validated arguments, on the backend ``on_cpu`` names."""
    if not on_cpu:
        from .backends.gpu import window as window_layout
        return int(window_layout.buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk,
                                                  use_fp8_dispatch, allow_hybrid_mode=allow_hybrid_mode,
                                                  allow_multiple_reduction=allow_multiple_reduction))
    row = (hidden + hidden // 128 * 4) if use_fp8_dispatch else 2 * hidden
    row += num_topk * 12 + 4
    total = 2 * num_ranks * num_max_tokens_per_rank * row
    return checks.BUFFER_ALIGNMENT * -(-total // checks.BUFFER_ALIGNMENT)


class ElasticBuffer(PipelineMixin, AllGatherReduceScatterMixin, EngramMixin):
    """Expert-parallel communication buffer: dispatch tokens to experts, combine the results back.

    Args (DeepEP V2's, in its order):
        group: the ranks taking part: a ``torch.distributed`` group, or an emulated-rank group from
            `deep_ep.emulated` (GPU). Where torch sees a CUDA device, a torch group runs on the GPU,
            whatever its backend, as in DeepEP V2: an NCCL group lends its communicator, any other
            (a gloo group whose ranks hold GPU tensors, vLLM's way) gets a private NCCL communicator,
            as does an NCCL group under ``EP_REUSE_NCCL_COMM=0``. Without CUDA, or with
            ``device="cpu"``, a gloo group runs on CPU tensors (docs/design.md, "Which backend").
        num_bytes: communication window per rank in bytes; ``None`` computes it with
            `get_buffer_size_hint` from ``num_max_tokens_per_rank``, ``hidden``, ``num_topk`` (0 on CPU
            when they are not given: the CPU backend allocates per call).
        num_cpu_bytes: room for an Engram table (`engram_write`), a multiple of 2 MiB; on a GPU
            buffer it ends the window (docs/primitives.md).
        num_max_tokens_per_rank: M, the most tokens one rank dispatches per call (0 = not fixed; then
            ``do_cpu_sync=False`` needs it per call).
        hidden: the largest hidden size dispatched (0 = not fixed). num_topk: the largest top-k (0 =
            not fixed). use_fp8_dispatch: size the window for FP8 data.
        deterministic: accepted; every backend already returns the deterministic order (by source
            rank, then source token), which DeepEP produces only with this flag.
        allow_hybrid_mode: DeepEP's hierarchical RDMA + NVLink algorithm across NVLink domains
            (logical domains = physical ones); False is direct mode (logical ``(1, R)``). No effect
            within one domain. docs/scaleout.md.
        allow_multiple_reduction: combine reduces each rank's rows before the final sum (the order of
            `deep_ep.reference`); False reduces expanded rows in one pass (and then refuses to reduce
            expanded ``topk_weights``, as DeepEP does).
        prefer_overlap_with_compute: `get_theoretical_num_sms` leaves SMs to compute; False gives the
            communication every SM.
        sl_idx: RDMA service level 0..15 (the environment's ``EP_OVERRIDE_RDMA_SL`` wins);
            num_allocated_qps: RDMA queue pairs (0 = `deep_ep.resources.default_num_allocated_qps`).
            Across nodes: the GIN traffic class and the GIN contexts asked of NCCL (docs/scaleout.md).
        num_cpu_timeout_secs, num_gpu_timeout_secs: seconds before a host wait / a GPU kernel gives
            up with a `TimeoutError` (on CPU each collective phase waits at most the former,
            whatever the process group's own timeout).
        explicitly_destroy: resources are only released by `destroy()` (a warning is issued if the
            buffer is garbage-collected alive); otherwise they are released when it is collected.

    Keyword-only (deep_ep's extension): device: None (default: the GPU where torch sees a CUDA device,
    else the CPU), ``"cpu"`` (the CPU backend; a CPU job on a machine with GPUs passes it) or
    ``"cuda"`` (the GPU backend, on the current CUDA device; an index must be that device).

    Attributes (DeepEP's): ``group``, ``rank_idx``, ``num_ranks``, ``num_bytes``,
    ``num_max_tokens_per_rank``, ``num_scaleout_ranks``, ``num_scaleup_ranks``, ``scaleout_rank_idx``,
    ``scaleup_rank_idx``, ``num_rdma_ranks``, ``num_nvlink_ranks``, ``num_allocated_qps``,
    ``allow_hybrid_mode``, ``allow_multiple_reduction``, ``prefer_overlap_with_compute``,
    ``deterministic``, ``explicitly_destroy``; ours: ``rank`` (= ``rank_idx``), ``buffer_id``,
    ``config``, ``device``, ``num_cpu_bytes``, ``sl_idx``, ``is_destroyed``.

    Every flag (here and in the methods) may also be given as an int 0 or 1, a numpy bool or a
    one-element torch tensor holding 0 or 1, as DeepEP takes them; it is kept as a bool.

    Raises:
        TypeError / ValueError: invalid arguments (a bad ``EP_CPU_NUM_NVLINK_RANKS`` too; ``device="cpu"``
        with an NCCL-only or emulated group).
        deep_ep.cuda.nccl.NcclError: creating the private NCCL communicator failed.
        NotImplementedError: the group needs the GPU backend and it is not available, or hybrid mode
        across nodes of more than 32 ranks. RuntimeError: a GPU group over several NVLink domains
        whose NCCL or communicator lacks GIN. Each raised on every rank before any allocation.
    """

    def __init__(self, group, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: float = 300,
                 num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False, *, device=None) -> None:
        self._backend = None
        self._destroyed = False
        rank, num_ranks = group_rank_and_size(group)
        (use_fp8_dispatch, deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute,
         explicitly_destroy) = checks.check_buffer_args(
            num_bytes, num_cpu_bytes, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, deterministic,
            allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx, num_allocated_qps,
            num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy)
        on_cpu = is_cpu_group(group, device)
        text = envs.get("EP_OVERRIDE_RDMA_SL")   # empty: unset, as every variable
        if text is not None:
            if not text.strip().isdigit() or not 0 <= int(text) <= 15:
                raise ValueError(f"EP_OVERRIDE_RDMA_SL must be an RDMA service level 0..15, got {text!r}")
            sl_idx = int(text)
        if num_bytes is None:
            if num_max_tokens_per_rank and hidden:
                num_bytes = _buffer_size_hint(num_ranks, on_cpu, num_max_tokens_per_rank, hidden, num_topk,
                                              use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)
            elif on_cpu:
                num_bytes = 0          # the CPU backend allocates per call
            else:
                raise ValueError("a GPU buffer needs num_bytes, or num_max_tokens_per_rank and hidden to "
                                 "compute it (see ElasticBuffer.get_buffer_size_hint)")
        self.group = group
        self.rank_idx = rank
        self.num_ranks = num_ranks
        self.buffer_id = next(_buffer_ids)
        self._plans: dict = {}   # validated call signatures (`deep_ep.call_plans`)
        self._window_use = WindowUse()   # dispatch/combine and the primitives share the window
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_cpu_bytes = num_cpu_bytes
        self.sl_idx = sl_idx
        config = BufferConfig(
            buffer_id=self.buffer_id, rank=rank, num_ranks=num_ranks, num_bytes=num_bytes,
            num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
            use_fp8_dispatch=use_fp8_dispatch, deterministic=deterministic, allow_hybrid_mode=allow_hybrid_mode,
            allow_multiple_reduction=allow_multiple_reduction, prefer_overlap_with_compute=prefer_overlap_with_compute,
            num_gpu_timeout_secs=num_gpu_timeout_secs, num_cpu_timeout_secs=num_cpu_timeout_secs,
            explicitly_destroy=explicitly_destroy, num_cpu_bytes=num_cpu_bytes, sl_idx=sl_idx,
            num_allocated_qps=num_allocated_qps)
        with creation_hold(group, on_cpu):
            self._make_backend(group, device, on_cpu, config)
        _live_buffers.add(self)

    def _make_backend(self, group, device, on_cpu: bool, config: BufferConfig) -> None:
        """The domains, the backend and what is read from them (the rest of `__init__`, while the
        communicator of a GPU buffer is held)."""
        allow_hybrid_mode = config.allow_hybrid_mode
        domains = group_domains(group, allow_hybrid_mode, device)[2]
        if not on_cpu:   # the group size's limit before any domain's: every rank refuses alike
            from .backends.gpu.window import check_num_ranks
            check_num_ranks(config.num_ranks)
        if not on_cpu and domains.num_rdma_ranks > 1:
            from .comm.nccl import nccl_version
            emulated = hasattr(group, "make_transport")   # emulated nodes: an emulated GIN, no NCCL
            topology.require_scaleout_support(domains, config.rank, 0 if emulated else nccl_version(),
                                              emulated=emulated)
        self.config = config
        self._backend = make_backend(group, config, device)
        self._resources = self._backend.device_resources()
        self.num_allocated_qps = config.num_allocated_qps or resources.default_num_allocated_qps(
            self._resources, allow_hybrid_mode)
        self.num_rdma_ranks, self.num_nvlink_ranks = domains.physical
        self.num_scaleout_ranks, self.num_scaleup_ranks = domains.logical
        self.scaleout_rank_idx, self.scaleup_rank_idx = domains.scaleout_rank_idx, domains.scaleup_rank_idx

    # ------------------------------------------------------------------ lifecycle
    @property
    def device(self) -> torch.device:
        """Device every tensor of this buffer lives on (``cpu`` for gloo groups)."""
        return self._backend.device

    @property
    def rank(self) -> int:
        """This rank in the group (DeepEP's ``rank_idx``)."""
        return self.rank_idx

    @property
    def num_bytes(self) -> int:
        """Communication window size per rank in bytes (0 when not applicable)."""
        return self.config.num_bytes

    @property
    def is_destroyed(self) -> bool:
        """Whether `destroy` was called (every other method then raises `RuntimeError`)."""
        return self._destroyed

    def _alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"ElasticBuffer #{self.buffer_id} was destroyed; create a new one")

    def destroy(self) -> None:
        """Release the buffer's resources (also without ``explicitly_destroy``, unlike DeepEP): the
        primitives' state first (PP channels, an open AGRS session and its space, the Engram
        mappings; tensors in flight are abandoned), then the backend's. Calling it again is a no-op;
        any other method then raises `RuntimeError`. Collective on GPU."""
        if not self._destroyed and self._backend is not None:
            self._destroyed = True
            for primitive in (PipelineMixin, AllGatherReduceScatterMixin, EngramMixin):
                primitive._release_primitives(self)
            self._window_use = WindowUse()   # nothing holds a destroyed buffer's window
            self._backend.destroy()
        self._destroyed = True

    def __del__(self) -> None:
        if getattr(self, "_backend", None) is None or getattr(self, "_destroyed", True):
            return
        if self.config.explicitly_destroy:
            warnings.warn(f"ElasticBuffer #{self.buffer_id} (explicitly_destroy=True) was garbage-collected "
                          f"without destroy(): its resources were not released", ResourceWarning)
            return
        try:
            self.destroy()
        except Exception:  # interpreter shutdown: nothing sensible left to do
            pass

    # ------------------------------------------------------------------ sizes, resources, topology
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of communication window one rank needs, rounded up to 2 MiB.

        GPU groups: `deep_ep.backends.gpu.window.buffer_size_hint` (both flags passed on). Groups on
        the CPU backend (`deep_ep.backends.is_cpu_group`, automatic choice): the staging memory of one dispatch, send and receive buffers of ``R * M``
        packed rows each (data, FP8 scale factors, ``num_topk`` ids and weights, a source index).

        Raises:
            TypeError / ValueError on invalid arguments.
        """
        _, num_ranks = group_rank_and_size(group)
        use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction = checks.check_size_hint_args(
            num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)
        return _buffer_size_hint(num_ranks, is_cpu_group(group), num_max_tokens_per_rank, hidden, num_topk,
                                 use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs a dispatch/combine should use: DeepEP's model over this buffer's domains
        (`deep_ep.resources`; 0 on CPU, which ``dispatch`` reads as automatic).

        Args:
            num_experts: E (divisible by the ranks). num_topk: K in ``[1, E]``.
            num_scaleout_topk: reserved, must be 0. rdma_gbs: RDMA GB/s (0: the device's, else
                `deep_ep.resources.DEFAULT_RDMA_GBS`). nvlink_gbs: NVLink GB/s per direction (0: the
                device's). sm_read_gbs, sm_write_gbs: one SM's read / write rate in GB/s.

        Raises:
            TypeError / ValueError: invalid arguments. RuntimeError: destroyed buffer.
        """
        self._alive()
        checks.check_sms_args(self.num_ranks, num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs,
                              sm_read_gbs, sm_write_gbs)
        return resources.theoretical_num_sms(
            num_experts, num_topk, num_ranks=self.num_ranks, resources=self._resources, nvlink_gbs=nvlink_gbs,
            rdma_gbs=rdma_gbs, sm_read_gbs=sm_read_gbs, sm_write_gbs=sm_write_gbs,
            prefer_overlap_with_compute=self.prefer_overlap_with_compute,
            num_scaleout_ranks=self.num_scaleout_ranks, num_scaleup_ranks=self.num_scaleup_ranks,
            num_rdma_ranks=self.num_rdma_ranks, num_nvlink_ranks=self.num_nvlink_ranks)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """RDMA QPs for a call on ``num_sms`` SMs (`deep_ep.resources.theoretical_num_qps`): ``num_sms * 16
        + 1`` with ``allow_hybrid_mode``, else ``min(num_sms, 9)``, at most ``num_allocated_qps``.
        Raises TypeError / ValueError on a bad ``num_sms``."""
        self._alive()
        checks.check_int("num_sms", num_sms, minimum=0)
        return resources.theoretical_num_qps(num_sms, self.num_allocated_qps, self.allow_hybrid_mode)

    def get_logical_domain_size(self) -> tuple:
        """``(num_scaleout_ranks, num_scaleup_ranks)`` as the algorithms use them."""
        self._alive()
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_physical_domain_size(self) -> tuple:
        """``(num_rdma_ranks, num_nvlink_ranks)`` of the hardware."""
        self._alive()
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_comm_stream(self):
        """The CUDA stream communication runs on, or ``None`` on CPU."""
        self._alive()
        return self._backend.get_comm_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Block until every rank calls `barrier` (collective), with this rank's communication
        finished. The flags are DeepEP's; every backend gives the strongest of its variants (the
        communication stream drained and the host synchronised) whatever they say.

        Raises:
            TypeError: a flag that is not one (`checks.check_bool`). RuntimeError: destroyed buffer,
            or a GPU error recorded on this rank or another (raised on every rank).
        """
        self._alive()
        self._backend.calls += 1
        for name, v in (("use_comm_stream", use_comm_stream), ("with_cpu_sync", with_cpu_sync),
                        ("sequential", sequential)):
            checks.check_bool(name, v)
        self._backend.barrier()

    @staticmethod
    def capture() -> EventHandle:
        """An `EventHandle` recorded on the current CUDA stream, for ``previous_event`` (a no-op one
        where the process has no CUDA work, e.g. on CPU)."""
        return EventHandle()

    # ------------------------------------------------------------------ dispatch and combine
    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Optional[EPHandle] = None,
                 do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False, *,
                 _phases: Optional[int] = None):
        """Send every token to the ranks holding its selected experts (collective; docs/design.md).

        Args:
            x: bf16 ``[T, H]``, or an FP8 tuple ``(float8_e4m3fn [T, H], sf)`` with ``sf`` float32
                ``[T, H/128]`` or int32 ``[T, ceil(H/512)]`` (UE8M0 exponents packed four to an
                int32); H a multiple of 128 for FP8. Contiguous, on the buffer's device; ``T`` may be 0
                and may differ between ranks.
            topk_idx: `topk_idx_t` ``[T, K]`` global expert ids in ``[0, num_experts)`` or -1 (no
                selection). Required unless ``handle`` is given (then it must be None).
            topk_weights: optional float32 ``[T, K]``; with ``handle`` (the backward of a dispatch) they
                are sent in the handle's layout.
            cumulative_local_expert_recv_stats: optional int32 ``[E / R]``, incremented in place by the
                received (unaligned) pairs per local expert.
            num_experts: E, divisible by the ranks; required unless ``handle`` is given.
            num_max_tokens_per_rank: M for this call (default: the buffer's; not above it); ``T <= M``
                when M > 0; required (> 0) for ``do_cpu_sync=False``.
            expert_alignment: A >= 1 (default 1): per-expert row counts are padded to multiples of A.
            num_sms: SMs on the GPU (0 = automatic; ignored on CPU). num_qps: RDMA QPs, at most
                ``num_allocated_qps`` (scale-out path only).
            previous_event: an `EventHandle` (`capture`) or `EventOverlap` the communication waits for
                instead of the current stream. previous_event_before_epilogue: waited for too.
            async_with_compute_stream: return at once with an event to wait on.
            allocate_on_comm_stream: allocate outputs on the communication stream.
            handle: an `EPHandle` of this buffer's dispatch on this rank: a cached dispatch, same
                layout, no routing input, no host sync; ``x`` must have the handle's shape; returns
                the handle itself.
            do_handle_copy: the handle keeps a copy of ``topk_idx`` (False: the tensor itself).
            do_cpu_sync: wait for the receive counts and size outputs exactly (default True; False
                with ``handle``). False: outputs sized for the worst case (docs/design.md).
            do_expand: the expanded layout, one row per (token, local expert), grouped by expert.
            do_zero_padding: zero the padding rows of the expanded layout (and their weights).
            use_tma_aligned_col_major_sf: FP8: scale factors column-major, rows rounded up to 4.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_x`` has
            ``handle.num_recv_rows`` rows; ``recv_topk_idx`` int64 ``[rows, K]`` local expert ids or
            -1 (None in the expanded layout); ``recv_topk_weights`` float32 ``[rows, K]`` (expanded
            ``[rows]``; None without ``topk_weights``); ``event`` an `EventOverlap`. With the private
            ``_phases`` (for `deep_ep.legacy.deferred`: a fresh GPU dispatch's data kernel phases,
            `deep_ep.backends.gpu.modules.SEND_PHASE` alone) its receive's `DeferredReceive` comes
            before ``event``.

        Raises:
            TypeError, ValueError: invalid arguments (before any communication).
            RuntimeError: destroyed buffer; a fresh dispatch with CPU sync during CUDA-graph
            capture (nothing is queued); or, on every rank, ranks that disagree on the
            configuration or receives that would not fit.
        """
        self._alive()
        backend = self._backend
        backend.calls += 1   # every call counts, a refused one too (ranks that disagree are found)
        self._window_use.check_free("dispatch")
        stats = cumulative_local_expert_recv_stats
        data, sf, plan = call_plans.dispatch_plan(
            self, x, topk_idx, topk_weights, stats, num_experts, num_max_tokens_per_rank, expert_alignment, num_sms,
            num_qps, previous_event, previous_event_before_epilogue, async_with_compute_stream,
            allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
            use_tma_aligned_col_major_sf)
        # Kept alive for the communication stream in async mode (with a handle: its tensors too).
        inputs = (data, sf, topk_idx, topk_weights, stats, handle)   # Nones allowed
        outputs, event = call_streams.run_call(
            backend, lambda: backend.dispatch(
                data, sf, topk_idx, topk_weights, num_experts=plan.num_experts,
                num_max_tokens_per_rank=plan.num_max_tokens_per_rank, expert_alignment=plan.expert_alignment,
                num_sms=plan.num_sms, handle=handle, do_handle_copy=plan.do_handle_copy, do_cpu_sync=plan.do_cpu_sync,
                do_expand=plan.do_expand, do_zero_padding=plan.do_zero_padding,
                use_tma_aligned_col_major_sf=plan.use_tma_aligned_col_major_sf,
                cumulative_local_expert_recv_stats=stats, num_qps=num_qps,
                **({} if _phases is None else {"phases": _phases})),
            previous_event, previous_event_before_epilogue, plan.async_with_compute_stream,
            plan.allocate_on_comm_stream, inputs)
        return (*outputs, event)

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None, bias=None,
                num_sms: int = 0, num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False, *,
                apply_dispatch_weights: bool = False, _phases: Optional[int] = None):
        """Send expert outputs back to their source ranks and reduce them (collective).

        The rows are summed as they are: expert outputs come weighted already (DeepEP's contract).
        The order of the float32 sums is `deep_ep.reference`'s (bias first, then each rank's partial
        at its last top-k slot; docs/design.md, "Combine").

        Args:
            x: bf16 ``[handle.num_recv_rows, handle.hidden]``, contiguous, in the layout dispatch
                returned (rows past the true count and padding rows are ignored).
            handle: the `EPHandle` of the dispatch on this rank.
            topk_weights: optional float32 ``[rows, K]`` (expanded: ``[rows]``, needs
                ``allow_multiple_reduction``), reduced back: slot k of a token gets the value its
                expert's rank holds for it.
            bias: None, a bf16 ``[handle.num_tokens, hidden]`` tensor, or a tuple of two (summed first).
            num_sms: SMs (0: the dispatch's, ``handle.num_sms``). num_qps, previous_event,
                previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream:
                as in `dispatch`.
            apply_dispatch_weights: (deep_ep extension, expanded handles whose dispatch had weights)
                multiply every row by its dispatch weight before reducing, fusing the gate weighting.

        Returns:
            ``(combined_x bf16 [T, H], combined_topk_weights float32 [T, K] or None, event)``; with
            ``_phases``, as in `dispatch`, the receive's `DeferredReceive` before ``event``.

        Raises:
            TypeError, ValueError: invalid arguments (before any communication).
            RuntimeError: destroyed buffer; or, on every rank, handles that do not match across ranks.
        """
        self._alive()
        backend = self._backend
        backend.calls += 1
        self._window_use.check_free("combine")
        bias_t, plan = call_plans.combine_plan(self, x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                                               previous_event_before_epilogue, async_with_compute_stream,
                                               allocate_on_comm_stream, apply_dispatch_weights)
        num_sms = num_sms or handle.num_sms
        inputs = (x, topk_weights, handle) + bias_t
        outputs, event = call_streams.run_call(
            backend, lambda: backend.combine(x, handle, topk_weights, bias_t, num_sms=num_sms, num_qps=num_qps,
                                             apply_dispatch_weights=plan.apply_dispatch_weights,
                                             **({} if _phases is None else {"phases": _phases})),
            previous_event, previous_event_before_epilogue, plan.async_with_compute_stream,
            plan.allocate_on_comm_stream, inputs)
        return (*outputs, event)
