"""The GPU AGRS module (include/deep_ep/kernels/agrs.cuh: the peers' window addresses, the emulated
ranks' copy, flags and wait) compiles under
NVRTC for both transports, and the host's view of its header layout matches the device constants.
Runs without a GPU: compiling needs only the NVRTC and header wheels (NCCL's headers for the NCCL
transport: the environment's, else NCCL 2.28.9's fetched as tests/nccl_wheels.py does; skipped when
neither can be had)."""
from __future__ import annotations

import pytest

from deep_ep import jit
from deep_ep.backends.gpu import agrs as gpu_agrs
from deep_ep.backends.gpu import modules
from deep_ep.primitives.agrs import AGRS_MAX_OPS_PER_SESSION

import nccl_wheels


@pytest.mark.parametrize("transport_nccl", [False, True], ids=["emulated", "nccl"])
def test_agrs_module_compiles(transport_nccl):
    include = None
    if transport_nccl and nccl_wheels.environment_include_dir() is None:
        try:
            include = str(nccl_wheels.include_dir(nccl_wheels.OLDEST))
        except nccl_wheels.FetchError as exc:
            pytest.skip(f"no NCCL headers: {exc}")
    mod = jit.build(f"deep_ep_agrs_test_{int(transport_nccl)}", modules.kernel_source("agrs"),
                    defines=modules.agrs_defines(transport_nccl=transport_nccl), use_nccl=transport_nccl,
                    nccl_include_dir=include, check_spills=True)
    assert sorted(mod.kernel_names()) == sorted([modules.AGRS_PEERS_KERNEL, modules.AGRS_WAIT_KERNEL, modules.AGRS_FLAGS_KERNEL,
                                                 modules.AGRS_COPY_KERNEL])


def test_header_layout():
    constants = gpu_agrs.AGRS_CONSTANTS
    assert constants["kAgrsMaxOps"] == AGRS_MAX_OPS_PER_SESSION
    assert constants["kAgrsHeaderRows"] == constants["kAgrsFlagRow"] + AGRS_MAX_OPS_PER_SESSION
    for num_ranks in (1, 2, 8, 64, 1024):
        start = gpu_agrs.space_offset(num_ranks)
        assert start % 4096 == 0 and start >= gpu_agrs.AGRS_OFFSET + 4 * constants["kAgrsHeaderRows"] * num_ranks
        assert gpu_agrs.window_bytes(num_ranks, 96) == start + 96
