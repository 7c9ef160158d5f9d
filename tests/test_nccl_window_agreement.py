"""`deep_ep.comm.nccl.SymmetricWindow`'s agreement before its collective registration, with NCCL's
calls faked: a rank whose allocation failed, or a peer's, makes every rank raise before
``ncclCommWindowRegister``, which would otherwise leave the ranks that got there waiting."""
from __future__ import annotations

import types

import pytest
import torch

from deep_ep.comm import nccl


class _FakeNccl:
    def __init__(self, alloc_result: int) -> None:
        self.alloc_result, self.calls = alloc_result, []

    def ncclMemAlloc(self, ptr, size):
        self.calls.append("alloc")
        if self.alloc_result == 0:
            ptr._obj.value = 0x7000_0000
        return self.alloc_result

    def ncclMemFree(self, ptr):
        self.calls.append("free")
        return 0

    def ncclCommWindowRegister(self, *args):
        self.calls.append("register")
        return 0

    def ncclGetErrorString(self, code):
        return b"fake NCCL error"

    def ncclGetLastError(self, comm):
        return b""


@pytest.fixture
def fake(monkeypatch):
    def make(alloc_result: int) -> _FakeNccl:
        lib = _FakeNccl(alloc_result)
        monkeypatch.setattr(nccl, "libnccl", lambda: lib)
        monkeypatch.setattr(nccl, "check", _check)
        monkeypatch.setattr(nccl.SymmetricWindow, "_allocate", _allocate_without_cuda)
        return lib
    return make


def _check(call, result, comm=None):
    if result != 0:
        raise nccl.NcclError(f"{call} failed: {result}")


def _allocate_without_cuda(self, lib) -> None:
    import ctypes
    ptr = ctypes.c_void_p()
    _check("ncclMemAlloc", lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(self.num_bytes)))
    self.ptr = ptr.value


def test_this_ranks_failed_allocation_is_told_to_the_others_then_raised(fake):
    lib = fake(2)
    told = []
    with pytest.raises(nccl.NcclError, match="ncclMemAlloc"):
        nccl.SymmetricWindow(1, 4096, torch.device("cpu"), agree=lambda ok: told.append(ok) or 0)
    assert told == [False] and lib.calls == ["alloc"]


def test_a_peers_failed_allocation_raises_here_before_registering(fake):
    lib = fake(0)
    with pytest.raises(RuntimeError, match="rank 3 could not allocate its 4096-byte NCCL window"):
        nccl.SymmetricWindow(1, 4096, torch.device("cpu"), agree=lambda ok: 3)
    assert lib.calls == ["alloc", "free"]        # its own memory freed, never registered


def test_every_rank_allocated_then_registers(fake):
    lib = fake(0)
    window = nccl.SymmetricWindow(1, 4096, torch.device("cpu"), agree=lambda ok: None)
    assert lib.calls == ["alloc", "register"] and window.ptr == 0x7000_0000


def test_first_failed_rank_reads_every_ranks_word(monkeypatch):
    import torch.distributed as dist
    group = types.SimpleNamespace(size=lambda: 4, rank=lambda: 1)
    peers = torch.tensor([0, 0, 1, 1], dtype=torch.int64)   # ranks 2 and 3 failed
    monkeypatch.setattr(nccl, "_carries_cpu_tensors", lambda group: True)
    monkeypatch.setattr(dist, "all_reduce", lambda words, op=None, group=None: words.copy_(torch.maximum(words, peers)))
    assert nccl.first_failed_rank(group, torch.device("cpu"), True) == 2
    monkeypatch.setattr(dist, "all_reduce", lambda words, op=None, group=None: None)
    assert nccl.first_failed_rank(group, torch.device("cpu"), True) is None
    assert nccl.first_failed_rank(group, torch.device("cpu"), False) == 1


@pytest.mark.parametrize("own_team_rank, peer_failed", [(0, 1), (1, None), (1, 0)])
def test_a_permuted_lsa_team_on_one_rank_raises_on_every_rank(monkeypatch, own_team_rank, peer_failed):
    """`NcclLsaTransport`: a rank whose LSA index differs from its group rank refuses, and so does
    every other rank, before the window's collective registration (told through
    `first_failed_rank`), instead of waiting there for it."""
    from deep_ep.comm import lsa
    released, windows = [], []
    lease = types.SimpleNamespace(comm=0x10, release=lambda: released.append(True), private=False)
    monkeypatch.setattr(lsa, "acquire_communicator", lambda group, device: lease)
    monkeypatch.setattr(lsa, "lsa_team", lambda comm: (2, own_team_rank))
    monkeypatch.setattr(lsa, "SymmetricWindow", lambda *args, **kwargs: windows.append(args) or types.SimpleNamespace(
        handle=0x20, destroy=lambda: None))

    def agree(group, device, ok):
        return 1 if not ok else peer_failed   # this is rank 1 of 2
    monkeypatch.setattr(lsa, "first_failed_rank", agree)
    group = types.SimpleNamespace(rank=lambda: 1, size=lambda: 2)
    expected = "LSA rank 0 differs from group rank 1" if own_team_rank == 0 else \
        f"rank {peer_failed} of the group cannot use the NVLink"
    if peer_failed is None:
        monkeypatch.setattr(lsa, "DeviceCommunicator", lambda comm, num_ranks: types.SimpleNamespace(
            transport_args=lambda handle: b"args", destroy=lambda: None))
        lsa.NcclLsaTransport(group, 4096, torch.device("cpu"))
        assert len(windows) == 1 and not released
        return
    with pytest.raises(NotImplementedError, match=expected):
        lsa.NcclLsaTransport(group, 4096, torch.device("cpu"))
    assert windows == [] and released == [True]
