"""DeepEP's V1 `deep_ep.Buffer` on the GPU: the cases of tests/test_legacy_buffer.py (every element
compared with the per-token spec there) on a one-rank NCCL group and on 2, 4 and 8 emulated ranks
of one device. Run by ``EXTRA_FILES=tests/gpu/test_gpu_legacy.py bash tools/device_suite.sh extra``."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from gpu_cases import run_legacy_on_emulated_ranks  # noqa: E402
from test_legacy_buffer import CASES, _run_case  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: the largest hidden of the cases is 256 (FP8); the window is sized for it
HIDDEN_BYTES = 2 * 256


def _body(group, num_ranks):
    device = torch.device("cuda", torch.cuda.current_device())
    num_nvl_bytes = deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN_BYTES, num_ranks)
    buffer = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)
    try:
        rank = buffer.rank
        assert buffer.group_size == num_ranks
        for index, case in enumerate(CASES):
            try:
                _run_case(buffer, rank, num_ranks, index, case, device)
            except Exception as exc:
                raise AssertionError(f"case {case[0]}, rank {rank} of {num_ranks}: {exc}") from exc
    finally:
        buffer.destroy()


def test_one_rank_nccl(nccl_group):
    _body(nccl_group, 1)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_emulated(num_ranks):
    run_legacy_on_emulated_ranks(_body, num_ranks)
