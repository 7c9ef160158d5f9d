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
signals and counters, one per rank, for the scale-out path. If the GIN request is refused, the
communicator is created without it (a warning says so): nothing on the NVLink path needs GIN.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import warnings
from dataclasses import dataclass
from typing import Optional

from ..cuda.nccl import check, libnccl
from .. import jit
from ..jit.elf import symbol_bytes

__all__ = ["DevCommLayout", "devcomm_layout", "DeviceCommunicator", "PROBE_SOURCE"]

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
                  "properties_size", "properties_gin_type")


@dataclass(frozen=True)
class DevCommLayout:
    """What the compiler says about NCCL's device-API structs under one set of headers.

    ``requirements`` / ``properties``: NCCL's default-initialised structs (bytes; ``properties`` is
    empty before NCCL 2.29). ``offsets``: byte offsets of the requirement fields this module sets.
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
                                        "gin_counter_count")},
        requirements=symbol_bytes(mod.cubin, "deep_ep_devcomm_requirements"), properties=props,
        properties_gin_type=values["properties_gin_type"])


def _comm_has_gin(comm: int, layout: DevCommLayout) -> bool:
    """Whether the communicator reports a GIN type (``ncclCommQueryProperties``, NCCL >= 2.29)."""
    if not layout.properties:
        return False
    lib = libnccl()
    query = getattr(lib, "ncclCommQueryProperties", None)
    if query is None:
        return False
    buf = ctypes.create_string_buffer(layout.properties, len(layout.properties))
    if query(ctypes.c_void_p(comm), buf) != 0:
        return False
    (gin_type,) = struct.unpack_from("<i", buf.raw, layout.properties_gin_type)
    return gin_type != 0


class DeviceCommunicator:
    """An ``ncclDevComm`` for the communicator ``comm`` (collective: every rank creates it).

    Args:
        comm: the ``ncclComm_t`` (an int) of the user's group (`deep_ep.comm.nccl.comm_ptr`).
        num_ranks: ranks of the group (GIN signals and counters are asked for one per rank).

    Raises:
        deep_ep.cuda.nccl.NcclError: ``ncclDevCommCreate`` failed.
    """

    def __init__(self, comm: int, num_ranks: int) -> None:
        self.comm = comm
        self.layout = devcomm_layout()
        self.has_gin = _comm_has_gin(comm, self.layout)
        self._devcomm = (ctypes.c_uint8 * self.layout.devcomm_size)()
        try:
            self._create(gin_signals=num_ranks if self.has_gin else 0)
        except Exception as exc:  # noqa: BLE001 - a GIN request refused: the NVLink path needs none
            if not self.has_gin:
                raise
            warnings.warn(f"deep_ep: ncclDevCommCreate with GIN signals failed ({exc}); the device "
                          f"communicator is created without GIN (scale-out over RDMA is unavailable)",
                          RuntimeWarning, stacklevel=3)
            self.has_gin = False
            self._create(gin_signals=0)
        self._live = True

    def _create(self, gin_signals: int) -> None:
        layout = self.layout
        req = bytearray(layout.requirements)
        struct.pack_into("<i", req, layout.offsets["lsa_barrier_count"], 1)
        struct.pack_into("<i", req, layout.offsets["gin_signal_count"], gin_signals)
        struct.pack_into("<i", req, layout.offsets["gin_counter_count"], gin_signals)
        req_buf = (ctypes.c_uint8 * len(req)).from_buffer(req)
        check("ncclDevCommCreate", libnccl().ncclDevCommCreate(ctypes.c_void_p(self.comm), req_buf, self._devcomm),
              self.comm)

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
