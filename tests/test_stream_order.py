"""The order of consecutive GPU calls whose kernels run on different streams, checked on the host
side without a GPU: `GPUBackend.enter_caller_stream` / `leave_caller_stream` / `enter_comm_stream` /
`leave_comm_stream` with recording stand-ins for the driver events.

A synchronous call on an NCCL-backed buffer launches on the caller's stream; an asynchronous one (or
one with ``previous_event`` or ``allocate_on_comm_stream``) on the buffer's communication stream. A
call must still start after the previous call's kernels, wherever they ran (DeepEP's calls are
ordered by sharing one stream), without waiting for later work on that stream."""
from types import SimpleNamespace

import pytest
import torch

from deep_ep.backends.gpu import GPUBackend

COMM, S1, S2 = 1000, 11, 22


class Events:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self, waiter, producer):            # StreamJoin.wait: record on producer now, waiter waits
        self.log.append((self.name, "wait-now", waiter, producer))

    def record(self, producer):
        self.log.append((self.name, "record", producer))

    def wait_recorded(self, waiter):
        self.log.append((self.name, "wait-recorded", waiter))


@pytest.fixture()
def backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    log = []
    b = SimpleNamespace(comm_handle=COMM, call_stream=None, _last_stream=None,
                        stream_join=Events(log, "join"), _call_done=Events(log, "done"), log=log)
    for name in ("enter_caller_stream", "leave_caller_stream", "enter_comm_stream", "leave_comm_stream"):
        setattr(b, name, getattr(GPUBackend, name).__get__(b))
    return b


def _sync_call(b, stream):
    b.enter_caller_stream(stream)
    assert b.call_stream == stream
    b.leave_caller_stream(stream)
    assert b.call_stream is None


def _comm_call(b):
    b.enter_comm_stream()
    b.leave_comm_stream()


def test_calls_on_one_stream_add_no_waits(backend):
    for _ in range(3):
        _sync_call(backend, S1)
    assert [e for e in backend.log if e[1] != "record"] == []


def test_a_synchronous_call_after_an_asynchronous_one_waits_for_the_communication_stream(backend):
    _comm_call(backend)
    _sync_call(backend, S1)
    assert ("join", "wait-now", S1, COMM) in backend.log


def test_a_call_on_another_caller_stream_waits_for_the_end_of_the_previous_call(backend):
    _sync_call(backend, S1)
    backend.log.clear()
    _sync_call(backend, S2)
    assert backend.log[0] == ("done", "wait-recorded", S2)   # the event recorded after the S1 call
    assert backend.log[1] == ("done", "record", S2)


def test_a_communication_stream_call_after_a_caller_stream_call_waits_for_its_end(backend):
    _sync_call(backend, S1)
    backend.log.clear()
    _comm_call(backend)
    assert backend.log == [("done", "wait-recorded", COMM)]
    backend.log.clear()
    _comm_call(backend)                                      # comm after comm: stream order suffices
    assert backend.log == []


def test_nothing_is_recorded_or_waited_for_under_graph_capture(backend, monkeypatch):
    _comm_call(backend)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    backend.log.clear()
    _sync_call(backend, S1)
    _comm_call(backend)
    assert backend.log == [] and backend._last_stream is None


def test_poll_event_waits_and_times_out():
    """`deep_ep.cuda.streams.poll_event` returns True once the event completes (polled, without a
    GPU: a fake event), and False when the time limit passes first."""
    from deep_ep.cuda.streams import poll_event

    class Event:
        def __init__(self, done_after):
            self.queries, self.done_after = 0, done_after

        def query(self):
            self.queries += 1
            return self.queries > self.done_after

    ev = Event(done_after=5)
    assert poll_event(ev) is True and ev.queries == 6
    assert poll_event(Event(done_after=10 ** 9), timeout_secs=0.01) is False


def test_spin_until_spins_then_sleeps(monkeypatch):
    """`deep_ep.cuda.streams.spin_until` polls without sleeping (yielding the GIL with
    os.sched_yield) for its spin window, then sleeps between polls; it gives up at the time limit."""
    from deep_ep.cuda import streams

    calls = {"yield": 0, "sleep": 0}
    monkeypatch.setattr(streams.os, "sched_yield", lambda: calls.__setitem__("yield", calls["yield"] + 1))
    real_sleep = streams.time.sleep

    def sleep(s):
        calls["sleep"] += 1
        real_sleep(s)
    monkeypatch.setattr(streams.time, "sleep", sleep)
    monkeypatch.setattr(streams, "SPIN_SECS", 10.0)        # a window no loaded machine outlasts
    polls = iter(range(10 ** 9))
    assert streams.spin_until(lambda: next(polls) >= 200) is True
    assert calls["yield"] > 0 and calls["sleep"] == 0       # a short wait never sleeps
    polls = iter(range(10 ** 9))
    assert streams.spin_until(lambda: next(polls) >= 200, spin_secs=0.0) is True
    assert calls["sleep"] > 0                               # past the spin window it sleeps
    monkeypatch.setattr(streams, "SPIN_SECS", 0.0)
    calls["sleep"] = 0
    polls = iter(range(10 ** 9))
    assert streams.spin_until(lambda: next(polls) >= 200) is True
    assert calls["sleep"] > 0
    assert streams.spin_until(lambda: False, timeout_secs=0.01) is False
    assert streams.spin_until(lambda: True, timeout_secs=0.0) is True


def test_a_failed_call_on_the_communication_stream_still_joins_the_callers_stream(backend, monkeypatch):
    """A call on the communication stream that raises (after queuing kernels, or refused during a
    CUDA-graph capture) still orders the caller's stream after that stream: the tensors it drops are
    not reused before its kernels end, and a capture's fork is joined again."""
    from deep_ep import call_streams
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: S1, raising=False)
    backend.get_comm_stream = lambda: SimpleNamespace(cuda_stream=COMM, device_index=0)
    backend.runs_on_caller_stream = False

    def fails():
        backend.log.append(("call",))
        raise RuntimeError("refused")
    with pytest.raises(RuntimeError, match="refused"):
        call_streams.run_call(backend, fails, None, None, False, False, ())
    assert backend.log == [("join", "wait-now", COMM, S1), ("call",), ("join", "wait-now", S1, COMM)]
    assert backend._last_stream == COMM
