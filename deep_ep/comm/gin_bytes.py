"""The byte counters of the emulated GIN (`deep_ep.comm.gin`, re-exported there): what the emulated
NICs of an `deep_ep.emulated.EmulatedGroup` carried, per (source rank, destination rank).

Each buffer's `deep_ep.comm.gin.EmulatedGin` holds ``carried_bytes`` (int64 ``[R, R]``, zeroed with
the rest of its state); its NIC kernel (``kernels/gin_nic.cuh``) adds every put's bytes to the
(source, destination) entry once, when it reads the put's source. The definition matches
`deep_ep.bench.link_bytes`' ``rdma`` (docs/scaleout.md, "Bytes per domain").
"""
from __future__ import annotations

import torch

__all__ = ["byte_counters", "reset_byte_counters"]

_WAIT_SECS = 300.0


def _wait_current_stream() -> None:
    """Wait on the host, by polling an event, for the work queued so far on the current stream.

    Raises:
        TimeoutError: not done within `_WAIT_SECS`.
    """
    from ..cuda.streams import poll_event
    done = torch.cuda.Event()
    done.record()
    if not poll_event(done, _WAIT_SECS):
        raise TimeoutError(f"deep_ep.comm.gin: the current stream did not finish within {_WAIT_SECS:.0f} s")

def _gin_states(group) -> list:
    """The `EmulatedGinState` of every live buffer of ``group`` (an `deep_ep.emulated.EmulatedGroup`
    or one of its rank groups), in creation order."""
    parent = getattr(group, "parent", group)
    window_sets = getattr(parent, "_windows", None)
    if window_sets is None or not hasattr(parent, "num_nvlink_ranks"):
        raise TypeError(f"deep_ep.comm.gin: byte counters belong to an emulated group (deep_ep.emulated."
                        f"EmulatedGroup or its rank group), got {type(group).__name__}")
    with parent._lock:
        return [ws.gin_state for _, ws in sorted(window_sets.items())
                if getattr(ws, "gin_state", None) is not None]


def byte_counters(group) -> torch.Tensor:
    """Bytes the emulated GIN carried from each rank to each rank, summed over ``group``'s live buffers.

    Entry ``[i, j]`` is the sum of the byte counts of every put rank ``i`` issued to rank ``j``
    through the emulated GIN since the buffer was made (or `reset_byte_counters`): rows, forwarding
    and node slots, headers, call tags and a dispatch's count rows alike; a signal alone carries no
    bytes. The NIC adds a put's bytes once, when it reads the put's source (kernels/gin_nic.cuh).
    This is the quantity `deep_ep.bench.link_bytes` computes as ``rdma`` (with ``notify=True`` for a
    fresh dispatch). Ranks of one node exchange through the GIN only with
    ``EmulatedGinSettings(gin_within_node=True)`` in direct mode; otherwise the entries between ranks
    of one node stay 0 (their loads and stores are not counted).

    Read it when no kernel of the group is in flight (every rank synchronised its device and met the
    others at a barrier): the NIC kernels run on streams of their own.

    Args:
        group: an `deep_ep.emulated.EmulatedGroup` or one of its rank groups.

    Returns:
        int64 ``[R, R]`` CPU tensor (zeros when the group spans one node or has no live buffer).

    Raises:
        TypeError: ``group`` is not an emulated group.
    """
    parent = getattr(group, "parent", group)
    states = _gin_states(group)
    total = torch.zeros(parent.num_ranks, parent.num_ranks, dtype=torch.int64, device=torch.device("cpu"))
    if states:
        _wait_current_stream()   # poll, then copy (deep_ep.emulated: a blocking copy can stall the peers)
    for state in states:
        total += state.gin.carried_bytes.cpu()
    return total


def reset_byte_counters(group) -> None:
    """Zero `byte_counters` of ``group``'s live buffers (queued on the current stream; call it when no
    kernel of the group is in flight, as `byte_counters`).

    Raises:
        TypeError: ``group`` is not an emulated group.
    """
    for state in _gin_states(group):
        state.gin.carried_bytes.zero_()
    _wait_current_stream()   # zeroed before a later NIC kernel, on a stream of its own, can add to them
