"""Kernel arguments: typed scalars and the packing of an argument tuple into launch parameters.

The launch path is on the hot path of dispatch/combine, so packing is planned once per tuple of
argument types (a ``struct.Struct`` and the slot offsets, `plan_for`) and each launch only packs
values into a reused per-thread ``ctypes`` buffer that also holds the ``void*`` table handed to
``cuLaunchKernel``.
"""

from __future__ import annotations

import ctypes
import struct
import threading

__all__ = ["i32", "u32", "i64", "u64", "f32", "f64", "ptr", "plan_for", "pack_args", "summarize",
           "BLOB_TYPES"]


# ---------------------------------------------------------------------------------------------
# Typed scalar arguments

class _Typed:
    __slots__ = ("value",)
    fmt = ""
    lo = hi = None

    def __init__(self, value):
        v = int(value) if self.fmt not in ("f", "d") else float(value)
        if self.lo is not None and not (self.lo <= v <= self.hi):
            raise OverflowError(f"{type(self).__name__}({value}) out of range [{self.lo}, {self.hi}]")
        self.value = v

    def __repr__(self):
        return f"{type(self).__name__}({self.value})"


class i32(_Typed):
    """A kernel argument of type ``int32_t``."""
    __slots__ = ()
    fmt, lo, hi = "i", -2**31, 2**31 - 1


class u32(_Typed):
    """A kernel argument of type ``uint32_t``."""
    __slots__ = ()
    fmt, lo, hi = "I", 0, 2**32 - 1


class i64(_Typed):
    """A kernel argument of type ``int64_t``."""
    __slots__ = ()
    fmt, lo, hi = "q", -2**63, 2**63 - 1


class u64(_Typed):
    """A kernel argument of type ``uint64_t``."""
    __slots__ = ()
    fmt, lo, hi = "Q", 0, 2**64 - 1


class ptr(_Typed):
    """A pointer kernel argument given as an integer address (0 = null)."""
    __slots__ = ()
    fmt, lo, hi = "Q", 0, 2**64 - 1


class f32(_Typed):
    """A kernel argument of type ``float``."""
    __slots__ = ()
    fmt = "f"


class f64(_Typed):
    """A kernel argument of type ``double``."""
    __slots__ = ()
    fmt = "d"


def _int32(v: int) -> int:
    if -2147483648 <= v <= 2147483647:
        return v
    raise OverflowError(f"Python int {v} does not fit the int32 kernel argument; wrap it (jit.i64/u64/u32/ptr)")


def _null(_a) -> int:
    return 0


def _typed_value(a) -> int | float:
    return a.value


def _blob(a) -> bytes:
    return bytes(a)


def _type_plan(tp):
    """(struct format, converter) for an argument type; blobs handled by the caller."""
    if tp is bool:
        return "i4x", int
    if tp is int:
        return "i4x", _int32
    if tp is float:
        return "f4x", float
    if tp is type(None):
        return "Q", _null
    if isinstance(tp, type) and issubclass(tp, _Typed):
        fmt = tp.fmt
        return (fmt + "4x" if fmt in "iIf" else fmt), _typed_value
    data_ptr = getattr(tp, "data_ptr", None)
    if callable(data_ptr):  # torch.Tensor and subclasses: the unbound method, no wrapper call
        return "Q", data_ptr
    raise TypeError(f"unsupported kernel argument type {tp.__name__}: use a tensor, None, int, float, bool, "
                    "jit.i32/u32/i64/u64/f32/ptr, a ctypes.Structure or bytes")


BLOB_TYPES = (bytes, bytearray, memoryview)


class _Plan:
    """Precomputed layout for one tuple of argument types (and blob sizes)."""
    __slots__ = ("struct", "convs", "offsets", "table_offset", "size", "table_struct", "local")

    def __init__(self, args):
        fmt = ["="]
        convs, offsets = [], []
        off = 0
        for a in args:
            tp = type(a)
            if _is_blob_type(tp):
                n = len(bytes(a)) if isinstance(a, BLOB_TYPES) else ctypes.sizeof(a)
                pad = (-off) % 16
                if pad:
                    fmt.append(f"{pad}x")
                    off += pad
                fmt.append(f"{n}s")
                offsets.append(off)
                off += n
                convs.append(_blob)
                continue
            f, conv = _type_plan(tp)
            pad = (-off) % 8
            if pad:
                fmt.append(f"{pad}x")
                off += pad
            fmt.append(f)
            offsets.append(off)
            off += struct.calcsize("=" + f)
            convs.append(conv)
        pad = (-off) % 8
        if pad:
            fmt.append(f"{pad}x")
            off += pad
        self.struct = struct.Struct("".join(fmt))
        self.convs = tuple(convs)
        self.offsets = tuple(offsets)
        self.table_offset = off
        self.table_struct = struct.Struct(f"={len(args)}Q")
        self.size = off + 8 * max(1, len(args))
        self.local = threading.local()


_blob_type_memo: dict[type, bool] = {}


def _is_blob_type(tp) -> bool:
    b = _blob_type_memo.get(tp)
    if b is None:
        b = _blob_type_memo[tp] = issubclass(tp, BLOB_TYPES + (ctypes.Structure, ctypes.Union, ctypes.Array))
    return b


def _plan_key(args):
    """Cache key of an argument tuple's layout: the types, plus the sizes of by-value blobs."""
    key = tuple(map(type, args))
    if any(map(_is_blob_type, key)):
        key += tuple(len(bytes(a)) if isinstance(a, BLOB_TYPES) else ctypes.sizeof(a)
                     for a in args if _is_blob_type(type(a)))
    return key


def pack_args(plan: _Plan, args) -> tuple[ctypes.Array, int]:
    """Pack ``args`` per ``plan`` into this thread's buffer for the plan.

    Returns ``(buffer, address of the void* table)``. The buffer is reused by later launches of
    the same plan on the same thread: the driver copies parameters during ``cuLaunchKernel``.
    """
    local = plan.local
    try:
        buf, table = local.buf, local.table
    except AttributeError:
        buf = ctypes.create_string_buffer(plan.size)
        base = ctypes.addressof(buf)
        plan.table_struct.pack_into(buf, plan.table_offset, *[base + o for o in plan.offsets])
        table = base + plan.table_offset
        local.buf, local.table = buf, table
    plan.struct.pack_into(buf, 0, *[c(a) for c, a in zip(plan.convs, args)])
    return buf, table


# ---------------------------------------------------------------------------------------------
# Driver helpers

def plan_for(plans: dict, args) -> _Plan:
    """The packing plan of ``args`` from ``plans`` (a per-kernel cache), made on first use."""
    key = _plan_key(args)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _Plan(args)
    return plan


def summarize(args) -> str:
    out = []
    for a in args:
        if hasattr(a, "data_ptr") and hasattr(a, "shape"):
            out.append(f"Tensor(shape={tuple(a.shape)}, dtype={a.dtype}, device={a.device}, ptr=0x{a.data_ptr():x})")
        elif isinstance(a, (ctypes.Structure, ctypes.Union)):
            out.append(f"{type(a).__name__}(<{ctypes.sizeof(a)} bytes by value>)")
        elif isinstance(a, BLOB_TYPES):
            out.append(f"<{len(a)} bytes by value>")
        else:
            out.append(repr(a))
    return "[" + ", ".join(out) + "]"

