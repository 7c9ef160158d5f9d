"""The host side of Engram on GPU buffers (deep_ep/primitives/engram.py's GPU branch and
deep_ep/backends/gpu/engram.py), without a GPU: ranks in threads, windows in host memory, and the two
kernels stood in for by Python that does what impls/engram.cuh does, through the very pointers and
argument structs the host passes. Checked, with the shards in host memory (host buffers standing for
pinned memory, reached by address) and in the windows (the default): every fetched element against
the reference (bf16 and FP8 with both factor kinds and layouts), the host shards' lifetime (a peer
still reads a shard after its owner's release; the last release frees it), the header exchange
(ranks that disagree, on the place too, raise together and keep the old table), out-of-range
indices reported by the next fetch, the window hold, the room the storage needs, and the dispatch
layout stopping before the storage. The kernels themselves run in
tests/gpu/test_gpu_engram.py."""
import ctypes
import threading
import types

import pytest
import torch

from deep_ep import ElasticBuffer
from deep_ep.backends import outputs
from deep_ep.backends.gpu import GPUBackend
from deep_ep.backends.gpu import engram as gpu_engram
from deep_ep.backends.gpu import engram_host
from deep_ep.backends.gpu import modules
from deep_ep.backends.gpu.abi import CTRL_BYTES
from deep_ep.primitives import WindowUse
from deep_ep.primitives.engram import EngramMixin, engram_fetch_reference

MIB2 = 2 * 1024 * 1024


class _MappedWords:
    """Host words standing for `errors.MappedWords`: the "device" pointer is the host address."""

    def __init__(self, device, n):
        self.buffer = (ctypes.c_int32 * n)()
        self.host_ptr = self.device_ptr = ctypes.addressof(self.buffer)

    def free(self):
        ctypes.memset(self.buffer, 0xEE, ctypes.sizeof(self.buffer))   # a read after the free shows
        self.host_ptr = self.device_ptr = 0


class _Kernels:
    """The Engram module, run by Python on the group's host windows (impls/engram.cuh's semantics)."""

    def __init__(self, windows):
        self.windows = windows
        self.launches = []
        self.host_reads = 0

    def function(self, name):
        return types.SimpleNamespace(launch=lambda grid, block, args, stream=None, device=None:
                                     self._run(name, grid, block, args))

    def _run(self, name, grid, block, args):
        assert block == gpu_engram.ENGRAM_THREADS and grid >= 1
        rank, bases = args[0], [window.data_ptr() for window in self.windows]
        self.launches.append(name)
        if name == modules.ENGRAM_STORE_KERNEL:
            offset, source, num_bytes = args[1].value, args[2], args[3].value
            assert source.numel() * source.element_size() == num_bytes
            assert 0 <= offset and offset + num_bytes <= self.windows[rank].numel()
            ctypes.memmove(bases[rank] + offset, source.data_ptr(), num_bytes)
            return
        assert name == modules.ENGRAM_GATHER_KERNEL
        gather = args[1]
        num_total = len(bases) * gather.num_entries
        for row in range(gather.num_fetched):
            index = ctypes.c_int32.from_address(gather.indices + 4 * row).value
            valid = 0 <= index < num_total
            dst = gather.out + row * gather.row_bytes
            if valid and gather.shards:   # host shards: a table of their addresses
                owner, local = divmod(index, gather.num_entries)
                self.host_reads += 1
                ctypes.memmove(dst, ctypes.c_int64.from_address(gather.shards + 8 * owner).value +
                               local * gather.row_bytes, gather.row_bytes)
            elif valid:
                owner, local = divmod(index, gather.num_entries)
                assert gather.storage_offset + (local + 1) * gather.row_bytes <= self.windows[owner].numel()
                ctypes.memmove(dst, bases[owner] + gather.storage_offset + local * gather.row_bytes, gather.row_bytes)
            else:
                ctypes.memset(dst, 0, gather.row_bytes)
                if gather.bad_index_host:
                    ctypes.c_uint64.from_address(gather.bad_index_host).value = ((index & 0xFFFFFFFF) << 32) | (row + 1)
            token, slot = divmod(row, gather.num_per_token)
            for pack in range(gather.num_sf_packs):
                value = ctypes.c_uint32.from_address(gather.sf + 4 * (index * gather.num_sf_packs + pack)).value if valid else 0
                where = token * gather.sf_token_stride + (slot * gather.num_sf_packs + pack) * gather.sf_column_stride
                ctypes.c_uint32.from_address(gather.out_sf + 4 * where).value = value


@pytest.fixture
def no_cuda(monkeypatch):
    """torch.cuda's streams and events, pinned memory and mapped words, stood in for."""
    stream = types.SimpleNamespace(cuda_stream=0, wait_event=lambda event: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda stream=None: None,
                                                                          query=lambda: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(gpu_engram, "MappedWords", _MappedWords)
    monkeypatch.setattr(engram_host, "MappedWords", _MappedWords)   # the host shards of one process
    monkeypatch.setattr(gpu_engram, "copy_bytes", lambda device, address, source, stream: ctypes.memmove(
        address, source.data_ptr(), source.numel() * source.element_size()))


def _buffers(num_ranks, num_bytes, num_cpu_bytes):
    """One `ElasticBuffer` per rank over a `GPUBackend` with host windows and the Python kernels."""
    windows = [torch.zeros(num_bytes, dtype=torch.uint8) for _ in range(num_ranks)]
    kernels = _Kernels(windows)
    barrier = threading.Barrier(num_ranks, timeout=30)
    buffers = []
    for rank in range(num_ranks):
        backend = GPUBackend.__new__(GPUBackend)
        backend.rank, backend.num_ranks, backend.emulated, backend.calls = rank, num_ranks, True, 0
        backend._device, backend.num_device_sms, backend.broken = torch.device("cpu"), 132, None
        backend.config = types.SimpleNamespace(num_cpu_bytes=num_cpu_bytes, num_cpu_timeout_secs=30, num_topk=0)
        backend.transport = types.SimpleNamespace(num_bytes=num_bytes, host_barrier=barrier.wait)
        backend.transport_args = rank
        backend.spin_secs, backend.comm_stream = 0, types.SimpleNamespace(cuda_stream=0)
        backend.err_record = types.SimpleNamespace(words=[0] * 4)
        backend.module = lambda kind, structure: kernels
        backend.host_read = lambda tensor, stream: tensor.tolist()
        backend._layouts = {}
        buffer = ElasticBuffer.__new__(ElasticBuffer)
        buffer._destroyed, buffer._backend, buffer._engram = False, backend, None
        buffer.rank_idx, buffer.num_ranks, buffer.num_cpu_bytes = rank, num_ranks, num_cpu_bytes
        buffer.config = types.SimpleNamespace(num_bytes=num_bytes)
        buffer._window_use = WindowUse()
        buffers.append(buffer)
    return buffers, kernels


def _release(buffers):
    """What `ElasticBuffer.destroy` does for Engram: wait for the last fetch, free the mapped word."""
    for buffer in buffers:
        table = buffer._engram
        EngramMixin._release_primitives(buffer)
        assert buffer._engram is None and (table is None or table.bad_index.host_ptr == 0)
        buffer._destroyed = True


def _on_ranks(buffers, body):
    """``body(buffer)`` in one thread per rank; re-raises the first failure."""
    results, failures = [None] * len(buffers), []

    def worker(rank):
        try:
            results[rank] = body(buffers[rank])
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(len(buffers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return results


def _random_bits(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8,
                         generator=generator).view(dtype)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _check(result, table, sf_table, indices, col_major):
    want = engram_fetch_reference(table, sf_table, indices, col_major)
    assert result[0].shape == want[0].shape and torch.equal(_bits(result[0]), _bits(want[0]))
    if sf_table is None:
        assert result[1] is None
    else:
        assert result[1].stride() == want[1].stride() and torch.equal(_bits(result[1]), _bits(want[1]))


FORMATS = ((torch.bfloat16, 24, None, 0), (torch.bfloat16, 33, None, 0), (torch.float8_e4m3fn, 128, torch.float32, 3),
           (torch.float8_e4m3fn, 50, torch.int32, 2))


@pytest.mark.parametrize("location", ["host", "device"])
@pytest.mark.parametrize("num_ranks", [1, 3])
def test_fetch_write_and_refusals(no_cuda, num_ranks, location):
    num_entries, num_per_token = 10, 3
    buffers, kernels = _buffers(num_ranks, 2 * MIB2, MIB2)
    num_total = num_ranks * num_entries

    def body(buffer):
        rank = buffer.rank_idx
        for position, (dtype, hidden, sf_dtype, packs) in enumerate(FORMATS):
            table = _random_bits((num_total, hidden), dtype, 10 * position)
            sf_table = None if sf_dtype is None else _random_bits((num_total, packs), sf_dtype, 10 * position + 1)
            storage = table[rank * num_entries:(rank + 1) * num_entries].clone()
            buffer.engram_write(storage, sf=None if sf_table is None else sf_table.clone(), storage_location=location)
            storage.view(torch.uint8).fill_(0xAB)
            for num_tokens in (1, 5, 7 + rank):
                indices = torch.randint(0, num_total, (num_tokens, num_per_token), dtype=torch.int32,
                                        generator=torch.Generator().manual_seed(num_tokens + rank))
                for col_major in ((False, True) if sf_table is not None else (False,)):
                    with outputs.poisoned():
                        hook = buffer.engram_fetch(indices, use_tma_aligned_col_major_sf=col_major)
                    with pytest.raises(RuntimeError, match="earlier fetch's hook has not been called"):
                        buffer.engram_fetch(indices)
                    result = hook()
                    assert buffer._window_use.holder is None and hook()[0] is result[0]
                    _check(result, table, sf_table, indices, col_major)
        # out of range: the row zeroed, the next fetch raises, the one after works
        bad = indices.clone()
        bad[1, 2] = -3
        data, sf = buffer.engram_fetch(bad)()
        assert (_bits(data.view(-1, num_per_token, hidden)[1, 2]) == 0).all() and (sf[1, 2 * packs:] == 0).all()
        with pytest.raises(ValueError, match=rf"entry -3 at flat position 5 .*\[0, {num_total}\)"):
            buffer.engram_fetch(indices)
        _check(buffer.engram_fetch(indices)(), table, sf_table, indices, False)
        if num_ranks > 1:
            # ranks that disagree raise together; the old table stays
            with pytest.raises(RuntimeError, match=r"ranks disagree on hidden: per-rank values \[8, 16, 24\]"):
                buffer.engram_write(torch.zeros(num_entries, 8 * (rank + 1), dtype=torch.bfloat16),
                                    storage_location=location)
            with pytest.raises(RuntimeError, match="ranks disagree on the values of sf"):
                buffer.engram_write(storage.fill_(1), sf=sf_table + rank, storage_location=location)
            disagree = r"ranks disagree on storage_location .*: per-rank values \[1, 0, 1\]"
            with pytest.raises(RuntimeError, match=disagree):
                buffer.engram_write(storage, sf=sf_table, storage_location=("host", "device")[rank % 2])
            _check(buffer.engram_fetch(indices)(), table, sf_table, indices, False)
        return True

    assert _on_ranks(buffers, body) == [True] * num_ranks
    assert set(kernels.launches) == {modules.ENGRAM_STORE_KERNEL, modules.ENGRAM_GATHER_KERNEL}
    assert (kernels.host_reads > 0) == (location == "host")
    # host: every rank's shard; device: those of the ranks that asked for host in the refused write
    asked_host = num_ranks if location == "host" else (num_ranks + 1) // 2 * (num_ranks > 1)
    assert len(engram_host.LocalShard._live) == asked_host
    _release(buffers)
    assert not engram_host.LocalShard._live


def test_a_host_shard_outlives_its_owner_while_a_peer_reads_it(no_cuda):
    """Rank 0 destroys its buffer; rank 1 still fetches rank 0's entries (its hold keeps them), and
    the last release frees both shards."""
    num_entries, hidden = 4, 16
    buffers, kernels = _buffers(2, 2 * MIB2, MIB2)
    table = _random_bits((2 * num_entries, hidden), torch.bfloat16, 7)
    _on_ranks(buffers, lambda buffer: buffer.engram_write(
        table[buffer.rank_idx * num_entries:(buffer.rank_idx + 1) * num_entries].clone(), storage_location="host"))
    _release(buffers[:1])
    assert len(engram_host.LocalShard._live) == 2
    indices = torch.arange(2 * num_entries, dtype=torch.int32).view(-1, 2)
    _check(buffers[1].engram_fetch(indices)(), table, None, indices, False)
    _release(buffers[1:])
    assert not engram_host.LocalShard._live


def test_storage_location_is_checked_before_any_communication(no_cuda):
    buffers, kernels = _buffers(1, 2 * MIB2, MIB2)
    storage = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"storage_location must be one of \('host', 'device'\), got 'gpu'"):
        buffers[0].engram_write(storage, storage_location="gpu")
    with pytest.raises(TypeError, match="storage_location must be a str"):
        buffers[0].engram_write(storage, storage_location=1)
    assert kernels.launches == [] and buffers[0]._engram is None or not buffers[0]._engram.written
    _release(buffers)


def test_a_window_without_room_before_the_storage_is_refused(no_cuda):
    buffers, kernels = _buffers(1, MIB2, MIB2)
    with pytest.raises(ValueError, match="bytes of window before the storage"):
        buffers[0].engram_write(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert kernels.launches == []
    _release(buffers)


def test_the_storage_sits_at_the_end_of_the_window_after_dispatch_s_rows():
    backend = GPUBackend.__new__(GPUBackend)
    backend.num_ranks, backend._layouts = 4, {}
    backend.transport = types.SimpleNamespace(num_bytes=8 * MIB2)
    backend.config = types.SimpleNamespace(num_cpu_bytes=3 * MIB2, num_topk=0)
    layout = backend.layout(4096)
    assert layout.recv_offset + 2 * layout.half_bytes <= 5 * MIB2 == gpu_engram.storage_offset(backend)
    assert gpu_engram.storage_offset(backend) - gpu_engram.HEADER_BYTES >= CTRL_BYTES
    backend.config.num_cpu_bytes, backend._layouts = 8 * MIB2, {}
    with pytest.raises(ValueError, match="leaves no window for dispatch and combine"):
        backend.layout(4096)
