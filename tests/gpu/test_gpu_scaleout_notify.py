"""The control kernels on emulated nodes (a dispatch's notify and layout stages, the GPU barrier)
reach the ranks of other nodes only through the emulated GIN (comm/gin_control.cuh), as a real
network needs.

In direct mode (a rank's own node by loads and stores, or every other rank through the NIC) and in
hybrid mode, at 2 nodes x 2 and 4 x 2 ranks:

* the puts each rank's notify issued to each rank, read from the emulated NIC's queues: a fresh
  dispatch's puts less a cached dispatch's of the same inputs (the same data kernel, no notify) are
  exactly a count row's pieces, the tag and a signal to every rank the mode reaches through GIN
  (direct: every rank of another node, or every other rank; hybrid: the rail peers, which forward the
  rows to their node by stores), and none to any other rank; one NIC has staging slots smaller than
  a count row, so a row takes two puts;
* the GPU barrier's puts: the tag and a signal to the same ranks, none to the others;
* the dispatch's outputs equal `deep_ep.reference.reference_dispatch`'s, element by element;
* a rank of another node that skips a dispatch, or a barrier, makes rank 0's wait time out naming
  rank 0, that rank and the phase.

Every case of tests/gpu/test_gpu_scaleout.py runs through these kernels too (results bit for bit
against the reference, direct and hybrid). Skipped without a CUDA device; run with
``EXTRA_FILES="tests/gpu/test_gpu_scaleout_notify.py" bash tools/device_suite.sh extra``.
"""
from __future__ import annotations

import pytest
import torch

import deep_ep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(2, 2), (4, 2)]   # (nodes, ranks per node)
# the emulated NIC: seed, contexts used, every other rank through it, staging slot bytes (the largest put)
NICS = [(1, 2, False, 4096), (2, 3, True, 64)]
MODES = ["direct", "hybrid"]
HIDDEN, NUM_TOPK, NUM_EXPERTS, NUM_TOKENS = 256, 4, 16, 12
COUNT_EXTRA_WORDS = 2   # kCountsExtraWords of common/abi.cuh: a count row is R + E + 2 int32


def _group(nodes: int, per_node: int, nic, hybrid: bool):
    from deep_ep.comm.gin import EmulatedGinSettings
    from deep_ep.emulated import EmulatedGroup
    seed, contexts, gin_within_node, stage_bytes = nic
    return EmulatedGroup(nodes * per_node, device=torch.device("cuda", 0), num_nvlink_ranks=per_node,
                         gin_settings=EmulatedGinSettings(seed=seed, num_contexts=contexts, stage_bytes=stage_bytes,
                                                          gin_within_node=gin_within_node))


def _through_gin(rank: int, peer: int, per_node: int, hybrid: bool, gin_within_node: bool) -> bool:
    """Whether ``rank``'s control kernels reach ``peer`` through the GIN."""
    other_node = rank // per_node != peer // per_node
    if hybrid:
        return other_node and rank % per_node == peer % per_node   # rail peers only
    return peer != rank if gin_within_node else other_node


def _inputs(num_ranks: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn((NUM_TOKENS, HIDDEN), generator=generator).to(torch.bfloat16) for _ in range(num_ranks)]
    idxs = []
    for _ in range(num_ranks):
        idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:NUM_TOPK] for _ in range(NUM_TOKENS)])
        idx[torch.rand(idx.shape, generator=generator) < 0.2] = -1    # some slots masked
        idxs.append(idx)
    return xs, idxs


def _buffer(g, hybrid: bool, **kwargs):
    return deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=32, hidden=HIDDEN, num_topk=NUM_TOPK,
                                 allow_hybrid_mode=hybrid, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nic", NICS, ids=lambda n: f"seed{n[0]}-ctx{n[1]}-stage{n[3]}" + ("-all-gin" if n[2] else ""))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_notify_and_barrier_go_through_gin(shape, nic, mode):
    from deep_ep.emulated import wait_for_stream
    from deep_ep.reference import reference_dispatch
    nodes, per_node = shape
    num_ranks, hybrid, gin_within_node, stage_bytes = nodes * per_node, mode == "hybrid", nic[2], nic[3]
    group = _group(nodes, per_node, nic, hybrid)
    xs, idxs = _inputs(num_ranks, 100 * nodes + nic[0])
    expected = reference_dispatch(xs, idxs, None, NUM_EXPERTS)
    row_pieces = -(-4 * (num_ranks + NUM_EXPERTS + COUNT_EXTRA_WORDS) // stage_bytes)
    dev = torch.device("cuda", 0)

    def body(g):
        rank = g.rank()
        buf = _buffer(g, hybrid)
        backend = buf._backend
        assert backend.transport_gin == (2 if hybrid else 1)
        gin = backend.transport.state.gin

        def issued():
            buf.barrier()          # this rank's kernels done, then every rank's
            wait_for_stream()
            counts = gin.issued(rank)
            g.barrier()            # every rank has read before any launches again
            return counts

        try:
            x, idx = xs[rank].to(dev), idxs[rank].to(dev)
            start = issued()
            recv_x, recv_idx, _, handle, _ = buf.dispatch(x, idx, num_experts=NUM_EXPERTS, do_cpu_sync=True)
            fresh = issued()
            cached_x, _, _, _, _ = buf.dispatch(x, handle=handle)
            cached = issued()
            backend.gpu_barrier(buf.get_comm_stream().cuda_stream)
            barrier = issued()
            return ([f - s for f, s in zip(fresh, start)], [c - f for c, f in zip(cached, fresh)],
                    [b - c for b, c in zip(barrier, cached)], recv_x.cpu(), recv_idx.cpu(), cached_x.cpu())
        finally:
            buf.destroy()

    for rank, (fresh, cached, barrier, recv_x, recv_idx, cached_x) in enumerate(group.run(body)):
        gin_peers = [_through_gin(rank, peer, per_node, hybrid, gin_within_node) for peer in range(num_ranks)]
        notify = [f - c for f, c in zip(fresh, cached)]
        assert notify == [row_pieces + 2 if through else 0 for through in gin_peers], (rank, fresh, cached)
        assert barrier == [2 if through else 0 for through in gin_peers], (rank, barrier)
        assert any(cached), rank   # the data kernels put too: the difference is not of two zeros
        want = expected[rank]
        assert torch.equal(recv_x, want.recv_x), rank
        assert torch.equal(recv_idx, want.recv_topk_idx), rank
        assert torch.equal(cached_x, want.recv_x), rank


@pytest.mark.parametrize("what", ["dispatch", "barrier"])
@pytest.mark.parametrize("mode", MODES)
def test_a_control_wait_times_out_naming_rank_peer_and_phase(mode, what):
    """2 nodes x 2: rank 2 (node 1, rank 0's rail peer) skips a fresh dispatch or a GPU barrier; rank
    0's wait for it over the GIN records the timeout, which rank 0's call (dispatch, with CPU sync)
    or its next error check (barrier) raises."""
    hybrid = mode == "hybrid"
    group = _group(2, 2, (3, 2, False, 4096), hybrid)
    xs, idxs = _inputs(4, 7)
    dev = torch.device("cuda", 0)
    phase = "dispatch notify" if what == "dispatch" else "barrier"

    def body(g):
        buf = _buffer(g, hybrid, num_gpu_timeout_secs=3)
        rank = g.rank()
        x, idx = xs[rank].to(dev), idxs[rank].to(dev)
        try:
            buf.dispatch(x, idx, num_experts=NUM_EXPERTS)     # one call that every rank makes
            if what == "barrier":
                # every rank makes one GPU barrier too: the first use of a kernel module is collective
                # on emulated ranks (a host barrier); made by ranks 0, 1 and 3 alone below, it would
                # pair with rank 2's host barrier and wait for the group's host timeout
                buf._backend.gpu_barrier(buf.get_comm_stream().cuda_stream)
            buf.barrier()
            if rank == 2:
                # skips the call, and waits on the host with its buffer alive: freeing it would
                # synchronise the device under the other ranks' launches (emulated ranks share it)
                g.barrier()
                return None
            if rank != 0:      # their waits time out too (naming rank 2 or a rank waiting for it)
                try:
                    if what == "dispatch":
                        buf.dispatch(x, idx, num_experts=NUM_EXPERTS, do_cpu_sync=True)
                    else:
                        buf._backend.gpu_barrier(buf.get_comm_stream().cuda_stream)
                        buf.get_comm_stream().synchronize()
                        buf._backend.check_errors()
                except (TimeoutError, RuntimeError):
                    pass
                g.barrier()
                return None
            pattern = rf"rank 0: peer rank 2 did not arrive .* {phase}"
            with pytest.raises(TimeoutError, match=pattern):
                if what == "dispatch":
                    buf.dispatch(x, idx, num_experts=NUM_EXPERTS, do_cpu_sync=True)   # the host waits for the counts
                else:
                    buf._backend.gpu_barrier(buf.get_comm_stream().cuda_stream)
                    buf.get_comm_stream().synchronize()
                    buf._backend.check_errors()
            g.barrier()
            return None
        finally:
            buf.get_comm_stream().synchronize()

    group.run(body)
