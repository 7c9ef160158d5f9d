"""What the host shares with the kernels, read from the one source, ``include/deep_ep/common/abi.cuh``.

Every ``constexpr int kName = value;`` line of ``common/abi.cuh`` becomes an entry of `CONSTANTS`
(``kMaxRanks`` -> ``CONSTANTS["kMaxRanks"]``), and the ``EP_LAYOUT_WORDS`` list gives `LayoutIndex`
the word offsets of a handle's layout tensor. The argument structs the kernels take by value are
mirrored as ctypes structures below; tests/test_kernel_args_layout.py checks them against the
compiler's own offsets.
"""
from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

__all__ = ["CONSTANTS", "LayoutIndex", "layout_index", "CallTag", "call_tag", "NotifyArgs", "LayoutArgs", "DispatchArgs", "CombineArgs",
           "READBACK", "READBACK_WORDS", "MAX_RANKS",
           "MAX_EXPERTS", "MAX_TOPK", "CTRL_BYTES", "CTRL_ERROR_OFFSET", "PHASES"]

_COMMON = Path(__file__).resolve().parents[2] / "include" / "deep_ep" / "common"
_CONSTEXPR = re.compile(r"^\s*constexpr\s+int\s+(k\w+)\s*=\s*([^;]+);")


def _read_constants(path: Path, known: dict = None) -> dict:
    values = dict(known or {})
    for line in path.read_text().splitlines():
        m = _CONSTEXPR.match(line)
        if m:
            name, expr = m.groups()
            # Integers, and sums / products of names defined above them.
            values[name] = int(eval(expr, {"__builtins__": {}}, dict(values)))  # noqa: S307
    return values


CONSTANTS = _read_constants(_COMMON / "abi.cuh")

MAX_RANKS = CONSTANTS["kMaxRanks"]
MAX_EXPERTS = CONSTANTS["kMaxExperts"]
MAX_TOPK = CONSTANTS["kMaxTopk"]
CTRL_BYTES = CONSTANTS["kCtrlBytes"]
CTRL_ERROR_OFFSET = CONSTANTS["kCtrlError"] * 4      #: byte offset of the error record
ERR_TIMEOUT = CONSTANTS["kErrTimeout"]
ERR_CAPACITY = CONSTANTS["kErrCapacity"]
ERR_BAD_EXPERT = CONSTANTS["kErrBadExpert"]
ERR_MISMATCH = CONSTANTS["kErrMismatch"]
ERR_FINGERPRINT = CONSTANTS["kErrFingerprint"]
COUNTS_EXTRA_WORDS = CONSTANTS["kCountsExtraWords"]
#: word offsets of what the layout stage reports to the host (kReadback*)
#: readback word name ("out_rows" for kReadbackOutRows) -> index
READBACK = {re.sub(r"(?<!^)(?=[A-Z])", "_", k[len("kReadback"):]).lower(): v
            for k, v in CONSTANTS.items() if k.startswith("kReadback")}
READBACK_WORDS = READBACK["counts"] + MAX_EXPERTS
#: what a rank was waiting for in each phase of common/abi.cuh (the ``kPhase*`` constants)
_PHASE_NAMES = {
    "kPhaseNotify": "dispatch notify (waiting for peers' counts)",
    "kPhaseDispatch": "dispatch (waiting for peers' tokens)",
    "kPhaseCombine": "combine (waiting for peers' expert outputs)",
    "kPhaseBarrier": "barrier (waiting for peers)",
    "kPhaseGinPut": "GIN put (waiting for room in a full NIC queue to the peer)",
    "kPhaseGinFlush": "GIN flush (waiting for the NIC to read this rank's sources)",
    "kPhaseGinNic": "emulated NIC (waiting for this rank's data kernel to put or end)",
    "kPhaseDispatchRail": "dispatch forwarding (waiting for rail peers' rows over the network)",
    "kPhaseCombineRail": "combine over the network (waiting for rail peers' node partials)",
    "kPhasePpSend": "pp_send (waiting for a free slot at the receiver)",
    "kPhasePpRecv": "pp_recv (waiting for the sender's tensor)",
    "kPhaseAgrsEntered": "AGRS (waiting for a peer to open the session)",
    "kPhaseAgrsCall": "AGRS handle (waiting for a peer's all_gather / reduce_scatter)",
}
#: phase code -> what the rank was waiting for (names a timeout)
PHASES = {CONSTANTS[name]: text for name, text in _PHASE_NAMES.items()}


def _layout_words() -> list:
    text = (_COMMON / "abi.cuh").read_text()
    body = text[text.index("#define EP_LAYOUT_WORDS(X)"):]
    body = body[:body.index("\n\n")]
    return re.findall(r"X\((\w+),\s*(\w+)\)", body)


_LAYOUT_WORDS = _layout_words()


class LayoutIndex:
    """Word offsets of a handle's layout tensor (``deep_ep::LayoutIndex``): ``ix.rank_prefix_sum``,
    ``ix.padded_counts``, ... and ``ix.size``, for ``R`` ranks, ``L`` local experts, ``E`` experts."""

    def __init__(self, R: int, L: int, E: int) -> None:
        counts = {"1": 1, "R": R, "L": L, "E": E}
        offset = 0
        for name, count in _LAYOUT_WORDS:
            setattr(self, name, offset)
            offset += counts[count]
        self.size = offset


@functools.lru_cache(maxsize=64)
def layout_index(R: int, L: int, E: int) -> LayoutIndex:
    """`LayoutIndex` for ``R`` ranks, ``L`` local experts, ``E`` experts, made once per shape (every
    dispatch needs one; treat it as read-only)."""
    return LayoutIndex(R, L, E)


class CallTag(ctypes.Structure):
    """Host mirror of ``deep_ep::comm::CallTag`` (include/deep_ep/comm/window.cuh): a call's number and
    the fingerprint of its configuration, compared between ranks at every exchange."""
    _fields_ = [("seq", ctypes.c_uint32), ("fingerprint", ctypes.c_uint32)]


def call_tag(seq: int, *config) -> CallTag:
    """The tag of call ``seq`` whose configuration is the integers ``config`` (the same on every rank
    for calls that belong together; Python's tuple hash of ints is the same in every process)."""
    return CallTag(seq & 0xFFFFFFFF, hash(config) & 0xFFFFFFFF)


class NotifyArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::NotifyArgs`` (include/deep_ep/impls/notify.cuh)."""
    _fields_ = [("topk_idx", ctypes.c_void_p), ("topk_copy", ctypes.c_void_p), ("num_tokens", ctypes.c_int),
                ("num_experts", ctypes.c_int),
                ("tokens_per_group", ctypes.c_int), ("counts_offset", ctypes.c_int64), ("pos_tok", ctypes.c_void_p),
                ("pos_pair", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64),
                ("tag", CallTag)]


class LayoutArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::LayoutArgs`` (include/deep_ep/impls/layout.cuh)."""
    _fields_ = [("num_experts", ctypes.c_int), ("alignment", ctypes.c_int), ("counts_offset", ctypes.c_int64),
                ("layout", ctypes.c_void_p), ("cumulative_stats", ctypes.c_void_p), ("out_capacity", ctypes.c_int),
                ("tok_capacity", ctypes.c_int), ("timeout_ns", ctypes.c_uint64), ("host_out", ctypes.c_void_p),
                ("seq", ctypes.c_int), ("err_host", ctypes.c_void_p), ("tag", CallTag)]


class DispatchArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::DispatchArgs`` (include/deep_ep/impls/dispatch_args.cuh)."""
    _fields_ = [("x", ctypes.c_void_p), ("sf", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p),
                ("topk_weights", ctypes.c_void_p), ("num_tokens", ctypes.c_int),
                ("pos_tok", ctypes.c_void_p), ("pos_pair", ctypes.c_void_p),
                ("out_x", ctypes.c_void_p), ("out_sf", ctypes.c_void_p), ("sf_ld", ctypes.c_int),
                ("out_topk_idx", ctypes.c_void_p), ("out_weights", ctypes.c_void_p),
                ("src_meta", ctypes.c_void_p), ("max_tokens", ctypes.c_int), ("out_capacity", ctypes.c_int),
                ("tok_capacity", ctypes.c_int), ("layout", ctypes.c_void_p),
                ("num_experts", ctypes.c_int), ("alignment", ctypes.c_int),
                ("recv_offset", ctypes.c_int64), ("half_bytes", ctypes.c_int64),
                ("row_stride", ctypes.c_int), ("timeout_ns", ctypes.c_uint64), ("err_host", ctypes.c_void_p),
                ("tag", CallTag)]


class CombineArgs(ctypes.Structure):
    """Host mirror of ``deep_ep::CombineArgs`` (include/deep_ep/impls/combine_args.cuh)."""
    _fields_ = [("y", ctypes.c_void_p), ("weights_in", ctypes.c_void_p), ("recv_weights", ctypes.c_void_p),
                ("src_meta", ctypes.c_void_p), ("layout", ctypes.c_void_p), ("pos_tok", ctypes.c_void_p),
                ("pos_pair", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p), ("num_tokens", ctypes.c_int),
                ("bias0", ctypes.c_void_p), ("bias1", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("out_weights", ctypes.c_void_p), ("num_experts", ctypes.c_int), ("apply_weights", ctypes.c_int),
                ("recv_offset", ctypes.c_int64), ("half_bytes", ctypes.c_int64),
                ("row_stride", ctypes.c_int), ("timeout_ns", ctypes.c_uint64), ("err_host", ctypes.c_void_p),
                ("tag", CallTag), ("max_tokens", ctypes.c_int)]
