"""GPU dispatch/combine against the reference, on real NCCL (EP=1) and emulated ranks (EP 2, 4, 8).

Every case draws fresh random inputs from a seed of its own (`gpu_cases.case_seed` of the case name),
computes every rank's expected outputs with `deep_ep.reference` on the CPU, runs the GPU path with
every output poisoned by the library's allocation hook (`deep_ep.backends.outputs.poisoned`: NaN /
0xA5 bytes, so an element a kernel leaves unwritten cannot pass for a result, whatever memory the
caching allocator hands out) and compares every element: dispatch bit for bit (the fresh dispatch,
the cached dispatch of fresh data and scale factors with the same handle: data, scale factors,
indices, weights and handle); combine bit for bit in both layouts, on expert outputs and biases drawn
from values whose fp32 sums depend on the order of the additions (so only the reference's order
passes), also on buffers with ``allow_multiple_reduction=False`` (the expanded combine sums every
slot's row at the source; `gpu_cases.Case.single_reduction`). The
expert statistics start from random non-zero counts, so an overwrite cannot pass for an increment.
Skipped without a CUDA device; run by tools/device_suite.sh on the H200.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_cases import case_seed, cases_for, handle_to_cpu, selected, to_cpu  # noqa: E402
from proc_utils import case_log  # noqa: E402

import deep_ep  # noqa: E402
from deep_ep import reference as ref  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------------------------- inputs
def make_inputs(case, seed: int):
    g = torch.Generator().manual_seed(seed)
    R, E, K, H = case.num_ranks, case.num_experts, case.num_topk, case.hidden
    xs, idxs, ws, biases = [], [], [], []
    for r in range(R):
        T = case.tokens_of(r)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.empty((0, K), dtype=torch.int64)
        idx = idx.to(torch.int64)
        if case.mask_prob > 0 and T:
            idx[torch.rand(idx.shape, generator=g) < case.mask_prob] = -1
        w = torch.rand((T, K), generator=g, dtype=torch.float32) if case.weights else None
        data = torch.randn((T, H), generator=g).to(torch.bfloat16)
        if case.fp8:
            data8 = (torch.randn((T, H), generator=g) * 4).to(torch.float8_e4m3fn)
            if case.fp8 == "fp32":
                sf = torch.rand((T, H // 128), generator=g) + 0.5
            else:
                sf = torch.randint(-2**31, 2**31 - 1, (T, (H + 511) // 512), generator=g, dtype=torch.int64).to(torch.int32)
            x = (data8, sf)
        else:
            x = data
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
        biases.append(tuple(torch.randn((T, H), generator=g).to(torch.bfloat16) for _ in range(case.num_bias)))
    return xs, idxs, (ws if case.weights else None), biases


def to_dev(x, dev):
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return tuple(to_dev(t, dev) for t in x)
    return x.to(dev)


# ------------------------------------------------------------------------------------- driver
def _adversarial(shape, g: torch.Generator) -> torch.Tensor:
    from ep_cases import ADVERSARIAL_VALUES
    return ADVERSARIAL_VALUES[torch.randint(0, len(ADVERSARIAL_VALUES), shape, generator=g)].to(torch.bfloat16)

def fresh_data(xs, g: torch.Generator) -> list:
    """New data (and new scale factors) of the same shapes and dtypes as ``xs``, for a cached dispatch:
    no row of its expected output equals the first dispatch's (a stale row shows)."""
    out = []
    for x in xs:
        d, sf = ref.split_x(x)
        if sf is None:
            out.append(torch.randn(d.shape, generator=g).to(d.dtype))
            continue
        nd = (torch.randn(d.shape, generator=g) * 4).to(d.dtype)
        if sf.dtype == torch.float32:
            nsf = torch.rand(sf.shape, generator=g) + 0.5
        else:
            nsf = torch.randint(-2**31, 2**31 - 1, tuple(sf.shape), generator=g, dtype=torch.int64).to(sf.dtype)
        out.append((nd, nsf))
    return out


def run_case(case, group_for_rank, dev, seed=None):
    """Run ``case`` and check everything.

    ``group_for_rank(body)`` runs ``body(group)`` on the ranks this process drives and returns their
    results: a list over all ranks (emulated ranks) or a dict ``{rank: result}`` (one rank per process
    under torchrun). Every process computes every rank's inputs and the reference from one seed
    (default: `case_seed` of the case name, so no two cases share inputs).
    """
    R = case.num_ranks
    L = case.num_experts // R
    seed = case_seed(case.name) if seed is None else seed
    xs, idxs, ws, biases = make_inputs(case, seed)
    M = max(case.max_tokens, 1)
    exp = ref.reference_dispatch(xs, idxs, ws, case.num_experts, do_expand=case.expand,
                                 expert_alignment=case.alignment, do_cpu_sync=case.do_cpu_sync,
                                 num_max_tokens_per_rank=M, use_tma_aligned_col_major_sf=case.col_major_sf)
    g = torch.Generator().manual_seed(seed + 1)
    # Expert outputs and biases from values whose fp32 sums depend on the order of the additions
    # (ep_cases.ADVERSARIAL_VALUES), so that a combine in another order than the reference's fails;
    # rows nobody may read (padding, past the true count) hold NaN.
    ys = []
    for e in exp:
        y = _adversarial((e.handle.num_recv_rows, case.hidden), g)
        y[e.handle.recv_src_rank < 0] = float("nan")
        ys.append(y)
    biases = [tuple(_adversarial(tuple(b.shape), g) for b in bs) for bs in biases]
    yws = None
    if case.weights and not (case.single_reduction and case.expand):   # expanded: they need multiple reduction
        yws = [torch.rand((e.handle.num_recv_rows,) if case.expand else (e.handle.num_recv_rows, case.num_topk),
                          generator=g) for e in exp]
    # Statistics start from random non-zero counts: an overwrite would not pass for an increment.
    stats0 = [torch.randint(1, 1000, (L,), generator=g, dtype=torch.int32) for _ in range(R)]
    exp_comb = ref.reference_combine(ys, [e.handle for e in exp], yws,
                                     [b if b else None for b in biases],
                                     allow_multiple_reduction=not case.single_reduction,
                                     apply_dispatch_weights=case.apply_dispatch_weights)
    # cached dispatch: fresh data and scale factors, same routing (and, expanded, the same weights)
    xs2 = exp2 = None
    if case.cached:
        xs2 = fresh_data(xs, torch.Generator().manual_seed(seed + 2))
        exp2 = ref.reference_dispatch(xs2, idxs, ws, case.num_experts, do_expand=case.expand,
                                      expert_alignment=case.alignment, do_cpu_sync=case.do_cpu_sync,
                                      num_max_tokens_per_rank=M, use_tma_aligned_col_major_sf=case.col_major_sf)
        if not case.weights:
            for e in exp2:
                e.recv_topk_weights = None   # a cached dispatch given no topk_weights returns None

    def body(group):
        r = group.rank()
        buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=case.hidden,
                                    num_topk=case.num_topk, use_fp8_dispatch=bool(case.fp8),
                                    allow_multiple_reduction=not case.single_reduction,
                                    num_gpu_timeout_secs=float(os.environ.get("DEEP_EP_TEST_GPU_TIMEOUT", "20")))
        if case.notify_groups_max and dev.type == "cuda":
            buf._backend.set_notify_groups_max(case.notify_groups_max)

        def sync():  # stream-level: a device-wide sync could wait on another rank's pending kernels
            if dev.type == "cuda":  # (tests/test_mutations_cpu.py runs the cases on the CPU backend)
                buf.get_comm_stream().synchronize()
                torch.cuda.current_stream(dev).synchronize()

        def combine():
            with outputs.poisoned():
                comb = buf.combine(to_dev(ys[r], dev), handle,
                                   topk_weights=to_dev(yws[r], dev) if yws is not None else None,
                                   bias=to_dev(biases[r], dev) if biases[r] else None, num_sms=case.num_sms,
                                   apply_dispatch_weights=case.apply_dispatch_weights)
            sync()
            return comb[0].cpu(), to_cpu(comb[1])

        try:
            stats = stats0[r].to(dev, copy=True)   # the start stays for the check
            with outputs.poisoned():
                out = buf.dispatch(to_dev(xs[r], dev), to_dev(idxs[r], dev),
                                   to_dev(ws[r], dev) if ws is not None else None,
                                   cumulative_local_expert_recv_stats=stats, num_experts=case.num_experts,
                                   expert_alignment=case.alignment, num_sms=case.num_sms,
                                   do_cpu_sync=case.do_cpu_sync, do_expand=case.expand,
                                   do_zero_padding=case.zero_padding,
                                   use_tma_aligned_col_major_sf=case.col_major_sf,
                                   num_max_tokens_per_rank=M)
            recv_x, recv_idx, recv_w, handle, _ = out
            sync()
            result = {"dispatch": (to_cpu(recv_x), to_cpu(recv_idx), to_cpu(recv_w), handle_to_cpu(handle)),
                      "stats": stats.cpu()}
            result["combine"] = combine()
            if case.cached:
                with outputs.poisoned():
                    # with weights: the backward pass of a dispatch (DeepEP's cached dispatch takes them)
                    out2 = buf.dispatch(to_dev(xs2[r], dev), handle=handle, num_sms=case.num_sms,
                                        topk_weights=to_dev(ws[r], dev) if ws is not None else None,
                                        do_zero_padding=case.zero_padding,
                                        use_tma_aligned_col_major_sf=case.col_major_sf)
                sync()
                assert out2[3] is handle, f"rank {r}: a cached dispatch returns the handle it was given"
                result["cached"] = (to_cpu(out2[0]), to_cpu(out2[1]), to_cpu(out2[2]), handle_to_cpu(out2[3]))
                # and a second combine with the same handle (rounds alternate halves)
                result["combine2"] = combine()
            buf.barrier()
            return result
        finally:
            buf.destroy()

    results = group_for_rank(body)
    # A list (every rank's result: emulated) or a dict {rank: result} (this process's ranks: NCCL).
    items = results.items() if isinstance(results, dict) else enumerate(results)
    for r, res in items:
        ref.check_dispatch(res["dispatch"], exp[r], do_zero_padding=case.zero_padding, rank=r)
        # stats: the start plus the unpadded received pairs per local expert
        counts = ref.local_expert_counts(exp)[r]
        assert torch.equal(res["stats"], stats0[r] + counts), \
            f"rank {r}: stats {res['stats'].tolist()}, expected {stats0[r].tolist()} + {counts.tolist()}"
        for key in ("combine", "combine2") if case.cached else ("combine",):
            ref.check_combine(res[key], exp_comb[r], rank=r)   # bit for bit, both layouts
        if case.cached:
            try:
                ref.check_dispatch(res["cached"], exp2[r], do_zero_padding=case.zero_padding, rank=r)
            except AssertionError as exc:
                raise AssertionError(f"cached dispatch: {exc}") from None


# ------------------------------------------------------------------------------------- EP=1 on real NCCL
@pytest.mark.parametrize("case", selected(cases_for(1)), ids=lambda c: c.name)
def test_ep1_real_nccl(case, nccl_group):
    dev = torch.device("cuda", 0)
    run_case(case, lambda body: {0: body(nccl_group)}, dev)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_emulated(num_ranks):
    """Every case at this rank count; stops at the first failure (a failed multi-rank case can leave
    kernels or memory behind that would make the next cases fail for the wrong reason)."""
    import traceback

    from deep_ep.emulated import EmulatedGroup
    dev = torch.device("cuda", 0)
    group = EmulatedGroup(num_ranks, device=dev)
    for case in selected(cases_for(num_ranks)):
        case_log(f"{case.name}: start")
        try:
            run_case(case, group.run, dev)
        except Exception as exc:
            case_log(f"{case.name}: FAIL {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise
        case_log(f"{case.name}: ok")
