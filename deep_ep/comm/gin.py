"""Host side of the emulated GIN (``deep_ep/include/deep_ep/comm/gin.cuh``) and its self-test runner.

`EmulatedGin` allocates the state an emulated GIN needs for ``num_ranks`` ranks on one GPU (queues,
entries, staging, signals, counters) and gives the kernels its ``EmulatedGinArgs``. `run_selftest`
builds the test kernels (``deep_ep/include/deep_ep/kernels/gin_selftest.cuh``) through `deep_ep.jit`
and runs one ping-pong: with a correct user of GIN every word arrives; with a planted bug (a weak
signal trusted for other puts, a source reused before flush) the seeded NIC makes words arrive wrong.

`EmulatedGinDirectTransport` is the transport of an `deep_ep.emulated.EmulatedGroup` whose ranks form
several nodes: the dispatch and combine data kernels, built with ``EP_TRANSPORT_GIN=1``, reach every
other rank through the emulated GIN (``comm/gin_direct.cuh``), and each data kernel of a rank runs
next to an NIC kernel of that rank (``kernels/gin_nic.cuh``) on a stream of its own; so do the control
kernels (a dispatch's notify stage, the GPU barrier: ``comm/gin_control.cuh``,
`deep_ep.backends.gpu.modules.launch_control`), which reach other nodes through it too. In hybrid mode
(``EP_TRANSPORT_GIN=2``, ``comm/gin_hybrid.cuh``) the same class reaches only the rail peers through
the GIN, and the state holds each rank's forwarding area and inbox.

`byte_counters` (`deep_ep.comm.gin_bytes`) reads what the emulated NICs of a group carried: the
bytes of every put, per (source rank, destination rank); `reset_byte_counters` zeroes them.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .. import jit
from ..backends.gpu.abi import CTRL_BYTES, CTRL_ERROR_OFFSET
from .gin_bytes import byte_counters, reset_byte_counters   # what the NICs carried (EmulatedGin.carried_bytes)
from .transport import Transport

__all__ = ["MODES", "BUGGY_MODES", "SELFTEST_PHASE", "REPORT_WORDS", "SELFTEST_SOURCE", "QUEUE_BYTES",
           "ENTRY_BYTES", "EmulatedGinArgs", "EmulatedGin", "selftest_window_bytes", "build_selftest", "run_selftest",
           "GinTransportArgs", "GinHybridTransportArgs", "NIC_KERNEL", "NIC_THREADS", "NIC_IDLE_TIMEOUTS",
           "EmulatedGinSettings", "EmulatedGinState", "EmulatedGinDirectTransport", "byte_counters",
           "reset_byte_counters"]

#: the self-test's modes (kMode* of gin_selftest.cuh); "weak_last", "no_flush" and "first_word" are
#: planted bugs, "no_signal" sends no signal, so every rank's first wait times out (and records it)
MODES = {"strong": 0, "weak_each": 1, "weak_last": 2, "no_flush": 3, "counter": 4, "no_signal": 5, "first_word": 6}
#: the phase the self-test's waits record on a timeout (kPhase of gin_selftest.cuh)
SELFTEST_PHASE = 8
#: the modes whose user of GIN is wrong: the emulated GIN must make them fail
BUGGY_MODES = ("weak_last", "no_flush", "first_word")
SELFTEST_SOURCE = "#include <deep_ep/kernels/gin_selftest.cuh>\n"
QUEUE_BYTES = 32    # sizeof(GinQueue)
ENTRY_BYTES = 64    # sizeof(GinEntry)
REPORT_WORDS = 4    # kReportWords
_THREADS = 128      # threads per block of the self-test launch: 4 NIC warps per NIC block


class EmulatedGinArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::comm::EmulatedGinArgs`` (comm/gin.cuh), passed by value."""
    _fields_ = [("windows", ctypes.c_void_p), ("queues", ctypes.c_void_p), ("entries", ctypes.c_void_p),
                ("staging", ctypes.c_void_p), ("signals", ctypes.c_void_p), ("counters", ctypes.c_void_p),
                ("done", ctypes.c_void_p), ("seed", ctypes.c_uint64), ("issue_timeout_ns", ctypes.c_uint64),
                ("min_delay_ns", ctypes.c_uint32), ("max_delay_ns", ctypes.c_uint32), ("linger_ns", ctypes.c_uint32),
                ("num_ranks", ctypes.c_int), ("num_contexts", ctypes.c_int), ("num_signals", ctypes.c_int),
                ("num_counters", ctypes.c_int), ("queue_depth", ctypes.c_int), ("stage_bytes", ctypes.c_int),
                ("batch", ctypes.c_int)]


class EmulatedGin:
    """The state of an emulated GIN for ``num_ranks`` ranks whose windows are ``windows``.

    Args:
        windows: ``[num_ranks]`` uint8 CUDA tensors, the ranks' windows (each starts with the control
            region of ``CTRL_BYTES``, where waits record their errors).
        num_contexts: GIN contexts (num_qps), >= 1.
        num_signals, num_counters: per (rank, context), >= 1.
        queue_depth: entries per (source, context, destination) queue, in [1, 64] (the NIC's landing
            bitmask); a full queue makes the issuer wait.
        stage_bytes: the largest put (a multiple of 4): the NIC reads a source into a staging slot
            of this size, then lands it later.

    Raises:
        ValueError: a count out of range, or windows not on one CUDA device.
    """

    def __init__(self, windows: list, num_contexts: int = 2, num_signals: int = 4, num_counters: int = 2,
                 queue_depth: int = 16, stage_bytes: int = 4096) -> None:
        if not windows or any(w.device != windows[0].device or w.dtype != torch.uint8 or w.dim() != 1
                              for w in windows) or windows[0].device.type != "cuda":
            raise ValueError("EmulatedGin: windows must be 1-D uint8 tensors on one CUDA device")
        if min(num_contexts, num_signals, num_counters) < 1:
            raise ValueError(f"EmulatedGin: contexts ({num_contexts}), signals ({num_signals}) and counters "
                             f"({num_counters}) must be at least 1")
        if not 1 <= queue_depth <= 64:
            raise ValueError(f"EmulatedGin: queue_depth={queue_depth} is outside [1, 64]")
        if stage_bytes < 4 or stage_bytes % 4:
            raise ValueError(f"EmulatedGin: stage_bytes={stage_bytes} must be a positive multiple of 4")
        self.windows = windows
        self.num_ranks = len(windows)
        self.num_contexts, self.num_signals, self.num_counters = num_contexts, num_signals, num_counters
        self.queue_depth, self.stage_bytes = queue_depth, stage_bytes
        device = windows[0].device
        num_queues = self.num_ranks * num_contexts * self.num_ranks
        self.window_table = torch.tensor([w.data_ptr() for w in windows], dtype=torch.int64, device=device)
        self.queues = torch.zeros(num_queues * QUEUE_BYTES // 8, dtype=torch.int64, device=device)
        self.entries = torch.zeros(num_queues * queue_depth * ENTRY_BYTES // 8, dtype=torch.int64, device=device)
        self.staging = torch.zeros(num_queues * queue_depth * stage_bytes, dtype=torch.uint8, device=device)
        self.signals = torch.zeros(self.num_ranks * num_contexts * num_signals, dtype=torch.int64, device=device)
        self.counters = torch.zeros(self.num_ranks * num_contexts * num_counters, dtype=torch.int64, device=device)
        # [num_ranks][2]: per rank, user blocks that ended and NIC warps that ended (kernels/gin_nic.cuh)
        self.done = torch.zeros(2 * self.num_ranks, dtype=torch.int32, device=device)
        # [num_ranks][num_ranks]: bytes of the puts the NIC kernel carried, by (source, destination)
        # (kernels/gin_nic.cuh; `byte_counters`)
        self.carried_bytes = torch.zeros(self.num_ranks, self.num_ranks, dtype=torch.int64, device=device)

    @property
    def num_queues(self) -> int:
        """``num_ranks * num_contexts * num_ranks``: one queue per (source, context, destination)."""
        return self.num_ranks * self.num_contexts * self.num_ranks

    def reset(self) -> None:
        """Zero every queue, signal and counter, the byte counters too (between launches; nothing may
        be in flight)."""
        for t in (self.queues, self.entries, self.signals, self.counters, self.done, self.carried_bytes):
            t.zero_()

    def issued(self, rank: int) -> list:
        """Puts (signals alone included) that rank ``rank`` has issued to each rank so far, summed over
        the contexts: ``num_ranks`` ints, read from the queues (a copy on the current stream; read them
        when nothing of the rank runs)."""
        queues = self.queues.view(self.num_ranks, self.num_contexts, self.num_ranks, QUEUE_BYTES // 8)
        return queues[rank, :, :, 0].sum(0).tolist()

    def full_waits(self) -> list:
        """Puts that found their queue full, per queue (index (source * contexts + context) * ranks + destination)."""
        return self.queues.view(-1, QUEUE_BYTES // 8)[:, 3].tolist()

    def kernel_args(self, seed: int = 0, min_delay_ns: int = 2000, max_delay_ns: int = 20000, linger_ns: int = 50000,
                    batch: int = 1, issue_timeout_ns: int = 2_000_000_000, rank: int = 0) -> EmulatedGinArgs:
        """The kernels' ``EmulatedGinArgs``: the NIC reads each source and lands each put after a delay
        drawn in ``[min_delay_ns, max_delay_ns)`` from a generator seeded by ``seed`` and the queue, and
        gathers up to ``batch`` entries of a queue (waiting at most ``linger_ns``) before landing them
        in a random order. ``issue_timeout_ns`` bounds a put's wait for room and a flush. ``rank``:
        whose ``done`` words the NIC reads (an NIC kernel per rank, kernels/gin_nic.cuh).

        Raises:
            ValueError: ``max_delay_ns < min_delay_ns`` or a negative value.
        """
        if min(min_delay_ns, max_delay_ns, linger_ns, issue_timeout_ns, seed) < 0 or max_delay_ns < min_delay_ns:
            raise ValueError(f"EmulatedGin: delays [{min_delay_ns}, {max_delay_ns}) ns, linger {linger_ns} ns, "
                             f"timeout {issue_timeout_ns} ns and seed {seed} must be non-negative, the range ordered")
        return EmulatedGinArgs(
            windows=self.window_table.data_ptr(), queues=self.queues.data_ptr(), entries=self.entries.data_ptr(),
            staging=self.staging.data_ptr(), signals=self.signals.data_ptr(), counters=self.counters.data_ptr(),
            done=self.done.data_ptr() + 8 * rank, seed=seed, issue_timeout_ns=issue_timeout_ns, min_delay_ns=min_delay_ns,
            max_delay_ns=max_delay_ns, linger_ns=linger_ns, num_ranks=self.num_ranks, num_contexts=self.num_contexts,
            num_signals=self.num_signals, num_counters=self.num_counters, queue_depth=self.queue_depth,
            stage_bytes=self.stage_bytes, batch=batch)


def selftest_window_bytes(payload_words: int, rounds: int) -> int:
    """Bytes of a self-test window: the control region, the source, ``2 * rounds`` receive slots."""
    return CTRL_BYTES + payload_words * 4 * (1 + 2 * rounds)


def build_selftest(check_spills: bool = True, **build_args) -> jit.Module:
    """Compile the self-test kernels (emulated; with ``use_nccl=True`` also the NCCL transport's probe)."""
    return jit.build("deep_ep_gin_selftest", SELFTEST_SOURCE, check_spills=check_spills, **build_args)


def run_selftest(mode: str = "strong", num_ranks: int = 2, num_contexts: int = 2, rounds: int = 6,
                 payload_words: int = 1024, pieces: int = 2, queue_depth: int = 16, seed: int = 0,
                 min_delay_ns: int = 5000, max_delay_ns: int = 30000, timeout_s: float = 2.0,
                 device: torch.device | None = None) -> dict:
    """One ping-pong of emulated ranks over the emulated GIN; every rank sends each round's payload
    (``payload_words`` uint32, in ``pieces`` puts) to the next rank and to itself.

    Returns:
        ``{"mismatched_words": [per rank], "bad_rounds": [per rank], "rounds_done": [per rank],
        "errors": [per rank (code, rank, peer, phase)], "full_waits": total puts that found a queue full}``.

    Raises:
        ValueError: an unknown mode, ``pieces`` not dividing ``payload_words``, a piece larger than 64
            KiB, or counts out of range.
    """
    if mode not in MODES:
        raise ValueError(f"run_selftest: mode {mode!r} is not one of {sorted(MODES)}")
    if num_ranks < 1 or rounds < 1 or pieces < 1 or payload_words < 1 or payload_words % pieces:
        raise ValueError(f"run_selftest: {num_ranks} ranks, {rounds} rounds, {payload_words} words in {pieces} "
                         f"pieces: need positive counts and pieces dividing the words")
    piece_bytes = payload_words // pieces * 4
    if piece_bytes > 65536:
        raise ValueError(f"run_selftest: pieces of {piece_bytes} bytes exceed the staging slots' 65536")
    device = device or torch.device("cuda", torch.cuda.current_device())
    window_bytes = selftest_window_bytes(payload_words, rounds)
    windows = [torch.zeros(window_bytes, dtype=torch.uint8, device=device) for _ in range(num_ranks)]
    gin = EmulatedGin(windows, num_contexts=num_contexts, num_signals=2, num_counters=1, queue_depth=queue_depth,
                      stage_bytes=piece_bytes)
    args = gin.kernel_args(seed=seed, min_delay_ns=min_delay_ns, max_delay_ns=max_delay_ns,
                           batch=min(pieces, queue_depth), issue_timeout_ns=int(timeout_s * 1e9))
    report = torch.zeros(num_ranks * REPORT_WORDS, dtype=torch.int32, device=device)
    module = build_selftest()
    warps_per_block = _THREADS // 32
    nic_blocks = -(-gin.num_queues // warps_per_block)
    module.function("gin_selftest").launch(
        num_ranks + nic_blocks, _THREADS,
        (args, jit.i32(MODES[mode]), jit.i32(rounds), jit.i32(payload_words), jit.i32(pieces),
         jit.u64(int(timeout_s * 1e9)), report), cooperative=True)
    torch.cuda.synchronize(device)
    rows = report.view(num_ranks, REPORT_WORDS).tolist()
    errors = [tuple(w[CTRL_ERROR_OFFSET:CTRL_ERROR_OFFSET + 16].view(torch.int32).tolist()) for w in windows]
    return {"mismatched_words": [r[0] for r in rows], "bad_rounds": [r[1] for r in rows],
            "rounds_done": [r[2] for r in rows], "errors": errors, "full_waits": sum(gin.full_waits())}


# ---------------------------------------------------------------------------------------------
# The direct-mode transport of emulated nodes.

NIC_KERNEL = "deep_ep_gin_nic"
NIC_THREADS = 256   # 8 NIC warps per block of the NIC kernel
#: kGinNicIdleTimeouts of comm/gin.cuh: the NIC gives up after this many GPU timeouts without a put
#: or the end of its rank's data kernel
NIC_IDLE_TIMEOUTS = 4


class GinTransportArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::comm::TransportArgs`` built with ``EP_TRANSPORT_GIN=1`` (comm/transport.cuh):
    the emulated transport's fields, then the GIN's."""
    _fields_ = [("peers", ctypes.c_void_p), ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int),
                ("gin", ctypes.c_void_p), ("recv_offset", ctypes.c_int64), ("half_bytes", ctypes.c_int64),
                ("stage_offset", ctypes.c_int64), ("max_put_bytes", ctypes.c_int), ("num_contexts", ctypes.c_int),
                ("node_ranks", ctypes.c_int)]


class GinHybridTransportArgs(GinTransportArgs):
    """Host mirror of ``deep_ep::comm::TransportArgs`` built with ``EP_TRANSPORT_GIN=2`` (hybrid mode):
    `GinTransportArgs`, then the offsets of the forwarding area and of combine's inbox from every
    window (comm/gin_hybrid.cuh)."""
    _fields_ = [("forward_offset", ctypes.c_int64), ("inbox_offset", ctypes.c_int64)]


class EmulatedGinSettings:
    """How the emulated NIC of a group behaves (`deep_ep.emulated.EmulatedGroup`'s ``gin_*`` arguments).

    Args:
        seed: seeds the NIC's delays and landing order (two seeds: two orders).
        num_contexts: contexts the kernels use (num_qps), at most those allocated.
        gin_within_node: reach the peers of a rank's own node through the GIN too (default: by loads
            and stores, as DeepEP's direct mode reaches NVLink peers).
        queue_depth, stage_bytes, batch, min_delay_ns, max_delay_ns, linger_ns: see `EmulatedGin` and
            `EmulatedGin.kernel_args`.

    Raises:
        ValueError: a count or delay out of range.
    """

    def __init__(self, seed: int = 0, num_contexts: int = 2, queue_depth: int = 16, stage_bytes: int = 4096,
                 batch: int = 4, min_delay_ns: int = 500, max_delay_ns: int = 4000, linger_ns: int = 20000,
                 gin_within_node: bool = False) -> None:
        if num_contexts < 1 or not 1 <= batch <= queue_depth <= 64 or stage_bytes < 16 or stage_bytes % 16:
            raise ValueError(f"EmulatedGinSettings: contexts {num_contexts} >= 1, 1 <= batch {batch} <= queue depth "
                             f"{queue_depth} <= 64 and stage_bytes {stage_bytes} a positive multiple of 16 needed")
        if min(seed, min_delay_ns, linger_ns) < 0 or max_delay_ns < min_delay_ns:
            raise ValueError(f"EmulatedGinSettings: seed {seed}, delays [{min_delay_ns}, {max_delay_ns}) ns and "
                             f"linger {linger_ns} ns must be non-negative, the range ordered")
        self.seed, self.num_contexts, self.queue_depth, self.stage_bytes = seed, num_contexts, queue_depth, stage_bytes
        self.batch, self.min_delay_ns, self.max_delay_ns, self.linger_ns = batch, min_delay_ns, max_delay_ns, linger_ns
        self.gin_within_node = bool(gin_within_node)


def receive_halves(num_ranks: int, num_bytes: int) -> tuple:
    """``(recv_offset, half_bytes)`` of a window of ``num_bytes`` for ``num_ranks`` ranks: every call's
    layout has them (`deep_ep.backends.gpu.window.make_layout` with ``num_bytes``)."""
    from ..backends.gpu.window import make_layout
    layout = make_layout(num_ranks, 1, 8, num_bytes=num_bytes)
    return layout.recv_offset, layout.half_bytes


class EmulatedGinState:
    """What the ranks of one buffer share: the emulated GIN over their windows (``num_allocated``
    contexts), each rank's staging area (``[num_ranks][half_bytes]``: the rows it sends, by
    destination), each rank's copy of ``EmulatedGinArgs`` in device memory, and in hybrid mode each
    rank's forwarding area and inbox (comm/gin_hybrid.cuh).

    Args:
        windows: the ranks' windows (`EmulatedGin`). num_bytes: a window's size.
        num_allocated: contexts allocated (the buffer's ``num_allocated_qps``).
        settings: `EmulatedGinSettings`. timeout_ns: the buffer's GPU timeout, which also bounds a
            put's wait for room, a flush, and (`NIC_IDLE_TIMEOUTS` of it) the NIC's wait for its rank.
        num_nvlink_ranks: ranks of a node. hybrid: the buffer runs hybrid mode (rail peers only
            through the GIN, whatever ``settings.gin_within_node`` says).
    """

    def __init__(self, windows: list, num_bytes: int, num_allocated: int, settings: EmulatedGinSettings,
                 timeout_ns: int, num_nvlink_ranks: int = 1, hybrid: bool = False) -> None:
        num_ranks = len(windows)
        self.settings, self.timeout_ns = settings, timeout_ns
        # hybrid mode: the node's ranks by loads and stores whatever the settings say (only rail
        # peers are reached through the NIC)
        self.hybrid = bool(hybrid)
        self.node_ranks = num_nvlink_ranks if self.hybrid or not settings.gin_within_node else 1
        self.num_contexts = min(settings.num_contexts, num_allocated)
        self.gin = EmulatedGin(windows, num_contexts=num_allocated, num_signals=2 * num_ranks, num_counters=1,
                               queue_depth=settings.queue_depth, stage_bytes=settings.stage_bytes)
        self.recv_offset, self.half_bytes = receive_halves(num_ranks, num_bytes)
        self.staging = torch.zeros(num_ranks * num_ranks * self.half_bytes, dtype=torch.uint8, device=windows[0].device)
        # hybrid mode: each rank's forwarding area and combine's inbox (two halves each), at the same
        # offset from every window (slices as far apart as the windows)
        self.forwarding, self.inbox = (torch.zeros(num_ranks * num_bytes if self.hybrid else 0, dtype=torch.uint8,
                                                   device=windows[0].device) for _ in range(2))
        self.num_bytes = num_bytes
        size = ctypes.sizeof(EmulatedGinArgs)
        blob = b"".join(bytes(self.gin.kernel_args(
            seed=settings.seed, min_delay_ns=settings.min_delay_ns, max_delay_ns=settings.max_delay_ns,
            linger_ns=settings.linger_ns, batch=settings.batch, issue_timeout_ns=timeout_ns, rank=r))
            for r in range(num_ranks))
        self.rank_args = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(windows[0].device)
        self.args_bytes = size
        torch.cuda.current_stream(windows[0].device).synchronize()   # zeroed and copied before any kernel
        self.windows = windows

    def _transport_fields(self, base_args, rank: int) -> dict:
        """The fields of ``rank``'s `GinTransportArgs` (``base_args``: its emulated transport's), by name."""
        # The staging area is addressed from the rank's window (an offset that may be negative here;
        # a real NIC needs it inside the registered window).
        stage = self.staging.data_ptr() + rank * len(self.windows) * self.half_bytes
        return dict(peers=base_args.peers, rank=rank, num_ranks=base_args.num_ranks,
                    gin=self.rank_args.data_ptr() + rank * self.args_bytes, recv_offset=self.recv_offset,
                    half_bytes=self.half_bytes, stage_offset=stage - self.windows[rank].data_ptr(),
                    max_put_bytes=self.settings.stage_bytes, num_contexts=self.num_contexts,
                    node_ranks=self.node_ranks)

    def transport_args(self, base_args, rank: int) -> GinTransportArgs:
        """The GIN kernels' ``TransportArgs`` of ``rank`` (``base_args``: its emulated transport's)."""
        return GinTransportArgs(**self._transport_fields(base_args, rank))

    def hybrid_transport_args(self, base_args, rank: int) -> GinHybridTransportArgs:
        """The hybrid-mode kernels' ``TransportArgs`` of ``rank``: `transport_args`' fields, then the
        offsets of the forwarding area and the inbox (the same from every window). Built field by
        field: a copy of the bytes of a temporary struct would read memory freed with it."""
        window = self.windows[rank].data_ptr()
        return GinHybridTransportArgs(**self._transport_fields(base_args, rank),
                                      forward_offset=self.forwarding.data_ptr() + rank * self.num_bytes - window,
                                      inbox_offset=self.inbox.data_ptr() + rank * self.num_bytes - window)

    def check_transport_args(self, args, base_args, rank: int) -> None:
        """Raise `RuntimeError` unless ``args`` (the struct ``rank``'s kernels get) holds exactly
        `transport_args`' fields (and, in hybrid mode, the forwarding and inbox offsets): a kernel
        given another peer table, rank or GIN state faults or waits on the wrong words."""
        expected = self.hybrid_transport_args(base_args, rank) if self.hybrid else self.transport_args(base_args, rank)
        if type(args) is not type(expected):
            wrong = [f"a {type(args).__name__}, expected a {type(expected).__name__}"]
        else:
            wrong = [f"{name} = {getattr(args, name)!r}, expected {getattr(expected, name)!r}"
                     for name in _field_names(type(expected)) if getattr(args, name) != getattr(expected, name)]
        if wrong:
            raise RuntimeError(f"deep_ep: emulated rank {rank}: the kernels' transport arguments differ from the "
                               f"GIN state's: {'; '.join(wrong)}")


def _field_names(struct: type) -> list:
    """Every field of a ctypes structure, its bases' first (``_fields_`` lists a class's own only)."""
    return [name for cls in reversed(struct.__mro__) for name, *_ in cls.__dict__.get("_fields_", ())]


class EmulatedGinDirectTransport(Transport):
    """One emulated rank's transport when the group's ranks form several nodes: the window of
    ``base`` (a `deep_ep.comm.emulated.EmulatedTransport`), and the emulated GIN of ``state``
    (`EmulatedGinState`) for the data and control kernels, each launched next to this rank's NIC
    kernel (`launch_data`, which drains every context: a call may use fewer). A
    `deep_ep.comm.transport.Transport`, plus ``gin_define`` (the kernels' ``EP_TRANSPORT_GIN``) and
    ``nic_blocks`` (blocks of the NIC kernel, on SMs of their own).
    """

    kernel_define = 0
    _carried_bytes = None   # the NIC kernel's byte counters (None: a null pointer, nothing counted)

    def __init__(self, base, state: EmulatedGinState) -> None:
        from ..cuda.streams import StreamJoin, new_stream
        self.base, self.state = base, state
        self.rank, self.num_ranks, self.num_bytes, self.device = base.rank, base.num_ranks, base.num_bytes, base.device
        #: the kernels' EP_TRANSPORT_GIN: 1 direct mode, 2 hybrid mode (comm/gin_hybrid.cuh)
        self.gin_define = 2 if state.hybrid else 1
        self._nic_args = state.transport_args(base.kernel_args(), base.rank)   # the NIC kernel's (GIN=1)
        self._args = state.hybrid_transport_args(base.kernel_args(), base.rank) if state.hybrid else self._nic_args
        state.check_transport_args(self._args, base.kernel_args(), base.rank)
        self.nic_blocks = -(-state.num_contexts * self.num_ranks * 32 // NIC_THREADS)
        self._carried_bytes = state.gin.carried_bytes
        self._nic_stream = new_stream(self.device)
        self._join = StreamJoin(self.device)

    def kernel_args(self) -> GinTransportArgs:
        return self._args

    def window_tensor(self) -> torch.Tensor:
        return self.base.window_tensor()

    def host_barrier(self) -> None:
        self.base.host_barrier()

    def first_failed_rank(self, ok: bool) -> Optional[int]:
        return self.base.first_failed_rank(ok)

    def destroy(self) -> None:
        """Release the NIC's stream once its kernels have ended, then the window (the last rank out
        frees the GIN's memory with the windows').

        Raises:
            TimeoutError: an NIC kernel of this rank did not end within `drain_secs` (its own timeout
                failed): its stream, the windows and the GIN's memory are kept (the kernel may still
                write them) and the rest is released.
        """
        from ..cuda.streams import release_stream
        stuck = False
        if self._nic_stream is not None:
            stuck = not self._drain_nic()
            if not stuck:
                release_stream(self._nic_stream)   # never recycled while a kernel may still run on it
            self._nic_stream = None
        self._join.destroy()
        windows = self.base.windows
        if stuck:
            _ABANDONED.append((windows, self.state))
            raise TimeoutError(f"deep_ep: emulated rank {self.rank}: its emulated NIC kernel did not end within "
                               f"{self.drain_secs:.0f} s of the buffer's destroy; its stream and the GIN's memory "
                               f"are kept")
        self.base.destroy()
        with windows.lock:
            if windows.refs == 0:
                windows.gin_state = None   # the last rank out frees the GIN's memory with the windows'

    @property
    def drain_secs(self) -> float:
        """How long `destroy` waits for this rank's NIC kernels: past the NIC's own limit on waiting
        for the data kernel's blocks (kGinNicIdleTimeouts GPU timeouts), plus a margin."""
        return (NIC_IDLE_TIMEOUTS + 1) * self.state.timeout_ns / 1e9 + 5.0

    def _drain_nic(self) -> bool:
        """Wait on the host (an event, polled) for the NIC kernels queued on this rank's NIC stream."""
        from ..cuda.streams import poll_event
        done = torch.cuda.Event()
        done.record(self._nic_stream)
        return poll_event(done, self.drain_secs)

    def launch_data(self, nic_module, stream: int, num_user_blocks: int, launch) -> None:
        """Launch this rank's NIC kernel (from ``nic_module``) on its own stream, after the work queued
        on the raw stream ``stream``; then ``launch()`` (the data kernel of ``num_user_blocks`` blocks,
        on ``stream``); then make ``stream`` wait for the NIC kernel, also when ``launch()`` raised (its
        error is passed on): the NIC kernel, which ends once the data kernel's blocks have, is then
        told that they have (a write to its ``done`` word queued on ``stream``)."""
        nic = self._nic_stream.cuda_stream
        self._join.wait(nic, stream)
        nic_module.function(NIC_KERNEL).launch(
            self.nic_blocks, NIC_THREADS, (self._nic_args, jit.i32(num_user_blocks), self._carried_bytes),
            stream=nic, device=self.device.index)
        try:
            launch()
        except BaseException:
            self._release_nic(stream, num_user_blocks)
            raise
        finally:
            self._join.wait(stream, nic)

    def _release_nic(self, stream: int, num_user_blocks: int) -> None:
        """Count the data kernel's ``num_user_blocks`` blocks as ended in this rank's NIC ``done`` word
        (a write queued on the raw ``stream``, which is not behind the NIC kernel)."""
        from ..cuda.driver import enter_context, leave_context, stream_write_u32
        previous = enter_context(self.device.index)
        try:
            stream_write_u32(stream, self.state.gin.done.data_ptr() + 8 * self.rank, num_user_blocks)
        finally:
            leave_context(previous)


#: what the destroy of a rank whose NIC kernel never ended keeps alive (the kernel may still write it)
_ABANDONED: list = []
