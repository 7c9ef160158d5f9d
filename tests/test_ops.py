"""deep_ep.ops (differentiable dispatch and combine) on the CPU backend over gloo, 2 and 4 ranks.

Every rank builds every rank's inputs from shared seeds, so it can compute the expected values of
all ranks locally. Checked, for each case (both layouts, with and without a host sync, alignment,
FP8, masked slots, duplicate experts, a rank without tokens):

* forward: the operators' outputs equal `deep_ep.reference` bit for bit (computed under
  `outputs.poisoned`), rows that hold no data are zero, and ``cumulative_local_expert_recv_stats``
  counts the received pairs of fresh and cached dispatches;
* dispatch (fresh and cached): the gradient of ``x`` equals `deep_ep.reference.reference_combine` of
  the received rows' gradients bit for bit, and autograd through a dense float32 equivalent (every
  token's copies summed) within the bf16 rounding bound (3 unit roundoffs of the sum of |terms|); the gradient of ``topk_weights`` equals the
  dense one exactly (a pure gather);
* combine: the gradients of ``x``, ``topk_weights`` and both biases equal autograd through a dense
  equivalent exactly (each is a gather of the output gradient), rows without data get zero; with
  ``apply_dispatch_weights`` the gradient reaches the dispatch's weights;
* every upstream gradient is random, including on rows without data (which must not be read), and
  handles do not outlive the step.

The helpers at the top take a buffer, a rank and a device, so the GPU suite
(tests/gpu/test_gpu_ops.py) runs the same checks on the H200.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from ep_cases import Case, bits_equal, make_inputs
from proc_utils import run_gloo_ranks

BF16 = torch.bfloat16
MAX_TOKENS = 12


# ---------------------------------------------------------------------------------------------- helpers
def offsets(case: Case) -> list:
    """Global index of each rank's first token (tokens of all ranks concatenated)."""
    out = [0]
    for T in case.num_tokens:
        out.append(out[-1] + T)
    return out


def row_sources(eh) -> tuple:
    """int64 ``[rows]`` each: source rank, source token and (expanded) top-k slot of every receive
    row of an `EPHandle`; -1 on rows without data."""
    src_rank = eh.recv_src_rank.cpu().long()
    src_tok = eh.recv_src_token.cpu().long()
    slot = torch.full_like(src_rank, -1)
    if eh.do_expand:
        meta = eh.recv_src_metadata.cpu().long()
        for k in range(eh.num_topk):
            rows = meta[:, 2 + k]
            slot[rows[rows >= 0]] = k
    return src_rank, src_tok, slot


def global_rows(eh, case: Case) -> tuple:
    """``(global token, slot, has data)`` of every receive row."""
    src_rank, src_tok, slot = row_sources(eh)
    valid = src_rank >= 0
    g = torch.where(valid, torch.tensor(offsets(case))[src_rank.clamp(min=0)] + src_tok, 0)
    return g, slot, valid


def reference(case: Case, xs, idxs, ws, max_tokens: int):
    from deep_ep.reference import reference_dispatch
    return reference_dispatch(xs, idxs, ws, case.num_experts, do_expand=case.do_expand,
                              expert_alignment=case.alignment, do_cpu_sync=case.do_cpu_sync,
                              num_max_tokens_per_rank=max_tokens, use_tma_aligned_col_major_sf=case.col_major_sf)


def settle(device) -> None:
    """Before a host read of GPU results, or a copy from host memory while GPU work is queued: wait
    for the current stream of ``device`` by polling an event. With emulated GPU ranks a synchronous
    copy waits for the stream inside the driver, which may stall the CUDA calls of the peers' threads
    and of autograd's one engine thread that runs every rank's backward (see deep_ep.emulated)."""
    if torch.device(device).type == "cuda":
        from deep_ep.emulated import wait_for_stream
        wait_for_stream(torch.cuda.current_stream(device))


def to(x, device):
    """A copy of ``x`` (a tensor, an FP8 tuple or None) on ``device``."""
    if isinstance(x, tuple):
        return tuple(t.to(device, copy=True) for t in x)
    return None if x is None else x.to(device, copy=True)


def recorded_gpu_error(buf) -> str:
    """The error a GPU kernel of ``buf``'s rank recorded (a call without host sync reports it only
    at the next call), as the message the next call would raise; "" when there is none or on CPU."""
    backend = getattr(buf, "_backend", None)
    if buf is None or not hasattr(backend, "read_error"):
        return ""
    record = backend.read_error()
    if record is None:
        return ""
    from deep_ep.backends.gpu.errors import raise_recorded
    try:
        raise_recorded(record, backend.config.num_gpu_timeout_secs, backend.call_record.num_max_tokens,
                       backend.call_record.launched_call)
    except Exception as exc:  # noqa: BLE001 - turned into text for the assertion message
        return f" (the GPU recorded: {type(exc).__name__}: {exc})"
    return f" (the GPU recorded {record})"


def check_forward(out, ref, device, buf=None) -> None:
    """``ops.dispatch``'s outputs against the reference (bit for bit), rows without data zero; a
    failure also names the error the rank's kernels recorded, if any (``buf`` given)."""
    from deep_ep import ops
    from deep_ep.reference import check_dispatch
    recv_x, recv_idx, recv_w, handle = out
    settle(device)
    cpu = (to(recv_x, "cpu"), to(recv_idx, "cpu"), to(recv_w, "cpu"))
    eh = ops.ep_handle(handle)
    try:
        check_dispatch((*cpu, eh), ref, check_handle=False)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{recorded_gpu_error(buf)}") from exc
    data = cpu[0][0] if isinstance(cpu[0], tuple) else cpu[0]
    valid = row_sources(eh)[0] >= 0
    assert data.shape[0] == valid.numel()
    assert not data[~valid].view(torch.uint8).any(), "rows without data must be zero"
    assert handle.num_recv_rows == data.shape[0]
    assert torch.equal(handle.num_unaligned_recv_tokens_per_expert.cpu(),
                       ref.handle.num_unaligned_recv_tokens_per_expert)


def dense_upstream(case: Case, gen: torch.Generator, R: int) -> tuple:
    """Random upstream gradients defined per token copy, so that a dense model can use them:
    ``G`` (non-expanded ``[R, N, H]``, per destination and token; expanded ``[N, K, H]``, per token
    and slot) and ``Q [N, K]`` (per slot, for the weights)."""
    N, H, K = offsets(case)[-1], case.hidden, case.num_topk
    return torch.randn((N, K, H) if case.do_expand else (R, N, H), generator=gen), torch.randn((N, K), generator=gen)


def upstream_rows(case: Case, eh, recv_idx, dense_g, dense_q, gen: torch.Generator, d: int) -> tuple:
    """Rank ``d``'s share of `dense_upstream`, on its received rows: ``(G [rows, H], Q [rows, K] or
    [rows])``. Rows without data and weight slots not local to ``d`` get junk (never to be read)."""
    H, K = case.hidden, case.num_topk
    g, slot, valid = global_rows(eh, case)
    junk = torch.randn((valid.numel(), H), generator=gen)
    if case.do_expand:
        rows_g = torch.where(valid.unsqueeze(1), dense_g[g, slot.clamp(min=0)], junk)
        rows_q = torch.where(valid, dense_q[g, slot.clamp(min=0)], torch.randn(valid.numel(), generator=gen))
    else:
        rows_g = torch.where(valid.unsqueeze(1), dense_g[d][g], junk)
        local = valid.unsqueeze(1) & (recv_idx.cpu() >= 0)
        rows_q = torch.where(local, dense_q[g], torch.randn((valid.numel(), K), generator=gen))
    return rows_g, rows_q


def dense_x_grad(case: Case, idx_all: torch.Tensor, dense_g: torch.Tensor, R: int) -> tuple:
    """Autograd through the dense equivalent of a dispatch: every copy of a token (one per
    destination rank, or one per selected slot) multiplied by its upstream gradient and summed.
    Returns ``(gradient, sum of |terms|)``, float32 ``[N, H]`` each."""
    L = case.num_experts // R
    N, H = idx_all.shape[0], case.hidden
    x = torch.zeros((N, H), requires_grad=True)
    if case.do_expand:
        copies = (idx_all >= 0).float()                                    # [N, K]
        (x.unsqueeze(1) * dense_g * copies.unsqueeze(2)).sum().backward()
        bound = (dense_g.abs() * copies.unsqueeze(2)).sum(1)
    else:
        owner = torch.where(idx_all >= 0, torch.div(idx_all, L, rounding_mode="floor"), -1)
        copies = torch.stack([(owner == d).any(1) for d in range(R)]).float()   # [R, N]
        (x.unsqueeze(0) * dense_g * copies.unsqueeze(2)).sum().backward()
        bound = (dense_g.abs() * copies.unsqueeze(2)).sum(0)
    return x.grad, bound


def check_dispatch_grads(buf, case: Case, rank: int, R: int, device, seed: int, check_leaks: bool = True) -> None:
    """Forward and gradients of a fresh ``ops.dispatch`` and of a cached one with its handle.
    ``check_leaks``: no handle may be alive at the end (the process's only rank: not with emulated
    ranks, which share the registry)."""
    from deep_ep import ops
    from deep_ep.backends import outputs
    from deep_ep.reference import reference_combine
    M = case.max_tokens or MAX_TOKENS
    xs, idxs, ws = make_inputs(case)
    fp8 = case.x_format != "bf16"
    refs = reference(case, xs, idxs, ws, M)
    ref_handles = [r.handle for r in refs]
    idx_all = torch.cat(idxs)
    handle = None
    stats = torch.full((case.num_experts // R,), 3, dtype=torch.int32, device=device)
    for step in ("fresh", "cached"):
        if step == "cached":
            xs, _, ws = make_inputs(dataclasses.replace(case, seed=case.seed + 77))
            refs = reference(case, xs, idxs, ws, M)
        x = to(xs[rank], device)
        if not fp8:
            x.requires_grad_(True)
        w = to(ws[rank], device).requires_grad_(True)
        with outputs.poisoned():
            if step == "fresh":
                out = ops.dispatch(buf, x, idxs[rank].to(device), w, num_experts=case.num_experts,
                                   num_max_tokens_per_rank=case.max_tokens or None, expert_alignment=case.alignment,
                                   do_cpu_sync=case.do_cpu_sync, do_expand=case.do_expand,
                                   use_tma_aligned_col_major_sf=case.col_major_sf,
                                   cumulative_local_expert_recv_stats=stats)
                handle = out[3]
            else:
                out = ops.dispatch(buf, x, topk_weights=w, handle=handle, use_tma_aligned_col_major_sf=case.col_major_sf,
                                   cumulative_local_expert_recv_stats=stats)
                assert out[3] is handle
        check_forward(out, refs[rank], device, buf)
        recv_x, recv_idx, recv_w = out[:3]
        gen = torch.Generator().manual_seed(seed + (step == "cached"))
        dense_g, dense_q = dense_upstream(case, gen, R)
        per_rank = [upstream_rows(case, ref_handles[d], refs[d].recv_topk_idx, dense_g, dense_q, gen, d)
                    for d in range(R)]
        rows_g, rows_q = per_rank[rank]
        data = recv_x[0] if fp8 else recv_x
        loss = (recv_w * rows_q.to(device)).sum()
        if not fp8:
            loss = loss + (data.float() * rows_g.to(device)).sum()
        with outputs.poisoned():
            loss.backward()
        settle(device)
        # topk_weights: a pure gather, exact
        valid = idx_all >= 0
        lo, hi = offsets(case)[rank], offsets(case)[rank + 1]
        want_w = torch.where(valid, dense_q, 0.0)[lo:hi]
        assert bits_equal(w.grad.cpu(), want_w), f"{case.name} {step}: topk_weights gradient{recorded_gpu_error(buf)}"
        if fp8:
            continue
        # x: the reference's combine of the rows' bf16 gradients, exactly
        ys = [p[0].to(BF16) for p in per_rank]
        want_x = reference_combine(ys, ref_handles)[rank][0]
        assert bits_equal(x.grad.cpu(), want_x), f"{case.name} {step}: x gradient vs reference_combine{recorded_gpu_error(buf)}"
        # and the dense float32 equivalent, within the bf16 roundings (unit roundoff u = 2^-8): each
        # term's, each rank's partial's and the result's, at most 3u of the sum of |terms| (plus the
        # float32 additions, far below)
        dense, bound = dense_x_grad(case, idx_all, dense_g, R)
        err = (x.grad.cpu().float() - dense[lo:hi]).abs()
        limit = (3 * 2.0 ** -8 + 2.0 ** -20) * bound[lo:hi] + 1e-30
        assert (err <= limit).all(), f"{case.name} {step}: x gradient vs dense, max excess {(err - limit).max()}"
    # both dispatches counted their received pairs per local expert
    assert torch.equal(stats.cpu(), 3 + 2 * ref_handles[rank].num_unaligned_recv_tokens_per_expert), case.name
    del out, recv_x, recv_idx, recv_w, handle, loss
    gc.collect()
    assert not check_leaks or ops.num_live_handles() == 0, "handles must not outlive their tensors"


def check_combine_grads(buf, case: Case, rank: int, R: int, device, seed: int, check_leaks: bool = True) -> None:
    """Forward and gradients of ``ops.combine`` (x, topk_weights, two biases; or the dispatch weights
    with ``apply_dispatch_weights``) on the layout of a fresh dispatch (``check_leaks`` as in
    `check_dispatch_grads`)."""
    from deep_ep import ops
    from deep_ep.backends import outputs
    from deep_ep.reference import reference_combine
    M = case.max_tokens or MAX_TOKENS
    xs, idxs, ws = make_inputs(case)
    refs = reference(case, xs, idxs, ws, M)
    apply_w = case.apply_dispatch_weights
    w = to(ws[rank], device).requires_grad_(apply_w)
    _, recv_idx, recv_w, handle = ops.dispatch(
        buf, to(xs[rank], device), idxs[rank].to(device), w, num_experts=case.num_experts,
        num_max_tokens_per_rank=case.max_tokens or None, expert_alignment=case.alignment,
        do_cpu_sync=case.do_cpu_sync, do_expand=case.do_expand)
    settle(device)   # the copies to the device below would wait for the dispatch inside the driver
    gen = torch.Generator().manual_seed(seed)
    N, H, K = offsets(case)[-1], case.hidden, case.num_topk
    lo, hi = offsets(case)[rank], offsets(case)[rank + 1]
    ys, tws, valids = [], [], []
    for d in range(R):
        rows = refs[d].handle.num_recv_rows
        _, _, valid = global_rows(refs[d].handle, case)
        y = torch.randn((rows, H), generator=gen).to(BF16)
        y[~valid] = float("nan")        # never read
        tw = torch.rand((rows,) if case.do_expand else (rows, K), generator=gen)
        tw[~valid] = float("nan")
        ys.append(y)
        tws.append(tw)
        valids.append(valid)
    biases = [tuple(torch.randn((T, H), generator=gen).to(BF16) for _ in range(case.num_bias))
              for T in case.num_tokens]
    with_tw = case.combine_weights
    y = to(ys[rank], device).requires_grad_(True)
    tw = to(tws[rank], device).requires_grad_(True) if with_tw else None
    bias = tuple(to(b, device).requires_grad_(True) for b in biases[rank])
    with outputs.poisoned():
        combined, cw = ops.combine(buf, y, handle, topk_weights=tw, bias=bias or None, apply_dispatch_weights=apply_w)
    want = reference_combine(ys, [r.handle for r in refs], tws if with_tw else None,
                             [b or None for b in biases], allow_multiple_reduction=buf.allow_multiple_reduction,
                             apply_dispatch_weights=apply_w)[rank]
    settle(device)
    assert bits_equal(combined.cpu(), want[0]), f"{case.name}: combined_x{recorded_gpu_error(buf)}"
    assert (cw is None) == (not with_tw) and (cw is None or bits_equal(cw.cpu(), want[1])), f"{case.name}: cw"

    U, V = torch.randn((N, H), generator=gen), torch.randn((N, K), generator=gen)
    loss = (combined.float() * U[lo:hi].to(device)).sum()
    if with_tw:
        loss = loss + (cw * V[lo:hi].to(device)).sum()
    with outputs.poisoned():
        loss.backward()
    settle(device)
    # dense equivalent: every row of a token added to the token's output; autograd gives each row
    # the output gradient of its token (bf16, as the output is), rows without data nothing
    g, slot, valid = global_rows(ops.ep_handle(handle), case)
    u16 = U.to(BF16).float()
    if apply_w:   # the row entered as w_r * y_r: it gets w_r * g_r, and w_r gets sum_h y_r * g_r
        want_gy = torch.where(valid.unsqueeze(1), u16[g], 0.0) * recv_w.detach().cpu().unsqueeze(1)
    else:
        y_dense = ys[rank].float().nan_to_num().requires_grad_(True)
        dense_out = torch.zeros((N, H)).index_add(0, g[valid], y_dense[valid])
        (dense_out * u16).sum().backward()
        want_gy = y_dense.grad
    assert bits_equal(y.grad.cpu(), want_gy.to(BF16)), f"{case.name}: x gradient{recorded_gpu_error(buf)}"
    for b in bias:
        assert bits_equal(b.grad.cpu(), U[lo:hi].to(BF16)), f"{case.name}: bias gradient"
    if with_tw:
        if case.do_expand:
            want_tw = torch.where(valid, V[g, slot.clamp(min=0)], 0.0)
        else:
            want_tw = torch.where(valid.unsqueeze(1) & (recv_idx.cpu() >= 0), V[g], 0.0)
        assert bits_equal(tw.grad.cpu(), want_tw), f"{case.name}: topk_weights gradient"
    if apply_w:
        # float32 sums over the hidden size, in another order than autograd's: 2^-20 relative
        want_w, scale = dispatch_weight_grads(refs, ys, u16, case, R)
        err = (w.grad.cpu() - want_w[lo:hi]).abs()
        assert (err <= 2.0 ** -20 * scale[lo:hi] + 1e-30).all(), f"{case.name}: dispatch weights gradient"
    del combined, cw, loss, handle, recv_w
    gc.collect()
    assert not check_leaks or ops.num_live_handles() == 0, "handles must not outlive their tensors"


def dispatch_weight_grads(refs, ys, u16, case: Case, R: int) -> tuple:
    """float32 ``[N, K]`` each: for every (token, slot), ``sum_h y * g`` of its row at the owner rank
    (``g`` the bf16 output gradient), and ``sum_h |y * g|``."""
    N, K = offsets(case)[-1], case.num_topk
    out, scale = torch.zeros((N, K)), torch.zeros((N, K))
    for d in range(R):
        g, slot, valid = global_rows(refs[d].handle, case)
        prod = ys[d].float().nan_to_num() * u16[g]
        out[g[valid], slot[valid]] = prod.sum(1)[valid]
        scale[g[valid], slot[valid]] = prod.abs().sum(1)[valid]
    return out, scale


def cases(R: int) -> list:
    """Dispatch and combine configurations for ``R`` ranks."""
    tok = {1: [[10], [7], [0]], 2: [[9, 6], [11, 0], [4, 12]], 4: [[6, 0, 9, 4], [3, 12, 1, 8], [5, 5, 5, 5]]}[R]
    E = {1: 4, 2: 8, 4: 16}[R]
    return [
        Case(f"R{R}-flat-sync", R, tok[0], hidden=64, num_topk=3, num_experts=E, seed=11),
        Case(f"R{R}-flat-nosync", R, tok[1], hidden=64, num_topk=3, num_experts=E, do_cpu_sync=False,
             max_tokens=MAX_TOKENS, num_bias=1, seed=12),
        Case(f"R{R}-expand-sync", R, tok[2], hidden=64, num_topk=4, num_experts=E, do_expand=True, num_bias=2, seed=13),
        Case(f"R{R}-expand-A4-nosync-dup", R, tok[0], hidden=64, num_topk=4, num_experts=E, do_expand=True,
             alignment=4, do_cpu_sync=False, max_tokens=MAX_TOKENS, duplicate_prob=0.3, seed=14),
        Case(f"R{R}-expand-A2-apply", R, tok[1], hidden=64, num_topk=3, num_experts=E, do_expand=True, alignment=2,
             apply_dispatch_weights=True, combine_weights=False, num_bias=1, seed=15),
    ]


def fp8_cases(R: int) -> list:
    tok = {1: [8], 2: [7, 10], 4: [5, 9, 0, 6]}[R]
    E = {1: 4, 2: 8, 4: 16}[R]
    return [Case(f"R{R}-fp8-expand", R, tok, hidden=256, num_topk=3, num_experts=E, x_format="fp8", do_expand=True,
                 alignment=2, seed=21),
            Case(f"R{R}-fp8-ue8m0-flat-colmajor-nosync", R, tok, hidden=512, num_topk=2, num_experts=E,
                 x_format="fp8_ue8m0", col_major_sf=True, do_cpu_sync=False, max_tokens=MAX_TOKENS, seed=22)]


# ---------------------------------------------------------------------------------------------- rank bodies
def _grads_rank(rank, R):
    import torch.distributed as dist
    import deep_ep
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=MAX_TOKENS)
    for i, case in enumerate(cases(R) + fp8_cases(R)):
        if not case.apply_dispatch_weights:
            check_dispatch_grads(buf, case, rank, R, torch.device("cpu"), seed=900 + i)
        if case.x_format == "bf16":
            check_combine_grads(buf, case, rank, R, torch.device("cpu"), seed=950 + i)
    # a buffer that reduces expanded rows in one pass: combine's x gradient is the same
    single = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=MAX_TOKENS, allow_multiple_reduction=False)
    case = dataclasses.replace(cases(R)[2], name=f"R{R}-single-reduction", combine_weights=False)
    check_combine_grads(single, case, rank, R, torch.device("cpu"), seed=990)
    dist.barrier()
    return True


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_gradients(tmp_path, num_ranks):
    assert run_gloo_ranks(_grads_rank, num_ranks, tmp_path, deadline=300) == {r: True for r in range(num_ranks)}
