"""What one node has, across emulated nodes: CUDA graphs, EPLB and the training operators, each with a
rank that has no tokens, in direct mode (``allow_hybrid_mode=False``) and hybrid mode.

One GPU acts as nodes of 2 ranks (`deep_ep.emulated.EmulatedGroup` with ``num_nvlink_ranks=2``, the
emulated GIN between nodes; tests/gpu/test_gpu_scaleout.py covers the plain calls):

* CUDA graphs: every rank's fresh dispatch with ``do_cpu_sync=False`` and its combine (weights, a
  bias), captured in one graph by one thread (`deep_ep.bench.rank_graphs.capture_rank_calls`, a branch
  per rank), replayed with a fresh routing and fresh data copied into the static inputs and every
  output (the handle's words included) poisoned first; after each replay every rank's dispatch
  outputs, handle and combine equal `deep_ep.reference` bit for bit (hybrid mode: the reference's
  hybrid combine order and per-scale-up-rank prefix sums);
* EPLB: a hierarchical plan over the nodes (every group's replicas on one node), the replica map on
  the GPU equal to the CPU's, dispatch to the replicas and combine equal bit for bit to the run
  without replicas, the received counts per replica those of the reference;
* the training operators: the gradient checks of tests/test_ops.py (deep_ep.ops, dispatch fresh and
  cached, combine, FP8 forward) on 2 nodes x 2, and ``torch.compile(fullgraph=True)`` (aot_eager) of
  a dispatch + cached dispatch + combine equal to eager, outputs and gradients.

The emulated NIC's seed is ``DEEP_EP_GIN_SEED`` (default 7), in the test ids with the mode and the
split. Skipped without a CUDA device; run with
``EXTRA_FILES="tests/gpu/test_gpu_scaleout_features.py" bash tools/device_suite.sh extra``.
"""
from __future__ import annotations

import functools
import os
import sys
import time
import types

import pytest
import torch

GPU_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(GPU_TESTS))
sys.path.insert(0, GPU_TESTS)

import deep_ep  # noqa: E402
import test_eplb_ranks as eplb_cpu  # noqa: E402
import test_gpu_ops as gpu_ops  # noqa: E402
import test_ops as grads  # noqa: E402
import test_ops_ranks as ops_ranks  # noqa: E402
from deep_ep import reference as ref  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402
from ep_cases import bits_equal  # noqa: E402
from gpu_cases import case_seed, handle_to_cpu, random_routing, to_cpu  # noqa: E402
from test_gpu_scaleout import _group as scaleout_group  # noqa: E402
from test_scaleout_features_cpu import (REPLICA_SLOTS, expected_dispatch, hybrid_combine_order,  # noqa: E402
                                        replica_case)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GIN_SEED = int(os.environ.get("DEEP_EP_GIN_SEED", "7"))
MODES = ("direct", "hybrid")
TIMEOUT = 30   # seconds: a rank whose peer never comes reports it well within the suite's limit
TOKENS = (24, 0, 17, 9)   # per rank, cycled: rank 1 (and 5) has no tokens


def _nodes(nodes: int, per_node: int, mode: str, seed: int = GIN_SEED):
    """Emulated nodes (both modes run on them; ``mode`` picks the buffers' allow_hybrid_mode)."""
    return scaleout_group(nodes, per_node, seed, 2)


def _id(shape, mode, *more) -> str:
    return "-".join([f"{shape[0]}x{shape[1]}", mode, f"seed{GIN_SEED}", *map(str, more)])


def _expected_combine(mode: str, per_node: int, *args, **kwargs) -> list:
    """`reference_combine` in the order of the mode: hybrid mode rounds each node's partial."""
    combine = hybrid_combine_order(per_node) if mode == "hybrid" else ref.reference_combine
    return combine(*args, **kwargs)


# ------------------------------------------------------------------------------------------ CUDA graphs
GRAPH_HIDDEN, GRAPH_TOPK, GRAPH_MAX_TOKENS = 512, 4, 32
GRAPH_RUNS = [((2, 2), "direct", False), ((2, 2), "direct", True), ((2, 2), "hybrid", False),
              ((2, 2), "hybrid", True), ((4, 2), "direct", False), ((4, 2), "hybrid", False)]


@pytest.mark.parametrize("shape, mode, expand", GRAPH_RUNS,
                         ids=[_id(s, m, "expand" if e else "flat") for s, m, e in GRAPH_RUNS])
def test_graph_replays_fresh_dispatch_and_combine_with_fresh_routing(shape, mode, expand):
    from deep_ep.bench import rank_graphs
    from deep_ep.emulated import wait_for_stream
    nodes, per_node = shape
    R, H, K, M = nodes * per_node, GRAPH_HIDDEN, GRAPH_TOPK, GRAPH_MAX_TOKENS
    E, align = 4 * R, 4 if expand else 1
    tokens = [TOKENS[r % len(TOKENS)] for r in range(R)]
    dev = torch.device("cuda", 0)
    group = _nodes(nodes, per_node, mode)
    g = torch.Generator().manual_seed(case_seed("scaleout-graph", nodes, per_node, mode, expand, GIN_SEED))

    def new_inputs():
        return ([torch.randn((t, H), generator=g).to(torch.bfloat16) for t in tokens],
                [random_routing(t, E, K, g) for t in tokens], [torch.rand((t, K), generator=g) for t in tokens],
                [torch.randn((t, H), generator=g).to(torch.bfloat16) for t in tokens])
    # on the device before the ranks start: a copy from the host in a rank's thread could stall its peers
    statics = [dict(x=x.to(dev), idx=idx.to(dev), w=w.to(dev), bias=bias.to(dev))
               for x, idx, w, bias in zip(*new_inputs())]
    torch.cuda.synchronize()

    def setup(rank_group):
        static = statics[rank_group.rank()]
        static["buf"] = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                                              allow_hybrid_mode=mode == "hybrid", num_gpu_timeout_secs=TIMEOUT,
                                              num_cpu_timeout_secs=TIMEOUT)
        handle = _graph_step(static, E, M, expand, align, None)[3]   # kernels loaded, the plan made
        static["y"] = torch.zeros((handle.num_recv_rows, H), dtype=torch.bfloat16, device=dev)
        _graph_step(static, E, M, expand, align, static["y"])
        wait_for_stream()
        return static

    ranks = group.run(setup)
    try:
        captured = rank_graphs.capture_rank_calls(
            group, [functools.partial(_graph_step, s, E, M, expand, align, s["y"]) for s in ranks])
        assert captured is not None, "capturing every emulated rank's calls failed: see the warning printed above"
        graph, outs = captured
        for replay in range(3):
            xs, idxs, ws, biases = new_inputs()
            ys = [torch.randn(tuple(s["y"].shape), generator=g).to(torch.bfloat16) for s in ranks]
            for s, x, idx, w, bias, y in zip(ranks, xs, idxs, ws, biases, ys):
                for name, value in (("x", x), ("idx", idx), ("w", w), ("bias", bias), ("y", y)):
                    s[name].copy_(value)
            for s, (recv_x, recv_idx, recv_w, handle, combined) in zip(ranks, outs):
                own_topk = handle.topk_idx if handle.topk_idx.data_ptr() != s["idx"].data_ptr() else None
                for t in (recv_x, recv_idx, recv_w, combined, handle.backend_state.words, own_topk):
                    if t is not None and t.numel():
                        outputs.fill_poison(t)
            graph.replay()
            torch.cuda.synchronize()
            exp = expected_dispatch(mode == "hybrid", per_node, xs, idxs, ws, E, do_expand=expand,
                                    expert_alignment=align, do_cpu_sync=False, num_max_tokens_per_rank=M)
            want = _expected_combine(mode, per_node, ys, [e.handle for e in exp], None, biases)
            for rank, ((recv_x, recv_idx, recv_w, handle, combined), e) in enumerate(zip(outs, exp)):
                where = f"replay {replay}, rank {rank} ({tokens[rank]} tokens)"
                try:
                    ref.check_dispatch((to_cpu(recv_x), to_cpu(recv_idx), to_cpu(recv_w), handle_to_cpu(handle)),
                                       e, rank=rank)
                    ref.check_combine((combined.cpu(), None), (want[rank][0], None), rank=rank)
                except AssertionError as exc:
                    raise AssertionError(f"{where}: {exc}") from exc
        del graph, outs, captured
        torch.cuda.synchronize()
    finally:
        group.run(lambda rank_group: ranks[rank_group.rank()]["buf"].destroy())


def _graph_step(static: dict, num_experts: int, num_max_tokens: int, expand: bool, align: int, y):
    """A rank's fresh dispatch without CPU sync and (``y`` given) its combine with weights and a bias:
    ``(recv_x, recv_idx, recv_w, handle, combined or None)``."""
    buf = static["buf"]
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
        static["x"], static["idx"], static["w"], num_experts=num_experts, do_cpu_sync=False,
        num_max_tokens_per_rank=num_max_tokens, do_expand=expand, expert_alignment=align, do_zero_padding=True)
    combined = None if y is None else buf.combine(y, handle, bias=static["bias"])[0]
    return recv_x, recv_idx, recv_w, handle, combined


# ------------------------------------------------------------------------------------------------- EPLB
@pytest.mark.parametrize("mode", MODES, ids=lambda m: _id((2, 2), m))
def test_dispatch_to_replicas_across_nodes(mode):
    """tests/test_scaleout_features_cpu.py's replica case (a hierarchical plan, a group of experts per
    node; rank 1 without tokens): the GPU replica map equal to the CPU's; dispatch to the replicas
    with ``num_experts`` = replicas, experts computed from the logical id, combine: equal bit for bit
    to the run without replicas on every rank, and the received pairs per replica those of the
    reference."""
    from deep_ep.eplb import ReplicaMap
    nodes, per_node = 2, 2
    R, E, N = nodes * per_node, 16, REPLICA_SLOTS
    seed = case_seed("scaleout-eplb", nodes, per_node, mode, GIN_SEED)
    where = f"{_id((nodes, per_node), mode)}, inputs seed {seed}"
    dev = torch.device("cuda", 0)
    group = _nodes(nodes, per_node, mode)
    case = replica_case(nodes, per_node, seed)
    xs, ws, idx, p2l, T = case["xs"], case["ws"], case["idx"], case["p2l"], max(case["tokens"])
    rmap = ReplicaMap(p2l, case["l2p"], case["count"], device=dev)
    for r, i in enumerate(idx):   # the GPU map (its kernel loaded before the ranks start spinning)
        got = rmap.map(i.to(dev), token_offset=r * T).cpu()
        assert torch.equal(got, case["physical"][r]), f"{where}: rank {r}'s replica map"
    want_counts = [e.handle.num_unaligned_recv_tokens_per_expert
                   for e in ref.reference_dispatch(xs, case["physical"], ws, N)]
    # on the device before the ranks start: a copy from the host in a rank's thread could stall its peers
    on_device = [(x.to(dev), i.to(dev), w.to(dev)) for x, i, w in zip(xs, idx, ws)]
    logical = (torch.arange(E, device=dev), p2l.to(dev))
    torch.cuda.synchronize()

    def body(rank_group):
        r = rank_group.rank()
        x, topk, w = on_device[r]
        buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=T, hidden=xs[0].shape[1],
                                    num_topk=idx[0].shape[1], allow_hybrid_mode=mode == "hybrid",
                                    num_gpu_timeout_secs=TIMEOUT, num_cpu_timeout_secs=TIMEOUT)
        try:
            def run(ids, num_experts, logical_of, stats=None):
                with outputs.poisoned():
                    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
                        x, ids, w, num_experts=num_experts, cumulative_local_expert_recv_stats=stats)
                    local = num_experts // R
                    y = eplb_cpu._experts(recv_x, recv_idx, recv_w, logical_of[r * local:(r + 1) * local])
                    out, _, _ = buf.combine(y, handle)
                grads.settle(dev)
                return out.cpu()
            plain = run(topk, E, logical[0])
            stats = torch.zeros(N // R, dtype=torch.int32, device=dev)
            replicas = run(rmap.map(topk, token_offset=r * T), N, logical[1], stats)
            grads.settle(dev)
            return plain, replicas, stats.cpu()
        finally:
            buf.destroy()

    for r, (plain, replicas, stats) in enumerate(group.run(body)):
        assert bits_equal(plain, case["want"][r]), f"{where}: rank {r}, combine without replicas"
        assert bits_equal(replicas, plain), f"{where}: rank {r}, combine through the replicas"
        assert torch.equal(stats, want_counts[r].to(torch.int32)), f"{where}: rank {r}, received per replica"


# ------------------------------------------------------------------------------------ training operators
@pytest.fixture
def hybrid_order(monkeypatch):
    """Makes tests/test_ops.py's expected combines (and dispatch gradients) use the hybrid order of
    nodes of ``per_node`` ranks: ``hybrid_order(per_node)``."""
    def use(per_node: int) -> None:
        monkeypatch.setattr(ref, "reference_combine", hybrid_combine_order(per_node))
    return use


@pytest.mark.parametrize("mode", MODES, ids=lambda m: _id((2, 2), m))
def test_operator_gradients_across_nodes(mode, hybrid_order):
    """tests/test_ops.py's cases for 4 ranks (as 2 nodes x 2; rank 1 without tokens in several): the
    forward bit for bit, every gradient against the reference and the dense model."""
    group = _nodes(2, 2, mode)
    if mode == "hybrid":
        hybrid_order(2)

    def body(rank_group):
        buf = gpu_ops._buffer(rank_group, allow_hybrid_mode=mode == "hybrid")
        try:
            gpu_ops._gradient_cases(rank_group.rank(), 4, buf, group.device, check_leaks=False)
        finally:
            buf.destroy()
        return True

    gpu_ops._run_ranks(group, body)


def _own_code(fn, rank: int):
    """``fn`` with a code object of its own, so that each rank's graph is compiled for its own shapes,
    as with one process per rank (ranks sharing one code object would share dynamo's cache, and the
    second rank's token count would make dynamo mark that dimension dynamic)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_rank{rank}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


#: what dynamo raises when a compiled function is entered while any thread traces with FX
_NESTED_TRACE = "symbolically trace a dynamo-optimized function"


def _retry_during_trace(compiled, timeout_secs: float = 200.0):
    """``compiled`` called again while dynamo refuses to enter it because another rank's thread traces.

    torch's "FX is tracing" flag is one per process, not per thread: a rank entering its compiled
    function while another rank's graph is traced gets RuntimeError (seen on the H200: two ranks
    raised it at their compiled call, the other two then waited on the GPU for their calls). Dynamo
    raises it before running anything, so calling again is safe. One rank per process never meets it."""
    def call(*args):
        deadline = time.monotonic() + timeout_secs
        while True:
            try:
                return compiled(*args)
            except RuntimeError as exc:
                if _NESTED_TRACE not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    return call


COMPILE_CONFIGS = {"direct": (False, True, 1), "hybrid": (True, False, 2)}   # do_expand, do_cpu_sync, alignment


@pytest.mark.parametrize("mode", MODES, ids=lambda m: _id((2, 2), m, "expand{}-sync{}-align{}".format(
    *map(int, COMPILE_CONFIGS[m]))))
def test_compiled_operators_equal_eager_across_nodes(mode):
    """``torch.compile(fullgraph=True, backend="aot_eager")`` of tests/test_ops_ranks.py's function
    (fresh dispatch, cached dispatch, combine with weights and a bias) on every rank: its outputs
    and the gradients of x, the weights and the bias equal eager bit for bit (the loss within
    float32 rounding). The ranks compile one at a time (dynamo's lock), hence the long timeouts."""
    import torch._dynamo
    do_expand, do_cpu_sync, align = COMPILE_CONFIGS[mode]
    group = _nodes(2, 2, mode)
    E, H, K, T = 8, 64, 3, 12

    def body(rank_group):
        rank = rank_group.rank()
        buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                    allow_hybrid_mode=mode == "hybrid", num_gpu_timeout_secs=240,
                                    num_cpu_timeout_secs=240)
        try:
            x, idx, w, b = ops_ranks.routing_inputs(rank, 0 if rank == 1 else T - rank, H, E, K, group.device)
            fn = ops_ranks.ops_function(buf, idx, E, do_expand, do_cpu_sync, align)
            eager = ops_ranks.run_with_grads(fn, (x, w, b))
            compiled_fn = torch.compile(_own_code(fn, rank), fullgraph=True, backend="aot_eager")
            compiled = ops_ranks.run_with_grads(_retry_during_trace(compiled_fn), (x, w, b))
            grads.settle(group.device)
            for i, (got, want) in enumerate(zip(compiled, eager)):
                got, want = got.cpu(), want.cpu()
                same = torch.allclose(got, want, rtol=1e-5) if i == 0 else bits_equal(got, want)
                assert same, f"rank {rank}: output {i} differs from eager{grads.recorded_gpu_error(buf)}"
        finally:
            buf.destroy()
        return True

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(cache_size_limit=64):
            assert group.run(body) == [True] * 4
    finally:
        torch._dynamo.reset()
