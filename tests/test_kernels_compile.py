"""Every kernel instantiation the GPU suite and the bench use compiles under NVRTC, with no spills.

Every structure is compiled for the emulated-rank transport; the NCCL transport (NCCL's device
headers through the JIT's compatibility layer) for the DeepSeek-V3 shapes of every layout and the
control module, since the transport only changes how a kernel finds its peers.
Runs on machines without a GPU (CI): compiling needs only the NVRTC and header wheels.
"""
from __future__ import annotations

import pytest

from deep_ep import jit
from deep_ep.backends import gpu
from deep_ep.backends.gpu import modules
from deep_ep.routing import MODEL_PRESETS as PRESETS

from gpu_cases import all_cases


def _structures():
    dispatch, combine = set(), set()
    for c in all_cases():
        dispatch.add(c.dispatch_structure())
        combine.add(c.combine_structure())
    # top-1 and top-2 expanded (the fewest slots)
    for k in (1, 2):
        dispatch.add((14336, 0, k, True))
        dispatch.add((7168, 56, k, True))
    # the bench's presets: bf16 and FP8 (fp32 scales), expanded or not
    for p in PRESETS.values():
        for expand in (False, True):
            dispatch.add((p.hidden * 2, 0, p.top_k, expand))
            if p.hidden % 128 == 0:
                dispatch.add((p.hidden, p.hidden // 128, p.top_k, expand))
            combine.add((p.hidden, p.top_k, expand))
        combine.add((p.hidden, p.top_k, modules.SINGLE_REDUCTION))   # allow_multiple_reduction=False
    return sorted(dispatch), sorted(combine)


DISPATCH, COMBINE = _structures()


@pytest.mark.parametrize("structure", DISPATCH, ids=lambda s: "d{}_sf{}_k{}_{}".format(*s))
def test_dispatch_module_compiles(structure):
    mod = jit.build("deep_ep_dispatch_test", gpu.kernel_source("dispatch"), defines=gpu.dispatch_defines(*structure),
                    check_spills=True)
    # the same kernels for every rank count and layout
    assert sorted(mod.kernel_names()) == sorted([modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL,
                                                 modules.CACHED_DISPATCH_KERNEL])


@pytest.mark.parametrize("structure", COMBINE, ids=lambda s: "h{}_k{}_{}".format(*s))
def test_combine_module_compiles(structure):
    mod = jit.build("deep_ep_combine_test", gpu.kernel_source("combine"), defines=gpu.combine_defines(*structure),
                    check_spills=True)
    assert mod.kernel_names() == [modules.COMBINE_KERNEL]


NCCL_STRUCTURES = [("dispatch", (14336, 0, 8, False)), ("dispatch", (14336, 0, 8, True)),
                   ("dispatch", (7168, 56, 8, False)), ("combine", (7168, 8, False)), ("combine", (7168, 8, True)),
                   ("combine", (7168, 8, modules.SINGLE_REDUCTION)), ("barrier", ()), ("pp", ())]


@pytest.mark.parametrize("kind, structure", NCCL_STRUCTURES, ids=lambda v: v if isinstance(v, str) else "")
def test_nccl_transport_module_compiles(kind, structure):
    """The modules of NCCL-backed buffers (EP_TRANSPORT_NCCL=1: ncclDevComm and the symmetric window)."""
    defines = {"dispatch": gpu.dispatch_defines, "combine": gpu.combine_defines,
               "barrier": modules.barrier_defines, "pp": modules.pp_defines}[kind](*structure, transport_nccl=True)
    mod = jit.build(f"deep_ep_{kind}_nccl_test", gpu.kernel_source(kind), defines=defines, use_nccl=True,
                    check_spills=True)
    assert mod.kernel_names()


def test_pp_module_compiles():
    """Pipeline send/recv (kernels/pp.cuh) for emulated ranks: the three entry points, no spills (the
    NCCL transport's build is among `NCCL_STRUCTURES`)."""
    mod = jit.build("deep_ep_pp_test", gpu.kernel_source("pp"), defines=modules.pp_defines(), check_spills=True)
    assert sorted(mod.kernel_names()) == sorted([modules.PP_SEND_KERNEL, modules.PP_RECV_KERNEL,
                                                 modules.PP_FLUSH_KERNEL])


def test_tunable_defines_from_environment(monkeypatch):
    """DEEP_EP_KERNEL_DEFINES adds build-time tunables to both data modules (the default build has
    none); the variant compiles without spills; malformed items, unknown names and structural defines
    are refused."""
    monkeypatch.delenv("DEEP_EP_KERNEL_DEFINES", raising=False)
    assert gpu.tunable_defines() == {} and "EP_LOAD_NO_L1" not in gpu.dispatch_defines(14336, 0, 8, False)
    monkeypatch.setenv("DEEP_EP_KERNEL_DEFINES", " EP_LOAD_NO_L1=1, EP_SEND_UNROLL=4 ")
    assert gpu.tunable_defines() == {"EP_LOAD_NO_L1": 1, "EP_SEND_UNROLL": 4}
    d, c = gpu.dispatch_defines(14336, 0, 8, False), gpu.combine_defines(7168, 8, False)
    assert d["EP_LOAD_NO_L1"] == 1 and d["EP_TOPK"] == 8 and c["EP_LOAD_NO_L1"] == 1
    jit.build("deep_ep_dispatch_test", gpu.kernel_source("dispatch"), defines=d, check_spills=True)
    jit.build("deep_ep_combine_test", gpu.kernel_source("combine"), defines=c, check_spills=True)
    for bad in ("LOAD_NO_L1=1", "EP_LOAD_NO_L1", "EP_LOAD_NO_L1=yes", "EP_X-Y=1", "EP_THREADS=256",
                "EP_TOPK=4", "ep_load_no_l1=1", "EP_LOAD_NO_L1S=1", "EP_BLOCK_FENCE=1", "EP_COMBINE_COMPACT=0"):
        monkeypatch.setenv("DEEP_EP_KERNEL_DEFINES", bad)
        with pytest.raises(ValueError, match="DEEP_EP_KERNEL_DEFINES"):
            gpu.tunable_defines()


def test_the_tunables_are_defined_in_one_header():
    """Every tunable of `modules.TUNABLES` is #defined with its default in common/tunables.cuh, and no
    other: no kernel file defines a default of its own (a switch the host would have to mirror). The
    only other defaults are structural, named by the host only when they differ: the transport, the
    data kernels' phases (both, unless a receive hook launches the halves apart), and combine's single
    reduction (an expanded handle on a buffer with allow_multiple_reduction=False)."""
    import re
    from pathlib import Path
    include = Path(modules.__file__).parents[2] / "include" / "deep_ep"
    header = (include / "common" / "tunables.cuh").read_text()
    assert set(re.findall(r"^#ifndef (EP_\w+)\n#define \1 \d+$", header, re.M)) == set(modules.TUNABLES)
    elsewhere = {(path.relative_to(include).as_posix(), name)
                 for path in include.rglob("*.cuh") if path.name != "tunables.cuh"
                 for name in re.findall(r"^#ifndef (EP_\w+)", path.read_text(), re.M)}
    assert elsewhere == {("comm/transport.cuh", "EP_TRANSPORT_NCCL"), ("comm/transport.cuh", "EP_TRANSPORT_GIN"),
                         ("kernels/dispatch.cuh", "EP_DATA_PHASES"),
                         ("kernels/combine.cuh", "EP_DATA_PHASES"), ("kernels/combine.cuh", "EP_SINGLE_REDUCTION")}


def test_the_combines_single_source_path_can_be_left_out():
    """EP_COMBINE_SINGLE_UNROLL=0 (no single-source path) still compiles without spills, so that
    tools/tune_gpu.py can time it against the default."""
    defines = dict(gpu.combine_defines(4096, 8, False), EP_COMBINE_SINGLE_UNROLL=0)
    mod = jit.build("deep_ep_combine_test", gpu.kernel_source("combine"), defines=defines, check_spills=True)
    assert modules.COMBINE_KERNEL in mod.kernel_names()


def test_agrs_reduce_kernel_compiles():
    """A reduce-scatter's sum (kernels/agrs_reduce.cuh) compiles under NVRTC without spills: one entry
    point for both dtypes and both load widths."""
    from deep_ep.backends.gpu import agrs_reduce
    module = jit.build("deep_ep_agrs_reduce", "#include <deep_ep/kernels/agrs_reduce.cuh>\n", check_spills=True)
    assert module.kernel_names() == [agrs_reduce.KERNEL_NAME]


def test_low_latency_layout_module_compiles():
    """The V1 low-latency dispatch's layout kernels (kernels/ll_layout.cuh: the pairs' cast, the counts
    and the placement) compile under NVRTC without spills, one module for every shape."""
    from deep_ep.legacy import ll_layout
    mod = jit.build("deep_ep_ll_layout", "#include <deep_ep/kernels/ll_layout.cuh>\n", check_spills=True)
    assert sorted(mod.kernel_names()) == sorted(ll_layout.KERNEL_NAMES)


@pytest.mark.parametrize("transport_nccl", [False, True], ids=["emulated", "nccl"])
def test_low_latency_direct_module_compiles(transport_nccl):
    """The V1 low-latency direct kernels (kernels/ll_direct.cuh: dispatch and combine, one kernel each
    with a send and a receive phase) compile under NVRTC without spills for both transports, one
    module for every shape."""
    from deep_ep.legacy import ll_direct
    mod = jit.build("deep_ep_ll_direct", ll_direct.SOURCE, defines={"EP_TRANSPORT_NCCL": int(transport_nccl)},
                    use_nccl=transport_nccl, check_spills=True)
    assert sorted(mod.kernel_names()) == sorted(ll_direct.KERNEL_NAMES)
