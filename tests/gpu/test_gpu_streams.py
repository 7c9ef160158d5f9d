"""Stream semantics of dispatch and combine on the GPU, observed rather than assumed.

A test kernel (tests/jit_kernels/spin_copy.cu) waits `SPIN_MS` of GPU time, then overwrites a call's
input (the tokens of a dispatch, the expert outputs of a combine) with new values. Queued on some
stream right before the call, it makes the ordering visible: a call ordered after that stream
sees the new values; one that is not reads the old ones. On one rank (NCCL group on GPU 0):

- default (no ``previous_event``): the call waits for the caller's current stream, the default one
  or a side stream made current;
- ``previous_event`` recorded on another stream: the call waits for that event, which the current
  stream knows nothing of; and waits for nothing else (DeepEP's contract: the event replaces the
  wait for the current stream);
- ``async_with_compute_stream``: the call returns while the communication still waits; the current
  stream is not held (it still reads the poisoned outputs) until ``event.current_stream_wait()``,
  after which it reads the results;
- ``allocate_on_comm_stream``: outputs allocated on the communication stream are right and usable on
  the current stream after the wait (synchronous and asynchronous calls).

The same kernel checks `deep_ep.emulated.wait_for_stream`: it returns only once a stream's work is
done, and times out while it is not.

A control test first shows that the spin kernel opens such a window at all. Every element is
compared with `deep_ep.reference`; outputs are poisoned (`deep_ep.backends.outputs.poisoned`)
wherever the poison fill is ordered before the kernels (not when it would be queued behind a spin on
the current stream: there fresh inputs and routing make every output new). Skipped without a CUDA
device, except the kernel's NVRTC compile check.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from deep_ep import jit  # noqa: E402
from deep_ep import reference as ref  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402
from gpu_cases import case_seed, handle_to_cpu, random_routing, to_cpu  # noqa: E402

KERNEL = Path(__file__).resolve().parents[1] / "jit_kernels" / "spin_copy.cu"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN, EXPERTS, TOPK, TOKENS = 512, 16, 4, 128
SPIN_MS = 100     # far longer than the host needs to issue a call after the spin was queued
OPS = ("dispatch", "dispatch-nosync", "cached-dispatch", "combine")
ASYNC_OPS = ("dispatch-nosync", "cached-dispatch", "combine")   # no host synchronisation inside the call


def _spin_function():
    return jit.build("spin_copy", KERNEL.read_text()).function("spin_then_copy")


def spin_then_copy(dst: torch.Tensor, src: torch.Tensor, stream, ms: float = SPIN_MS) -> None:
    """Queue on ``stream``: wait ``ms`` milliseconds of GPU time, then ``dst <- src`` (same bytes).
    ``src`` must stay alive until the stream has run it."""
    assert dst.is_contiguous() and src.is_contiguous() and dst.nbytes == src.nbytes and dst.nbytes % 4 == 0
    words = dst.nbytes // 4
    # A few blocks: the SMs stay free for the kernels under test (cooperative ones need all theirs resident).
    _spin_function().launch(max(1, min(8, (words + 255) // 256)), 256,
                            (src, dst, jit.i64(words), jit.u64(int(ms * 1e6))), stream=stream)


def event_after(buf, stream) -> deep_ep.EventOverlap:
    """An event for ``previous_event`` that completes with the work queued on ``stream`` so far.

    `ElasticBuffer.capture()` made current on ``stream`` gives it where it returns an event (DeepEP's
    API: an event recorded on the current stream); otherwise it is an `EventOverlap` of a
    `torch.cuda.Event` recorded there. The one place to adjust when that API changes."""
    with torch.cuda.stream(stream):
        captured = buf.capture()
        if isinstance(captured, deep_ep.EventOverlap) and captured.event is not None:
            return captured
        event = torch.cuda.Event()
        event.record(stream)
    return deep_ep.EventOverlap(event)


def _all_poison(t: torch.Tensor) -> bool:
    """Every byte of a floating-point tensor is the poison byte (0xFF)."""
    return bool((t.contiguous().view(torch.uint8) == 0xFF).all())


class _Armed:
    """One call's inputs, all on the device before any spin is queued (a copy queued after it on
    the current stream would itself be ordered, or not, with the call): ``x``, the input the spin
    rewrites, holding ``old`` until then; ``src`` holding ``new``; for a fresh dispatch, a routing
    of its own (``idx``, ``w``), so that no output of an earlier call can pass for this one's."""

    def __init__(self, st: "_Setup", op: str):
        self.old, self.new = st.input_for(op), st.input_for(op)
        self.idx, self.w = st.idx, st.w
        if op in ("dispatch", "dispatch-nosync"):
            self.idx, self.w = random_routing(TOKENS, EXPERTS, TOPK, st.g), torch.rand((TOKENS, TOPK), generator=st.g)
        self.x, self.src = self.old.to(st.dev), self.new.to(st.dev)
        self.idx_d, self.w_d = self.idx.to(st.dev), self.w.to(st.dev)
        torch.cuda.synchronize()


class _Setup:
    """A buffer with every module loaded, one routing and its handle (for cached dispatches and
    combines); per operation, the input it reads and the check of its outputs."""

    def __init__(self, buf, seed: int):
        self.buf, self.dev = buf, torch.device("cuda", 0)
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.idx = random_routing(TOKENS, EXPERTS, TOPK, g)
        self.w = torch.rand((TOKENS, TOPK), generator=g)
        x0 = self._x()
        _, _, _, self.handle, _ = buf.dispatch(x0.to(self.dev), self.idx.to(self.dev), self.w.to(self.dev),
                                               num_experts=EXPERTS)
        self.ref_handle = ref.reference_dispatch([x0], [self.idx], [self.w], EXPERTS,
                                                 num_max_tokens_per_rank=TOKENS)[0].handle
        self.rows = self.handle.num_recv_rows
        # warm-up: every kernel module loaded and every launch prepared before a spin is timed against
        for op in OPS:
            self.call(op, _Armed(self, op))
        torch.cuda.synchronize()
        _spin_function().handle()

    def _x(self) -> torch.Tensor:
        return torch.randn((TOKENS, HIDDEN), generator=self.g).to(torch.bfloat16)

    def input_for(self, op: str) -> torch.Tensor:
        """Fresh values of the input ``op`` reads (CPU)."""
        if op == "combine":
            return torch.randn((self.rows, HIDDEN), generator=self.g).to(torch.bfloat16)
        return self._x()

    def call(self, op: str, a: _Armed, **kw):
        """Run ``op`` on ``a.x``; returns everything the call returns."""
        b, x = self.buf, a.x
        if op == "dispatch":
            return b.dispatch(x, a.idx_d, a.w_d, num_experts=EXPERTS, **kw)
        if op == "dispatch-nosync":
            return b.dispatch(x, a.idx_d, a.w_d, num_experts=EXPERTS, do_cpu_sync=False, **kw)
        if op == "cached-dispatch":
            return b.dispatch(x, handle=self.handle, **kw)
        return b.combine(x, self.handle, **kw)

    def check(self, op: str, out, a: _Armed, x: torch.Tensor) -> None:
        """Every element of ``op``'s outputs against the reference of input ``x`` (CPU)."""
        if op == "combine":
            want = ref.reference_combine([x], [self.ref_handle])[0]
            ref.check_combine((out[0].cpu(), to_cpu(out[1])), want)
            return
        exp = ref.reference_dispatch([x], [a.idx], [a.w], EXPERTS, do_cpu_sync=op != "dispatch-nosync",
                                     num_max_tokens_per_rank=TOKENS)[0]
        if op == "cached-dispatch":
            exp.recv_topk_weights = None   # design.md: a cached non-expanded dispatch returns no weights
        ref.check_dispatch((to_cpu(out[0]), to_cpu(out[1]), to_cpu(out[2]), handle_to_cpu(out[3])), exp)


@pytest.fixture()
def setup(nccl_group, request):
    buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK)
    try:
        yield _Setup(buf, case_seed(request.node.nodeid))
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def test_spin_kernel_compiles():
    """The test kernel builds under NVRTC (also without a GPU) with no local memory."""
    mod = jit.build("spin_copy", KERNEL.read_text(), check_spills=True)
    assert mod.kernel_names() == ["spin_then_copy"]


@needs_gpu
def test_spin_opens_a_window():
    """Control: a copy on a stream that does not wait reads the old values while the spin runs, and
    the new values are there once it is done (so an unordered call would be seen)."""
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(case_seed("spin-window"))
    old, new = torch.randn(1 << 16, generator=g), torch.randn(1 << 16, generator=g)
    x, src = old.to(dev), new.to(dev)
    a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(a)
    spin_then_copy(x, src, a)
    end.record(a)
    with torch.cuda.stream(b):
        snapshot = x.clone()
    torch.cuda.synchronize()
    assert torch.equal(snapshot.cpu(), old), "the unordered copy did not run during the spin"
    assert torch.equal(x.cpu(), new), "the spin kernel did not copy"
    assert start.elapsed_time(end) >= 0.9 * SPIN_MS, f"the spin took {start.elapsed_time(end):.1f} ms"


@needs_gpu
@pytest.mark.parametrize("current", ["default-stream", "side-stream"])
@pytest.mark.parametrize("op", OPS)
def test_call_waits_for_the_current_stream(setup, op, current):
    """No poisoning here: the poison fill of an output allocated on the current stream would be
    queued behind the spin, after the point the communication stream waits for, and race with the
    kernels. Fresh inputs and routing make every output element new instead (the other tests poison)."""
    st = setup
    a = _Armed(st, op)
    stream = torch.cuda.current_stream() if current == "default-stream" else torch.cuda.Stream(st.dev)
    with torch.cuda.stream(stream):
        spin_then_copy(a.x, a.src, stream)
        out = st.call(op, a)
        st.check(op, out, a, a.new)


@needs_gpu
@pytest.mark.parametrize("op", OPS)
def test_previous_event_from_another_stream(setup, op):
    """The producer runs on a stream the current one does not wait for; only the event orders it.
    After the (synchronous) call the current stream reads the results without another wait."""
    st = setup
    a = _Armed(st, op)
    producer = torch.cuda.Stream(st.dev)
    spin_then_copy(a.x, a.src, producer)
    event = event_after(st.buf, producer)
    with outputs.poisoned():
        out = st.call(op, a, previous_event=event)
    st.check(op, out, a, a.new)


@needs_gpu
@pytest.mark.parametrize("op", OPS)
def test_previous_event_replaces_the_current_stream_wait(setup, op):
    """With ``previous_event`` the call waits for that event only (DeepEP's contract): queued behind
    an event of an idle stream, it runs before the spin on the current stream rewrote its input.
    Outputs are allocated (and poisoned) on the communication stream: the current stream is busy."""
    st = setup
    a = _Armed(st, op)
    event = event_after(st.buf, torch.cuda.Stream(st.dev))
    spin_then_copy(a.x, a.src, torch.cuda.current_stream())
    with outputs.poisoned():
        out = st.call(op, a, previous_event=event, allocate_on_comm_stream=True)
    st.check(op, out, a, a.old)
    assert torch.equal(a.x.cpu(), a.new)


@needs_gpu
@pytest.mark.parametrize("allocate_on_comm_stream", [False, True], ids=["compute-alloc", "comm-alloc"])
@pytest.mark.parametrize("op", ASYNC_OPS)
def test_async_with_compute_stream(setup, op, allocate_on_comm_stream):
    """The call returns while its communication still waits for the producer; the current stream
    is not held by it until ``current_stream_wait()``, after which it reads the results."""
    st = setup
    a = _Armed(st, op)
    producer = torch.cuda.Stream(st.dev)
    spin_then_copy(a.x, a.src, producer)
    with outputs.poisoned():
        out = st.call(op, a, previous_event=event_after(st.buf, producer), async_with_compute_stream=True,
                      allocate_on_comm_stream=allocate_on_comm_stream)
    event = out[-1]
    assert isinstance(event, deep_ep.EventOverlap)
    comm_done = torch.cuda.Event()
    comm_done.record(st.buf.get_comm_stream())
    if not allocate_on_comm_stream:
        early = out[0].clone()          # queued on the current stream, which must not wait yet
    current_free = torch.cuda.Event()
    current_free.record()
    current_free.synchronize()
    assert not comm_done.query(), "the communication finished before its producer"
    if not allocate_on_comm_stream:
        # (outputs allocated on the communication stream get their poison there, after the wait)
        assert _all_poison(early), "the current stream waited for an asynchronous call"
    event.current_stream_wait()
    st.check(op, out[:-1], a, a.new)
    producer.synchronize()


@needs_gpu
@pytest.mark.parametrize("op", OPS)
def test_allocate_on_comm_stream_synchronous(setup, op):
    st = setup
    a = _Armed(st, op)
    spin_then_copy(a.x, a.src, torch.cuda.current_stream())
    with outputs.poisoned():
        out = st.call(op, a, allocate_on_comm_stream=True)
    result = out[0].clone()             # used on the current stream right after the call
    st.check(op, (result,) + tuple(out[1:]), a, a.new)


@needs_gpu
def test_emulated_wait_for_stream_waits_and_times_out():
    """`deep_ep.emulated.wait_for_stream` returns only once the stream's work is done (a spinning
    kernel's copy is visible after it), and raises TimeoutError when the work outlasts the limit."""
    from deep_ep.emulated import wait_for_stream
    stream = torch.cuda.Stream()
    src = torch.arange(1024, dtype=torch.int32, device="cuda")
    dst = torch.full_like(src, -7)
    torch.cuda.current_stream().synchronize()
    spin_then_copy(dst, src, stream)
    wait_for_stream(stream)
    assert torch.equal(dst.cpu(), src.cpu())
    spin_then_copy(dst, src, stream, ms=300)
    with pytest.raises(TimeoutError):
        wait_for_stream(stream, timeout_secs=0.01)
    wait_for_stream(stream)
