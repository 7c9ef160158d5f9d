"""A V1 low-latency call that raises after taking a buffer half gives it back
(`deep_ep.legacy.ll_state.release_on_error`), on the CPU backend over gloo.

Errors are forced where a call has already moved its rows or made its hook: while the hook is made
(`ReceiveHook`) and after it (the call's event), for dispatch and combine, on every rank alike. After
each, no half is held and the next calls (two results alive at once, DeepEP's double buffering)
return what calls that never saw an error return. A hook pending from an earlier call keeps its half.
The GPU's split send (`deep_ep.legacy.deferred`) is checked with a stand-in receive: a call that
raises after its send launches that receive and frees the window, and the buffer's next dispatch works.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.legacy import deferred, layouts, ll_state, low_latency
from proc_utils import run_gloo_ranks
from test_legacy_low_latency import MAX_TOKENS, _equal, _expected_combine, _raw, _rank_inputs, num_experts_for

HIDDEN = 512


class _Forced(Exception):
    pass


@contextlib.contextmanager
def _raising(module, name):
    """``module.name`` raises `_Forced` when called, inside the block."""
    original = getattr(module, name)

    def fail(*args, **kwargs):
        raise _Forced(f"forced error in {name}")

    setattr(module, name, fail)
    try:
        yield
    finally:
        setattr(module, name, original)


def _expert_x(result, rank, num_local):
    """The simulated experts' outputs for a dispatch's rows: each expert scales its rows."""
    recv_x = result[0]
    return torch.stack([(recv_x[local].float() * (1 + (rank * num_local + local) % 3)).to(torch.bfloat16)
                        for local in range(num_local)])


def _check_failed_calls_hold_nothing(buffer, rank, num_ranks):
    num_experts = num_experts_for(num_ranks)
    num_local = num_experts // num_ranks
    inputs = [_rank_inputs(90, source, num_ranks, num_experts, HIDDEN) for source in range(num_ranks)]
    x, topk_idx, topk_weights = inputs[rank]

    def dispatch(use_hook):
        return buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False,
                                           return_recv_hook=use_hook)

    def combine(expert_x, handle, use_hook):
        return buffer.low_latency_combine(expert_x, topk_idx, topk_weights, handle, return_recv_hook=use_hook)

    plain = dispatch(False)
    expert_x = _expert_x(plain, rank, num_local)
    want = _expected_combine(rank, num_experts, HIDDEN, inputs, False, False)
    assert torch.equal(combine(expert_x, plain[2], False)[0], want)
    # what each call makes after its hook: a dispatch's results come from layouts.py, a combine's here
    dispatch_places = ((ll_state, "ReceiveHook"), (layouts, "EventOverlap"))
    places = ((ll_state, "ReceiveHook"), (low_latency, "EventOverlap"))
    for module, name in dispatch_places:
        for _ in range(2):                     # without the release, two failures hold both halves
            with _raising(module, name), pytest.raises(_Forced):
                dispatch(True)
            assert buffer._pending_hooks() == [None, None], name
    first, second = dispatch(True), dispatch(True)
    second[4]()
    first[4]()
    for result in (first, second):
        assert _equal(_raw(result), _raw(plain))
    for module, name in places:
        for _ in range(2):
            with _raising(module, name), pytest.raises(_Forced):
                combine(expert_x, first[2], True)
            assert buffer._pending_hooks() == [None, None], name
    combine_first, combine_second = combine(expert_x, first[2], True), combine(expert_x, second[2], True)
    combine_second[2]()
    combine_first[2]()
    assert torch.equal(combine_first[0], want) and torch.equal(combine_second[0], want)
    # a failing call leaves an earlier call's pending hook (and its half) as they were
    pending = dispatch(True)
    with _raising(layouts, "EventOverlap"), pytest.raises(_Forced):
        dispatch(True)
    assert buffer._pending_hooks()[pending[2].slot] == "low_latency_dispatch"
    assert buffer._pending_hooks()[1 - pending[2].slot] is None
    pending[4]()
    assert _equal(_raw(pending), _raw(plain)) and buffer._pending_hooks() == [None, None]


class _StandInReceive:
    """A `DeferredReceive` stand-in that counts its launches."""

    def __init__(self):
        self.launches = 0

    def launch(self):
        self.launches += 1


def _check_failed_send_launches_its_receive(buffer, rank, num_ranks):
    """`deferred.send_dispatch` on an `ElasticBuffer` whose dispatch returns a stand-in receive, in a
    call that raises after it: the receive is launched once, the window is free, the next dispatch
    works; a send whose hook went out before is left for that hook."""
    elastic = buffer._alive()
    num_experts = num_experts_for(num_ranks)
    x, topk_idx, _ = _rank_inputs(91, rank, num_ranks, num_experts, HIDDEN)
    receives = []

    def split_dispatch(*args, _phases=None, **kwargs):
        assert _phases == deferred.SEND_PHASE
        receives.append(_StandInReceive())
        return torch.zeros(1), None, None, "handle", receives[-1], None

    class Calls(ll_state.LowLatencyState):
        @ll_state.release_on_error
        def send(self, fail):
            deferred.send_dispatch(elastic, x, topk_idx, num_experts, MAX_TOKENS, 0)
            if fail:
                raise _Forced("forced error after the send")

    calls = Calls()
    elastic.dispatch = split_dispatch
    try:
        calls.send(False)
        assert elastic._window_use.holder == deferred.HOLDER and receives[0].launches == 0
        deferred.launch_receive(elastic, receives[0])
        with pytest.raises(_Forced):
            calls.send(True)
    finally:
        del elastic.dispatch
    assert [receive.launches for receive in receives] == [1, 1]
    assert elastic._window_use.holder is None and deferred.sent_since(0) == []
    recv_x = elastic.dispatch(x, topk_idx, num_experts=num_experts, num_max_tokens_per_rank=MAX_TOKENS,
                              do_expand=True, do_cpu_sync=False)[0]
    assert recv_x.shape[1] == HIDDEN


def _worker(rank, num_ranks):
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, num_ranks, num_experts_for(num_ranks))
    buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True)
    _check_failed_calls_hold_nothing(buffer, rank, num_ranks)
    _check_failed_send_launches_its_receive(buffer, rank, num_ranks)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_failed_low_latency_call_holds_no_buffer_half(world_size, tmp_path):
    run_gloo_ranks(_worker, world_size, tmp_path, deadline=120)
