"""The split calls behind V1 low-latency receive hooks on the GPU (`deep_ep.legacy.low_latency`):
a dispatch or combine of an `ElasticBuffer` whose data kernel runs its send phase in the call and
its receive phase when the hook launches it (`deep_ep.backends.gpu.modules.launch_send_phase`).

Contract: `send_dispatch` / `send_combine` are `ElasticBuffer.dispatch` / `combine` as the V1 layer
calls them (synchronous, on the caller's stream order) with their private ``_phases`` set to the
send phase; they return the `DeferredReceive` too and hold the buffer's window until
`launch_receive`, so that no other call of the buffer (dispatch, combine, a primitive) runs between
the two halves: every such call raises `RuntimeError` naming the pending receive. The receive is
not a call of its own: it keeps the send's call number and tag, so ranks may call their hooks at
different times. `sent_since` lists the sends whose receive is still to launch (a V1 call that
fails before handing its hook over launches its own: `deep_ep.legacy.ll_state.release_on_error`).
"""
from __future__ import annotations

import weakref

from .. import call_streams
from ..backends.gpu.modules import SEND_PHASE

__all__ = ["HOLDER", "send_dispatch", "send_combine", "launch_receive", "num_sends", "sent_since"]

HOLDER = "a low-latency receive hook"
_DETAIL = ("its call sent the rows and the receive waits for the hook; calling the hook that "
           "low_latency_dispatch / low_latency_combine returned ends it")

# Per buffer, ``(number, deferred)``: the receive its window is held for (one at most: the hold
# refuses a second) and the number of its send in this process (`num_sends`).
_unlaunched: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_num_sends = 0


def send_dispatch(buffer, x, topk_idx, num_experts: int, num_max_tokens_per_rank: int, num_sms: int) -> tuple:
    """A fresh, expanded dispatch without CPU sync (alignment 1) of ``x`` (a tensor, or an FP8
    ``(data, sf)`` tuple) routed by ``topk_idx`` on ``buffer`` (a GPU `ElasticBuffer`), send phase
    only. Returns ``(recv_x, handle, deferred)``: the outputs (written by the receive) and the
    handle, as `ElasticBuffer.dispatch` returns them, and the receive's `DeferredReceive`.

    Raises:
        as `ElasticBuffer.dispatch`; RuntimeError: the window is held (another hook is pending).
    """
    recv_x, _, _, handle, deferred, _ = buffer.dispatch(
        x, topk_idx, num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=1,
        num_sms=num_sms, do_cpu_sync=False, do_expand=True, _phases=SEND_PHASE)
    _hold(buffer, deferred)
    return recv_x, handle, deferred


def send_combine(buffer, x, handle, num_sms: int) -> tuple:
    """`ElasticBuffer.combine` of ``x`` (bf16, the handle's rows) with ``handle``, no weights or
    biases, send phase only. Returns ``(combined_x, deferred)``: the output (written by the
    receive) and the receive's `DeferredReceive`.

    Raises:
        as `ElasticBuffer.combine`; RuntimeError: the window is held (another hook is pending).
    """
    combined_x, _, deferred, _ = buffer.combine(x, handle, num_sms=num_sms, _phases=SEND_PHASE)
    _hold(buffer, deferred)
    return combined_x, deferred


def launch_receive(buffer, deferred) -> None:
    """Launch the receive of ``deferred`` (from `send_dispatch` / `send_combine` on ``buffer``) on
    the current stream's order, as a synchronous call's kernels go, and free the window.

    Raises:
        RuntimeError: the buffer was destroyed, or is unusable after an earlier GPU error.
    """
    _unlaunched.pop(buffer, None)
    buffer._window_use.release(HOLDER)
    buffer._alive()
    call_streams.run_call(buffer._backend, deferred.launch, None, None, False, False, ())


def num_sends() -> int:
    """How many sends this process made so far (`send_dispatch` and `send_combine`)."""
    return _num_sends


def sent_since(number: int) -> list:
    """``(buffer, deferred)`` of every send after the first ``number`` (`num_sends`) whose receive
    `launch_receive` did not launch yet."""
    return [(buffer, deferred) for buffer, (send, deferred) in list(_unlaunched.items()) if send > number]


def _hold(buffer, deferred) -> None:
    global _num_sends
    buffer._window_use.hold(HOLDER, _DETAIL)
    _num_sends += 1
    _unlaunched[buffer] = (_num_sends, deferred)
