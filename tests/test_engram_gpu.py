"""The GPU path of Engram, checked on the CPU (no GPU needed): the Engram module (kernels/engram.cuh)
compiles under NVRTC for both transports with no spills, its host mirror `EngramArgs` has the device
struct's layout, and its constants parse. The kernels run in tests/gpu/test_gpu_engram.py."""
import ctypes

import pytest

from deep_ep import jit
from deep_ep.backends.gpu import engram as gpu_engram
from deep_ep.backends.gpu import modules

import nccl_wheels
from test_kernel_args_layout import _device_layout

KERNELS = sorted([modules.ENGRAM_GATHER_KERNEL, modules.ENGRAM_STORE_KERNEL])


def test_engram_module_compiles_for_emulated_ranks():
    mod = jit.build("deep_ep_engram_test", modules.kernel_source("engram"), defines=modules.engram_defines(),
                    check_spills=True)
    assert sorted(mod.kernel_names()) == KERNELS


def test_engram_module_compiles_for_the_nccl_transport():
    include = nccl_wheels.environment_include_dir()
    if include is None:
        try:
            include = nccl_wheels.include_dir(nccl_wheels.OLDEST)
        except nccl_wheels.FetchError as exc:
            pytest.skip(f"no NCCL headers: {exc}")
    mod = jit.build("deep_ep_engram_nccl_test", modules.kernel_source("engram"),
                    defines=modules.engram_defines(transport_nccl=True), use_nccl=True, nccl_include_dir=str(include),
                    check_spills=True)
    assert sorted(mod.kernel_names()) == KERNELS


def test_engram_args_mirror_matches_the_device_struct():
    fields = [name for name, _ in gpu_engram.EngramArgs._fields_]
    device = _device_layout("deep_ep::EngramArgs", fields, "impls/engram.cuh")
    host = [ctypes.sizeof(gpu_engram.EngramArgs)] + [getattr(gpu_engram.EngramArgs, f).offset for f in fields]
    assert device == host


def test_engram_constants_parse_from_the_header():
    constants = gpu_engram.ENGRAM_CONSTANTS
    assert constants["kEngramThreads"] == 32 * constants["kEngramWarps"]
    assert gpu_engram.HEADER_BYTES == 64 and gpu_engram.HEADER_BYTES % 16 == 0
