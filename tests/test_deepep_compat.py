"""DeepEP V2's test of ElasticBuffer (every check of its tests/elastic/test_ep.py, all 144 modes,
re-derived in tests/deepep_cases.py) on the CPU backend: gloo, 2 and 4 spawned ranks, with and without
CPU sync, and with allow_multiple_reduction off (the single-pass expanded combine)."""
import pytest
import torch
import torch.distributed as dist

from proc_utils import run_gloo_ranks

M, H, K, E = 10, 128, 4, 16


#: (do_cpu_sync, allow_multiple_reduction) runs per rank count, in one set of processes each.
CONFIGS = {2: [(True, True), (False, True), (True, False)], 4: [(True, True), (False, True)]}


def _worker(rank, world_size):
    from deep_ep import ElasticBuffer
    from deepep_cases import run_ep_modes

    done = []
    for do_cpu_sync, allow_multiple_reduction in CONFIGS[world_size]:
        buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, deterministic=True,
                               allow_multiple_reduction=allow_multiple_reduction, prefer_overlap_with_compute=False,
                               sl_idx=0, num_allocated_qps=0, explicitly_destroy=True, num_gpu_timeout_secs=100,
                               num_cpu_timeout_secs=60)
        try:
            done.append(run_ep_modes(buffer, torch.device("cpu"), num_tokens=M, hidden=H, num_topk=K, num_experts=E,
                                     do_cpu_sync=do_cpu_sync, masked_ratio=0.1, seed=world_size + 2 * do_cpu_sync))
        finally:
            buffer.destroy()
    return done


@pytest.mark.parametrize("world_size", [2, 4])
def test_deepep_ep_modes(world_size, tmp_path):
    res = run_gloo_ranks(_worker, world_size, tmp_path, deadline=400)
    assert res == {r: [144] * len(CONFIGS[world_size]) for r in range(world_size)}
