"""Domains (`deep_ep.topology`), the SM / QP model (`deep_ep.resources`) and the scale-out refusal.

* Physical and logical domains as DeepEP V2 computes them, against a direct restatement of its rules.
* `EP_CPU_NUM_NVLINK_RANKS`: a gloo group of 4 acting as 2 nodes x 2, hybrid and direct, gives the
  buffer's domain attributes and exactly the outputs of the one-node run (but hybrid combine's values,
  which follow the hybrid order: tests/test_hybrid_scaleout.py).
* The SM and QP counts against an independent implementation in exact arithmetic (fractions) over
  many configurations, and against DeepEP's numbers derived by hand.
* A GPU group over two NVLink domains is refused before anything is allocated, naming the NCCL
  versions; emulated nodes (`EmulatedGroup(num_nvlink_ranks=...)`) report their domains, run direct
  mode and refuse hybrid mode. Hybrid mode on nodes of more than 32 ranks (real or emulated) is
  refused at creation; on a GPU buffer across nodes the experimental primitives refuse every method.
"""
from __future__ import annotations

import itertools
import math
import os
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from deep_ep import resources, topology
from deep_ep.resources import DeviceResources

from proc_utils import run_gloo_ranks

H200 = DeviceResources(num_device_sms=132, max_sms=132, nvlink_gbs=450.0)


# ---------------------------------------------------------------------------------------- domains
def _deepep_domains(num_ranks, rank, nvlink, hybrid):
    """DeepEP's rules restated: physical (R / N, N); hybrid keeps it, direct is (1, R)."""
    rdma = num_ranks // nvlink
    scaleout, scaleup = (rdma, nvlink) if hybrid else (1, num_ranks)
    return (rdma, nvlink), (scaleout, scaleup), (rank // scaleup, rank % scaleup)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 6, 8, 16, 24, 72, 144])
def test_domains_match_deepep_rules(num_ranks):
    for nvlink in (n for n in range(1, num_ranks + 1) if num_ranks % n == 0):
        for rank, hybrid in itertools.product(range(num_ranks), (True, False)):
            d = topology.domains_from_nvlink_ranks(num_ranks, rank, nvlink, hybrid)
            physical, logical, indices = _deepep_domains(num_ranks, rank, nvlink, hybrid)
            assert (d.physical, d.logical, (d.scaleout_rank_idx, d.scaleup_rank_idx)) == (physical, logical, indices)
            assert d.scaleout_rank_idx * d.num_scaleup_ranks + d.scaleup_rank_idx == rank


def test_domains_examples():
    d = topology.domains_from_nvlink_ranks(16, 11, 8, True)      # node 1, GPU 3
    assert (d.physical, d.logical, d.scaleout_rank_idx, d.scaleup_rank_idx) == ((2, 8), (2, 8), 1, 3)
    d = topology.domains_from_nvlink_ranks(16, 11, 8, False)
    assert (d.physical, d.logical, d.scaleout_rank_idx, d.scaleup_rank_idx) == ((2, 8), (1, 16), 0, 11)
    with pytest.raises(ValueError, match="cannot split a group of 8 ranks"):
        topology.domains_from_nvlink_ranks(8, 0, 3)
    with pytest.raises(ValueError, match="cannot split"):
        topology.domains_from_nvlink_ranks(8, 0, 16)
    with pytest.raises(ValueError, match="rank 8 is outside"):
        topology.domains_from_nvlink_ranks(8, 8, 4)


def test_cpu_variable(monkeypatch):
    monkeypatch.delenv("EP_CPU_NUM_NVLINK_RANKS", raising=False)
    assert topology.cpu_num_nvlink_ranks(4) == 4
    monkeypatch.setenv("EP_CPU_NUM_NVLINK_RANKS", "2")
    assert topology.cpu_num_nvlink_ranks(4) == 2
    monkeypatch.setenv("EP_CPU_NUM_NVLINK_RANKS", "")
    assert topology.cpu_num_nvlink_ranks(4) == 4          # empty counts as unset
    for bad in ("3", "0", "-2", "two", "8"):
        monkeypatch.setenv("EP_CPU_NUM_NVLINK_RANKS", bad)
        with pytest.raises(ValueError, match="EP_CPU_NUM_NVLINK_RANKS"):
            topology.cpu_num_nvlink_ranks(4)


def test_emulated_group_is_one_domain():
    class Emulated:                      # the shape of an emulated-rank group: rank() and size()
        def rank(self):
            return 3

        def size(self):
            return 8
    from deep_ep import get_logical_domain_size, get_physical_domain_size
    assert get_physical_domain_size(Emulated()) == (1, 8)
    assert get_logical_domain_size(Emulated(), False) == (1, 8)


# ---------------------------------------------------------------------------------------- GPU scale-out checks
def _fake_nccl_group(monkeypatch, rank, num_ranks, team_size, version):
    """A ProcessGroup the buffer takes for an NCCL group whose LSA team has ``team_size`` ranks."""
    import deep_ep.backends
    import deep_ep.buffer
    import deep_ep.comm.nccl
    group = dist.ProcessGroup(dist.HashStore(), rank, num_ranks)
    monkeypatch.setattr(deep_ep.backends, "is_cpu_group", lambda g, device=None: False)
    monkeypatch.setattr(deep_ep.buffer, "is_cpu_group", lambda g, device=None: False)
    monkeypatch.setattr(topology, "_nccl_lsa_team", lambda g: (team_size, rank % team_size))
    monkeypatch.setattr(deep_ep.comm.nccl, "nccl_version", lambda: version)

    def no_backend(*args):
        raise AssertionError("a backend was made (memory allocated) for a group that must be refused")
    monkeypatch.setattr(deep_ep.buffer, "make_backend", no_backend)
    return group


@pytest.mark.parametrize("rank", [0, 3, 5])
def test_gpu_scaleout_reaches_the_backend(monkeypatch, rank):
    """With GIN in the NCCL, a buffer over several domains is made by the GPU backend (whose NCCL GIN
    transport checks the communicator: tests/test_gin_nccl_creation.py), in both modes."""
    import deep_ep.buffer
    from deep_ep import ElasticBuffer, get_logical_domain_size, get_physical_domain_size
    group = _fake_nccl_group(monkeypatch, rank, 8, 4, 22909)
    assert get_physical_domain_size(group) == (2, 4)
    assert get_logical_domain_size(group) == (2, 4) and get_logical_domain_size(group, False) == (1, 8)
    made = []

    class BackendMade(Exception):
        pass

    def backend_made(group, config, device):
        made.append(config.allow_hybrid_mode)
        raise BackendMade   # stop before anything reads the backend
    monkeypatch.setattr(deep_ep.buffer, "make_backend", backend_made)
    for hybrid in (True, False):
        with pytest.raises(BackendMade):
            ElasticBuffer(group, num_bytes=2 << 20, allow_hybrid_mode=hybrid)
    assert made == [True, False]


def test_gpu_scaleout_needs_gin_nccl(monkeypatch):
    from deep_ep import ElasticBuffer
    group = _fake_nccl_group(monkeypatch, 1, 4, 2, 22803)
    with pytest.raises(RuntimeError, match=r"GIN needs NCCL >= 2\.28\.7, and the NCCL torch loaded is 2\.28\.3"):
        ElasticBuffer(group, num_bytes=2 << 20)


def test_gpu_permuted_lsa_team_refused(monkeypatch):
    from deep_ep import get_physical_domain_size
    group = _fake_nccl_group(monkeypatch, 1, 4, 2, 22809)
    monkeypatch.setattr(topology, "_nccl_lsa_team", lambda g: (2, 0))     # rank 1 is not LSA rank 1
    with pytest.raises(ValueError, match="consecutive ranks"):
        get_physical_domain_size(group)
    monkeypatch.setattr(topology, "_nccl_lsa_team", lambda g: (3, 1))
    with pytest.raises(ValueError, match="LSA team"):
        get_physical_domain_size(group)


@pytest.mark.parametrize("emulated", [False, True], ids=["nccl", "emulated"])
def test_hybrid_nodes_of_more_than_32_ranks_refused_at_creation(monkeypatch, emulated):
    """Hybrid mode across nodes of 33 ranks is refused on every rank by ElasticBuffer, before a backend
    is made, for an NCCL group (LSA teams of 33) and emulated nodes alike; direct mode and nodes of 32
    go on to the backend."""
    import deep_ep.buffer
    from deep_ep import ElasticBuffer

    class BackendMade(Exception):
        pass

    def backend_made(group, config, device):
        raise BackendMade   # stop before anything reads the backend

    def group_of(rank, num_ranks, node_ranks):
        if not emulated:
            return _fake_nccl_group(monkeypatch, rank, num_ranks, node_ranks, 23007)
        group = _EmulatedRankGroup(node_ranks)
        group.rank, group.size = (lambda: rank), (lambda: num_ranks)
        return group

    for rank in (0, 32, 40, 65):
        group = group_of(rank, 66, 33)
        monkeypatch.setattr(deep_ep.buffer, "make_backend", backend_made)
        with pytest.raises(NotImplementedError, match=rf"rank {rank}: hybrid mode supports nodes of at most 32 "
                                                      r"ranks .* spans 2 nodes \(NVLink domains\) of 33 ranks; "
                                                      r"pass allow_hybrid_mode=False \(direct mode"):
            ElasticBuffer(group, num_bytes=2 << 20)
        with pytest.raises(BackendMade):
            ElasticBuffer(group, num_bytes=2 << 20, allow_hybrid_mode=False)
    group = group_of(5, 64, 32)
    monkeypatch.setattr(deep_ep.buffer, "make_backend", backend_made)
    with pytest.raises(BackendMade):
        ElasticBuffer(group, num_bytes=2 << 20)
    # one node of 66 ranks: no forwarding, no limit
    one_node = topology.domains_from_nvlink_ranks(66, 40, 66)
    topology.require_scaleout_support(one_node, 40, 23007, emulated=emulated)


def test_primitives_refuse_a_gpu_buffer_across_nvlink_domains():
    """Every method of the experimental primitives on a GPU buffer whose transport is a GIN (nodes,
    real or emulated) raises NotImplementedError naming the method and the primitive, before it uses
    the backend (the stand-in fails the test on any use) or holds the window."""
    from deep_ep import ElasticBuffer
    from deep_ep.backends.gpu import GPUBackend
    from deep_ep.primitives import WindowUse

    class SpanningBackend(GPUBackend):
        transport_gin, num_ranks, calls = 2, 4, 0

        def __init__(self):
            pass

        def __getattr__(self, name):
            raise AssertionError(f"the backend was used ({name}) before the refusal")

    buf = ElasticBuffer.__new__(ElasticBuffer)
    buf._destroyed, buf._backend, buf._window_use = False, SpanningBackend(), WindowUse()
    buf.rank_idx, buf.num_ranks, buf.num_cpu_bytes = 1, 4, 0
    tensor, storage = torch.zeros(8), torch.zeros(4, 128, dtype=torch.bfloat16)

    def enter_session():
        with buf.agrs_new_session():
            pass

    calls = {"pipeline send/recv": [("pp_set_config", lambda: buf.pp_set_config(64, 2)),
                                    ("pp_send", lambda: buf.pp_send(tensor, 2)),
                                    ("pp_recv", lambda: buf.pp_recv(tensor, 0))],
             "all-gather / reduce-scatter": [("agrs_set_config", lambda: buf.agrs_set_config(1024, 2)),
                                             ("create_agrs_session", buf.create_agrs_session),
                                             ("agrs_new_session", enter_session),
                                             ("agrs_get_inplace_tensor", lambda: buf.agrs_get_inplace_tensor(
                                                 [(8,)], torch.float32)),
                                             ("all_gather", lambda: buf.all_gather(tensor)),
                                             ("reduce_scatter", lambda: buf.reduce_scatter(tensor)),
                                             ("destroy_agrs_session", buf.destroy_agrs_session)],
             "Engram": [("engram_write", lambda: buf.engram_write(storage)),
                        ("engram_fetch", lambda: buf.engram_fetch(torch.zeros(1, 1, dtype=torch.int32)))]}
    for primitive, methods in calls.items():
        for method, call in methods:
            with pytest.raises(NotImplementedError, match=(
                    rf"ElasticBuffer\.{method}: {primitive} runs within one NVLink domain only on GPU buffers .*"
                    rf"group of 4 ranks spans several NVLink domains \(nodes, real or emulated\)\. DeepEP's "
                    rf"version goes over GIN")):
                call()
    assert buf._window_use.holder is None and "calls" not in vars(buf._backend)
    buf._destroyed = True   # nothing to release: the backend is a stand-in


def test_require_scaleout_support_one_domain_passes():
    one = topology.domains_from_nvlink_ranks(8, 2, 8)
    topology.require_scaleout_support(one, 2, 22600)          # nothing needed within one domain
    assert topology.nccl_version_text(22809) == "2.28.9" and topology.nccl_version_text(23203) == "2.32.3"
    assert topology.NCCL_GIN_MIN_VERSION == 22807


# ---------------------------------------------------------------------------------------- SM / QP model
def _frac_expected(num_experts, num_topk, groups):
    return groups * (1 - Fraction(math.comb(num_experts - num_experts // groups, num_topk),
                                  math.comb(num_experts, num_topk)))


def _independent_num_sms(num_experts, num_topk, num_ranks, nvlink, hybrid, nvlink_gbs, rdma_gbs,
                         device_sms=132, overlap=True, read_gbs=200, write_gbs=50):
    """The model written out per link, in exact arithmetic (docs/scaleout.md's formulas)."""
    nodes = num_ranks // nvlink
    so, su = (nodes, nvlink) if hybrid else (1, num_ranks)
    k = _frac_expected(num_experts, num_topk, num_ranks)
    if so > 1:
        k_nodes = _frac_expected(num_experts, num_topk, so)
        reads = 1 / k + k_nodes / k
        writes = 1 / k + k_nodes / (k * so) + 1
        links = {"rdma": (k_nodes * (so - 1) / (so * k), Fraction(rdma_gbs)),
                 "nvlink": (Fraction(su - 1, su), Fraction(nvlink_gbs))}
        bound = "rdma" if links["rdma"][0] / links["rdma"][1] > links["nvlink"][0] / links["nvlink"][1] else "nvlink"
    else:
        reads = 1 / k
        writes = (1 / k if nodes > 1 else 0) + Fraction(nvlink, num_ranks)
        links = {"nvlink": (Fraction(nvlink, num_ranks) * Fraction(nvlink - 1, nvlink), Fraction(nvlink_gbs))}
        bound = "nvlink"
    traffic, gbs = links[bound]
    if traffic == 0:
        want = Fraction(device_sms)
    else:
        want = max(gbs / traffic * reads / read_gbs, gbs / traffic * writes / write_gbs)
    sms = max(4, math.ceil(want * Fraction(5, 4)))
    sms = sms + 1 if sms % 2 else sms
    if not overlap:
        sms = max(sms, 64)
    return min(sms, device_sms)


def test_num_sms_against_independent_model():
    checked = 0
    for num_experts, num_topk in ((256, 8), (288, 8), (64, 6), (160, 6), (128, 1), (256, 16), (384, 12)):
        for nodes, nvlink in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)):
            num_ranks = nodes * nvlink
            if num_experts % num_ranks:
                continue
            for hybrid, overlap, (nvlink_gbs, rdma_gbs) in itertools.product(
                    (True, False), (True, False), ((450.0, 50.0), (430.0, 25.0), (900.0, 100.0))):
                got = resources.theoretical_num_sms(
                    num_experts, num_topk, num_ranks=num_ranks, resources=H200, nvlink_gbs=nvlink_gbs,
                    rdma_gbs=rdma_gbs, prefer_overlap_with_compute=overlap,
                    num_scaleout_ranks=nodes if hybrid else 1, num_scaleup_ranks=nvlink if hybrid else num_ranks,
                    num_rdma_ranks=nodes, num_nvlink_ranks=nvlink)
                want = _independent_num_sms(num_experts, num_topk, num_ranks, nvlink, hybrid, nvlink_gbs, rdma_gbs,
                                            overlap=overlap)
                assert got == want, (num_experts, num_topk, nodes, nvlink, hybrid, overlap, nvlink_gbs, rdma_gbs)
                assert got % 2 == 0 and 4 <= got <= 132
                checked += 1
    assert checked > 500


def test_num_sms_deepep_numbers():
    """DeepEP's counts, derived by hand for E = 256, K = 8, NVLink 450 GB/s, RDMA 50 GB/s."""
    def sms(nodes, nvlink=8, hybrid=True, **kw):
        return resources.theoretical_num_sms(256, 8, num_ranks=nodes * nvlink, resources=H200,
                                             num_scaleout_ranks=nodes if hybrid else 1, num_rdma_ranks=nodes,
                                             num_nvlink_ranks=nvlink, **kw)
    # One node of 8: NVLink carries 7/8 of a row per delivered row and SMs write 1, so the write rate
    # bounds: 450 / (7/8) / 50 = 10.29 SMs, +25 % = 12.86 -> 13 -> 14 (even).
    assert sms(1) == 14
    # EP 8x2 and 8x4 hybrid: the RDMA link bounds; DeepEP runs these with 12 and 6 SMs.
    assert sms(2) == 12 and sms(4) == 6
    assert sms(16) == 4                                  # at least 4
    assert sms(1, nvlink=1) == 132                       # nothing crosses a link: every SM
    assert sms(1, prefer_overlap_with_compute=False) == 64
    assert sms(2, hybrid=False) == 18                    # direct: NVLink-bound, with a send buffer
    emulated = DeviceResources(num_device_sms=132, max_sms=10, nvlink_gbs=450.0)
    assert resources.theoretical_num_sms(256, 8, num_ranks=8, resources=emulated) == 10
    assert resources.theoretical_num_sms(256, 8, num_ranks=8, resources=None) == 0            # CPU
    # no RDMA rate from anywhere: the default, never a division by zero
    no_rates = DeviceResources(num_device_sms=132, max_sms=132, nvlink_gbs=0.0)
    assert resources.theoretical_num_sms(256, 8, num_ranks=16, resources=no_rates, num_scaleout_ranks=2,
                                         num_rdma_ranks=2) == 12


def test_expected_groups():
    assert resources.expected_ranks_per_token(256, 8, 1) == 1.0
    assert resources.expected_ranks_per_token(8, 8, 4) == 4.0                 # every expert: every rank
    assert resources.expected_ranks_per_token(16, 1, 4) == pytest.approx(1.0)
    miss = math.prod((128 - i) / (256 - i) for i in range(8))
    assert resources.expected_ranks_per_token(256, 8, 2) == pytest.approx(2 * (1 - miss))
    for groups in (2, 4, 8, 16, 32):
        assert resources.expected_ranks_per_token(256, 8, groups) == pytest.approx(
            float(_frac_expected(256, 8, groups)), rel=1e-12)
    with pytest.raises(ValueError, match="spread evenly"):
        resources.expected_ranks_per_token(256, 8, 3)


def test_num_qps():
    qps = resources.theoretical_num_qps
    for num_sms, allocated in itertools.product(range(0, 140), (1, 9, 17, 65, 129, 1000)):
        hybrid = 0 if num_sms == 0 else min(num_sms * 16 + 1, allocated)
        direct = 0 if num_sms == 0 else min(num_sms, 9, allocated)
        assert (qps(num_sms, allocated, True), qps(num_sms, allocated, False)) == (hybrid, direct)
    assert qps(12, 129, True) == 129 and qps(6, 129, True) == 97 and qps(12, 17, False) == 9
    assert resources.default_num_allocated_qps(H200, True) == 129
    assert resources.default_num_allocated_qps(H200, False) == 17
    assert resources.default_num_allocated_qps(None, True) == 0



# ---------------------------------------------------------------------------------------- CPU as 2 nodes x 2
HIDDEN, TOPK, EXPERTS, MAX_TOKENS = 256, 4, 16, 24


def _inputs(rank):
    gen = torch.Generator().manual_seed(1000 + rank)
    num_tokens = (5, 0, 24, 17)[rank]
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    scores = torch.rand(num_tokens, EXPERTS, generator=gen)
    topk_idx = scores.topk(TOPK, dim=1).indices.to(torch.int64)
    topk_idx[::3, -1] = -1                                    # some unused slots
    weights = torch.rand(num_tokens, TOPK, generator=gen)
    bias = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    return x, topk_idx, weights, bias


def _run(buf, rank):
    """Every output of a dispatch / cached dispatch / combine in both layouts, as a flat list."""
    x, topk_idx, weights, bias = _inputs(rank)
    out = []
    for do_expand in (False, True):
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx, weights, num_experts=EXPERTS,
                                                           expert_alignment=4, do_expand=do_expand,
                                                           do_zero_padding=do_expand)   # no unset rows
        out += [recv_x, recv_idx, recv_w]
        out += [getattr(handle, name) for name in (
            "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert", "recv_src_metadata",
            "dst_buffer_slot_idx", "num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list",
            "token_metadata_at_forward", "channel_linked_list")]
        cached = buf.dispatch(x * 2, handle=handle, do_zero_padding=do_expand)[0]
        out.append(cached)
        y = recv_x.float().mul(1.5).to(torch.bfloat16)
        rows_weights = recv_w if do_expand else None
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=rows_weights, bias=bias)
        out += [combined, combined_w]
    plain = buf.dispatch(x, topk_idx, weights, num_experts=EXPERTS)[3]
    return out, plain.psum_num_recv_tokens_per_scaleup_rank, plain.rank_prefix_sum


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            (a.view(torch.uint8) == b.view(torch.uint8)).all() if a.numel() else True)
    return a == b


def _two_nodes_worker(rank, world_size):
    from deep_ep import ElasticBuffer, get_logical_domain_size, get_physical_domain_size
    group = dist.group.WORLD
    os.environ.pop("EP_CPU_NUM_NVLINK_RANKS", None)
    one_node = ElasticBuffer(group)
    assert (one_node.get_physical_domain_size(), one_node.get_logical_domain_size()) == ((1, 4), (1, 4))
    want, want_psum, _ = _run(one_node, rank)
    one_node.destroy()
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = "2"
    try:
        assert get_physical_domain_size(group) == (2, 2)
        assert get_logical_domain_size(group) == (2, 2) and get_logical_domain_size(group, False) == (1, 4)
        seen = {}
        for hybrid in (True, False):
            buf = ElasticBuffer(group, allow_hybrid_mode=hybrid)
            seen[hybrid] = {name: getattr(buf, name) for name in (
                "num_rdma_ranks", "num_nvlink_ranks", "num_scaleout_ranks", "num_scaleup_ranks",
                "scaleout_rank_idx", "scaleup_rank_idx", "num_allocated_qps")}
            assert buf.get_theoretical_num_sms(EXPERTS, TOPK) == 0 and buf.get_theoretical_num_qps(0) == 0
            got, psum, rank_prefix_sum = _run(buf, rank)
            assert len(got) == len(want)
            for i, (g, w) in enumerate(zip(got, want)):
                # combined_x of each layout: hybrid mode rounds each node's partial to bf16 first
                # (deep_ep.reference, "Hybrid order"; tests/test_hybrid_scaleout.py checks it)
                if hybrid and i in (13, 28):
                    assert g.dtype == w.dtype and g.shape == w.shape, i
                    continue
                assert _same(g, w), (hybrid, i)
            seen[hybrid]["psum"] = psum.tolist()
            seen[hybrid]["rank_prefix_sum"] = rank_prefix_sum.tolist()
            buf.destroy()
    finally:
        del os.environ["EP_CPU_NUM_NVLINK_RANKS"]
    return seen, want_psum.tolist()


def test_cpu_two_nodes_of_two(tmp_path):
    results = run_gloo_ranks(_two_nodes_worker, 4, tmp_path, deadline=120)
    for rank, (seen, one_node_psum) in results.items():
        # hybrid: per scale-up rank j, the tokens from rank j of both nodes (DeepEP's hybrid handle)
        per_source = [b - a for a, b in zip([0] + one_node_psum[:-1], one_node_psum)]
        per_scaleup = [per_source[0] + per_source[2], per_source[1] + per_source[3]]
        assert seen[True] == dict(num_rdma_ranks=2, num_nvlink_ranks=2, num_scaleout_ranks=2, num_scaleup_ranks=2,
                                  scaleout_rank_idx=rank // 2, scaleup_rank_idx=rank % 2, num_allocated_qps=0,
                                  psum=[per_scaleup[0], sum(per_scaleup)],
                                  rank_prefix_sum=seen[True]["rank_prefix_sum"])
        assert per_scaleup[0] > 0 and per_scaleup[1] > 0
        assert seen[False] == dict(num_rdma_ranks=2, num_nvlink_ranks=2, num_scaleout_ranks=1, num_scaleup_ranks=4,
                                   scaleout_rank_idx=0, scaleup_rank_idx=rank, num_allocated_qps=0,
                                   psum=one_node_psum, rank_prefix_sum=one_node_psum)
        assert seen[True]["rank_prefix_sum"] == one_node_psum        # still per source rank


def _deepep_modes_worker(rank, world_size):
    from deep_ep import ElasticBuffer
    from deepep_cases import run_ep_modes
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = "2"
    try:
        buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=10, hidden=128, deterministic=True,
                               explicitly_destroy=True, num_cpu_timeout_secs=60)
        assert buffer.get_logical_domain_size() == (2, 2)
        try:
            return run_ep_modes(buffer, torch.device("cpu"), num_tokens=10, hidden=128, num_topk=4, num_experts=16,
                                do_cpu_sync=True, masked_ratio=0.1, seed=11)
        finally:
            buffer.destroy()
    finally:
        del os.environ["EP_CPU_NUM_NVLINK_RANKS"]


def test_deepep_modes_two_nodes_hybrid(tmp_path):
    """DeepEP's own checks (tests/deepep_cases.py), hybrid handle semantics included: 144 modes."""
    assert run_gloo_ranks(_deepep_modes_worker, 4, tmp_path, deadline=400) == {r: 144 for r in range(4)}


def _legacy_worker(rank, world_size):
    import deep_ep
    from test_legacy_buffer import CASES, _run_case
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = "2"
    try:
        buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=0, num_rdma_bytes=0)
        assert buffer.elastic_buffer.get_logical_domain_size() == (2, 2)
        for index, case in enumerate(CASES):
            _run_case(buffer, rank, world_size, index, case)
        return len(CASES)
    finally:
        del os.environ["EP_CPU_NUM_NVLINK_RANKS"]


def test_legacy_buffer_two_nodes_hybrid(tmp_path):
    """DeepEP's V1 Buffer over a hybrid-mode ElasticBuffer: the same checks as on one node."""
    results = run_gloo_ranks(_legacy_worker, 4, tmp_path, deadline=200)
    assert set(results.values()) == {len(__import__("test_legacy_buffer").CASES)}


def _low_latency_worker(rank, world_size):
    import deep_ep
    from test_legacy_low_latency import MAX_TOKENS, num_experts_for, run_cases, run_mask_cases
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = "2"
    try:
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, 512, world_size, num_experts_for(world_size))
        for enable_shrink in (False, True):
            buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True,
                                    enable_shrink=enable_shrink)
            assert buffer.elastic_buffer.get_logical_domain_size() == (2, 2)
            (run_mask_cases if enable_shrink else run_cases)(buffer, rank, world_size)
        return True
    finally:
        del os.environ["EP_CPU_NUM_NVLINK_RANKS"]


def test_legacy_low_latency_two_nodes_hybrid(tmp_path):
    """DeepEP's V1 low-latency mode over a hybrid-mode ElasticBuffer: the same checks as on one node."""
    assert run_gloo_ranks(_low_latency_worker, 4, tmp_path, deadline=300) == {r: True for r in range(4)}


# ---------------------------------------------------------------------------------------- emulated nodes
class _EmulatedRankGroup:
    """What topology reads of an `deep_ep.emulated.EmulatedRankGroup` (no GPU needed)."""

    def __init__(self, num_nvlink_ranks):
        self._nvlink = num_nvlink_ranks

    def num_nvlink_ranks(self):
        return self._nvlink

    def make_transport(self, num_bytes):  # marks an emulated group
        raise AssertionError("not called")


@pytest.mark.parametrize("num_ranks, nvlink", [(2, 1), (4, 2), (8, 2), (8, 8)])
def test_emulated_nodes_report_their_domains(num_ranks, nvlink):
    for rank in range(num_ranks):
        direct = topology.group_domains(_EmulatedRankGroup(nvlink), rank, num_ranks, False, allow_hybrid_mode=False)
        assert direct.physical == (num_ranks // nvlink, nvlink) and direct.logical == (1, num_ranks)
        hybrid = topology.group_domains(_EmulatedRankGroup(nvlink), rank, num_ranks, False)
        assert hybrid.logical == (num_ranks // nvlink, nvlink)
        assert (hybrid.scaleout_rank_idx, hybrid.scaleup_rank_idx) == (rank // nvlink, rank % nvlink)
        # both modes run over the emulated GIN
        topology.require_scaleout_support(direct, rank, 0, emulated=True)
        topology.require_scaleout_support(hybrid, rank, 0, emulated=True)
        if nvlink < num_ranks:
            # a real NCCL group over several domains needs an NCCL with GIN (its transport checks the rest)
            for domains in (direct, hybrid):
                topology.require_scaleout_support(domains, rank, 22809)
            with pytest.raises(RuntimeError, match="NCCL >= 2.28.7"):
                topology.require_scaleout_support(hybrid, rank, 22600)


def test_emulated_num_nvlink_ranks_setting(monkeypatch):
    from deep_ep.emulated import _nvlink_ranks
    monkeypatch.delenv("EP_EMULATED_NUM_NVLINK_RANKS", raising=False)
    assert _nvlink_ranks(8, None) == 8 and _nvlink_ranks(8, 2) == 2
    monkeypatch.setenv("EP_EMULATED_NUM_NVLINK_RANKS", "4")
    assert _nvlink_ranks(8, None) == 4 and _nvlink_ranks(8, 1) == 1   # the argument wins
    for bad in ("3", "0", "two"):
        monkeypatch.setenv("EP_EMULATED_NUM_NVLINK_RANKS", bad)
        with pytest.raises(ValueError, match="EP_EMULATED_NUM_NVLINK_RANKS"):
            _nvlink_ranks(8, None)
    with pytest.raises(ValueError, match="dividing"):
        _nvlink_ranks(8, 3)
