"""Emulated ranks: N expert-parallel ranks inside one process, on one GPU.

The GPU kernels, the window layout and the signals are exactly those of a real multi-GPU run; only
the transport differs: the N windows are slices of one allocation instead of NCCL symmetric memory
reached over NVLink. This is how deep_ep tests every multi-rank path on a single GPU, and it is a
tool for users too: test an MoE layer's EP code on a workstation before taking it to a cluster.

Each rank has its own `deep_ep.ElasticBuffer`, its own compute and communication streams and its own
host thread (a host-side wait in one rank must not block another)::

    import deep_ep
    from deep_ep.emulated import EmulatedGroup

    group = EmulatedGroup(num_ranks=8)

    def body(rank_group):                   # runs in rank_group.rank()'s thread
        buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=512, hidden=7168, num_topk=8)
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx, topk_weights, num_experts=256)
        ...
        return result

    results = group.run(body)               # one result per rank; re-raises the first failure

Several nodes on one GPU: ``EmulatedGroup(8, num_nvlink_ranks=2)`` (or ``EP_EMULATED_NUM_NVLINK_RANKS=2``)
makes 4 nodes of 2 ranks (`ElasticBuffer.num_rdma_ranks` 4, ``num_nvlink_ranks`` 2). Buffers of such a
group run hybrid mode (the default of `ElasticBuffer`: a token crosses the network once per node, then
NVLink) or direct mode (``allow_hybrid_mode=False``: every rank of another node is reached directly);
other nodes are reached through an emulated GIN
whose NIC lands puts after seeded delays and in a seeded order (``gin_settings``,
`deep_ep.comm.gin.EmulatedGinSettings`); docs/scaleout.md says what runs.

One thread can also make the ranks' calls one after another (`EmulatedGroup.acting_as`), for calls
whose host side never waits for the peers (a cached dispatch, a combine): the bench captures every
rank's kernels of one such call into one CUDA graph that way.

Constraints:

* Ranks wait for each other inside kernels, so every rank's blocks must be resident at once:
  ``num_ranks * num_sms <= SMs of the device`` (checked, with a clear error).
* CUDA's lazy kernel loading (the default since CUDA 12.2) loads a kernel at its first launch and
  waits for the whole GPU to drain first. With ranks spinning on each other in one process, that wait
  never ends. Emulated ranks therefore need ``CUDA_MODULE_LOADING=EAGER``. deep_ep's own kernels are
  loaded at a point where every rank has stopped (a host barrier), the first time each is needed.
* The GPU feeds work from ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (8 by default); streams
  beyond that share queues, and work queued behind a spinning kernel of another rank in the same
  queue cannot start: a deadlock that ends in a GPU timeout. Each rank uses two streams (compute and
  communication), so ``2 * num_ranks + 2`` connections are needed; `EmulatedGroup` asks for 32 (the
  maximum). Measured on the H200: 8 emulated ranks timed out in 4 of 14 cases with the default of 8,
  and passed all 14 with 32.
* Both variables are read when CUDA initialises: `EmulatedGroup` sets them when CUDA is not
  initialised yet, and raises a clear error when it is too late (`ensure_cuda_settings`).
* A synchronous copy between host and device (``t.cpu()``, ``t.item()``, ``t.tolist()``,
  ``cpu_tensor.to("cuda")``) waits for the stream inside the CUDA driver, and while it waits other
  threads' CUDA calls can stall: if the stream's work needs a peer rank whose thread has not queued
  its kernels yet, the ranks can wait on each other until a GPU timeout. Wait with
  `wait_for_stream` first (it polls an event), then copy; deep_ep's own host reads poll too. This
  rule is inferred from hangs on the H200 (a thread blocked recording an event while another waited
  in such a copy), seen when autograd's one engine thread ran the ranks' backward passes one after
  another, so that the ranks ran further apart than in a forward pass.
* ``torch.compile`` in the ranks' threads: torch's "FX is tracing" flag is one per process, so a
  rank that enters its compiled function while another rank's graph is being traced gets
  ``RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized
  function``, raised before anything runs; its peers then wait on the GPU for its calls. Call the
  compiled function again when that happens (tests/gpu/test_gpu_scaleout_features.py does).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from typing import Callable, Iterator, Optional

import torch

from . import envs
from .comm.emulated import EmulatedTransport, EmulatedWindowSet
from .cuda.streams import new_stream, poll_event, release_stream

__all__ = ["EmulatedGroup", "EmulatedRankGroup", "CollectiveLoadError", "connections_needed", "ensure_cuda_settings",
           "wait_for_stream"]

MAX_CONNECTIONS = 32  # the most CUDA_DEVICE_MAX_CONNECTIONS allows


class EmulatedGroup:
    """A group of ``num_ranks`` emulated ranks on one CUDA device.

    Args:
        num_ranks: number of ranks, >= 1.
        device: CUDA device (default: the current one).
        timeout_secs: host-side wait limit of collective steps (buffer creation, `barrier`), seconds.
        num_nvlink_ranks: ranks of one emulated node (dividing ``num_ranks``); None: the variable
            ``EP_EMULATED_NUM_NVLINK_RANKS``, else ``num_ranks`` (one node).
        gin_settings: the emulated NIC's `deep_ep.comm.gin.EmulatedGinSettings` (several nodes
            only; default: its defaults).

    Raises:
        ValueError: ``num_ranks < 1``, or ``num_nvlink_ranks`` not dividing it.
        RuntimeError: no CUDA device, or CUDA was initialised without the settings emulated ranks
            need (see `ensure_cuda_settings`).
    """

    def __init__(self, num_ranks: int, device: Optional[torch.device] = None, timeout_secs: float = 300.0,
                 num_nvlink_ranks: Optional[int] = None, gin_settings=None) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_nvlink_ranks = _nvlink_ranks(num_ranks, num_nvlink_ranks)
        self.gin_settings = gin_settings
        # a rank of several emulated nodes has a third stream, its emulated NIC's (comm/gin.py)
        ensure_cuda_settings(num_ranks, 3 if self.num_nvlink_ranks < num_ranks else 2)
        if not torch.cuda.is_available():
            raise RuntimeError("emulated ranks run on a CUDA device; none is available")
        self.num_ranks = num_ranks
        device = torch.device(device) if device is not None else torch.device("cuda")
        if device.type != "cuda":
            raise ValueError(f"emulated ranks run on a CUDA device, got {device}")
        # "cuda" without an index: the current device (the backends need the index)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.timeout_secs = timeout_secs
        self._barrier = threading.Barrier(num_ranks, timeout=timeout_secs)
        self._lock = threading.Lock()
        self._windows: dict = {}          # creation index -> EmulatedWindowSet
        self._creations = [0] * num_ranks  # buffers created so far by each rank
        self._loaded: set = set()          # kernel modules loaded for this group (see load_collectively)
        self.ranks = [EmulatedRankGroup(self, r) for r in range(num_ranks)]
        #: each rank's compute stream: `run` makes it the current stream of the rank's thread
        self.compute_streams = [new_stream(self.device) for _ in range(num_ranks)]

    def __del__(self) -> None:
        for stream in getattr(self, "compute_streams", ()):
            try:
                release_stream(stream)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def rank_group(self, rank: int) -> "EmulatedRankGroup":
        """The group object rank ``rank`` passes to `ElasticBuffer`."""
        return self.ranks[rank]

    def barrier(self) -> None:
        """Host barrier across the ranks' threads.

        Raises:
            threading.BrokenBarrierError: timeout, or a rank failed.
            RuntimeError: called inside `acting_as` (one thread standing in for a rank cannot meet
                the other ranks' threads: the barrier would pair the wrong calls or never trip).
        """
        acting = getattr(_acting, "rank", None)
        if acting is not None:
            raise RuntimeError(
                f"deep_ep.emulated: a host barrier (a buffer's creation or barrier, or the first use of a "
                f"kernel module) inside EmulatedGroup.acting_as({acting}): only calls that never meet the "
                f"other ranks on the host can be made there; make the others in EmulatedGroup.run first")
        self._barrier.wait()

    @contextlib.contextmanager
    def acting_as(self, rank: int, stream: Optional[torch.cuda.Stream] = None) -> Iterator["EmulatedRankGroup"]:
        """Within the block, the calling thread makes rank ``rank``'s calls: the group's device and
        ``stream`` (default: the rank's compute stream, ``compute_streams[rank]``) are current, as
        `run` sets them in the rank's own thread. Yields the rank's `EmulatedRankGroup`.

        For one thread that drives several ranks, e.g. to capture every rank's kernels of one call
        in one CUDA graph, each rank on a stream branch of its own. Only calls whose host side never
        waits for a peer can be made this way, one rank after another: a cached dispatch and a
        combine (with their kernels already loaded). A dispatch with ``do_cpu_sync=True`` waits on
        the host for every peer's counts, which never come; a buffer's creation, its barrier and the
        first use of a kernel module meet the other ranks at a host barrier, which raises here. The
        rank's own thread must not make calls meanwhile.

        Args:
            rank: the rank, in ``[0, num_ranks)``.
            stream: the stream its calls go to (a CUDA stream of the group's device), or None.

        Raises:
            ValueError: ``rank`` out of range.
            RuntimeError: nested in another `acting_as` of this thread.
        """
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        if getattr(_acting, "rank", None) is not None:
            raise RuntimeError(f"deep_ep.emulated: acting_as({rank}) inside acting_as({_acting.rank}) "
                               f"of the same thread")
        stream = self.compute_streams[rank] if stream is None else stream
        _acting.rank = rank
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                yield self.ranks[rank]
        finally:
            _acting.rank = None

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """Run ``fn(rank_group, *args, **kwargs)`` in one thread per rank; return the results by rank.

        If a rank raises, the barrier is broken (so no other rank waits forever on the host) and the
        first exception is re-raised after every thread ended.
        """
        results: list = [None] * self.num_ranks
        errors: list = [None] * self.num_ranks

        def worker(r: int) -> None:
            torch.cuda.set_device(self.device)
            try:
                # Each rank computes on its own stream, as on its own GPU. On the shared default
                # stream, the caching allocator would hand a block one rank just freed (say, an input
                # its communication kernels still read) to another rank's kernels.
                with torch.cuda.stream(self.compute_streams[r]):
                    results[r] = fn(self.ranks[r], *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors[r] = exc
                self._barrier.abort()
                if any(t.is_alive() for i, t in enumerate(threads) if i != r):
                    # Peers may now wait on the GPU for this rank until their timeouts (minutes):
                    # say at once what happened, not only when every thread has ended.
                    print(f"[deep_ep.emulated] rank {r} raised while other ranks still run (they may wait for "
                          f"it until a timeout):\n" + "".join(traceback.format_exception(exc)).rstrip(),
                          file=sys.stderr, flush=True)

        threads = [threading.Thread(target=worker, args=(r,), name=f"deep_ep-rank{r}") for r in range(self.num_ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._barrier.reset()
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return results
        # The root cause first: a rank's own error, not a peer's timeout or a broken host barrier.
        failed.sort(key=lambda re: (isinstance(re[1], (TimeoutError, threading.BrokenBarrierError)), re[0]))
        rank, primary = failed[0]
        if len(failed) > 1:
            others = "; ".join(f"rank {r}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                               for r, e in failed[1:])
            _note(primary, f"[deep_ep.emulated] raised on rank {rank}; other ranks: {others}")
        else:
            _note(primary, f"[deep_ep.emulated] raised on rank {rank}")
        raise primary

    def load_collectively(self, rank: int, key, load: Callable) -> None:
        """Run ``load()`` once for ``key`` while every rank waits at a host barrier.

        Loading a CUDA module waits for the GPU to drain; if another rank had a kernel in flight that
        waits for this rank, the load would never finish. Every rank reaches its first use of a
        module at the same call (ranks issue the same sequence of calls), so: barrier, load, barrier.
        """
        try:
            self.barrier()
            with self._lock:
                if key not in self._loaded:
                    load()
                    self._loaded.add(key)
            self.barrier()
        except threading.BrokenBarrierError:
            raise CollectiveLoadError(
                f"emulated rank {rank}: the first use of a kernel module is collective (every rank loads it "
                f"at the same call), and not every rank reached it within {self.timeout_secs} s or a rank "
                f"failed: emulated ranks must make the same sequence of calls") from None

    def _agree_on_gin(self, windows: EmulatedWindowSet, rank: int, mode: tuple, transport) -> None:
        """Collective: every rank's ``(allow_hybrid_mode, num_allocated_qps)`` for a buffer across
        emulated nodes. The GIN state is one for all ranks and a mode's kernels expect their peers'
        to run the same protocol, so ranks that differ get a ValueError on every rank (their windows
        released) instead of waits that time out."""
        with self._lock:
            modes = windows.__dict__.setdefault("gin_modes", {})
            modes[rank] = mode
        self.barrier()
        if len(set(modes.values())) > 1:
            transport.destroy()
            seen = ", ".join(f"rank {r}: allow_hybrid_mode={hybrid}, num_allocated_qps={qps}"
                             for r, (hybrid, qps) in sorted(modes.items()))
            raise ValueError(f"deep_ep: ranks disagree on a buffer across emulated nodes ({seen}); every rank must "
                             f"pass the same allow_hybrid_mode and num_allocated_qps")

    def _gin_for(self, windows: EmulatedWindowSet, num_allocated: int, timeout_ns: int, hybrid: bool = False):
        """The emulated GIN state of a buffer's window set, made by the first rank that asks
        (``hybrid``: the buffer runs hybrid mode, every rank's forwarding area with it)."""
        from .comm.gin import EmulatedGinSettings, EmulatedGinState
        with self._lock:
            state = getattr(windows, "gin_state", None)
            if state is None:
                slices = [windows.storage[r * windows.num_bytes:(r + 1) * windows.num_bytes]
                          for r in range(self.num_ranks)]
                state = windows.gin_state = EmulatedGinState(slices, windows.num_bytes, num_allocated,
                                                             self.gin_settings or EmulatedGinSettings(), timeout_ns,
                                                             self.num_nvlink_ranks, hybrid)
            return state

    # called by the ranks' transports
    def _windows_for(self, rank: int, num_bytes: int) -> EmulatedWindowSet:
        with self._lock:
            idx = self._creations[rank]
            self._creations[rank] += 1
            ws = self._windows.get(idx)
            if ws is None:
                ws = EmulatedWindowSet(self.num_ranks, num_bytes, self.device)
                self._windows[idx] = ws
            elif ws.num_bytes != num_bytes:
                raise ValueError(f"rank {rank} creates a buffer of {num_bytes} bytes, but another rank created "
                                 f"buffer #{idx} with {ws.num_bytes}: every rank must pass the same size")
            return ws


def wait_for_stream(stream: Optional[torch.cuda.Stream] = None, timeout_secs: float = 300.0) -> None:
    """Wait on the host until the work queued so far on ``stream`` is done, by polling an event,
    never inside a blocking driver call (see the module's notes: with emulated ranks a blocking wait
    can stall the peers' threads). The event is reused per thread and device.

    Args:
        stream: a CUDA stream; None (the default) for the current stream of the current device.
        timeout_secs: how long to wait, seconds (default 300).

    Raises:
        TimeoutError: the work did not finish within ``timeout_secs``.
        RuntimeError: called while a CUDA graph is being captured on the current stream (captured
            work cannot be waited on).
    """
    stream = torch.cuda.current_stream() if stream is None else stream
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("deep_ep.emulated.wait_for_stream: a CUDA graph is being captured on the current stream")
    events = getattr(_wait_events, "by_device", None)
    if events is None:
        events = _wait_events.by_device = {}
    index = stream.device.index
    if index not in events:
        events[index] = torch.cuda.Event()
    done = events[index]
    done.record(stream)
    if not poll_event(done, timeout_secs):
        raise TimeoutError(f"deep_ep.emulated: the stream's work did not finish within {timeout_secs} s")


_wait_events = threading.local()   # per thread: device index -> the event wait_for_stream reuses
_acting = threading.local()        # per thread: the rank `EmulatedGroup.acting_as` stands in for, or None


def connections_needed(num_ranks: int, streams_per_rank: int = 2) -> int:
    """CUDA hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``) that ``num_ranks`` emulated ranks of
    ``streams_per_rank`` streams each need: one per stream, two more for torch's own streams, at
    most the 32 CUDA allows."""
    return min(streams_per_rank * num_ranks + 2, MAX_CONNECTIONS)


def ensure_cuda_settings(num_ranks: int, streams_per_rank: int = 2) -> None:
    """Make CUDA load kernels eagerly and use enough hardware queues for ``num_ranks`` emulated ranks
    of ``streams_per_rank`` streams each (2: compute and communication; 3 on emulated nodes, with
    the NIC's; see the module docstring), or raise if CUDA was initialised without them.

    Sets ``CUDA_MODULE_LOADING=EAGER`` and ``CUDA_DEVICE_MAX_CONNECTIONS=32`` when CUDA is not
    initialised yet (a larger value already set is kept).

    With 16 ranks or more (10 on emulated nodes), even 32 queues (the most CUDA allows) are shared by
    some streams: such groups are accepted, but a rank's work can wait behind another rank's kernel.

    Raises:
        RuntimeError: CUDA was initialised with lazy loading, or with fewer than
            `connections_needed` connections (8 when the variable is unset).
    """
    need = connections_needed(num_ranks, streams_per_rank)
    if not torch.cuda.is_initialized():
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
        if _connections() < MAX_CONNECTIONS:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(MAX_CONNECTIONS)
        return
    if not _eager_loading():
        raise RuntimeError(
            "emulated ranks need CUDA_MODULE_LOADING=EAGER: CUDA's lazy loading waits for the whole GPU to "
            "drain before loading a kernel, which never happens while another rank's kernel spins waiting "
            "for this one. Set CUDA_MODULE_LOADING=EAGER in the environment before the process first uses "
            "CUDA (or create the EmulatedGroup before any CUDA work)")
    if _connections() < need:
        raise RuntimeError(
            f"{num_ranks} emulated ranks need CUDA_DEVICE_MAX_CONNECTIONS >= {need} (this process has "
            f"{_connections()}): with fewer hardware queues, one rank's work waits behind another rank's "
            f"spinning kernel and the ranks time out. Set CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment "
            f"before the process first uses CUDA (or create the EmulatedGroup before any CUDA work)")


def _connections() -> int:
    try:
        return int(envs.get("CUDA_DEVICE_MAX_CONNECTIONS") or "8")
    except ValueError:
        return 8


def _eager_loading() -> bool:
    if (envs.get("CUDA_MODULE_LOADING") or "").upper() == "EAGER":
        return True
    try:
        from cuda.bindings import driver
        err, mode = driver.cuModuleGetLoadingMode()
        return int(err) == 0 and mode == driver.CUmoduleLoadingMode.CU_MODULE_EAGER_LOADING
    except Exception:  # noqa: BLE001 - no bindings: unknown, treated as lazy
        return False


class CollectiveLoadError(threading.BrokenBarrierError):
    """A rank gave up waiting at a collective kernel-module load (`EmulatedGroup.load_collectively`).

    A `threading.BrokenBarrierError`: `EmulatedGroup.run` reports another rank's own error first."""


class EmulatedRankGroup:
    """One rank of an `EmulatedGroup`: what that rank passes to `deep_ep.ElasticBuffer` as ``group``."""

    def __init__(self, parent: EmulatedGroup, rank: int) -> None:
        self.parent = parent
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.parent.num_ranks

    def barrier(self) -> None:
        self.parent.barrier()

    def load_collectively(self, key, load: Callable) -> None:
        """See `EmulatedGroup.load_collectively`."""
        self.parent.load_collectively(self._rank, key, load)

    def num_nvlink_ranks(self) -> int:
        """Ranks of one emulated node (`deep_ep.topology`)."""
        return self.parent.num_nvlink_ranks

    def make_transport(self, num_bytes: int, num_allocated_qps: int = 0, timeout_ns: int = 2_000_000_000,
                       allow_hybrid_mode: bool = False):
        """Collective over the ranks: the window set shared by this group's next buffer; with several
        nodes, its emulated GIN too (``num_allocated_qps`` contexts, 0: DeepEP's 17 of direct mode),
        for hybrid mode with ``allow_hybrid_mode`` and nodes of several ranks (with one rank per node
        hybrid mode moves what direct mode moves). ``timeout_ns``: the buffer's GPU timeout, which
        bounds the emulated GIN's waits (`deep_ep.comm.gin.EmulatedGinState`).

        Raises:
            ValueError: across nodes, ranks that passed another ``allow_hybrid_mode`` or
                ``num_allocated_qps`` (on every rank, after a barrier; nothing is kept).
        """
        ws = self.parent._windows_for(self._rank, num_bytes)
        transport = EmulatedTransport(ws, self._rank, self.parent.barrier)
        if self.parent.num_nvlink_ranks < self.parent.num_ranks:
            from .comm.gin import EmulatedGinDirectTransport
            hybrid = bool(allow_hybrid_mode) and self.parent.num_nvlink_ranks > 1
            allocated = num_allocated_qps or 17
            self.parent._agree_on_gin(ws, self._rank, (bool(allow_hybrid_mode), allocated), transport)
            state = self.parent._gin_for(ws, allocated, timeout_ns, hybrid)
            transport = EmulatedGinDirectTransport(transport, state)
        self.parent.barrier()  # every rank holds its transport before any kernel can signal
        return transport


def _nvlink_ranks(num_ranks: int, num_nvlink_ranks: Optional[int]) -> int:
    text = envs.get("EP_EMULATED_NUM_NVLINK_RANKS") if num_nvlink_ranks is None else str(num_nvlink_ranks)
    if text is None:
        return num_ranks
    value = text.strip()
    if not value.isdigit() or int(value) < 1 or num_ranks % int(value):
        raise ValueError(f"num_nvlink_ranks (or EP_EMULATED_NUM_NVLINK_RANKS) = {text!r}: expected the ranks of "
                         f"one emulated node, a positive integer dividing the group's {num_ranks} ranks")
    return int(value)


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(text)
