"""DeepEP's V1 low-latency dispatch and combine on direct kernels (``include/deep_ep/kernels/ll_direct.cuh``):
every (token, top-k slot) row goes straight to its place in the expert owner's window, at
[local expert][source rank][place] (its place: the earlier tokens of its rank that chose that expert),
and the sender then publishes its per-expert counts, tagged with the call; the receive waits for
those counts and writes DeepEP's layouts (the same as `deep_ep.legacy.low_latency`'s, bit for bit).
A combine writes each received row's expert output into its source rank's window at (token, slot)
and flags every rank; the source waits for the flags and sums the top-k rows (float32, slot order,
one bf16 rounding); combines alternate the halves' combine rows and flags on their own, so that
two combines of one handle never share them. No counts exchange before the rows, no host reads: graph capturable.

Rank masks (``enable_shrink``): a dispatch copies the Buffer's mask on the stream when it is called
and both its phases use that copy; its combine follows the dispatch's decisions about its sources
(int32 ``[R]``, ``DirectRoute.present``), so a mask changed meanwhile takes effect at the next
dispatch, and no change of a mask makes two ranks disagree on whether they exchange in a call. A
rank exchanges with a peer when neither masks the other; it waits for no rank it masks, and a peer
whose flag does not come within ``num_gpu_timeout_secs`` is masked in the Buffer's mask (DeepEP's
failure detection) instead of failing the call, so a rank that stops making calls is left out by
its peers. Such a peer is taken as failed (also recorded in ``Buffer._rank_state[R:]``: a combine
leaves out the peers taken as failed since its dispatch rather than wait out the timeout again) and
must be stopped: one that was only slow and goes on may still write combine rows into the window of
a rank that no longer waits for them, where a later combine reads.

Where: one node (NCCL's LSA window or emulated ranks on one GPU) of up to 512 ranks, ``E <= 1024``
experts, top-k ``K <= 16`` (and, with rank masks, up to 65535 tokens per rank): `applies` says so, and
`deep_ep.legacy.low_latency` takes the expanded `ElasticBuffer` path elsewhere (emulated nodes,
larger sizes).

Window: both buffer halves in one window, the Buffer's low-latency window when it is large enough
(DeepEP's ``get_low_latency_rdma_size_hint`` is; never the normal-mode one,
`deep_ep.legacy.internode.open_elastic_buffers`), else one made for them (collective, not during a CUDA-graph
capture); each half has control words of its own (`impls/ll_direct.cuh`). Receive hooks: the call
launches its kernel's send phase, the hook its receive phase; in between nothing holds an SM. Without
a hook, one launch runs both phases (the grid the larger of the two), cooperatively where the data
kernels are (`GPUBackend.cooperative`): its receiving blocks wait for its sending blocks, so all must be
resident at once. Emulated ranks launch the two phases one after the other even without a hook: their
grids share one device, and a receive spinning in one rank's grid could hold the SMs another rank's
send still needs (a send phase never waits, so two launches always make progress).
"""
from __future__ import annotations

import ctypes
import zlib
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from .. import jit
from ..backends.gpu.abi import CONSTANTS, CTRL_BYTES, _read_constants
from ..event import EventHandle, EventOverlap
from .layouts import NUM_CHANNELS_PER_SCALE, LowLatencyHandle, check_combine_inputs, dispatch_receive

__all__ = ["applies", "prepare", "dispatch", "combine", "window_bytes", "Regions", "KERNEL_NAMES", "SOURCE",
           "DISPATCH_KERNEL", "COMBINE_KERNEL", "SEND_PHASE", "RECEIVE_PHASE", "BOTH_PHASES"]

_CONSTANTS = _read_constants(Path(__file__).resolve().parents[1] / "include" / "deep_ep" / "impls" / "ll_direct.cuh",
                             CONSTANTS)
_THREADS = _CONSTANTS["kLlDirectThreads"]
_WARPS = _CONSTANTS["kLlDirectWarps"]
MAX_TOPK = _CONSTANTS["kLlDirectMaxTopk"]
MAX_EXPERTS = _CONSTANTS["kLlDirectMaxExperts"]
MAX_RANKS = _CONSTANTS["kLlDirectMaxRanks"]
MAX_SLOTS = _CONSTANTS["kLlDirectMaxSlots"]
_CHUNK_CHANNELS = 8               # bf16 channels of one 16-byte load (the combine's sum)
_SEGMENT = _CONSTANTS["kLlDirectSegment"]   # 16-byte chunks of a row one warp of a receive copies
_ALIGNMENT = 128
_INT32_LIMIT = 2 ** 31

# one kernel per call kind, launched for its send phase, then for its receive phase (both at once
# without a receive hook)
DISPATCH_KERNEL = "deep_ep::dispatch_ll_direct"
COMBINE_KERNEL = "deep_ep::combine_ll_direct"
KERNEL_NAMES = (DISPATCH_KERNEL, COMBINE_KERNEL)
SEND_PHASE = _CONSTANTS["kLlDirectSendPhase"]
RECEIVE_PHASE = _CONSTANTS["kLlDirectReceivePhase"]
BOTH_PHASES = _CONSTANTS["kLlDirectBothPhases"]    # a call without a receive hook: one launch
SOURCE = "#include <deep_ep/kernels/ll_direct.cuh>\n"
# the Buffer's attributes: a window made for the calls (when its own is too small), the stream of
# the last kernel
_WINDOW_KEY = "_ll_direct_window"
_STREAM_KEY = "_ll_direct_stream"
_COMBINE_KEY = "_ll_direct_combine"   # the next combine's half and the halves held by combine hooks


class Regions(ctypes.Structure):
    """``LlDirectRegions`` of impls/ll_direct.cuh: byte offsets of a half's regions in every window."""
    _fields_ = [("rows", ctypes.c_int64), ("scales", ctypes.c_int64), ("pairs", ctypes.c_int64),
                ("combine", ctypes.c_int64)]


class DirectRoute(NamedTuple):
    """What a combine needs of its direct dispatch: the window (`ElasticBuffer`), the half's
    `Regions`, each received row's route back (int32 ``[L, R*T_max]``: source rank * T_max * K +
    token * K + slot), the received counts (int32 ``[L]``), the dispatch's token count, and with a
    rank mask the sources the dispatch took part with (int32 ``[R]``, 1 = in; else None)."""
    window: object
    regions: Regions
    routes: torch.Tensor
    recv_count: torch.Tensor
    num_tokens: int
    present: Optional[torch.Tensor] = None


def _align(value: int) -> int:
    return -(-value // _ALIGNMENT) * _ALIGNMENT


def _half_bytes(num_ranks: int, num_local_experts: int, num_slots: int, hidden: int, num_topk: int) -> int:
    rows = num_local_experts * num_ranks * num_slots
    return (_align(rows * 2 * hidden) + _align(rows * (hidden // NUM_CHANNELS_PER_SCALE) * 4) + _align(rows * 4)
            + _align(num_slots * num_topk * 2 * hidden))


def window_bytes(num_ranks: int, num_local_experts: int, num_slots: int, hidden: int, num_topk: int) -> int:
    """Bytes of window both halves of direct calls of these sizes need (the control region included):
    per half, rows ``[L, R, T_max]`` of up to ``2 * hidden`` bytes, their scales and (token, slot)
    words, and the combine's ``T_max * K`` bf16 rows."""
    return CTRL_BYTES + 2 * _half_bytes(num_ranks, num_local_experts, num_slots, hidden, num_topk)


def _regions(half: int, num_ranks: int, num_local_experts: int, num_slots: int, hidden: int,
             num_topk: int) -> Regions:
    rows = num_local_experts * num_ranks * num_slots
    base = CTRL_BYTES + half * _half_bytes(num_ranks, num_local_experts, num_slots, hidden, num_topk)
    scales = base + _align(rows * 2 * hidden)
    pairs = scales + _align(rows * (hidden // NUM_CHANNELS_PER_SCALE) * 4)
    return Regions(base, scales, pairs, pairs + _align(rows * 4))


def applies(owner, device: torch.device, num_experts: int, num_topk: int, num_slots: int) -> bool:
    """Whether a low-latency call of ``owner`` (a `deep_ep.Buffer`) runs on the direct kernels:
    on a CUDA device, a transport of one node (not the emulated GIN), and sizes within the
    kernels' limits."""
    if device.type != "cuda":
        return False
    backend = owner._alive()._backend
    num_ranks = owner.group_size
    return (not getattr(backend, "transport_gin", 0) and num_ranks <= MAX_RANKS and num_experts <= MAX_EXPERTS
            and num_topk <= MAX_TOPK and (num_slots <= MAX_SLOTS or not owner.enable_shrink)
            and num_ranks * num_slots * num_topk < _INT32_LIMIT
            and num_experts * num_slots < _INT32_LIMIT)


def _load(backend) -> object:
    """The module on the backend's device, built and loaded once (collectively for emulated ranks:
    a load waits for the device, where the peers' kernels may wait for this rank)."""
    module = getattr(backend, "_ll_direct_module", None)
    if module is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("deep_ep.Buffer: the direct low-latency kernels are not loaded yet; make a first "
                               "low-latency call before CUDA-graph capture")
        from ..backends.gpu.modules import load_module
        nccl = bool(backend.transport_nccl)
        module = jit.build("deep_ep_ll_direct", SOURCE, defines={"EP_TRANSPORT_NCCL": int(nccl)}, use_nccl=nccl)
        device_index = backend.device.index
        if backend.emulated:
            backend.group.load_collectively(("ll_direct", nccl), lambda: load_module(module, device_index))
        else:
            load_module(module, device_index)
        backend._ll_direct_module = module
    return module


def prepare(owner) -> None:
    """With ``enable_shrink`` on a GPU of one node, at the Buffer's creation (collective): build and
    load the direct kernels on every rank, then meet at a barrier. Otherwise each rank would build
    them at its first call, and a slow build could outlast its peers' ``num_gpu_timeout_secs``:
    they would mask a healthy rank for good. On each window the calls may use: the Buffer's own and
    its low-latency one (a window made later by a call loads them from the process's build)."""
    windows = [owner._alive(), owner.__dict__.get("_low_latency_extra_buffer")]
    backends = [window._backend for window in windows if window is not None]
    if any(getattr(backend, "transport_gin", 0) for backend in backends):
        return
    for backend in backends:
        _load(backend)
    owner._alive().barrier()


def _window(owner, need: int):
    """The `ElasticBuffer` whose window holds both halves: the Buffer's low-latency window when large
    enough (made with it: its own where ``num_nvl_bytes`` is 0, else one of ``num_rdma_bytes``, never
    the normal-mode one: `deep_ep.legacy.internode.open_elastic_buffers` says why), else one made for
    ``need`` bytes (collective; kept for later calls, destroyed with the Buffer)."""
    buffer = owner._alive()
    home = buffer if owner.num_nvl_bytes == 0 else owner.__dict__.get("_low_latency_extra_buffer")
    if home is not None and not home.is_destroyed and home.num_bytes - home._backend.config.num_cpu_bytes >= need:
        return home
    extra = owner.__dict__.get(_WINDOW_KEY)
    if extra is not None and extra.num_bytes >= need:
        return extra
    if torch.cuda.is_current_stream_capturing():
        have = (extra or home or buffer).num_bytes
        raise RuntimeError(f"deep_ep.Buffer: this low-latency call needs a {need}-byte window, larger than its "
                           f"low-latency window's {have}; make the first such call before CUDA-graph capture (or "
                           f"pass a larger num_rdma_bytes)")
    from ..buffer import ElasticBuffer
    if extra is not None:
        extra.destroy()
    extra = ElasticBuffer(owner.group, num_bytes=need, explicitly_destroy=owner.explicitly_destroy,
                          **owner._low_latency_options)
    owner.__dict__[_WINDOW_KEY] = extra
    return extra


def _launch(owner, window, name: str, blocks: int, args: tuple, device: torch.device) -> None:
    """Launch ``name`` on the current stream, after the previous direct kernel of ``owner`` when
    that went to another stream (the halves' tags count calls in stream order)."""
    stream = torch.cuda.current_stream(device)
    capturing = torch.cuda.is_current_stream_capturing()
    last = owner.__dict__.get(_STREAM_KEY)
    if last is not None and last != stream and not capturing:
        stream.wait_stream(last)
    owner.__dict__[_STREAM_KEY] = None if capturing else stream
    backend = window._backend
    cooperative = args[1] == BOTH_PHASES and bool(getattr(backend, "cooperative", False))
    _load(backend).function(name).launch(blocks, _THREADS, args, stream=stream, device=device.index,
                                         cooperative=cooperative)


def _one_launch(backend, return_recv_hook: bool) -> bool:
    """Whether a call runs both phases in one launch: without a receive hook, off emulated ranks
    (module docstring)."""
    return not return_recv_hook and not getattr(backend, "emulated", True)


def _fingerprint(*sizes) -> jit.u32:
    """16 bits of a call's sizes that every rank must agree on, carried by every flag: a rank that
    disagrees is found at the wait (a mismatch error) instead of reading rows of another layout."""
    return jit.u32(zlib.crc32(repr(sizes).encode()) & 0xFFFF)


def _blocks(backend, work: int) -> int:
    """Blocks of a launch with ``work`` units: emulated ranks' receive phases wait for the others'
    send phases on the same device, so each rank keeps to its share of the SMs
    (`GPUBackend.num_sms`); elsewhere a block per SM of the device."""
    resources = backend.device_resources()
    limit = resources.max_sms if getattr(backend, "emulated", True) else resources.num_device_sms
    return max(1, min(work, limit))


def dispatch(owner, x: torch.Tensor, topk_idx: torch.Tensor, num_slots: int, num_experts: int, use_fp8: bool,
             round_scale: bool, use_ue8m0: bool, async_finish: bool, return_recv_hook: bool,
             stats: Optional[torch.Tensor]) -> tuple:
    """`deep_ep.Buffer.low_latency_dispatch` on the direct kernels, its arguments checked there (and
    `applies`); returns what it returns. The handle carries a `DirectRoute` (``handle.direct``).

    Raises:
        RuntimeError: both buffer halves held (as the expanded path); a window to make during a
            CUDA-graph capture; a GPU error an earlier call recorded.
    """
    device = x.device
    num_ranks = owner.group_size
    num_local_experts = num_experts // num_ranks
    num_tokens, hidden = x.shape
    num_topk = topk_idx.shape[1]
    half = owner._free_half("low_latency_dispatch")
    window = _window(owner, window_bytes(num_ranks, num_local_experts, num_slots, hidden, num_topk))
    backend = window._backend
    backend.raise_if_broken()
    _load(backend)
    regions = _regions(half, num_ranks, num_local_experts, num_slots, hidden, num_topk)
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    topk_idx = topk_idx.contiguous()
    received = dispatch_receive(num_local_experts, num_ranks, num_slots, hidden, use_fp8, use_ue8m0, device)
    routes = torch.empty((num_local_experts, num_ranks * num_slots), dtype=torch.int32, device=device)
    handle = LowLatencyHandle((received.src_info, received.layout_range, num_slots, hidden, num_experts), None,
                              num_topk, half)
    # the Buffer's mask and failed ranks (where timeouts mark a peer), the call's copy of the mask
    # (both phases see one mask) and the receive's decisions
    rank_state = owner._rank_state if owner.enable_shrink else None
    rank_view = None if rank_state is None else owner._mask_if_shrink().clone()
    present = None if rank_state is None else torch.empty(num_ranks, dtype=torch.int32, device=device)
    handle.direct = DirectRoute(window, regions, routes, received.recv_count, num_tokens, present)
    handle.number = owner._mark_dispatched(half)
    transport = backend.transport_args
    fingerprint = _fingerprint("dispatch", hidden, num_topk, num_slots, num_experts, bool(use_fp8),
                               rank_state is not None)
    # the receive: a warp per row segment of the most rows a rank can receive (a token names an
    # expert once)
    row_bytes = hidden if use_fp8 else 2 * hidden
    max_rows = num_ranks * num_slots * min(num_topk, num_local_experts)
    receive_warps = max_rows * -(-row_bytes // (16 * _SEGMENT))

    def args(phase: int) -> tuple:
        return (transport, phase, half, regions, x, topk_idx, num_tokens, hidden, num_topk, num_experts,
                num_local_experts, num_slots, int(use_fp8), int(round_scale), int(use_ue8m0),
                received.data_storage, received.scales_storage, received.recv_count, received.src_info,
                received.layout_range, stats, routes, rank_view, rank_state, present, fingerprint,
                jit.u64(backend.timeout_ns), jit.ptr(backend.err_record.device_ptr))

    send_blocks, receive_blocks = _blocks(backend, num_tokens), _blocks(backend, -(-receive_warps // _WARPS))
    one_launch = _one_launch(backend, return_recv_hook)
    if one_launch:
        _launch(owner, window, DISPATCH_KERNEL, max(send_blocks, receive_blocks), args(BOTH_PHASES), device)
    else:
        _launch(owner, window, DISPATCH_KERNEL, send_blocks, args(SEND_PHASE), device)

    def receive() -> None:
        if not one_launch:
            _launch(owner, window, DISPATCH_KERNEL, receive_blocks, args(RECEIVE_PHASE), device)
            if rank_view is not None and device.type == "cuda":   # a hook on another stream reads them
                for tensor in (rank_view, present):
                    tensor.record_stream(torch.cuda.current_stream(device))
        handle.set_rows(routes, routes, routes)    # the dispatch is received: its combine may run

    hook = owner._receive_or_hook(receive, "low_latency_dispatch", device, half, return_recv_hook)
    return received.results(x, topk_idx, stats, handle, async_finish, hook)


def _combine_half(owner) -> int:
    """The buffer half of the next combine: combines alternate halves of their own (every rank makes the
    same calls, so every rank picks the same), whatever half their dispatch used; reusing the
    dispatch's half let two combines of one handle in a row share rows and flags. Without receive
    hooks a rank's combine on a half starts only after its receive of the combine before, which
    waited for every peer's send of it, each sent after that peer's own receive of the combine on
    this half: a fast rank never overwrites what a slow one still waits for. With hooks the slack is
    DeepEP's: every rank must call a combine's hook before its peers make two more combines. The half
    is chosen on the host, so a CUDA graph replays its combines on the halves of their capture: a
    graph of one dispatch and one combine (a decode step) is safe, as the dispatch orders the
    replays; replaying a graph of combines alone back to back is not.

    Raises:
        RuntimeError: the receive hook of the last combine on that half was not called yet.
    """
    state = owner.__dict__.setdefault(_COMBINE_KEY, {"next": 0, "pending": [None, None]})
    half = state["next"]
    if state["pending"][half] is not None:
        raise RuntimeError("deep_ep.Buffer.low_latency_combine: the receive hooks of the last two combines were not "
                           "called yet: at most two can be (DeepEP's double buffering); call the older one first. "
                           "Nothing was sent")
    state["next"] ^= 1
    return half


def combine(owner, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
            zero_copy: bool, async_finish: bool, return_recv_hook: bool, out: Optional[torch.Tensor]) -> tuple:
    """`deep_ep.Buffer.low_latency_combine` of a direct dispatch's handle (checked there up to its
    buffer half), on the direct kernels; returns what it returns.

    Raises:
        ValueError: ``topk_idx`` not of the dispatch's shape, a bad ``out``. RuntimeError: a GPU
            error an earlier call recorded.
    """
    route = handle.direct
    src_info, layout_range, num_slots, hidden, num_experts = handle
    device = x.device
    num_ranks = owner.group_size
    num_local_experts = num_experts // num_ranks
    num_tokens, num_topk = topk_idx.shape
    check_combine_inputs(topk_idx, route.num_tokens, handle.num_topk, num_experts, out, hidden, device)
    half = _combine_half(owner)        # raises before anything is marked or sent
    owner._mark_combined(handle)
    source = owner._combine_buffer(num_slots, hidden, num_experts) if zero_copy else x
    item = source.element_size()
    if source.stride(2) != 1 or source.data_ptr() % 16 or source.stride(0) * item % 16 or source.stride(1) * item % 16:
        source = source.contiguous()
    window = route.window
    backend = window._backend
    backend.raise_if_broken()
    regions = _regions(half, num_ranks, num_local_experts, num_slots, hidden, handle.num_topk)
    combined_x = out if out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0 else \
        torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    transport = backend.transport_args
    # with a rank mask: the dispatch's decisions, which the combine follows, and the Buffer's mask and
    # failed ranks (it leaves out the peers taken as failed since, and marks those it times out on)
    present = route.present
    rank_state = None if present is None else owner._rank_state
    fingerprint = _fingerprint("combine", hidden, num_topk, num_slots, num_experts, present is not None)
    num_rows = num_ranks * num_slots

    def args(phase: int) -> tuple:
        return (transport, phase, half, regions, source, jit.i64(source.stride(0) * item // 16),
                jit.i64(source.stride(1) * item // 16), route.recv_count, route.routes, num_local_experts, num_slots,
                num_topk, hidden, topk_idx, topk_weights, combined_x, num_tokens, rank_state, present, fingerprint,
                jit.u64(backend.timeout_ns), jit.ptr(backend.err_record.device_ptr))

    send_blocks = _blocks(backend, -(-num_local_experts * num_rows // _WARPS))
    receive_blocks = _blocks(backend, -(-num_tokens * hidden // _CHUNK_CHANNELS // _THREADS))
    one_launch = _one_launch(backend, return_recv_hook)
    if one_launch:
        _launch(owner, window, COMBINE_KERNEL, max(send_blocks, receive_blocks), args(BOTH_PHASES), device)
    else:
        _launch(owner, window, COMBINE_KERNEL, send_blocks, args(SEND_PHASE), device)

    def receive() -> None:
        if not one_launch:
            _launch(owner, window, COMBINE_KERNEL, receive_blocks, args(RECEIVE_PHASE), device)
        if out is not None and combined_x is not out:
            out.copy_(combined_x)

    # the hook holds the dispatch's half as on the expanded path (DeepEP's double buffering), and
    # this combine's own half until it is called
    pending = owner.__dict__[_COMBINE_KEY]["pending"]
    if return_recv_hook:
        pending[half] = handle.slot
    hook = owner._receive_or_hook(receive, "low_latency_combine", device, handle.slot, return_recv_hook,
                                  also_release=lambda: pending.__setitem__(half, None))
    result = out if out is not None else combined_x
    event = EventOverlap(EventHandle(), (x, topk_idx, topk_weights, src_info, layout_range, result)) \
        if async_finish else EventOverlap()
    return result, event, hook
