"""DeepEP's V1 `deep_ep.Buffer` with both modes on one Buffer, as SGLang's "auto" mode uses it (normal
mode for prefill, low-latency mode for decode): the normal-mode cases of tests/test_legacy_buffer.py
and the low-latency cases of tests/test_legacy_low_latency.py, taking turns on one Buffer made with
``num_nvl_bytes`` and ``num_rdma_bytes``, every element compared with their specs; the two modes on
windows of their own (`deep_ep.legacy.internode.open_elastic_buffers` says why), the low-latency calls
on the direct kernels; and a Buffer of ``num_nvl_bytes=0`` refusing normal-mode calls. On a one-rank
NCCL group and on 2, 4 and 8 emulated ranks of one device. Run by
``EXTRA_FILES=tests/gpu/test_gpu_legacy_modes.py bash tools/device_suite.sh extra``."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from gpu_cases import run_legacy_on_emulated_ranks  # noqa: E402
from test_legacy_buffer import CASES, _run_case  # noqa: E402
from test_legacy_low_latency import MAX_TOKENS, _rank_inputs, num_experts_for, run_cases  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_HIDDEN = 512          # the low-latency cases' largest hidden
HIDDEN_BYTES = 2 * 256    # the normal-mode cases' largest hidden (FP8 at 256)
MIB = 1 << 20


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // (2 * MIB)) * 2 * MIB


def _body(group, num_ranks):
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = num_experts_for(num_ranks)
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN_BYTES, num_ranks)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, nvl, rdma, low_latency_mode=True, explicitly_destroy=True)
    try:
        rank = buffer.rank
        low_latency_window = buffer.__dict__["_low_latency_extra_buffer"]
        assert buffer.elastic_buffer.num_bytes == _aligned(nvl) and low_latency_window.num_bytes == _aligned(rdma)
        for turn in range(2):
            for index, case in enumerate(CASES[turn::2]):     # normal mode (prefill)
                try:
                    _run_case(buffer, rank, num_ranks, index, case, device)
                except Exception as exc:
                    raise AssertionError(f"turn {turn}, normal case {case[0]}, rank {rank}: {exc}") from exc
            # SGLang's switch: clean, then low-latency calls (decode), which run on their own window
            buffer.clean_low_latency_buffer(MAX_TOKENS, MAX_HIDDEN, num_experts)
            x, topk_idx, topk_weights = (t.to(device) for t in _rank_inputs(7 + turn, rank, num_ranks, num_experts,
                                                                             384))
            _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
            assert handle.direct.window is low_latency_window
            expert_x = torch.zeros(num_experts // num_ranks, num_ranks * MAX_TOKENS, 384, dtype=torch.bfloat16,
                                   device=device)
            buffer.low_latency_combine(expert_x, topk_idx, topk_weights, handle)
            run_cases(buffer, rank, num_ranks, device)
    finally:
        buffer.destroy()
    low_latency_only = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
    try:
        idx = torch.zeros(4, 2, dtype=torch.int64, device=device)
        per_rank, _, per_expert, in_rank, _ = low_latency_only.get_dispatch_layout(idx, num_experts)
        with pytest.raises(ValueError, match="num_nvl_bytes=0"):
            low_latency_only.dispatch(torch.zeros(4, 256, dtype=torch.bfloat16, device=device), topk_idx=idx,
                                      num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                      num_tokens_per_expert=per_expert)
    finally:
        low_latency_only.destroy()


def test_one_rank_nccl(nccl_group):
    _body(nccl_group, 1)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_emulated(num_ranks):
    run_legacy_on_emulated_ranks(_body, num_ranks)
