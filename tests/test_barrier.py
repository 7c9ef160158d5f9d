"""ElasticBuffer.barrier on the CPU backend, 2 and 4 spawned gloo ranks: DeepEP V2's barrier test
(buffers built with its arguments, many barriers in a row, buffers created and destroyed in a
loop) plus checks it leaves implicit: the barrier really waits for the slowest rank, every flag
combination works given as bools or as ints 0 / 1 (as DeepEP's scripts pass them), and bad flags
are refused on every rank before any communication.
"""
import itertools
import time

import pytest
import torch.distributed as dist

from proc_utils import run_gloo_ranks

FLAG_NAMES = ("use_comm_stream", "with_cpu_sync", "sequential")


def _barrier_worker(rank, world_size, allow_hybrid_mode, num_allocated_qps):
    from deep_ep import ElasticBuffer
    for _ in range(3):   # DeepEP's pressure loop: create, use and destroy a buffer again and again
        buf = ElasticBuffer(dist.group.WORLD, num_bytes=2 ** 30, allow_hybrid_mode=allow_hybrid_mode,
                            num_allocated_qps=num_allocated_qps, explicitly_destroy=True, num_cpu_timeout_secs=30)
        assert buf.get_logical_domain_size() == (1, world_size)
        assert buf.num_allocated_qps == num_allocated_qps   # 0 stays 0 on CPU: no SMs to derive QPs from
        for _ in range(20):
            buf.barrier()
        buf.destroy()
    buf = ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=30)
    # DeepEP's defaults, then every combination as bools, as ints, positionally and by name
    buf.barrier()
    combos = list(itertools.product((0, 1), repeat=3))
    for values in combos:
        buf.barrier(*values)
        buf.barrier(*(bool(v) for v in values))
        buf.barrier(**dict(zip(FLAG_NAMES, values)))
    # the barrier waits for the slowest rank: each rank arrives later than the one before
    exits, entries = [], []
    for round_idx in range(2):
        time.sleep(0.3 * ((rank + round_idx) % world_size))
        entries.append(time.time())
        buf.barrier(use_comm_stream=round_idx, with_cpu_sync=1 - round_idx, sequential=1)
        exits.append(time.time())
    # bad flags: refused on every rank before communicating (the barriers after them still pair up)
    for name in FLAG_NAMES:
        for bad in (2, -1, 1.0, "yes", None):
            with pytest.raises(TypeError, match=f"{name} must be a bool"):
                buf.barrier(**{name: bad})
    buf.barrier(True, False, True)
    buf.destroy()
    with pytest.raises(RuntimeError, match="was destroyed"):
        buf.barrier()
    return entries, exits


@pytest.mark.parametrize("world_size,allow_hybrid_mode,num_allocated_qps", [(2, 1, 8), (4, 0, 0)])
def test_barrier(world_size, allow_hybrid_mode, num_allocated_qps, tmp_path):
    results = run_gloo_ranks(_barrier_worker, world_size, tmp_path, allow_hybrid_mode, num_allocated_qps,
                             deadline=180)
    for round_idx in range(2):
        last_entry = max(entries[round_idx] for entries, _ in results.values())
        for rank, (_, exits) in results.items():
            assert exits[round_idx] >= last_entry, (round_idx, rank, results)
