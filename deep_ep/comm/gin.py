"""Host side of the emulated GIN (``deep_ep/include/deep_ep/comm/gin.cuh``) and its self-test runner.

`EmulatedGin` allocates the state an emulated GIN needs for ``num_ranks`` ranks on one GPU (queues,
entries, staging, signals, counters) and gives the kernels its ``EmulatedGinArgs``. `run_selftest`
builds the test kernels (``deep_ep/include/deep_ep/kernels/gin_selftest.cuh``) through `deep_ep.jit`
and runs one ping-pong: with a correct user of GIN every word arrives; with a planted bug (a weak
signal trusted for other puts, a source reused before flush) the seeded NIC makes words arrive wrong.
No kernel of the library uses GIN yet (docs/scaleout.md).
"""
from __future__ import annotations

import ctypes

import torch

from .. import jit
from ..backends.gpu.abi import CTRL_BYTES, CTRL_ERROR_OFFSET

__all__ = ["MODES", "BUGGY_MODES", "SELFTEST_PHASE", "REPORT_WORDS", "SELFTEST_SOURCE", "QUEUE_BYTES",
           "ENTRY_BYTES", "EmulatedGinArgs", "EmulatedGin", "selftest_window_bytes", "build_selftest", "run_selftest"]

#: the self-test's modes (kMode* of gin_selftest.cuh); "weak_last" and "no_flush" are planted bugs,
#: "no_signal" sends no signal, so every rank's first wait times out (and records it)
MODES = {"strong": 0, "weak_each": 1, "weak_last": 2, "no_flush": 3, "counter": 4, "no_signal": 5}
#: the phase the self-test's waits record on a timeout (kPhase of gin_selftest.cuh)
SELFTEST_PHASE = 8
#: the modes whose user of GIN is wrong: the emulated GIN must make them fail
BUGGY_MODES = ("weak_last", "no_flush")
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
        self.done = torch.zeros(1, dtype=torch.int32, device=device)

    @property
    def num_queues(self) -> int:
        """``num_ranks * num_contexts * num_ranks``: one queue per (source, context, destination)."""
        return self.num_ranks * self.num_contexts * self.num_ranks

    def reset(self) -> None:
        """Zero every queue, signal and counter (between launches; nothing may be in flight)."""
        for t in (self.queues, self.entries, self.signals, self.counters, self.done):
            t.zero_()

    def full_waits(self) -> list:
        """Puts that found their queue full, per queue (index (source * contexts + context) * ranks + destination)."""
        return self.queues.view(-1, QUEUE_BYTES // 8)[:, 3].tolist()

    def kernel_args(self, seed: int = 0, min_delay_ns: int = 2000, max_delay_ns: int = 20000, linger_ns: int = 50000,
                    batch: int = 1, issue_timeout_ns: int = 2_000_000_000) -> EmulatedGinArgs:
        """The kernels' ``EmulatedGinArgs``: the NIC reads each source and lands each put after a delay
        drawn in ``[min_delay_ns, max_delay_ns)`` from a generator seeded by ``seed`` and the queue, and
        gathers up to ``batch`` entries of a queue (waiting at most ``linger_ns``) before landing them
        in a random order. ``issue_timeout_ns`` bounds a put's wait for room and a flush.

        Raises:
            ValueError: ``max_delay_ns < min_delay_ns`` or a negative value.
        """
        if min(min_delay_ns, max_delay_ns, linger_ns, issue_timeout_ns, seed) < 0 or max_delay_ns < min_delay_ns:
            raise ValueError(f"EmulatedGin: delays [{min_delay_ns}, {max_delay_ns}) ns, linger {linger_ns} ns, "
                             f"timeout {issue_timeout_ns} ns and seed {seed} must be non-negative, the range ordered")
        return EmulatedGinArgs(
            windows=self.window_table.data_ptr(), queues=self.queues.data_ptr(), entries=self.entries.data_ptr(),
            staging=self.staging.data_ptr(), signals=self.signals.data_ptr(), counters=self.counters.data_ptr(),
            done=self.done.data_ptr(), seed=seed, issue_timeout_ns=issue_timeout_ns, min_delay_ns=min_delay_ns,
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
