"""Pipeline send/recv on GPU buffers: a one-rank NCCL group (the tensor loops back) and 2, 4 and 8
ranks emulated on one device (8: the random interleavings and the ring), with tests/test_pp.py's scenarios, on both paths: the copy engine
(``num_sms=0``) and the SM kernel (``num_sms > 0``), alone and mixed call by call on one channel.
Every receive tensor is poisoned first and compared byte for byte; hosts never block on a send or a
receive (they wait with `deep_ep.emulated.wait_for_stream` before reading results). Covered: random
interleavings in both ring directions with GPU-side delays and several block counts, aligned and
unaligned tensors, the in-flight limit (a receiver that sleeps on the GPU: a sender that did not
wait would overwrite a slot not yet read), refusals before any launch, dispatch against PP traffic,
a CUDA graph replayed with fresh inputs (num_sms=0 taking the kernel in and after a capture), that
the copy engine launches no kernel, a GPU timeout and a byte-count mismatch (emulated nodes refusing
every method: tests/gpu/test_gpu_primitives_across_nodes.py). Run by
``EXTRA_FILES=tests/gpu/test_gpu_pp.py bash tools/device_suite.sh extra``.
"""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from test_pp import _assert_received, _bytes, _poisoned_like, _random_tensor, _stress_plan  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", 0)
MAX_BYTES = 1000
TIMEOUT = 120


def _wait():
    from deep_ep.emulated import wait_for_stream
    wait_for_stream(timeout_secs=TIMEOUT)


def _run(num_ranks, body, *args):
    """``body(group, *args)`` on every rank: a one-rank NCCL group, or emulated ranks; results by rank."""
    if num_ranks == 1:
        from deep_ep.bench.gpu_timing import single_rank_nccl_group
        return [body(single_rank_nccl_group(DEVICE), *args)]
    from deep_ep.emulated import EmulatedGroup
    return EmulatedGroup(num_ranks, device=DEVICE).run(body, *args)


def _buffer(group, max_bytes, limit, **kwargs):
    hint = deep_ep.ElasticBuffer.get_pp_buffer_size_hint(max_bytes, limit)
    return deep_ep.ElasticBuffer(group, num_bytes=hint, explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT,
                                 **kwargs)


def _stress_body(group, seeds, num_sends, limit, sm_choices):
    rank, num_ranks = group.rank(), group.size()
    buf = _buffer(group, MAX_BYTES, limit)
    try:
        buf.pp_set_config(MAX_BYTES, limit)
        checked = 0
        for seed in seeds:
            ops, total = _stress_plan(seed, num_ranks, num_sends, limit)
            generator = torch.Generator().manual_seed(seed)
            tensors = [_random_tensor(generator, MAX_BYTES) for _ in range(total)]
            # host-to-device copies wait for the stream: all of them before any PP call
            on_device = [tensor.to(DEVICE) for tensor in tensors]
            choices = random.Random(seed * 100 + rank)
            pending = []
            for _, op, peer, index in ops[rank]:
                if choices.random() < 0.3:
                    torch.cuda._sleep(choices.randrange(1, 200_000))   # GPU-side delay
                num_sms = choices.choice(sm_choices)
                if op == "send":
                    sent = on_device[index].clone()
                    buf.pp_send(sent, peer, num_sms=num_sms)
                    _bytes(sent).fill_(0)   # queued after the copy: reusing the tensor changes nothing
                else:
                    out = _poisoned_like(on_device[index])
                    buf.pp_recv(out, peer, num_sms=num_sms)
                    pending.append((out, tensors[index], f"rank {rank} seed {seed} tensor {index} from {peer}"))
            _wait()
            for out, expected, where in pending:
                _assert_received(out.cpu(), expected, where)
                checked += 1
            buf.pp_set_config(MAX_BYTES, limit)   # flush between seeds
        return checked
    finally:
        buf.destroy()


@pytest.mark.parametrize("sm_choices", [(0, 1, 2, 3), (0,), (1, 3)], ids=["mixed", "copy_engine", "kernel"])
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_random_interleavings_arrive_in_order(num_ranks, sm_choices):
    results = _run(num_ranks, _stress_body, [11, 12, 13], 24 * max(num_ranks, 2), 3, sm_choices)
    assert sum(results) == 3 * 24 * max(num_ranks, 2)


def _large_body(group, num_sms):
    """Tensors of up to 3 MiB over several blocks, at byte offsets 0, 1 and 2 of their storage on both
    sides (the copy's 16-byte and byte paths); the bytes around each output stay poisoned."""
    rank, num_ranks = group.rank(), group.size()
    max_bytes = 3 * 1024 * 1024 + 5
    sizes = (max_bytes, 1 << 20, 4097)
    buf = _buffer(group, max_bytes, len(sizes))
    next_rank, prev_rank = (rank + 1) % num_ranks, (rank - 1) % num_ranks

    def storage(src, position):
        generator = torch.Generator().manual_seed(7000 + 10 * src + position)
        return torch.randint(0, 256, (sizes[position] + 3,), dtype=torch.uint8, generator=generator)

    try:
        buf.pp_set_config(max_bytes, len(sizes))
        sends = [storage(rank, position).to(DEVICE) for position in range(len(sizes))]
        outs = [torch.full((size + 3,), 0xA5, dtype=torch.uint8, device=DEVICE) for size in sizes]
        _wait()
        for position, size in enumerate(sizes):
            buf.pp_send(sends[position][position:position + size], next_rank, num_sms=num_sms)
        for position, size in enumerate(sizes):
            buf.pp_recv(outs[position][2 - position:2 - position + size], prev_rank, num_sms=num_sms)
        _wait()
        for position, size in enumerate(sizes):
            expected = storage(prev_rank, position)[position:position + size]
            out = outs[position].cpu()
            assert torch.equal(out[2 - position:2 - position + size], expected), f"rank {rank} tensor {position}"
            assert (out[:2 - position] == 0xA5).all() and (out[2 - position + size:] == 0xA5).all()
        buf.pp_set_config(max_bytes, len(sizes))
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_ranks, num_sms", [(1, 0), (1, 1), (1, 8), (2, 0), (2, 4), (4, 0), (4, 16)])
def test_large_and_unaligned_tensors(num_ranks, num_sms):
    _run(num_ranks, _large_body, num_sms)


def _ring_body(group, rounds, num_sms):
    """Forward then backward (a pipeline's two directions); with 2 ranks one channel holds both."""
    rank, num_ranks = group.rank(), group.size()
    limit = rounds if num_ranks > 2 else 2 * rounds
    buf = _buffer(group, 4096, limit)
    next_rank, prev_rank = (rank + 1) % num_ranks, (rank - 1) % num_ranks

    def tensor(src, direction, position):
        generator = torch.Generator().manual_seed(1000 * src + 100 * direction + position)
        return torch.randn((position + 1, 7), generator=generator).to(torch.bfloat16)

    try:
        buf.pp_set_config(4096, limit)
        sends = [tensor(rank, direction, position).to(DEVICE) for direction in (0, 1) for position in range(rounds)]
        expected = [tensor(src, direction, position) for direction, src in ((0, prev_rank), (1, next_rank))
                    for position in range(rounds)]
        outs = [_poisoned_like(wanted).to(DEVICE) for wanted in expected]
        _wait()
        for index, sent in enumerate(sends):
            buf.pp_send(sent, next_rank if index < rounds else prev_rank, num_sms=num_sms)
        for index, out in enumerate(outs):
            # with 2 ranks next == prev: one channel, the backward tensors follow the forward ones
            buf.pp_recv(out, prev_rank if index < rounds else next_rank, num_sms=num_sms)
        _wait()
        for index, (out, wanted) in enumerate(zip(outs, expected)):
            _assert_received(out.cpu(), wanted, f"rank {rank} #{index}")
        buf.pp_set_config(4096, limit)
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_sms", [0, 2])
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_ring_forward_and_backward(num_ranks, num_sms):
    _run(num_ranks, _ring_body, 3, num_sms)


def _limit_body(group, limit, num_sends, num_sms):
    """Rank 0 sends ``num_sends`` distinct tensors to rank 1 while rank 1's stream sleeps before
    receiving: without the wait for a free slot the later tensors would overwrite earlier ones."""
    rank = group.rank()
    buf = _buffer(group, 4096, limit)
    try:
        buf.pp_set_config(4096, limit)
        tensors = [torch.full((1024,), position + 1, dtype=torch.int32, device=DEVICE) for position in range(num_sends)]
        outs, events = [], []
        if rank == 0:
            for tensor in tensors:
                buf.pp_send(tensor, 1, num_sms=num_sms)
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()   # the send's kernel has returned
        elif rank == 1:
            outs = [torch.full((1024,), -7, dtype=torch.int32, device=DEVICE) for _ in tensors]
            torch.cuda._sleep(500_000_000)   # about a quarter of a second at H200 clocks
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()   # the receiver starts taking tensors
            for out in outs:
                buf.pp_recv(out, 0, num_sms=num_sms)
        _wait()
        for tensor, out in zip(tensors, outs):
            assert torch.equal(out.cpu(), tensor.cpu())
        buf.pp_set_config(4096, limit)
        return events
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_sms", [0, 1])
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_send_beyond_the_limit_waits_for_the_receiver(num_ranks, num_sms):
    """The first ``limit`` sends end before the receiver starts; the next one only after."""
    limit = 2
    results = _run(num_ranks, _limit_body, limit, 7, num_sms)
    sent, (started,) = results[0], results[1]
    after_start_ms = [started.elapsed_time(event) for event in sent]   # negative: before the receiver started
    assert all(ms < 0 for ms in after_start_ms[:limit]), after_start_ms
    assert all(ms >= 0 for ms in after_start_ms[limit:]), after_start_ms


def _expect(error, match, fn, *args, **kwargs):
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


def _refusals_body(group):
    rank, num_ranks = group.rank(), group.size()
    buf = _buffer(group, 64, 2)
    next_rank, prev_rank = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    sent = torch.arange(6, dtype=torch.float32, device=DEVICE) + 10 * rank
    try:
        _expect(RuntimeError, "pp_set_config.*on every rank first", buf.pp_send, sent, next_rank)
        _expect(ValueError, "num_max_inflight_tensors must be >= 1", buf.pp_set_config, 64, 0)
        # more than the window holds: refused before any communication
        _expect(ValueError, "get_pp_buffer_size_hint", buf.pp_set_config, 4 * 1024 * 1024, 2)
        buf.pp_set_config(64, 2)
        bad_calls = [
            (TypeError, "t must be a torch.Tensor", (sent.tolist(), next_rank), {}),
            (ValueError, f"dst_rank_idx={num_ranks} is not a neighbour", (sent, num_ranks), {}),
            (ValueError, "must be contiguous", (torch.arange(12.0, device=DEVICE).view(2, 6).t(), next_rank), {}),
            (ValueError, "more than the configured num_max_tensor_bytes",
             (torch.zeros(17, dtype=torch.float32, device=DEVICE), next_rank), {}),
            (ValueError, "t is on cpu", (sent.cpu(), next_rank), {}),
            (ValueError, "num_sms must be >= 0", (sent, next_rank), {"num_sms": -1}),
        ]
        if num_ranks > 1:   # emulated ranks share the device's SMs
            bad_calls.append((ValueError, "emulated ranks", (sent, next_rank), {"num_sms": 100_000}))
        if num_ranks > 2:
            bad_calls.append((ValueError, "not a neighbour", (sent, rank), {}))
        for error, match, args, kwargs in bad_calls:
            _expect(error, match, buf.pp_send, *args, **kwargs)
            recv_args = (args[0], prev_rank) if type(args[1]) is int and args[1] == next_rank else args
            _expect(error, match.replace("dst_", "src_"), buf.pp_recv, *recv_args, **kwargs)
        if num_ranks == 1:
            _expect(RuntimeError, "nothing in flight", buf.pp_recv, sent, 0)
        # nothing moved: the first real tensor on each channel is the first one received
        buf.pp_send(sent, next_rank)
        out = torch.full((6,), float("nan"), device=DEVICE)
        buf.pp_recv(out, prev_rank)
        _wait()
        assert torch.equal(out.cpu(), torch.arange(6, dtype=torch.float32) + 10 * prev_rank)
        # a tensor sent and not received: every rank refuses the flush and keeps the channels
        buf.pp_send(sent * 3, next_rank)
        _expect(RuntimeError, f"sent and not received .*1 from rank {prev_rank} to rank {rank}", buf.pp_set_config,
                64, 2)
        buf.pp_recv(out, prev_rank)
        _wait()
        assert torch.equal(out.cpu(), (torch.arange(6, dtype=torch.float32) + 10 * prev_rank) * 3)
        if num_ranks > 1:
            _expect(RuntimeError, "ranks disagree on num_max_inflight_tensors", buf.pp_set_config, 64, 2 + rank)
        buf.pp_set_config(96, 2)
        buf.pp_send(torch.ones(24, dtype=torch.float32, device=DEVICE), next_rank)   # 96 bytes now fit
        out = torch.zeros(24, dtype=torch.float32, device=DEVICE)
        buf.pp_recv(out, prev_rank)
        _wait()
        assert torch.equal(out.cpu(), torch.ones(24))
        buf.pp_set_config(96, 2)
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_bad_input_is_refused_before_any_launch(num_ranks):
    _run(num_ranks, _refusals_body)


def _window_body(group):
    rank, num_ranks = group.rank(), group.size()
    hidden, num_tokens = 128, 3
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=1,
                                explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT)
    next_rank, prev_rank = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    x = (torch.arange(num_tokens * hidden, dtype=torch.float32, device=DEVICE).view(num_tokens, hidden)
         + 1000 * rank).to(torch.bfloat16)
    topk_idx = torch.zeros((num_tokens, 1), dtype=torch.int64, device=DEVICE)
    try:
        sent = torch.randn(16, generator=torch.Generator().manual_seed(rank)).to(DEVICE)
        buf.pp_set_config(1024, 2)
        buf.pp_send(sent, next_rank)
        _expect(RuntimeError, "dispatch cannot use the buffer's window while pp holds it", buf.dispatch, x, topk_idx,
                num_experts=num_ranks)
        out = torch.full((16,), float("nan"), device=DEVICE)
        buf.pp_recv(out, prev_rank)
        buf.pp_set_config(1024, 2)
        assert torch.equal(out.cpu(), torch.randn(16, generator=torch.Generator().manual_seed(prev_rank)))
        buf.dispatch(x, topk_idx, num_experts=num_ranks)
        # the dispatch wrote over the slots: PP refuses until the next flush, on every rank
        _expect(RuntimeError, "ran on this buffer since the last pp_set_config", buf.pp_send,
                sent, next_rank)
        _wait()
        buf.pp_set_config(1024, 2)
        buf.pp_send(sent * 2, next_rank)
        buf.pp_recv(out, prev_rank)
        _wait()
        assert torch.equal(out.cpu(), torch.randn(16, generator=torch.Generator().manual_seed(prev_rank)) * 2)
        buf.pp_set_config(1024, 2)
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_dispatch_and_pp_take_turns(num_ranks):
    _run(num_ranks, _window_body)


def _graph_body(group, replays):
    """pp_send / pp_recv captured once, replayed with fresh inputs: the counters live on the GPU."""
    rank, num_ranks = group.rank(), group.size()
    buf = _buffer(group, 4096, 2)
    next_rank, prev_rank = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    stream = torch.cuda.Stream(DEVICE)   # capture needs a stream other than the legacy default one
    try:
        buf.pp_set_config(4096, 2)
        with torch.cuda.stream(stream):
            _graph_replays(group, buf, rank, num_ranks, next_rank, prev_rank, replays)
    finally:
        buf.destroy()


def _graph_replays(group, buf, rank, num_ranks, next_rank, prev_rank, replays):
    x = torch.zeros(1000, dtype=torch.float32, device=DEVICE)
    out = torch.zeros(1000, dtype=torch.float32, device=DEVICE)
    _wait()
    graph = torch.cuda.CUDAGraph()
    # One rank captures at a time (a capture synchronises the device), and none replays before all did.
    for capturing in range(num_ranks):
        if capturing == rank:
            with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
                # the copy engine's sequence numbers would be fixed in the graph: num_sms=0 (the
                # default) takes the one-block kernel inside a capture
                buf.pp_send(x, next_rank)
                buf.pp_recv(out, prev_rank, num_sms=1)
        if num_ranks > 1:
            group.barrier()
    for replay in range(replays):
        x.copy_(torch.arange(1000, dtype=torch.float32, device=DEVICE) * (replay + 1) + 10_000 * rank)
        out.fill_(float("nan"))
        graph.replay()
        _wait()
        expected = torch.arange(1000, dtype=torch.float32) * (replay + 1) + 10_000 * prev_rank
        assert torch.equal(out.cpu(), expected), f"rank {rank} replay {replay}"
    # the replays moved the GPU's counters past the host's count: until a flush, num_sms=0 takes the
    # kernel, which reads them on the GPU
    x.copy_(torch.arange(1000, dtype=torch.float32, device=DEVICE) + 7 + 10_000 * rank)
    out.fill_(float("nan"))
    buf.pp_send(x, next_rank)
    buf.pp_recv(out, prev_rank)
    _wait()
    assert torch.equal(out.cpu(), torch.arange(1000, dtype=torch.float32) + 7 + 10_000 * prev_rank), rank
    buf.pp_set_config(4096, 2)   # the replays' tensors were all received (the GPU's counters say so)
    x.copy_(torch.arange(1000, dtype=torch.float32, device=DEVICE) - 10_000 * rank)
    out.fill_(float("nan"))
    buf.pp_send(x, next_rank)
    buf.pp_recv(out, prev_rank)
    _wait()
    assert torch.equal(out.cpu(), torch.arange(1000, dtype=torch.float32) - 10_000 * prev_rank)
    buf.pp_set_config(4096, 2)


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_cuda_graph_replays_pp(num_ranks):
    _run(num_ranks, _graph_body, 4)


def _timeout_body(group):
    rank = group.rank()
    buf = _buffer(group, 64, 2, num_gpu_timeout_secs=2)
    try:
        buf.pp_set_config(64, 2)
        if rank == 0:
            out = torch.full((4,), float("nan"), device=DEVICE)
            buf.pp_recv(out, 1, num_sms=1)   # rank 1 never sends (the copy engine has no GPU timeout)
            _wait()
            _expect(TimeoutError, "pp_recv waited for a tensor from rank 1", buf.pp_send, out, 1)
            _expect(RuntimeError, "no longer usable", buf.pp_send, out, 1)
    finally:
        buf.destroy()


def test_a_recv_with_no_sender_times_out_on_the_gpu():
    _run(2, _timeout_body)


def _byte_count_body(group, send_sms, recv_sms):
    rank = group.rank()
    buf = _buffer(group, 64, 2)
    try:
        buf.pp_set_config(64, 2)
        if rank == 0:
            buf.pp_send(torch.ones(6, device=DEVICE), 1, num_sms=send_sms)
        else:
            out = torch.full((5,), -1.0, device=DEVICE)
            buf.pp_recv(out, 0, num_sms=recv_sms)
            _wait()
            # the kernel copies nothing; the copy engine cannot choose, it copies t's 20 bytes
            assert torch.equal(out.cpu(), torch.full((5,), -1.0 if recv_sms else 1.0))
            _expect(ValueError, "rank 0 sent a tensor of 24 bytes", buf.pp_send, out, 0)
    finally:
        buf.destroy()


@pytest.mark.parametrize("send_sms, recv_sms", [(0, 0), (1, 1), (0, 1), (1, 0)])
def test_a_receive_tensor_of_another_byte_count_is_reported(send_sms, recv_sms):
    _run(2, _byte_count_body, send_sms, recv_sms)


def _launches_body(group, num_bytes):
    """Count the PP module's launches (`GPUPipeline._launch` asks the backend for the module on every
    launch): none with num_sms=0, one per call with num_sms > 0; the bytes arrive both ways."""
    rank, num_ranks = group.rank(), group.size()
    buf = _buffer(group, num_bytes, 2)
    next_rank, prev_rank = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    backend = buf._backend
    load = backend.module
    loads = []
    sent = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
    expected = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(prev_rank))
    try:
        buf.pp_set_config(num_bytes, 2)
        on_device = sent.to(DEVICE)
        out = torch.full((num_bytes,), 0xA5, dtype=torch.uint8, device=DEVICE)
        _wait()
        backend.module = lambda kind, structure: loads.append(kind) or load(kind, structure)
        try:
            for num_sms in (0, 0, 1):
                buf.pp_send(on_device, next_rank, num_sms=num_sms)
                buf.pp_recv(out, prev_rank, num_sms=num_sms)
                if num_sms == 0:
                    assert loads == [], loads
            _wait()
        finally:
            del backend.module   # the class's method again
        assert loads == ["pp", "pp"]
        assert torch.equal(out.cpu(), expected)
        buf.pp_set_config(num_bytes, 2)
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_the_copy_engine_launches_no_kernel(num_ranks):
    _run(num_ranks, _launches_body, 1 << 20)


def test_the_profiler_sees_no_kernel_on_the_copy_engine():
    """What the GPU ran (torch.profiler's CUDA activities) for 4 MiB looped back on one rank: a
    kernel with num_sms=1 (the profiler sees kernels), copies and no kernel with num_sms=0."""
    from torch.profiler import ProfilerActivity, profile
    from deep_ep.bench.gpu_timing import single_rank_nccl_group
    num_bytes = 4 << 20
    buf = _buffer(single_rank_nccl_group(DEVICE), num_bytes, 2)
    try:
        buf.pp_set_config(num_bytes, 2)
        sent = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device=DEVICE)
        out = torch.zeros_like(sent)
        names = {}
        for num_sms in (1, 0):
            out.zero_()
            _wait()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                buf.pp_send(sent, 0, num_sms=num_sms)
                buf.pp_recv(out, 0, num_sms=num_sms)
                _wait()
            names[num_sms] = [event.name for event in prof.events()]
            assert torch.equal(out.cpu(), sent.cpu())
        if not any("deep_ep_pp_send" in name for name in names[1]):
            pytest.skip(f"the profiler recorded no kernel here (events: {names[1][:10]})")
        assert not any("deep_ep" in name for name in names[0]), names[0]
        assert any("memcpy" in name.lower() for name in names[0]), names[0]
        buf.pp_set_config(num_bytes, 2)
    finally:
        buf.destroy()
