"""All-gather / reduce-scatter sessions on GPU buffers: a one-rank NCCL group (the rank alone) and
2, 4 and 8 ranks emulated on one device. Every session space is poisoned (all bits set: NaN in every
float dtype) before its session, inputs are fresh random tensors each round, and every element is
compared with the CPU spec's formula (tests/test_agrs.py's references). Covered: single, batched
and in-place all-gathers of several dtypes (a 0-dim and an empty tensor among them), several calls
per session, reduce-scatters of bf16 and float32 (average too, batched), handles waited out of
order with outputs read right after each handle (GPU-side delays on random ranks: a handle that did
not wait would read poison), a slow reader of the previous session's outputs (a peer that did not
wait for it to enter the next session would overwrite them), bad input refused before any launch,
dispatch against an open session, dispatch and pp_set_config between sessions (refused until the
next agrs_set_config), CUDA-graph capture refused, a peer that comes late named by the next call
and by destroy's wait, the reduce kernel against its torch spec (emulated nodes refusing every
method: tests/gpu/test_gpu_primitives_across_nodes.py). Hosts never block
on a call or a handle; they wait with `deep_ep.emulated.wait_for_stream` before reading results.
Run by ``EXTRA_FILES=tests/gpu/test_gpu_agrs.py bash tools/device_suite.sh extra``.
"""
from __future__ import annotations

import os
import random
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from test_agrs import _reduce_reference, _tensor  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", 0)
TIMEOUT = 120
# All-gathered per session: (shape, dtype); the last one goes through an in-place slot.
GATHER_SPECS = [((5, 7), torch.float32), ((33, 64), torch.bfloat16), ((17,), torch.uint8), ((), torch.float64),
                ((0, 9), torch.float32), ((3, 5), torch.int32)]
IN_PLACE_SPEC = ((8, 33), torch.bfloat16)
# Reduce-scattered per session: (rows per rank, columns, dtype).
SCATTER_SPECS = [(6, 40, torch.bfloat16), (3, 17, torch.float32)]


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


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _assert_same(got: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (where, got.shape, expected.shape)
    assert torch.equal(_bytes(got), _bytes(expected)), f"{where}: differs from the CPU spec"


def _expect(error, match, fn, *args, **kwargs):
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


def _session_bytes(group) -> int:
    size = deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes
    total = sum(size(group, shape, dtype) for shape, dtype in GATHER_SPECS + [IN_PLACE_SPEC])
    # reduce_scatter rooms: the first spec alone, then both batched
    return total + sum(size(group, (rows, columns), dtype) for rows, columns, dtype in SCATTER_SPECS + SCATTER_SPECS[:1])


def _sessions_body(group, rounds):
    rank, num_ranks = group.rank(), group.size()
    session_bytes = _session_bytes(group)
    buf = deep_ep.ElasticBuffer(group, num_bytes=deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(group, session_bytes),
                                explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT)

    def gather_input(round_index, src, index):
        shape, dtype = (GATHER_SPECS + [IN_PLACE_SPEC])[index]
        return _tensor((round_index, src, index), shape, dtype)

    def scatter_input(round_index, src, index):
        rows, columns, dtype = SCATTER_SPECS[index]
        return _tensor((round_index, src, 100 + index), (rows * num_ranks, columns), dtype)

    def gathered(round_index, index):
        return torch.stack([gather_input(round_index, src, index) for src in range(num_ranks)])

    def reduced(round_index, index, average, scale=1):
        return _reduce_reference([scatter_input(round_index, src, index) * scale for src in range(num_ranks)], rank,
                                 average)

    # Host-to-device copies block on the stream: all of them before the first session.
    inputs = [([gather_input(r, rank, i).to(DEVICE) for i in range(len(GATHER_SPECS) + 1)],
               [scatter_input(r, rank, i).to(DEVICE) for i in range(len(SCATTER_SPECS))]) for r in range(rounds)]
    choices = random.Random(1000 * num_ranks + rank)
    checks = []   # (device tensor read right after its handle, expected CPU tensor, where)

    def delay():
        if choices.random() < 0.4:
            torch.cuda._sleep(choices.randrange(1, 40_000_000))   # up to about 20 ms at H200 clocks

    try:
        buf.agrs_set_config(session_bytes, 5)
        _wait()
        for round_index, (gather_in, scatter_in) in enumerate(inputs):
            buf._agrs_session.space.fill_(0xFF)   # poison: NaN in every float dtype
            delay()
            buf.create_agrs_session()
            delay()
            sent = gather_in[0].clone()
            g_first, h_first = buf.all_gather(sent)
            sent.zero_()   # queued after the copies: changes nothing
            *g_batch, h_batch = buf.all_gather(gather_in[1:len(GATHER_SPECS)])
            slot = buf.agrs_get_inplace_tensor(*IN_PLACE_SPEC)
            slot.copy_(gather_in[-1])
            g_slot, h_slot = buf.all_gather(slot)
            delay()
            r_bf16, h_bf16 = buf.reduce_scatter(scatter_in[0])
            r_fp32, r_scaled, h_pair = buf.reduce_scatter([scatter_in[1], scatter_in[0] * 3], average=True)
            expected = {
                "first": (h_first, [g_first], [gathered(round_index, 0)]),
                "batch": (h_batch, g_batch, [gathered(round_index, i) for i in range(1, len(GATHER_SPECS))]),
                "slot": (h_slot, [g_slot], [gathered(round_index, len(GATHER_SPECS))]),
                "bf16": (h_bf16, [r_bf16], [reduced(round_index, 0, False)]),
                "pair": (h_pair, [r_fp32, r_scaled], [reduced(round_index, 1, True), reduced(round_index, 0, True, 3)]),
            }
            names = list(expected)
            choices.shuffle(names)
            last = names.pop()   # left to destroy_agrs_session
            for name in names:
                handle, outputs, wanted = expected[name]
                delay()
                handle()
                checks += [(out.clone(), want, f"rank {rank} round {round_index} {name}[{i}] after its handle")
                           for i, (out, want) in enumerate(zip(outputs, wanted))]
            buf.destroy_agrs_session()
            handle, outputs, wanted = expected[last]
            assert handle.done
            checks += [(out.clone(), want, f"rank {rank} round {round_index} {last}[{i}] after the session")
                       for i, (out, want) in enumerate(zip(outputs, wanted))]
            if rank == 0:   # a slow reader: the peers' next session must not overwrite what it reads
                torch.cuda._sleep(60_000_000)
                checks.append((g_first.clone(), gathered(round_index, 0), f"round {round_index} read late"))
        _wait()
        for got, want, where in checks:
            _assert_same(got.cpu(), want, where)
        return len(checks)
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_sessions_match_the_cpu_spec(num_ranks):
    rounds = 3
    results = _run(num_ranks, _sessions_body, rounds)
    # per round: 1 + 5 + 1 gathered, 1 + 2 reduced, and rank 0's late read
    assert results[0] == rounds * 11 and all(count == rounds * 10 for count in results[1:])


def _refusals_body(group):
    rank, num_ranks = group.rank(), group.size()
    hidden, num_tokens = 128, 3
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=1,
                                explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT)
    x = (torch.arange(num_tokens * hidden, dtype=torch.float32, device=DEVICE).view(num_tokens, hidden)
         + 1000 * rank).to(torch.bfloat16)
    topk_idx = torch.zeros((num_tokens, 1), dtype=torch.int64, device=DEVICE)
    mine_on_host = torch.arange(8, dtype=torch.float32) + 100 * rank
    mine = mine_on_host.to(DEVICE)   # host-to-device copies block: all of them before the first session
    grads = [torch.randn((2 * num_ranks, 5), generator=torch.Generator().manual_seed(src)).to(torch.bfloat16)
             for src in range(num_ranks)]
    grad = grads[rank].to(DEVICE)
    expected = torch.stack([torch.arange(8, dtype=torch.float32) + 100 * src for src in range(num_ranks)])
    try:
        _expect(RuntimeError, "agrs_set_config before create_agrs_session", buf.create_agrs_session)
        _expect(RuntimeError, "inside an AGRS session", buf.all_gather, mine)
        _expect(ValueError, "get_agrs_buffer_size_hint", buf.agrs_set_config, buf.num_bytes + 32, 2)
        if num_ranks > 1:
            _expect(RuntimeError, "ranks disagree on the num_max_session_bytes", buf.agrs_set_config,
                    1024 + 32 * rank, 2)
        buf.agrs_set_config(1024, 2)
        buf._agrs_session.space.fill_(0xFF)
        buf.create_agrs_session()
        _expect(RuntimeError, "dispatch cannot use the buffer's window while agrs holds it", buf.dispatch, x, topk_idx,
                num_experts=num_ranks)
        slot = buf.agrs_get_inplace_tensor((8,), torch.float32)
        bad_calls = [
            (ValueError, "must be on cuda", buf.all_gather, (mine_on_host,), {}),
            (ValueError, "must be contiguous", buf.all_gather, (torch.zeros((4, 2), device=DEVICE).t(),), {}),
            (TypeError, "must be a torch.Tensor", buf.all_gather, ([mine, 3],), {}),
            (ValueError, "the one agrs_get_inplace_tensor returned", buf.all_gather, (slot[4:],), {}),
            (RuntimeError, "bytes of the session space", buf.all_gather, (torch.zeros(1024, device=DEVICE),), {}),
            (TypeError, "bfloat16 or float32", buf.reduce_scatter, (grad.to(torch.int32),), {}),
            (ValueError, r"must be \[R \* n", buf.reduce_scatter, (torch.zeros((), device=DEVICE),), {}),
            (TypeError, "average must be", buf.reduce_scatter, (grad,), {"average": "yes"}),
        ]
        if num_ranks > 1:
            bad_calls.append((ValueError, r"must be \[R \* n", buf.reduce_scatter,
                              (torch.zeros((num_ranks + 1, 2), device=DEVICE),), {}))
        for error, match, fn, args, kwargs in bad_calls:
            _expect(error, match, fn, *args, **kwargs)
        # nothing was sent or counted: the next two calls are the session's first and second
        slot.copy_(mine)
        gathered, handle = buf.all_gather(slot)
        handle()
        gathered_copy = gathered.clone()
        reduced, reduce_handle = buf.reduce_scatter(grad)
        _expect(RuntimeError, "already holds 2", buf.all_gather, mine)
        buf.destroy_agrs_session()
        reduced_copy = reduced.clone()
        _expect(RuntimeError, "called after that session ended", reduce_handle)
        # a dispatch writes over the region: sessions refuse until the next agrs_set_config
        buf.dispatch(x, topk_idx, num_experts=num_ranks)
        _expect(RuntimeError, "ran on this buffer since the last agrs_set_config",
                buf.create_agrs_session)
        buf.agrs_set_config(1024, 2)
        with buf.agrs_new_session():
            again, handle = buf.all_gather(mine * 2)
            handle()
            again_copy = again.clone()
        # pipeline send/recv's configuration writes over the flags too
        buf.pp_set_config(64, 2)
        _expect(RuntimeError, "pipeline send/recv ran on this buffer since the last agrs_set_config",
                buf.create_agrs_session)
        buf.agrs_set_config(1024, 2)
        with buf.agrs_new_session():
            third, handle = buf.all_gather(mine * 3)
            handle()
            third_copy = third.clone()
        _wait()
        _assert_same(gathered_copy.cpu(), expected, f"rank {rank} gathered")
        _assert_same(reduced_copy.cpu(), _reduce_reference(grads, rank, False), f"rank {rank} reduced")
        _assert_same(again_copy.cpu(), expected * 2, f"rank {rank} gathered after the dispatch")
        _assert_same(third_copy.cpu(), expected * 3, f"rank {rank} gathered after pp_set_config")
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_bad_input_is_refused_before_any_launch(num_ranks):
    _run(num_ranks, _refusals_body)


def _deepep_sizes_body(group):
    """DeepEP's way of sizing: the buffer's hint passed as the session bytes too."""
    rank, num_ranks = group.rank(), group.size()
    shape = (3000, 64)
    session_bytes = deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(group, shape, torch.bfloat16)
    hint = deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(group, session_bytes)
    inputs = [_tensor((77, src), shape, torch.bfloat16) for src in range(num_ranks)]
    mine = inputs[rank].to(DEVICE)   # host-to-device copies block: before any session
    buf = deep_ep.ElasticBuffer(group, num_bytes=hint, explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT)
    try:
        buf.agrs_set_config(hint, 1)
        space = buf._agrs_session.num_max_session_bytes
        assert session_bytes <= space < hint, (session_bytes, space, hint)
        buf._agrs_session.space.fill_(0xFF)
        with buf.agrs_new_session():
            gathered, handle = buf.all_gather(mine)
            handle()
            out = gathered.clone()
        with buf.agrs_new_session():
            _expect(RuntimeError, "bytes of the session space", buf.all_gather,
                    torch.zeros(space // (2 * num_ranks) + 16, dtype=torch.bfloat16, device=DEVICE))
        _wait()
        _assert_same(out.cpu(), torch.stack(inputs), f"rank {rank} gathered")
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_deepep_sizing_by_the_buffer_hint(num_ranks):
    """agrs_set_config(hint, n) on a buffer of num_bytes=hint, as DeepEP's test sizes it: accepted, the
    space is what the window holds after its header, and a call larger than that is refused."""
    _run(num_ranks, _deepep_sizes_body)


def test_capture_is_refused(nccl_group):
    buf = deep_ep.ElasticBuffer(nccl_group, num_bytes=deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(nccl_group, 64),
                                explicitly_destroy=True)
    try:
        buf.agrs_set_config(64, 1)
        stream = torch.cuda.Stream(DEVICE)
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                _expect(RuntimeError, "cannot be captured in a CUDA graph", buf.create_agrs_session)
                _expect(RuntimeError, "cannot be captured in a CUDA graph", buf.agrs_set_config, 64, 1)
        with buf.agrs_new_session():   # still usable
            gathered, handle = buf.all_gather(torch.full((4,), 7.0, device=DEVICE))
            handle()
        assert torch.equal(gathered.cpu(), torch.full((1, 4), 7.0))
    finally:
        buf.destroy()


def _special_values(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Infinities, NaN, signed zeros, float32 subnormals and sums that overflow, at random places
    (tensors of 500 elements or more: in smaller ones they would leave few plain numbers)."""
    flat = tensor.view(-1)
    values = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40, -3e-39, 3e38, -3e38]
    if flat.numel() >= 500:
        for value in values:
            flat[int(torch.randint(0, flat.numel(), (1,), generator=generator))] = value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reduce_kernel_equals_the_torch_spec(dtype):
    """A reduce-scatter's sum kernel (deep_ep/backends/gpu/agrs_reduce.py) equals its torch spec, run on
    the CPU, bit for bit: random chunks with special values, 1 to 8 ranks, average on and off, the
    16-byte path (aligned chunks) and the element path (odd chunks, or a view off 16-byte alignment),
    an empty chunk; the output poisoned first. A NaN's sign and payload are not specified by IEEE
    arithmetic (x86 and the GPU differ): NaNs are compared by position, every other element by its bits."""
    from deep_ep.backends.gpu import agrs_reduce
    generator = torch.Generator().manual_seed(17)
    cases = [(1, (4, 1024), 0), (2, (7, 1024), 0), (3, (5, 33), 0), (3, (7, 33), 0), (8, (16, 7168), 0),
             (4, (3, 64), 1), (5, (1,), 0), (2, (0, 16), 0)]
    for num_ranks, shape, misalign in cases:
        for average in (False, True):
            where = (num_ranks, shape, misalign, average, dtype)
            numel = num_ranks * int(torch.tensor(shape).prod())
            scale = 1.0 if dtype == torch.float32 else 4.0
            storage = (torch.randn(numel + misalign, generator=generator) * scale).to(dtype)
            _special_values(storage, generator)
            received_cpu = storage[misalign:].view(num_ranks, *shape)
            want = agrs_reduce.reduce_torch(received_cpu, average, torch.empty(shape, dtype=dtype))
            received = storage.to(DEVICE)[misalign:].view(num_ranks, *shape)
            out = torch.empty(shape, dtype=dtype, device=DEVICE)
            out.view(torch.uint8).fill_(0xFF)   # poison: NaN, which the comparison below tells apart by position
            got = agrs_reduce.reduce(received, average, out)
            assert got is out
            torch.cuda.synchronize()
            got = got.cpu()
            if want.numel():
                assert want.float().abs().nansum() > 0, where
                assert (~want.isnan()).sum() > want.numel() // 2, where
            assert torch.equal(got.isnan(), want.isnan()), where
            numbers = ~want.isnan()
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert torch.equal(got.view(bits)[numbers], want.view(bits)[numbers]), where


def test_reduce_refuses_bad_arguments():
    """The sum's checks run before any launch: dtypes, shapes, layout."""
    from deep_ep.backends.gpu import agrs_reduce
    received = torch.zeros((2, 8), dtype=torch.bfloat16, device=DEVICE)
    _expect(TypeError, "bf16 or float32", agrs_reduce.reduce, received.to(torch.int32), False,
            torch.zeros(8, dtype=torch.int32, device=DEVICE))
    _expect(TypeError, "bf16 or float32", agrs_reduce.reduce, received, False,
            torch.zeros(8, dtype=torch.float32, device=DEVICE))
    _expect(ValueError, r"must be \[R, \*out.shape\]", agrs_reduce.reduce, received, False,
            torch.zeros(4, dtype=torch.bfloat16, device=DEVICE))
    _expect(ValueError, "contiguous", agrs_reduce.reduce, torch.zeros((8, 2), dtype=torch.bfloat16,
                                                                      device=DEVICE).t(), False,
            torch.zeros(8, dtype=torch.bfloat16, device=DEVICE))


#: num_cpu_timeout_secs of the late-peer test: how long rank 0's stream waits before the host names rank 1
LATE_TIMEOUT = 5.0


def _late_peer_body(group):
    rank = group.rank()
    buf = deep_ep.ElasticBuffer(group, num_bytes=deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(group, 1024),
                                explicitly_destroy=True, num_cpu_timeout_secs=LATE_TIMEOUT)
    mine = torch.full((8,), float(rank + 1), device=DEVICE)
    try:
        buf.agrs_set_config(1024, 2)
        buf.create_agrs_session()
        gathered = None
        if rank == 0:
            gathered, handle = buf.all_gather(mine)
            handle()   # the stream waits for rank 1's flag: rank 1 makes its call only after the checks below
            buf.destroy_agrs_session()
            time.sleep(LATE_TIMEOUT + 0.5)
            missing = r"rank 1 never made its all_gather #1 of AGRS session #\d+"
            _expect(TimeoutError, missing, buf.create_agrs_session)   # the next call names the peer
            _expect(TimeoutError, missing + ".*window is not released", buf._agrs_moves().release, "destroy")
            _expect(RuntimeError, "an AGRS peer never arrived", buf.create_agrs_session)   # broken from then on
        group.barrier()
        if rank == 1:
            gathered, handle = buf.all_gather(mine)
            handle()
            buf.destroy_agrs_session()
        _wait()
        assert torch.equal(gathered.cpu(), torch.tensor([[1.0] * 8, [2.0] * 8])), rank
    finally:
        buf.destroy()   # rank 1 came: the waits are done, the window is released


def test_a_peer_that_never_arrives_is_named():
    """Rank 1 makes its all_gather only after rank 0's checks: rank 0's next call, once its stream has
    waited over num_cpu_timeout_secs, raises TimeoutError naming rank 1 and the call (the host never
    waited for it), and so does the wait of destroy; once rank 1 makes the call, both streams finish
    and destroy releases the buffer."""
    from deep_ep.backends.gpu import agrs_reduce
    agrs_reduce.load_kernel(DEVICE)   # built before the ranks start, not inside the short timeout
    _run(2, _late_peer_body)


def _absent_peer_body(group):
    rank = group.rank()
    buf = deep_ep.ElasticBuffer(group, num_bytes=deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(group, 1024),
                                explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT, num_gpu_timeout_secs=2)
    mine = torch.full((8,), float(rank + 1), device=DEVICE)
    try:
        buf.agrs_set_config(1024, 2)
        buf.create_agrs_session()
        if rank == 0:
            _, handle = buf.all_gather(mine)
            handle()   # rank 1 never makes the call: the wait kernel gives up after 2 s
            buf.destroy_agrs_session()
            _wait()
            _expect(TimeoutError, r"peer rank 1 did not arrive within [\d.]+ s in phase AGRS handle",
                    buf.create_agrs_session)
            _expect(RuntimeError, "no longer usable", buf.create_agrs_session)   # broken from then on
        group.barrier()
    finally:
        buf.destroy()


def test_the_wait_kernel_of_emulated_ranks_times_out():
    """Emulated ranks wait in a kernel: rank 1 opens the session but never makes its all_gather, so
    rank 0's handle gives up on the GPU after num_gpu_timeout_secs and rank 0's next session raises
    TimeoutError naming rank 1 (the host never waited for the GPU)."""
    _run(2, _absent_peer_body)
