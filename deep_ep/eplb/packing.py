"""The numeric core of the planner: replicate experts and pack the replicas onto GPUs.

One *problem* is: ``X`` experts with loads ``w`` (float64, >= 0), ``M >= X`` slots spread over
``G`` GPUs with exactly ``S = M / G`` slots each. Choose a replica count ``r_e >= 1`` per expert
(``sum r_e = M``) and a GPU for every replica so that the most loaded GPU carries as little as
possible; a replica carries ``w_e / r_e`` (dispatch spreads an expert's tokens evenly over its
replicas). Many problems (layers, or layers x nodes) are solved at once: every step below works on
arrays with a leading batch dimension, so the Python loops run over items and stages, never over
problems.

How a problem is solved (``balance``):

1. Replica counts come from candidate families; every candidate is packed (step 2) and searched
   for a few rounds, and the best one per problem is then searched to the end:

   A. *greedy*: split the expert with the highest per-replica load, ``M - X`` times (the classical
      rule; it minimises the largest replica), and the same rule stopped after three quarters of
      the splits, the remaining slots given to the coldest experts (their replicas carry almost
      nothing: in effect, empty slots). With a fixed number of slots per GPU, splitting a hot
      expert ``G + 1`` times, say, forces two of its replicas onto one GPU; stopping earlier
      avoids that.
   B. the greedy rule stopped after other numbers of splits (up to 9 values), and *split to fit*:
      experts in decreasing load, each split into the fewest replicas that fit into the largest
      remaining gaps below the target (and below the target + 2%);
   C. *around the target*: for the hottest few experts, every combination of ``b, b + 1, b + 2``
      replicas with ``b = max(1, floor(w / T))`` (``T`` the target load of a GPU), the rest of the
      slots to the coldest experts. This finds counts such as "hot expert 6 replicas, the next
      ones 2 and 3" that neither greedy rule reaches.

   B runs only for problems that A left above ``target * (1 + tol)``, C only for those B left.
2. Packing: longest-processing-time first (each replica, largest first, onto the least loaded
   GPU that still has a free slot; split to fit places its own), then local search: pair the
   heaviest GPU with the lightest, the second heaviest with the second lightest, ..., and in each
   pair swap the two replicas that lower the pair's maximum the most; when no pair improves, try
   the heaviest GPU against every GPU; stop when nothing improves or the maximum is within
   ``tol`` of the target. A swap never raises the maximum.

Guarantees: every expert gets at least one replica, every GPU exactly ``S`` slots, replica counts
sum to ``M``; the result is never worse than replicate-greedily-then-LPT (candidate A); it is
deterministic for a given input.
"""
from __future__ import annotations

import itertools

import numpy as np

__all__ = ["balance", "pack_fixed"]

#: Relative distance to the target below which a problem counts as solved.
DEFAULT_TOL = 5e-3
#: Work limit of stage C: candidates x slots summed over its problems.
_STAGE_C_BUDGET = 300_000
#: Local-search rounds given to each candidate before the best one per problem is searched to the end.
SCREEN_ROUNDS = 4


def _greedy_picks(w: np.ndarray, steps: int) -> np.ndarray:
    """``[B, steps]``: the expert split at each step of the greedy rule (highest per-replica load)."""
    B, X = w.shape
    counts = np.ones((B, X))
    picks = np.empty((B, steps), dtype=np.int64)
    rows = np.arange(B)
    for s in range(steps):
        pick = np.argmax(w / counts, axis=1)
        picks[:, s] = pick
        counts[rows, pick] += 1
    return picks


def _add_cold(counts: np.ndarray, coldest: np.ndarray, extra: np.ndarray) -> None:
    """Give ``extra[b]`` more replicas to the coldest experts of problem ``b``, one each (cycling)."""
    B, X = counts.shape
    top = int(extra.max(initial=0))
    if top == 0:
        return
    pos = np.arange(top)
    use = pos[None, :] < extra[:, None]
    rows, cols = np.nonzero(use)
    np.add.at(counts, (rows, coldest[rows, cols % X]), 1)


def _counts_from_picks(picks: np.ndarray, k: int, coldest: np.ndarray, X: int) -> np.ndarray:
    B, spare = picks.shape
    counts = np.ones((B, X), dtype=np.int64)
    if k:
        np.add.at(counts, (np.repeat(np.arange(B), k), picks[:, :k].reshape(-1)), 1)
    _add_cold(counts, coldest, np.full(B, spare - k))
    return counts


def _expand(counts: np.ndarray, M: int) -> np.ndarray:
    """``[B, M]`` expert id of every replica (experts in order, each repeated ``counts`` times)."""
    B, X = counts.shape
    ids = np.tile(np.arange(X), B)
    return np.repeat(ids, counts.reshape(-1)).reshape(B, M)


def _lpt(load: np.ndarray, G: int, S: int) -> np.ndarray:
    """``[B, G * S]`` item index in every slot: largest item first onto the least loaded GPU with room."""
    B, M = load.shape
    order = np.argsort(-load, axis=1, kind="stable")
    bin_load = np.zeros((B, G))
    fill = np.zeros((B, G), dtype=np.int64)
    slot_item = np.empty((B, G * S), dtype=np.int64)
    rows = np.arange(B)
    for j in range(M):
        item = order[:, j]
        g = np.where(fill < S, bin_load, np.inf).argmin(axis=1)
        slot_item[rows, g * S + fill[rows, g]] = item
        bin_load[rows, g] += load[rows, item]
        fill[rows, g] += 1
    return slot_item


def _swap_in(slot_load, slot_expert, b, g1, s1, g2, s2) -> None:
    tmp = slot_load[b, g1, s1].copy()
    slot_load[b, g1, s1] = slot_load[b, g2, s2]
    slot_load[b, g2, s2] = tmp
    tmp = slot_expert[b, g1, s1].copy()
    slot_expert[b, g1, s1] = slot_expert[b, g2, s2]
    slot_expert[b, g2, s2] = tmp


def _best_swaps(a, la, b, lb):
    """Best swap between GPU sets ``a`` (``[A, P, S]`` slot loads, totals ``la [A, P]``) and ``b``:
    ``(gain [A, P], slot in a, slot in b)``; the gain is how much the pair's maximum drops."""
    S = a.shape[-1]
    d = a[..., :, None] - b[..., None, :]
    # The pair's new maximum is max(la - d, lb + d); its drop from la is min(d, la - lb - d).
    gain = np.minimum(d, (la - lb)[..., None, None] - d).reshape(*la.shape, S * S)
    best = gain.argmax(axis=-1)
    return np.take_along_axis(gain, best[..., None], -1)[..., 0], best // S, best % S


def _improve(slot_load: np.ndarray, slot_expert: np.ndarray, stop: np.ndarray, rounds: int | None = None) -> None:
    """Local search by pairwise swaps, in place (``slot_load``/``slot_expert``: ``[B, G, S]``); at
    most ``rounds`` rounds (None: until no swap improves)."""
    B, G, S = slot_load.shape
    if G < 2 or S == 0:
        return
    H = G // 2
    active = np.arange(B)
    # A round lowers the sorted GPU loads of every problem it changes, so the search ends; the cap
    # bounds its time.
    for _ in range(8 * G + 64 if rounds is None else rounds):
        if active.size == 0:
            return
        sub = slot_load[active]
        loads = sub.sum(axis=2)
        keep = loads.max(axis=1) > stop[active]
        active, sub, loads = active[keep], sub[keep], loads[keep]
        if active.size == 0:
            return
        A = active.size
        rows = np.arange(A)[:, None]
        order = np.argsort(-loads, axis=1, kind="stable")
        hi, lo = order[:, :H], order[:, ::-1][:, :H]
        gain, sa, sb = _best_swaps(sub[rows, hi], loads[rows, hi], sub[rows, lo], loads[rows, lo])
        ok = gain > 1e-12 * np.maximum(loads[rows, hi], 1e-300)
        moved = ok.any(axis=1)
        if ok.any():
            p, h = np.nonzero(ok)
            _swap_in(slot_load, slot_expert, active[p], hi[p, h], sa[p, h], lo[p, h], sb[p, h])
        # Problems no pair improved: the heaviest GPU against every other GPU.
        stuck = np.nonzero(~moved)[0]
        if stuck.size:
            top = order[stuck, 0]
            srows = np.arange(stuck.size)
            heavy = sub[stuck, top][:, None, :].repeat(G, axis=1)
            lt = loads[stuck, top][:, None].repeat(G, axis=1)
            gain, sa, sb = _best_swaps(heavy, lt, sub[stuck], loads[stuck])
            gain[srows, top] = -np.inf
            j = gain.argmax(axis=1)
            g = gain[srows, j]
            ok2 = g > 1e-12 * np.maximum(lt[:, 0], 1e-300)
            q = np.nonzero(ok2)[0]
            if q.size:
                _swap_in(slot_load, slot_expert, active[stuck[q]], top[q], sa[q, j[q]], j[q], sb[q, j[q]])
            moved[stuck[q]] = True
        active = active[moved]


def _lpt_slots(w: np.ndarray, counts: np.ndarray, G: int, S: int) -> np.ndarray:
    """LPT packing of replicas with the given counts: ``slot_expert [B, G*S]``."""
    expert = _expand(counts, G * S)
    slot_item = _lpt(np.take_along_axis(w / counts, expert, 1), G, S)
    return np.take_along_axis(expert, slot_item, 1)


def _finish(w, counts, slot_expert, G, S, stop, rounds):
    """Local search from a packing: ``(slot_expert [B, G*S], max GPU load [B])``."""
    B = w.shape[0]
    slot_load = np.take_along_axis(w / counts, slot_expert, 1).reshape(B, G, S)
    slot_expert = slot_expert.reshape(B, G, S).copy()
    _improve(slot_load, slot_expert, stop, rounds)
    return slot_expert.reshape(B, G * S), slot_load.sum(axis=2).max(axis=1)


def _split_fit(w: np.ndarray, M: int, G: int, target: np.ndarray):
    """Split to fit (family B of the module docstring): ``(counts [B, X], slot_expert [B, M])``."""
    B, X = w.shape
    S = M // G
    rows = np.arange(B)
    order = np.argsort(-w, axis=1, kind="stable")
    gap = np.repeat(target[:, None].astype(np.float64), G, 1)
    free = np.full((B, G), S, dtype=np.int64)
    spare = np.full(B, M - X, dtype=np.int64)
    slot_expert = np.full((B, G, S), -1, dtype=np.int64)
    counts = np.zeros((B, X), dtype=np.int64)
    r_all = np.arange(1, G + 1)
    for j in range(X):
        e = order[:, j]
        x = w[rows, e]
        open_gap = np.where(free > 0, gap, -np.inf)
        by_gap = np.argsort(-open_gap, axis=1, kind="stable")
        gaps = np.take_along_axis(open_gap, by_gap, 1)
        allowed = r_all[None, :] <= np.minimum(spare + 1, (free > 0).sum(axis=1))[:, None]
        over = x[:, None] / r_all[None, :] - gaps
        fits = (over <= 0) & allowed
        r = np.where(fits.any(axis=1), fits.argmax(axis=1),
                     np.where(allowed, over, np.inf).argmin(axis=1)) + 1
        b, pos = np.nonzero(r_all[None, :] <= r[:, None])
        g = by_gap[b, pos]
        gap[b, g] -= (x / r)[b]
        slot_expert[b, g, S - free[b, g]] = e[b]
        free[b, g] -= 1
        spare -= r - 1
        counts[rows, e] = r
    # Slots left over: replicas of the coldest experts, in the GPUs that still have room.
    b, g, s = np.nonzero(slot_expert < 0)
    if b.size:
        starts = np.r_[0, np.nonzero(np.diff(b))[0] + 1]
        nth = np.arange(b.size) - np.repeat(starts, np.diff(np.r_[starts, b.size]))
        e = order[b, X - 1 - (nth % X)]
        slot_expert[b, g, s] = e
        np.add.at(counts, (b, e), 1)
    return counts, slot_expert.reshape(B, M)


def _target_counts(w: np.ndarray, spare: int, target: np.ndarray, m: int):
    """Family C of the module docstring: ``(problem index [N], counts [N, X])`` around ``w / target``."""
    B, X = w.shape
    order = np.argsort(-w, axis=1, kind="stable")
    top = order[:, :m]
    x = np.take_along_axis(w, top, 1) / np.maximum(target, 1e-300)[:, None]
    base = np.maximum(np.floor(x), 1)[..., None]
    choices = np.minimum(base + np.arange(3), spare + 1).astype(np.int64)  # [B, m, 3]
    combos = np.array(list(itertools.product(range(3), repeat=m)), dtype=np.int64)  # [C, m]
    picked = choices[:, np.arange(m)[None, :], combos]                   # [B, C, m]
    used = (picked - 1).sum(axis=2)
    ok = used <= spare
    b, c = np.nonzero(ok)
    counts = np.ones((b.size, X), dtype=np.int64)
    np.put_along_axis(counts, top[b], picked[b, c], 1)
    coldest = order[b][:, ::-1]
    _add_cold(counts, coldest, spare - used[b, c])
    # Distinct candidates only (many combinations coincide after the caps).
    key = np.concatenate([b[:, None], counts], axis=1)
    _, first = np.unique(key, axis=0, return_index=True)
    first.sort()
    return b[first], counts[first]


def balance(w: np.ndarray, M: int, G: int, target: np.ndarray, tol: float | None = None):
    """Replicate and pack a batch of problems (see the module docstring).

    Args:
        w: float64 ``[B, X]`` loads, finite and >= 0.
        M: slots per problem, ``M >= X``, a multiple of ``G``.
        G: GPUs per problem.
        target: float64 ``[B]``, the load per GPU the search aims at (at least ``w.sum(1) / G``);
            a problem is solved once its maximum is within ``tol`` of it.

    Returns:
        ``slot_expert`` int64 ``[B, M]`` (slot ``g * S + s`` is slot ``s`` of GPU ``g``; slots of a GPU
        sorted by expert id) and the maximum GPU load float64 ``[B]``.
    """
    B, X = w.shape
    S, spare = M // G, M - X
    tol = DEFAULT_TOL if tol is None else tol
    target = np.maximum(target, w.sum(axis=1) / G)
    stop = target * (1 + tol)
    coldest = np.argsort(w, axis=1, kind="stable")
    picks = _greedy_picks(w, spare)
    best_slots = np.zeros((B, M), dtype=np.int64)
    best = np.full(B, np.inf)

    def consider(idx, counts, slots=None, rounds=SCREEN_ROUNDS):
        if slots is None:
            slots = _lpt_slots(w[idx], counts, G, S)
        slots, score = _finish(w[idx], counts, slots, G, S, stop[idx], rounds)
        # Several candidates of one problem may come in one call: keep the best of each.
        order = np.lexsort((score, idx))
        idx, slots, score = idx[order], slots[order], score[order]
        first = np.r_[True, idx[1:] != idx[:-1]]
        idx, slots, score = idx[first], slots[first], score[first]
        better = score < best[idx]
        best[idx[better]] = score[better]
        best_slots[idx[better]] = slots[better]

    def polish(idx):
        """Search the current best packings of ``idx`` to the end; returns the problems still above
        their stop value."""
        idx = idx[best[idx] > stop[idx]]
        if idx.size:
            counts = np.zeros((idx.size, X), dtype=np.int64)
            np.add.at(counts, (np.repeat(np.arange(idx.size), M), best_slots[idx].reshape(-1)), 1)
            best_slots[idx], best[idx] = _finish(w[idx], counts, best_slots[idx], G, S, stop[idx], None)
        return idx[best[idx] > stop[idx]]

    # Stage A: the greedy counts, and the greedy stopped at three quarters of the spare slots.
    first_ks = sorted({spare, spare - spare // 4})
    everyone = np.arange(B)
    consider(np.repeat(everyone, len(first_ks)),
             np.stack([_counts_from_picks(picks, k, coldest, X) for k in first_ks], axis=1).reshape(-1, X))
    hard = polish(everyone)
    if hard.size and spare > 0:
        ks = sorted(set(np.linspace(0, spare, min(9, spare + 1)).round().astype(int).tolist()) - set(first_ks))
        idx = np.repeat(hard, len(ks))
        counts = np.stack([_counts_from_picks(picks[hard], k, coldest[hard], X) for k in ks], axis=1).reshape(-1, X)
        slots = _lpt_slots(w[idx], counts, G, S)
        both = np.concatenate([hard, hard])
        fit_counts, fit_slots = _split_fit(w[both], M, G, np.concatenate([target[hard], target[hard] * 1.02]))
        consider(np.concatenate([idx, both]), np.concatenate([counts, fit_counts]), np.concatenate([slots, fit_slots]))
        hard = polish(hard)
    if hard.size and spare > 0:
        for m in range(min(4, X), 0, -1):
            if hard.size * 3 ** m * M <= _STAGE_C_BUDGET:
                which, counts = _target_counts(w[hard], spare, target[hard], m)
                consider(hard[which], counts)
                break
        polish(hard)
    slots = np.sort(best_slots.reshape(B, G, S), axis=2).reshape(B, M)
    return slots, best


def pack_fixed(w: np.ndarray, G: int, S: int) -> np.ndarray:
    """Pack ``G * S`` items (no replication) onto ``G`` bins of ``S`` each, balancing the sums:
    ``[B, G * S]`` item index per slot (LPT, then the same local search)."""
    B, M = w.shape
    counts = np.ones((B, M), dtype=np.int64)
    slots, _ = _finish(w, counts, _lpt_slots(w, counts, G, S), G, S, w.sum(axis=1) / G * (1 + 1e-9), None)
    return slots
