"""DeepEP's V1 low-latency mode on the direct kernels (`deep_ep.legacy.ll_direct`, the default where
they apply): the dispatch and combine cases of tests/gpu/test_gpu_legacy_low_latency.py
(every element compared with the spec of tests/test_legacy_low_latency.py: layouts, FP8 and UE8M0
scales, handles, the weighted combine, receive hooks, zero-copy, ``out=``, double buffering with hook
results equal bit for bit to those without) on a one-rank NCCL group and on 2, 4 and 8 emulated ranks
of one device, every output allocated from memory poisoned first; that the calls took the direct
path, with ``enable_shrink`` too (its mask cases passing, and DeepEP's failure simulation: a rank that
stops making calls is masked by its peers' timed-out waits, then not waited for); and the decode
step captured in a CUDA graph and replayed with fresh inputs; that a call without a receive hook
launches both phases of its kernel at once, and one with a hook only its kernel's send phase and the
hook its receive phase, with a matmul between them that finishes while peers have not even made their
call. Run by
``EXTRA_FILES=tests/gpu/test_gpu_legacy_ll_direct.py bash tools/device_suite.sh extra``."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from deep_ep.legacy import ll_direct  # noqa: E402
from gpu_cases import run_legacy_on_emulated_ranks  # noqa: E402
from test_legacy_low_latency import (CASES, MAX_TOKENS, _cast_back, _check_dispatch, _expected_combine,  # noqa: E402
                                     _expert_output, _host, _rank_inputs, num_experts_for, run_cases,
                                     run_double_buffer_cases, run_mask_cases)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_HIDDEN = 512     # the largest hidden of the cases
POISON = 0x7F        # int32 0x7F7F7F7F (never -1), bf16 / float32 huge finite, FP8 NaN



def _poison_allocator(device: torch.device) -> None:
    """Fill the caching allocator's free memory with `POISON`: blocks of the sizes the calls allocate
    (small and large pools), filled, then freed, so that the outputs made next start poisoned."""
    sizes = [1 << 9, 1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 23, 1 << 25]
    blocks = [torch.full((size,), POISON, dtype=torch.uint8, device=device) for size in sizes for _ in range(8)]
    # the rank's own stream, never the device: emulated peers' kernels may be spinning on this rank
    torch.cuda.current_stream(device).synchronize()
    del blocks


def _check_direct_path(buffer, rank: int, num_ranks: int, device: torch.device, direct: bool) -> None:
    num_experts = num_experts_for(num_ranks)
    x, topk_idx, topk_weights = (t.to(device) for t in _rank_inputs(5, rank, num_ranks, num_experts, 384))
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
    assert (getattr(handle, "direct", None) is not None) == direct
    expert_x = torch.zeros(num_experts // num_ranks, num_ranks * MAX_TOKENS, 384, dtype=torch.bfloat16, device=device)
    buffer.low_latency_combine(expert_x, topk_idx, topk_weights, handle)


def _body(group, num_ranks):
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = num_experts_for(num_ranks)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, num_ranks, num_experts)
    for enable_shrink in (False, True):
        buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True,
                                enable_shrink=enable_shrink)
        try:
            _check_direct_path(buffer, buffer.rank, num_ranks, device, True)
            _poison_allocator(device)
            if enable_shrink:
                run_mask_cases(buffer, buffer.rank, num_ranks, device)
                run_mask_cases(buffer, buffer.rank, num_ranks, device, use_hook=False)
            else:
                run_cases(buffer, buffer.rank, num_ranks, device)
                _poison_allocator(device)
                run_double_buffer_cases(buffer, buffer.rank, num_ranks, device)
                buffer.clean_low_latency_buffer(MAX_TOKENS, MAX_HIDDEN, num_experts)
                run_cases(buffer, buffer.rank, num_ranks, device)     # the halves' tags still in step
        finally:
            buffer.destroy()


def test_one_rank_nccl(nccl_group):
    _body(nccl_group, 1)


@pytest.mark.parametrize("num_ranks", [2, 4, 8, 12])   # 12: an NVLink domain of more than DeepEP's V1 nodes
def test_emulated(num_ranks):
    run_legacy_on_emulated_ranks(_body, num_ranks)


FAILURE_TIMEOUT_SECS = 6.0


def _failure_body(group, num_ranks, meet):
    """DeepEP's failure simulation: a round every rank makes (the kernels load), then rank 1 makes no
    call and the last rank its dispatch but not its combine. The others' waits for them time out,
    which masks them: results as if they had sent nothing, masks that say so. Then a round that
    waits for neither (its calls take far less than the timeout). ``meet(index)``: a barrier of the
    ranks that make round ``index``'s dispatch, so that host skew between healthy ranks never comes
    near the timeout; the ranks that stopped wait at the end (their destroy would free memory while
    their peers' kernels still wait for them)."""
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = num_experts_for(num_ranks)
    num_local = num_experts // num_ranks
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True,
                            enable_shrink=True, num_gpu_timeout_secs=FAILURE_TIMEOUT_SECS)
    rank = buffer.rank
    status = torch.full((num_ranks,), 7, dtype=torch.int32, device=device)
    try:
        for index, (dispatching, combining) in enumerate(failure_rounds(num_ranks)):
            if rank not in dispatching:
                continue
            hidden, use_fp8, round_scale, use_ue8m0 = CASES[index]
            inputs = [_rank_inputs(90 + index, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
            x, topk_idx, topk_weights = (t.to(device) for t in inputs[rank])
            _poison_allocator(device)
            meet(index)
            start = time.monotonic()
            result = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=use_fp8,
                                                 round_scale=round_scale, use_ue8m0=use_ue8m0)
            torch.cuda.current_stream(device).synchronize()
            waited = time.monotonic() - start
            received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, _host(result[:3]) + (None, None),
                                       use_fp8, round_scale, use_ue8m0, dispatching)
            if rank not in combining:
                continue
            expert_x = torch.stack([_expert_output(received[local], rank * num_local + local)
                                    for local in range(num_local)]).to(device)
            start = time.monotonic()
            combined, _, _ = buffer.low_latency_combine(expert_x, topk_idx, topk_weights, result[2])
            torch.cuda.current_stream(device).synchronize()
            waited += time.monotonic() - start
            if index == 2:
                assert waited < FAILURE_TIMEOUT_SECS / 2, f"a masked rank was waited for ({waited:.1f} s)"
            want = _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale, combining)
            assert torch.equal(_host(combined), want), (rank, index)
            buffer.low_latency_query_mask_buffer(status)
            assert _host(status).tolist() == [int(peer not in combining) for peer in range(num_ranks)], index
    finally:
        group.barrier()          # every rank, the stopped ones too, before any destroy
        buffer.destroy()


def failure_rounds(num_ranks: int) -> list:
    """``(ranks that dispatch, ranks that combine)`` per round of `_failure_body`: a dispatch takes
    rows from the ranks that dispatch, a combine adds the slots of the ranks that combine."""
    everyone = set(range(num_ranks))
    last = num_ranks - 1
    return [(everyone, everyone), (everyone - {1}, everyone - {1, last}), (everyone - {1, last},) * 2]


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_emulated_rank_failures_are_masked(num_ranks):
    barriers = [threading.Barrier(len(dispatching)) for dispatching, _ in failure_rounds(num_ranks)]
    run_legacy_on_emulated_ranks(lambda group, n: _failure_body(group, n, lambda index: barriers[index].wait(120)),
                                 num_ranks)


@pytest.mark.parametrize("enable_shrink", [False, True], ids=["plain", "shrink"])
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_graph_replays_with_fresh_inputs(nccl_group, use_fp8, enable_shrink):
    """The decode step (dispatch with a receive hook, the expert GEMM, combine) captured once in a CUDA
    graph on the direct path and replayed with fresh inputs copied into the static tensors: every
    replay equals the spec (the halves' tags advance on the device, replay after replay). With
    ``enable_shrink``, a mask set after capture takes effect at the next replay (the kernels read it
    as they run: the rank masks itself, so nothing is exchanged), and cleared, the next exchanges."""
    device = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts = MAX_HIDDEN, num_experts_for(1)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, hidden, 1, num_experts)
    buffer = deep_ep.Buffer(nccl_group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True,
                            enable_shrink=enable_shrink)
    try:
        x, topk_idx, topk_weights = _rank_inputs(70, 0, 1, num_experts, hidden)
        x_static, idx_static, weights_static = x.to(device), topk_idx.to(device), topk_weights.to(device)

        def step():
            recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
                x_static, idx_static, MAX_TOKENS, num_experts, use_fp8=use_fp8, return_recv_hook=True)
            hook()
            rows = _cast_back(recv_x[0].view(-1, hidden), recv_x[1].reshape(-1, hidden // 128)).view(
                recv_x[0].shape) if use_fp8 else recv_x
            expert_x = torch.stack([_expert_output(rows[local], local) for local in range(num_experts)])
            combined, _, _ = buffer.low_latency_combine(expert_x, idx_static, weights_static, handle)
            return recv_x, recv_count, handle, combined

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):             # the module load outside capture
            assert getattr(step()[2], "direct", None) is not None
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv_x, recv_count, handle, combined = step()
        for replay in range(4):
            inputs = [_rank_inputs(71 + replay, 0, 1, num_experts, hidden)]
            x_static.copy_(inputs[0][0])
            idx_static.copy_(inputs[0][1])
            weights_static.copy_(inputs[0][2])
            masked = enable_shrink and replay == 2
            if masked:
                buffer.low_latency_update_mask_buffer(0, True)
            elif enable_shrink:
                buffer.low_latency_clean_mask_buffer()
            linked = set() if masked else None
            graph.replay()
            torch.cuda.synchronize()
            _check_dispatch(0, 1, num_experts, hidden, inputs, _host((recv_x, recv_count, handle)) + (None, None),
                            use_fp8, False, False, linked)
            want = _expected_combine(0, num_experts, hidden, inputs, use_fp8, False, linked)
            assert masked or want.abs().sum() > 0
            assert torch.equal(_host(combined), want), replay
    finally:
        buffer.destroy()


_recorded = threading.local()      # each emulated rank's thread: the direct kernels it launched


def _recording_launch(original):
    def launch(owner, window, name, blocks, args, device):
        launches = getattr(_recorded, "launches", None)
        if launches is not None:
            launches.append((name, args[1]))
        original(owner, window, name, blocks, args, device)
    return launch


def _idle_within(stream, seconds: float) -> bool:
    """Whether ``stream``'s work queued so far finishes within ``seconds`` (polled: never a blocking wait)."""
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _hooks_hold_no_sm(group, num_ranks):
    """A dispatch and a combine with receive hooks on the direct path: each call launches its kernel's
    send phase only, its hook the receive phase. For the combine, rank 0 then runs a matmul on its
    stream, which finishes while every other rank has not made its combine call yet (they wait at a
    host barrier). Then the others call, every rank calls its hook, and the results are the spec's."""
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts, hidden = num_experts_for(num_ranks), MAX_HIDDEN
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    rank, barrier = buffer.rank, (group.barrier if num_ranks > 1 else (lambda: None))
    try:
        inputs = [_rank_inputs(95, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
        x, topk_idx, topk_weights = (tensor.to(device) for tensor in inputs[rank])
        launches = _recorded.launches = []
        warm = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
        buffer.low_latency_combine(warm[0], topk_idx, topk_weights, warm[2])
        # without hooks, one launch of both phases per call; emulated ranks launch the phases one
        # after the other (their grids share the device)
        if buffer._alive()._backend.emulated:
            assert launches == [(name, phase) for name in (ll_direct.DISPATCH_KERNEL, ll_direct.COMBINE_KERNEL)
                                for phase in (ll_direct.SEND_PHASE, ll_direct.RECEIVE_PHASE)], launches
        else:
            assert launches == [(ll_direct.DISPATCH_KERNEL, ll_direct.BOTH_PHASES),
                                (ll_direct.COMBINE_KERNEL, ll_direct.BOTH_PHASES)], launches
        launches.clear()
        result = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False,
                                             return_recv_hook=True)
        send, receive = (ll_direct.DISPATCH_KERNEL, ll_direct.SEND_PHASE), (ll_direct.DISPATCH_KERNEL,
                                                                            ll_direct.RECEIVE_PHASE)
        assert launches == [send], launches
        result[4]()
        assert launches == [send, receive], launches
        received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, _host(result[:3]) + (None, None),
                                   False, False, False)
        num_local = num_experts // num_ranks
        expert_x = torch.stack([_expert_output(received[local], rank * num_local + local)
                                for local in range(num_local)]).to(device)
        weight = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
        launches.clear()
        barrier()
        idle = True
        if rank == 0:
            combined, _, hook = buffer.low_latency_combine(expert_x, topk_idx, topk_weights, result[2],
                                                           return_recv_hook=True)
            product = weight @ weight
            idle = _idle_within(torch.cuda.current_stream(device), 30.0)
            barrier()
        else:
            barrier()
            combined, _, hook = buffer.low_latency_combine(expert_x, topk_idx, topk_weights, result[2],
                                                           return_recv_hook=True)
            product = weight @ weight
        send, receive = (ll_direct.COMBINE_KERNEL, ll_direct.SEND_PHASE), (ll_direct.COMBINE_KERNEL,
                                                                           ll_direct.RECEIVE_PHASE)
        assert launches == [send], launches
        hook()
        assert launches == [send, receive], launches
        want = _expected_combine(rank, num_experts, hidden, inputs, False, False)
        assert (want.numel() == 0 or want.abs().sum() > 0) and torch.equal(_host(combined), want)
        assert bool(torch.isfinite(product).all())
        assert idle, "rank 0's combine call left a kernel waiting for the peers' call"
        torch.cuda.current_stream(device).synchronize()
    finally:
        _recorded.launches = None
        buffer.destroy()


def test_hook_launches_the_receive_kernel_one_rank(nccl_group, monkeypatch):
    monkeypatch.setattr(ll_direct, "_launch", _recording_launch(ll_direct._launch))
    _hooks_hold_no_sm(nccl_group, 1)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_emulated_hooks_hold_no_sm(num_ranks, monkeypatch):
    monkeypatch.setattr(ll_direct, "_launch", _recording_launch(ll_direct._launch))
    run_legacy_on_emulated_ranks(_hooks_hold_no_sm, num_ranks)
