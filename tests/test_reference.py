"""deep_ep.reference against the independent per-token loop of ep_cases.py (small sizes, all modes)."""
import time

import pytest
import torch

from deep_ep.reference import check_combine, check_dispatch, local_expert_counts, reference_combine, \
    reference_dispatch
from deep_ep.shapes import align_up, expanded_row_experts, worst_case_recv_rows

from ep_cases import Case, bits_equal, check_against_loop, loop_combine, make_combine_inputs, make_inputs


def _cases():
    cases = []
    seed = 0
    for R, tokens in ((1, [5]), (2, [7, 0]), (4, [6, 1, 9, 3])):
        for x_format in ("bf16", "fp8", "fp8_ue8m0"):
            for do_expand in (False, True):
                for alignment in ((1,) if not do_expand else (1, 4)):
                    for sync in (True, False):
                        seed += 1
                        cases.append(Case(
                            name=f"R{R}-{x_format}-{'exp' if do_expand else 'flat'}-A{alignment}-"
                                 f"{'sync' if sync else 'nosync'}",
                            num_ranks=R, num_tokens=tokens, hidden=512 if x_format != "bf16" else 128,
                            num_topk=3, num_experts=8, x_format=x_format, col_major_sf=(seed % 2 == 0),
                            do_expand=do_expand, alignment=alignment, weights=(seed % 3 != 0),
                            do_cpu_sync=sync, max_tokens=10, num_bias=seed % 3, seed=seed))
    # experts split one per rank, K > L, all masked, duplicate expert selections
    cases.append(Case("K>L", 4, [4, 4, 4, 4], num_topk=4, num_experts=4, do_expand=True, alignment=3, seed=99))
    cases.append(Case("all-masked", 2, [3, 2], mask_prob=1.0, do_expand=True, alignment=2, num_bias=2, seed=98))
    cases.append(Case("no-mask-128", 2, [5, 6], mask_prob=0.0, do_expand=True, alignment=128, seed=97))
    # expanded combine without multiple reduction (no weights to reduce), and the fused weighting
    cases.append(Case("single-reduction", 4, [6, 1, 9, 3], do_expand=True, alignment=2, num_bias=2,
                      combine_weights=False, allow_multiple_reduction=False, seed=96))
    cases.append(Case("apply-weights", 2, [7, 5], do_expand=True, alignment=4, num_bias=1,
                      apply_dispatch_weights=True, seed=95))
    cases.append(Case("apply-weights-single", 2, [7, 5], num_topk=4, do_expand=True, num_bias=1,
                      combine_weights=False, allow_multiple_reduction=False, apply_dispatch_weights=True, seed=94))
    for expand in (False, True):     # a token may name an expert twice: one expanded row per slot
        cases.append(Case(f"duplicates-{'exp' if expand else 'flat'}", 2, [9, 6], num_topk=4, do_expand=expand,
                          alignment=2, duplicate_prob=0.5, num_bias=1, seed=80 + expand))
    for i, (expand, multi) in enumerate(((False, True), (True, True), (True, False))):
        cases.append(Case(f"order-{'exp' if expand else 'flat'}-{'multi' if multi else 'single'}", 4, [16] * 4,
                          num_topk=6, num_experts=16, do_expand=expand, num_bias=2 - i % 2, mask_prob=0.1,
                          combine_weights=multi, allow_multiple_reduction=multi, adversarial=True, seed=90 + i))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_reference_matches_loop(case):
    xs, idxs, ws = make_inputs(case)
    res = reference_dispatch(xs, idxs, ws, case.num_experts, do_expand=case.do_expand,
                             expert_alignment=case.alignment, do_zero_padding=True,
                             do_cpu_sync=case.do_cpu_sync, num_max_tokens_per_rank=case.max_tokens,
                             use_tma_aligned_col_major_sf=case.col_major_sf)
    check_against_loop([r.as_tuple() for r in res], xs, idxs, ws, case.num_experts, case.do_expand,
                       case.alignment, num_max_tokens_per_rank=case.max_tokens)
    L = case.num_experts // case.num_ranks
    for d, r in enumerate(res):
        rows = r.handle.num_recv_rows
        if not case.do_cpu_sync:
            assert rows == worst_case_recv_rows(case.num_ranks, case.max_tokens, case.num_topk, L,
                                                case.alignment, case.do_expand)
            assert r.handle.num_recv_tokens == case.num_ranks * case.max_tokens
            assert r.handle.num_recv_tokens_per_expert_list == []
        else:
            assert r.handle.num_recv_tokens == int(r.handle.psum_num_recv_tokens_per_scaleup_rank[-1])
        if case.do_expand:
            experts = expanded_row_experts(r.handle.psum_num_recv_tokens_per_expert,
                                           r.handle.num_unaligned_recv_tokens_per_expert, rows)
            src = r.handle.recv_src_rank
            assert torch.equal(experts >= 0, src >= 0)
            assert torch.equal(experts[src >= 0], torch.sort(experts[src >= 0]).values)
        if isinstance(r.recv_x, tuple):
            sf = r.recv_x[1]
            if case.col_major_sf:
                assert sf.stride() == (1, align_up(rows, 4))
            else:
                assert sf.is_contiguous()
        # self-consistency helper used by the other suites
        check_dispatch(r.as_tuple(), r)
    counts = local_expert_counts(res)
    for d in range(case.num_ranks):
        assert counts[d].sum().item() == sum(
            int(((i >= d * L) & (i < (d + 1) * L)).sum()) for i in idxs)

    handles = [r.handle for r in res]
    valid = [r.handle.recv_src_rank >= 0 for r in res]
    ys, tws, biases = make_combine_inputs(case, [v.numel() for v in valid], valid)
    flags = dict(allow_multiple_reduction=case.allow_multiple_reduction,
                 apply_dispatch_weights=case.apply_dispatch_weights)
    got = reference_combine(ys, handles, tws, biases, **flags)
    want = loop_combine(ys, handles, tws, biases, **flags)
    for s in range(case.num_ranks):
        assert bits_equal(got[s][0], want[s][0]), f"rank {s} combined_x"
        assert bits_equal(got[s][1], want[s][1]), f"rank {s} combined_topk_weights"
        check_combine(got[s], want[s], rank=s)
        assert not torch.isnan(got[s][0].float()).any()


def test_roundtrip_identity():
    """Expanded dispatch then combine of the received rows: each token comes back once per selected
    expert (rows are summed as they are), or weighted with ``apply_dispatch_weights``."""
    case = Case("rt", 4, [8, 8, 8, 8], hidden=128, num_topk=4, num_experts=16, do_expand=True,
                alignment=4, mask_prob=0.0, seed=7)
    xs, idxs, ws = make_inputs(case)
    res = reference_dispatch(xs, idxs, ws, 16, do_expand=True, expert_alignment=4)
    plain = reference_combine([r.recv_x for r in res], [r.handle for r in res])
    weighted = reference_combine([r.recv_x for r in res], [r.handle for r in res], apply_dispatch_weights=True)
    for s in range(4):
        torch.testing.assert_close(plain[s][0].float(), 4 * xs[s].float(), rtol=2e-2, atol=2e-2)
        want = (ws[s].sum(1, keepdim=True) * xs[s].float())
        torch.testing.assert_close(weighted[s][0].float(), want, rtol=2e-2, atol=2e-2)


def _bf16(value: float, shape=(1, 8)) -> torch.Tensor:
    return torch.full(shape, value).to(torch.bfloat16)


def test_combine_order_bias_first_then_last_slot():
    """The documented order, on values where any other order gives other bits."""
    tiny = 2.0 ** -24
    empty_x, empty_idx = torch.zeros(0, 8).to(torch.bfloat16), torch.zeros(0, 3, dtype=torch.int64)
    # Non-expanded, 2 ranks x 2 experts, token slots owned by ranks (0, 1, 0): rank 1's row enters at
    # slot 1, rank 0's at slot 2. fp32(1) + fp32(2**-24) = 1; then (1 - 1) + 2**-24 = 2**-24, whereas
    # rank 0 first would give (1 + 2**-24) - 1 = 0.
    res = reference_dispatch([_bf16(0.0), empty_x], [torch.tensor([[0, 2, 1]]), empty_idx], None, 4)
    ys = [_bf16(tiny), _bf16(-1.0)]
    out = reference_combine(ys, [r.handle for r in res], None, [(_bf16(1.0), _bf16(tiny)), None])[0][0]
    assert torch.equal(out, _bf16(tiny))
    # Expanded, two slots on rank 0 holding 2**-24 each, biases 1 and 2**-8 (a bf16 tie): with multiple
    # reduction the partial 2**-23 tips the sum above the tie (1 + 2**-7); one slot at a time each
    # addition ties back to 1 + 2**-8, which rounds to 1.
    res = reference_dispatch([_bf16(0.0), empty_x], [torch.tensor([[0, 1, -1]]), empty_idx], None, 4,
                             do_expand=True)
    ys = [_bf16(tiny, (2, 8)), torch.zeros(0, 8).to(torch.bfloat16)]
    biases = [(_bf16(1.0), _bf16(2.0 ** -8)), None]
    multi = reference_combine(ys, [r.handle for r in res], None, biases)[0][0]
    single = reference_combine(ys, [r.handle for r in res], None, biases, allow_multiple_reduction=False)[0][0]
    assert torch.equal(multi, _bf16(1.0 + 2.0 ** -7)) and torch.equal(single, _bf16(1.0))
    # -0.0 biases: every slot adds (+0.0 where it contributes nothing), so the result is +0.0
    masked = reference_dispatch([_bf16(0.0)] * 2, [torch.full((1, 3), -1)] * 2, None, 4)
    out = reference_combine([torch.zeros(0, 8).to(torch.bfloat16)] * 2, [r.handle for r in masked], None,
                            [(_bf16(-0.0), _bf16(-0.0))] * 2)
    assert (out[0][0].view(torch.int16) == 0).all()


def test_reference_speed():
    """Vectorised: 8 ranks x 512 tokens x 1024 channels, both layouts + combine, in seconds (2 to 6 s
    on the 2-core CI machine); the bound only catches a fall back to per-token loops."""
    R, T, H, K, E = 8, 512, 1024, 8, 256
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(R)]
    idxs = [torch.rand(T, E, generator=g).topk(K, 1).indices for _ in range(R)]
    ws = [torch.rand(T, K, generator=g) for _ in range(R)]
    t0 = time.time()
    for expand in (False, True):
        res = reference_dispatch(xs, idxs, ws, E, do_expand=expand, expert_alignment=128 if expand else 1)
        reference_combine([r.recv_x for r in res], [r.handle for r in res])
    assert time.time() - t0 < 30
