"""ElasticBuffer.barrier on GPU buffers: a one-rank NCCL group and 2, 4 and 8 ranks emulated on one
device. DeepEP V2's barrier test re-derived (buffers created, used by many barriers and destroyed in
a loop; every flag combination, as bools and as ints 0 / 1), plus what it leaves implicit: every
rank leaves a barrier after the slowest one entered it, the communication stream is drained when
it returns (work queued on it by a GPU-side delay of random length), bad flags are refused before
any communication on every rank, and a destroyed buffer refuses. The CPU backend's version is
tests/test_barrier.py. Run by ``EXTRA_FILES=tests/gpu/test_gpu_barrier.py bash tools/device_suite.sh extra``.
"""
from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

import deep_ep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", 0)
FLAG_NAMES = ("use_comm_stream", "with_cpu_sync", "sequential")


def _run(num_ranks, body):
    if num_ranks == 1:
        from deep_ep.bench.gpu_timing import single_rank_nccl_group
        return [body(single_rank_nccl_group(DEVICE))]
    from deep_ep.emulated import EmulatedGroup
    return EmulatedGroup(num_ranks, device=DEVICE).run(body)


def _body(group):
    rank, num_ranks = group.rank(), group.size()
    for _ in range(3):   # DeepEP's pressure loop: create, use and destroy a buffer again and again
        buf = deep_ep.ElasticBuffer(group, num_bytes=2 ** 24, explicitly_destroy=True, num_cpu_timeout_secs=60)
        assert buf.get_logical_domain_size() == (1, num_ranks)
        for _ in range(20):
            buf.barrier()
        buf.destroy()
    buf = deep_ep.ElasticBuffer(group, num_bytes=2 ** 24, explicitly_destroy=True, num_cpu_timeout_secs=60)
    try:
        buf.barrier()
        for values in itertools.product((0, 1), repeat=3):
            buf.barrier(*values)
            buf.barrier(*(bool(v) for v in values))
            buf.barrier(**dict(zip(FLAG_NAMES, values)))
        entries, exits = [], []
        comm_stream = buf._backend.comm_stream
        for round_index in range(3):
            # the barrier drains the communication stream: a GPU-side delay of random length on it
            with torch.cuda.stream(comm_stream):
                torch.cuda._sleep(random.Random(100 * round_index + rank).randrange(1, 50) * 1_000_000)
            time.sleep(0.2 * ((rank + round_index) % num_ranks))   # the ranks arrive one after another
            entries.append(time.time())
            buf.barrier(use_comm_stream=round_index % 2, with_cpu_sync=1 - round_index % 2, sequential=1)
            exits.append(time.time())
            assert comm_stream.query(), f"rank {rank}: the communication stream still runs after the barrier"
        for name in FLAG_NAMES:
            for bad in (2, -1, 1.0, "yes", None):
                with pytest.raises(TypeError, match=f"{name} must be a bool"):
                    buf.barrier(**{name: bad})
        buf.barrier(True, False, True)   # the ranks still pair up after the refusals
    finally:
        buf.destroy()
    with pytest.raises(RuntimeError, match="was destroyed"):
        buf.barrier()
    return entries, exits


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_barrier(num_ranks):
    results = _run(num_ranks, _body)
    for round_index in range(3):
        last_entry = max(entries[round_index] for entries, _ in results)
        for rank, (_, exits) in enumerate(results):
            assert exits[round_index] >= last_entry, (round_index, rank, results)
