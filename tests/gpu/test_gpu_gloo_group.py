"""A gloo group with GPU tensors (vLLM passes its CPU group to `deep_ep.Buffer` while its tensors are
on the GPU), and an NCCL group under ``EP_REUSE_NCCL_COMM=0``: the buffer runs on the GPU on a private
NCCL communicator (an NCCL unique id broadcast over the group), for `ElasticBuffer` and
`deep_ep.Buffer` alike, and `destroy()` ends that communicator.

Every dispatch and combine is compared element by element with `deep_ep.reference` (the cases of
tests/gpu/test_gpu_backend.py) or with the V1 spec of tests/test_legacy_buffer.py. One process runs
it on one GPU (a one-rank group); under torchrun every process runs it on its own GPU, with the
group of every process (``torchrun --nproc-per-node N -m pytest tests/gpu/test_gpu_gloo_group.py``).
Run by ``EXTRA_FILES=tests/gpu/test_gpu_gloo_group.py bash tools/device_suite.sh extra``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_cases import cases_for  # noqa: E402
from test_gpu_backend import run_case  # noqa: E402
from test_legacy_buffer import CASES as LEGACY_CASES, _run_case as run_legacy_case  # noqa: E402

import deep_ep  # noqa: E402
from deep_ep.comm import nccl as comm_nccl  # noqa: E402
from deep_ep.cuda import nccl as nccl_calls  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: the cases of tests/gpu/test_gpu_backend.py run here (by base name): both layouts, alignment and
#: biases, no CPU sync, FP8 with packed scales, an empty rank
CASE_NAMES = ("bf16", "bf16-expand-align128", "bf16-nosync", "fp8-ue8m0-colmajor", "bf16-expand-empty-rank")


@pytest.fixture(scope="module")
def nccl_world():
    """The NCCL group of every process: torchrun's (one GPU per process, from ``LOCAL_RANK``), or a
    one-rank group on GPU 0 (`deep_ep.bench.gpu_timing.single_rank_nccl_group`)."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return dist.group.WORLD
    from deep_ep.bench.gpu_timing import single_rank_nccl_group
    return single_rank_nccl_group(torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture(scope="module")
def gloo_group(nccl_world):
    """A gloo group over the same ranks, as vLLM's CPU group is."""
    return dist.new_group(backend="gloo")


@pytest.fixture
def destroyed_comms():
    """The communicators `deep_ep.cuda.nccl.destroy_comm` ended during the test (it still ends them)."""
    ended = []
    real = nccl_calls.destroy_comm

    def recording(comm):
        ended.append(comm)
        real(comm)
    with mock.patch.object(nccl_calls, "destroy_comm", recording):
        yield ended


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _privates(group) -> list:
    return [(device, comm, leases) for g, device, comm, leases in comm_nccl.private_communicators() if g is group]


def _cases(num_ranks: int) -> list:
    return [c for c in cases_for(num_ranks) if c.name.split("-", 1)[1] in CASE_NAMES]


# ---------------------------------------------------------------------------------------------- ElasticBuffer
def test_gloo_group_gets_a_private_communicator(gloo_group, nccl_world, destroyed_comms):
    world_size = gloo_group.size()
    assert comm_nccl.reuses_torch_communicator(nccl_world, _device())
    assert not comm_nccl.reuses_torch_communicator(gloo_group, _device())
    buffer = deep_ep.ElasticBuffer(gloo_group, num_max_tokens_per_rank=64, hidden=256, num_topk=4)
    transport = buffer._backend.transport
    assert buffer.device == _device() and buffer.num_ranks == world_size
    assert transport.private_communicator and transport.comm != comm_nccl.comm_ptr(nccl_world, _device())
    assert _privates(gloo_group) == [(_device(), transport.comm, 1)]
    assert buffer.get_physical_domain_size() == (1, world_size)
    assert deep_ep.get_physical_domain_size(gloo_group) == (1, world_size)   # the buffer's communicator
    second = deep_ep.ElasticBuffer(gloo_group, num_bytes=buffer.num_bytes)   # shares it
    assert second._backend.transport.comm == transport.comm and _privates(gloo_group)[0][2] == 2
    second.destroy()
    assert destroyed_comms == [] and _privates(gloo_group)[0][2] == 1
    comm = transport.comm
    buffer.destroy()
    assert destroyed_comms == [comm] and _privates(gloo_group) == []
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device=_device())
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.dispatch(x, torch.zeros(4, 4, dtype=torch.int64, device=_device()), num_experts=4 * world_size)


@pytest.mark.parametrize("base", CASE_NAMES)
def test_dispatch_combine_on_gloo_group(base, gloo_group, destroyed_comms):
    (case,) = [c for c in _cases(gloo_group.size()) if c.name.split("-", 1)[1] == base]
    rank = gloo_group.rank()
    run_case(case, lambda body: {rank: body(gloo_group)}, _device())
    assert len(destroyed_comms) == 1 and _privates(gloo_group) == []   # each case's buffer ended its own


def test_cpu_job_on_a_gpu_machine(gloo_group):
    buffer = deep_ep.ElasticBuffer(gloo_group, device="cpu")
    assert buffer.device == torch.device("cpu") and _privates(gloo_group) == []
    with pytest.raises(ValueError, match="must be on cpu"):
        buffer.dispatch(torch.zeros(4, 256, dtype=torch.bfloat16, device=_device()),
                        torch.zeros(4, 2, dtype=torch.int64, device=_device()), num_experts=2 * gloo_group.size())
    buffer.destroy()


# ---------------------------------------------------------------------------------------------- EP_REUSE_NCCL_COMM
def test_reuse_off_on_nccl_group(nccl_world, monkeypatch, destroyed_comms):
    torch_comm = comm_nccl.comm_ptr(nccl_world, _device())
    buffer = deep_ep.ElasticBuffer(nccl_world, num_max_tokens_per_rank=64, hidden=256, num_topk=4)
    assert not buffer._backend.transport.private_communicator and buffer._backend.transport.comm == torch_comm
    buffer.destroy()
    assert destroyed_comms == []                                       # torch's is never ended here
    monkeypatch.setenv("EP_REUSE_NCCL_COMM", "0")
    buffer = deep_ep.ElasticBuffer(nccl_world, num_max_tokens_per_rank=64, hidden=256, num_topk=4)
    transport = buffer._backend.transport
    assert transport.private_communicator and transport.comm != torch_comm
    assert _privates(nccl_world) == [(_device(), transport.comm, 1)]
    comm = transport.comm
    buffer.destroy()
    assert destroyed_comms == [comm] and _privates(nccl_world) == []
    (case,) = [c for c in cases_for(nccl_world.size()) if c.name.endswith("-bf16-expand-align128")]
    rank = nccl_world.rank()
    run_case(dataclasses.replace(case, name=case.name + "-private"), lambda body: {rank: body(nccl_world)}, _device())
    assert len(destroyed_comms) == 2


# ---------------------------------------------------------------------------------------------- deep_ep.Buffer (V1)
def test_legacy_buffer_on_gloo_group(gloo_group, destroyed_comms):
    world_size = gloo_group.size()
    num_nvl_bytes = deep_ep.Config().get_nvl_buffer_size_hint(2 * 256, world_size)   # the cases' largest hidden
    buffer = deep_ep.Buffer(gloo_group, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)
    transport = buffer.elastic_buffer._backend.transport
    assert buffer.elastic_buffer.device == _device() and transport.private_communicator
    comm = transport.comm
    try:
        for index, case in enumerate(LEGACY_CASES):
            try:
                run_legacy_case(buffer, gloo_group.rank(), world_size, index, case, _device())
            except Exception as exc:
                raise AssertionError(f"case {case[0]}, rank {gloo_group.rank()} of {world_size}: {exc}") from exc
    finally:
        buffer.destroy()
    assert comm in destroyed_comms and _privates(gloo_group) == []
