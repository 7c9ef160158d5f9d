"""Direct-mode scale-out on emulated nodes: one GPU acting as M nodes of S ranks, every rank reaching
the ranks of other nodes through the emulated GIN (deep_ep/comm/gin.py, comm/gin_direct.cuh).

For 2 nodes x 1, 2 x 2 and 4 x 2 ranks, and two seeds of the emulated NIC (its delays and the order
it lands puts in; the first reaches a rank's own node by loads and stores and uses two contexts, the
second sends every peer through the NIC on three contexts), runs dispatch + combine cases of
tests/gpu_cases.py through `test_gpu_backend.run_case`: fresh random inputs per case, outputs poisoned
first, every element compared with deep_ep.reference (dispatch bit for bit, combine bit for bit in the
reference's fp32 order; also expanded combines on buffers without multiple reduction, every slot's row
pushed to its source), a cached dispatch and a second combine with the same handle. Also checks the
domains a buffer reports in either mode, and that a GIN wait that times out names the rank, the
missing peer and the phase.

Hybrid mode (comm/gin_hybrid.cuh, impls/dispatch_forward.cuh, impls/combine_forward.cuh: a row
crosses the emulated network once per node, to the rail peer there, which forwards it over NVLink;
combine's node partials are rounded at that rank; the default of `ElasticBuffer`) runs the same cases
at 2 x 1, 2 x 2 and 4 x 2 with both NIC seeds (with one rank per node it moves what direct mode moves), its combine checked in the reference's hybrid order (``num_scaleup_ranks``); on buffers
with ``allow_multiple_reduction=False`` (impls/combine_hybrid_single.cuh: forwarders pass each rank's
row, or each slot's, on unreduced) non-expanded and expanded cases checked in the flat order; a rail
wait that times out names the rank, the rail peer and the phase. A call's ``num_qps`` limits the
contexts its data kernel puts on; ranks that disagree on ``allow_hybrid_mode`` or ``num_allocated_qps``
are refused at creation on every rank. Skipped without a CUDA device; run with
``EXTRA_FILES="tests/gpu/test_gpu_scaleout.py" bash tools/device_suite.sh extra``.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_cases import case_seed, cases_for  # noqa: E402
from proc_utils import case_log  # noqa: E402

import deep_ep  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (nodes, ranks per node)
SHAPES = [(2, 1), (2, 2), (4, 2)]
# the emulated NIC: seed, contexts used, and whether peers of a rank's own node go through it too
NICS = [(1, 2, False), (2, 3, True)]
CASE_NAMES = ("bf16", "bf16-expand", "bf16-expand-align128", "bf16-noweights-bias2", "bf16-nosync",
              "bf16-empty-rank", "fp8-fp32")
# expanded combines on buffers without multiple reduction (hybrid mode: also HYBRID_SINGLE_REDUCTION_NAMES)
SINGLE_REDUCTION_NAMES = ("bf16-expand-single", "bf16-expand-single-applyw-bias2", "fp8-fp32-expand-single",
                          "top8-expand-single-nosync")


def _group(nodes: int, per_node: int, seed: int, contexts: int, gin_within_node: bool = False):
    from deep_ep.comm.gin import EmulatedGinSettings
    from deep_ep.emulated import EmulatedGroup
    return EmulatedGroup(nodes * per_node, device=torch.device("cuda", 0), num_nvlink_ranks=per_node,
                         gin_settings=EmulatedGinSettings(seed=seed, num_contexts=contexts,
                                                          gin_within_node=gin_within_node))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_domains_of_both_modes(shape):
    """Hybrid mode (the default) and direct mode are both accepted on emulated nodes; each buffer
    reports DeepEP's domains and runs the emulated GIN's kernels of its mode (1 direct, 2 hybrid with
    forwarding within a node of several ranks)."""
    nodes, per_node = shape

    def body(rank_group):
        seen = []
        for options in ({}, {"allow_hybrid_mode": False}):
            buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=16, hidden=256, num_topk=4, **options)
            try:
                seen.append((buf.num_rdma_ranks, buf.num_nvlink_ranks, buf.num_scaleout_ranks, buf.num_scaleup_ranks,
                             buf.scaleout_rank_idx, buf.scaleup_rank_idx, buf._backend.transport_gin))
            finally:
                buf.destroy()
        return seen

    for rank, (hybrid, direct) in enumerate(_group(nodes, per_node, 1, 2).run(body)):
        assert hybrid == (nodes, per_node, nodes, per_node, rank // per_node, rank % per_node,
                          2 if per_node > 1 else 1), f"rank {rank}: {hybrid}"
        assert direct == (nodes, per_node, 1, nodes * per_node, 0, rank, 1), f"rank {rank}: {direct}"


@pytest.mark.parametrize("nic", NICS, ids=lambda n: f"seed{n[0]}-ctx{n[1]}" + ("-all-gin" if n[2] else ""))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dispatch_combine(shape, nic, monkeypatch):
    """Every case at this shape; stops at the first failure (a failed case can leave kernels behind)."""
    import traceback

    from test_gpu_backend import run_case
    nodes, per_node = shape
    seed, contexts, gin_within_node = nic
    num_ranks = nodes * per_node
    group = _group(nodes, per_node, seed, contexts, gin_within_node)
    monkeypatch.setattr(deep_ep, "ElasticBuffer", functools.partial(deep_ep.ElasticBuffer, allow_hybrid_mode=False))
    names = CASE_NAMES + SINGLE_REDUCTION_NAMES
    cases = [c for c in cases_for(num_ranks) if c.name.split("-", 1)[1] in names]
    assert len(cases) == len(names)
    dev = torch.device("cuda", 0)
    for case in cases:
        name = f"{nodes}x{per_node}-seed{seed}-{case.name}"
        case_log(f"{name}: start")
        try:
            # the NIC's seed is part of the inputs' seed: each run draws its own inputs
            run_case(case, group.run, dev, seed=case_seed(case.name, nodes, per_node, seed))
        except Exception as exc:
            case_log(f"{name}: FAIL {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise
        case_log(f"{name}: ok")


def test_a_gin_wait_times_out_naming_rank_peer_and_phase():
    """Rank 1 (the second node) skips a combine: rank 0's combine waits for its GIN signals in vain,
    records the timeout, and rank 0's next call raises it."""
    group = _group(2, 1, 3, 2)
    dev = torch.device("cuda", 0)
    x = torch.randn((8, 256), device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(16)[:4] for _ in range(8)]).to(dev)

    def body(g):
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=16, hidden=256, num_topk=4, allow_hybrid_mode=False,
                                    num_gpu_timeout_secs=3)
        try:
            _, _, _, handle, _ = buf.dispatch(x, idx, num_experts=16)
            y = torch.randn((handle.num_recv_rows, 256), device=dev).to(torch.bfloat16)
            buf.combine(y, handle)
            buf.barrier()
            if g.rank() == 1:
                # skips the next combine, and waits on the host with its buffer alive: freeing it
                # would synchronise the device under rank 0's launches (emulated ranks share it)
                g.barrier()
                return None
            buf.combine(y, handle)                 # queued; its GIN wait gives up after 3 s
            buf.get_comm_stream().synchronize()    # rank 1 is at the host barrier: nothing waits for rank 0
            with pytest.raises(TimeoutError, match=r"rank 0: peer rank 1 did not arrive .* combine"):
                buf.dispatch(x, handle=handle)
            g.barrier()
            return None
        finally:
            buf.get_comm_stream().synchronize()

    group.run(body)


# ---------------------------------------------------------------------------------------- hybrid mode
# tools/diagnose_hybrid.py runs one case stage by stage, naming a stage that hangs
HYBRID_SHAPES = [(2, 1), (2, 2), (4, 2)]


# hybrid mode without multiple reduction: non-expanded cases (forwarders pass each rank's row on
# unreduced; a buffer with multiple reduction would add node partials) and the expanded single-reduction
# cases (every slot's row passed on)
HYBRID_UNREDUCED_ROW_NAMES = ("bf16", "bf16-noweights-bias2", "bf16-nosync", "bf16-empty-rank", "bf16-mostly-masked",
                              "fp8-fp32", "hidden2880-top4")
HYBRID_SINGLE_REDUCTION_NAMES = SINGLE_REDUCTION_NAMES + ("bf16-expand-single-empty-rank", "bf16-expand-single-decode")


def _run_hybrid(shape, nic, monkeypatch, cases, label: str) -> None:
    """Run ``cases`` in hybrid mode at ``shape`` with the NIC ``nic``, the combine checked against the
    reference with ``num_scaleup_ranks`` of the node (its hybrid order with multiple reduction, the
    flat one without); stops at the first failure."""
    import traceback

    from deep_ep import reference as ref
    from test_gpu_backend import run_case
    nodes, per_node = shape
    seed, contexts, gin_within_node = nic
    group = _group(nodes, per_node, seed, contexts, gin_within_node)
    dev = torch.device("cuda", 0)

    def domains(g):
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=16, hidden=256, num_topk=4)
        try:
            return (buf.num_scaleout_ranks, buf.num_scaleup_ranks, buf._backend.transport_gin)
        finally:
            buf.destroy()

    assert group.run(domains) == [(nodes, per_node, 2 if per_node > 1 else 1)] * (nodes * per_node)
    # run_case's expected combine in the hybrid order of nodes of `per_node` ranks, and handles whose
    # psum_num_recv_tokens_per_scaleup_rank counts per scale-up rank (DeepEP's hybrid layout)
    monkeypatch.setattr(ref, "reference_combine", functools.partial(ref.reference_combine, num_scaleup_ranks=per_node))
    flat_dispatch = ref.reference_dispatch

    def hybrid_dispatch(*args, **kwargs):
        results = flat_dispatch(*args, **kwargs)
        for e in results:
            psum = e.handle.psum_num_recv_tokens_per_scaleup_rank
            counts = torch.diff(psum, prepend=psum.new_zeros(1))
            e.handle.psum_num_recv_tokens_per_scaleup_rank = torch.cumsum(
                counts.view(-1, per_node).sum(0), 0).to(torch.int32)
        return results

    monkeypatch.setattr(ref, "reference_dispatch", hybrid_dispatch)
    for case in cases:
        name = f"{label}-{nodes}x{per_node}-seed{seed}-{case.name}"
        case_log(f"{name}: start")
        try:
            run_case(case, group.run, dev, seed=case_seed(case.name, label, nodes, per_node, seed))
        except Exception as exc:
            case_log(f"{name}: FAIL {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise
        case_log(f"{name}: ok")


@pytest.mark.parametrize("nic", NICS, ids=lambda n: f"seed{n[0]}-ctx{n[1]}" + ("-all-gin" if n[2] else ""))
@pytest.mark.parametrize("shape", HYBRID_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_hybrid_dispatch_combine(shape, nic, monkeypatch):
    """Hybrid mode (the default) at this shape: every case of `test_dispatch_combine` but those without
    multiple reduction, the combine checked against the reference's hybrid order (node partials
    rounded to bf16 at the forwarder)."""
    nodes, per_node = shape
    cases = [c for c in cases_for(nodes * per_node) if c.name.split("-", 1)[1] in CASE_NAMES]
    assert len(cases) == len(CASE_NAMES)
    _run_hybrid(shape, nic, monkeypatch, cases, "hybrid")


@pytest.mark.parametrize("nic", NICS, ids=lambda n: f"seed{n[0]}-ctx{n[1]}" + ("-all-gin" if n[2] else ""))
@pytest.mark.parametrize("shape", HYBRID_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_hybrid_dispatch_combine_without_multiple_reduction(shape, nic, monkeypatch):
    """Hybrid mode on buffers with allow_multiple_reduction=False (impls/combine_hybrid_single.cuh):
    non-expanded cases (each rank's row passed on unreduced and added at its last slot) and the
    expanded single-reduction cases (every slot's row), checked against the reference's flat order,
    every element (a combine that summed node partials fails: the inputs make fp32 sums depend on
    the order)."""
    nodes, per_node = shape
    by_name = {c.name.split("-", 1)[1]: c for c in cases_for(nodes * per_node)}
    rows = [dataclasses.replace(by_name[n], name=by_name[n].name + "-nomr", single_reduction=True)
            for n in HYBRID_UNREDUCED_ROW_NAMES]
    slots = [by_name[n] for n in HYBRID_SINGLE_REDUCTION_NAMES]
    assert all(c.single_reduction and c.expand for c in slots) and not any(c.expand for c in rows)
    _run_hybrid(shape, nic, monkeypatch, rows + slots, "hybrid-nomr")


def test_a_hybrid_rail_wait_times_out_naming_rank_peer_and_phase():
    """2 nodes x 2: rank 2 (node 1) skips a combine. Rank 0's combine waits for its rail peer's
    signals in vain (rank 2 forwards node 1's partials to it), records the timeout naming that peer,
    and rank 0's next call raises it."""
    group = _group(2, 2, 3, 2)
    dev = torch.device("cuda", 0)
    x = torch.randn((8, 256), device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(16)[:4] for _ in range(8)]).to(dev)

    def body(g):
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=16, hidden=256, num_topk=4, num_gpu_timeout_secs=3)
        try:
            _, _, _, handle, _ = buf.dispatch(x, idx, num_experts=16)
            y = torch.randn((handle.num_recv_rows, 256), device=dev).to(torch.bfloat16)
            buf.combine(y, handle)
            buf.barrier()
            if g.rank() != 0:
                # the others skip the next combine and wait on the host with their buffers alive
                g.barrier()
                return None
            buf.combine(y, handle)                 # queued; its waits give up after 3 s
            buf.get_comm_stream().synchronize()
            with pytest.raises(TimeoutError, match=r"rank 0: peer rank [12] did not arrive .* combine"):
                buf.dispatch(x, handle=handle)
            g.barrier()
            return None
        finally:
            buf.get_comm_stream().synchronize()

    group.run(body)


@pytest.mark.parametrize("num_qps", [1, 2, 0])
def test_a_calls_num_qps_is_the_contexts_its_data_kernel_uses(num_qps, monkeypatch):
    """Direct mode at 2 x 2, every peer through the emulated NIC on 3 contexts: dispatch, cached
    dispatch and combine with ``num_qps`` 1 or 2 put on that many contexts only (the control kernels
    on the first), and with 0 on all three; every case checked against the reference as in
    `test_dispatch_combine`."""
    from test_gpu_backend import run_case
    issued = []   # per buffer: puts this rank issued on each context

    class Buffer(deep_ep.ElasticBuffer):
        def dispatch(self, *args, **kwargs):
            return super().dispatch(*args, num_qps=num_qps, **kwargs)

        def combine(self, *args, **kwargs):
            return super().combine(*args, num_qps=num_qps, **kwargs)

        def destroy(self):
            backend = self._backend
            gin = backend.transport.state.gin
            queues = gin.queues.view(gin.num_ranks, gin.num_contexts, gin.num_ranks, -1)
            issued.append(queues[backend.rank, :, :, 0].sum(1).tolist())
            super().destroy()

    monkeypatch.setattr(deep_ep, "ElasticBuffer", functools.partial(Buffer, allow_hybrid_mode=False))
    group = _group(2, 2, seed=3, contexts=3, gin_within_node=True)
    names = ("bf16", "bf16-expand", "fp8-fp32", "bf16-nosync")
    cases = [c for c in cases_for(4) if c.name.split("-", 1)[1] in names]
    assert len(cases) == len(names)
    for case in cases:
        run_case(case, group.run, torch.device("cuda", 0), seed=case_seed(case.name, 2, 2, 3 + num_qps))
    used = 3 if num_qps == 0 else num_qps
    assert len(issued) == 4 * len(cases)
    for per_context in issued:
        assert not any(per_context[used:]), (num_qps, per_context)   # no put past the call's contexts
    totals = [sum(column) for column in zip(*issued)]
    assert all(count > 0 for count in totals[:used]), (num_qps, totals)


@pytest.mark.parametrize("option", ["allow_hybrid_mode", "num_allocated_qps"])
def test_ranks_that_disagree_on_the_mode_are_refused_on_every_rank(option):
    """One rank of 2 x 2 emulated nodes creates its buffer in another mode (or with other QPs) than
    the rest: every rank gets the same ValueError naming each rank's values, before any kernel;
    the group then creates a buffer they agree on."""
    group = _group(2, 2, seed=1, contexts=2)

    def body(rank_group):
        rank = rank_group.rank()
        odd = {"allow_hybrid_mode": rank != 1} if option == "allow_hybrid_mode" else \
            {"allow_hybrid_mode": False, "num_allocated_qps": 9 if rank == 1 else 17}
        with pytest.raises(ValueError, match="ranks disagree on a buffer across emulated nodes") as info:
            deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=16, hidden=256, num_topk=4, **odd)
        buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=16, hidden=256, num_topk=4)
        buf.destroy()
        return str(info.value)

    messages = group.run(body)
    assert len(set(messages)) == 1 and "rank 1: allow_hybrid_mode=" in messages[0], messages
