"""The host side of pipeline send/recv on GPU buffers (deep_ep/backends/gpu/pp.py), without a GPU:
the window layout against the size hint, the argument struct against the kernel's, and
pp_set_config's flush (refusals on every rank, channel bookkeeping) with the kernels and the
transport stood in for. The kernels themselves run in tests/gpu/test_gpu_pp.py."""
import re
import types
from pathlib import Path

import pytest
import torch

from deep_ep import ElasticBuffer
from deep_ep.backends.gpu import CallRecord, GPUBackend
from deep_ep.backends.gpu import pp as gpu_pp

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


def _backend(monkeypatch, rank, num_ranks, reports):
    """A GPUBackend with no device: launches are recorded, the flush reads ``reports[0]``."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
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
    backend.host_read = lambda tensor, stream: sum(reports[0], [])
    return backend


def test_channels_and_the_flush(monkeypatch):
    num_ranks = 4
    rows = [[0, 0, 0, 0, 2, 2] for _ in range(num_ranks)]   # sent[2], consumed[2], slot bytes / 32, slots
    reports = [rows]
    backend = _backend(monkeypatch, 1, num_ranks, reports)
    pipeline = gpu_pp.configure(backend, None, 64, 2)
    assert [(name, args[2], args[3]) for name, _, _, args in backend.launches] == [
        ("deep_ep_pp_flush", 0, 0), ("deep_ep_pp_flush", 1, 0), ("deep_ep_pp_flush", 2, 0)]
    tensor = torch.arange(6, dtype=torch.float32)
    pipeline.send(tensor, 2, pipeline.check("pp_send", tensor, 2, 0))
    args = backend.launches[-1][3][1]
    # rank 1 -> 2: this rank's channel 1 (next), rank 2's channel 0 (from its previous rank)
    assert (args.peer, args.local_channel, args.remote_channel, args.num_bytes) == (2, 1, 0, 24)
    pipeline.recv(tensor, 0, pipeline.check("pp_recv", tensor, 0, 0))
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
    backend.err_record.words = [1, 1, 0, gpu_pp.PP_CONSTANTS["kPhasePpRecv"]]
    backend.err_record.read = lambda: tuple(backend.err_record.words)
    with pytest.raises(TimeoutError, match="rank 1: pp_recv waited for a tensor from rank 0"):
        gpu_pp.raise_errors(backend)
    with pytest.raises(RuntimeError, match="no longer usable"):
        gpu_pp.raise_errors(backend)
    backend = _backend(monkeypatch, 1, 2, [[]])
    backend.err_record.words = [gpu_pp.PP_CONSTANTS["kErrPpByteCount"], 1, 0, 24]
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
