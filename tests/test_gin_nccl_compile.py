"""The scale-out kernels over NCCL's GIN (EP_TRANSPORT_NCCL=1 with EP_TRANSPORT_GIN=1 direct, 2 hybrid)
compile under NVRTC against NCCL 2.28.9's, 2.29.7's and 2.32.3's headers (fetched as tests/nccl_wheels.py does),
on machines without a GPU:

* dispatch (its module holds the notify stage), combine and the GPU barrier, in both modes: no spills,
  and no more stack than NCCL's own GIN calls keep (put, signal, flush: the transports add none);
* the host's ``TransportArgs`` (`deep_ep.comm.nccl_gin.transport_args_type`) has the compiled layout,
  field for field, in both modes.
"""
from __future__ import annotations

import ctypes

import pytest

from deep_ep import jit
from deep_ep.backends import gpu
from deep_ep.backends.gpu import modules
from deep_ep.comm import devcomm, nccl_gin

import nccl_wheels

VERSIONS = [nccl_wheels.OLDEST, nccl_wheels.TORCH_2_13, nccl_wheels.NEWEST]


@pytest.fixture(autouse=True)
def _no_loaded_nccl(tmp_path_factory, monkeypatch):
    """A JIT cache of this session, and no check against a loaded libnccl (there is none here)."""
    from deep_ep.jit import builder
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "jit-cache"))
    monkeypatch.setattr(builder, "_check_nccl_versions", lambda *args: None)
    jit.clear_memory_cache()


def _include(version: str) -> str:
    try:
        return str(nccl_wheels.include_dir(version))
    except nccl_wheels.FetchError as e:
        pytest.skip(str(e))


# NCCL's own calls alone, each as the transport makes them (a put, a put with a signal, a signal, a
# flush): the stack they keep is the reference the kernels are measured against.
RAW_GIN = """
#include <nccl.h>
#include <nccl_device.h>
extern "C" __global__ void raw_gin(const __grid_constant__ ncclDevComm comm, ncclWindow_t window, int context,
                                   int what) {
    ncclGin gin(comm, context);
    ncclTeam world = ncclTeamWorld(comm);
    const int peer = (world.rank + 1) % world.nRanks;
    if (what == 0) gin.put(world, peer, window, 4096, window, 0, 1024);
    else if (what == 1) gin.put(world, peer, window, 4096, window, 0, 1024, ncclGin_SignalAdd{0, 1});
    else if (what == 2) gin.signal(world, peer, ncclGin_SignalAdd{1, 1});
    else gin.flush(ncclCoopThread{});
}
"""

_DISPATCH_KERNELS = {modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL, modules.CACHED_DISPATCH_KERNEL}
#: (kind, structure, kernels): the notify stage is in the dispatch module. Between them every
#: compile-time branch of the scale-out kernels: BF16 and FP8 rows (with their scales), both
#: layouts of dispatch and combine, the GPU barrier
MODULES = [("dispatch", (512, 0, 4, False), _DISPATCH_KERNELS),
           ("dispatch", (512, 4, 4, True), _DISPATCH_KERNELS),     # FP8 (hidden 512, 4 scales), expanded
           ("combine", (256, 4, True), {modules.COMBINE_KERNEL}),
           ("combine", (256, 4, False), {modules.COMBINE_KERNEL}),
           ("barrier", (), {modules.BARRIER_KERNEL})]


@pytest.mark.parametrize("gin_mode", [1, 2], ids=["direct", "hybrid"])
@pytest.mark.parametrize("version", VERSIONS)
def test_scaleout_kernels_compile_over_nccl_gin(version, gin_mode):
    inc = _include(version)
    raw = jit.build("deep_ep_gin_raw_calls", RAW_GIN, use_nccl=True, nccl_include_dir=inc, check_spills=False)
    ncclgin_stack = raw.info["raw_gin"]["stack"]
    # also the combines without multiple reduction: expanded handles, and in hybrid mode non-expanded ones
    single = [("combine", (256, 4, modules.SINGLE_REDUCTION), {modules.COMBINE_KERNEL})]
    if gin_mode == 2:
        single.append(("combine", (256, 4, modules.UNREDUCED_RANKS), {modules.COMBINE_KERNEL}))
    for kind, structure, kernels in MODULES + single:
        defines = modules._DEFINES[kind](*structure, transport_nccl=True, transport_gin=gin_mode)
        assert defines["EP_TRANSPORT_NCCL"] == 1 and defines["EP_TRANSPORT_GIN"] == gin_mode
        module = jit.build(f"deep_ep_{kind}_nccl_gin_test", gpu.kernel_source(kind), defines=defines, use_nccl=True,
                           nccl_include_dir=inc, check_spills=False)
        assert kernels <= set(module.kernel_names()), (kind, module.kernel_names())
        for name, info in module.info.items():
            assert info["spill_stores"] == info["spill_loads"] == 0, (version, kind, name, info)
            assert info["stack"] <= ncclgin_stack, (version, kind, name, info, ncclgin_stack)


def test_the_backend_builds_nccl_gin_modules_with_both_defines():
    """`modules.build_module` with the NCCL transport and a GIN mode gives the data and control kinds
    both defines (the kernels over NCCL's GIN), and the others (pp, agrs, Engram) neither GIN."""
    for kind, structure in (("dispatch", (512, 0, 4, False)), ("combine", (256, 4, False)), ("barrier", ())):
        defines = modules._DEFINES[kind](*structure, transport_nccl=True, transport_gin=2)
        assert (defines["EP_TRANSPORT_NCCL"], defines["EP_TRANSPORT_GIN"]) == (1, 2)
    assert "gin_nic" in modules._GIN_KINDS and "pp" not in modules._GIN_KINDS


@pytest.mark.parametrize("version", VERSIONS)
def test_transport_args_match_the_compiled_layout(version):
    """The ctypes ``TransportArgs`` over NCCL's GIN has NVRTC's size and offsets in both modes, with
    the ``ncclDevComm`` and the window where the one-node probe puts them."""
    inc = _include(version)
    layout = devcomm._layout(inc)
    for gin_mode, hybrid in ((1, False), (2, True)):
        device = nccl_gin.gin_args_layout(gin_mode, inc)
        host_type = nccl_gin.transport_args_type(layout.window_offset, hybrid)
        names = ["window"] + [name for name, _ in host_type._fields_[2:]]
        host = [ctypes.sizeof(host_type)] + [getattr(host_type, name).offset for name in names]
        assert device == host, (version, gin_mode, list(zip(["sizeof"] + names, device, host)))
        assert device[1] == layout.window_offset and host_type.comm.size == layout.window_offset
        assert host_type.gin_comm.offset == layout.window_offset + 8
