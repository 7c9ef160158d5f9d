"""NCCL's device communicator (``ncclDevComm``), created from the user's communicator.

`DeviceCommunicator` calls ``ncclDevCommCreate`` on the ``ncclComm_t`` of the user's
``torch.distributed`` NCCL group and holds the resulting ``ncclDevComm``, which every kernel of an
NCCL-backed buffer receives by value (`deep_ep/include/deep_ep/comm/transport.cuh`).

The host structs differ between NCCL releases (2.29 prepended a size/magic/version header to the
requirements, later releases appended fields), so nothing here hard-codes a layout: a small probe
module is compiled against exactly the NCCL headers the kernels use, and the compiler's own
``sizeof`` / ``offsetof`` values and NCCL's default requirements initializer are read out of its
cubin (`deep_ep.jit.elf`). The JIT already checks that those headers match the loaded libnccl.

Requirements asked for: one LSA barrier (the device API's scale-up barrier resource), and, when the
communicator reports GIN (NCCL >= 2.29 can say so; 2.28 cannot, and then no GIN is asked for), GIN
signals and counters, one per rank. If that request is refused, the communicator is created without
it (a warning says so): nothing on the NVLink path needs GIN. The scale-out path over NCCL's GIN
(`deep_ep.comm.nccl_gin`) passes `GinRequirements` instead (contexts, signals, counters, connection
type, traffic class, as far as the headers have the fields) and gets an error if they are refused.
"""
from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass
from typing import Optional

from ..cuda.nccl import check, libnccl
from .. import jit
from ..jit.elf import symbol_bytes

__all__ = ["DevCommLayout", "devcomm_layout", "DeviceCommunicator", "GinRequirements", "GIN_QUEUE_DEPTH", "comm_gin_types",
           "requirements_bytes", "PROBE_SOURCE"]

#: The probe: sizes, offsets and NCCL's defaults under the headers the kernels are built with.
PROBE_SOURCE = r"""
#include <cuda/std/cstddef>   // offsetof as a constant expression on every NVRTC (13.0 has no __builtin_offsetof)
#define EP_TRANSPORT_NCCL 1
#include <deep_ep/comm/transport.cuh>
#define EP_OFFSET(type, field) offsetof(type, field)
extern "C" __device__ const unsigned long long deep_ep_devcomm_layout[] = {
    NCCL_VERSION_CODE,
    sizeof(ncclDevComm),
    sizeof(ncclDevCommRequirements),
    sizeof(deep_ep::comm::TransportArgs),
    EP_OFFSET(deep_ep::comm::TransportArgs, window),
    EP_OFFSET(ncclDevCommRequirements, lsaBarrierCount),
    EP_OFFSET(ncclDevCommRequirements, ginContextCount),
    EP_OFFSET(ncclDevCommRequirements, ginSignalCount),
    EP_OFFSET(ncclDevCommRequirements, ginCounterCount),
#ifdef NCCL_COMM_PROPERTIES_INITIALIZER
    sizeof(ncclCommProperties),
    EP_OFFSET(ncclCommProperties, ginType),
#else
    0, 0,
#endif
    EP_OFFSET(ncclDevComm, ginContextCount),
    sizeof(ncclDevComm::ginContextCount),
    // fields of later releases (0: absent), at the versions of deep_ep.topology.NCCL_GIN_FEATURES
#if NCCL_VERSION_CODE >= 22907
    EP_OFFSET(ncclDevCommRequirements, ginConnectionType),
    EP_OFFSET(ncclDevCommRequirements, ginExclusiveContexts),
    NCCL_GIN_CONNECTION_FULL,
    NCCL_GIN_CONNECTION_RAIL,
    EP_OFFSET(ncclDevCommRequirements, ginQueueDepth),
#else
    0, 0, 0, 0, 0,
#endif
#if NCCL_VERSION_CODE >= 23003
    EP_OFFSET(ncclDevCommRequirements, ginTrafficClass),
#else
    0,
#endif
#if NCCL_VERSION_CODE >= 22907
    EP_OFFSET(ncclCommProperties, railedGinType),
#else
    0,
#endif
};
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
extern "C" __device__ const ncclDevCommRequirements deep_ep_devcomm_requirements = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
extern "C" __device__ const ncclDevCommRequirements deep_ep_devcomm_requirements = {};
#endif
#ifdef NCCL_COMM_PROPERTIES_INITIALIZER
extern "C" __device__ const ncclCommProperties deep_ep_comm_properties = NCCL_COMM_PROPERTIES_INITIALIZER;
#endif
"""

_LAYOUT_FIELDS = ("version", "devcomm_size", "requirements_size", "transport_args_size", "window_offset",
                  "lsa_barrier_count", "gin_context_count", "gin_signal_count", "gin_counter_count",
                  "properties_size", "properties_gin_type", "devcomm_gin_context_count",
                  "devcomm_gin_context_count_size", "gin_connection_type", "gin_exclusive_contexts",
                  "connection_full", "connection_rail", "gin_queue_depth", "gin_traffic_class",
                  "properties_railed_gin_type")
#: requirement fields that only some releases have (absent: left out of `DevCommLayout.offsets`)
_OPTIONAL_FIELDS = ("gin_connection_type", "gin_exclusive_contexts", "gin_queue_depth", "gin_traffic_class")
#: ``ginQueueDepth`` asked for (puts in flight per GIN context), DeepEP V2's value; NCCL's default
#: (0) lets the backend choose
GIN_QUEUE_DEPTH = 1024


@dataclass(frozen=True)
class DevCommLayout:
    """What the compiler says about NCCL's device-API structs under one set of headers.

    ``requirements`` / ``properties``: NCCL's default-initialised structs (bytes; ``properties`` is
    empty before NCCL 2.29). ``offsets``: byte offsets of the requirement fields this module sets;
    those of later releases (``gin_connection_type``, ``gin_exclusive_contexts``,
    ``gin_queue_depth``, ``gin_traffic_class``) only where the headers have them. ``connection_types``: NCCL's values of
    ``{"full", "rail"}`` (empty before 2.29.7). ``devcomm_gin_context_count``: offset and size of
    the context count the created ``ncclDevComm`` holds. ``properties_railed_gin_type``: offset of
    the properties' GIN type on rails (0: absent).
    """
    version: int
    devcomm_size: int
    requirements_size: int
    transport_args_size: int
    window_offset: int
    offsets: dict
    requirements: bytes
    properties: bytes
    properties_gin_type: int
    devcomm_gin_context_count: tuple = (0, 0)
    connection_types: dict = None
    properties_railed_gin_type: int = 0


def devcomm_layout(nccl_include_dir: Optional[str] = None) -> DevCommLayout:
    """The layout for the NCCL headers the kernels use (default: the JIT's, checked against the loaded
    libnccl); compiled once per process and cached on disk like any kernel. Works without a GPU.

    Raises:
        deep_ep.jit.CompileError / JitEnvironmentError: the probe cannot be built.
    """
    return _layout(str(nccl_include_dir) if nccl_include_dir else None)


@functools.lru_cache(maxsize=None)
def _layout(nccl_include_dir: Optional[str]) -> DevCommLayout:
    mod = jit.build("deep_ep_devcomm_probe", PROBE_SOURCE, use_nccl=True, nccl_include_dir=nccl_include_dir)
    raw = symbol_bytes(mod.cubin, "deep_ep_devcomm_layout")
    values = dict(zip(_LAYOUT_FIELDS, struct.unpack(f"<{len(raw) // 8}Q", raw)))
    props = symbol_bytes(mod.cubin, "deep_ep_comm_properties") if values["properties_size"] else b""
    return DevCommLayout(
        version=values["version"], devcomm_size=values["devcomm_size"],
        requirements_size=values["requirements_size"], transport_args_size=values["transport_args_size"],
        window_offset=values["window_offset"],
        offsets={k: values[k] for k in ("lsa_barrier_count", "gin_context_count", "gin_signal_count",
                                        "gin_counter_count") + _OPTIONAL_FIELDS if k not in _OPTIONAL_FIELDS or values[k]},
        requirements=symbol_bytes(mod.cubin, "deep_ep_devcomm_requirements"), properties=props,
        properties_gin_type=values["properties_gin_type"],
        devcomm_gin_context_count=(values["devcomm_gin_context_count"], values["devcomm_gin_context_count_size"]),
        connection_types=({"full": values["connection_full"], "rail": values["connection_rail"]}
                          if values["gin_connection_type"] else {}),
        properties_railed_gin_type=values["properties_railed_gin_type"])


@dataclass(frozen=True)
class GinRequirements:
    """What the scale-out kernels need of the device communicator's GIN (`deep_ep.comm.nccl_gin`).

    ``contexts``: ``ginContextCount`` (the buffer's ``num_allocated_qps``; NCCL may give fewer).
    ``signals`` / ``counters``: per context. ``rail``: hybrid mode (RAIL connections, rail peers
    only) rather than direct (FULL). ``traffic_class``: the RDMA service level (``sl_idx``).
    """
    contexts: int
    signals: int
    counters: int
    rail: bool
    traffic_class: int


def requirements_bytes(layout: DevCommLayout, gin: Optional[GinRequirements] = None, gin_signals: int = 0) -> bytes:
    """NCCL's default requirements with this module's fields set: one LSA barrier, and either
    ``gin`` (every field the headers have: contexts, signals, counters, exclusive contexts, the
    connection type and a queue depth of `GIN_QUEUE_DEPTH` from 2.29.7, the traffic class from
    2.30.3) or ``gin_signals`` signals and counters (0: no GIN).

    Raises:
        ValueError: ``gin`` asks for a traffic class the headers cannot set (the caller checks the
            version first, `deep_ep.topology.require_gin_features`).
    """
    offsets = layout.offsets
    req = bytearray(layout.requirements)
    struct.pack_into("<i", req, offsets["lsa_barrier_count"], 1)
    if gin is None:
        struct.pack_into("<i", req, offsets["gin_signal_count"], gin_signals)
        struct.pack_into("<i", req, offsets["gin_counter_count"], gin_signals)
        return bytes(req)
    struct.pack_into("<i", req, offsets["gin_context_count"], gin.contexts)
    struct.pack_into("<i", req, offsets["gin_signal_count"], gin.signals)
    struct.pack_into("<i", req, offsets["gin_counter_count"], gin.counters)
    if "gin_connection_type" in offsets:
        kind = layout.connection_types["rail" if gin.rail else "full"]
        struct.pack_into("<i", req, offsets["gin_connection_type"], kind)
        struct.pack_into("<?", req, offsets["gin_exclusive_contexts"], True)
    if "gin_queue_depth" in offsets:
        struct.pack_into("<i", req, offsets["gin_queue_depth"], GIN_QUEUE_DEPTH)
    if "gin_traffic_class" in offsets:
        struct.pack_into("<i", req, offsets["gin_traffic_class"], gin.traffic_class)
    else:
        raise ValueError(f"the NCCL {layout.version} headers have no GIN traffic class (ginTrafficClass)")
    return bytes(req)


def comm_gin_types(comm: int, layout: DevCommLayout) -> tuple:
    """``(GIN type, GIN type on rails)`` the communicator reports (``ncclCommQueryProperties``, NCCL
    >= 2.29; 0: none). The rails' type is the first one where the headers have no field for it
    (before 2.29.7), and both are 0 where the communicator cannot be asked."""
    if not layout.properties:
        return 0, 0
    lib = libnccl()
    query = getattr(lib, "ncclCommQueryProperties", None)
    if query is None:
        return 0, 0
    buf = ctypes.create_string_buffer(layout.properties, len(layout.properties))
    if query(ctypes.c_void_p(comm), buf) != 0:
        return 0, 0
    (gin_type,) = struct.unpack_from("<i", buf.raw, layout.properties_gin_type)
    railed = gin_type
    if layout.properties_railed_gin_type:
        (railed,) = struct.unpack_from("<i", buf.raw, layout.properties_railed_gin_type)
    return gin_type, railed


class DeviceCommunicator:
    """An ``ncclDevComm`` for the communicator ``comm`` (collective: every rank creates it).

    Args:
        comm: the ``ncclComm_t`` (an int) of the user's group (`deep_ep.comm.nccl.comm_ptr`).
        num_ranks: ranks of the group (the GIN requirements, when given, are sized by the caller).
        gin: the scale-out path's `GinRequirements`: asked for as they are, a refusal raises;
            None (NVLink alone): no GIN resources are asked for.

    Raises:
        deep_ep.cuda.nccl.NcclError: ``ncclDevCommCreate`` failed (with ``gin``: also when NCCL
            refused the GIN requirements).
    """

    def __init__(self, comm: int, num_ranks: int, gin: Optional[GinRequirements] = None) -> None:
        self.comm = comm
        self.layout = devcomm_layout()
        self._devcomm = (ctypes.c_uint8 * self.layout.devcomm_size)()
        if gin is not None:
            self._create_with(requirements_bytes(self.layout, gin))
            self._live = True
            return
        # NVLink alone (the LSA transport) asks for no GIN resources: its kernels use none, and a
        # request NCCL refused on some ranks only would leave the others in the collective creation.
        self._create_with(requirements_bytes(self.layout, gin_signals=0))
        self._live = True

    def _create_with(self, requirements: bytes) -> None:
        req = bytearray(requirements)
        req_buf = (ctypes.c_uint8 * len(req)).from_buffer(req)
        check("ncclDevCommCreate", libnccl().ncclDevCommCreate(ctypes.c_void_p(self.comm), req_buf, self._devcomm),
              self.comm)

    @property
    def gin_context_count(self) -> int:
        """The GIN contexts the created ``ncclDevComm`` holds (NCCL may give fewer than asked for)."""
        offset, size = self.layout.devcomm_gin_context_count
        return int.from_bytes(bytes(self._devcomm)[offset:offset + size], "little")

    def devcomm_bytes(self) -> bytes:
        """The ``ncclDevComm`` as NCCL filled it in."""
        return bytes(self._devcomm)

    def transport_args(self, window: int) -> ctypes.Array:
        """The kernels' ``TransportArgs`` (by value): this device communicator and the window handle
        ``window`` (an ``ncclWindow_t``)."""
        layout = self.layout
        args = (ctypes.c_uint8 * layout.transport_args_size)()
        ctypes.memmove(args, self._devcomm, layout.devcomm_size)
        struct.pack_into("<Q", args, layout.window_offset, int(window))
        return args

    def destroy(self) -> None:
        """``ncclDevCommDestroy`` (collective). Idempotent."""
        if getattr(self, "_live", False):
            self._live = False
            check("ncclDevCommDestroy", libnccl().ncclDevCommDestroy(ctypes.c_void_p(self.comm), self._devcomm),
                  self.comm)
