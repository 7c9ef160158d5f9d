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


def _profiler_lines(call, calls: int = 5) -> tuple:
    """``call()`` ``calls`` times under torch.profiler (CUDA activity), a barrier before each as DeepEP's
    test has: ``(the lines of the key-averages table as that test prints it, the events)``."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return events.table(sort_by="cuda_time_total", max_name_column_width=100).split("\n"), events


def test_deepeps_profiler_rule_times_our_kernels(nccl_group):
    """DeepEP's test times each call by the profiler-table lines whose name contains two substrings
    (dispatch: ``dispatch_impl`` and ``dispatch_copy_epilogue_impl``; combine: ``combine_impl`` and
    ``combine_reduce_epilogue_impl``): each must be in exactly one line of a call's table (more fail
    its check, none divides by zero), and that kernel must have run with device time. Fresh, expanded
    and cached dispatches and a combine at EP=1, each profiled with the buffer's barrier beside it."""
    from deep_ep import ElasticBuffer
    dev = torch.device("cuda", 0)
    buffer = ElasticBuffer(nccl_group, num_max_tokens_per_rank=64, hidden=256, num_topk=K, explicitly_destroy=True)
    try:
        g = torch.Generator().manual_seed(11)
        x = torch.randn(64, 256, generator=g).to(torch.bfloat16).to(dev)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(64)]).to(dev)
        w = torch.rand(64, K, generator=g).to(dev)
        recv_x, _, _, handle, _ = buffer.dispatch(x, idx, w, num_experts=E)
        calls = {
            "fresh dispatch": (lambda: buffer.dispatch(x, idx, w, num_experts=E), "dispatch"),
            "expanded dispatch": (lambda: buffer.dispatch(x, idx, w, num_experts=E, do_expand=True), "dispatch"),
            "cached dispatch": (lambda: buffer.dispatch(x, handle=handle), "dispatch"),
            "combine": (lambda: buffer.combine(recv_x, handle=handle), "combine"),
        }
        substrings = {"dispatch": ("dispatch_impl", "dispatch_copy_epilogue_impl"),
                      "combine": ("combine_impl", "combine_reduce_epilogue_impl")}
        for name, (call, kind) in calls.items():
            lines, events = _profiler_lines(lambda: (buffer.barrier(), call()))
            for substring in substrings[kind]:
                matching = [line for line in lines if substring in line]
                assert len(matching) == 1, (name, substring, matching)
                timed = [e for e in events if substring in e.key]
                assert len(timed) == 1 and timed[0].count >= 5, (name, substring, [e.key for e in timed])
                device_us = getattr(timed[0], "device_time_total", None) or timed[0].cuda_time_total
                assert device_us > 0, (name, substring)
    finally:
        torch.cuda.synchronize()
        buffer.destroy()
