"""ElasticBuffer on the CPU backend over gloo, 2 and 4 spawned ranks, every mode.

Each rank builds every rank's inputs from a shared seed, so it computes deep_ep.reference for all
ranks locally and compares its own outputs bit for bit (every specified element; rows the contract
leaves unspecified are poisoned with NaN on the combine side, so reading them would show). Its own
dispatch layout is also checked against the per-token loop of ep_cases.py.
"""
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from proc_utils import run_gloo_ranks
from ep_cases import (Case, bits_equal, check_cached_dispatch, check_against_loop, loop_combine, make_combine_inputs,
                      make_inputs)


BUFFER_MAX_TOKENS = 12


def _cases(R):
    tok = {2: [[9, 0], [5, 11], [0, 0]], 4: [[6, 0, 11, 3], [2, 9, 0, 7], [0, 0, 0, 4]]}[R]
    E = {2: 8, 4: 16}[R]
    cases = []
    seed = 100 * R
    for x_format in ("bf16", "fp8", "fp8_ue8m0"):
        for do_expand, alignment in ((False, 1), (True, 1), (True, 128)):
            for sync in (True, False):
                seed += 1
                cases.append(Case(
                    name=f"R{R}-{x_format}-{'exp' if do_expand else 'flat'}-A{alignment}-{'sync' if sync else 'nosync'}",
                    num_ranks=R, num_tokens=tok[seed % 2], hidden=512 if x_format != "bf16" else 256,
                    num_topk=4, num_experts=E, x_format=x_format, col_major_sf=bool(seed % 2),
                    do_expand=do_expand, alignment=alignment, zero_padding=bool(seed % 3 != 1),
                    weights=bool(seed % 3 != 2), mask_prob=0.25, do_cpu_sync=sync, max_tokens=12,
                    num_bias=seed % 3, combine_weights=bool(seed % 2 == 0), seed=seed))
    cases.append(Case(f"R{R}-all-empty", R, [0] * R, do_expand=True, alignment=4,
                      num_experts=E, num_bias=2, seed=seed + 1))
    cases.append(Case(f"R{R}-one-rank-only", R, tok[2], num_experts=E, num_topk=2, seed=seed + 2))
    cases.append(Case(f"R{R}-unmasked-k8", R, [7] * R, num_experts=E, num_topk=min(8, E), mask_prob=0.0,
                      do_expand=True, alignment=3, num_bias=1, seed=seed + 3))
    # expanded combine: one reduction pass (a buffer with allow_multiple_reduction=False), and the
    # fused dispatch weighting in both reduction modes
    cases.append(Case(f"R{R}-single-reduction", R, tok[0], num_experts=E, num_topk=4, do_expand=True,
                      alignment=2, num_bias=2, combine_weights=False, allow_multiple_reduction=False,
                      seed=seed + 4))
    cases.append(Case(f"R{R}-apply-weights", R, tok[1], num_experts=E, num_topk=4, do_expand=True,
                      alignment=4, num_bias=1, apply_dispatch_weights=True, do_cpu_sync=False, max_tokens=12,
                      seed=seed + 5))
    cases.append(Case(f"R{R}-apply-weights-single", R, tok[1], num_experts=E, num_topk=4, do_expand=True,
                      num_bias=1, combine_weights=False, allow_multiple_reduction=False,
                      apply_dispatch_weights=True, seed=seed + 6))
    cases.append(Case(f"R{R}-duplicate-experts", R, tok[1], num_experts=E, num_topk=4, do_expand=True, alignment=2,
                      duplicate_prob=0.5, num_bias=1, seed=seed + 11))
    # combine inputs whose float32 sums depend on the order, in every reduction mode
    for i, (expand, multi, bias) in enumerate(((False, True, 2), (True, True, 2), (True, False, 1),
                                               (False, True, 0))):
        cases.append(Case(f"R{R}-order-{'exp' if expand else 'flat'}-{'multi' if multi else 'single'}-b{bias}",
                          R, [12] * R, hidden=128, num_topk=min(6, E), num_experts=E, do_expand=expand,
                          num_bias=bias, mask_prob=0.1, combine_weights=multi, allow_multiple_reduction=multi,
                          adversarial=True, cached=False, seed=seed + 7 + i))
    return cases


def _run_case(buf, case, rank):
    from deep_ep import EventOverlap
    from deep_ep.reference import check_combine, check_dispatch, local_expert_counts, reference_combine, \
        reference_dispatch

    R, E = case.num_ranks, case.num_experts
    L = E // R
    M = case.max_tokens or BUFFER_MAX_TOKENS     # dispatch's None means the buffer's
    xs, idxs, ws = make_inputs(case)
    stats = torch.full((L,), 5, dtype=torch.int32) if case.stats else None
    out = buf.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank] if ws else None,
                       cumulative_local_expert_recv_stats=stats, num_experts=E,
                       num_max_tokens_per_rank=case.max_tokens or None, expert_alignment=case.alignment,
                       do_cpu_sync=case.do_cpu_sync, do_expand=case.do_expand,
                       do_zero_padding=case.zero_padding,
                       use_tma_aligned_col_major_sf=case.col_major_sf)
    assert isinstance(out[4], EventOverlap)
    ref = reference_dispatch(xs, idxs, ws, E, do_expand=case.do_expand, expert_alignment=case.alignment,
                             do_cpu_sync=case.do_cpu_sync, num_max_tokens_per_rank=M,
                             use_tma_aligned_col_major_sf=case.col_major_sf)
    check_dispatch(out, ref[rank], do_zero_padding=case.zero_padding)
    check_against_loop({rank: out}, xs, idxs, ws, E, case.do_expand, case.alignment,
                       zero_padding=case.zero_padding, num_max_tokens_per_rank=case.max_tokens or BUFFER_MAX_TOKENS)
    handle = out[3]
    assert handle.buffer_id == buf.buffer_id
    if stats is not None:
        assert torch.equal(stats, 5 + local_expert_counts(ref)[rank])

    # combine (unspecified rows of the inputs are NaN)
    valid = [r.handle.recv_src_rank >= 0 for r in ref]
    ys, tws, biases = make_combine_inputs(case, [v.numel() for v in valid], valid)
    flags = dict(allow_multiple_reduction=case.allow_multiple_reduction,
                 apply_dispatch_weights=case.apply_dispatch_weights)
    got = buf.combine(ys[rank], handle, topk_weights=tws[rank] if tws else None, bias=biases[rank],
                      apply_dispatch_weights=case.apply_dispatch_weights)
    want = reference_combine(ys, [r.handle for r in ref], tws, biases, **flags)[rank]
    check_combine(got, want, rank=rank)
    loop = loop_combine(ys, [r.handle for r in ref], tws, biases, ranks=[rank], **flags)[rank]
    assert bits_equal(got[0], loop[0]) and bits_equal(got[1], loop[1])
    assert not torch.isnan(got[0].float()).any()

    # cached dispatch: new data, same layout, no routing input
    if case.cached:
        out2 = check_cached_dispatch(buf, case, rank, handle, idxs, ws, E, M, seed_offset=7777,
                                     with_weights=case.seed % 2 == 0)
        assert out2[3] is handle
        # and the async path with a previous event (a captured one, or a dispatch's), as a context manager
        previous = buf.capture() if case.seed % 2 else out2[4]
        with buf.combine(ys[rank], handle, bias=biases[rank], previous_event=previous,
                         async_with_compute_stream=True, apply_dispatch_weights=case.apply_dispatch_weights)[2] as ev:
            assert isinstance(ev, EventOverlap) and ev.event is not None


def _worker(rank, world_size, case_names):
    from deep_ep import ElasticBuffer, EventHandle
    bufs = {flag: ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=BUFFER_MAX_TOKENS, hidden=512,
                                num_topk=8, allow_multiple_reduction=flag) for flag in (True, False)}
    buf = bufs[True]
    assert buf.get_logical_domain_size() == (1, world_size)
    assert buf.get_physical_domain_size() == (1, world_size)
    assert buf.get_comm_stream() is None and buf.get_theoretical_num_sms(16, 4) == 0
    assert buf.get_theoretical_num_qps(0) == 0 and buf.num_allocated_qps == 0
    event = buf.capture()
    assert isinstance(event, EventHandle) and event.event is None
    event.current_stream_wait()
    for case in _cases(world_size):
        if case_names and case.name not in case_names:
            continue
        try:
            _run_case(bufs[case.allow_multiple_reduction], case, rank)
        except Exception as exc:
            raise AssertionError(f"case {case.name}, rank {rank}: {exc}\n{traceback.format_exc()}") from None
    buf.barrier()
    bufs[False].destroy()
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.barrier()


@pytest.mark.parametrize("world_size", [2, 4])
def test_cpu_backend_all_modes(world_size, tmp_path):
    names = os.environ.get("DEEP_EP_TEST_CASES", "")
    run_gloo_ranks(_worker, world_size, tmp_path, names.split(",") if names else [], deadline=600)


def _duplicate_ids_worker(rank, world_size):
    from deep_ep import ElasticBuffer
    buf = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=3, hidden=128, num_topk=4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((3, 128), generator=g).to(torch.bfloat16)
    # 2 ranks x 2 experts: L = 2 < K = 4, so a token naming expert 0 four times exceeds the
    # R x M x min(K, L) rows a do_cpu_sync=False expanded output is sized for, at rank 0.
    idx = torch.zeros((3, 4), dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] would receive .* Nothing was written"):
        buf.dispatch(x, idx, num_experts=4, do_expand=True, do_cpu_sync=False)
    # every rank raised at the same point: the buffer still works
    idx = torch.stack([torch.randperm(4, generator=g) for _ in range(3)])
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, num_experts=4, do_expand=True, do_cpu_sync=False)
    assert buf.combine(recv_x, handle)[0].shape == (3, 128)
    buf.destroy()


def test_expanded_receive_over_the_worst_case_raises_on_every_rank(tmp_path):
    """Duplicate expert ids in a token can exceed the do_cpu_sync=False expanded worst case: every
    rank raises before anything is written (the GPU layout kernel's capacity error, on CPU)."""
    run_gloo_ranks(_duplicate_ids_worker, 2, tmp_path, deadline=60)
