"""deep_ep.ops under torch.compile, the operators' registrations, bad input, and the reference MoE
layer (deep_ep.moe) against its dense single-process equivalent; CPU backend over gloo.

* compile: ``torch._dynamo.explain`` of functions calling dispatch (fresh and cached) and combine,
  and of the MoE layer, reports one graph and no break; ``torch.compile(fullgraph=True,
  backend="aot_eager")`` gives the eager results bit for bit, forward and backward, with and without
  a host sync (data-dependent and worst-case row counts);
* ``torch.library.opcheck`` of the three operators (schema, autograd registration, fake tensors; and
  AOT dispatch for the two that create no handle: a fresh dispatch's token differs from call to call
  by design);
* bad arguments raise TypeError / ValueError on every rank, before any communication (the next
  correct call still works);
* `deep_ep.moe.MoELayer` on 2 and 4 ranks against `deep_ep.moe.DenseMoE` with the same parameters
  and tokens: outputs, input gradients and every parameter gradient (the gate's summed over ranks),
  for both gates, both layouts, alignment, no host sync, fused gate weights, grouped GEMM and the
  loop over experts;
* examples/train_moe.py on 2 ranks: the loss goes down and follows the dense model's.

The helpers take a buffer and a device, so tests/gpu/test_gpu_ops.py runs them on the H200.
"""
from __future__ import annotations

import gc

import pytest
import torch

from proc_utils import run_gloo_ranks

BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------- compile
def routing_inputs(rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int, device, seed: int = 0):
    """This rank's ``(x bf16, topk_idx, topk_weights, bias bf16)``, random, a quarter of the slots masked."""
    g = torch.Generator().manual_seed(seed + 31 * rank)
    x = torch.randn((num_tokens, hidden), generator=g).to(BF16)
    idx = torch.rand((num_tokens, num_experts), generator=g).topk(num_topk, dim=1).indices
    idx[torch.rand((num_tokens, num_topk), generator=g) < 0.25] = -1
    w = torch.rand((num_tokens, num_topk), generator=g)
    b = torch.randn((num_tokens, hidden), generator=g).to(BF16)
    return x.to(device), idx.to(device), w.to(device), b.to(device)


def ops_function(buf, topk_idx, num_experts: int, do_expand: bool, do_cpu_sync: bool, expert_alignment: int):
    """A function of ``(x, topk_weights, bias)`` through a dispatch, a cached dispatch with weights and
    a combine with weights and a bias, returning ``(loss, combined_x, combined_topk_weights)``.
    Its arithmetic around the operators is exact or rounds the same way in every backend."""
    from deep_ep import ops

    def fn(x, w, b):
        recv_x, _, recv_w, handle = ops.dispatch(buf, x, topk_idx, w, num_experts=num_experts,
                                                 expert_alignment=expert_alignment, do_cpu_sync=do_cpu_sync,
                                                 do_expand=do_expand)
        again, _, again_w, _ = ops.dispatch(buf, (x.float() * 0.5).to(BF16), topk_weights=w * 2, handle=handle)
        y = (recv_x.float() * 2 + again.float()).to(BF16)
        combined, combined_w = ops.combine(buf, y, handle, topk_weights=recv_w * again_w, bias=b)
        loss = (combined.float() * combined.float()).sum() + (combined_w * combined_w).sum()
        return loss, combined, combined_w
    return fn


def run_with_grads(fn, inputs) -> list:
    """``fn``'s outputs and the gradients of its inputs after ``outputs[0].backward()``."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs[0].backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves if t.requires_grad]


def explain(fn, inputs) -> tuple:
    """``(graphs, graph breaks, reasons)`` that ``torch._dynamo.explain`` reports for ``fn(*inputs)``.

    ``explain`` traces without ``fullgraph``, where dynamo stops at an operator with a data-dependent
    output shape (a dispatch that synchronises with the host) unless
    ``capture_dynamic_output_shape_ops`` is set; ``torch.compile(fullgraph=True)`` sets it itself."""
    import torch._dynamo
    torch._dynamo.reset()
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report = torch._dynamo.explain(fn)(*leaves)
    torch._dynamo.reset()
    return report.graph_count, report.graph_break_count, [str(r.reason) for r in report.break_reasons]


def check_compiled(fn, inputs, backend: str, tolerance: float = 0.0) -> None:
    """``fn`` compiles with ``fullgraph=True`` as one graph without a break, and the compiled function's
    outputs and input gradients equal eager ones: bit for bit with ``tolerance=0`` (but for the first
    output, a loss, which a fusing backend may sum in another order: float32 rounding), else within
    ``tolerance`` of each tensor's largest element (a backend that fuses the arithmetic around the
    operators rounds it differently)."""
    from ep_cases import bits_equal
    graphs, breaks, reasons = explain(fn, inputs)
    assert (graphs, breaks) == (1, 0), f"{graphs} graphs, {breaks} breaks: {reasons}"
    eager = run_with_grads(fn, inputs)
    compiled = run_with_grads(torch.compile(fn, fullgraph=True, backend=backend), inputs)
    for i, (a, b) in enumerate(zip(compiled, eager)):
        a, b = a.cpu(), b.cpu()
        if tolerance:
            assert (a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max(), i
        elif i == 0:
            assert torch.allclose(a, b, rtol=1e-5), (i, a, b)
        else:
            assert bits_equal(a, b), f"output {i} differs between compiled and eager"


def moe_function(layer, target):
    def fn(x):
        out = layer(x)
        return ((out - target) ** 2).sum(), out
    return fn


def compile_configurations():
    """``(do_expand, do_cpu_sync, expert_alignment)`` triples of the compile tests."""
    return [(False, True, 1), (False, False, 1), (True, True, 4), (True, False, 2)]


def _compile_rank(rank, R):
    import torch.distributed as dist
    import deep_ep
    from deep_ep import moe
    torch._dynamo.config.cache_size_limit = 64
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=16)
    E, H, K = 8, 32, 3
    x, idx, w, b = routing_inputs(rank, 10 + 3 * rank, H, E, K, "cpu")
    for do_expand, sync, A in compile_configurations():
        check_compiled(ops_function(buf, idx, E, do_expand, sync, A), (x, w, b), "aot_eager")
    params = moe.moe_parameters(H, 16, E, generator=torch.Generator().manual_seed(5))
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))
    for kwargs in (dict(do_expand=True, expert_alignment=4), dict(do_expand=False, do_cpu_sync=False)):
        layer = moe.MoELayer(buf, params, K, **kwargs)
        check_compiled(moe_function(layer, target), (x.float(),), "aot_eager")
        layer.zero_grad()
    gc.collect()
    from deep_ep import ops
    assert ops.num_live_handles() == 0
    return True


def test_compile_no_graph_break_and_equal_to_eager(tmp_path):
    assert run_gloo_ranks(_compile_rank, 2, tmp_path, deadline=400) == {0: True, 1: True}


# ---------------------------------------------------------------------------------------------- opcheck
def _opcheck_rank(rank, R):
    import torch.distributed as dist
    import deep_ep
    from deep_ep import ops
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=12)
    E, H, K, T = 8, 16, 3, 6 + rank
    x, idx, w, _ = routing_inputs(rank, T, H, E, K, "cpu", seed=3)
    x.requires_grad_(True)
    w.requires_grad_(True)
    results = []
    for sync in (True, False):
        for expand in (False, True):
            args = (buf.buffer_id, x, None, idx, w, R, E, 12, 2, 0, sync, expand, False)
            results.append(torch.library.opcheck(torch.ops.deep_ep.dispatch.default, args,
                                                 test_utils=("test_schema", "test_autograd_registration",
                                                             "test_faketensor")))
            _, _, recv_w, handle = ops.dispatch(buf, x.detach(), idx, w.detach(), num_experts=E, do_expand=expand,
                                                do_cpu_sync=sync, expert_alignment=2)
            y = torch.randn((handle.num_recv_rows, H)).to(BF16).requires_grad_(True)
            tw = torch.rand(recv_w.shape).requires_grad_(True)
            results.append(torch.library.opcheck(
                torch.ops.deep_ep.combine.default,
                (buf.buffer_id, handle.token, y, tw, None, None, None, T, K, 0, expand)))
            results.append(torch.library.opcheck(
                torch.ops.deep_ep.cached_dispatch.default,
                (buf.buffer_id, handle.token, x, None, w, handle.num_recv_rows, K, 0, expand, False)))
    return [set(r.values()) for r in results]


def test_opcheck(tmp_path):
    out = run_gloo_ranks(_opcheck_rank, 2, tmp_path, deadline=300)
    for rank in out:
        assert all(r == {"SUCCESS"} for r in out[rank]), out[rank]


# ---------------------------------------------------------------------------------------------- bad input
def check_bad_input(buf, other, rank: int, device) -> None:
    """Each bad call raises the named error on every rank before communicating: a correct call
    after them still works (every rank reaches it together)."""
    from deep_ep import ops
    E, H, K = 8, 32, 2
    x, idx, w, _ = routing_inputs(rank, 6, H, E, K, device, seed=9)
    handle = ops.dispatch(buf, x, idx, w, num_experts=E, do_expand=True)[3]
    unweighted = ops.dispatch(buf, x, idx, None, num_experts=E, do_expand=True)[3]
    fp8 = (x.float().to(torch.float8_e4m3fn).requires_grad_(True), torch.ones((6, 1), device=device))
    rows = torch.zeros((handle.num_recv_rows, H), dtype=BF16, device=device)
    bad = [
        (TypeError, lambda: ops.dispatch(object(), x, idx, w, num_experts=E)),
        (ValueError, lambda: ops.dispatch(buf, x, idx, w)),                       # no num_experts
        (TypeError, lambda: ops.dispatch(buf, x.float(), idx, w, num_experts=E)),  # the buffer's check
        (ValueError, lambda: ops.dispatch(buf, x, idx, w[:, :1], num_experts=E)),
        (ValueError, lambda: ops.dispatch(buf, fp8, idx, w, num_experts=E)),      # FP8 is forward only
        (TypeError, lambda: ops.dispatch(buf, x, handle=ops.ep_handle(handle))),
        (ValueError, lambda: ops.dispatch(other, x, handle=handle)),
        (ValueError, lambda: ops.dispatch(buf, x, idx, handle=handle)),
        (ValueError, lambda: ops.dispatch(buf, x, idx, w, num_experts=E, do_cpu_sync=False, num_max_tokens_per_rank=0)),
        (TypeError, lambda: ops.dispatch(buf, x, idx, w, num_experts=E, cumulative_local_expert_recv_stats=torch.zeros(
            E // 2, dtype=torch.int64, device=device))),
        (TypeError, lambda: ops.combine(buf, rows, ops.ep_handle(handle))),
        (ValueError, lambda: ops.combine(other, rows, handle)),
        (ValueError, lambda: ops.combine(buf, rows[1:], handle)),
        (ValueError, lambda: ops.combine(buf, rows, unweighted, apply_dispatch_weights=True)),
        (ValueError, lambda: ops.dispatch(other, x, idx, w.requires_grad_(True), num_experts=E, do_expand=True)),
    ]
    for i, (error, call) in enumerate(bad):
        with pytest.raises(error):
            call()
        w.requires_grad_(False)
    assert unweighted.recv_topk_weights is None
    combined, _ = ops.combine(buf, rows, handle)
    assert combined.shape == (6, H) and not combined.any()


def _bad_input_rank(rank, R):
    import torch.distributed as dist
    import deep_ep
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=12)
    other = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=12, allow_multiple_reduction=False)
    check_bad_input(buf, other, rank, torch.device("cpu"))
    return True


def test_bad_input_raises_on_every_rank(tmp_path):
    assert run_gloo_ranks(_bad_input_rank, 2, tmp_path, deadline=120) == {0: True, 1: True}


# ---------------------------------------------------------------------------------------------- MoE layer
def moe_configurations() -> list:
    """Keyword arguments of `deep_ep.moe.MoELayer` the MoE tests cover (activation is the
    parameters')."""
    v3 = dict(gate="deepseek_v3", num_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    return [
        dict(activation="swiglu", do_expand=True),
        dict(activation="gelu", do_expand=False, renormalize=False, use_grouped_mm=False),
        dict(activation="swiglu", do_expand=True, expert_alignment=4, do_cpu_sync=False, fuse_gate_weights=True, **v3),
        dict(activation="swiglu", do_expand=False, do_cpu_sync=False, use_grouped_mm=True, **v3),
        dict(activation="gelu", do_expand=True, expert_alignment=2, use_grouped_mm=False, **v3),
    ]


def check_moe_layer(buf, rank: int, R: int, config: dict, device, all_reduce, num_tokens: list, seed: int,
                    output_units: float = 3, gradient_fraction: float = 2.0 ** -6) -> None:
    """`MoELayer` on this rank against `DenseMoE` on every rank's tokens, same parameters.

    Tolerances: the two compute the same bf16 and float32 operations on the same values, except that
    combine sums each rank's partial (rounded to bf16) and the dense model sums all slots at once, in
    another order; with bf16's unit roundoff u = 2^-8, the partials' roundings cost at most u of the
    sum of the terms' magnitudes and each side's final rounding u of the output: 3u of the sum of
    |terms| in all. A gradient is a few products of such values with the same bf16 roundings on both
    sides: we allow 2^-6 (4u) of its largest element. (``output_units`` and ``gradient_fraction`` set
    these two; a GPU, whose bf16 matrix products round differently from the CPU's dense model, needs
    more.)

    ``all_reduce(t)`` sums a tensor over the ranks in place (the replicated gate's gradient).
    """
    from deep_ep import moe
    E, H, F, K = 4 * max(R, 2), 32, 16, 3    # 8 experts at least: the V3 gate picks 3 from 2 of 4 groups
    config = dict(config)
    activation = config.pop("activation")
    params = moe.moe_parameters(H, F, E, activation=activation, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn((T, H), generator=gen) for T in num_tokens]
    targets = [torch.randn((T, H), generator=gen) for T in num_tokens]
    lo = sum(num_tokens[:rank])
    hi = lo + num_tokens[rank]
    gate_keys = ("gate", "renormalize", "num_groups", "topk_groups", "routed_scaling_factor")
    dense = moe.DenseMoE(params, K, **{k: v for k, v in config.items() if k in gate_keys})
    layer = moe.MoELayer(buf, {k: v.to(device) for k, v in params.items()}, K, **config)

    x = xs[rank].to(device, copy=True).requires_grad_(True)
    target = targets[rank].to(device, copy=True)   # before the layer's kernels are queued (emulated ranks)
    out = layer(x)
    ((out - target) ** 2).sum().backward()
    for p in layer.replicated_parameters():
        all_reduce(p.grad)
    x_all = torch.cat(xs).requires_grad_(True)
    dense_out = dense(x_all)
    ((dense_out - torch.cat(targets)) ** 2).sum().backward()

    name = f"R{R} {activation} {config}"
    idx, w = layer.route(x)
    want_idx, want_w = dense.route(x_all)
    assert torch.equal(idx.cpu(), want_idx[lo:hi]), f"{name}: the routing differs (a near tie in the gate?)"
    # the output bound: the sum of |terms| of every token
    terms = torch.zeros((x_all.shape[0], H))
    xb = x_all.detach().to(BF16)
    for e in range(E):
        tok, slot = (want_idx == e).nonzero(as_tuple=True)
        y = moe.expert_mlp(xb[tok], params["w1"][e], params["w2"][e], params["w3"][e] if "w3" in params else None)
        terms.index_add_(0, tok, (y.float() * want_w[tok, slot].detach().unsqueeze(1)).abs())
    err = (out.detach().cpu().float() - dense_out.detach()[lo:hi].float()).abs()
    limit = output_units * 2.0 ** -8 * terms[lo:hi] + 1e-30
    assert (err <= limit).all(), f"{name}: output, max excess {(err - limit).max()}"
    L = E // R
    local = slice(rank * L, (rank + 1) * L)
    pairs = [("x", x.grad, x_all.grad[lo:hi]), ("gate_weight", layer.gate_weight.grad, dense.gate_weight.grad),
             ("w1", layer.w1.grad, dense.w1.grad[local]), ("w2", layer.w2.grad, dense.w2.grad[local])]
    if layer.w3 is not None:
        pairs.append(("w3", layer.w3.grad, dense.w3.grad[local]))
    for what, got, want in pairs:
        if want.numel() == 0:     # a rank without tokens
            assert got is not None and got.numel() == 0
            continue
        assert got is not None and want.abs().max() > 0, f"{name}: {what} has no gradient"
        err = (got.cpu() - want).abs().max()
        assert err <= gradient_fraction * want.abs().max(), f"{name}: {what} gradient off by {err} (max {want.abs().max()})"


def _moe_rank(rank, R):
    import torch.distributed as dist
    import deep_ep
    from deep_ep import ops
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=24)
    tokens = {2: [20, 13], 4: [9, 17, 0, 12]}[R]
    for i, config in enumerate(moe_configurations()):
        check_moe_layer(buf, rank, R, config, torch.device("cpu"), dist.all_reduce, tokens, seed=40 + i)
    gc.collect()
    assert ops.num_live_handles() == 0
    return True


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_moe_layer_matches_dense(tmp_path, num_ranks):
    assert run_gloo_ranks(_moe_rank, num_ranks, tmp_path, deadline=300) == {r: True for r in range(num_ranks)}


# ---------------------------------------------------------------------------------------------- the example
def test_training_example_cpu():
    """examples/train_moe.py (2 spawned gloo ranks, 300 steps): the loss goes down and matches the
    dense model's within the example's tolerance (it exits 0 only then)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "train_moe.py")], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "went down" in proc.stdout and "within the tolerance" in proc.stdout, proc.stdout


def _empty_rank_sum_loss(rank, R):
    """Rank 1 has no tokens and the loss is a plain sum: autograd hands it [0, H] gradients of strides
    (0, 0), which a dtype-changing view rejected (found by a new-user trial). x's gradient is 2 per
    rank a token visited, exactly; rank 1's is empty."""
    import torch.distributed as dist
    import deep_ep
    from deep_ep import ops
    E, H, K, T = 8, 16, 2, 6
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=T)
    g = torch.Generator().manual_seed(11 + rank)
    num_tokens = 0 if rank == 1 else T
    x = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)]) if num_tokens else \
        torch.empty(0, K, dtype=torch.int64)
    for do_expand in (False, True):
        x.grad = None
        recv_x, _, _, handle = ops.dispatch(buf, x, idx, num_experts=E, do_expand=do_expand)
        out, _ = ops.combine(buf, (recv_x.float() * 2).to(torch.bfloat16), handle)
        out.float().sum().backward()
        visited = torch.stack([torch.div(idx, E // R, rounding_mode="floor") == r for r in range(R)], 2).any(1)
        per_token = visited.sum(1) if not do_expand else torch.full((num_tokens,), K)
        assert x.grad.shape == (num_tokens, H)
        assert torch.equal(x.grad.float(), 2 * per_token.float()[:, None].expand(num_tokens, H)), (rank, do_expand)
    buf.destroy()
    return True


def test_a_rank_without_tokens_backpropagates_a_sum_loss(tmp_path):
    assert run_gloo_ranks(_empty_rank_sum_loss, 2, tmp_path, deadline=120) == {0: True, 1: True}


def _non_contiguous_inputs(rank, R):
    """Transposed (non-contiguous) x for dispatch and combine give the outputs and gradients of their
    dense copies (the operators copy them; `ElasticBuffer` refuses them, as DeepEP)."""
    import torch.distributed as dist
    import deep_ep
    from deep_ep import ops
    E, H, K, T = 8, 16, 2, 6
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=60, num_max_tokens_per_rank=T)
    g = torch.Generator().manual_seed(21 + rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    base = torch.randn(H, T, generator=g).to(torch.bfloat16)
    results = []
    for dense in (True, False):
        leaf = base.clone().requires_grad_()
        x = leaf.t().contiguous() if dense else leaf.t()
        assert x.is_contiguous() == dense
        recv_x, _, _, handle = ops.dispatch(buf, x, idx, num_experts=E)
        y = (recv_x.float().t() * 3).to(torch.bfloat16).t()          # non-contiguous when fed as is
        out, _ = ops.combine(buf, y.contiguous() if dense else y, handle)
        (out.float() * torch.arange(H, dtype=torch.float32)).sum().backward()
        results.append((out.detach(), leaf.grad))
    assert torch.equal(results[0][0].view(torch.int16), results[1][0].view(torch.int16))
    assert torch.equal(results[0][1].view(torch.int16), results[1][1].view(torch.int16))
    buf.destroy()
    return True


def test_operators_take_non_contiguous_inputs(tmp_path):
    assert run_gloo_ranks(_non_contiguous_inputs, 2, tmp_path, deadline=120) == {0: True, 1: True}
