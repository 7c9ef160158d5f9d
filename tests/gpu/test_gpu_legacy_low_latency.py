"""DeepEP's V1 low-latency mode of `deep_ep.Buffer` on the GPU, on its expanded `ElasticBuffer` path
(taken with rank masks and across nodes; forced here for every case, the direct kernels that serve
the rest having tests/gpu/test_gpu_legacy_ll_direct.py): the cases of
tests/test_legacy_low_latency.py (every element compared with the spec there: layouts, FP8 and UE8M0
scales, handles, the weighted combine, receive hooks, zero-copy, ``out=``, rank masks, double
buffering with hook results equal bit for bit to those without hooks) on a one-rank NCCL group and
on 2, 4 and 8 emulated ranks of one device; that a call with a receive hook launches only the send
half of its data kernel and the hook the receive half, with a matmul between them that finishes
while peers have not even made their call; and the decode step captured in a CUDA graph and
replayed with fresh inputs, rank masks set after capture included; the combine's kernels (the
rows' gather, the weighted sum) equal bit for bit to their torch specs, and the dispatch's layout
kernels (the pairs' cast, the receive layout with and without a rank mask) to theirs. Run by
``EXTRA_FILES=tests/gpu/test_gpu_legacy_low_latency.py bash tools/device_suite.sh extra``."""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from gpu_cases import run_legacy_on_emulated_ranks  # noqa: E402
from deep_ep.backends.gpu import modules  # noqa: E402
from deep_ep.legacy import ll_direct  # noqa: E402
from test_legacy_low_latency import (MAX_TOKENS, _cast_back, _check_dispatch, _expected_combine,  # noqa: E402
                                     _expert_output, _host, _rank_inputs, num_experts_for, run_cases,
                                     run_double_buffer_cases, run_mask_cases)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: the largest hidden of the cases
MAX_HIDDEN = 512


@pytest.fixture(autouse=True)
def _expanded(monkeypatch):
    monkeypatch.setattr(ll_direct, "applies", lambda *args: False)


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
                run_double_buffer_cases(buffer, buffer.rank, num_ranks, device)
                buffer.clean_low_latency_buffer(MAX_TOKENS, MAX_HIDDEN, num_experts)
        finally:
            buffer.destroy()


def test_one_rank_nccl(nccl_group):
    _body(nccl_group, 1)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_emulated(num_ranks):
    run_legacy_on_emulated_ranks(_body, num_ranks)


def _record_data_launches(buffer, hidden: int) -> list:
    """From now on, the phases (``"send"``, ``"receive"``, ``"both"``) of every data kernel the
    low-latency windows of ``buffer`` launch (a bf16 dispatch at ``hidden`` and its combine), in order."""
    phases = {modules.SEND_PHASE: "send", modules.RECEIVE_PHASE: "receive", modules.BOTH_PHASES: "both"}
    launches = []
    for elastic in buffer._low_latency_buffers():
        backend = elastic._backend
        names = {}
        for phase, label in phases.items():
            names[id(backend.module("dispatch", (2 * hidden, 0, 1, True, phase)))] = label
            names[id(backend.module("combine", (hidden, 1, True, phase)))] = label

        def record(prepared, num_blocks, launch=backend.launch_data, names=names):
            launches.append(names.get(id(prepared.function.module), prepared.function.name))
            launch(prepared, num_blocks)

        backend.launch_data = record
    return launches


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
    """A dispatch and a combine with receive hooks: each call launches the send half of its data
    kernel only, its hook the receive half. For the combine, rank 0 then runs a matmul on its stream,
    which finishes while every other rank has not made its combine call yet (they wait at a host
    barrier): no kernel of rank 0's call waits for them. Then the others call, every rank calls its
    hook, and the results are the spec's."""
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts, hidden = num_experts_for(num_ranks), MAX_HIDDEN
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    rank, barrier = buffer.rank, (group.barrier if num_ranks > 1 else (lambda: None))
    try:
        inputs = [_rank_inputs(95, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
        x, topk_idx, topk_weights = (tensor.to(device) for tensor in inputs[rank])
        warm = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
        buffer.low_latency_combine(warm[0], topk_idx, topk_weights, warm[2])
        launches = _record_data_launches(buffer, hidden)
        result = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False,
                                             return_recv_hook=True)
        assert launches == ["send"], launches
        result[4]()
        assert launches == ["send", "receive"], launches
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
        assert launches == ["send"], launches
        hook()
        assert launches == ["send", "receive"], launches
        want = _expected_combine(rank, num_experts, hidden, inputs, False, False)
        assert (want.numel() == 0 or want.abs().sum() > 0) and torch.equal(_host(combined), want)  # a rank may send nothing
        assert bool(torch.isfinite(product).all())
        assert idle, "rank 0's combine call left a kernel waiting for the peers' call"
        torch.cuda.current_stream(device).synchronize()
    finally:
        buffer.destroy()


def test_hook_launches_the_receive_half_one_rank(nccl_group):
    _hooks_hold_no_sm(nccl_group, 1)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_emulated_hooks_hold_no_sm(num_ranks):
    run_legacy_on_emulated_ranks(_hooks_hold_no_sm, num_ranks)


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_graph_replays_with_fresh_inputs_and_masks(nccl_group, use_fp8):
    """The decode step as serving frameworks capture it: `low_latency_dispatch` (receive hook), the
    simulated expert GEMM and `low_latency_combine` on a fresh ``enable_shrink`` Buffer of one rank,
    captured once in a CUDA graph, then replayed with fresh inputs copied into the static tensors:
    every replay is compared with the spec. A mask set after capture must hold across a replay (the
    graph must not zero it) and take effect there; cleared, the next replay exchanges again."""
    device = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts = MAX_HIDDEN, num_experts_for(1)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, hidden, 1, num_experts)
    buffer = deep_ep.Buffer(nccl_group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True,
                            enable_shrink=True)
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
        with torch.cuda.stream(side):             # windows, plans and module loads outside capture
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv_x, recv_count, handle, combined = step()
        status = torch.zeros(1, dtype=torch.int32, device=device)
        for replay, masked in enumerate((False, False, True, False)):
            inputs = [_rank_inputs(71 + replay, 0, 1, num_experts, hidden)]
            x_static.copy_(inputs[0][0])
            idx_static.copy_(inputs[0][1])
            weights_static.copy_(inputs[0][2])
            if masked:
                buffer.low_latency_update_mask_buffer(0, True)
            graph.replay()
            torch.cuda.synchronize()
            buffer.low_latency_query_mask_buffer(status)
            assert _host(status).tolist() == [int(masked)]
            linked = set() if masked else None
            _check_dispatch(0, 1, num_experts, hidden, inputs, _host((recv_x, recv_count, handle)) + (None, None),
                            use_fp8, False, False, linked)
            want = _expected_combine(0, num_experts, hidden, inputs, use_fp8, False, linked)
            assert want.abs().sum() > 0 or masked
            assert torch.equal(_host(combined), want), (replay, masked)
            buffer.low_latency_clean_mask_buffer()
    finally:
        buffer.destroy()


def test_hook_runs_on_the_stream_of_its_call(nccl_group):
    """A receive hook called under another stream still writes on the stream that was current at its
    call (DeepEP's): the other stream is held busy by a sleep, and the results read on the call's
    stream alone, before that stream waits for the other, must already be the spec's."""
    device = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts = MAX_HIDDEN, num_experts_for(1)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, hidden, 1, num_experts)
    buffer = deep_ep.Buffer(nccl_group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    try:
        inputs = [_rank_inputs(90, 0, 1, num_experts, hidden)]
        x, topk_idx, topk_weights = (tensor.to(device) for tensor in inputs[0])
        result = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False,
                                             return_recv_hook=True)
        other = torch.cuda.Stream(device)
        with torch.cuda.stream(other):
            torch.cuda._sleep(200_000_000)       # about 0.1 s on an H200: long past the copies below
            result[4]()
        received = _check_dispatch(0, 1, num_experts, hidden, inputs, _host(result[:3]) + (None, None),
                                   False, False, False)
        expert_x = torch.stack([_expert_output(received[local], local) for local in range(num_experts)])
        combined, _, hook = buffer.low_latency_combine(expert_x.to(device), topk_idx, topk_weights, result[2],
                                                       return_recv_hook=True)
        with torch.cuda.stream(other):
            torch.cuda._sleep(200_000_000)
            hook()
        want = _expected_combine(0, num_experts, hidden, inputs, False, False)
        assert (want.numel() == 0 or want.abs().sum() > 0) and torch.equal(_host(combined), want)  # a rank may send nothing
        torch.cuda.synchronize()
    finally:
        buffer.destroy()


def test_reduce_kernel_equals_the_torch_spec():
    """The combine's weighted top-k sum kernel (deep_ep/legacy/ll_reduce.py) equals its torch loop bit
    for bit: random rows and weights with -1 slots, a rank mask, ids of masked and unmasked ranks,
    signed zeros, infinities and NaN among the rows, and the decode shape (128 tokens, top-8, 7168).
    A NaN's sign and payload are not specified by IEEE arithmetic (x86 and the GPU differ): NaNs are
    compared by position, every other element by its bits."""
    from deep_ep.legacy import ll_reduce
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator().manual_seed(5)
    for num_tokens, num_topk, hidden, use_mask in ((128, 8, 7168, False), (37, 3, 512, True), (1, 1, 128, False),
                                                   (0, 2, 256, True)):
        num_ranks, num_local = 4, 8
        pairs = (torch.randn(num_tokens, num_topk, hidden, generator=generator) * 3).to(torch.bfloat16)
        if num_tokens > 1:
            pairs[0, 0, :4] = torch.tensor([float("inf"), float("nan"), -0.0, 0.0])
            pairs[1, :, 5] = -0.0
        topk_idx = torch.randint(-1, num_ranks * num_local, (num_tokens, num_topk), generator=generator)
        topk_idx[:, 0] = torch.randint(0, num_local, (num_tokens,), generator=generator)   # rank 0: never masked
        topk_weights = torch.randn(num_tokens, num_topk, generator=generator)
        masked = torch.tensor([0, 1, 0, 1], dtype=torch.int32) if use_mask else None
        want = ll_reduce.weighted_sum_torch(pairs, topk_idx, topk_weights, masked, num_local,
                                            torch.empty(num_tokens, hidden, dtype=torch.bfloat16))
        got = ll_reduce.weighted_sum(pairs.to(device), topk_idx.to(device), topk_weights.to(device),
                                     masked.to(device) if use_mask else None, num_local,
                                     torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device))
        assert num_tokens == 0 or want.float().abs().nansum() > 0
        got = got.cpu()
        assert torch.equal(got.isnan(), want.isnan()), (num_tokens, num_topk, hidden)
        numbers = ~want.isnan()
        assert torch.equal(got.view(torch.int16)[numbers], want.view(torch.int16)[numbers]), (num_tokens, num_topk,
                                                                                              hidden)


def _same_fp8(got: torch.Tensor, want: torch.Tensor) -> bool:
    """FP8 bits equal, NaNs (0x7F with either sign) compared by position."""
    got, want = got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu()
    got_nan, want_nan = (got & 0x7F) == 0x7F, (want & 0x7F) == 0x7F
    return torch.equal(got_nan, want_nan) and torch.equal(got[~want_nan], want[~want_nan])


def _same_float(got: torch.Tensor, want: torch.Tensor) -> bool:
    """float32 bits equal, NaNs compared by position (their payload is not specified)."""
    got, want = got.cpu(), want.cpu()
    numbers = ~want.isnan()
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.view(torch.int32)[numbers],
                                                                  want.view(torch.int32)[numbers])


def test_cast_kernel_equals_the_torch_spec():
    """The pairs' cast kernel (deep_ep/legacy/ll_layout.py) equals its torch spec (run on the same
    device) bit for bit: bf16 replication and FP8 with float and power-of-two scales, for 0, 1 and
    more tokens, top-1 to top-8, with rows of zeros (the 1e-4 floor), tiny values (FP8 subnormals),
    signed zeros, large values, infinities and NaN among the inputs, and the decode shape; the pairs'
    routing with and without a rank mask (-1 slots among the ids); the receive layout's count
    scratch, poisoned, zeroed on the way."""
    from deep_ep.legacy import ll_layout
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator().manual_seed(11)
    cases = ((128, 8, 7168, None), (37, 3, 512, [0, 1, 1, 0]), (1, 1, 128, [1, 0, 0, 0]), (0, 2, 256, [0, 1, 0, 1]),
             (5, 8, 1024, None), (9, 4, 256, [1, 1, 0, 1]))
    for num_tokens, num_topk, hidden, mask in cases:
        num_ranks, num_local = 4, 8
        x = torch.randn(num_tokens, hidden, generator=generator) * 4
        if num_tokens >= 5:
            x[1] = 0.0
            x[2, :128] *= 1e-6                                   # amax below the floor
            x[2, 128:] *= 2.0 ** -12                            # FP8 subnormals after the scale
            x[3, :8] = torch.tensor([float("inf"), -0.0, 0.0, 3e38, -3e38, float("nan"), 1e-30, -1e-30])
            x[4, 130 % hidden] = -float("inf")
        x = x.to(torch.bfloat16).to(device)
        topk_idx = torch.stack([torch.randperm(num_ranks * num_local, generator=generator)[:num_topk]
                                for _ in range(num_tokens)]) if num_tokens else torch.empty(0, num_topk)
        topk_idx = torch.where(torch.rand(topk_idx.shape, generator=generator) < 0.2, -1, topk_idx)
        topk_idx = topk_idx.to(torch.int64).to(device)
        masked = None if mask is None else torch.tensor(mask, dtype=torch.int32, device=device)
        for use_fp8 in (False, True):
            for round_scale in ((False, True) if use_fp8 else (False,)):
                want, want_topk = ll_layout.cast_pairs_torch(x, topk_idx, use_fp8, round_scale, masked, num_local)
                scratch = ll_layout.count_scratch(num_local, num_ranks, device).fill_(-1515870811)
                got, got_topk = ll_layout.cast_pairs(x, topk_idx, use_fp8, round_scale, masked, num_local, scratch)
                case = (num_tokens, num_topk, hidden, use_fp8, round_scale, mask)
                # the receive layout's scratch, zeroed on the way (0 tokens too)
                assert scratch.numel() == num_local * num_ranks + 1 and not bool(scratch.any()), case
                assert got_topk.shape == (num_tokens * num_topk, 1) and torch.equal(got_topk.cpu(),
                                                                                   want_topk.cpu()), case
                assert mask is None or num_tokens < 5 or bool((got_topk == -1).any() & (got_topk >= 0).any()), case
                if not use_fp8:
                    assert got.shape == (num_tokens * num_topk, hidden) and got.dtype == torch.bfloat16
                    assert torch.equal(got.view(torch.int16).cpu(), want.view(torch.int16).cpu()), case
                    assert num_tokens == 0 or got.float().abs().nansum() > 0
                    continue
                assert got[0].shape == want[0].shape and got[1].shape == want[1].shape, case
                assert got[0].dtype == want[0].dtype and got[1].dtype == torch.float32, case
                assert _same_fp8(got[0], want[0]), case
                assert _same_float(got[1], want[1]), case
                assert num_tokens == 0 or (got[0].float().abs().nansum() > 0 and got[1].nansum() > 0)


def _pair_dispatch(generator, num_ranks: int, rank: int, num_local: int, num_slots: int, num_topk: int,
                   token_counts: list, device):
    """The handle fields (`types.SimpleNamespace`) the layout reads, as a pair dispatch to ``rank``
    leaves them: random top-k rows (-1 slots, distinct experts) of ``token_counts[s]`` tokens on every
    source rank ``s``; metadata rows ordered by (source rank, pair), -1 past the received; expanded rows
    grouped by local expert, then by (source rank, pair)."""
    import types
    num_experts = num_ranks * num_local
    max_pairs = num_slots * num_topk
    received = []                                                  # (local expert, source, pair)
    for source in range(num_ranks):
        for token in range(token_counts[source]):
            experts = torch.randperm(num_experts, generator=generator)[:num_topk].tolist()
            for slot, expert in enumerate(experts):
                if torch.rand(1, generator=generator).item() < 0.2:
                    continue                                       # a -1 slot
                if expert // num_local == rank:
                    received.append((expert % num_local, source, token * num_topk + slot))
    by_expert = sorted(received)
    expanded = {(source, pair): row for row, (_, source, pair) in enumerate(by_expert)}
    metadata = torch.full((num_ranks * max_pairs, 3), -1, dtype=torch.int32)
    for index, (_, source, pair) in enumerate(sorted(received, key=lambda item: (item[1], item[2]))):
        metadata[index] = torch.tensor([source * max_pairs + pair, source, expanded[(source, pair)]])
    counts = torch.bincount(torch.tensor([item[0] for item in received], dtype=torch.int64),
                            minlength=num_local).to(torch.int32)
    return types.SimpleNamespace(
        num_local_experts=num_local, device=device, num_expanded_tokens=num_ranks * max_pairs,
        recv_src_metadata=metadata.to(device), psum_num_recv_tokens_per_expert=counts.cumsum(0).to(torch.int32)
        .to(device), num_unaligned_recv_tokens_per_expert=counts.to(device)), len(received)


def _poisoned_outputs(generator, num_local: int, num_ranks: int, num_slots: int, hidden: int, use_fp8: bool,
                      use_ue8m0: bool, with_stats: bool, device):
    from deep_ep.legacy import ll_layout
    from deep_ep.legacy.layouts import receive_storage, scale_storage

    def poison(tensor):
        raw = tensor.view(torch.uint8) if tensor.dtype != torch.bool else tensor
        raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8).to(raw.dtype))
        return tensor

    num_rows = num_ranks * num_slots
    data_storage, _ = receive_storage(num_local, num_rows, hidden, torch.uint8 if use_fp8 else torch.bfloat16, "cpu")
    scales = scale_storage(num_local, num_rows, hidden // 128, use_ue8m0, "cpu")[0] if use_fp8 else None
    tensors = [torch.empty(num_local, dtype=torch.int32), torch.empty((num_local, num_rows), dtype=torch.int32),
               torch.empty((num_local, num_ranks), dtype=torch.int64), data_storage, scales,
               torch.empty(num_local, dtype=torch.int32) if with_stats else None]
    tensors = [None if tensor is None else poison(tensor) for tensor in tensors]

    def copy():
        moved = [None if tensor is None else tensor.to(device, copy=True) for tensor in tensors]
        if use_fp8:
            moved[3] = moved[3].view(torch.float8_e4m3fn)
        return ll_layout.ReceiveOutputs(*moved[:5], use_ue8m0, moved[5])
    return copy


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_layout_kernels_equal_the_torch_spec(num_ranks):
    """The receive layout's kernels (deep_ep/legacy/ll_layout.py: without a rank mask the one-launch
    placement with its counts, with one the counts then the placement) equal their torch spec bit for
    bit on synthetic pair dispatches: every output poisoned first (rows past a count keep the poison in
    both), bf16 and FP8 rows, float and UE8M0 scales (row-major and column-major received scales), rank
    masks (this rank's own included), -1 slots, 0 and 1 token per rank, statistics added."""
    from deep_ep.legacy import ll_layout
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator().manual_seed(17 + num_ranks)
    cases = [(256 // num_ranks, 128, 8, 7168, [128] * num_ranks, True, False, False, None),
             (3, 5, 2, 512, [5, 0, 1, 4, 2, 5, 0, 3][:num_ranks], True, True, True, [1, 0, 1, 0, 0, 1, 0, 0]),
             (2, 4, 3, 256, [4, 1, 0, 2, 4, 4, 1, 3][:num_ranks], False, False, True, [0, 1, 0, 0, 1, 1, 0, 0]),
             (1, 1, 1, 128, [1, 0, 1, 1, 0, 1, 1, 1][:num_ranks], True, False, False, [0, 0, 1, 0, 0, 0, 0, 1]),
             (4, 3, 2, 512, [0] * num_ranks, True, True, False, None),
             (8, 6, 4, 1024, [6, 3, 6, 1, 0, 6, 2, 5][:num_ranks], True, False, True, [0, 1, 1, 0, 0, 0, 1, 0]),
             (2, 3, 2, 512, [3, 2, 3, 1, 3, 0, 3, 2][:num_ranks], True, True, False, [1] * 8)]
    for num_local, num_slots, num_topk, hidden, tokens, use_fp8, use_ue8m0, column_major, mask in cases:
        rank = num_ranks - 1
        handle, num_received = _pair_dispatch(generator, num_ranks, rank, num_local, num_slots, num_topk, tokens,
                                              device)
        rows_count = handle.num_expanded_tokens
        if use_fp8:
            data = torch.randint(0, 256, (rows_count, hidden), generator=generator, dtype=torch.uint8)
            scales = torch.rand(rows_count, hidden // 128, generator=generator) * 2.0 ** torch.randint(
                -20, 20, (rows_count, hidden // 128), generator=generator)
            if column_major:
                scales = scales.t().contiguous().t()
            recv = (data.to(device).view(torch.float8_e4m3fn), scales.to(device))
        else:
            recv = torch.randn(rows_count, hidden, generator=generator).to(torch.bfloat16).to(device)
        masked = None if mask is None else torch.tensor(mask[:num_ranks], dtype=torch.int32, device=device)
        copy = _poisoned_outputs(generator, num_local, num_ranks, num_slots, hidden, use_fp8, use_ue8m0,
                                 num_topk % 2 == 0, device)          # statistics with and without a mask
        want_outputs, got_outputs = copy(), copy()
        want_rows = ll_layout.receive_layout_torch(handle, recv, num_ranks, num_slots, num_topk, masked, want_outputs)
        got_rows = ll_layout.receive_layout(handle, recv, num_ranks, num_slots, num_topk, masked, got_outputs)
        case = (num_ranks, num_local, num_slots, num_topk, hidden, use_fp8, use_ue8m0, mask)
        for got, want in zip(got_rows, want_rows):
            assert got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu()), case
        for index in (0, 1, 2, 6):
            got, want = got_outputs[index], want_outputs[index]
            assert (got is None) == (want is None) and (got is None or torch.equal(got.cpu(), want.cpu())), (case,
                                                                                                          index)
        # the storages' last row (element) is the spec's spare, not part of the layout
        for got, want in zip(got_outputs[3:5], want_outputs[3:5]):
            if want is not None:
                assert torch.equal(got[:-1].view(torch.uint8).cpu(), want[:-1].view(torch.uint8).cpu()), case
        kept = int(want_outputs.recv_count.sum())
        assert num_received == 0 or kept > 0 or (masked is not None and bool(masked.bool().any())), case
        assert int(got_rows[2].sum()) == kept, case


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_gather_kernel_equals_the_torch_spec(num_ranks):
    """The combine's gather kernel (deep_ep/legacy/ll_reduce.py) equals its torch spec bit for bit on
    the received rows of synthetic pair dispatches, into a poisoned output: layout rows contiguous, with
    the zero-copy buffer's row stride, and with a stride off 16 bytes (the torch path), rank masks
    (masked rows come back as zeros), 0 and 1 token per rank; rows past the received pairs keep the
    poison (the pair combine does not read them)."""
    from deep_ep.legacy import ll_layout, ll_reduce
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator().manual_seed(29 + num_ranks)
    cases = [(256 // num_ranks, 128, 8, 7168, [128] * num_ranks, "contiguous", None),
             (256 // num_ranks, 128, 8, 7168, [128] * num_ranks, "zero_copy", [0, 1, 0, 0, 0, 0, 1, 0]),
             (3, 5, 2, 512, [5, 0, 1, 4, 2, 5, 0, 3][:num_ranks], "zero_copy", [1, 0, 1, 0, 0, 1, 0, 0]),
             (2, 4, 3, 256, [4, 1, 0, 2, 4, 4, 1, 3][:num_ranks], "zero_copy", None),
             (1, 1, 1, 128, [1, 0, 1, 1, 0, 1, 1, 1][:num_ranks], "contiguous", [0, 0, 1, 0, 0, 0, 0, 1]),
             (4, 3, 2, 512, [0] * num_ranks, "contiguous", None),
             (8, 6, 4, 1024, [6, 3, 6, 1, 0, 6, 2, 5][:num_ranks], "contiguous", [1] * 8)]
    for num_local, num_slots, num_topk, hidden, tokens, strides, mask in cases:
        rank = num_ranks - 1
        handle, num_received = _pair_dispatch(generator, num_ranks, rank, num_local, num_slots, num_topk, tokens,
                                              device)
        num_rows = num_ranks * num_slots
        masked = None if mask is None else torch.tensor(mask[:num_ranks], dtype=torch.int32, device=device)
        placement = _poisoned_outputs(generator, num_local, num_ranks, num_slots, hidden, False, False, False,
                                      device)()
        recv = torch.zeros(handle.num_expanded_tokens, hidden, dtype=torch.bfloat16, device=device)
        row_expert, row_slot, row_kept = ll_layout.receive_layout_torch(handle, recv, num_ranks, num_slots, num_topk,
                                                                        masked, placement)
        row = hidden + 2 * (hidden // 128) if strides == "zero_copy" else hidden
        # made on the device: the decode shape's layout is 470 MB
        rows_generator = torch.Generator(device).manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=generator)))
        source = torch.randn(num_local, num_rows, row, generator=rows_generator, device=device,
                             dtype=torch.bfloat16)[:, :, :hidden]
        aligned = ll_reduce._gather_ready(source, handle.psum_num_recv_tokens_per_expert, row_expert, row_slot,
                                          row_kept)
        assert aligned == (row * 2 % 16 == 0), (strides, hidden)
        poison = torch.randint(-2 ** 15, 2 ** 15, (handle.num_expanded_tokens, hidden), generator=generator,
                               dtype=torch.int16)
        out = poison.to(device).view(torch.bfloat16)
        want = ll_reduce.gather_rows_torch(source, row_expert, row_slot, row_kept, masked)
        got = ll_reduce.gather_rows(source, handle.psum_num_recv_tokens_per_expert, row_expert, row_slot, row_kept,
                                    masked, out=out)
        case = (num_ranks, num_local, num_slots, num_topk, hidden, strides, mask)
        assert got.data_ptr() == out.data_ptr() and got.shape == want.shape, case
        received = int(handle.psum_num_recv_tokens_per_expert[-1]) if num_local else 0
        assert received == num_received, case
        got_bits, want_bits = got.view(torch.int16).cpu(), want.view(torch.int16).cpu()
        assert torch.equal(got_bits[:received], want_bits[:received]), case
        if aligned:
            assert torch.equal(got_bits[received:], poison[received:]), case
        kept = int(row_kept.sum())
        assert received == 0 or kept == 0 or bool(got_bits[:received].ne(0).any()), case
        assert masked is not None or kept == received, case
