"""Argument checks shared by the EPLB planner, replica map, load monitor and weight mover.

Every check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong value or
shape) with a message naming the argument; none communicates.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["positive_int", "as_weight", "check_plan", "Plan"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def positive_int(value, name: str, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum``; ``TypeError`` for non-integers (bool included)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def as_weight(weight) -> tuple[np.ndarray, bool]:
    """``(float64 [L, E] array, was 1-D)`` from a float or integer tensor ``[L, E]`` or ``[E]``."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype == torch.bool or weight.is_complex() or not (weight.is_floating_point()
                                                                 or weight.dtype in _INT_DTYPES):
        raise TypeError(f"weight must be a float or integer tensor, got {weight.dtype}")
    if weight.dim() not in (1, 2):
        raise ValueError(f"weight must be [num_layers, num_experts] or [num_experts], got shape "
                         f"{tuple(weight.shape)}")
    squeezed = weight.dim() == 1
    w = weight.detach().to("cpu", torch.float64).reshape(1 if squeezed else weight.shape[0], -1).numpy()
    if w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"weight must have at least one layer and one expert, got shape {tuple(weight.shape)}")
    if not np.isfinite(w).all():
        raise ValueError("weight contains NaN or infinite loads")
    if (w < 0).any():
        raise ValueError(f"weight contains negative loads (min {w.min()})")
    return w, squeezed


class Plan:
    """A checked plan on the CPU: int64 ``physical_to_logical [L, N]``, ``logical_to_physical
    [L, E, R]``, ``logical_count [L, E]`` (numpy), whether it was given without the layer dimension."""

    def __init__(self, p2l: np.ndarray, l2p: np.ndarray, count: np.ndarray, squeezed: bool):
        self.physical_to_logical, self.logical_to_physical, self.logical_count = p2l, l2p, count
        self.squeezed = squeezed
        self.num_layers, self.num_replicas = p2l.shape
        self.num_experts, self.max_replicas = l2p.shape[1:]


def _int_array(t, name: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (int64), got {t.dtype}")
    return t.detach().to("cpu", torch.int64).numpy()


def check_plan(physical_to_logical, logical_to_physical, logical_count, *, num_experts=None,
               num_replicas=None, num_layers=None) -> Plan:
    """Check that the three tensors of :func:`deep_ep.eplb.rebalance_experts` form one consistent
    plan: ``[L, N]``, ``[L, E, R]``, ``[L, E]`` (or all three without the layer dimension); every
    physical slot holds a logical expert in ``[0, E)``; ``logical_count`` counts them (each >= 1);
    ``logical_to_physical[l, e, :count]`` lists exactly the slots holding ``e``, -1 after them.
    The optional keywords are the shape the caller expects (a plan for another model or EP size is
    rejected with a message saying which dimension differs). Reads GPU tensors back to the host."""
    p2l = _int_array(physical_to_logical, "physical_to_logical")
    l2p = _int_array(logical_to_physical, "logical_to_physical")
    cnt = _int_array(logical_count, "logical_count")
    squeezed = p2l.ndim == 1
    if squeezed:
        if l2p.ndim != 2 or cnt.ndim != 1:
            raise ValueError("a plan without the layer dimension needs physical_to_logical [N], "
                             f"logical_to_physical [E, R], logical_count [E]; got shapes {p2l.shape}, "
                             f"{l2p.shape}, {cnt.shape}")
        p2l, l2p, cnt = p2l[None], l2p[None], cnt[None]
    if p2l.ndim != 2 or l2p.ndim != 3 or cnt.ndim != 2:
        raise ValueError("expected physical_to_logical [L, N], logical_to_physical [L, E, R], logical_count "
                         f"[L, E]; got shapes {p2l.shape}, {l2p.shape}, {cnt.shape}")
    L, N = p2l.shape
    E, R = l2p.shape[1:]
    if l2p.shape[0] != L or cnt.shape != (L, E):
        raise ValueError(f"plan tensors disagree: physical_to_logical {p2l.shape}, logical_to_physical "
                         f"{l2p.shape}, logical_count {cnt.shape}")
    for given, want, what in ((E, num_experts, "logical experts"), (N, num_replicas, "physical slots"),
                              (L, num_layers, "layers")):
        if want is not None and given != want:
            raise ValueError(f"the plan is for {given} {what}, expected {want}")
    if E == 0 or N < E or R < 1:
        raise ValueError(f"a plan needs at least one expert and one slot per expert (E={E}, N={N}, R={R})")
    if p2l.min() < 0 or p2l.max() >= E:
        raise ValueError(f"physical_to_logical holds ids outside [0, {E})")
    want_count = np.zeros((L, E), dtype=np.int64)
    np.add.at(want_count, (np.repeat(np.arange(L), N), p2l.reshape(-1)), 1)
    if not np.array_equal(cnt, want_count):
        raise ValueError("logical_count does not count the slots of physical_to_logical")
    if cnt.min() < 1:
        raise ValueError("every logical expert needs at least one replica (logical_count >= 1)")
    if cnt.max() > R:
        raise ValueError(f"logical_to_physical has {R} columns but an expert has {cnt.max()} replicas")
    used = np.arange(R)[None, None, :] < cnt[..., None]
    if (l2p[~used] != -1).any():
        raise ValueError("logical_to_physical must hold -1 after each expert's replicas")
    phys = l2p[used]
    if phys.min() < 0 or phys.max() >= N:
        raise ValueError(f"logical_to_physical holds slot ids outside [0, {N})")
    layer = np.nonzero(used)[0]
    expert = np.nonzero(used)[1]
    if not np.array_equal(p2l[layer, phys], expert):
        raise ValueError("logical_to_physical and physical_to_logical are not inverse maps")
    seen = np.zeros((L, N), dtype=np.int64)
    np.add.at(seen, (layer, phys), 1)
    if (seen != 1).any():
        raise ValueError("logical_to_physical must list every physical slot exactly once")
    return Plan(p2l, l2p, cnt, squeezed)
