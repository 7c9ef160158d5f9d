"""DeepEP's V1 `deep_ep.Buffer` across nodes on one GPU: `EmulatedGroup(R, num_nvlink_ranks=2)` acting
as R / 2 nodes of 2 ranks (4 and 8 ranks), the ranks of other nodes reached through the emulated GIN.

* Low-latency mode: the Buffer's `ElasticBuffer` is in direct mode with ``num_allocated_qps =
  num_qps_per_rank``; the cases of tests/test_legacy_low_latency.py (BF16, FP8 with float and rounded
  scales, UE8M0; two dispatches per case, so both buffer halves; combine from ``x``, zero-copy and
  ``out=``), and rank masks, every element against the spec there. Receive hooks over the GIN are refused
  (`NotImplementedError`, before anything is sent). The same Buffer's normal-mode calls run in hybrid mode.
* Normal mode: the Buffer's `ElasticBuffer` in hybrid mode; the cases of tests/test_legacy_buffer.py
  (`_run_case`: get_dispatch_layout with ``num_tokens_per_rdma_rank``, a fresh dispatch, a cached one
  with the handle, combine with biases and weights), every element against the per-token spec there
  (DeepEP's 10-item internode handle, combine in DeepEP's internode order), every output poisoned.
* A probe, skipped unless ``DEEP_EP_PROBE_GIN_HOOKS=1``: the low-latency cases with receive hooks over
  the GIN, the refusal lifted, to learn whether the send / receive split already works there.

Run by ``EXTRA_FILES=tests/gpu/test_gpu_legacy_scaleout.py bash tools/device_suite.sh extra`` (the
probe: ``DEEP_EP_PROBE_GIN_HOOKS=1 PYTEST_ARGS="-k probe"`` in front).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from proc_utils import case_log  # noqa: E402
from test_legacy_buffer import CASES as NORMAL_CASES  # noqa: E402
from test_legacy_buffer import _run_case as run_normal_case  # noqa: E402
from test_legacy_low_latency import (CASES, MAX_TOKENS, _rank_inputs, _run_case, num_experts_for,  # noqa: E402
                                     run_mask_cases)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NUM_QPS = 2
MAX_HIDDEN = 512
#: (ranks, ranks per node)
SHAPES = [(4, 2), (8, 2)]


def _run(body, num_ranks: int, per_node: int) -> None:
    """``body(group, num_ranks, per_node)`` on emulated nodes, with `deep_ep.Buffer`'s class-wide SM
    count lowered so that every rank's blocks and its emulated NIC's are resident at once."""
    from deep_ep.emulated import EmulatedGroup
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0), num_nvlink_ranks=per_node)
    num_sms = deep_ep.Buffer.num_sms
    share = torch.cuda.get_device_properties(0).multi_processor_count // num_ranks
    deep_ep.Buffer.set_num_sms(max(2, min(num_sms, (share - 4) // 2 * 2)))
    try:
        group.run(body, num_ranks, per_node)
    finally:
        deep_ep.Buffer.set_num_sms(num_sms)


def _low_latency_body(group, num_ranks, per_node):
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = num_experts_for(num_ranks)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=NUM_QPS,
                            explicitly_destroy=True)
    rank = buffer.rank
    try:
        assert (buffer.num_rdma_ranks, buffer.num_nvl_ranks) == (num_ranks // per_node, per_node)
        assert buffer.elastic_buffer.get_logical_domain_size() == (num_ranks // per_node, per_node)   # hybrid
        for index, (hidden, use_fp8, round_scale, use_ue8m0) in enumerate(CASES):
            name = f"{num_ranks}/{per_node} rank {rank} hidden {hidden} fp8 {use_fp8} round {round_scale} ue8m0 " \
                   f"{use_ue8m0}"
            case_log(f"legacy scaleout {name}: start")
            try:
                _run_case(buffer, rank, num_ranks, num_experts, hidden, index, use_fp8, round_scale, use_ue8m0,
                          False, device)
            except Exception as exc:
                raise AssertionError(f"{name}: {exc}") from exc
        for elastic in buffer._low_latency_buffers()[1:]:
            assert elastic.get_logical_domain_size() == (1, num_ranks) and elastic.num_allocated_qps == NUM_QPS
        x, topk_idx, _ = (tensor.to(device) for tensor in _rank_inputs(40, rank, num_ranks, num_experts, 512))
        with pytest.raises(NotImplementedError, match="return_recv_hook=True over the GIN"):
            buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, return_recv_hook=True)
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
        buffer.low_latency_combine(recv_x, topk_idx, torch.ones(topk_idx.shape, device=device), handle)  # in step
        buffer.clean_low_latency_buffer(MAX_TOKENS, MAX_HIDDEN, num_experts)
        run_normal_case(buffer, rank, num_ranks, 0, NORMAL_CASES[0], device)   # normal mode on the same Buffer
    finally:
        buffer.destroy()
    shrink = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=NUM_QPS,
                            explicitly_destroy=True, enable_shrink=True)
    try:
        run_mask_cases(shrink, rank, num_ranks, device, use_hook=False)
    finally:
        shrink.destroy()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0] // s[1]}x{s[1]}")
def test_low_latency_across_emulated_nodes(shape):
    _run(_low_latency_body, *shape)


def _normal_mode_body(group, num_ranks, per_node):
    from deep_ep.backends import outputs
    device = torch.device("cuda", torch.cuda.current_device())
    num_nvl_bytes = deep_ep.Config().get_nvl_buffer_size_hint(2 * 256, num_ranks)   # hidden 256 at most
    buffer = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)
    try:
        assert (buffer.num_rdma_ranks, buffer.num_nvl_ranks) == (num_ranks // per_node, per_node)
        assert buffer.elastic_buffer.get_logical_domain_size() == (num_ranks // per_node, per_node)   # hybrid
        for index, case in enumerate(NORMAL_CASES):
            case_log(f"legacy scaleout normal {num_ranks}/{per_node} rank {buffer.rank} {case[0]}: start")
            try:
                with outputs.poisoned():
                    run_normal_case(buffer, buffer.rank, num_ranks, index, case, device)
            except Exception as exc:
                raise AssertionError(f"case {case[0]}, rank {buffer.rank} of {num_ranks}: {exc}") from exc
    finally:
        buffer.destroy()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0] // s[1]}x{s[1]}")
def test_normal_mode_across_emulated_nodes(shape):
    _run(_normal_mode_body, *shape)


def _hooks_probe_body(group, num_ranks, per_node):
    """Low-latency calls with receive hooks over the GIN, the refusal lifted: every element against
    the spec (BF16 and FP8 cases of tests/test_legacy_low_latency.py, hooks called once each)."""
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = num_experts_for(num_ranks)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=NUM_QPS,
                            explicitly_destroy=True)
    try:
        for index, (hidden, use_fp8, round_scale, use_ue8m0) in enumerate(CASES[:2]):
            _run_case(buffer, buffer.rank, num_ranks, num_experts, hidden, index, use_fp8, round_scale, use_ue8m0,
                      True, device)
    finally:
        buffer.destroy()


@pytest.mark.skipif(os.environ.get("DEEP_EP_PROBE_GIN_HOOKS") != "1",
                    reason="a probe: set DEEP_EP_PROBE_GIN_HOOKS=1 to try receive hooks over the GIN")
def test_probe_receive_hooks_over_gin(monkeypatch):
    """Whether the send / receive split of the data kernels (deep_ep/legacy/deferred.py) already works
    over the emulated GIN (each phase launch gets its own emulated NIC kernel): the refusal
    (`_refuse_hooks_over_gin`) is lifted for this test only. Passing would let it be removed."""
    from deep_ep.legacy.ll_state import LowLatencyState
    monkeypatch.setattr(LowLatencyState, "_refuse_hooks_over_gin", lambda self, return_recv_hook: None)
    _run(_hooks_probe_body, 4, 2)
