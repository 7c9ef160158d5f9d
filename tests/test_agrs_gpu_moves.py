"""The GPU backend's AGRS moves (`deep_ep.backends.gpu.agrs.GPUAgrsMoves`) run on the CPU with the
driver's three operations replaced by their host meaning over windows in host memory: a copy is a
memmove, a flag write a store, a stream wait an assertion that the flag already holds the value
(the ranks' calls run one after another, every send before any wait); the kernels emulated ranks
queue instead are run on the host from their launch arguments (both ways are run). This checks, without a GPU,
where every byte and flag goes (rooms, rows, chunks, in-place slots, the "entered" words) and that
reduce-scatter's sum is the CPU spec's, bit for bit; the device suite (tests/gpu/test_gpu_agrs.py)
runs the real thing.
"""
from __future__ import annotations

import contextlib
import ctypes
import types

import pytest
import torch

from deep_ep.backends.gpu import agrs as gpu_agrs
from deep_ep.backends.gpu import errors as gpu_errors
from deep_ep.backends.gpu import modules
from test_agrs import _reduce_reference, _tensor

WINDOW_BYTES = 256 * 1024
SM_LIMIT = 33   # the copy kernel's most blocks (132 SMs over 4 emulated ranks)


class _Unreached(AssertionError):
    """A stream wait whose flag was not raised: on a GPU the stream would wait for it."""


def _memmove(dst, src, num_bytes, stream):
    ctypes.memmove(dst, src, num_bytes)
    return 0


def _write(stream, address, value):
    ctypes.c_uint32.from_address(address).value = value & 0xFFFFFFFF
    return 0


def _driver_wait(stream, address, value, flush=False):
    assert flush, "a stream wait for peers' rows flushes their writes where the device can"
    return _wait(stream, address, value)


def _wait(stream, address, value):
    word = ctypes.c_uint32.from_address(address).value
    if ((word - value) & 0xFFFFFFFF) >= 1 << 31:
        raise _Unreached(f"the word at {address:#x} holds {word}, the stream waits for {value}")
    return 0


class _HostKernels:
    """The AGRS module's kernels with their meaning on the host, run from their launch arguments
    as the device reads them (the windows' bases from the storage, not from the moves' addresses)."""

    def __init__(self, rank: int, num_ranks: int, storage: torch.Tensor) -> None:
        self.rank, self.num_ranks = rank, num_ranks
        self.bases = [storage.data_ptr() + peer * WINDOW_BYTES for peer in range(num_ranks)]

    def function(self, name: str):
        return types.SimpleNamespace(launch=lambda grid, block, args, stream=None, device=None:
                                     self._run(name, grid, block, args))

    def _run(self, name: str, grid: int, block: int, args: tuple) -> None:
        constants = gpu_agrs.AGRS_CONSTANTS
        if name == modules.AGRS_WAIT_KERNEL:
            wait = args[1]
            assert (grid, block) == (1, constants["kAgrsThreads"])
            assert wait.phase in (gpu_agrs._PHASE_ENTERED, gpu_agrs._PHASE_CALL) and wait.timeout_ns > 0
            for peer in range(self.num_ranks):
                _wait(None, wait.row + 4 * peer, wait.session)
        elif name == modules.AGRS_FLAGS_KERNEL:
            flags = args[1]
            for peer in range(self.num_ranks):
                _write(None, self.bases[peer] + flags.row_offset + 4 * self.rank, flags.session)
        else:
            assert name == modules.AGRS_COPY_KERNEL and block == constants["kAgrsCopyThreads"]
            dst, src, num_bytes = (arg.value for arg in args[1:])
            assert grid == gpu_agrs.copy_blocks(num_bytes, SM_LIMIT) and num_bytes > 0
            _memmove(dst, src, num_bytes, None)


@pytest.fixture(params=["driver operations", "kernels"])
def host_driver(monkeypatch, request):
    """The driver's and the kernels' meaning on the host; True when the moves use the kernels (as
    emulated ranks do; for `_ranks`)."""
    stream = types.SimpleNamespace(cuda_stream=0)
    monkeypatch.setattr(gpu_agrs, "memcpy_async", _memmove)
    monkeypatch.setattr(gpu_agrs, "stream_write_u32", _write)
    monkeypatch.setattr(gpu_agrs, "stream_wait_u32", _driver_wait)
    monkeypatch.setattr(gpu_agrs, "can_flush_remote_writes", lambda device_index: True)
    monkeypatch.setattr(gpu_errors, "enter_context", lambda device: None)
    monkeypatch.setattr(gpu_errors, "leave_context", lambda previous: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return request.param == "kernels"


def _ranks(num_ranks: int, session_bytes: int, by_kernels: bool) -> list:
    """Every rank's moves over windows of one host allocation, configured (header zeroed)."""
    storage = torch.zeros(num_ranks * WINDOW_BYTES, dtype=torch.uint8)
    windows = types.SimpleNamespace(storage=storage)
    out = []
    for rank in range(num_ranks):
        transport = types.SimpleNamespace(
            windows=windows, num_bytes=WINDOW_BYTES,
            window_tensor=lambda rank=rank: storage[rank * WINDOW_BYTES:(rank + 1) * WINDOW_BYTES])
        backend = types.SimpleNamespace(rank=rank, num_ranks=num_ranks, device=torch.device("cpu"), emulated=True,
                                        transport=transport, calls=0, broken=None,
                                        call_record=types.SimpleNamespace(launched_call=0),
                                        raise_if_broken=lambda: None, transport_args=None, timeout_ns=10**9,
                                        err_record=types.SimpleNamespace(words=[0] * 4, device_ptr=0),
                                        _sm_limit=SM_LIMIT)
        kernels = _HostKernels(rank, num_ranks, storage)
        backend.module = lambda kind, structure, kernels=kernels: kernels
        moves = gpu_agrs.GPUAgrsMoves(backend)
        moves.by_kernels = by_kernels
        moves.peers = moves._read_peers(None)
        moves.configured_call = 0
        space = moves._window_view(moves.space_offset, session_bytes)
        out.append((moves, types.SimpleNamespace(index=0, num_ops=0, offset=0, space=space)))
    return out


def _room(num_ranks: int, num_bytes: int) -> int:
    return -(-num_ranks * num_bytes // 32) * 32


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_moves_place_every_byte_and_flag(host_driver, num_ranks):
    gather_specs = [((5, 7), torch.float32), ((3,), torch.uint8), ((), torch.float64), ((0, 4), torch.bfloat16)]
    in_place_spec = ((4, 6), torch.bfloat16)
    scatter_specs = [((2 * num_ranks, 9), torch.bfloat16), ((num_ranks, 5), torch.float32)]
    ranks = _ranks(num_ranks, 8192, host_driver)
    for session_index in (1, 2):   # the second session reuses the space and the flag rows
        seed = 1000 * session_index
        gather_in = [[_tensor((seed, rank, i), *spec) for i, spec in enumerate(gather_specs)]
                     for rank in range(num_ranks)]
        scatter_in = [[_tensor((seed, rank, 50 + i), *spec) for i, spec in enumerate(scatter_specs)]
                      for rank in range(num_ranks)]
        slot_in = [_tensor((seed, rank, 99), *in_place_spec) for rank in range(num_ranks)]
        for moves, session in ranks:
            session.space.fill_(0xFF)
            session.index, session.num_ops, session.offset = session_index, 0, 0
            moves.begin_session(session_index)
        gather_sizes = [tensor.numel() * tensor.element_size() for tensor in gather_in[0]]
        gather_offsets = [sum(_room(num_ranks, size) for size in gather_sizes[:i]) for i in range(len(gather_sizes))]
        slot_bytes = slot_in[0].numel() * slot_in[0].element_size()
        slot_offset = sum(_room(num_ranks, size) for size in gather_sizes)
        scatter_offset = slot_offset + _room(num_ranks, slot_bytes)
        scatter_sizes = [tensor.numel() * tensor.element_size() // num_ranks for tensor in scatter_in[0]]
        scatter_offsets = [scatter_offset + sum(_room(num_ranks, size) for size in scatter_sizes[:i])
                           for i in range(len(scatter_sizes))]
        waits, outputs = [], []
        for rank, (moves, session) in enumerate(ranks):
            rank_waits = [moves.all_gather(session, gather_in[rank], gather_offsets, [False] * len(gather_specs), 0)]
            session.num_ops = 1
            slot = session.space[slot_offset + rank * slot_bytes:slot_offset + (rank + 1) * slot_bytes]
            slot.view(in_place_spec[1]).copy_(slot_in[rank].reshape(-1))
            rank_waits.append(moves.all_gather(session, [slot.view(in_place_spec[1]).view(in_place_spec[0])],
                                               [slot_offset], [True], 0))
            session.num_ops = 2
            reduced, wait = moves.reduce_scatter(session, scatter_in[rank], scatter_offsets, rank % 2 == 1, 0)
            rank_waits.append(wait)
            session.num_ops = 3
            waits.append(rank_waits)
            outputs.append(reduced)
        if num_ranks > 1:   # a flag of a call nobody made is not raised
            with pytest.raises(_Unreached):
                gpu_agrs.GPUAgrsMoves._waiter(ranks[0][0], ranks[0][1], gpu_agrs._FLAG_ROW + 3, "test")()
        for rank, rank_waits in enumerate(waits):
            for wait in reversed(rank_waits):   # out of order
                wait()
            space = ranks[rank][1].space
            for index, (offset, size) in enumerate(zip(gather_offsets, gather_sizes)):
                got = space[offset:offset + size * num_ranks]
                expected = torch.stack([gather_in[src][index] for src in range(num_ranks)])
                assert torch.equal(got, expected.reshape(-1).view(torch.uint8)), (session_index, rank, index)
            got = space[slot_offset:slot_offset + slot_bytes * num_ranks]
            assert torch.equal(got, torch.stack(slot_in).reshape(-1).view(torch.uint8))
            for index, output in enumerate(outputs[rank]):
                expected = _reduce_reference([scatter_in[src][index] for src in range(num_ranks)], rank, rank % 2 == 1)
                assert torch.equal(output.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


def test_a_call_waits_for_every_rank_to_enter_the_session(host_driver):
    (first, first_session), (second, second_session) = _ranks(2, 1024, host_driver)
    first_session.index = second_session.index = 1
    first.begin_session(1)
    # rank 1 has not entered: rank 0 must not write into its space yet
    with pytest.raises(_Unreached):
        first.all_gather(first_session, [torch.ones(4)], [0], [False], 0)
    second.begin_session(1)
    wait = first.all_gather(first_session, [torch.ones(4)], [0], [False], 0)
    with pytest.raises(_Unreached):   # rank 1's data has not come
        wait()
    second.all_gather(second_session, [torch.full((4,), 2.0)], [0], [False], 0)()
    wait = first._waiter(first_session, gpu_agrs._FLAG_ROW, "all_gather")
    wait()
    assert torch.equal(first_session.space[:32].view(torch.float32), torch.tensor([1.0] * 4 + [2.0] * 4))
