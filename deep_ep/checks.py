"""Argument checks of the public API: the only place deep_ep validates what a user passes.

`ElasticBuffer` runs these before anything else; backends trust what comes out (validated,
normalised, every default resolved, every flag a real bool). `validate_dispatch` / `validate_combine`
hold every rule of a call; `deep_ep.call_plans` runs them once per call signature. Each rule raises a
clear exception naming the argument, what was expected and what was given:

* `TypeError`  - an argument of the wrong Python type or the wrong tensor dtype;
* `ValueError` - a wrong shape, device, layout (non-contiguous), value (expert id out of range, more
  tokens than ``num_max_tokens_per_rank``, ...) or a handle of another buffer / configuration.

Value checks on ``topk_idx`` (``-1 <= id < num_experts``) read the tensor for CPU tensors only; on
GPU tensors the kernels check the ids (every rank raises the same `ValueError`, docs/troubleshooting.md).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .cuda.streams import poll_event
from .event import EventHandle, EventOverlap
from .handle import EPHandle

__all__ = [
    "INT32_MAX", "BUFFER_ALIGNMENT", "check_int", "check_bool", "check_number", "check_tensor", "check_event",
    "check_x", "check_topk_values", "normalise_bias", "check_buffer_args", "check_size_hint_args",
    "check_sms_args", "CallPlan", "validate_dispatch", "validate_combine",
]

INT32_MAX = 2 ** 31 - 1            # sizes and counts travel as int32 (kernel arguments, count tensors)
BUFFER_ALIGNMENT = 2 * 1024 * 1024  # host memory for the scale-out path comes in 2 MiB pages
FP8 = torch.float8_e4m3fn
topk_idx_t = torch.int64


def _fmt_tensor(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device}"


# ============================================================================ single values
def check_int(name: str, value, *, minimum: Optional[int] = None, maximum: Optional[int] = INT32_MAX) -> int:
    """``value`` if it is an int (not a bool) within ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` as a bool. A flag is what DeepEP takes as one: a bool, an int 0 or 1 (DeepEP's own
    tests pass flags as ints), a numpy bool or integer 0 / 1, or a one-element torch bool or integer
    tensor holding 0 or 1.

    Raises:
        TypeError: anything else (2, 1.0, 'yes', None).
    """
    if value is True or value is False:
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    try:
        number = operator.index(value)   # ints, numpy integers, one-element integer or bool tensors
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        number = None
    if number == 0 or number == 1:
        return number == 1
    raise TypeError(f"{name} must be a bool (or an int 0 / 1), got {kind.__name__} ({value!r})")


def check_number(name: str, value, *, positive: bool = True) -> float:
    """``value`` if it is a finite int or float (``> 0`` with ``positive``, else ``>= 0``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if not positive and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_tensor(name: str, t, *, dtype: Union[torch.dtype, tuple], shape: tuple,
                 device: torch.device, contiguous: bool = True) -> torch.Tensor:
    """Check one tensor argument. ``shape`` entries are ints or None (any size)."""
    # This runs on every call: the common case is a few comparisons; messages are built on failure.
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({_want_dtype(dtype)} {_want_shape(shape)}), "
                        f"got {type(t).__name__}")
    if t.dtype is not dtype and not (isinstance(dtype, tuple) and t.dtype in dtype):
        raise TypeError(f"{name} must have dtype {_want_dtype(dtype)}, got {_fmt_tensor(t)}")
    sizes = t.shape
    if sizes != shape:   # equal only when ``shape`` has no wildcards: then nothing is left to compare
        if len(sizes) != len(shape):
            raise ValueError(f"{name} must have shape {_want_shape(shape)}, got {_fmt_tensor(t)}")
        for s, n in zip(shape, sizes):
            if s is not None and s != n:
                raise ValueError(f"{name} must have shape {_want_shape(shape)}, got {_fmt_tensor(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the buffer's device), got {_fmt_tensor(t)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got {_fmt_tensor(t)} with strides {t.stride()}")
    return t


def _want_dtype(dtype) -> str:
    return "/".join(str(d).replace("torch.", "") for d in (dtype if isinstance(dtype, tuple) else (dtype,)))


def _want_shape(shape: tuple) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_event(name: str, event) -> None:
    """``event`` is None, an `EventHandle` (`ElasticBuffer.capture`) or an `EventOverlap`."""
    if event is not None and not isinstance(event, (EventHandle, EventOverlap)):
        raise TypeError(f"{name} must be None, an EventHandle (ElasticBuffer.capture()) or an EventOverlap, "
                        f"got {type(event).__name__}")


def check_x(x, device: torch.device, name: str = "x") -> tuple:
    """``x`` -> ``(data, sf)``: bf16 ``[T, H]``, or FP8 ``(float8_e4m3fn [T, H], sf [T, num_sf])``
    with ``sf`` float32 (``num_sf = H / 128``) or int32 packed UE8M0 (``num_sf = ceil(H / 512)``).
    ``sf`` may have any strides, as in DeepEP (column-major scales from a TMA-aligned FP8 cast, for
    one); the returned ``sf`` is contiguous (a copy when it was not)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{name} as a tuple must be (fp8 data, scale factors), got {len(x)} items")
        data, sf = x
        check_tensor(f"{name}[0] (FP8 data)", data, dtype=FP8, shape=(None, None), device=device)
        T, H = data.shape
        if H % 128 != 0:
            raise ValueError(f"FP8 {name} needs hidden to be a multiple of 128 (one scale per 128 "
                             f"channels), got hidden={H}")
        if not isinstance(sf, torch.Tensor):
            raise TypeError(f"{name}[1] (scale factors) must be a torch.Tensor, got {type(sf).__name__}")
        num_sf = H // 128 if sf.dtype == torch.float32 else -(-H // 512)
        check_tensor(f"{name}[1] (scale factors: float32 [T, H/128] or int32 packed UE8M0 [T, H/512])",
                     sf, dtype=(torch.float32, torch.int32), shape=(T, num_sf), device=device, contiguous=False)
        return data, sf.contiguous()
    if isinstance(x, torch.Tensor) and x.dtype == FP8:
        raise TypeError(f"FP8 {name} must be given as a tuple (data, scale factors), got a bare "
                        f"{_fmt_tensor(x)}")
    if isinstance(x, torch.Tensor) and x.dtype is not torch.bfloat16:
        raise TypeError(f"{name} must have dtype bfloat16, got {_fmt_tensor(x)}: cast it with .to(torch.bfloat16), "
                        f"or pass FP8 as a tuple (float8_e4m3fn data, scale factors)")
    check_tensor(name, x, dtype=torch.bfloat16, shape=(None, None), device=device)
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
    host = torch.empty(2, dtype=pair.dtype, device="cpu", pin_memory=True)
    host.copy_(pair, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    poll_event(done)
    lo, hi = host.tolist()
    return int(lo), int(hi)


def check_topk_values(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Every expert id is in ``[0, num_experts)`` or -1 (reads the tensor)."""
    if topk_idx.numel() == 0:
        return
    lo, hi = _min_max(topk_idx)
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        where = (topk_idx == bad).nonzero()[0].tolist()
        raise ValueError(f"topk_idx holds expert id {bad} at {where}: ids must be in [0, {num_experts}) "
                         f"or -1 (no selection)")


def normalise_bias(bias, num_tokens: int, hidden: int, device: torch.device) -> tuple:
    """``bias`` (None, a tensor, or a tuple of up to two, entries may be None) -> a tuple of 0-2 bf16
    ``[T, H]`` tensors."""
    if bias is None:
        return ()
    items = (bias,) if isinstance(bias, torch.Tensor) else bias
    if not isinstance(items, (tuple, list)):
        raise TypeError(f"bias must be None, a tensor or a tuple of up to two tensors, got {type(bias).__name__}")
    if len(items) > 2:
        raise ValueError(f"bias takes at most two tensors, got {len(items)}")
    return tuple(check_tensor(f"bias[{i}]", b, dtype=torch.bfloat16, shape=(num_tokens, hidden), device=device)
                 for i, b in enumerate(items) if b is not None)


# ============================================================================ constructor and queries
def check_buffer_args(num_bytes, num_cpu_bytes, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                      deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute,
                      sl_idx, num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs,
                      explicitly_destroy) -> tuple:
    """Every rule of `ElasticBuffer.__init__`'s arguments. Returns the flags as bools:
    ``(use_fp8_dispatch, deterministic, allow_hybrid_mode, allow_multiple_reduction,
    prefer_overlap_with_compute, explicitly_destroy)``."""
    if num_bytes is not None:
        check_int("num_bytes", num_bytes, minimum=0, maximum=None)
    check_int("num_cpu_bytes", num_cpu_bytes, minimum=0, maximum=None)
    if num_cpu_bytes % BUFFER_ALIGNMENT:
        raise ValueError(f"num_cpu_bytes must be a multiple of 2 MiB ({BUFFER_ALIGNMENT}), got {num_cpu_bytes}")
    check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=0)
    check_int("hidden", hidden, minimum=0)
    check_int("num_topk", num_topk, minimum=0)
    flags = tuple(check_bool(name, v) for name, v in (
        ("use_fp8_dispatch", use_fp8_dispatch), ("deterministic", deterministic),
        ("allow_hybrid_mode", allow_hybrid_mode), ("allow_multiple_reduction", allow_multiple_reduction),
        ("prefer_overlap_with_compute", prefer_overlap_with_compute), ("explicitly_destroy", explicitly_destroy)))
    check_int("sl_idx", sl_idx, minimum=0, maximum=15)
    check_int("num_allocated_qps", num_allocated_qps, minimum=0)
    check_number("num_cpu_timeout_secs", num_cpu_timeout_secs)
    check_number("num_gpu_timeout_secs", num_gpu_timeout_secs)
    if flags[0] and hidden % 128 != 0:
        raise ValueError(f"use_fp8_dispatch needs hidden to be a multiple of 128, got hidden={hidden}")
    return flags


def check_size_hint_args(num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode,
                         allow_multiple_reduction) -> tuple:
    """Every rule of `ElasticBuffer.get_buffer_size_hint`'s arguments. Returns the flags as bools:
    ``(use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)``."""
    check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=0)
    check_int("hidden", hidden, minimum=0)
    check_int("num_topk", num_topk, minimum=0)
    flags = tuple(check_bool(name, v) for name, v in (
        ("use_fp8_dispatch", use_fp8_dispatch), ("allow_hybrid_mode", allow_hybrid_mode),
        ("allow_multiple_reduction", allow_multiple_reduction)))
    if flags[0] and hidden % 128 != 0:
        raise ValueError(f"use_fp8_dispatch needs hidden to be a multiple of 128, got hidden={hidden}")
    return flags


def check_sms_args(num_ranks, num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs,
                   sm_write_gbs) -> None:
    """Every rule of `ElasticBuffer.get_theoretical_num_sms`'s arguments."""
    check_int("num_experts", num_experts, minimum=1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks ({num_ranks})")
    check_int("num_topk", num_topk, minimum=1, maximum=num_experts)
    check_int("num_scaleout_topk", num_scaleout_topk, minimum=0)
    if num_scaleout_topk != 0:
        raise ValueError(f"num_scaleout_topk is reserved for group-limited gates and must be 0, got "
                         f"{num_scaleout_topk}")
    check_number("rdma_gbs", rdma_gbs, positive=False)
    check_number("nvlink_gbs", nvlink_gbs, positive=False)
    check_number("sm_read_gbs", sm_read_gbs)
    check_number("sm_write_gbs", sm_write_gbs)


@dataclass(slots=True)
class CallPlan:
    """What the checks of one dispatch or combine resolved, for every call of the same signature
    (`deep_ep.call_plans`): the backend call's arguments other than the call's tensors (defaults
    resolved; a cached dispatch's layout is its handle's), the stream flags as bools, and what each
    call re-checks.

    ``check_ids``: a fresh dispatch of CPU tensors, whose expert ids are read on every call (on a
    GPU the kernels check them). ``num_max_tokens_per_rank`` 0: no bound on the tokens.
    """
    device: torch.device
    async_with_compute_stream: bool
    allocate_on_comm_stream: bool
    num_experts: int = 0
    num_max_tokens_per_rank: int = 0
    expert_alignment: int = 1
    num_sms: int = 0
    do_handle_copy: bool = True
    do_cpu_sync: bool = True
    do_expand: bool = False
    do_zero_padding: bool = False
    use_tma_aligned_col_major_sf: bool = False
    check_ids: bool = False
    apply_dispatch_weights: bool = False


def _check_call_resources(buf, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                          async_with_compute_stream, allocate_on_comm_stream) -> tuple:
    """The rules every dispatch and combine share; returns the two stream flags as bools."""
    check_int("num_sms", num_sms, minimum=0)
    check_int("num_qps", num_qps, minimum=0)
    if num_qps > buf.num_allocated_qps:
        why = " (a CPU buffer allocates none unless num_allocated_qps is passed)" if buf.num_allocated_qps == 0 else ""
        raise ValueError(f"num_qps={num_qps} exceeds the buffer's num_allocated_qps={buf.num_allocated_qps}{why}: "
                         f"pass 0 (automatic) or buffer.get_theoretical_num_qps(num_sms)")
    check_event("previous_event", previous_event)
    check_event("previous_event_before_epilogue", previous_event_before_epilogue)
    return (check_bool("async_with_compute_stream", async_with_compute_stream),
            check_bool("allocate_on_comm_stream", allocate_on_comm_stream))


def _check_handle(buf, handle, what: str) -> None:
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle must be {what}, got {type(handle).__name__}")
    handle.check_matches(buffer_id=buf.buffer_id, num_ranks=buf.num_ranks, rank=buf.rank_idx, device=buf.device)


# ============================================================================ dispatch and combine
def validate_dispatch(buf, x, topk_idx, topk_weights, stats, num_experts, num_max_tokens_per_rank,
                      expert_alignment, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                      async_with_compute_stream, allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync,
                      do_expand, do_zero_padding, use_tma_aligned_col_major_sf) -> tuple:
    """All dispatch argument rules, in order (``buf`` is the `ElasticBuffer`; ``stats`` is
    ``cumulative_local_expert_recv_stats``). Returns ``(data, sf, plan)``: ``x`` as its data and
    scale factors (None for bf16) and the call's `CallPlan`."""
    dev, cfg = buf.device, buf.config
    streams = _check_call_resources(buf, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                                    async_with_compute_stream, allocate_on_comm_stream)
    do_handle_copy = check_bool("do_handle_copy", do_handle_copy)
    do_expand = check_bool("do_expand", do_expand)
    do_zero_padding = check_bool("do_zero_padding", do_zero_padding)
    use_tma_aligned_col_major_sf = check_bool("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
    if do_cpu_sync is not None:
        do_cpu_sync = check_bool("do_cpu_sync", do_cpu_sync)
    if num_experts is not None:
        check_int("num_experts", num_experts, minimum=1)
    if num_max_tokens_per_rank is not None:
        check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=0)
    if expert_alignment is not None:
        check_int("expert_alignment", expert_alignment, minimum=1)
    data, sf = check_x(x, dev)
    T, H = data.shape

    if handle is not None:
        # --- cached dispatch: the layout comes from the handle
        _check_handle(buf, handle, "an EPHandle")
        if topk_idx is not None:
            raise ValueError("a cached dispatch (handle given) takes no topk_idx: the routing is the handle's")
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
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(T, handle.num_topk), device=dev)
        num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
        num_max_tokens_per_rank, do_expand = handle.num_max_tokens_per_rank, handle.do_expand
        do_cpu_sync = handle.do_cpu_sync   # for the backend: "size outputs as the handle's layout"
    else:
        # --- fresh dispatch
        if topk_idx is None:
            raise ValueError("topk_idx is required unless a handle is given")
        if num_experts is None:
            raise ValueError("num_experts is required unless a handle is given")
        if num_experts % buf.num_ranks != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks "
                             f"({buf.num_ranks}): experts are split evenly over ranks")
        check_tensor("topk_idx", topk_idx, dtype=topk_idx_t, shape=(T, None), device=dev)
        K = topk_idx.shape[1]
        if K < 1:
            raise ValueError(f"topk_idx must have at least one column (num_topk >= 1), got {_fmt_tensor(topk_idx)}")
        if cfg.num_topk and K > cfg.num_topk:
            raise ValueError(f"topk_idx has {K} columns, more than the buffer's num_topk={cfg.num_topk}")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(T, K), device=dev)
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
        if dev.type == "cpu":
            # GPU tensors: the notify kernel checks every id and every rank raises the same ValueError
            # (with a host sync at once, else at the buffer's next call), without a host round trip here.
            check_topk_values(topk_idx, num_experts)
    if num_max_tokens_per_rank and T > num_max_tokens_per_rank:
        raise ValueError(f"x has {T} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}")
    if cfg.hidden and H > cfg.hidden:
        raise ValueError(f"x has hidden={H}, more than the buffer's hidden={cfg.hidden}")
    if stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", stats, dtype=torch.int32,
                     shape=(num_experts // buf.num_ranks,), device=dev)
    return data, sf, CallPlan(
        dev, *streams, num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
        expert_alignment=expert_alignment, num_sms=num_sms, do_handle_copy=do_handle_copy, do_cpu_sync=do_cpu_sync,
        do_expand=do_expand, do_zero_padding=do_zero_padding,
        use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, check_ids=handle is None and dev.type == "cpu")


def validate_combine(buf, x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                     previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream,
                     apply_dispatch_weights) -> tuple:
    """All combine argument rules, in order. Returns ``(bias, plan)``: the biases as a tuple of 0-2
    tensors and the call's `CallPlan`."""
    dev = buf.device
    streams = _check_call_resources(buf, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                                    async_with_compute_stream, allocate_on_comm_stream)
    apply_dispatch_weights = check_bool("apply_dispatch_weights", apply_dispatch_weights)
    _check_handle(buf, handle, "the EPHandle returned by dispatch")
    if isinstance(x, (tuple, list)):
        raise TypeError("combine takes bf16 x, not an FP8 tuple")
    rows = handle.num_recv_rows
    check_tensor("x", x, dtype=torch.bfloat16, shape=(rows, handle.hidden), device=dev)
    if topk_weights is not None:
        shape = (rows,) if handle.do_expand else (rows, handle.num_topk)
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=shape, device=dev)
        if handle.do_expand and not buf.config.allow_multiple_reduction:
            raise ValueError("combine of an expanded handle reduces topk_weights only with multiple reduction: "
                             "create the buffer with allow_multiple_reduction=True (the default)")
    if apply_dispatch_weights and not handle.do_expand:
        raise ValueError("apply_dispatch_weights=True needs an expanded handle (do_expand=True): a "
                         "non-expanded row already holds a rank's sum over its experts")
    if apply_dispatch_weights and handle.recv_topk_weights is None:
        raise ValueError("apply_dispatch_weights=True needs a handle whose dispatch had topk_weights")
    bias = normalise_bias(bias, handle.num_tokens, handle.hidden, dev)
    return bias, CallPlan(dev, *streams, apply_dispatch_weights=apply_dispatch_weights)
