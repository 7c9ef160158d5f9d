"""The control kernels over GIN (comm/gin_control.cuh) on machines without a GPU.

* the barrier module with the direct and the hybrid scale-out transports (EP_TRANSPORT_GIN=1 and 2)
  compiles under NVRTC without spills or stack (the notify kernel's instantiations are in the dispatch
  modules that tests/test_gin_compile.py compiles);
* `modules.launch_control` launches a control kernel beside the rank's NIC on emulated nodes, and
  alone elsewhere.
"""
from __future__ import annotations

import types

import pytest

from deep_ep import jit
from deep_ep.backends.gpu import modules


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """A JIT cache of this test session: the builds are compiled here, not found in a stale cache."""
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "jit-cache"))
    jit.clear_memory_cache()


def _no_spills(module):
    for name, info in module.info.items():
        assert info["stack"] == info["spill_stores"] == info["spill_loads"] == 0, (name, info)


def test_barrier_over_gin_compiles_without_spills():
    for gin_mode in (1, 2):
        key, module = modules.build_module("barrier", (), False, gin_mode)
        assert key == ("barrier", (("EP_TRANSPORT_GIN", gin_mode), ("EP_TRANSPORT_NCCL", 0)))
        assert module.kernel_names() == [modules.BARRIER_KERNEL]
        _no_spills(module)
    key, _ = modules.build_module("barrier", (), False, 0)   # one node: no GIN define, the key unchanged
    assert key == ("barrier", (("EP_TRANSPORT_NCCL", 0),))


class _Transport:
    def __init__(self):
        self.calls = []

    def launch_data(self, nic_module, stream, num_blocks, launch):
        self.calls.append((nic_module, stream, num_blocks))
        launch()


def _backend(transport_gin: int):
    transport = _Transport()
    return types.SimpleNamespace(transport_gin=transport_gin, transport=transport,
                                 module=lambda kind, structure: (kind, structure)), transport


@pytest.mark.parametrize("transport_gin", [1, 2])
def test_launch_control_runs_beside_the_nic_on_emulated_nodes(transport_gin):
    backend, transport = _backend(transport_gin)
    launched = []
    modules.launch_control(backend, 77, 5, lambda: launched.append("kernel"))
    assert launched == ["kernel"] and transport.calls == [(("gin_nic", ()), 77, 5)]


def test_launch_control_alone_on_one_node():
    backend, transport = _backend(0)
    launched = []
    modules.launch_control(backend, 3, 1, lambda: launched.append("kernel"))
    assert launched == ["kernel"] and transport.calls == []


def test_control_kernels_use_the_control_transport():
    """The notify kernel and the barrier take `make_control_transport` and end every block with
    `end_control_block` (the NIC beside them ends only once they have)."""
    include = jit.locate.deep_ep_include_dir() / "deep_ep" / "kernels"
    for name in ("dispatch.cuh", "barrier.cuh"):
        text = (include / name).read_text()
        assert "make_control_transport(transport, peers)" in text and "end_control_block(tr)" in text, name
