"""GPU backend: dispatch and combine with the kernels of ``deep_ep/include/deep_ep``.

Every kernel runs on the backend's communication stream (`ElasticBuffer` orders it after the
compute stream or ``previous_event``); outputs are allocated on the caller's current stream.
Flow of one non-cached dispatch:

1. ``deep_ep_notify``  (R [+E] blocks) numbers this rank's tokens per destination rank / expert and
   writes its count row into every peer's window; its last block signals the peers.
2. ``deep_ep_layout``  (1 block) waits for every peer's counts and writes the handle's layout words.
3. With ``do_cpu_sync`` the host reads the received row count and allocates exact outputs; without
   it the outputs are sized for the worst case and nothing waits on the host.
4. ``deep_ep_dispatch`` (num_sms blocks): the send phase moves every token row once per
   destination rank (peers: into their window; this rank: straight into the outputs) and signals;
   the receive phase waits for every peer, then copies peers' rows into the outputs.

A cached dispatch runs step 4 only (``deep_ep_dispatch_cached``); combine runs ``deep_ep_combine``
(stage the rows that came from peers, signal; then pull and sum every token's rows). Rounds
alternate between the two halves of the receive region (see `window_layout`).
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field, fields as dc_fields
from typing import Optional

import torch

from .. import jit
from ..handle import EPHandle
from ..reference import worst_case_recv_rows
from ..streams import StreamJoin, new_stream, release_stream
from . import outputs
from . import window_layout as wl
from .base import Backend, BufferConfig

__all__ = ["GPUBackend", "GPUHandleState", "kernel_source", "dispatch_defines", "combine_defines",
           "tunable_defines"]

THREADS = 512           # threads of the data kernels (EP_THREADS)
LAYOUT_THREADS = 512    # threads of the layout kernels (launch bounds of entry.cuh)
# The data kernels' blocks wait for each other (receive blocks for the last send block's signal),
# so all of them must be resident at once. A cooperative launch makes the driver check that and
# refuse a grid that cannot be (MPS or green contexts with fewer SMs) instead of stalling until the
# timeout; it cost nothing measurable on the H200 (docs/performance.md). Not for emulated ranks,
# whose grids share the device. DEEP_EP_COOPERATIVE=0 turns it off.
COOPERATIVE = os.environ.get("DEEP_EP_COOPERATIVE", "1") not in ("", "0")


class _DispatchArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::DispatchArgs`` (include/deep_ep/dispatch.cuh); same field order."""
    _fields_ = [("x", ctypes.c_void_p), ("sf", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p),
                ("topk_weights", ctypes.c_void_p), ("num_tokens", ctypes.c_int),
                ("pos_tok", ctypes.c_void_p), ("pos_pair", ctypes.c_void_p),
                ("out_x", ctypes.c_void_p), ("out_sf", ctypes.c_void_p), ("sf_ld", ctypes.c_int),
                ("out_topk_idx", ctypes.c_void_p), ("out_weights", ctypes.c_void_p),
                ("out_src_rank", ctypes.c_void_p), ("out_src_token", ctypes.c_void_p),
                ("row_map", ctypes.c_void_p), ("out_capacity", ctypes.c_int), ("layout", ctypes.c_void_p),
                ("peers", ctypes.c_void_p), ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int),
                ("num_experts", ctypes.c_int), ("alignment", ctypes.c_int),
                ("recv_offset", ctypes.c_int64), ("half_bytes", ctypes.c_int64),
                ("row_stride", ctypes.c_int), ("timeout_ns", ctypes.c_uint64), ("err_host", ctypes.c_void_p)]


class _CombineArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::CombineArgs`` (include/deep_ep/combine.cuh); same field order."""
    _fields_ = [("y", ctypes.c_void_p), ("weights_in", ctypes.c_void_p), ("recv_weights", ctypes.c_void_p),
                ("row_map", ctypes.c_void_p), ("layout", ctypes.c_void_p), ("pos_tok", ctypes.c_void_p),
                ("pos_pair", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p), ("num_tokens", ctypes.c_int),
                ("bias0", ctypes.c_void_p), ("bias1", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("out_weights", ctypes.c_void_p), ("peers", ctypes.c_void_p), ("rank", ctypes.c_int),
                ("num_ranks", ctypes.c_int), ("num_experts", ctypes.c_int),
                ("recv_offset", ctypes.c_int64), ("half_bytes", ctypes.c_int64),
                ("row_stride", ctypes.c_int), ("timeout_ns", ctypes.c_uint64), ("err_host", ctypes.c_void_p)]


class _ErrorRecord:
    """Four int32 words of page-locked host memory mapped into the device's address space: the data
    kernels' last block copies the window's error record here (``finish_wait`` in common.cuh), so
    the host reads an asynchronous call's error at its next call with no operation on the stream.
    Freed with the buffer (a graph replayed after that is invalid anyway: the window is gone too).
    """

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # torch's primary context exists
            jit.runtime.ensure_context(device.index)
            err, host = driver.cuMemHostAlloc(16, driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE)
            if int(err) != 0:
                raise RuntimeError(f"cuMemHostAlloc of the error record failed: {err}")
            err, dev = driver.cuMemHostGetDevicePointer(host, 0)
            if int(err) != 0:
                driver.cuMemFreeHost(host)
                raise RuntimeError(f"cuMemHostGetDevicePointer of the error record failed: {err}")
        self.host_ptr, self.device_ptr = int(host), int(dev)
        ctypes.memset(self.host_ptr, 0, 16)
        self.words = (ctypes.c_int32 * 4).from_address(self.host_ptr)

    def read(self) -> tuple:
        """(code, rank, peer, phase); the kernel writes the code last."""
        return tuple(self.words)

    def free(self) -> None:
        """Release the memory (the buffer's kernels must have finished)."""
        if self.host_ptr:
            from cuda.bindings import driver
            self.words = None
            driver.cuMemFreeHost(self.host_ptr)
            self.host_ptr = self.device_ptr = 0


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None or t.numel() == 0 else t.data_ptr()


# ---------------------------------------------------------------------------------------------
# kernel sources (also used by tests/test_kernels_compile.py to build every instantiation on CPU)

def kernel_source() -> str:
    """The CUDA source every module is built from; the structure comes in as defines."""
    return "#include <deep_ep/entry.cuh>\n"


# Build-time tunables of the data kernels (include/deep_ep/common.cuh): they change how bytes move,
# never which, so the host needs no matching change. Structural defines (EP_THREADS, EP_TOPK...) are
# not among them: overriding those would break the host's view of the kernels.
TUNABLES = frozenset({"EP_SEND_UNROLL", "EP_COMBINE_UNROLL", "EP_LOAD_NO_L1", "EP_STORE_STREAMING",
                      "EP_BLOCK_FENCE"})


def tunable_defines() -> dict:
    """Build-time tunables from ``DEEP_EP_KERNEL_DEFINES`` (e.g. ``"EP_BLOCK_FENCE=1,EP_SEND_UNROLL=4"``),
    added to every data module: for running the GPU tests against a variant before it becomes the
    default (tools/tune_gpu.py times them). The tunables are listed in include/deep_ep/common.cuh.

    Raises:
        ValueError: an item is not ``<tunable>=<integer>`` with a name in `TUNABLES`.
    """
    out = {}
    for item in filter(None, (p.strip() for p in os.environ.get("DEEP_EP_KERNEL_DEFINES", "").split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in TUNABLES:
            raise ValueError(f"DEEP_EP_KERNEL_DEFINES: expected <tunable>=<integer> with a tunable of "
                             f"{sorted(TUNABLES)}, got {item!r}")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"DEEP_EP_KERNEL_DEFINES: {name} needs an integer, got {value.strip()!r}") from None
    return out


#: Test-only kernel defects (include/deep_ep/common.cuh, ``kDefect*``): tools/mutation_check.py builds
#: the kernels with one of them to prove that the GPU tests and the bench's check catch it.
TEST_DEFECTS = {1: "dropped row", 2: "wrong row", 3: "missing bias", 4: "scaled weight",
                5: "stale scale factor", 6: "skipped expert"}


def test_defect_defines() -> dict:
    """``{"EP_TEST_DEFECT": n}`` when ``DEEP_EP_TEST_DEFECT=n`` (a key of `TEST_DEFECTS`) is set, else
    ``{}``. Only the mutation check sets it: a defect makes the kernels wrong on purpose.

    Raises:
        ValueError: the variable is set to something else.
    """
    value = os.environ.get("DEEP_EP_TEST_DEFECT", "").strip()
    if value in ("", "0"):
        return {}
    if not value.isdigit() or int(value) not in TEST_DEFECTS:
        raise ValueError(f"DEEP_EP_TEST_DEFECT must be one of {sorted(TEST_DEFECTS)} (test-only kernel "
                         f"defects: {TEST_DEFECTS}), got {value!r}")
    return {"EP_TEST_DEFECT": int(value)}


def dispatch_defines(data_bytes: int, num_sf: int, num_topk: int, expand: bool) -> dict:
    """Defines of the dispatch module (layout + dispatch kernels) for one structural configuration."""
    return {"EP_DISPATCH": 1, "EP_DATA_BYTES": data_bytes, "EP_NUM_SF": num_sf, "EP_TOPK": num_topk,
            "EP_EXPAND": int(expand), "EP_THREADS": THREADS, **tunable_defines(), **test_defect_defines()}


def combine_defines(hidden: int, num_topk: int, expand: bool) -> dict:
    """Defines of the combine module for one structural configuration."""
    return {"EP_COMBINE": 1, "EP_HIDDEN": hidden, "EP_TOPK": num_topk, "EP_EXPAND": int(expand),
            "EP_THREADS": THREADS, **tunable_defines(), **test_defect_defines()}


_modules: dict = {}
_modules_lock = threading.Lock()


def _build_module(kind: str, defines: dict):
    key = (kind, tuple(sorted(defines.items())))
    mod = _modules.get(key)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(key)
            if mod is None:
                name = f"deep_ep_{kind}_" + "_".join(f"{v}" for _, v in sorted(defines.items()))
                mod = jit.build(name, kernel_source(), defines=defines)
                _modules[key] = mod
    return key, mod


def _load_module(mod, device: torch.device) -> None:
    """Load every kernel of ``mod`` on ``device`` now (not at its first launch)."""
    for name in mod.kernel_names():
        mod.function(name).handle(device.index)


def num_modules_built() -> int:
    """Distinct kernel modules this process has built or loaded (the bench reports it)."""
    return len(_modules)


# ---------------------------------------------------------------------------------------------
@dataclass
class GPUHandleState:
    """What the kernels need beyond `EPHandle`'s public fields (device tensors).

    layout:   int32 words of ``deep_ep::LayoutIndex`` (this rank as destination and as source)
    pos_tok:  [T, R] int32 token row of each token at each destination (-1: not sent)
    pos_pair: [T, K] int32 output row of each (token, expert) pair at its owner (expanded only)
    row_map:  [tok rows, K] int32 output rows of each received token row (expanded only)
    recv_topk_idx, recv_topk_weights: the dispatch's outputs, returned again by a cached dispatch
    num_tok_rows_capacity: rows allocated in ``row_map`` (the true count, or ``R * M`` without CPU sync)
    launches: prepared kernel launches of cached dispatches and combines with this handle
              (`jit.PreparedLaunch`, keyed by kernel structure and options; not copied by `clone`):
              their arguments point at this handle's tensors, so a later call with the handle
              only updates the per-call pointers (inputs, outputs)
    """
    layout: torch.Tensor
    pos_tok: torch.Tensor
    pos_pair: Optional[torch.Tensor]
    row_map: Optional[torch.Tensor]
    recv_topk_idx: torch.Tensor
    recv_topk_weights: Optional[torch.Tensor]
    num_tok_rows_capacity: int
    launches: dict = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the prepared launches behind (ctypes memory pointing at the
        original's tensors)."""
        state = dict(self.__dict__)
        state["launches"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def clone(self) -> "GPUHandleState":
        """A copy with every tensor cloned (for ``do_handle_copy`` and `EPHandle.clone`); no launches."""
        return GPUHandleState(**{f.name: (getattr(self, f.name).clone()
                                          if isinstance(getattr(self, f.name), torch.Tensor)
                                          else getattr(self, f.name)) for f in dc_fields(self)
                                 if f.name != "launches"})


class GPUBackend(Backend):
    """Dispatch/combine on CUDA tensors; transports: NCCL (LSA) or emulated ranks on one GPU."""

    def __init__(self, group, config: BufferConfig) -> None:
        super().__init__(group, config)
        if not torch.cuda.is_available():
            raise RuntimeError("the GPU backend needs a CUDA device; use a gloo group with CPU tensors "
                               "to run deep_ep without a GPU")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("an ElasticBuffer cannot be created while a CUDA graph is being captured: "
                               "create it before capture (it allocates and registers memory with NCCL), "
                               "then capture dispatch/combine calls")
        from ..emulated import EmulatedRankGroup
        num_bytes = config.num_bytes
        if num_bytes <= 0:
            raise ValueError("the GPU backend needs a window size: pass num_bytes, or "
                             "num_max_tokens_per_rank and hidden to ElasticBuffer")
        if isinstance(group, EmulatedRankGroup):
            self.transport = group.make_transport(num_bytes)
            self._device = self.transport.device
            self.emulated = True
        else:
            from ..comm.nccl import NcclTransport
            self._device = torch.device("cuda", torch.cuda.current_device())
            self.transport = NcclTransport(group, num_bytes, self._device)
            self.emulated = False
        self.rank, self.num_ranks = self.transport.rank, self.transport.num_ranks
        props = torch.cuda.get_device_properties(self._device)
        self.num_device_sms = props.multi_processor_count
        # Blocks a data kernel may use: every emulated rank's blocks must be resident at once.
        self._sm_limit = max(1, self.num_device_sms // (self.num_ranks if self.emulated else 1))
        self._default_sms = self.get_theoretical_num_sms(1, 1)  # the model ignores experts and top-k
        self._cooperative = COOPERATIVE and not self.emulated
        self._peers_ptr = self.transport.peers.data_ptr()  # the peer table is fixed for the window's life
        self.comm_stream = new_stream(self._device)   # never one of torch's pooled (shared) streams
        self._comm_handle = self.comm_stream.cuda_stream   # raw CUstream for prepared launches
        self.stream_join = StreamJoin(self._device)
        self.timeout_ns = int(config.num_gpu_timeout_secs * 1e9)
        self._host_buf = torch.empty(256, dtype=torch.int32, pin_memory=True)
        self._err_record = _ErrorRecord(self._device)   # written by the data kernels (finish_wait)
        self._ctrl_error: Optional[torch.Tensor] = None
        self._broken: Optional[str] = None
        self._last_m = 0
        self._ready_modules: dict = {}   # (kind, structure) -> loaded module
        self._layouts: dict = {}         # hidden -> WindowLayout
        self._destroyed = False

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        """The CUDA device of this rank's tensors and window."""
        return self._device

    def get_comm_stream(self):
        """The dedicated stream every kernel of this buffer runs on (`deep_ep.streams`)."""
        return self.comm_stream

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int) -> int:
        """SMs per dispatch/combine from the bandwidth model (`window_layout.theoretical_num_sms`),
        capped for emulated ranks so that all of them fit on the device."""
        return min(wl.theoretical_num_sms(num_experts, num_topk, self.num_ranks, self.num_device_sms), self._sm_limit)

    def barrier(self) -> None:
        """Wait for this rank's communication, report a recorded GPU error, then a host barrier.

        Raises:
            TimeoutError / RuntimeError: see `check_errors`.
        """
        self.comm_stream.synchronize()
        self.check_errors()
        self.transport.host_barrier()

    def destroy(self) -> None:
        """Wait for this rank's kernels, release the window (collective for NCCL) and the stream."""
        if not self._destroyed:
            self._destroyed = True
            self.comm_stream.synchronize()  # not device-wide: other emulated ranks may still be running
            self.transport.destroy()
            release_stream(self.comm_stream)
            self.stream_join.destroy()
            self._err_record.free()

    # ------------------------------------------------------------------ helpers
    def _layout(self, hidden: int) -> wl.WindowLayout:
        """The window's layout for rows of ``hidden`` channels (computed once per hidden size)."""
        layout = self._layouts.get(hidden)
        if layout is None:
            layout = self._layouts[hidden] = wl.make_layout(self.num_ranks, 0, hidden, self.config.num_topk,
                                                            False, self.transport.num_bytes)
        return layout

    def _launch_data(self, prepared, n_sms: int) -> None:
        """Launch a dispatch/combine kernel on the comm stream; a cooperative launch the device
        refuses (its blocks cannot all be resident: MPS or green contexts with fewer SMs) becomes a
        LaunchError that says which ``num_sms`` to lower."""
        try:
            prepared.launch(self._comm_handle)
        except jit.LaunchError as exc:
            if "COOPERATIVE_LAUNCH_TOO_LARGE" in str(exc):
                # Kernels of this call may already be queued (notify, layout) and the peers wait for
                # this one: the buffer is out of step with them, so it cannot be used again.
                self._broken = "cooperative launch refused"
                raise jit.LaunchError(f"rank {self.rank}: the device cannot hold all {n_sms} blocks of "
                                      f"{prepared.function.name} at once (fewer SMs available, e.g. under MPS "
                                      f"or a green context). This buffer can no longer be used (its peers "
                                      f"wait for this call): create a new one and pass a smaller num_sms") from exc
            raise

    def _module(self, kind: str, structure: tuple):
        """The built and loaded module for ``structure`` (the arguments of `dispatch_defines` /
        `combine_defines`); the first use builds and loads it, collectively for emulated ranks."""
        mod = self._ready_modules.get((kind, structure))
        if mod is None:
            defines = dispatch_defines(*structure) if kind == "dispatch" else combine_defines(*structure)
            key, mod = _build_module(kind, defines)
            if self.emulated:
                self.group.load_collectively(key, lambda: _load_module(mod, self._device))
            else:
                _load_module(mod, self._device)
            self._ready_modules[(kind, structure)] = mod
        return mod

    def _num_sms(self, num_sms: int) -> int:
        """Blocks of the data kernels: ``num_sms``, or the model's default capped so that every
        emulated rank's blocks fit on the device at once."""
        limit = self._sm_limit
        n = num_sms or self._default_sms
        if n < 1:
            raise ValueError(f"num_sms must be >= 1, got {n}")
        if n > limit:
            if self.emulated:
                raise ValueError(
                    f"{self.num_ranks} emulated ranks x {n} SMs > {self.num_device_sms} SMs of the device: "
                    f"every rank's blocks must be resident at once (ranks wait on each other); "
                    f"use num_sms <= {limit}")
            n = limit
        return n

    def _host_read(self, t: torch.Tensor, stream) -> list:
        """``t`` (int32, on the device) as a list, once ``stream``'s work before now is done.

        A pinned copy and an event, polled: a pageable copy (``.cpu()``) would wait inside the
        driver for the kernel it depends on, which spins until every peer arrives, and while it
        waits other threads' launches can block too (with emulated ranks: the peers' launches).
        """
        n = t.numel()
        if self._host_buf.numel() < n:
            self._host_buf = torch.empty(max(n, 2 * self._host_buf.numel()), dtype=torch.int32, pin_memory=True)
        dst = self._host_buf[:n]
        with torch.cuda.stream(stream):
            dst.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        deadline = time.monotonic() + self.config.num_cpu_timeout_secs
        while not ev.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"deep_ep: rank {self.rank} waited {self.config.num_cpu_timeout_secs} s on the "
                                   f"host for the GPU (num_cpu_timeout_secs); the GPU-side timeout did not fire")
            time.sleep(2e-5)
        return dst.tolist()

    def read_error(self) -> Optional[tuple]:
        """(code, rank, peer, phase) recorded by a kernel of this rank, or None (waits for the stream)."""
        v = self._host_read(self._ctrl_error_view(), self.comm_stream)
        return tuple(v) if v[0] != 0 else None

    def check_errors(self) -> None:
        """Raise if a kernel of this rank recorded an error (waits for the communication stream).

        Raises:
            TimeoutError: a peer did not arrive within ``num_gpu_timeout_secs``.
            RuntimeError: this rank would have received more rows than its outputs hold.
        """
        err = self.read_error()
        if err is not None:
            self._raise_error(err)

    def _raise_error(self, err: tuple) -> None:
        code, rank, peer, phase = err
        phases = {1: "dispatch notify (waiting for peers' counts)", 2: "dispatch (waiting for peers' tokens)",
                  3: "combine (waiting for peers' expert outputs)"}
        if code == 2:
            self._broken = "capacity"
            raise RuntimeError(
                f"deep_ep: rank {rank} would receive more rows than its do_cpu_sync=False outputs hold "
                f"(sized for num_max_tokens_per_rank={self._last_m} per rank): every rank must pass the same "
                f"num_max_tokens_per_rank, and in the expanded layout a token must not name the same expert "
                f"twice. Nothing was written; this buffer is no longer usable")
        self._broken = "timeout"
        raise TimeoutError(
            f"deep_ep GPU timeout on rank {rank}: peer rank {peer} did not arrive within "
            f"{self.config.num_gpu_timeout_secs} s in phase {phases.get(phase, phase)}. A rank skipped a "
            f"call or failed; this buffer is no longer usable (destroy it and create a new one)")

    def _ctrl_error_view(self) -> torch.Tensor:
        if self._ctrl_error is None:
            off = wl.CTRL_ERROR_OFFSET
            self._ctrl_error = self.transport.window_tensor()[off:off + 16].view(torch.int32)
        return self._ctrl_error

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"deep_ep: this buffer is no longer usable after an earlier GPU error "
                               f"({self._broken}); destroy it and create a new one")
        v = self._err_record.read()
        if v[0] != 0:
            self._raise_error(v)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, data, sf, topk_idx, topk_weights, *, num_experts, num_max_tokens_per_rank,
                 expert_alignment, num_sms, handle, do_handle_copy, do_cpu_sync, do_expand,
                 do_zero_padding, use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats):
        dev = self._device
        R, rank = self.num_ranks, self.rank
        cached = handle is not None
        if cached:
            state = handle.backend_state
            if not isinstance(state, GPUHandleState):
                raise ValueError("the handle was not made by a GPU dispatch (it has no GPU layout state)")
            topk_idx = handle.topk_idx
            do_expand = handle.do_expand
            expert_alignment = handle.expert_alignment
            num_experts = handle.num_experts
        E, A = num_experts, expert_alignment
        if E > wl.MAX_EXPERTS:
            raise ValueError(f"num_experts={E} exceeds the {wl.MAX_EXPERTS} experts a window has room for")
        L = E // R
        T, H = int(data.shape[0]), int(data.shape[1])
        K = int(topk_idx.shape[1])
        if K > (self.config.num_topk or wl.MAX_TOPK):
            raise ValueError(f"top-k {K} exceeds the {self.config.num_topk or wl.MAX_TOPK} the window rows were "
                             f"sized for: create the buffer with num_topk={K}")
        data_bytes = H * data.element_size()
        num_sf = 0 if sf is None else int(sf.shape[1])
        if data_bytes % 16:
            raise ValueError(f"a token row must be a multiple of 16 bytes on the GPU; got hidden={H} "
                             f"({data.dtype}): use a hidden size that is a multiple of 8 (bf16) / 16 (fp8)")
        layout = self._layout(H)
        cap_tok_rows = layout.rows_per_half
        m = num_max_tokens_per_rank or (cap_tok_rows // R)
        if R * m > cap_tok_rows:
            raise ValueError(f"the window holds {cap_tok_rows} token rows per round, fewer than "
                             f"{R} ranks x num_max_tokens_per_rank={m}: create the buffer with a larger "
                             f"num_bytes (see ElasticBuffer.get_buffer_size_hint)")
        if T > m:
            raise ValueError(f"{T} tokens on rank {rank}, more than the {m} per rank the buffer holds "
                             f"(num_max_tokens_per_rank)")
        self._last_m = m
        n_sms = self._num_sms(num_sms)
        mod = self._module("dispatch", (data_bytes, num_sf, K, bool(do_expand)))
        peers = self._peers_ptr

        self._raise_if_broken()
        if not cached:
            # do_cpu_sync=False: outputs are sized now for the worst case; the layout kernel refuses
            # (error code 2) a receive that would not fit, e.g. a peer with a larger M.
            big = 2 ** 31 - 1
            out_cap = big if do_cpu_sync else worst_case_recv_rows(R, m, K, L, A, do_expand)
            tok_cap = big if do_cpu_sync else R * m
            lay = outputs.empty(_LayoutIndex(R, L, E).size, torch.int32, dev)
            pos_tok = outputs.empty((T, R), torch.int32, dev)
            pos_pair = outputs.empty((T, K), torch.int32, dev) if do_expand else None
            stream = self.comm_stream
            mod.function("deep_ep_notify").launch(
                R + (E if do_expand else 0), LAYOUT_THREADS,
                (topk_idx, T, E, R, rank, jit.ptr(peers), jit.i64(layout.counts_offset), pos_tok, pos_pair),
                smem=4 * L, stream=stream)
            mod.function("deep_ep_layout").launch(
                1, LAYOUT_THREADS,
                (jit.ptr(peers), rank, R, E, A, jit.i64(layout.counts_offset), lay,
                 cumulative_local_expert_recv_stats, out_cap, tok_cap, jit.u64(self.timeout_ns)), stream=stream)
            if do_cpu_sync:
                head = self._host_read(lay, stream)  # waits for the layout kernel, i.e. every peer's counts
                self.check_errors()
                num_out_rows, num_tok_rows = head[0], head[1]
                out_rows = num_out_rows
                tok_capacity = num_tok_rows
            else:
                out_rows, tok_capacity, num_out_rows = out_cap, tok_cap, None
        else:
            lay, pos_tok, pos_pair = state.layout, state.pos_tok, state.pos_pair
            out_rows = handle.num_recv_rows

        # outputs
        out_x = outputs.empty((out_rows, H), data.dtype, dev)
        out_sf, sf_ld = None, 0
        if sf is not None:
            if use_tma_aligned_col_major_sf:
                sf_ld = (out_rows + 3) // 4 * 4
                out_sf = outputs.empty((num_sf, sf_ld), sf.dtype, dev).t()[:out_rows]
            else:
                out_sf = outputs.empty((out_rows, num_sf), sf.dtype, dev)
        if not cached:
            if do_expand:
                out_idx = outputs.empty(out_rows, torch.int64, dev)
                out_w = outputs.empty(out_rows, torch.float32, dev)
                row_map = outputs.empty((tok_capacity, K), torch.int32, dev)
            else:
                out_idx = outputs.empty((out_rows, K), torch.int64, dev)
                out_w = outputs.empty((out_rows, K), torch.float32, dev) if topk_weights is not None else None
                row_map = None
            src_rank = outputs.empty(out_rows, torch.int32, dev)
            src_token = outputs.empty(out_rows, torch.int32, dev)
        else:
            out_idx, out_w, row_map = state.recv_topk_idx, state.recv_topk_weights, state.row_map
            src_rank, src_token = handle.recv_src_rank, handle.recv_src_token

        out_sf_ptr = out_sf.data_ptr() if out_sf is not None and out_sf.numel() else None
        prepared = None
        if cached:
            # The handle's prepared launch: only the per-call pointers change.
            # The handle-level tensors the launch reads are part of the key: a handle rebuilt with
            # other tensors (dataclasses.replace) shares this state but must not reuse the pointers.
            key = ("dispatch", data_bytes, num_sf, K, n_sms, bool(do_zero_padding), sf_ld,
                   topk_idx.data_ptr(), src_rank.data_ptr(), src_token.data_ptr())
            prepared = state.launches.get(key)
            if prepared is not None:
                a = prepared.args[0]
                a.x, a.sf, a.out_x, a.out_sf = _ptr(data), _ptr(sf), _ptr(out_x), out_sf_ptr
        if prepared is None:
            args = _DispatchArgs(
                x=_ptr(data), sf=_ptr(sf), topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights), num_tokens=T,
                pos_tok=_ptr(pos_tok), pos_pair=_ptr(pos_pair), out_x=_ptr(out_x), out_sf=out_sf_ptr, sf_ld=sf_ld,
                out_topk_idx=_ptr(out_idx), out_weights=_ptr(out_w), out_src_rank=_ptr(src_rank),
                out_src_token=_ptr(src_token), row_map=_ptr(row_map), out_capacity=out_rows, layout=lay.data_ptr(),
                peers=peers, rank=rank, num_ranks=R, num_experts=E, alignment=A,
                recv_offset=layout.recv_offset, half_bytes=layout.half_bytes, row_stride=layout.row_stride,
                timeout_ns=self.timeout_ns, err_host=self._err_record.device_ptr)
            fn = mod.function("deep_ep_dispatch_cached" if cached else "deep_ep_dispatch")
            prepared = fn.prepare(n_sms, THREADS, (args, ctypes.c_int(int(do_zero_padding))), device=dev.index,
                                  cooperative=self._cooperative)
            if cached:
                state.launches[key] = prepared
        self._launch_data(prepared, n_sms)

        recv_x = out_x if sf is None else (out_x, out_sf)
        if cached:
            # design.md: the handle's weights in the expanded layout, None otherwise.
            return recv_x, out_idx, (handle.recv_topk_weights if do_expand else None), handle

        Lx = _LayoutIndex(R, L, E)
        plist = None
        if do_cpu_sync:
            plist = head[Lx.padded: Lx.padded + L]
        new_state = GPUHandleState(layout=lay, pos_tok=pos_tok, pos_pair=pos_pair, row_map=row_map,
                                   recv_topk_idx=out_idx, recv_topk_weights=out_w,
                                   num_tok_rows_capacity=tok_capacity)
        new_handle = EPHandle(
            buffer_id=self.config.buffer_id, num_ranks=R, rank=rank, num_experts=E, num_topk=K, hidden=H,
            do_expand=do_expand, expert_alignment=A, num_max_tokens_per_rank=num_max_tokens_per_rank, num_tokens=T,
            num_recv_tokens=num_out_rows, num_recv_tokens_gpu=lay[0:1],
            rank_prefix_sum=lay[Lx.rps: Lx.rps + R], num_recv_tokens_per_expert=lay[Lx.padded: Lx.padded + L],
            num_recv_tokens_per_expert_list=plist, recv_src_rank=src_rank, recv_src_token=src_token,
            send_pos=pos_pair if do_expand else pos_tok, topk_idx=topk_idx,
            recv_topk_weights=out_w if do_expand else None, backend_state=new_state)
        return recv_x, out_idx, out_w, new_handle

    # ------------------------------------------------------------------ combine
    def combine(self, x, handle, topk_weights, bias, *, num_sms):
        dev = self._device
        state = handle.backend_state
        if not isinstance(state, GPUHandleState):
            raise ValueError("the handle was not made by a GPU dispatch (it has no GPU layout state)")
        self._raise_if_broken()
        R, rank = self.num_ranks, self.rank
        T, H, K, E = handle.num_tokens, handle.hidden, handle.num_topk, handle.num_experts
        layout = self._layout(H)
        n_sms = self._num_sms(num_sms)
        mod = self._module("combine", (H, K, bool(handle.do_expand)))
        out = outputs.empty((T, H), torch.bfloat16, dev)
        out_w = outputs.empty((T, K), torch.float32, dev) if topk_weights is not None else None
        bias0 = bias[0] if len(bias) > 0 else None
        bias1 = bias[1] if len(bias) > 1 else None
        key = ("combine", H, K, n_sms, handle.topk_idx.data_ptr(), _ptr(handle.recv_topk_weights))
        prepared = state.launches.get(key)
        if prepared is None:
            args = _CombineArgs(
                recv_weights=_ptr(handle.recv_topk_weights),
                row_map=_ptr(state.row_map), layout=state.layout.data_ptr(), pos_tok=_ptr(state.pos_tok),
                pos_pair=_ptr(state.pos_pair), topk_idx=_ptr(handle.topk_idx), num_tokens=T,
                peers=self._peers_ptr, rank=rank, num_ranks=R, num_experts=E,
                recv_offset=layout.recv_offset, half_bytes=layout.half_bytes, row_stride=layout.row_stride,
                timeout_ns=self.timeout_ns, err_host=self._err_record.device_ptr)
            prepared = state.launches[key] = mod.function("deep_ep_combine").prepare(
                n_sms, THREADS, (args,), device=dev.index, cooperative=self._cooperative)
        a = prepared.args[0]  # the per-call pointers
        a.y, a.weights_in, a.bias0, a.bias1 = _ptr(x), _ptr(topk_weights), _ptr(bias0), _ptr(bias1)
        a.out, a.out_weights = _ptr(out), _ptr(out_w)
        self._launch_data(prepared, n_sms)
        return out, out_w


class _LayoutIndex:
    """Word offsets the host reads from a handle's layout tensor (``deep_ep::LayoutIndex`` in
    include/deep_ep/layout.cuh is the full list)."""

    def __init__(self, R: int, L: int, E: int) -> None:
        self.rps = 2 + R                   # rank_prefix_sum [R]
        self.padded = 2 + 2 * R + L        # padded counts per local expert [L]
        self.size = 2 + 3 * R + 3 * L + E  # every word
