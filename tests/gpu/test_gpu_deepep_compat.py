"""DeepEP V2's test of ElasticBuffer (tests/deepep_cases.py: every check of its tests/elastic/test_ep.py, all
144 modes) on the GPU backend: one rank on real NCCL, and 2, 4 and 8 emulated ranks on one GPU.

``DEEP_EP_DEEPEP_MODES=stride`` runs every stride-th mode on emulated ranks (default 1: all of them)."""
import os

import pytest
import torch

from deepep_cases import enumerate_ep_modes, run_ep_modes

M, H, K, E = 10, 128, 4, 16
NUM_MODES = len(list(enumerate_ep_modes()))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _buffer(group):
    from deep_ep import ElasticBuffer
    return ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, deterministic=True,
                         allow_multiple_reduction=True, prefer_overlap_with_compute=False, sl_idx=0,
                         num_allocated_qps=0, explicitly_destroy=True,
                         num_gpu_timeout_secs=float(os.environ.get("DEEP_EP_TEST_GPU_TIMEOUT", "20")),
                         num_cpu_timeout_secs=60)


def _body(group, seed, modes):
    buffer = _buffer(group)
    try:
        return run_ep_modes(buffer, torch.device("cuda", 0), num_tokens=M, hidden=H, num_topk=K, num_experts=E,
                            do_cpu_sync=seed % 2 == 0, masked_ratio=0.1, seed=seed, modes=modes)
    finally:
        buffer.destroy()


@pytest.mark.parametrize("do_cpu_sync", [True, False])
def test_ep1_real_nccl(nccl_group, do_cpu_sync):
    assert _body(nccl_group, 2 if do_cpu_sync else 3, None) == NUM_MODES


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_emulated(num_ranks):
    from deep_ep.emulated import EmulatedGroup
    stride = int(os.environ.get("DEEP_EP_DEEPEP_MODES", "1"))
    modes = set(range(num_ranks % stride, NUM_MODES, stride))
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0))
    done = group.run(lambda rank_group: _body(rank_group, num_ranks * 2, modes))
    assert done == [len(modes)] * num_ranks
