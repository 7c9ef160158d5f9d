"""GPU backend: dispatch and combine with the kernels of ``deep_ep/include/deep_ep``.

One room per concern:

* this module: `GPUBackend`, a buffer's lifecycle on one rank (transport, streams, error record,
  module loading, SM counts, barrier);
* `dispatch` / `combine`: the host side of each primitive (argument structs, outputs, launches);
* `modules`: kernel sources, build-time defines, building and loading;
* `window`: the layout of a rank's window and the buffer-size hint;
* `abi`: what the host shares with the kernels (read from ``include/deep_ep/common/abi.cuh``);
* `errors`: errors recorded by the kernels; `state`: a handle's GPU-side state.

Every kernel runs on the backend's communication stream (`ElasticBuffer` orders it after the
compute stream or ``previous_event``); outputs are allocated on the caller's current stream. The
transport (`deep_ep.comm`) is NCCL's symmetric window and device communicator for a torch group
(NCCL, or gloo on a private communicator), or one allocation shared by ranks emulated on one GPU; kernels are built for the one in use.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ... import envs, jit, resources
from ...cuda.driver import error_name, stream_query
from ...cuda.streams import StreamJoin, new_stream, poll_event, release_stream, spin_until
from ...resources import DeviceResources
from ..base import Backend, BufferConfig
from . import window
from .abi import CONSTANTS, CTRL_ERROR_OFFSET, ERR_BAD_EXPERT, MAX_EXPERTS, READBACK, READBACK_WORDS, call_tag
from .combine import run_combine
from .dispatch import NOTIFY_WARPS, run_dispatch
from .errors import (CallRecord, ErrorRecord, MappedWords, agree_at_barrier, broken_label, raise_bad_expert,
                     raise_recorded)
from .modules import (BARRIER_KERNEL, THREADS, build_module, combine_defines, dispatch_defines,
                      kernel_source, launch_control, load_module, num_modules_built, tunable_defines)
from .state import GPUHandleState

__all__ = ["GPUBackend", "CallRecord", "GPUHandleState", "kernel_source", "dispatch_defines", "combine_defines",
           "tunable_defines", "THREADS", "num_modules_built"]

# The data kernels' blocks wait for each other (receive blocks for the last send block's signal),
# so all of them must be resident at once. A cooperative launch makes the driver check that and
# refuse a grid that cannot be (MPS or green contexts with fewer SMs) instead of stalling until the
# timeout; it cost nothing measurable on the H200 (docs/performance.md). Not for emulated ranks,
# whose grids share the device. DEEP_EP_COOPERATIVE=0 turns it off.
COOPERATIVE = envs.flag("DEEP_EP_COOPERATIVE")
NVLINK_GBPS = 450.0   # H200 / H100 NVLink 4, per direction per GPU (datasheet)
# The notify kernel's grid cap, in groups (warps) per SM (for emulated ranks divided by the ranks):
# every block is resident at once (it has grid barriers).
NOTIFY_GROUPS_PER_SM = 8


class GPUBackend(Backend):
    """Dispatch/combine on CUDA tensors for one rank of a buffer.

    ``group`` is a torch process group, NCCL or not (transport: `deep_ep.comm.lsa.NcclLsaTransport`,
    on the group's NCCL communicator or a private one), or a rank of an emulated group, which makes its own transport (``group.make_transport``) and loads
    modules collectively (``group.load_collectively``).

    Raises:
        RuntimeError: no CUDA device, or created during CUDA-graph capture.
        ValueError: no window size, or more ranks than a window holds (`window.check_num_ranks`). RuntimeError:
            the group spans NVLink domains and NCCL or its communicator lacks GIN (`deep_ep.comm.nccl_gin`).
    """

    transport_gin = 0   # the data kernels use a GIN (emulated nodes, or NCCL's: `_open_transport`)
    hybrid_scaleout, hybrid_node_ranks, hybrid_scaleup_ranks = False, 0, 0

    def __init__(self, group, config: BufferConfig) -> None:
        super().__init__(group, config)
        window.check_num_ranks(config.num_ranks)   # every rank sees the group's size: all refuse alike
        if not torch.cuda.is_available():
            raise RuntimeError("the GPU backend needs a CUDA device; use a gloo group with CPU tensors "
                               "to run deep_ep without a GPU")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("an ElasticBuffer cannot be created while a CUDA graph is being captured: "
                               "create it before capture (it allocates and registers memory with NCCL), "
                               "then capture dispatch/combine calls")
        num_bytes = config.num_bytes
        if num_bytes <= 0:
            raise ValueError("the GPU backend needs a window size: pass num_bytes, or "
                             "num_max_tokens_per_rank and hidden to ElasticBuffer")
        self._open_transport(group, num_bytes)
        self._set_up_streams()
        self._set_up_host_state(config)
        self.set_notify_groups_max(max(1, NOTIFY_GROUPS_PER_SM * self.num_device_sms //
                                       (self.num_ranks if self.emulated else 1)))
        self._layouts: dict = {}         # row stride -> WindowLayout
        self._destroyed = False

    def _open_transport(self, group, num_bytes: int) -> None:
        """The window of ``num_bytes`` bytes (`deep_ep.comm`), this rank's place in the group, and
        what the device lends its kernels (SMs, cooperative launches)."""
        self.emulated = hasattr(group, "make_transport")
        if self.emulated:
            self.transport = group.make_transport(num_bytes, num_allocated_qps=self.config.num_allocated_qps,
                                                  timeout_ns=int(self.config.num_gpu_timeout_secs * 1e9),
                                                  allow_hybrid_mode=self.config.allow_hybrid_mode)
            self._device = self.transport.device
        else:
            from ...comm.nccl_gin import open_nccl_transport   # one NVLink domain, or NCCL's GIN across them
            self._device = torch.device("cuda", torch.cuda.current_device())
            self.transport = open_nccl_transport(group, num_bytes, self._device, self.config)
        self.rank, self.num_ranks = self.transport.rank, self.transport.num_ranks
        self.transport_nccl = bool(self.transport.kernel_define)
        # emulated nodes (comm/gin.py): 1 direct mode, 2 hybrid mode (forwarding within a node)
        self.transport_gin = int(getattr(self.transport, "gin_define", 0))
        # hybrid mode across nodes (a receive hook's split combine is refused: `combine.run_combine`);
        # with forwarding, the ranks of a node (`dispatch_plan.check_config`, `combine._prepare`), else 0
        self.hybrid_scaleout = bool(self.config.allow_hybrid_mode and self.transport_gin)
        self.hybrid_node_ranks = self.transport.state.node_ranks if self.transport_gin == 2 else 0
        self.hybrid_scaleup_ranks = ((group.num_nvlink_ranks() if self.emulated else self.transport.num_nvlink_ranks)
                                     if self.hybrid_scaleout else 0)   # the handles' psum
        self.transport_args = self.transport.kernel_args()   # fixed for the window's life
        self.num_device_sms = torch.cuda.get_device_properties(self._device).multi_processor_count
        # Blocks a data kernel may use: every emulated rank's blocks must be resident at once.
        self._sm_limit = max(1, self.num_device_sms // (self.num_ranks if self.emulated else 1)
                             - getattr(self.transport, "nic_blocks", 0))
        self._default_sms: dict = {}     # (experts, top-k) -> SMs of a call with num_sms=0
        self.cooperative = COOPERATIVE and not self.emulated
        # Host waits (`deep_ep.cuda.streams.spin_until`): emulated ranks sleep between polls from the
        # start, since the peers' threads need the GIL to queue the kernels a wait depends on.
        self.spin_secs: Optional[float] = 0.0 if self.emulated else None

    def _set_up_streams(self) -> None:
        """The communication stream and what orders a call's kernels after the previous call's."""
        self.comm_stream = new_stream(self._device)   # never one of torch's pooled (shared) streams
        self.comm_handle = self.comm_stream.cuda_stream   # raw CUstream for prepared launches
        # A synchronous call on an NCCL-backed buffer runs on the caller's stream (`ElasticBuffer` sets
        # `call_stream` around it): the same order as a join to the communication stream and back,
        # without the four driver calls. Emulated ranks always use their own stream: a kernel spinning
        # for its peers must not hold up the rank's other work.
        self.runs_on_caller_stream = not self.emulated
        self.call_stream: Optional[int] = None
        self.stream_join = StreamJoin(self._device)
        # Where the previous call's kernels went (raw stream; None: unknown, e.g. captured in a graph)
        # and an event recorded after them when that was a caller's stream: a call on another stream
        # is ordered after them, as DeepEP's calls are by sharing one communication stream.
        self._last_stream: Optional[int] = None
        self._call_done = StreamJoin(self._device)

    def _set_up_host_state(self, config: BufferConfig) -> None:
        """What the host keeps across calls: the kernels' timeout, the mapped words they report in
        (error record, the layout stage's report), the call record, loaded modules and the fresh
        dispatches' plans."""
        self.timeout_ns = int(config.num_gpu_timeout_secs * 1e9)
        self._host_buf = torch.empty(256, dtype=torch.int32, device="cpu", pin_memory=True)
        self.err_record = ErrorRecord(self._device)   # written by the data kernels (finish_wait)
        self.readback = MappedWords(self._device, READBACK_WORDS)   # the layout stage's report (do_cpu_sync)
        self._ctrl_error: Optional[torch.Tensor] = None
        self.broken: Optional[str] = None
        self.call_record = CallRecord()   # set by each call (dispatch, combine)
        self._ready_modules: dict = {}   # (kind, structure) -> loaded module
        # Fresh dispatches' plans (`dispatch.run_dispatch`): per configuration, what is derived from
        # it and the two prepared launches.
        self.fresh_plans: dict = {}

    def set_notify_groups_max(self, groups_max: int) -> None:
        """Cap the notify kernel's grid at ``groups_max`` groups (warps; rounded down to whole blocks
        of `dispatch.NOTIFY_WARPS`, at least one block). Its blocks must all be resident at once
        (emulated ranks share the device): the default fits; larger caps are for tuning. Waits
        for this rank's kernels, then allocates the kernel's scratch
        (barrier words, the smallest bad index, INT_MAX for none, and a row of counts per block) and
        drops the fresh dispatches' plans, whose notify launches point at the old scratch."""
        if self._device.type == "cuda":
            self.drain()   # this rank's kernels only (emulated ranks never wait for the whole device)
        blocks = max(1, groups_max // NOTIFY_WARPS)
        self.notify_groups_max = blocks * NOTIFY_WARPS
        self.notify_scratch = torch.zeros(CONSTANTS["kNotifyGroupCounts"] + blocks * (self.num_ranks + MAX_EXPERTS),
                                          dtype=torch.int32, device=self._device)
        self.notify_scratch[CONSTANTS["kNotifyBadIndex"]] = 2 ** 31 - 1
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
        self.fresh_plans.clear()

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        """The CUDA device of this rank's tensors and window."""
        return self._device

    def get_comm_stream(self):
        """The buffer's dedicated communication stream (`deep_ep.cuda.streams`): where its kernels run,
        except those of a synchronous call, which run on the caller's stream (`call_stream`)."""
        return self.comm_stream

    @property
    def launch_stream(self) -> int:
        """The raw stream the current call's kernels go to."""
        return self.comm_handle if self.call_stream is None else self.call_stream

    @property
    def fill_stream(self):
        """Where poisoned outputs are filled (`deep_ep.backends.outputs`): the stream their kernels run
        on (None: the current stream, which is the caller's)."""
        return self.comm_stream if self.call_stream is None else None

    def enter_caller_stream(self, stream: int) -> None:
        """Before a synchronous call whose kernels go to the caller's raw stream ``stream``: order
        them after the previous call's kernels when those ran on another stream (an asynchronous
        call's communication stream, or another caller stream)."""
        last = self._last_stream
        if last is not None and last != stream and not torch.cuda.is_current_stream_capturing():
            if last == self.comm_handle:
                self.stream_join.wait(stream, last)     # only this buffer's kernels are queued there
            else:
                self._call_done.wait_recorded(stream)
        self.call_stream = stream

    def leave_caller_stream(self, stream: int) -> None:
        """After such a call: remember where its kernels went."""
        self.call_stream = None
        if torch.cuda.is_current_stream_capturing():
            self._last_stream = None    # torch.cuda.graph synchronises the device before a capture
        else:
            self._call_done.record(stream)
            self._last_stream = stream

    def enter_comm_stream(self) -> None:
        """Before a call on the communication stream: ordered after the previous call when that ran
        on a caller's stream (the end of its kernels, not later work on that stream)."""
        last = self._last_stream
        if last is not None and last != self.comm_handle and not torch.cuda.is_current_stream_capturing():
            self._call_done.wait_recorded(self.comm_handle)

    def leave_comm_stream(self) -> None:
        """After a call on the communication stream."""
        self._last_stream = None if torch.cuda.is_current_stream_capturing() else self.comm_handle

    def drain(self) -> None:
        """Wait for every kernel of this rank's buffer: the communication stream, and, for calls that
        ran on the caller's stream, the device (NCCL-backed buffers only; emulated ranks never do)."""
        if self.runs_on_caller_stream:
            torch.cuda.synchronize(self._device)
        else:
            self.comm_stream.synchronize()

    def device_resources(self) -> DeviceResources:
        """The device's SMs (those one rank may use: emulated ranks share the device) and its NVLink
        rate per direction (H200 NVLink 4: 450 GB/s, the datasheet's)."""
        return DeviceResources(num_device_sms=self.num_device_sms, max_sms=self._sm_limit,
                               nvlink_gbs=NVLINK_GBPS if self.num_ranks > 1 else 0.0)

    def default_num_sms(self, num_experts: int, num_topk: int) -> int:
        """SMs of a call that passed ``num_sms=0`` (`deep_ep.resources.theoretical_num_sms`)."""
        key = (num_experts, num_topk)
        num_sms = self._default_sms.get(key)
        if num_sms is None:
            num_sms = self._default_sms[key] = max(1, resources.theoretical_num_sms(
                num_experts, num_topk, num_ranks=self.num_ranks, resources=self.device_resources(),
                prefer_overlap_with_compute=self.config.prefer_overlap_with_compute))
        return num_sms

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        """Wait for this rank's communication, then a host barrier at which every rank learns whether
        a kernel of any rank recorded an error, and all raise (`errors.agree_at_barrier`).

        Raises:
            TimeoutError / RuntimeError: see `check_errors`; RuntimeError: another rank's recorded one.
        """
        agree_at_barrier(self)

    def gpu_barrier(self, stream_handle: int) -> None:
        """Queue a barrier across the ranks on the raw stream ``stream_handle``: a kernel that signals
        every peer and waits for every peer's signal (the buffer's GPU timeout applies)."""
        self.raise_if_broken()
        kernel, args = self.module("barrier", ()).function(BARRIER_KERNEL), (
            self.transport_args, jit.u64(self.timeout_ns), jit.ptr(self.err_record.device_ptr), call_tag(self.calls, 4))
        launch_control(self, stream_handle, 1, lambda: kernel.launch(1, 128, args, stream=stream_handle,
                                                                     device=self._device.index))

    def destroy(self) -> None:
        """Wait for this rank's kernels, release the window (collective for NCCL) and the stream."""
        if not self._destroyed:
            self._destroyed = True
            self.drain()  # emulated ranks: only this rank's stream (other ranks may still be running)
            self.transport.destroy()
            release_stream(self.comm_stream)
            self.stream_join.destroy()
            self._call_done.destroy()
            self.err_record.free()
            self.readback.free()

    # ------------------------------------------------------------------ dispatch / combine
    # `Backend.dispatch` and `Backend.combine` themselves (no wrapper frame between the buffer and
    # the per-call code)
    dispatch = run_dispatch
    combine = run_combine

    # ------------------------------------------------------------------ helpers for the primitives
    def layout(self, stride: int) -> window.WindowLayout:
        """The window's layout for rows of ``stride`` bytes (`window.dispatch_row_stride`,
        `window.combine_row_stride`; computed once per stride). Every rank of a call computes the same
        stride: the call's configuration is part of its tag."""
        layout = self._layouts.get(stride)
        if layout is None:
            # the window's last num_cpu_bytes hold the Engram storage (deep_ep/backends/gpu/engram.py)
            usable = self.transport.num_bytes - self.config.num_cpu_bytes
            if usable <= 0:
                raise ValueError(f"num_bytes={self.transport.num_bytes} leaves no window for dispatch and combine "
                                 f"beside num_cpu_bytes={self.config.num_cpu_bytes} (the Engram storage); pass "
                                 f"num_bytes = ElasticBuffer.get_buffer_size_hint(...) + num_cpu_bytes")
            layout = self._layouts[stride] = window.make_layout(self.num_ranks, 0, 0, self.config.num_topk, False,
                                                            usable, stride=stride)
        return layout

    def launch_data(self, prepared, n_sms: int) -> None:
        """Launch a dispatch/combine kernel on the comm stream; a cooperative launch the device
        refuses (its blocks cannot all be resident: MPS or green contexts with fewer SMs) becomes a
        LaunchError that says which ``num_sms`` to lower."""
        self.call_record.launched_call = self.calls
        try:
            if self.transport_gin and not self.transport_nccl:   # emulated nodes: the NIC kernel beside it
                self.transport.launch_data(self.module("gin_nic", ()), self.launch_stream, n_sms,
                                           lambda: prepared.launch(self.launch_stream))
            else:
                prepared.launch(self.launch_stream)
        except jit.LaunchError as exc:
            if "COOPERATIVE_LAUNCH_TOO_LARGE" in str(exc):
                # Kernels of this call may already be queued (notify, layout) and the peers wait for
                # this one: the buffer is out of step with them, so it cannot be used again.
                self.broken = "cooperative launch refused"
                raise jit.LaunchError(f"rank {self.rank}: the device cannot hold all {n_sms} blocks of "
                                      f"{prepared.function.name} at once (fewer SMs available, e.g. under MPS "
                                      f"or a green context). This buffer can no longer be used (its peers "
                                      f"wait for this call): create a new one and pass a smaller num_sms") from exc
            raise

    def module(self, kind: str, structure: tuple):
        """The built and loaded module of ``kind`` for ``structure`` (the arguments of its defines
        function); the first use builds and loads it, collectively for emulated ranks."""
        module = self._ready_modules.get((kind, structure))
        if module is None:
            key, module = build_module(kind, structure, self.transport_nccl, self.transport_gin)
            if self.emulated:
                self.group.load_collectively(key, lambda: load_module(module, self._device.index))
            else:
                load_module(module, self._device.index)
            self._ready_modules[(kind, structure)] = module
        return module

    def transport_args_for(self, num_qps: int):
        """The data kernels' ``TransportArgs`` for a call with ``num_qps`` RDMA QPs: across nodes its
        puts spread over that many GIN contexts (`Transport.kernel_args_using`, 0: all; every rank
        must pass the same); elsewhere, and for the control kernels, the buffer's own."""
        return self.transport.kernel_args_using(num_qps)

    def num_sms(self, num_sms: int, num_experts: int, num_topk: int) -> int:
        """Blocks of the data kernels: ``num_sms``, or the model's default capped so that every
        emulated rank's blocks fit on the device at once."""
        limit = self._sm_limit
        blocks = num_sms or self.default_num_sms(num_experts, num_topk)
        if blocks < 1:
            raise ValueError(f"num_sms must be >= 1, got {blocks}")
        if blocks > limit:
            if self.emulated:
                raise ValueError(
                    f"{self.num_ranks} emulated ranks x {blocks} SMs > {self.num_device_sms} SMs of the device: "
                    f"every rank's blocks must be resident at once (ranks wait on each other); "
                    f"use num_sms <= {limit}")
            blocks = limit
        return blocks

    def host_read(self, tensor: torch.Tensor, stream) -> list:
        """``tensor`` (int32, on the device) as a list, once ``stream``'s work before now is done.

        A pinned copy and an event, polled: a pageable copy (``.cpu()``) would wait inside the
        driver for the kernel it depends on, which spins until every peer arrives, and while it
        waits other threads' launches can block too (with emulated ranks: the peers' launches).
        """
        num_words = tensor.numel()
        if self._host_buf.numel() < num_words:
            self._host_buf = torch.empty(max(num_words, 2 * self._host_buf.numel()), dtype=torch.int32, device="cpu",
                                         pin_memory=True)
        pinned = self._host_buf[:num_words]
        with torch.cuda.stream(stream):
            pinned.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        if not poll_event(event, self.config.num_cpu_timeout_secs, self.spin_secs):
            self.broken = "host timeout"
            raise TimeoutError(f"deep_ep: rank {self.rank} waited {self.config.num_cpu_timeout_secs} s on the "
                               f"host for the GPU (num_cpu_timeout_secs); the GPU-side timeout did not fire")
        return pinned.tolist()

    def wait_readback(self, seq: int, num_experts: int, num_topk: int) -> list:
        """The layout stage's report of call ``seq`` (the kReadback* words), once it is written.

        The host spins on mapped memory (no copy, no event; `deep_ep.cuda.streams.spin_until`: no
        sleep for the first milliseconds, since a sleep lasts the OS's timer slack, tens of
        microseconds), yielding the GIL now and then; with emulated ranks it sleeps between polls
        from the start, so that the other ranks' threads get the GIL.

        Raises:
            ValueError: a rank's ``topk_idx`` held an out-of-range expert id (raised on every rank;
                nothing moved, the buffer stays usable).
            TimeoutError / RuntimeError: the layout stage recorded a timeout or a capacity error, a
                kernel recorded one in the host's error record with no report to come, or the report
                did not come within ``num_cpu_timeout_secs``; the buffer is then unusable.
            KeyboardInterrupt: passed on; the buffer is then unusable (its peers wait for the rest
                of the call).
        """
        words, err = self.readback.words, self.err_record.words
        seq_word = READBACK["seq"]
        stream_state = [600, time.monotonic() + 1.0]   # the stream's last cuStreamQuery, the next one's time

        def ended() -> bool:
            # Also stops at an error in the host's record (not an out-of-range id: an earlier call's,
            # raised at the next call as usual) when no report is coming; and, asked once a second,
            # when the stream of the notify kernel (the last work this call queued) has finished or
            # faulted without the report: a wait for it would last until the host's timeout.
            if words[seq_word] == seq or err[0] not in (0, ERR_BAD_EXPERT):
                return True
            if time.monotonic() < stream_state[1]:
                return False
            stream_state[:] = stream_query(self.launch_stream, self._device.index), time.monotonic() + 1.0
            return stream_state[0] != 600

        try:
            arrived = spin_until(ended, self.config.num_cpu_timeout_secs, self.spin_secs)
        except KeyboardInterrupt:
            self.broken = "interrupted while waiting for the counts"   # the call is half queued
            raise
        if arrived and words[seq_word] != seq and err[0] in (0, ERR_BAD_EXPERT):
            self.broken = "no report of the counts"
            what = "finished" if stream_state[0] == 0 else f"failed with {error_name(stream_state[0])}"
            raise RuntimeError(f"deep_ep: rank {self.rank}: the stream of the notify kernel {what} without the "
                               f"report of the counts (call {seq}); the buffer is unusable"
                               + ("" if stream_state[0] == 0 else " (a fault: compute-sanitizer finds where)"))
        if arrived and words[seq_word] != seq:
            self._raise(self.err_record.read())
        if not arrived:
            self.broken = "host timeout"   # kernels of this call may still be queued
            raise TimeoutError(f"deep_ep: rank {self.rank} waited {self.config.num_cpu_timeout_secs} s on the "
                               f"host for the GPU (num_cpu_timeout_secs) in phase dispatch notify: the counts of "
                               f"call {seq} (the notify kernel's report) never came, and the GPU-side timeout "
                               f"did not fire")
        report = self.readback.ints[:READBACK["counts"] + num_experts // self.num_ranks].tolist()   # header, L counts
        status = report[READBACK["status"]]
        if status == ERR_BAD_EXPERT:
            raise_bad_expert(report[READBACK["peer"]], report[READBACK["detail"]], report[READBACK["value"]],
                             num_experts, num_topk)
        if status != 0:
            self._raise((status, report[READBACK["rank"]], report[READBACK["peer"]], report[READBACK["detail"]]))
        return report

    def read_error(self) -> Optional[tuple]:
        """(code, rank, peer, phase) recorded by a kernel of this rank, or None (waits for the stream)."""
        words = self.host_read(self._ctrl_error_view(), self.comm_stream)
        return tuple(words) if words[0] != 0 else None

    def check_errors(self) -> None:
        """Raise if a kernel of this rank recorded an error (waits for the communication stream).

        Raises:
            TimeoutError: a peer did not arrive within ``num_gpu_timeout_secs``.
            RuntimeError: this rank would have received more rows than its outputs hold.
        """
        err = self.read_error()
        if err is not None:
            self._raise(err)

    def raise_if_broken(self) -> None:
        """Raise if an earlier error left the buffer unusable, or a kernel recorded one since
        (read from the mapped host record: no stream operation)."""
        if self.broken is not None:
            raise RuntimeError(f"deep_ep: this buffer is no longer usable after an earlier GPU error "
                               f"({self.broken}); destroy it and create a new one")
        if self.err_record.words[0] == 0:   # the common case: one read of mapped memory
            return
        recorded = self.err_record.read()
        if recorded[0] == ERR_BAD_EXPERT:
            # Found by an earlier call without a host sync; every rank voided that call alike.
            self.err_record.clear()
            record = self.call_record
            raise_bad_expert(recorded[1], recorded[2], recorded[3], record.num_experts, record.num_topk)
        if recorded[0] != 0:
            self._raise(recorded)

    def _raise(self, record: tuple) -> None:
        self.broken = broken_label(record[0])
        raise_recorded(record, self.config.num_gpu_timeout_secs, self.call_record.num_max_tokens,
                       self.call_record.launched_call)

    def _ctrl_error_view(self) -> torch.Tensor:
        if self._ctrl_error is None:
            self._ctrl_error = self.transport.window_tensor()[CTRL_ERROR_OFFSET:CTRL_ERROR_OFFSET + 16].view(torch.int32)
        return self._ctrl_error
