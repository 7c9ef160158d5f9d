"""The GIN transports (deep_ep/include/deep_ep/comm/gin.cuh) compile under NVRTC, on machines without a GPU.

* the emulated transport, its NIC and the self-test kernel (kernels/gin_selftest.cuh), with no spills
  and no stack;
* the NCCL transport (``ncclGin``) against NCCL 2.28.9's and 2.32.3's headers (fetched as
  tests/nccl_wheels.py does): no spills, and no more stack than NCCL's own ``ncclGin::put`` needs
  (its put keeps a few bytes on the stack in both releases, ours adds none);
* the host mirrors of the emulated GIN's structures, and the self-test runner's input checks;
* the direct-mode data kernels over the emulated GIN (EP_TRANSPORT_GIN=1) and the NIC kernel, without
  spills, and the host mirror of their transport arguments.
"""
from __future__ import annotations

import ctypes

import pytest

from deep_ep import jit
from deep_ep.comm import gin

import nccl_wheels


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """A JIT cache of this test session: the builds are compiled here, not found in a stale cache."""
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "jit-cache"))
    jit.clear_memory_cache()


def _nccl_include(version: str):
    try:
        return nccl_wheels.include_dir(version)
    except nccl_wheels.FetchError as e:
        pytest.skip(str(e))


# NCCL's own put alone: the stack it needs, against which the transport's probe is measured.
RAW_PUT = """
#include <nccl.h>
#include <nccl_device.h>
extern "C" __global__ void raw_put(const __grid_constant__ ncclDevComm comm, ncclWindow_t window, int context) {
    ncclGin gin(comm, context);
    ncclTeam world = ncclTeamWorld(comm);
    gin.put(world, (world.rank + 1) % world.nRanks, window, 4096, window, 0, 1024);
}
"""


def test_emulated_transport_and_selftest_compile_without_spills():
    module = gin.build_selftest(check_spills=True)
    assert module.kernel_names() == ["gin_selftest"]          # no NCCL probe without NCCL's headers
    info = module.info["gin_selftest"]
    assert info["stack"] == info["spill_stores"] == info["spill_loads"] == 0
    assert 0 < info["registers"] <= 128


@pytest.mark.parametrize("version", [nccl_wheels.OLDEST, nccl_wheels.TORCH_2_13, nccl_wheels.NEWEST])
def test_nccl_transport_compiles(version):
    inc = _nccl_include(version)
    assert jit.nccl_header_version(inc) == nccl_wheels.version_code(version)
    module = gin.build_selftest(check_spills=False, use_nccl=True, nccl_include_dir=inc,
                                defines={"EP_TRANSPORT_NCCL": 1})
    assert sorted(module.kernel_names()) == ["gin_nccl_probe", "gin_selftest"]
    emulated, probe = module.info["gin_selftest"], module.info["gin_nccl_probe"]
    assert emulated["stack"] == emulated["spill_stores"] == emulated["spill_loads"] == 0
    assert probe["spill_stores"] == probe["spill_loads"] == 0 and probe["registers"] > 0
    raw = jit.build("deep_ep_gin_raw_put", RAW_PUT, use_nccl=True, nccl_include_dir=inc, check_spills=False)
    assert probe["stack"] <= raw.info["raw_put"]["stack"], (probe, raw.info)


def test_host_mirrors_match_the_header():
    """gin.cuh static_asserts the same sizes and offsets: a change on one side fails one of the two."""
    args = gin.EmulatedGinArgs
    assert ctypes.sizeof(args) == 112
    assert args.min_delay_ns.offset == 72 and args.batch.offset == 108
    assert (gin.QUEUE_BYTES, gin.ENTRY_BYTES) == (32, 64)
    header = (jit.locate.deep_ep_include_dir() / "deep_ep" / "comm" / "gin.cuh").read_text()
    assert "sizeof(GinQueue) == 32" in header and "sizeof(GinEntry) == 64" in header
    selftest = (jit.locate.deep_ep_include_dir() / "deep_ep" / "kernels" / "gin_selftest.cuh").read_text()
    for name, value in gin.MODES.items():
        words = "".join(part.capitalize() for part in name.split("_"))
        assert f"constexpr int kMode{words} = {value};" in selftest
    assert f"constexpr int kReportWords = {gin.REPORT_WORDS};" in selftest
    assert f"constexpr int kPhase = {gin.SELFTEST_PHASE};" in selftest


def test_selftest_window_size():
    # control region, the source, 2 x 3 receive slots of 1024 words
    assert gin.selftest_window_bytes(1024, 3) == 65536 + 4096 * 7


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="weak"), "mode"),
    (dict(payload_words=1000, pieces=3), "pieces"),
    (dict(rounds=0), "rounds"),
    (dict(payload_words=1 << 16, pieces=1), "staging"),
])
def test_selftest_refuses_bad_input_before_any_launch(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gin.run_selftest(**kwargs)


def test_emulated_gin_refuses_cpu_windows():
    import torch
    with pytest.raises(ValueError, match="CUDA"):
        gin.EmulatedGin([torch.zeros(16, dtype=torch.uint8)])


# ---------------------------------------------------------------------------------------- emulated nodes
def test_gin_data_modules_compile_without_spills():
    """The dispatch and combine modules with the direct-mode GIN transport (EP_TRANSPORT_GIN=1), and
    the per-rank NIC kernel, in the layouts the scale-out GPU test runs (combine also with single
    reduction, allow_multiple_reduction=False)."""
    from deep_ep.backends.gpu import modules
    for kind, structure in [("gin_nic", ()), ("dispatch", (512, 0, 4, False)), ("dispatch", (512, 4, 4, True)),
                            ("combine", (256, 4, False)), ("combine", (256, 4, True)),
                            ("combine", (256, 4, modules.SINGLE_REDUCTION)),
                            ("combine", (2048, 4, modules.SINGLE_REDUCTION))]:
        key, module = modules.build_module(kind, structure, False, True)
        assert ("EP_TRANSPORT_GIN", 1) in key[1]
        for name, info in module.info.items():
            assert info["stack"] == info["spill_stores"] == info["spill_loads"] == 0, (kind, name, info)
    # without GIN the defines (and so the cache keys and names of existing modules) are unchanged
    key, _ = modules.build_module("combine", (256, 4, False), False, False)
    assert all(name != "EP_TRANSPORT_GIN" for name, _ in key[1])


def test_gin_transport_args_mirror():
    """comm/transport.cuh's TransportArgs with EP_TRANSPORT_GIN=1: the emulated fields first (kernels
    built without GIN read the same prefix), then the GIN's."""
    args = gin.GinTransportArgs
    assert ctypes.sizeof(args) == 64
    assert (args.peers.offset, args.rank.offset, args.num_ranks.offset, args.gin.offset) == (0, 8, 12, 16)
    assert (args.recv_offset.offset, args.half_bytes.offset, args.stage_offset.offset) == (24, 32, 40)
    assert (args.max_put_bytes.offset, args.num_contexts.offset, args.node_ranks.offset) == (48, 52, 56)
    from deep_ep.comm.emulated import EmulatedTransportArgs
    assert [f[0] for f in EmulatedTransportArgs._fields_] == [f[0] for f in args._fields_[:3]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_contexts=0), "contexts"),
    (dict(batch=32, queue_depth=16), "batch"),
    (dict(stage_bytes=100), "stage_bytes"),
    (dict(min_delay_ns=10, max_delay_ns=5), "delays"),
    (dict(seed=-1), "seed"),
])
def test_emulated_gin_settings_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gin.EmulatedGinSettings(**kwargs)


def test_receive_halves_match_every_call_layout():
    from deep_ep.backends.gpu import window
    num_bytes = window.buffer_size_hint(8, 64, 256, 4)
    recv_offset, half = gin.receive_halves(8, num_bytes)
    for stride in (window.dispatch_row_stride(512, 0, 4), window.combine_row_stride(256, 4)):
        layout = window.make_layout(8, 0, 0, 4, False, num_bytes, stride=stride)
        assert (layout.recv_offset, layout.half_bytes) == (recv_offset, half)
        # a source's rows from each owner (combine_args.cuh's pushed_row_offset) fit a half
        assert layout.rows_per_half // 8 >= 64


def test_hybrid_modules_compile_without_spills():
    """Hybrid mode's dispatch and combine (EP_TRANSPORT_GIN=2: comm/gin_hybrid.cuh,
    impls/dispatch_forward.cuh, impls/combine_forward.cuh, and without multiple reduction
    impls/combine_hybrid_single.cuh) in the structures the scale-out GPU tests run (BF16 and FP8
    dispatch, both layouts, top-4 and top-8, a wide row) and DeepSeek-V3 shapes."""
    from deep_ep.backends.gpu import modules
    single, rows = modules.SINGLE_REDUCTION, modules.UNREDUCED_RANKS
    for kind, structure in [("dispatch", (512, 0, 4, False)), ("dispatch", (512, 0, 4, True)),
                            ("dispatch", (512, 4, 4, False)), ("dispatch", (512, 4, 4, True)),
                            ("dispatch", (14336, 0, 8, True)), ("combine", (256, 4, False)), ("combine", (256, 4, True)),
                            ("combine", (7168, 8, True)), ("combine", (128, 4, rows)), ("combine", (128, 4, single)),
                            ("combine", (256, 4, rows)), ("combine", (256, 4, single)), ("combine", (512, 4, rows)),
                            ("combine", (512, 4, single)), ("combine", (2880, 4, rows)), ("combine", (256, 8, single)),
                            ("combine", (2048, 4, single)),
                            ("combine", (7168, 8, rows)), ("combine", (7168, 8, single))]:
        key, module = modules.build_module(kind, structure, False, 2)
        assert ("EP_TRANSPORT_GIN", 2) in key[1]
        for name, info in module.info.items():
            assert info["stack"] == info["spill_stores"] == info["spill_loads"] == 0, (structure, name, info)


def test_gin_hybrid_transport_args_mirror():
    """TransportArgs with EP_TRANSPORT_GIN=2: the direct mode's fields, then the offsets of the
    forwarding area and of combine's inbox."""
    args = gin.GinHybridTransportArgs
    assert ctypes.sizeof(args) == 80 and (args.forward_offset.offset, args.inbox_offset.offset) == (64, 72)
    from deep_ep.backends.gpu import window
    # the forwarding slot mirrors impls/dispatch_forward.cuh's forward_slot_bytes
    assert window.forward_slot_bytes(512, 4, 4, 2) == 528 + 80
    include = jit.locate.deep_ep_include_dir() / "deep_ep" / "impls"
    assert "(16 + 12 * K + 4 * node_ranks + 15) / 16 * 16" in (include / "dispatch_forward.cuh").read_text()
    # and combine's entries and node slots mirror combine_hybrid_reduce.cuh's sizes
    reduce = (include / "combine_hybrid_reduce.cuh").read_text()
    assert "(16 + 4 * K + 15) / 16 * 16" in reduce and "(16 + 4 * K * node_ranks + 15) / 16 * 16" in reduce
    # without multiple reduction (window.check_hybrid_combine(unreduced=True)): an expanded entry is
    # the values and 16 bytes, a rows slot its trailer then a row per rank of the node or per slot
    single = (include / "combine_hybrid_single.cuh").read_text()
    assert "CombineRow<kHidden, K, true>::kWeightOffset + 16;" in single
    assert "(16 + 4 * K * (kExpand ? 1 : node_ranks) + 15) / 16 * 16" in single
    assert "unreduced_entries<K, kExpand>(node_ranks) * CombineRow<kHidden, K, kExpand>::kWeightOffset" in single
