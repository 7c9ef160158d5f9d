"""`ElasticBuffer`: the public API of deep_ep (names and meaning follow DeepEP V2).

This module owns every argument check. Each public method first validates and normalises its
arguments (the ``_validate_*`` functions below, one rule after the other, each raising a clear
exception that names the argument, what was expected and what was given), then runs the backend
inside a thin stream/event layer. Nothing is communicated before validation passes.

Exceptions (all raised on the rank that received the bad argument, before any communication):

* `TypeError`  - an argument of the wrong Python type or the wrong tensor dtype;
* `ValueError` - a wrong shape, device, layout (non-contiguous), value (expert id out of range, more
  tokens than ``num_max_tokens_per_rank``, ...) or a handle of another buffer / configuration;
* `RuntimeError` - the buffer was destroyed; or, raised by the backend on *every* rank, a condition
  no single rank can see (ranks disagreeing on the configuration, a receive that would not fit).

Argument errors are local: the rank that got the bad argument raises and skips the call. In SPMD code
every rank normally gets the same kind of argument and raises the same error; a rank whose peers
raised while its own arguments were fine waits in the collective until the buffer's timeout
(``num_cpu_timeout_secs`` on CPU, ``num_gpu_timeout_secs`` on GPU), then raises `TimeoutError` naming
the peer that did not arrive and the phase.

Value checks on ``topk_idx`` (``-1 <= id < num_experts``) read the tensor: always done for CPU
tensors; for GPU tensors only when the call synchronises with the host anyway (``do_cpu_sync``).
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import time
import warnings
import weakref
from typing import Optional, Union

import torch

from .backends import BufferConfig, group_rank_and_size, is_cpu_group, make_backend
from .event import EventOverlap
from .handle import EPHandle

__all__ = ["ElasticBuffer", "topk_idx_t"]

topk_idx_t = torch.int64
"""dtype of ``topk_idx`` tensors."""

_BUFFER_ALIGNMENT = 2 * 1024 * 1024
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
_FP8 = torch.float8_e4m3fn


# ============================================================================ validation rules
def _fmt_tensor(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device}"


_INT32_MAX = 2 ** 31 - 1   # sizes and counts travel as int32 (kernel arguments, count tensors)


def _check_int(name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = _INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def _check_number(name: str, value, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_tensor(name: str, t, *, dtype: Union[torch.dtype, tuple], shape: tuple,
                  device: torch.device, contiguous: bool = True) -> torch.Tensor:
    """Check one tensor argument. ``shape`` entries are ints or None (any size)."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)

    def want() -> str:  # messages are built only on failure: this runs on every call
        return "/".join(str(d).replace("torch.", "") for d in dtypes)

    def want_shape() -> str:
        return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({want()} {want_shape()}), got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {want()}, got {_fmt_tensor(t)}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {want_shape()}, got {_fmt_tensor(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the buffer's device), got {_fmt_tensor(t)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got {_fmt_tensor(t)} with strides {t.stride()}")
    return t


def _check_event(previous_event) -> None:
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise TypeError(f"previous_event must be None or an EventOverlap, got {type(previous_event).__name__}")


def _check_x(x, device: torch.device, name: str = "x") -> tuple:
    """``x`` → ``(data, sf)``: bf16 ``[T, H]``, or FP8 ``(float8_e4m3fn [T, H], sf [T, num_sf])``
    with ``sf`` float32 (``num_sf = H / 128``) or int32 packed UE8M0 (``num_sf = ceil(H / 512)``)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{name} as a tuple must be (fp8 data, scale factors), got {len(x)} items")
        data, sf = x
        _check_tensor(f"{name}[0] (FP8 data)", data, dtype=_FP8, shape=(None, None), device=device)
        T, H = data.shape
        if H % 128 != 0:
            raise ValueError(f"FP8 {name} needs hidden to be a multiple of 128 (one scale per 128 "
                             f"channels), got hidden={H}")
        if not isinstance(sf, torch.Tensor):
            raise TypeError(f"{name}[1] (scale factors) must be a torch.Tensor, got {type(sf).__name__}")
        num_sf = H // 128 if sf.dtype == torch.float32 else -(-H // 512)
        _check_tensor(f"{name}[1] (scale factors: float32 [T, H/128] or int32 packed UE8M0 [T, H/512])",
                      sf, dtype=(torch.float32, torch.int32), shape=(T, num_sf), device=device)
        return data, sf
    if isinstance(x, torch.Tensor) and x.dtype == _FP8:
        raise TypeError(f"FP8 {name} must be given as a tuple (data, scale factors), got a bare "
                        f"{_fmt_tensor(x)}")
    _check_tensor(name, x, dtype=torch.bfloat16, shape=(None, None), device=device)
    return x, None


def _min_max(t: torch.Tensor) -> tuple:
    """``(min, max)`` of an integer tensor as Python ints.

    For CUDA tensors the two values go to pinned memory and the host polls an event: a plain
    ``int(t.min())`` is a pageable copy, which waits inside the driver and can hold up other
    threads' kernel launches meanwhile (emulated ranks in threads would then wait on each other).
    """
    if not t.is_cuda:
        return int(t.min()), int(t.max())
    pair = torch.stack([t.min(), t.max()])
    host = torch.empty(2, dtype=pair.dtype, pin_memory=True)
    host.copy_(pair, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        time.sleep(2e-5)
    lo, hi = host.tolist()
    return int(lo), int(hi)


def _check_topk_values(topk_idx: torch.Tensor, num_experts: int) -> None:
    if topk_idx.numel() == 0:
        return
    lo, hi = _min_max(topk_idx)
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        where = (topk_idx == bad).nonzero()[0].tolist()
        raise ValueError(f"topk_idx holds expert id {bad} at {where}: ids must be in [0, {num_experts}) "
                         f"or -1 (no selection)")


def _normalise_bias(bias, num_tokens: int, hidden: int, device: torch.device) -> tuple:
    if bias is None:
        return ()
    items = (bias,) if isinstance(bias, torch.Tensor) else bias
    if not isinstance(items, (tuple, list)):
        raise TypeError(f"bias must be None, a tensor or a tuple of up to two tensors, got {type(bias).__name__}")
    if len(items) > 2:
        raise ValueError(f"bias takes at most two tensors, got {len(items)}")
    out = []
    for i, b in enumerate(items):
        if b is None:
            continue
        out.append(_check_tensor(f"bias[{i}]", b, dtype=torch.bfloat16, shape=(num_tokens, hidden),
                                 device=device))
    return tuple(out)


# ============================================================================ the buffer
class ElasticBuffer:
    """Expert-parallel communication buffer: dispatch tokens to experts, combine the results back.

    Args:
        group: the ranks taking part. A ``torch.distributed`` gloo group runs on CPU tensors
            (`deep_ep.backends.cpu`); an NCCL group, or an emulated-rank group from `deep_ep.emulated`,
            runs on the GPU.
        num_bytes: size in bytes of the communication window per rank; ``None`` computes it with
            `get_buffer_size_hint` from ``num_max_tokens_per_rank``, ``hidden``, ``num_topk`` (0 on CPU
            when they are not given: the CPU backend allocates per call).
        num_max_tokens_per_rank: M, the most tokens one rank dispatches per call (0 = not fixed; then
            ``do_cpu_sync=False`` needs it per call).
        hidden: the largest hidden size dispatched (0 = not fixed).
        num_topk: the largest number of experts per token (0 = not fixed).
        use_fp8_dispatch: size the window for FP8 data (only affects the size estimate).
        deterministic: keep the reference row order even where a faster order exists (the CPU
            backend always does).
        allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute: DeepEP V2's
            algorithm choices, accepted for compatibility; no backend uses them yet.
        num_gpu_timeout_secs, num_cpu_timeout_secs: seconds before a GPU kernel / a host wait gives
            up with a `TimeoutError` (on CPU each collective phase of a call waits at most
            ``num_cpu_timeout_secs``, whatever the process group's own timeout).
        explicitly_destroy: resources are only released by `destroy()` (a warning is issued if the
            buffer is garbage-collected alive); otherwise they are released when it is collected.

    Raises:
        TypeError / ValueError: invalid arguments. NotImplementedError: the group needs the GPU
        backend and it is not available.
    """

    def __init__(self, group, num_bytes: Optional[int] = None, *, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 num_gpu_timeout_secs: float = 100, num_cpu_timeout_secs: float = 300,
                 explicitly_destroy: bool = False) -> None:
        self._backend = None
        self._destroyed = False
        rank, num_ranks = group_rank_and_size(group)
        _check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=0)
        _check_int("hidden", hidden, minimum=0)
        _check_int("num_topk", num_topk, minimum=0)
        for name, v in (("use_fp8_dispatch", use_fp8_dispatch), ("deterministic", deterministic),
                        ("allow_hybrid_mode", allow_hybrid_mode),
                        ("allow_multiple_reduction", allow_multiple_reduction),
                        ("prefer_overlap_with_compute", prefer_overlap_with_compute),
                        ("explicitly_destroy", explicitly_destroy)):
            _check_bool(name, v)
        _check_number("num_gpu_timeout_secs", num_gpu_timeout_secs)
        _check_number("num_cpu_timeout_secs", num_cpu_timeout_secs)
        if use_fp8_dispatch and hidden % 128 != 0:
            raise ValueError(f"use_fp8_dispatch needs hidden to be a multiple of 128, got hidden={hidden}")
        if num_bytes is None:
            if num_max_tokens_per_rank and hidden:
                num_bytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden,
                                                               num_topk, use_fp8_dispatch)
            elif is_cpu_group(group):
                num_bytes = 0          # the CPU backend allocates per call
            else:
                raise ValueError("a GPU buffer needs num_bytes, or num_max_tokens_per_rank and hidden to "
                                 "compute it (see ElasticBuffer.get_buffer_size_hint)")
        _check_int("num_bytes", num_bytes, minimum=0, maximum=None)

        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.buffer_id = next(_buffer_ids)
        self.config = BufferConfig(
            buffer_id=self.buffer_id, rank=rank, num_ranks=num_ranks, num_bytes=num_bytes,
            num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk,
            use_fp8_dispatch=use_fp8_dispatch, deterministic=deterministic,
            allow_hybrid_mode=allow_hybrid_mode, allow_multiple_reduction=allow_multiple_reduction,
            prefer_overlap_with_compute=prefer_overlap_with_compute,
            num_gpu_timeout_secs=num_gpu_timeout_secs, num_cpu_timeout_secs=num_cpu_timeout_secs,
            explicitly_destroy=explicitly_destroy)
        self._backend = make_backend(group, self.config)
        _live_buffers.add(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def device(self) -> torch.device:
        """Device every tensor of this buffer lives on (``cpu`` for gloo groups)."""
        return self._backend.device

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
        """Release the buffer's resources. Calling it again is a no-op; any other method then raises
        `RuntimeError`. Collective on GPU: every rank must call it."""
        if not self._destroyed and self._backend is not None:
            self._destroyed = True
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

    # ------------------------------------------------------------------ sizes and topology
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False) -> int:
        """Bytes of communication window one rank needs, rounded up to 2 MiB.

        For GPU groups this is `deep_ep.backends.window_layout.buffer_size_hint`. For CPU (gloo)
        groups it estimates the staging memory of one dispatch: send and receive buffers of
        ``R * M`` packed rows each (data, FP8 scale factors, ``num_topk`` ids and weights, a source
        index), rounded up to 2 MiB.

        Args:
            group: the process group (or emulated group).
            num_max_tokens_per_rank: M (>= 0). hidden: H (>= 0). num_topk: K (>= 0).
            use_fp8_dispatch: size for FP8 data with float32 scale factors (H multiple of 128).
        Raises:
            TypeError / ValueError on invalid arguments.
        """
        _, num_ranks = group_rank_and_size(group)
        _check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=0)
        _check_int("hidden", hidden, minimum=0)
        _check_int("num_topk", num_topk, minimum=0)
        _check_bool("use_fp8_dispatch", use_fp8_dispatch)
        if use_fp8_dispatch and hidden % 128 != 0:
            raise ValueError(f"use_fp8_dispatch needs hidden to be a multiple of 128, got hidden={hidden}")
        if not is_cpu_group(group):
            from .backends.gpu import window as window_layout
            return int(window_layout.buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden,
                                                      num_topk, use_fp8_dispatch))
        row = (hidden + hidden // 128 * 4) if use_fp8_dispatch else 2 * hidden
        row += num_topk * 12 + 4
        total = 2 * num_ranks * num_max_tokens_per_rank * row
        return -(-total // _BUFFER_ALIGNMENT) * _BUFFER_ALIGNMENT

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int) -> int:
        """SMs a dispatch/combine needs to saturate the links (the ``num_sms`` to pass; 0 = auto).

        GPU: the bandwidth model of `window_layout.theoretical_num_sms`, capped so that emulated
        ranks' blocks all fit on the device. Returns 0 on CPU.

        Raises:
            ValueError: ``num_experts`` or ``num_topk`` below 1. RuntimeError: destroyed buffer.
        """
        self._alive()
        _check_int("num_experts", num_experts, minimum=1)
        _check_int("num_topk", num_topk, minimum=1)
        return int(self._backend.get_theoretical_num_sms(num_experts, num_topk))

    def get_logical_domain_size(self) -> tuple:
        """``(scale-out ranks, scale-up ranks)`` as the algorithms use them (``(1, R)`` on CPU)."""
        self._alive()
        return tuple(self._backend.get_logical_domain_size())

    def get_physical_domain_size(self) -> tuple:
        """``(scale-out ranks, scale-up ranks)`` of the hardware (``(1, R)`` on CPU)."""
        self._alive()
        return tuple(self._backend.get_physical_domain_size())

    def get_comm_stream(self):
        """The CUDA stream communication runs on, or ``None`` on CPU."""
        self._alive()
        return self._backend.get_comm_stream()

    def barrier(self) -> None:
        """Block until every rank of the group calls `barrier` (collective)."""
        self._alive()
        self._backend.barrier()

    def capture(self):
        """Context manager to wrap CUDA-graph capture of dispatch/combine calls (no-op on CPU)."""
        self._alive()
        return self._backend.capture()

    # ------------------------------------------------------------------ stream / event layer
    def _run(self, fn, previous_event: Optional[EventOverlap], async_with_compute_stream: bool,
             allocate_on_comm_stream: bool, inputs: list):
        """Run ``fn`` (the backend call) with DeepEP's stream semantics; returns ``(outputs, event)``.

        GPU: the communication stream waits for ``previous_event`` (or for the current compute
        stream), outputs are allocated on the comm stream if ``allocate_on_comm_stream``, and then
        either the compute stream waits for the communication (synchronous) or an `EventOverlap`
        carrying the completion event is returned (``async_with_compute_stream``) while inputs and
        outputs are kept alive for the other stream. CPU: calls ``fn`` and returns an empty event.
        """
        comm = self._backend.get_comm_stream()
        if comm is None:
            return fn(), EventOverlap()
        join = self._backend.stream_join
        if join is not None and previous_event is None and not async_with_compute_stream \
                and not allocate_on_comm_stream and torch._C._cuda_getDevice() == comm.device_index:
            # The common synchronous call, on raw handles and reused events (a few us of host time
            # instead of ~12 with torch's stream and event objects); same ordering as below. Only
            # when the buffer's device is current: a raw default-stream handle (0) means the null
            # stream of the current context.
            compute_raw = torch._C._cuda_getCurrentRawStream(comm.device_index)
            comm_raw = comm.cuda_stream
            join.wait(comm_raw, compute_raw)
            outputs = fn()
            join.wait(compute_raw, comm_raw)
            return outputs, EventOverlap()
        compute = torch.cuda.current_stream()
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(compute)
        with (torch.cuda.stream(comm) if allocate_on_comm_stream else contextlib.nullcontext()):
            outputs = fn()
        event = torch.cuda.Event()
        event.record(comm)
        if allocate_on_comm_stream:
            for t in _collect_tensors(outputs):
                t.record_stream(compute)
        if not async_with_compute_stream:
            compute.wait_event(event)
            return outputs, EventOverlap()
        # Async: the communication stream may still read the inputs (and the handle) and write the
        # outputs after the caller drops them.
        for t in _collect_tensors(inputs) + ([] if allocate_on_comm_stream else _collect_tensors(outputs)):
            t.record_stream(comm)
        return outputs, EventOverlap(event, extra_tensors=(tuple(inputs), outputs))

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0,
                 previous_event: Optional[EventOverlap] = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: Optional[EPHandle] = None,
                 do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send every token to the ranks holding its selected experts (collective).

        Args:
            x: bf16 ``[T, H]``, or an FP8 tuple ``(float8_e4m3fn [T, H], sf)`` with ``sf`` float32
                ``[T, H/128]`` (one scale per 128 channels) or int32 ``[T, ceil(H/512)]`` (UE8M0
                exponents packed four to an int32); H a multiple of 128 for FP8. Contiguous, on the
                buffer's device. ``T`` may be 0 and may differ between ranks.
            topk_idx: `topk_idx_t` (int64) ``[T, K]``, global expert ids in ``[0, num_experts)`` or
                -1 (no selection). Required unless ``handle`` is given (then it must be None).
            topk_weights: optional float32 ``[T, K]``, travels with the ids (None with ``handle``).
            cumulative_local_expert_recv_stats: optional int32 ``[E / R]``; incremented in place by
                the received (unpadded) pairs per local expert.
            num_experts: E, divisible by the number of ranks. Required unless ``handle`` is given.
            num_max_tokens_per_rank: M for this call (default: the buffer's; must not exceed it);
                ``T <= M`` is checked when M > 0; required (> 0) for ``do_cpu_sync=False``.
            expert_alignment: A >= 1 (default 1): per-expert row counts are padded to multiples of A.
            num_sms: SMs to use on GPU (0 = automatic; ignored on CPU).
            previous_event: an `EventOverlap` the communication waits for (default: the current
                stream). async_with_compute_stream: return immediately with an event to wait on.
                allocate_on_comm_stream: allocate outputs on the communication stream.
            handle: an `EPHandle` from an earlier dispatch of this buffer on this rank: cached
                dispatch, same layout, ``x`` must have ``handle.num_tokens`` rows and ``handle.hidden``
                channels; the layout arguments default to the handle's and must match it if given
                (``do_expand=True`` for an expanded handle, or left False).
            do_handle_copy: return a handle that survives later calls (always true on CPU).
            do_cpu_sync: wait for the receive counts on the host and size outputs exactly (default:
                True, False with ``handle``). False: outputs sized for the worst case (docs/design.md).
            do_expand: expanded layout, one row per (token, local expert), grouped by local expert.
            do_zero_padding: zero the padding rows of the expanded layout.
            use_tma_aligned_col_major_sf: FP8 only: receive scale factors column-major, row count
                rounded up to 4 (a ``[rows, num_sf]`` view of ``[num_sf, align4(rows)]`` storage).

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``:
            non-expanded: ``recv_x`` ``[rows, H]`` (or the FP8 tuple), ``recv_topk_idx`` int64
            ``[rows, K]`` local expert ids or -1, ``recv_topk_weights`` float32 ``[rows, K]`` or None;
            expanded: ``recv_topk_idx`` int64 ``[rows]`` (-1 on padding), ``recv_topk_weights``
            float32 ``[rows]`` (1.0 without weights, 0 on padding). Received order: by source rank,
            then source token (expanded: by local expert first). ``rows`` is the true count, or the
            worst case of docs/design.md with ``do_cpu_sync=False``. A cached dispatch returns the
            handle's routing: ``recv_topk_weights`` is None (non-expanded) or
            ``handle.recv_topk_weights`` (expanded). ``event``: an `EventOverlap`.

        Raises:
            TypeError, ValueError: invalid arguments (before any communication).
            RuntimeError: destroyed buffer; or, on every rank, ranks that disagree on the
            configuration or receives that would not fit.
        """
        self._alive()
        args = self._validate_dispatch(
            x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
            num_max_tokens_per_rank, expert_alignment, num_sms, previous_event,
            async_with_compute_stream, allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync,
            do_expand, do_zero_padding, use_tma_aligned_col_major_sf)
        data, sf = args.pop("data"), args.pop("sf")
        # Kept alive for the communication stream in async mode (with a handle: its tensors too).
        inputs = [t for t in (data, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats, handle)
                  if t is not None]
        outputs, event = self._run(
            lambda: self._backend.dispatch(data, sf, topk_idx, topk_weights, **args),
            previous_event, async_with_compute_stream, allocate_on_comm_stream, inputs)
        recv_x, recv_topk_idx, recv_topk_weights, out_handle = outputs
        return recv_x, recv_topk_idx, recv_topk_weights, out_handle, event

    def _validate_dispatch(self, x, topk_idx, topk_weights, stats, num_experts, num_max_tokens_per_rank,
                           expert_alignment, num_sms, previous_event, async_with_compute_stream,
                           allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync, do_expand,
                           do_zero_padding, use_tma_aligned_col_major_sf) -> dict:
        """All dispatch argument rules, in order; returns the backend's keyword arguments."""
        dev, cfg = self.device, self.config
        _check_int("num_sms", num_sms, minimum=0)
        _check_event(previous_event)
        for name, v in (("async_with_compute_stream", async_with_compute_stream),
                        ("allocate_on_comm_stream", allocate_on_comm_stream),
                        ("do_handle_copy", do_handle_copy), ("do_expand", do_expand),
                        ("do_zero_padding", do_zero_padding),
                        ("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)):
            _check_bool(name, v)
        if do_cpu_sync is not None:
            _check_bool("do_cpu_sync", do_cpu_sync)
        for name, v in (("num_experts", num_experts), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                        ("expert_alignment", expert_alignment)):
            if v is not None:
                _check_int(name, v, minimum=1 if name != "num_max_tokens_per_rank" else 0)
        data, sf = _check_x(x, dev)
        T, H = data.shape

        if handle is not None:
            # --- cached dispatch: the layout comes from the handle
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle must be an EPHandle, got {type(handle).__name__}")
            handle.check_matches(buffer_id=self.buffer_id, num_ranks=self.num_ranks, rank=self.rank,
                                 device=dev)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx / topk_weights: "
                                 "the routing is the handle's")
            for name, given, own in (("num_experts", num_experts, handle.num_experts),
                                     ("expert_alignment", expert_alignment, handle.expert_alignment),
                                     ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                      handle.num_max_tokens_per_rank)):
                if given is not None and given != own:
                    raise ValueError(f"{name}={given} does not match the handle's {name}={own}")
            if do_expand and not handle.do_expand:
                raise ValueError("do_expand=True, but the handle was made by a non-expanded dispatch")
            if do_cpu_sync:
                raise ValueError("do_cpu_sync=True cannot be used with a handle: a cached dispatch "
                                 "never synchronises with the host")
            if T != handle.num_tokens or H != handle.hidden:
                raise ValueError(f"x must have the handle's shape [{handle.num_tokens}, {handle.hidden}] "
                                 f"(num_tokens, hidden of the dispatch that made it), got {list(data.shape)}")
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            num_max_tokens_per_rank, do_expand = handle.num_max_tokens_per_rank, handle.do_expand
            do_cpu_sync = handle.do_cpu_sync   # for the backend: "size outputs as the handle's layout"
            K = handle.num_topk
        else:
            # --- fresh dispatch
            if topk_idx is None:
                raise ValueError("topk_idx is required unless a handle is given")
            if num_experts is None:
                raise ValueError("num_experts is required unless a handle is given")
            if num_experts % self.num_ranks != 0:
                raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks "
                                 f"({self.num_ranks}): experts are split evenly over ranks")
            _check_tensor("topk_idx", topk_idx, dtype=topk_idx_t, shape=(T, None), device=dev)
            K = topk_idx.shape[1]
            if K < 1:
                raise ValueError(f"topk_idx must have at least one column (num_topk >= 1), got {_fmt_tensor(topk_idx)}")
            if cfg.num_topk and K > cfg.num_topk:
                raise ValueError(f"topk_idx has {K} columns, more than the buffer's num_topk={cfg.num_topk}")
            if topk_weights is not None:
                _check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(T, K), device=dev)
            if num_max_tokens_per_rank is None:
                num_max_tokens_per_rank = cfg.num_max_tokens_per_rank
            elif cfg.num_max_tokens_per_rank and num_max_tokens_per_rank > cfg.num_max_tokens_per_rank:
                raise ValueError(f"num_max_tokens_per_rank={num_max_tokens_per_rank} exceeds the buffer's "
                                 f"num_max_tokens_per_rank={cfg.num_max_tokens_per_rank}")
            if expert_alignment is None:
                expert_alignment = 1
            if do_cpu_sync is None:
                do_cpu_sync = True
            if not do_cpu_sync and num_max_tokens_per_rank == 0:
                raise ValueError("do_cpu_sync=False sizes outputs for the worst case and needs "
                                 "num_max_tokens_per_rank (> 0), in the buffer or in this call")
            if dev.type == "cpu" or do_cpu_sync:
                _check_topk_values(topk_idx, num_experts)
        if num_max_tokens_per_rank and T > num_max_tokens_per_rank:
            raise ValueError(f"x has {T} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}")
        if cfg.hidden and H > cfg.hidden:
            raise ValueError(f"x has hidden={H}, more than the buffer's hidden={cfg.hidden}")
        if stats is not None:
            _check_tensor("cumulative_local_expert_recv_stats", stats, dtype=torch.int32,
                          shape=(num_experts // self.num_ranks,), device=dev)
        return dict(data=data, sf=sf, num_experts=num_experts,
                    num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment,
                    num_sms=num_sms, handle=handle, do_handle_copy=do_handle_copy,
                    do_cpu_sync=do_cpu_sync, do_expand=do_expand, do_zero_padding=do_zero_padding,
                    use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                    cumulative_local_expert_recv_stats=stats)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias=None, num_sms: int = 0, previous_event: Optional[EventOverlap] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Send expert outputs back to their source ranks and reduce them (collective).

        Args:
            x: bf16 ``[handle.num_recv_rows, handle.hidden]``, contiguous: the expert outputs in the
                layout dispatch returned (rows past the true count and padding rows are ignored).
            handle: the `EPHandle` of the dispatch on this rank.
            topk_weights: optional float32, ``[rows, K]`` (non-expanded) or ``[rows]`` (expanded),
                reduced back too (dispatch's backward).
            bias: None, a bf16 ``[handle.num_tokens, hidden]`` tensor, or a tuple of up to two, added
                to the result in float32.
            num_sms, previous_event, async_with_compute_stream, allocate_on_comm_stream: as in
                `dispatch`.

        Returns:
            ``(combined_x, combined_topk_weights, event)``: ``combined_x`` bf16
            ``[handle.num_tokens, hidden]``: non-expanded, the float32 sum over the ranks a token went
            to; expanded, the float32 sum over its top-k of ``recv_topk_weights * x``; plus the
            biases, rounded once to bf16. ``combined_topk_weights`` float32 ``[T, K]`` or None.

        Raises:
            TypeError, ValueError: invalid arguments (before any communication).
            RuntimeError: destroyed buffer; or, on every rank, handles that do not match across ranks.
        """
        self._alive()
        bias_t = self._validate_combine(x, handle, topk_weights, bias, num_sms, previous_event,
                                        async_with_compute_stream, allocate_on_comm_stream)
        inputs = [t for t in (x, topk_weights, handle) + bias_t if t is not None]
        (combined_x, combined_w), event = self._run(
            lambda: self._backend.combine(x, handle, topk_weights, bias_t, num_sms=num_sms),
            previous_event, async_with_compute_stream, allocate_on_comm_stream, inputs)
        return combined_x, combined_w, event

    def _validate_combine(self, x, handle, topk_weights, bias, num_sms, previous_event,
                          async_with_compute_stream, allocate_on_comm_stream) -> tuple:
        """All combine argument rules, in order; returns the biases as a tuple of 0-2 tensors."""
        dev = self.device
        _check_int("num_sms", num_sms, minimum=0)
        _check_event(previous_event)
        _check_bool("async_with_compute_stream", async_with_compute_stream)
        _check_bool("allocate_on_comm_stream", allocate_on_comm_stream)
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be the EPHandle returned by dispatch, got {type(handle).__name__}")
        handle.check_matches(buffer_id=self.buffer_id, num_ranks=self.num_ranks, rank=self.rank, device=dev)
        if isinstance(x, (tuple, list)):
            raise TypeError("combine takes bf16 x, not an FP8 tuple")
        rows = handle.num_recv_rows
        _check_tensor("x", x, dtype=torch.bfloat16, shape=(rows, handle.hidden), device=dev)
        if topk_weights is not None:
            shape = (rows,) if handle.do_expand else (rows, handle.num_topk)
            _check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=shape, device=dev)
        return _normalise_bias(bias, handle.num_tokens, handle.hidden, dev)


def _collect_tensors(obj) -> list:
    """Every tensor inside nested tuples/lists/EPHandles."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _collect_tensors(o)]
    if hasattr(obj, "__dataclass_fields__"):  # an EPHandle and its backend state (read by the kernels)
        return [t for v in vars(obj).values() for t in _collect_tensors(v)]
    return []
