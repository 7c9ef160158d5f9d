"""DeepEP V2's test of ElasticBuffer (tests/deepep_cases.py: every check of its tests/elastic/test_ep.py,
the 144 modes) on the CPU backend acting as several nodes (``EP_CPU_NUM_NVLINK_RANKS``): 2 gloo ranks as
2 nodes x 1 and 4 as 2 x 2, each in hybrid mode (``allow_hybrid_mode=True``, DeepEP's test default) and
direct mode, plus hybrid mode without CPU sync and without multiple reduction.

As in DeepEP's test, combines are checked bit for bit against its multi-level recipe: in hybrid mode
across nodes with multiple reduction, within the rank, then within the node, then across nodes
(``reference_combine_deepep(..., num_scaleup_ranks=S)``); in direct mode and without multiple reduction,
the flat order. Dispatch outputs and handles are checked as on one node, the per-scale-up-rank prefix
sums against DeepEP's per-scale-up-rank counts.

CI runs every ``STRIDE``-th mode of each configuration, the configurations offset so that together
they cover different modes; ``DEEP_EP_DEEPEP_MODES=1`` runs all 144 of each (``=k``: every k-th).
"""
import os

import pytest
import torch
import torch.distributed as dist

from deepep_cases import enumerate_ep_modes
from proc_utils import run_gloo_ranks

M, H, K, E = 10, 128, 4, 16
NUM_MODES = len(list(enumerate_ep_modes()))
#: every STRIDE-th mode in CI: the configurations of a split, offset by one mode each, cover all 144
#: together, each mode in one (all of every configuration: about 100 s on two cores, CI a third of that)
STRIDE = 4

#: (nodes, ranks per node) -> configurations (allow_hybrid_mode, do_cpu_sync, allow_multiple_reduction),
#: each run in the same set of processes
SPLITS = {(2, 1): [(True, True, True), (False, True, True), (True, False, True), (True, True, False)],
          (2, 2): [(True, True, True), (False, True, True), (True, False, True), (True, True, False)]}


def _stride() -> int:
    stride = int(os.environ.get("DEEP_EP_DEEPEP_MODES", str(STRIDE)))
    if stride < 1:
        raise ValueError(f"DEEP_EP_DEEPEP_MODES must be a positive stride, got {stride}")
    return stride


def _modes(config_index: int, stride: int) -> set:
    """Every ``stride``-th mode, starting at an offset of its own per configuration."""
    return set(range(config_index % stride, NUM_MODES, stride))


def _worker(rank, world_size, num_nvlink_ranks, stride):
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = str(num_nvlink_ranks)
    from deep_ep import ElasticBuffer
    from deepep_cases import run_ep_modes

    done, order_differs = [], []
    configs = SPLITS[(world_size // num_nvlink_ranks, num_nvlink_ranks)]
    for config_index, (hybrid, do_cpu_sync, multi) in enumerate(configs):
        buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, deterministic=True,
                               allow_hybrid_mode=hybrid, allow_multiple_reduction=multi,
                               prefer_overlap_with_compute=False, sl_idx=0, num_allocated_qps=0,
                               explicitly_destroy=True, num_gpu_timeout_secs=100, num_cpu_timeout_secs=60)
        try:
            expected = (world_size // num_nvlink_ranks, num_nvlink_ranks) if hybrid else (1, world_size)
            assert buffer.get_logical_domain_size() == expected, (buffer.get_logical_domain_size(), expected)
            assert (buffer.num_rdma_ranks, buffer.num_nvlink_ranks) == (world_size // num_nvlink_ranks,
                                                                       num_nvlink_ranks)
            done.append(run_ep_modes(buffer, torch.device("cpu"), num_tokens=M, hidden=H, num_topk=K, num_experts=E,
                                     do_cpu_sync=do_cpu_sync, masked_ratio=0.1,
                                     seed=10 * world_size + config_index, modes=_modes(config_index, stride),
                                     order_differs=order_differs))
        finally:
            buffer.destroy()
    if num_nvlink_ranks > 1:   # nodes of one rank sum as the flat order does (but for the sign of a zero)
        assert any(order_differs), "no mode's hybrid combine differs from the flat order: the check is blind"
    return done


@pytest.mark.parametrize("split", sorted(SPLITS), ids=lambda s: f"{s[0]}x{s[1]}")
def test_deepep_ep_modes_across_nodes(split, tmp_path):
    nodes, per_node = split
    world_size = nodes * per_node
    stride = _stride()
    expected = [len(_modes(i, stride)) for i in range(len(SPLITS[split]))]
    res = run_gloo_ranks(_worker, world_size, tmp_path, per_node, stride,
                         deadline=60 + 5 * sum(expected) * world_size)
    assert res == {r: expected for r in range(world_size)}
