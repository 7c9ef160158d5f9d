"""EPLB and the training operators on the CPU backend acting as 2 nodes x 2 (``EP_CPU_NUM_NVLINK_RANKS=2``,
4 gloo ranks), in hybrid and direct mode, rank 1 without tokens:

* EPLB: a hierarchical plan (every group of experts on one node), dispatch to the replicas and
  combine equal bit for bit to the run without replicas, the received counts per replica those of
  the reference;
* deep_ep.ops: tests/test_ops.py's gradient checks (hybrid mode: expanded without CPU sync, with
  duplicate experts; direct mode: flat with CPU sync), the expected combines in the mode's order;
* torch.compile(fullgraph=True, aot_eager) of tests/test_ops_ranks.py's function in hybrid mode: one
  graph, equal to eager, outputs and gradients.

The helpers at the top (the plan and inputs, the expected results per mode) are shared with
tests/gpu/test_gpu_scaleout_features.py, which runs the same on emulated nodes.
"""
from __future__ import annotations

import functools
import os

import torch

from proc_utils import run_gloo_ranks

NODES, PER_NODE = 2, 2
REPLICA_EXPERTS, REPLICA_SLOTS, REPLICA_TOPK, REPLICA_HIDDEN, REPLICA_TOKENS = 16, 24, 4, 128, 48


def expected_dispatch(hybrid: bool, per_node: int, *args, **kwargs) -> list:
    """`deep_ep.reference.reference_dispatch`; in hybrid mode each handle's
    ``psum_num_recv_tokens_per_scaleup_rank`` per scale-up rank (entry j: the tokens of rank j of
    every node, DeepEP's hybrid layout)."""
    from deep_ep import reference as ref
    results = ref.reference_dispatch(*args, **kwargs)
    if hybrid:
        for e in results:
            psum = e.handle.psum_num_recv_tokens_per_scaleup_rank
            counts = torch.diff(psum, prepend=psum.new_zeros(1))
            e.handle.psum_num_recv_tokens_per_scaleup_rank = torch.cumsum(
                counts.view(-1, per_node).sum(0), 0).to(torch.int32)
    return results


def hybrid_combine_order(per_node: int):
    """`deep_ep.reference.reference_combine` in the hybrid order of nodes of ``per_node`` ranks (each
    node's partial rounded to bf16): set it as the module's function for callers that look it up."""
    from deep_ep import reference as ref
    return functools.partial(ref.reference_combine, num_scaleup_ranks=per_node)


def replica_case(nodes: int, per_node: int, seed: int) -> dict:
    """Every rank's inputs (rank 1 without tokens; x in {-1, 0, 1} and weights in {1, 2}, so that every
    sum is exact in bf16 in any order) and a hierarchical EPLB plan over ``nodes`` nodes (a group of
    experts per node, experts 1 and 9 hot), checked: every group's replicas on one node, the hot
    experts replicated. Keys: tokens, idx, xs, ws, p2l, l2p, count, physical (the CPU map of idx,
    token offsets ``rank * REPLICA_TOKENS``), want (each rank's combine without replicas)."""
    from deep_ep.eplb import ReplicaMap, rebalance_experts
    R, E, N, K, H, T = (nodes * per_node, REPLICA_EXPERTS, REPLICA_SLOTS, REPLICA_TOPK, REPLICA_HIDDEN,
                        REPLICA_TOKENS)
    g = torch.Generator().manual_seed(seed)
    tokens = [0 if r == 1 else T for r in range(R)]
    idx = [torch.rand(t, E, generator=g).argsort(dim=1)[:, :K].contiguous() for t in tokens]
    for i in idx:
        i[torch.rand(i.shape, generator=g) < 0.1] = -1
    xs = [torch.randint(-1, 2, (t, H), generator=g).to(torch.bfloat16) for t in tokens]
    ws = [torch.randint(1, 3, (t, K), generator=g).to(torch.float32) for t in tokens]
    load = torch.ones(E, dtype=torch.float64)
    load[[1, 9]] = 12.0
    p2l, l2p, count = rebalance_experts(load, N, nodes, nodes, R)
    node_of_slot = torch.arange(N) // (N // R) // per_node
    for group_idx in range(nodes):
        held = node_of_slot[p2l // (E // nodes) == group_idx].unique()
        assert held.numel() == 1, f"seed {seed}: expert group {group_idx} on nodes {held.tolist()}, plan {p2l.tolist()}"
    assert count[1] >= 2 and count[9] >= 2, f"seed {seed}: the hot experts should be replicated, counts {count}"
    rmap = ReplicaMap(p2l, l2p, count)
    physical = [rmap.map(i, token_offset=r * T) for r, i in enumerate(idx)]
    want = [(sum(w[:, k:k + 1] * (i[:, k:k + 1] + 1) * (i[:, k:k + 1] >= 0) for k in range(K)) * x.float())
            .to(torch.bfloat16) for x, i, w in zip(xs, idx, ws)]
    return dict(tokens=tokens, idx=idx, xs=xs, ws=ws, p2l=p2l, l2p=l2p, count=count, physical=physical, want=want)


def _replicas(buf, case: dict, rank: int, world: int, where: str) -> None:
    from deep_ep import reference as ref
    from deep_ep.backends import outputs
    from ep_cases import bits_equal
    from test_eplb_ranks import _experts
    E, N = REPLICA_EXPERTS, REPLICA_SLOTS
    x, w = case["xs"][rank], case["ws"][rank]

    def run(topk, num_experts, logical_of, stats=None):
        with outputs.poisoned():
            recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk, w, num_experts=num_experts,
                                                               cumulative_local_expert_recv_stats=stats)
            local = num_experts // world
            out, _, _ = buf.combine(_experts(recv_x, recv_idx, recv_w, logical_of[rank * local:(rank + 1) * local]),
                                    handle)
        return out

    plain = run(case["idx"][rank], E, torch.arange(E))
    stats = torch.zeros(N // world, dtype=torch.int32)
    replicas = run(case["physical"][rank], N, case["p2l"], stats)
    assert bits_equal(plain, case["want"][rank]), f"{where}: combine without replicas"
    assert bits_equal(replicas, plain), f"{where}: combine through the replicas"
    counts = ref.reference_dispatch(case["xs"], case["physical"], case["ws"], N)[rank].handle
    assert torch.equal(stats, counts.num_unaligned_recv_tokens_per_expert.to(torch.int32)), f"{where}: per replica"


def _worker(rank, world):
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = str(PER_NODE)
    import torch.distributed as dist

    import deep_ep
    import test_ops as grads
    import test_ops_ranks as ops_ranks
    from deep_ep import reference as ref
    flat_combine = ref.reference_combine
    checked = []
    try:
        for hybrid in (True, False):
            where = f"rank {rank}, {'hybrid' if hybrid else 'direct'} mode, {NODES}x{PER_NODE}"
            buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=REPLICA_TOKENS,
                                        allow_hybrid_mode=hybrid, num_cpu_timeout_secs=60)
            assert buf.get_logical_domain_size() == ((NODES, PER_NODE) if hybrid else (1, world)), where
            _replicas(buf, replica_case(NODES, PER_NODE, seed=31 + hybrid), rank, world, where)
            checked.append("eplb")
            # test_ops' checks look reference_combine up when they run
            ref.reference_combine = hybrid_combine_order(PER_NODE) if hybrid else flat_combine
            # a rank without tokens in both; hybrid mode takes the expanded case, direct mode the flat one
            for i, case in enumerate(grads.cases(world)):
                if case.name.endswith("expand-A4-nosync-dup" if hybrid else "flat-sync"):
                    grads.check_dispatch_grads(buf, case, rank, world, torch.device("cpu"), seed=900 + i)
                    grads.check_combine_grads(buf, case, rank, world, torch.device("cpu"), seed=950 + i)
                    checked.append(case.name)
            ref.reference_combine = flat_combine
            if hybrid:   # compiled: the combine's order is the backend's, compared with eager
                x, idx, w, b = ops_ranks.routing_inputs(rank, 0 if rank == 1 else 10, 32, 8, 3, "cpu")
                ops_ranks.check_compiled(ops_ranks.ops_function(buf, idx, 8, True, False, 2), (x, w, b), "aot_eager")
                checked.append("compile")
            buf.destroy()
    finally:
        ref.reference_combine = flat_combine
        del os.environ["EP_CPU_NUM_NVLINK_RANKS"]
    return checked


def test_eplb_and_operators_across_cpu_nodes(tmp_path):
    want = ["eplb", "R4-expand-A4-nosync-dup", "compile", "eplb", "R4-flat-sync"]
    assert run_gloo_ranks(_worker, NODES * PER_NODE, tmp_path, deadline=240) == {r: want for r in range(4)}
