"""Which backend a group gets, and which NCCL communicator a GPU buffer works on, without a GPU.

* `deep_ep.backends.is_cpu_group`: the CPU backend exactly without CUDA or with ``device="cpu"``; a
  gloo group where CUDA is available runs on the GPU (DeepEP V2's rule, vLLM's CPU group);
  ``device`` is validated (type, kind, index, a group that cannot carry CPU tensors);
* `deep_ep.comm.nccl`: torch's communicator is borrowed from an NCCL group unless
  ``EP_REUSE_NCCL_COMM=0``; any other group gets a private one: group rank 0's NCCL unique id reaches
  every rank through the group (2 gloo processes), each rank joins with its own rank and the group
  size, the buffers of one group share it, and the last release destroys it, once;
* an `ElasticBuffer` on a gloo group with CUDA "available" (the NCCL calls, CUDA queries and the GPU
  backend replaced by recorders) holds one private communicator from its creation to `destroy`;
* the ctypes calls of `deep_ep.cuda.nccl` pass the id by value and finalize before destroying.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep import backends
from deep_ep.comm import nccl as comm_nccl
from deep_ep.cuda import nccl as nccl_calls
from proc_utils import run_gloo_ranks

COMM_BASE = 0x5000   # fake ncclComm_t values: COMM_BASE + rank


@pytest.fixture(scope="module")
def gloo_group():
    """A one-rank gloo process group in this process (the default group unless one exists)."""
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="deep_ep_choice_"), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    if created:
        dist.destroy_process_group()


class FakeNccl:
    """Records the NCCL calls `deep_ep.comm.nccl` makes (unique id, init, destroy)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.unique_ids = 0
        self.inits: list = []
        self.destroyed: list = []

    def get_unique_id(self) -> bytes:
        self.unique_ids += 1
        return bytes((7 * i + 3) % 256 for i in range(nccl_calls.UNIQUE_ID_BYTES))

    def init_rank(self, unique_id: bytes, num_ranks: int, rank: int) -> int:
        self.inits.append((unique_id, num_ranks, rank))
        return COMM_BASE + rank

    def destroy_comm(self, comm: int) -> None:
        self.destroyed.append(comm)


@contextlib.contextmanager
def cuda_as_if_available(fake: FakeNccl, lsa=lambda comm: (1, 0)):
    """CUDA "available" on device 0 for the choice and the communicator code, NCCL replaced by ``fake``."""
    with contextlib.ExitStack() as stack:
        for target, value in (("torch.cuda.is_available", lambda: True),
                              ("torch.cuda.current_device", lambda: 0),
                              ("torch.cuda.is_current_stream_capturing", lambda: False),
                              ("torch.cuda.device", lambda device: contextlib.nullcontext()),
                              ("deep_ep.cuda.nccl.get_unique_id", fake.get_unique_id),
                              ("deep_ep.cuda.nccl.init_rank", fake.init_rank),
                              ("deep_ep.cuda.nccl.destroy_comm", fake.destroy_comm),
                              ("deep_ep.comm.nccl.lsa_team", lsa)):
            stack.enter_context(mock.patch(target, value))
        yield


# ---------------------------------------------------------------------------------------------- the choice
def test_device_keyword_is_checked():
    assert backends.check_device(None) is None
    assert backends.check_device("cpu") == "cpu" and backends.check_device(torch.device("cpu")) == "cpu"
    assert backends.check_device("cuda") == "cuda"
    with pytest.raises(TypeError, match="device must be None"):
        backends.check_device(0)
    with pytest.raises(ValueError, match="type 'cpu' or 'cuda'"):
        backends.check_device("meta")
    with pytest.raises(ValueError, match="device"):
        backends.check_device("not-a-device")
    with mock.patch("torch.cuda.is_available", lambda: True), mock.patch("torch.cuda.current_device", lambda: 0):
        assert backends.check_device("cuda:0") == "cuda"
        with pytest.raises(ValueError, match="current CUDA device"):
            backends.check_device("cuda:1")


def test_gloo_group_runs_on_the_gpu_where_cuda_is(gloo_group):
    with mock.patch("torch.cuda.is_available", lambda: False):
        assert backends.is_cpu_group(gloo_group)                     # a CPU-only job
        assert backends.is_cpu_group(gloo_group, "cpu")
        assert not backends.is_cpu_group(gloo_group, "cuda")         # the GPU backend then says it has no GPU
    with mock.patch("torch.cuda.is_available", lambda: True), mock.patch("torch.cuda.current_device", lambda: 0):
        assert not backends.is_cpu_group(gloo_group)                 # DeepEP's rule: any group on the GPU
        assert backends.is_cpu_group(gloo_group, "cpu")
        assert backends.is_cpu_group(gloo_group, torch.device("cpu"))
        assert not backends.is_cpu_group(gloo_group, "cuda:0")


def test_device_cpu_needs_a_group_that_carries_cpu_tensors(gloo_group):
    with mock.patch("deep_ep.backends._backend_name", lambda group: "nccl"):
        with pytest.raises(ValueError, match="carries CPU tensors"):
            backends.is_cpu_group(gloo_group, "cpu")
        assert not backends.is_cpu_group(gloo_group, "cuda")
    with mock.patch("deep_ep.backends._backend_name", lambda group: "cpu:gloo,cuda:nccl"):
        assert backends.is_cpu_group(gloo_group, "cpu")

    class Emulated:   # an emulated-rank group: rank() and size(), not a ProcessGroup
        def rank(self):
            return 0

        def size(self):
            return 2
    assert not backends.is_cpu_group(Emulated())
    with pytest.raises(ValueError, match="emulated"):
        backends.is_cpu_group(Emulated(), "cpu")


def test_buffer_refuses_a_bad_device_before_anything(gloo_group):
    with pytest.raises(TypeError, match="device must be None"):
        deep_ep.ElasticBuffer(gloo_group, device=1)
    with pytest.raises(ValueError, match="type 'cpu' or 'cuda'"):
        deep_ep.Buffer(gloo_group, device="meta")
    buffer = deep_ep.ElasticBuffer(gloo_group, device="cpu")
    assert buffer.device == torch.device("cpu")
    buffer.destroy()


# ---------------------------------------------------------------------------------------------- the communicator
class _LendingBackend:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def _comm_ptr(self) -> int:
        return self.ptr


class _NcclLikeGroup:
    """A group whose backend for CUDA lends a communicator, as torch's NCCL group does."""

    def __init__(self, ptr: int = 0xBEEF) -> None:
        self.backend = _LendingBackend(ptr)

    def _get_backend(self, device):
        return self.backend

    def rank(self):
        return 0

    def size(self):
        return 1


def test_torch_communicator_is_borrowed_unless_told_not_to(monkeypatch, gloo_group):
    device = torch.device("cuda", 0)
    monkeypatch.delenv("EP_REUSE_NCCL_COMM", raising=False)
    group = _NcclLikeGroup()
    assert comm_nccl.reuses_torch_communicator(group, device)
    assert not comm_nccl.reuses_torch_communicator(gloo_group, device)   # gloo lends nothing
    fake = FakeNccl()
    with cuda_as_if_available(fake):
        lease = comm_nccl.acquire_communicator(group, device)
        assert (lease.comm, lease.private) == (0xBEEF, False)
        lease.release()
        assert fake.inits == [] and fake.destroyed == [] and comm_nccl.private_communicators() == []
        monkeypatch.setenv("EP_REUSE_NCCL_COMM", "0")                  # DeepEP's switch
        assert not comm_nccl.reuses_torch_communicator(group, device)
        unique_id = fake.get_unique_id()
        with mock.patch("deep_ep.comm.nccl.broadcast_unique_id", lambda group, device: unique_id):
            lease = comm_nccl.acquire_communicator(group, device)
        assert (lease.comm, lease.private) == (COMM_BASE, True)
        assert fake.inits == [(unique_id, 1, 0)]
        lease.release()
        lease.release()                                                # a second release does nothing
        assert fake.destroyed == [COMM_BASE] and comm_nccl.private_communicators() == []


def test_private_communicator_is_shared_then_destroyed_once(gloo_group):
    fake = FakeNccl()
    device = torch.device("cuda", 0)
    with cuda_as_if_available(fake):
        first = comm_nccl.acquire_communicator(gloo_group, device)
        second = comm_nccl.acquire_communicator(gloo_group, torch.device("cuda"))   # index: the current device
        assert first.private and first.comm == second.comm == COMM_BASE
        assert fake.unique_ids == 1 and len(fake.inits) == 1
        assert [(g is gloo_group, d, c, n) for g, d, c, n in comm_nccl.private_communicators()] == \
            [(True, device, COMM_BASE, 2)]
        assert comm_nccl.group_lsa_team(gloo_group, device) == (1, 0)       # no second communicator
        assert len(fake.inits) == 1
        first.release()
        assert fake.destroyed == []
        second.release()
        assert fake.destroyed == [COMM_BASE] and comm_nccl.private_communicators() == []
        # a query with no buffer alive makes one for itself and ends it
        assert comm_nccl.group_lsa_team(gloo_group, device) == (1, 0)
        assert len(fake.inits) == 2 and fake.destroyed == [COMM_BASE, COMM_BASE]


def _private_communicator_on_ranks(rank, world_size):
    fake = FakeNccl(rank)
    with cuda_as_if_available(fake):
        lease = comm_nccl.acquire_communicator(dist.group.WORLD, torch.device("cuda", 0))
        comm = lease.comm
        lease.release()
    return fake.unique_ids, fake.inits, comm, fake.destroyed


def test_unique_id_of_rank_zero_reaches_every_rank(tmp_path):
    world_size = 2
    results = run_gloo_ranks(_private_communicator_on_ranks, world_size, tmp_path)
    expected_id = FakeNccl().get_unique_id()
    for rank in range(world_size):
        unique_ids, inits, comm, destroyed = results[rank]
        assert unique_ids == (1 if rank == 0 else 0)           # only rank 0 makes an id
        assert inits == [(expected_id, world_size, rank)]
        assert comm == COMM_BASE + rank and destroyed == [COMM_BASE + rank]


# ---------------------------------------------------------------------------------------------- a buffer on it
class RecordingGPUBackend(backends.Backend):
    """Stands for the GPU backend: takes its communicator lease as the NCCL transport does."""

    made: list = []

    def __init__(self, group, config) -> None:
        super().__init__(group, config)
        self.lease = comm_nccl.acquire_communicator(group, torch.device("cuda", torch.cuda.current_device()))
        RecordingGPUBackend.made.append(self)

    @property
    def device(self):
        return torch.device("cuda", 0)

    def barrier(self):
        pass

    def dispatch(self, *args, **kwargs):
        raise AssertionError("not called")

    def combine(self, *args, **kwargs):
        raise AssertionError("not called")

    def destroy(self):
        self.lease.release()


def test_buffer_on_gloo_group_holds_one_private_communicator(gloo_group):
    import deep_ep.backends.gpu as gpu_backend
    fake = FakeNccl()
    RecordingGPUBackend.made.clear()
    with cuda_as_if_available(fake), mock.patch.object(gpu_backend, "GPUBackend", RecordingGPUBackend):
        buffer = deep_ep.ElasticBuffer(gloo_group, num_bytes=2 << 20)
        assert buffer.device.type == "cuda" and len(RecordingGPUBackend.made) == 1
        assert buffer.get_physical_domain_size() == (1, 1)      # the LSA team of the private communicator
        assert fake.unique_ids == 1 and len(fake.inits) == 1 and fake.destroyed == []
        assert [n for _, _, _, n in comm_nccl.private_communicators()] == [1]   # the backend's lease only
        legacy = deep_ep.Buffer(gloo_group, num_nvl_bytes=2 << 20, explicitly_destroy=True)
        assert legacy.elastic_buffer.device.type == "cuda" and len(fake.inits) == 1     # shared
        legacy.destroy()
        assert fake.destroyed == []
        buffer.destroy()
        assert fake.destroyed == [COMM_BASE] and comm_nccl.private_communicators() == []
        cpu_buffer = deep_ep.ElasticBuffer(gloo_group, device="cpu")     # a CPU job on a GPU machine
        assert cpu_buffer.device == torch.device("cpu") and len(fake.inits) == 1
        cpu_buffer.destroy()


def test_failed_buffer_releases_its_communicator(gloo_group):
    import deep_ep.backends.gpu as gpu_backend

    class Refusing(RecordingGPUBackend):
        def __init__(self, group, config):
            super().__init__(group, config)
            self.lease.release()
            raise NotImplementedError("refused")

    fake = FakeNccl()
    with cuda_as_if_available(fake), mock.patch.object(gpu_backend, "GPUBackend", Refusing):
        with pytest.raises(NotImplementedError, match="refused"):
            deep_ep.ElasticBuffer(gloo_group, num_bytes=2 << 20)
    assert fake.destroyed == [COMM_BASE] and comm_nccl.private_communicators() == []


# ---------------------------------------------------------------------------------------------- ctypes calls
class FakeLib:
    def __init__(self) -> None:
        self.calls: list = []

    def ncclGetUniqueId(self, ref):
        ctypes.memmove(ref._obj.internal, bytes(range(nccl_calls.UNIQUE_ID_BYTES)), nccl_calls.UNIQUE_ID_BYTES)
        return 0

    def ncclCommInitRank(self, comm_ref, num_ranks, unique_id, rank):
        self.calls.append(("init", bytes(unique_id.internal), num_ranks, rank))
        comm_ref._obj.value = 0x1234
        return 0

    def ncclCommFinalize(self, comm):
        self.calls.append(("finalize", comm.value))
        return 0

    def ncclCommDestroy(self, comm):
        self.calls.append(("destroy", comm.value))
        return 0


def test_ctypes_calls(monkeypatch):
    lib = FakeLib()
    monkeypatch.setattr(nccl_calls, "libnccl", lambda: lib)
    unique_id = nccl_calls.get_unique_id()
    assert unique_id == bytes(range(nccl_calls.UNIQUE_ID_BYTES))
    assert nccl_calls.init_rank(unique_id, 4, 3) == 0x1234
    nccl_calls.destroy_comm(0x1234)
    assert lib.calls == [("init", unique_id, 4, 3), ("finalize", 0x1234), ("destroy", 0x1234)]
    with pytest.raises(ValueError, match="128 bytes"):
        nccl_calls.init_rank(b"short", 4, 3)
    assert ctypes.sizeof(nccl_calls.UniqueId) == nccl_calls.UNIQUE_ID_BYTES
