"""DeepEP's V1 low-latency mode of `deep_ep.Buffer` on the GPU: the cases of
tests/test_legacy_low_latency.py (every element compared with the spec there: layouts, FP8 and UE8M0
scales, handles, the weighted combine, receive hooks, zero-copy, ``out=``, rank masks) on a one-rank
NCCL group and on 2, 4 and 8 emulated ranks of one device. Run by
``EXTRA_FILES=tests/gpu/test_gpu_legacy_low_latency.py bash tools/device_suite.sh extra``."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from test_legacy_low_latency import MAX_TOKENS, num_experts_for, run_cases, run_mask_cases  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: the largest hidden of the cases
MAX_HIDDEN = 512


def _body(group, num_ranks):
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = num_experts_for(num_ranks)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, num_ranks, num_experts)
    for enable_shrink in (False, True):
        buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True,
                                enable_shrink=enable_shrink)
        try:
            assert buffer.group_size == num_ranks
            if enable_shrink:
                run_mask_cases(buffer, buffer.rank, num_ranks, device)
            else:
                run_cases(buffer, buffer.rank, num_ranks, device)
                buffer.clean_low_latency_buffer(MAX_TOKENS, MAX_HIDDEN, num_experts)
        finally:
            buffer.destroy()


def test_one_rank_nccl(nccl_group):
    _body(nccl_group, 1)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_emulated(num_ranks):
    from deep_ep.emulated import EmulatedGroup
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0))
    # every emulated rank's blocks must be resident at once: 8 ranks x 20 SMs would not fit
    num_sms = deep_ep.Buffer.num_sms
    deep_ep.Buffer.set_num_sms(min(num_sms, torch.cuda.get_device_properties(0).multi_processor_count
                                   // num_ranks // 2 * 2))
    try:
        group.run(_body, num_ranks)
    finally:
        deep_ep.Buffer.set_num_sms(num_sms)
