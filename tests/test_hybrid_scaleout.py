"""Hybrid combine order across nodes (`deep_ep.reference`, "Hybrid order") on the CPU.

* `reference_combine(..., num_scaleup_ranks=S)` against a per-token loop written from DeepEP V2's
  recipe (rank, then scale-up group, then across: each level a float32 sum from +0.0 in slot order,
  rounded to bf16 and standing at the group's last slot; then the biases and every slot), on values
  whose float32 sums depend on the order, so that the hybrid order is shown to differ from the flat one;
  without multiple reduction (either layout) the hybrid order is the flat one.
* A gloo group of 4 acting as 2 nodes x 2 (`EP_CPU_NUM_NVLINK_RANKS=2`): combine in hybrid mode gives
  exactly the reference's hybrid order, direct mode (`allow_hybrid_mode=False`) the flat order, both
  layouts, with biases and weights; dispatch outputs are those of the one-node run.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from deep_ep.reference import reference_combine, reference_dispatch
from ep_cases import ADVERSARIAL_VALUES, bits_equal

from proc_utils import run_gloo_ranks

RANKS, SCALEUP, EXPERTS, TOPK, HIDDEN, MAX_TOKENS = 4, 2, 16, 4, 128, 20
TOKENS = (7, 0, 20, 13)


def _inputs(seed: int):
    """Every rank's dispatch inputs and combine biases (adversarial values), identical on all ranks."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws, biases = [], [], [], []
    for rank in range(RANKS):
        T = TOKENS[rank]
        xs.append(torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16))
        idx = torch.rand(T, EXPERTS, generator=g).topk(TOPK, dim=1).indices.to(torch.int64)
        idx[torch.rand(T, TOPK, generator=g) < 0.15] = -1
        idxs.append(idx)
        ws.append(torch.rand(T, TOPK, generator=g))
        biases.append(_adversarial((T, HIDDEN), g))
    return xs, idxs, ws, biases


def _adversarial(shape, g) -> torch.Tensor:
    return ADVERSARIAL_VALUES[torch.randint(0, len(ADVERSARIAL_VALUES), shape, generator=g)].to(torch.bfloat16)


def _expert_outputs(results, seed: int):
    """Per rank: bf16 rows for its received layout (rows past the valid count poisoned with NaN)."""
    g = torch.Generator().manual_seed(seed)
    ys = []
    for res in results:
        y = _adversarial((res.recv_x.shape[0], HIDDEN), g)
        y[res.num_valid_rows:] = float("nan")
        ys.append(y)
    return ys


def _loop_combine(ys, handles, biases, num_scaleup_ranks: int, multi: bool):
    """DeepEP's multi-level recipe token by token: per rank bf16 ``[T, H]``."""
    out = []
    L = EXPERTS // RANKS
    for s, h in enumerate(handles):
        combined = torch.empty(h.num_tokens, HIDDEN, dtype=torch.bfloat16)
        for t in range(h.num_tokens):
            owner = [int(e) // L if int(e) >= 0 else -1 for e in h.topk_idx[t].tolist()]
            slots = []                              # bf16 value per slot (zero for a masked slot)
            for k in range(TOPK):
                if owner[k] < 0:
                    slots.append(torch.zeros(HIDDEN, dtype=torch.bfloat16))
                else:
                    row = int(h.dst_buffer_slot_idx[t, k if h.do_expand else owner[k]])
                    slots.append(ys[owner[k]][row])
            if not h.do_expand:                     # one row per (token, rank): it stands at the last slot
                slots = [value if owner[k] < 0 or owner[k] not in owner[k + 1:] else torch.zeros_like(value)
                         for k, value in enumerate(slots)]
            levels = [lambda k: owner[k]] if multi and h.do_expand else []
            if multi and num_scaleup_ranks < RANKS:
                levels.append(lambda k: owner[k] // num_scaleup_ranks if owner[k] >= 0 else -1)
            for group_of in levels:
                grouped = []
                for k in range(TOPK):
                    group = group_of(k)
                    if group < 0 or any(group_of(j) == group for j in range(k + 1, TOPK)):
                        grouped.append(torch.zeros(HIDDEN, dtype=torch.bfloat16))
                        continue
                    acc = torch.zeros(HIDDEN, dtype=torch.float32)
                    for j in range(k + 1):
                        if group_of(j) == group:
                            acc += slots[j].float()
                    grouped.append(acc.to(torch.bfloat16))
                slots = grouped
            acc = biases[s][t].float().clone()
            for value in slots:
                acc += value.float()
            combined[t] = acc.to(torch.bfloat16)
        out.append(combined)
    return out


@pytest.mark.parametrize("do_expand", [False, True])
def test_reference_hybrid_order(do_expand):
    xs, idxs, ws, biases = _inputs(3)
    results = reference_dispatch(xs, idxs, ws, EXPERTS, do_expand=do_expand)
    handles = [res.handle for res in results]
    ys = _expert_outputs(results, 4)
    hybrid = reference_combine(ys, handles, biases=biases, num_scaleup_ranks=SCALEUP)
    flat = reference_combine(ys, handles, biases=biases)
    assert all(bits_equal(a[0], b[0]) for a, b in zip(flat, reference_combine(
        ys, handles, biases=biases, num_scaleup_ranks=RANKS)))
    want_hybrid = _loop_combine(ys, handles, biases, SCALEUP, True)
    want_flat = _loop_combine(ys, handles, biases, RANKS, True)
    for s in range(RANKS):
        assert bits_equal(hybrid[s][0], want_hybrid[s]), s
        assert bits_equal(flat[s][0], want_flat[s]), s
    # the adversarial values make the two orders differ, so the test tells them apart
    assert any(not bits_equal(hybrid[s][0], flat[s][0]) for s in range(RANKS))
    # without multiple reduction every rank's (or slot's) row travels alone: the flat order
    single = reference_combine(ys, handles, biases=biases, allow_multiple_reduction=False,
                               num_scaleup_ranks=SCALEUP)
    want = _loop_combine(ys, handles, biases, SCALEUP, False)
    assert all(bits_equal(single[s][0], want[s]) for s in range(RANKS))


def test_reference_hybrid_bad_scaleup():
    xs, idxs, ws, biases = _inputs(3)
    results = reference_dispatch(xs, idxs, ws, EXPERTS)
    ys = _expert_outputs(results, 4)
    for bad in (0, 3, -2, 2.0, True):
        with pytest.raises(ValueError, match="num_scaleup_ranks"):
            reference_combine(ys, [res.handle for res in results], num_scaleup_ranks=bad)


def _two_nodes_worker(rank, world_size):
    from deep_ep import ElasticBuffer
    xs, idxs, ws, biases = _inputs(5)
    want_dispatch = {do_expand: reference_dispatch(xs, idxs, ws, EXPERTS, do_expand=do_expand)
                     for do_expand in (False, True)}
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = str(SCALEUP)
    checked = 0
    try:
        for hybrid in (True, False):
            buf = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                num_topk=TOPK, allow_hybrid_mode=hybrid, device="cpu")
            assert buf.get_logical_domain_size() == ((2, 2) if hybrid else (1, 4))
            for do_expand in (False, True):
                want = want_dispatch[do_expand]
                recv_x, _, _, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=EXPERTS,
                                                       do_expand=do_expand)
                valid = want[rank].num_valid_rows
                assert bits_equal(recv_x[:valid], want[rank].recv_x[:valid])
                ys = _expert_outputs(want, 6)
                g = torch.Generator().manual_seed(7)
                weights = [torch.rand((y.shape[0],) if do_expand else (y.shape[0], TOPK), generator=g) for y in ys]
                expected = reference_combine(ys, [res.handle for res in want], weights, biases,
                                             num_scaleup_ranks=SCALEUP if hybrid else None)[rank]
                combined, combined_w, _ = buf.combine(ys[rank], handle, topk_weights=weights[rank],
                                                      bias=biases[rank])
                assert bits_equal(combined, expected[0]), (hybrid, do_expand)
                assert bits_equal(combined_w, expected[1]), (hybrid, do_expand)
                checked += 1
                # without multiple reduction: the flat order in both modes and layouts
                single = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                       num_topk=TOPK, allow_hybrid_mode=hybrid, allow_multiple_reduction=False,
                                       device="cpu")
                handle = single.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=EXPERTS,
                                         do_expand=do_expand)[3]
                expected = reference_combine(ys, [res.handle for res in want], biases=biases,
                                             allow_multiple_reduction=False)[rank]
                assert bits_equal(single.combine(ys[rank], handle, bias=biases[rank])[0], expected[0])
                single.destroy()
                checked += 1
            buf.destroy()
    finally:
        del os.environ["EP_CPU_NUM_NVLINK_RANKS"]
    return checked


def test_cpu_two_nodes_hybrid_combine_order(tmp_path):
    assert run_gloo_ranks(_two_nodes_worker, RANKS, tmp_path, deadline=200) == {r: 8 for r in range(RANKS)}
