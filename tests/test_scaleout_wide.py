"""Wide jobs: many nodes and large NVLink domains (docs/scaleout.md, "How large a job").

* Host side without a GPU, at NVL72 (72 x 1), 72 x 14 (1008 ranks, the largest split of 72-rank
  domains under the GPU's 1024-rank limit), 16 x 64 (1024) and 72 x 16 (1152): domains, the SM and
  QP model, window sizes and the computed link bytes are finite and consistent; a GPU buffer of
  more than 1024 ranks is refused on every rank before anything is allocated, naming the limit.
* The CPU backend (gloo ranks, the executable spec) acting as many nodes at tiny sizes: 32 ranks as
  16 nodes x 2, 32 x 1 and 2 x 16, hybrid and direct mode, both layouts: dispatch bit for bit the
  reference's, combine bit for bit in the reference's hybrid (or flat) order. The ranks are forked
  from a server that imported torch once (about 10 s for 32 ranks on two cores).
  ``DEEP_EP_WIDE_RANKS=1`` also runs 144 ranks as 2 NVL72 domains, 16 x 9 and 144 x 1 (opt-in: a
  few minutes on two cores).
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

import proc_utils
from deep_ep import reference as ref
from ep_cases import ADVERSARIAL_VALUES

TOPK, HIDDEN = 4, 128
MAX_RANKS = 1024      # kMaxRanks (include/deep_ep/common/abi.cuh), checked against the header below


# ------------------------------------------------------------------ host side at 72 x 16 and NVL72
def test_limit_constants_are_the_headers():
    from deep_ep.backends.gpu import abi
    assert abi.MAX_RANKS == abi.CONSTANTS["kMaxRanks"] == MAX_RANKS
    assert abi.MAX_EXPERTS == MAX_RANKS   # experts divisible by ranks: no more ranks could dispatch either


@pytest.mark.parametrize("nodes,per_node", [(1, 72), (14, 72), (16, 64), (16, 72), (16, 1), (16, 8)])
def test_domains_of_wide_splits(nodes, per_node):
    from deep_ep import topology
    num_ranks = nodes * per_node
    for rank in sorted({0, per_node - 1, per_node, num_ranks // 2 + 1, num_ranks - 1} & set(range(num_ranks))):
        hybrid = topology.domains_from_nvlink_ranks(num_ranks, rank, per_node, True)
        direct = topology.domains_from_nvlink_ranks(num_ranks, rank, per_node, False)
        assert hybrid.physical == direct.physical == (nodes, per_node)
        assert (hybrid.logical, hybrid.scaleout_rank_idx, hybrid.scaleup_rank_idx) == \
            ((nodes, per_node), rank // per_node, rank % per_node)
        assert (direct.logical, direct.scaleout_rank_idx, direct.scaleup_rank_idx) == ((1, num_ranks), 0, rank)


# (name, nodes, ranks per node, experts, SMs per GPU, NVLink GB/s)
MACHINES = [("NVL72", 1, 72, 288, 148, 900.0), ("NVL72 x 14", 14, 72, 1008, 148, 900.0),
            ("H200 16 x 64", 16, 64, 1024, 132, 450.0), ("NVL72 x 16", 16, 72, 2304, 148, 900.0),
            ("H200 16 x 8", 16, 8, 256, 132, 450.0)]


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m[0])
def test_sm_and_qp_model_at_wide_splits(machine):
    """DeepEP's SM model over the split (`deep_ep.resources`), both modes: an even count in [4, SMs],
    never more SMs with more nodes at the same rate, and the QP counts derived from it."""
    from deep_ep import resources
    _, nodes, per_node, experts, sms, nvlink = machine
    num_ranks = nodes * per_node
    device = resources.DeviceResources(num_device_sms=sms, max_sms=sms, nvlink_gbs=nvlink)
    for hybrid in (True, False):
        scaleout = nodes if hybrid else 1
        num_sms = resources.theoretical_num_sms(experts, 8, num_ranks=num_ranks, resources=device,
                                                num_scaleout_ranks=scaleout, num_rdma_ranks=nodes,
                                                num_nvlink_ranks=per_node)
        assert 4 <= num_sms <= sms and num_sms % 2 == 0, (machine, hybrid, num_sms)
        for allocated in (0, 17, 129):
            qps = resources.theoretical_num_qps(num_sms, allocated or resources.default_num_allocated_qps(device, hybrid),
                                                hybrid)
            assert 1 <= qps <= (allocated or (129 if hybrid else 17))
            assert qps == min(num_sms * 16 + 1 if hybrid else min(num_sms, 9), allocated or (129 if hybrid else 17))
        wide = resources.theoretical_num_sms(experts, 8, num_ranks=num_ranks, resources=device,
                                             num_scaleout_ranks=scaleout, num_rdma_ranks=nodes,
                                             num_nvlink_ranks=per_node, prefer_overlap_with_compute=False)
        assert wide >= min(64, sms) and wide >= num_sms
    # a token of top-8 reaches at most 8 ranks and 8 nodes, whatever the split
    assert 1 < resources.expected_ranks_per_token(experts, 8, num_ranks) <= 8
    assert 1 <= resources.expected_ranks_per_token(experts, 8, nodes) <= min(8, nodes)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m[0])
def test_link_bytes_model_at_wide_splits(machine):
    """The closed-form bytes per rank (`deep_ep.bench.scaleout_model`): hybrid mode puts fewer bytes
    on RDMA than direct mode across nodes, none on one node, and every count is finite and >= 0."""
    from deep_ep.bench import scaleout_model as model
    name, nodes, per_node, experts, sms, nvlink = machine
    topo = model.Topology(name, nodes * per_node, per_node, experts, nvlink, 50.0, sms, "model")
    got = {hybrid: model.expected_link_bytes(topo, hybrid=hybrid, tokens=8192, hidden=7168, num_topk=8, fp8=True,
                                             num_sf=56) for hybrid in (True, False)}
    for per_call in got.values():
        for call in ("dispatch", "combine"):
            assert all(math.isfinite(v) and v >= 0 for v in per_call[call].values()), per_call
    if nodes == 1:
        assert got[True]["dispatch"]["rdma"] == got[False]["dispatch"]["rdma"] == 0
    else:
        assert 0 < got[True]["dispatch"]["rdma"] < got[False]["dispatch"]["rdma"]
        assert 0 < got[True]["combine"]["rdma"] < got[False]["combine"]["rdma"]


@pytest.mark.parametrize("num_ranks", [72, 128, 1008, 1024])
def test_window_sizes_within_the_limit(num_ranks):
    """A window for every rank count up to the limit: the count matrix grows as R (R + E), the
    receive halves as R M; the hint covers both and the layout fits it."""
    from deep_ep.backends.gpu import window
    hint = window.buffer_size_hint(num_ranks, 8, 7168, 8, True)
    layout = window.make_layout(num_ranks, 8, 7168, 8, True, num_bytes=hint)
    assert hint % window.BUFFER_ALIGNMENT == 0
    assert layout.recv_offset >= window.CTRL_BYTES + num_ranks * (num_ranks + window.MAX_EXPERTS) * 4
    assert layout.rows_per_half >= num_ranks * 8
    # the window's count region is the largest fixed cost: under 9 MB even at the limit
    assert layout.recv_offset < 9 * 2 ** 20


class _WideGroup:
    """Stands in for a rank of an emulated group of ``size`` ranks in nodes of ``per_node`` (what the
    buffer reads of a group before its backend allocates); any allocation fails the test."""

    def __init__(self, rank: int, size: int, per_node: int) -> None:
        self._rank, self._size, self._per_node = rank, size, per_node

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def num_nvlink_ranks(self) -> int:
        return self._per_node

    def make_transport(self, *args, **kwargs):
        raise AssertionError("the buffer allocated a window for a group it must refuse")


@pytest.mark.parametrize("num_bytes", [None, 64 * 2 ** 20])
@pytest.mark.parametrize("hybrid", [True, False])
def test_more_ranks_than_the_limit_are_refused_on_every_rank(num_bytes, hybrid):
    """72 x 16 = 1152 ranks on the GPU backend: every rank raises the same ValueError naming the
    1024-rank limit, from the size hint or from the backend, before any window is made."""
    import deep_ep
    from deep_ep.backends.gpu import window
    messages = set()
    for rank in (0, 71, 72, 1151):
        with pytest.raises(ValueError, match=f"at most {MAX_RANKS} ranks .*kMaxRanks.* has 1152") as info:
            deep_ep.ElasticBuffer(_WideGroup(rank, 1152, 72), num_bytes=num_bytes, num_max_tokens_per_rank=8,
                                  hidden=256, num_topk=8, allow_hybrid_mode=hybrid)
        messages.add(str(info.value))
    assert len(messages) == 1
    with pytest.raises(ValueError, match=f"at most {MAX_RANKS} ranks"):
        window.buffer_size_hint(MAX_RANKS + 1, 8, 256, 8)
    window.check_num_ranks(MAX_RANKS)   # the limit itself is allowed


def test_top_k_beyond_a_warp_is_refused_before_any_launch():
    """The GPU kernels give each top-k slot of a token a lane of a warp: a top-k of 33 is a ValueError
    before any launch, even from a buffer made for it."""
    from test_gpu_host_path import E, H, M, _backend

    from deep_ep.backends.gpu import dispatch as gpu_dispatch
    log = []
    backend = _backend(log)
    backend.config = dataclasses.replace(backend.config, num_topk=33)
    x = torch.randn(4, H).to(torch.bfloat16)
    idx = torch.arange(4 * 33, dtype=torch.int64).view(4, 33) % E
    with pytest.raises(ValueError, match="top-k 33 exceeds the 32 .* lanes of a warp"):
        gpu_dispatch.run_dispatch(
            backend, x, None, idx, None, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=1, num_sms=4,
            handle=None, do_handle_copy=True, do_cpu_sync=True, do_expand=False, do_zero_padding=False,
            use_tma_aligned_col_major_sf=False, cumulative_local_expert_recv_stats=None)
    assert log == []


# ------------------------------------------------------------------ the CPU backend as many nodes
def _run_ranks(fn, world_size, tmp_path, *args, deadline):
    """`proc_utils.run_gloo_ranks` with the ranks forked from a server that imported torch and
    deep_ep once (spawning 32 interpreters that each import torch takes minutes on two cores)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "deep_ep", "proc_utils", __name__])
    original = proc_utils.multiprocessing
    proc_utils.multiprocessing = type("ForkServer", (), {"get_context": staticmethod(lambda _name: context)})
    try:
        return proc_utils.run_gloo_ranks(fn, world_size, tmp_path, *args, deadline=deadline)
    finally:
        proc_utils.multiprocessing = original


def _inputs(num_ranks: int, num_experts: int, seed: int):
    """Every rank's tokens (0 to 6 each, some ranks empty), routing (10 % masked), weights, biases."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws, biases = [], [], [], []
    for rank in range(num_ranks):
        tokens = (rank * 5 + seed) % 7
        xs.append(torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16))
        idx = torch.rand(tokens, num_experts, generator=g).topk(TOPK, dim=1).indices.to(torch.int64)
        idx[torch.rand(tokens, TOPK, generator=g) < 0.1] = -1
        idxs.append(idx)
        ws.append(torch.rand(tokens, TOPK, generator=g))
        biases.append(_adversarial((tokens, HIDDEN), g))
    return xs, idxs, ws, biases


def _adversarial(shape, g) -> torch.Tensor:
    return ADVERSARIAL_VALUES[torch.randint(0, len(ADVERSARIAL_VALUES), shape, generator=g)].to(torch.bfloat16)


def _per_scaleup_psum(expected: ref.ReferenceDispatch, per_node: int) -> ref.ReferenceDispatch:
    """The reference's handle as hybrid mode across nodes lays it out: one prefix-sum entry per
    scale-up rank (docs/scaleout.md, "Handles across nodes")."""
    psum = expected.handle.psum_num_recv_tokens_per_scaleup_rank
    counts = torch.diff(psum, prepend=psum.new_zeros(1)).view(-1, per_node).sum(0)
    handle = dataclasses.replace(expected.handle,
                                 psum_num_recv_tokens_per_scaleup_rank=torch.cumsum(counts, 0).to(torch.int32))
    return dataclasses.replace(expected, handle=handle)


def _expected(world_size: int, splits: tuple) -> dict:
    """Every rank's inputs and expected outputs, computed once here (each rank computing the reference
    of every rank would cost minutes at 32 ranks): per layout the inputs, the dispatch and the expert
    outputs, and the combine in the flat order and in the hybrid order of each split."""
    num_experts = 2 * world_size
    rounds = {}
    for do_expand in (False, True):
        xs, idxs, ws, biases = _inputs(world_size, num_experts, 3 + do_expand)
        want = ref.reference_dispatch(xs, idxs, ws, num_experts, do_expand=do_expand, num_max_tokens_per_rank=8)
        g = torch.Generator().manual_seed(5 + do_expand)
        ys = [_adversarial((w.recv_x.shape[0], HIDDEN), g) for w in want]
        weights = [torch.rand((y.shape[0],) if do_expand else (y.shape[0], TOPK), generator=g) for y in ys]
        handles = [w.handle for w in want]
        combined = {None: ref.reference_combine(ys, handles, weights, biases)}
        for per_node in splits:
            if per_node < world_size:
                combined[per_node] = ref.reference_combine(ys, handles, weights, biases, num_scaleup_ranks=per_node)
        rounds[do_expand] = (xs, idxs, ws, biases, want, ys, weights, combined)
    return rounds


def _wide_worker(rank, world_size, splits, rounds):
    """For each ``per_node`` in ``splits``, hybrid and direct mode, both layouts: one dispatch and
    one combine, checked against ``rounds`` (`_expected`, pickled: plain bytes, where tensors would
    travel as one shared-memory file each); returns the number of checked calls."""
    from deep_ep import ElasticBuffer
    rounds = pickle.loads(rounds)
    num_experts = 2 * world_size
    checked = 0
    try:
        for per_node in splits:
            os.environ["EP_CPU_NUM_NVLINK_RANKS"] = str(per_node)
            nodes = world_size // per_node
            for hybrid in (True, False):
                buf = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=8, hidden=HIDDEN, num_topk=TOPK,
                                    allow_hybrid_mode=hybrid, device="cpu")
                assert (buf.num_rdma_ranks, buf.num_nvlink_ranks) == (nodes, per_node)
                assert buf.get_logical_domain_size() == ((nodes, per_node) if hybrid else (1, world_size))
                across = hybrid and nodes > 1
                for do_expand in (False, True):
                    xs, idxs, ws, biases, want, ys, weights, combined = rounds[do_expand]
                    out = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=num_experts, do_expand=do_expand)
                    ref.check_dispatch(out, _per_scaleup_psum(want[rank], per_node) if across else want[rank],
                                       rank=rank)
                    got = buf.combine(ys[rank], out[3], topk_weights=weights[rank], bias=biases[rank])
                    ref.check_combine(got, combined[per_node if across else None][rank], rank=rank)
                    checked += 1
                buf.destroy()
    finally:
        os.environ.pop("EP_CPU_NUM_NVLINK_RANKS", None)
    return checked


def test_cpu_backend_as_16_nodes(tmp_path):
    """32 gloo ranks as 16 nodes x 2, 32 x 1 and 2 x 16: 24 checked calls per rank."""
    start = time.monotonic()
    splits = (2, 1, 16)
    got = _run_ranks(_wide_worker, 32, tmp_path, splits, pickle.dumps(_expected(32, splits)), deadline=240)
    assert got == {rank: 4 * len(splits) for rank in range(32)}
    print(f"32 ranks: {time.monotonic() - start:.1f} s")


@pytest.mark.skipif(os.environ.get("DEEP_EP_WIDE_RANKS") != "1",
                    reason="144 gloo ranks take minutes on two cores: DEEP_EP_WIDE_RANKS=1 runs them")
def test_cpu_backend_as_two_nvl72_domains(tmp_path):
    """144 gloo ranks as 2 nodes x 72 (two NVL72 domains), 16 x 9 and 144 x 1."""
    splits = (72, 9, 1)
    got = _run_ranks(_wide_worker, 144, tmp_path, splits, pickle.dumps(_expected(144, splits)), deadline=1200)
    assert got == {rank: 4 * len(splits) for rank in range(144)}
