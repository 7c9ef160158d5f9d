"""DeepEP's V1 `deep_ep.Buffer` across nodes on the CPU backend: gloo groups acting as several NVLink
domains (`EP_CPU_NUM_NVLINK_RANKS`), 4 ranks as 2 nodes x 2 and 2 ranks as 2 nodes x 1.

* Normal mode: the cases of tests/test_legacy_buffer.py (`_run_case`: BF16 and FP8, with and without
  top-k, alignment, ``num_worst_tokens``, cached dispatch, combine with biases and weights), every
  element against the per-token spec there: ``num_tokens_per_rdma_rank``, the received rows, DeepEP's
  10-item internode handle (`spec_internode_handle`), and combine in DeepEP's internode order (each
  node's ranks summed and rounded to bf16, then the nodes; weights likewise in float32). Also
  ``internode_dispatch`` / ``internode_combine`` called directly, and the refusals of a missing or wrong
  ``num_tokens_per_rdma_rank``.
* Low-latency mode: the cases of tests/test_legacy_low_latency.py (layouts, FP8 / UE8M0, hooks,
  zero-copy, double buffering, rank masks) on a Buffer whose low-latency calls run on a direct-mode
  `ElasticBuffer` with ``num_allocated_qps = num_qps_per_rank``; the same Buffer's normal-mode calls
  run in hybrid mode.
* The framework replays of tests/test_framework_calls.py on 2 ranks as 2 nodes of 1.
"""
import os

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.legacy import InternodeHandle
from proc_utils import run_gloo_ranks
from test_legacy_buffer import CASES, _inputs, _run_case
from test_legacy_low_latency import MAX_TOKENS, num_experts_for, run_cases, run_double_buffer_cases, run_mask_cases

NUM_QPS = 3


def _as_nodes(num_nvl_ranks: int) -> None:
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = str(num_nvl_ranks)


def _normal_worker(rank, world_size, num_nvl_ranks):
    _as_nodes(num_nvl_ranks)
    nodes = world_size // num_nvl_ranks
    hint = deep_ep.Config().get_rdma_buffer_size_hint(7168 * 2, 16)
    buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=0, num_rdma_bytes=hint)
    assert (buffer.num_rdma_ranks, buffer.num_nvl_ranks) == (nodes, num_nvl_ranks)
    assert buffer.elastic_buffer.get_logical_domain_size() == (nodes, num_nvl_ranks)      # hybrid
    for index, case in enumerate(CASES):
        try:
            _run_case(buffer, rank, world_size, index, case)
        except Exception as exc:
            raise AssertionError(f"case {case[0]}, rank {rank}: {exc}") from exc

    # DeepEP's internode entry points, and the refusals (on every rank, before any communication)
    num_experts = 4 * world_size
    x, topk_idx, topk_weights = _inputs(31, [6] * world_size, num_experts, 2, 128, False)[rank]
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    with pytest.raises(TypeError, match="num_tokens_per_rdma_rank must be a torch.Tensor"):
        buffer.dispatch(x, **args)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank does not match"):
        buffer.dispatch(x, num_tokens_per_rdma_rank=per_rdma_rank + 1, **args)
    recv_x, _, recv_w, _, handle, _ = buffer.internode_dispatch(
        x, num_tokens_per_rdma_rank=per_rdma_rank, topk_idx=topk_idx, topk_weights=topk_weights,
        num_worst_tokens=6 * world_size, config=deep_ep.Buffer.get_dispatch_config(world_size), **args)
    assert isinstance(handle, InternodeHandle) and len(handle) == 10 and handle[9] is None
    assert recv_x.shape[0] == 6 * world_size
    cached = buffer.internode_dispatch(x, handle=handle)[0]
    assert torch.equal(cached, recv_x[:cached.shape[0]])
    combined, combined_w, _ = buffer.internode_combine(recv_x, handle, topk_weights=recv_w)
    sent = in_rank.sum(1, keepdim=True)
    assert torch.equal(combined, (x.float() * sent + 0.0).to(torch.bfloat16))   # exact: small integers
    assert combined_w.shape == topk_weights.shape
    return nodes


@pytest.mark.parametrize("shape", [(2, 2), (2, 1)], ids=["2x2", "2x1"])
def test_normal_mode_across_nodes(shape, tmp_path):
    nodes, per_node = shape
    assert run_gloo_ranks(_normal_worker, nodes * per_node, tmp_path, per_node, deadline=200) == \
        {r: nodes for r in range(nodes * per_node)}


def _low_latency_worker(rank, world_size, num_nvl_ranks):
    _as_nodes(num_nvl_ranks)
    num_experts = num_experts_for(world_size)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, 512, world_size, num_experts)
    with pytest.raises(ValueError, match="num_qps_per_rank must be >= 1"):
        deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=0)
    for enable_shrink in (False, True):
        buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True,
                                num_qps_per_rank=NUM_QPS, enable_shrink=enable_shrink, explicitly_destroy=True)
        direct = buffer._low_latency_elastic_buffer(MAX_TOKENS, 512)
        assert direct is not buffer.elastic_buffer
        assert direct.get_logical_domain_size() == (1, world_size) and direct.num_allocated_qps == NUM_QPS
        assert buffer.elastic_buffer.get_logical_domain_size() == (world_size // num_nvl_ranks, num_nvl_ranks)
        if enable_shrink:
            run_mask_cases(buffer, rank, world_size)
            run_mask_cases(buffer, rank, world_size, use_hook=False)      # as on emulated GPU nodes
        else:
            run_cases(buffer, rank, world_size)
            run_double_buffer_cases(buffer, rank, world_size)
            # normal mode on the same Buffer, between low-latency calls
            _run_case(buffer, rank, world_size, 0, CASES[0])
            run_cases(buffer, rank, world_size)
        buffer.destroy()
    return True


@pytest.mark.parametrize("shape", [(2, 2), (2, 1)], ids=["2x2", "2x1"])
def test_low_latency_across_nodes(shape, tmp_path):
    nodes, per_node = shape
    run_gloo_ranks(_low_latency_worker, nodes * per_node, tmp_path, per_node, deadline=300)


def _framework_worker(rank, world_size, name):
    import test_framework_calls
    _as_nodes(1)
    assert deep_ep.get_physical_domain_size(dist.group.WORLD) == (world_size, 1)
    getattr(test_framework_calls, name)(rank, world_size)


@pytest.mark.parametrize("name", ["_sglang", "_vllm", "_megatron", "_tensorrt_llm"])
def test_framework_calls_across_nodes(name, tmp_path):
    """tests/test_framework_calls.py's replays of SGLang (one Buffer for both modes), vLLM, Megatron-LM
    (autograd) and TensorRT-LLM on 2 ranks acting as 2 nodes of 1: the same results as on one node
    (with one rank per node DeepEP's internode sums round nothing more)."""
    run_gloo_ranks(_framework_worker, 2, tmp_path, name, deadline=200)


def test_a_gpu_groups_domains_come_from_nccl_and_the_hold_spans_both_buffers(monkeypatch):
    """A V1 Buffer on a GPU torch group over two nodes of 8 (NCCL's LSA team, faked): two NVLink
    domains, the normal-mode ElasticBuffer in hybrid mode and the low-latency one in direct mode with
    ``num_qps_per_rank`` QPs, both made while one hold keeps the group's communicator."""
    import contextlib
    import types

    import deep_ep.buffer
    from deep_ep.legacy import internode
    events = []

    @contextlib.contextmanager
    def hold(group, on_cpu):
        events.append(("hold", on_cpu))
        yield
        events.append("release")

    class FakeElastic:
        def __init__(self, group, **kwargs):
            events.append(("buffer", kwargs.get("allow_hybrid_mode", True), kwargs.get("num_allocated_qps"),
                           kwargs["num_bytes"]))

    monkeypatch.setattr(internode, "is_cpu_group", lambda group, device: False)
    monkeypatch.setattr(internode, "group_domain_sizes", lambda group, hybrid, device: ((2, 8), (2, 8)))
    monkeypatch.setattr(internode, "creation_hold", hold)
    monkeypatch.setattr(deep_ep.buffer, "ElasticBuffer", FakeElastic)
    owner = types.SimpleNamespace()
    timeouts = {"num_cpu_timeout_secs": 5, "num_gpu_timeout_secs": 6}
    internode.open_elastic_buffers(owner, object(), 1 << 20, 1 << 21, 4, True, True, "cuda", timeouts)
    assert (owner.num_rdma_ranks, owner.num_nvl_ranks) == (2, 8)
    # across nodes one size for both, as before the split within one node (nvl + rdma, in 2 MiB steps)
    assert events == [("hold", False), ("buffer", True, None, 4 << 20), ("buffer", False, 4, 4 << 20), "release"]
    assert owner._low_latency_options == {"allow_hybrid_mode": False, "num_allocated_qps": 4, **timeouts}


def test_normal_and_low_latency_calls_get_windows_of_their_own_within_one_node(monkeypatch):
    """On a GPU within one node a low-latency Buffer with both sizes makes two windows (num_nvl_bytes,
    num_rdma_bytes), and low-latency calls (expanded half 0, direct kernels) never use the normal-mode
    one; with num_nvl_bytes=0 its one window is the low-latency one and normal-mode calls raise."""
    import types

    import deep_ep.buffer
    from deep_ep.legacy import internode, ll_direct
    from deep_ep.legacy.ll_state import LowLatencyState
    made = []

    class FakeElastic:
        is_destroyed = False
        device = torch.device("cuda")

        def __init__(self, group, **kwargs):
            self.num_bytes = kwargs["num_bytes"]
            self._backend = types.SimpleNamespace(config=types.SimpleNamespace(num_cpu_bytes=0))
            made.append(self)

    monkeypatch.setattr(internode, "is_cpu_group", lambda group, device: False)
    monkeypatch.setattr(internode, "group_domain_sizes", lambda group, hybrid, device: ((1, 8), (1, 8)))
    monkeypatch.setattr(deep_ep.buffer, "ElasticBuffer", FakeElastic)

    class Owner(LowLatencyState):
        group_size, low_latency_mode = 8, True

        def _alive(self):
            return self.elastic_buffer

    mib = 1 << 20
    for nvl, rdma in ((3 * mib, 5 * mib), (0, 5 * mib)):
        made.clear()
        owner = Owner()
        owner.num_nvl_bytes, owner.num_rdma_bytes = nvl, rdma
        internode.open_elastic_buffers(owner, object(), nvl, rdma, 4, True, False, "cuda", {})
        if nvl:
            normal, low_latency = made
            assert (normal.num_bytes, low_latency.num_bytes) == (4 * mib, 6 * mib)
            assert owner.__dict__["_low_latency_extra_buffer"] is low_latency
            assert internode.normal_mode_buffer(owner) is normal
        else:
            (low_latency,) = made
            assert low_latency.num_bytes == 6 * mib and owner.elastic_buffer is low_latency
            with pytest.raises(ValueError, match="num_nvl_bytes=0"):
                internode.normal_mode_buffer(owner)
        assert owner._low_latency_elastic_buffer(16, 512, 0) is low_latency
        assert ll_direct._window(owner, 5 * mib) is low_latency
    made.clear()
    prepared = []             # a Buffer with rank masks loads the direct kernels at creation
    monkeypatch.setattr(ll_direct, "prepare", prepared.append)
    shrink = Owner()
    shrink.enable_shrink, shrink.num_nvl_bytes, shrink.num_rdma_bytes = True, 3 * mib, 5 * mib
    internode.open_elastic_buffers(shrink, object(), 3 * mib, 5 * mib, 4, True, False, "cuda", {})
    assert [b.num_bytes for b in made] == [4 * mib, 8 * mib]   # the expanded path keeps the combined size
    assert prepared == [shrink]
    with pytest.raises(ValueError, match="num_nvl_bytes=0 leaves no GPU window"):
        internode.open_elastic_buffers(Owner(), object(), 0, 5 * mib, 4, False, False, "cuda", {})
