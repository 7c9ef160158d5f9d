"""The host side of pipeline send/recv on GPU buffers (deep_ep/backends/gpu/pp.py), without a GPU:
the window layout against the size hint, the argument struct against the kernel's, pp_set_config's
flush (refusals on every rank, channel bookkeeping) and the copy-engine path's driver calls (the
words, slots and sequence numbers the kernels use too, mixing with kernels, no launch, the graph
refusals, the byte-count checks) with the kernels, the driver and the transport stood in for. The
kernels and the copy engine themselves run in tests/gpu/test_gpu_pp.py."""
import re
import types
from pathlib import Path

import pytest
import torch

from deep_ep import ElasticBuffer
from deep_ep.backends.gpu import CallRecord, GPUBackend
from deep_ep.backends.gpu import pp as gpu_pp
from deep_ep.backends.gpu import errors as gpu_errors

HEADER = Path(gpu_pp.__file__).resolve().parents[2] / "include" / "deep_ep" / "impls" / "pp.cuh"


@pytest.mark.parametrize("num_ranks", [1, 2, 8, 1024])
def test_the_rings_fit_a_window_of_the_hint(num_ranks):
    for num_bytes in (1, 32, 33, 1000, 4096, 100_000, 512 * 1024, 512 * 1024 + 1, 56 * 1024 * 1024):
        for inflight in (1, 2, 3, 16, 1000, 16384):
            hint = ElasticBuffer.get_pp_buffer_size_hint(num_bytes, inflight)
            if hint > 1 << 33:
                continue
            layout = gpu_pp.pp_layout(num_ranks, -(-num_bytes // 32) * 32, inflight)
            assert gpu_pp.PP_OFFSET >= 64 * 1024   # clear of dispatch/combine's control region
            assert layout.end <= hint, (num_bytes, inflight)
            assert layout.sizes_offset % 256 == 0 and layout.ring_offset % 256 == 0


def test_the_argument_struct_mirrors_the_kernel_s():
    body = re.search(r"struct PpArgs \{(.*?)\};", HEADER.read_text(), re.S).group(1)
    members = re.findall(r"^\s*[\w:*]+\s*\*?\s*(\w+);", body, re.M)
    assert members == [name for name, _ in gpu_pp.PpArgs._fields_]


class _Function:
    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def launch(self, grid, block, args, stream=None, device=None):
        self.launches.append((self.name, grid, block, args))


class _FakeWords:
    """Stands in for `MappedWords` (no device): plain ints the test writes as the GPU would."""

    def __init__(self, device, n):
        self.words, self.device_ptr, self.freed = [0] * n, 0x7000_0000, False

    def free(self):
        self.freed = True


def _backend(monkeypatch, rank, num_ranks, reports):
    """A GPUBackend with no device: launches are recorded, the flush reads ``reports[0]`` and window
    bases ``base(rank)``; the copy engine's driver calls are recorded in ``backend.driver_calls``."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=5))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gpu_pp, "MappedWords", _FakeWords)
    monkeypatch.setattr(gpu_errors, "enter_context", lambda device: None)
    monkeypatch.setattr(gpu_errors, "leave_context", lambda previous: None)
    driver_calls = []
    for name in ("memcpy_async", "_copy_async"):
        monkeypatch.setattr(gpu_pp, name, lambda dst, src, num_bytes, stream, name=name: driver_calls.append(
            (name, dst, src, num_bytes, stream)) or 0)
    for name in ("stream_wait_u32", "stream_write_u32"):   # a wait that flushes remote writes says so
        monkeypatch.setattr(gpu_pp, name, lambda stream, address, value, flush=False, name=name: driver_calls.append(
            (name, address, value & 0xFFFFFFFF, stream) + (("flush",) if flush else ())) or 0)
    monkeypatch.setattr(gpu_pp, "can_flush_remote_writes", lambda device_index: True)
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda stream: None,
                                                                          query=lambda: True))
    backend = GPUBackend.__new__(GPUBackend)
    backend.launches = []
    backend.rank, backend.num_ranks, backend.emulated = rank, num_ranks, True
    backend.num_device_sms, backend._sm_limit = 132, 132 // num_ranks
    backend.broken, backend.calls, backend.timeout_ns = None, 1, 10 ** 9
    backend.err_record = types.SimpleNamespace(words=[0] * 4, device_ptr=0, read=lambda: (0, 0, 0, 0))
    backend.call_record = CallRecord()
    backend.transport_args = b"\0" * 16
    backend.transport = types.SimpleNamespace(host_barrier=lambda: None)
    backend.config = types.SimpleNamespace(num_cpu_timeout_secs=1, num_gpu_timeout_secs=1)
    backend.spin_secs, backend._device = 0, torch.device("cpu")
    backend.comm_stream = types.SimpleNamespace(cuda_stream=0)
    backend.module = lambda kind, structure: types.SimpleNamespace(
        function=lambda name: _Function(backend.launches, name))
    bases = sum(([_base(peer) & 0xFFFFFFFF, _base(peer) >> 32] for peer in range(num_ranks)), [])
    backend.host_read = lambda tensor, stream: sum(reports[0], []) + bases
    backend.driver_calls = driver_calls
    return backend


def _base(rank):
    """The window base of ``rank`` the stand-in flush reports (above 4 GiB: both halves count)."""
    return 0x7F00_0000_0000 + rank * 0x1_0000_0000


def test_channels_and_the_flush(monkeypatch):
    num_ranks = 4
    rows = [[0, 0, 0, 0, 2, 2] for _ in range(num_ranks)]   # sent[2], consumed[2], slot bytes / 32, slots
    reports = [rows]
    backend = _backend(monkeypatch, 1, num_ranks, reports)
    pipeline = gpu_pp.configure(backend, None, 64, 2)
    assert [(name, args[2], args[3]) for name, _, _, args in backend.launches] == [
        ("deep_ep_pp_flush", 0, 0), ("deep_ep_pp_flush", 1, 0), ("deep_ep_pp_flush", 2, 0)]
    tensor = torch.arange(6, dtype=torch.float32)
    pipeline.send(tensor, 2, pipeline.check("pp_send", tensor, 2, 1))
    args = backend.launches[-1][3][1]
    # rank 1 -> 2: this rank's channel 1 (next), rank 2's channel 0 (from its previous rank)
    assert (args.peer, args.local_channel, args.remote_channel, args.num_bytes) == (2, 1, 0, 24)
    pipeline.recv(tensor, 0, pipeline.check("pp_recv", tensor, 0, 1))
    args = backend.launches[-1][3][1]
    assert (args.peer, args.local_channel, args.remote_channel) == (0, 0, 1)
    rows[1][1] = 1     # rank 1 sent one tensor on its channel 1 (to rank 2), which rank 2 did not take
    with pytest.raises(RuntimeError, match=r"sent and not received \(1 from rank 1 to rank 2\)"):
        gpu_pp.configure(backend, pipeline, 64, 2)
    rows[2][2] = 1     # taken on rank 2's channel 0
    gpu_pp.configure(backend, pipeline, 64, 2)
    rows[3][5] = 3
    with pytest.raises(RuntimeError, match=r"disagree on num_max_inflight_tensors: per-rank values \[2, 2, 2, 3\]"):
        gpu_pp.configure(backend, pipeline, 64, 2)
    with pytest.raises(ValueError, match="emulated ranks x num_sms=100"):
        pipeline.check("pp_recv", tensor, 0, 100)
    backend.call_record.launched_call = 5   # a dispatch since the configuration
    with pytest.raises(RuntimeError, match="ran on this buffer since the last pp_set_config"):
        pipeline.check("pp_send", tensor, 2, 0)


def test_recorded_errors_become_pp_s_exceptions(monkeypatch):
    backend = _backend(monkeypatch, 1, 2, [[]])
    backend.err_record.words = [1, 1, 0, gpu_pp.CONSTANTS["kPhasePpRecv"]]
    backend.err_record.read = lambda: tuple(backend.err_record.words)
    with pytest.raises(TimeoutError, match="rank 1: pp_recv waited for a tensor from rank 0"):
        gpu_pp.raise_errors(backend)
    with pytest.raises(RuntimeError, match="no longer usable"):
        gpu_pp.raise_errors(backend)
    backend = _backend(monkeypatch, 1, 2, [[]])
    backend.err_record.words = [gpu_pp.CONSTANTS["kErrPpByteCount"], 1, 0, 24]
    backend.err_record.read = lambda: tuple(backend.err_record.words)
    with pytest.raises(ValueError, match="rank 0 sent a tensor of 24 bytes"):
        gpu_pp.raise_errors(backend)


def test_the_rings_stay_before_the_engram_storage(monkeypatch):
    """On a GPU buffer the window's last ``num_cpu_bytes`` hold Engram's table: rings that would reach
    it are refused before any communication; the same rings fit once that space is free."""
    from deep_ep.primitives.window_use import WindowUse
    configured = []
    monkeypatch.setattr(gpu_pp, "configure", lambda backend, old, slot_bytes, inflight: configured.append(
        (slot_bytes, inflight)) or "pipeline")
    monkeypatch.setattr(ElasticBuffer, "_pp_on_gpu", lambda self, method: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    buf = ElasticBuffer.__new__(ElasticBuffer)
    buf._destroyed, buf.buffer_id, buf._window_use = False, 0, WindowUse()
    buf._backend = types.SimpleNamespace(num_ranks=2, calls=0)
    buf.config = types.SimpleNamespace(num_bytes=4 * 1024 * 1024, explicitly_destroy=True)
    slot_bytes = 512 * 1024          # two slots in each of two channels: 2 MiB of rings, past the control region
    buf.num_cpu_bytes = 2 * 1024 * 1024
    with pytest.raises(ValueError, match=r"the buffer has 2097152 \(num_bytes=4194304, less num_cpu_bytes"):
        buf.pp_set_config(slot_bytes, 2)
    assert configured == []
    buf.num_cpu_bytes = 0
    buf.pp_set_config(slot_bytes, 2)
    assert configured == [(slot_bytes, 2)]
    buf._destroyed = True            # nothing to release: the backend is a stand-in


def _configured(monkeypatch, rank, num_ranks, slot_bytes=64, num_slots=2):
    rows = [[0, 0, 0, 0, slot_bytes // 32, num_slots] for _ in range(num_ranks)]
    backend = _backend(monkeypatch, rank, num_ranks, [rows])
    return backend, gpu_pp.configure(backend, None, slot_bytes, num_slots)


def _word(rank, word):
    return _base(rank) + gpu_pp.PP_OFFSET + 4 * gpu_pp.PP_CONSTANTS[word]


def test_the_copy_engine_keeps_the_kernels_words(monkeypatch):
    """Rank 1 of 4 sends to rank 2 (its channel 1, rank 2's channel 0) and receives from rank 0 (its
    channel 0, rank 0's channel 1) with num_sms=0: absolute sequence numbers in the kernels' words,
    slot ``seq % num_slots``, a wait for the slot's previous tenant from the third send on, and no
    kernel."""
    backend, pipeline = _configured(monkeypatch, 1, 4)
    layout = pipeline.layout
    flushes = len(backend.launches)
    tensor = torch.arange(6, dtype=torch.float32)   # 24 bytes
    stream = 5

    def slot(rank, channel, seq):
        return (_base(rank) + gpu_pp.PP_OFFSET + layout.ring_offset
                + (channel * layout.num_slots + seq % layout.num_slots) * layout.slot_bytes)

    def byte_count(rank, channel, seq):
        return _base(rank) + gpu_pp.PP_OFFSET + layout.sizes_offset + 4 * (channel * layout.num_slots
                                                                           + seq % layout.num_slots)

    for seq in range(3):
        backend.driver_calls.clear()
        assert pipeline.check("pp_send", tensor, 2, 0) == 0
        pipeline.send(tensor, 2, 0)
        wait = [("stream_wait_u32", _word(1, "kPpFreed") + 4, seq + 1 - 2, stream)] if seq >= 2 else []
        assert backend.driver_calls == wait + [
            ("memcpy_async", slot(2, 0, seq), tensor.data_ptr(), 24, stream),
            ("stream_write_u32", byte_count(2, 0, seq), 24, stream),
            ("stream_write_u32", _word(2, "kPpPublished"), seq + 1, stream),
            ("stream_write_u32", _word(1, "kPpSent") + 4, seq + 1, stream)]
    checks = pipeline.byte_counts
    for seq in range(2):
        backend.driver_calls.clear()
        pipeline.recv(tensor, 0, pipeline.check("pp_recv", tensor, 0, 0))
        assert backend.driver_calls == [
            ("stream_wait_u32", _word(1, "kPpPublished"), seq + 1, stream, "flush"),   # the slot's bytes
            ("memcpy_async", tensor.data_ptr(), slot(1, 0, seq), 24, stream),
            ("_copy_async", checks.words.device_ptr + 4 * seq, byte_count(1, 0, seq), 4, stream),
            ("stream_write_u32", _word(1, "kPpConsumed"), seq + 1, stream),
            ("stream_write_u32", _word(0, "kPpFreed") + 4, seq + 1, stream)]
    assert len(backend.launches) == flushes   # no kernel
    # a kernel in between: the copy engine continues at the next sequence number
    pipeline.send(tensor, 2, pipeline.check("pp_send", tensor, 2, 2))
    assert len(backend.launches) == flushes + 1 and backend.launches[-1][1] == 1   # 24 bytes: one block
    backend.driver_calls.clear()
    pipeline.send(tensor, 2, 0)
    assert backend.driver_calls[0] == ("stream_wait_u32", _word(1, "kPpFreed") + 4, 4 + 1 - 2, stream)
    assert backend.driver_calls[-1] == ("stream_write_u32", _word(1, "kPpSent") + 4, 5, stream)


def test_an_empty_tensor_moves_no_bytes_on_the_copy_engine(monkeypatch):
    backend, pipeline = _configured(monkeypatch, 0, 1)
    empty = torch.empty((0, 3))
    pipeline.send(empty, 0, pipeline.check("pp_send", empty, 0, 0))
    pipeline.recv(empty, 0, pipeline.check("pp_recv", empty, 0, 0))
    names = [call[0] for call in backend.driver_calls]
    assert names.count("memcpy_async") == 0 and names.count("_copy_async") == 1   # the byte count still
    assert ("stream_write_u32", _word(0, "kPpPublished"), 1, 5) in backend.driver_calls


def test_the_copy_engine_gives_way_to_the_kernel_in_and_after_graphs(monkeypatch):
    backend, pipeline = _configured(monkeypatch, 0, 2)
    tensor = torch.zeros(4)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert pipeline.check("pp_send", tensor, 1, 0) == 1                # num_sms=0 in a capture: one block
    pipeline.send(tensor, 1, pipeline.check("pp_send", tensor, 1, 1))   # captured: replays move the counters
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert pipeline.check("pp_recv", tensor, 1, 0) == 1                # after it, until pp_set_config
    assert pipeline.check("pp_recv", tensor, 1, 1) == 1
    backend.call_record = CallRecord()
    rows = [[1, 0, 1, 0, 2, 2] for _ in range(2)]   # the replays' tensors were all received
    backend.host_read = lambda tensor, stream: sum(rows, []) + [0] * 4
    assert gpu_pp.configure(backend, pipeline, 64, 2).check("pp_recv", tensor, 1, 0) == 0


def test_copy_engine_byte_counts_are_checked_at_the_next_call(monkeypatch):
    backend, pipeline = _configured(monkeypatch, 1, 2)
    out = torch.zeros(6)   # 24 bytes
    for _ in range(3):
        pipeline.recv(out, 0, pipeline.check("pp_recv", out, 0, 0))
    words = pipeline.byte_counts.words.words
    assert words[:3] == [-1, -1, -1]   # not arrived yet
    words[0:2] = [24, 24]              # the GPU did the first two receives; their counts match
    pipeline.check("pp_recv", out, 0, 0)
    assert [index for index, _, _ in pipeline.byte_counts.pending] == [2]
    words[2] = 20                      # the third tensor had 20 bytes
    with pytest.raises(ValueError, match="rank 0 sent a tensor of 20 bytes, but the receiving tensor had 24"):
        pipeline.check("pp_send", out, 0, 0)
    with pytest.raises(RuntimeError, match="no longer usable"):
        pipeline.check("pp_send", out, 0, 1)


def test_byte_count_checks_reuse_a_word_only_after_its_check(monkeypatch):
    """Beyond ``capacity`` unchecked receives, the next one's count goes to the spare word
    unchecked; a word is booked again once its check is done."""
    monkeypatch.setattr(gpu_pp, "MappedWords", _FakeWords)
    checks = gpu_pp.ByteCountChecks(torch.device("cpu"), capacity=2)
    base = checks.words.device_ptr
    assert [checks.entry(8, 0, 5) for _ in range(3)] == [base, base + 4, base + 8]   # the third: spare
    assert [index for index, _, _ in checks.pending] == [0, 1]
    backend = types.SimpleNamespace(rank=0)
    checks.words.words[0] = 8
    checks.raise_mismatch(backend)
    assert [index for index, _, _ in checks.pending] == [1]
    assert checks.entry(16, 0, 5) == base and checks.words.words[0] == -1   # word 0 again, for index 2
    checks.words.words[1] = 8
    checks.words.words[0] = 12
    with pytest.raises(ValueError, match="rank 0 sent a tensor of 12 bytes, but the receiving tensor had 16"):
        checks.raise_mismatch(backend)
