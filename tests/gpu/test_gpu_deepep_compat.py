"""DeepEP V2's test of ElasticBuffer (tests/deepep_cases.py: every check of its tests/elastic/test_ep.py, all
144 modes) on the GPU backend: one rank on real NCCL, 2, 4 and 8 emulated ranks on one GPU, and emulated
nodes (`EmulatedGroup(R, num_nvlink_ranks=N)`: 2 x 2, 2 x 4 and 4 x 2) in direct mode and in hybrid
mode (combine checked in DeepEP's hybrid order). Its ``--allow-multiple-reduction 0`` runs on one
node and on emulated nodes in direct and hybrid mode (the ``*_without_multiple_reduction`` tests;
hybrid mode's combine then checked in the flat order).

``DEEP_EP_DEEPEP_MODES=stride`` runs every stride-th mode on emulated ranks (default 1: all of them).
The emulated NIC's seed (its delays and landing order, and from it the contexts used, whether a node's
own ranks go through the NIC, and the inputs) is ``DEEP_EP_GIN_SEED``, else drawn from the clock; it is
part of the scale-out tests' ids, so ``DEEP_EP_GIN_SEED=<seed>`` reruns a failure."""
import os
import time

import pytest
import torch

from deepep_cases import enumerate_ep_modes, run_ep_modes

M, H, K, E = 10, 128, 4, 16
NUM_MODES = len(list(enumerate_ep_modes()))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gin_seed() -> int:
    value = os.environ.get("DEEP_EP_GIN_SEED")
    return int(value) if value else int(time.time() * 1000) % 1_000_000


#: the emulated NIC's seed for the scale-out tests (printed in their ids)
GIN_SEED = _gin_seed()
#: (nodes, ranks per node) of the scale-out tests
SPLITS = [(2, 2), (2, 4), (4, 2)]


def _buffer(group, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True):
    from deep_ep import ElasticBuffer
    return ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, deterministic=True,
                         allow_hybrid_mode=allow_hybrid_mode, allow_multiple_reduction=allow_multiple_reduction,
                         prefer_overlap_with_compute=False, sl_idx=0, num_allocated_qps=0, explicitly_destroy=True,
                         num_gpu_timeout_secs=float(os.environ.get("DEEP_EP_TEST_GPU_TIMEOUT", "20")),
                         num_cpu_timeout_secs=60)


def _body(group, seed, modes, allow_hybrid_mode: bool = True, do_cpu_sync=None, domains=None,
          allow_multiple_reduction: bool = True):
    buffer = _buffer(group, allow_hybrid_mode, allow_multiple_reduction)
    try:
        if domains is not None:
            assert buffer.get_logical_domain_size() == domains, (buffer.get_logical_domain_size(), domains)
        return run_ep_modes(buffer, torch.device("cuda", 0), num_tokens=M, hidden=H, num_topk=K, num_experts=E,
                            do_cpu_sync=seed % 2 == 0 if do_cpu_sync is None else do_cpu_sync, masked_ratio=0.1,
                            seed=seed, modes=modes)
    finally:
        buffer.destroy()


def _stride() -> int:
    return int(os.environ.get("DEEP_EP_DEEPEP_MODES", "1"))


@pytest.mark.parametrize("do_cpu_sync", [True, False])
def test_ep1_real_nccl(nccl_group, do_cpu_sync):
    assert _body(nccl_group, 2 if do_cpu_sync else 3, None) == NUM_MODES


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_emulated(num_ranks):
    from deep_ep.emulated import EmulatedGroup
    stride = _stride()
    modes = set(range(num_ranks % stride, NUM_MODES, stride))
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0))
    done = group.run(lambda rank_group: _body(rank_group, num_ranks * 2, modes))
    assert done == [len(modes)] * num_ranks


def _nic_settings(seed: int):
    """The emulated NIC for ``seed``: 2 or 3 contexts, a node's own ranks by loads and stores or
    through the NIC, the delays and landing order drawn from the seed."""
    from deep_ep.comm.gin import EmulatedGinSettings
    return EmulatedGinSettings(seed=seed, num_contexts=2 + seed % 2, gin_within_node=bool(seed // 2 % 2))


@pytest.mark.parametrize("hybrid", [False, True], ids=["direct", "hybrid"])
@pytest.mark.parametrize("split", SPLITS, ids=[f"{n}x{s}-gin{GIN_SEED}" for n, s in SPLITS])
def test_emulated_scaleout(split, hybrid):
    """Every (stride-th) mode on one GPU acting as ``nodes`` nodes of ``per_node`` ranks; without CPU
    sync on every other split (by the seed). Every mode of the matrix runs across nodes in both modes:
    none is refused."""
    from deep_ep.emulated import EmulatedGroup
    nodes, per_node = split
    num_ranks = nodes * per_node
    split_index = SPLITS.index(split)
    seed = GIN_SEED + split_index
    stride = _stride()
    modes = set(range((GIN_SEED + split_index) % stride, NUM_MODES, stride))
    nic = _nic_settings(seed)
    print(f"emulated scale-out {'hybrid' if hybrid else 'direct'} {nodes}x{per_node}: DEEP_EP_GIN_SEED={GIN_SEED} "
          f"(NIC seed {seed}, {nic.num_contexts} contexts, gin_within_node={nic.gin_within_node}), "
          f"{len(modes)} modes (stride {stride})")
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0), num_nvlink_ranks=per_node, gin_settings=nic)
    domains = (nodes, per_node) if hybrid else (1, num_ranks)
    done = group.run(lambda rank_group: _body(rank_group, seed, modes, allow_hybrid_mode=hybrid,
                                              do_cpu_sync=(seed + hybrid) % 2 == 0, domains=domains))
    assert done == [len(modes)] * num_ranks


@pytest.mark.parametrize("do_cpu_sync", [True, False])
def test_ep1_real_nccl_without_multiple_reduction(nccl_group, do_cpu_sync):
    """DeepEP's test with ``--allow-multiple-reduction 0``: its expanded combine sums every slot's row
    at the source."""
    assert _body(nccl_group, 4 if do_cpu_sync else 5, None, allow_multiple_reduction=False) == NUM_MODES


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_emulated_without_multiple_reduction(num_ranks):
    from deep_ep.emulated import EmulatedGroup
    stride = _stride()
    modes = set(range((num_ranks + 1) % stride, NUM_MODES, stride))
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0))
    done = group.run(lambda rank_group: _body(rank_group, num_ranks * 2 + 1, modes, do_cpu_sync=num_ranks != 4,
                                              allow_multiple_reduction=False))
    assert done == [len(modes)] * num_ranks


def _emulated_scaleout_single_reduction(split, hybrid: bool, seed_offset: int) -> None:
    """Every ``stride``-th mode with ``allow_multiple_reduction=False`` across emulated nodes of
    ``split`` in hybrid or direct mode; without CPU sync on every other split (by the seed)."""
    from deep_ep.emulated import EmulatedGroup
    nodes, per_node = split
    num_ranks = nodes * per_node
    seed = GIN_SEED + seed_offset + SPLITS.index(split)
    stride = _stride()
    modes = set(range(seed % stride, NUM_MODES, stride))
    nic = _nic_settings(seed)
    print(f"emulated scale-out {'hybrid' if hybrid else 'direct'} {nodes}x{per_node} without multiple reduction: "
          f"DEEP_EP_GIN_SEED={GIN_SEED} (NIC seed {seed}, {nic.num_contexts} contexts, "
          f"gin_within_node={nic.gin_within_node}), {len(modes)} modes (stride {stride})")
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0), num_nvlink_ranks=per_node, gin_settings=nic)
    done = group.run(lambda rank_group: _body(rank_group, seed, modes, allow_hybrid_mode=hybrid,
                                              do_cpu_sync=seed % 2 == 0,
                                              domains=(nodes, per_node) if hybrid else (1, num_ranks),
                                              allow_multiple_reduction=False))
    assert done == [len(modes)] * num_ranks


@pytest.mark.parametrize("split", SPLITS, ids=[f"{n}x{s}-gin{GIN_SEED}" for n, s in SPLITS])
def test_emulated_scaleout_without_multiple_reduction(split):
    """``--allow-multiple-reduction 0`` across emulated nodes in direct mode (every slot's row pushed
    to its source through the emulated GIN)."""
    _emulated_scaleout_single_reduction(split, hybrid=False, seed_offset=7)


@pytest.mark.parametrize("split", SPLITS, ids=[f"{n}x{s}-gin{GIN_SEED}" for n, s in SPLITS])
def test_emulated_scaleout_hybrid_without_multiple_reduction(split):
    """``--allow-multiple-reduction 0`` across emulated nodes in hybrid mode (the forwarders pass each
    rank's row, or each (token, slot) row of an expanded handle, on unreduced; combine checked in the
    flat order)."""
    _emulated_scaleout_single_reduction(split, hybrid=True, seed_offset=13)


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
