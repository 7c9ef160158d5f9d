"""Pipeline send/recv (pp_set_config, pp_send, pp_recv) on the CPU backend over gloo: 1, 2 and 4
spawned ranks.

Every rank builds every tensor of a run from a shared seed (fresh random bytes per tensor, mixed
dtypes and shapes), so a receiver knows what each sender sent. Receive tensors are poisoned first
and compared byte for byte (every element, NaN payloads included). Covered: FIFO order per channel
under random interleavings, the in-flight limit, refusals (raised on every rank, before any
communication: the traffic after them still matches), the window held against dispatch until the
collective flush, and GPU buffers refusing every method.
"""
import random
import time

import pytest
import torch
import torch.distributed as dist

from proc_utils import run_gloo_ranks

POISON = 0xA5
DTYPES = (torch.bfloat16, torch.float32, torch.int32, torch.uint8, torch.float64, torch.int64, torch.bool)


def _align(value, alignment):
    return -(-value // alignment) * alignment


def _random_tensor(generator, max_bytes):
    """A fresh tensor of random bytes (any dtype, 0-dim and empty shapes included) of <= max_bytes."""
    dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=generator))]
    itemsize = torch.empty((), dtype=dtype).element_size()
    kind = int(torch.randint(6, (1,), generator=generator))
    if kind == 0:
        shape = ()
    elif kind == 1:
        shape = (0, 3)
    else:
        numel = int(torch.randint(1, max_bytes // itemsize + 1, (1,), generator=generator))
        shape = (numel,) if kind % 2 else (1, numel)
    nbytes = int(torch.tensor(shape).prod()) * itemsize if shape else itemsize
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        data = data % 2
    return data.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)


def _poisoned_like(tensor):
    out = torch.empty_like(tensor)
    out.reshape(-1).view(torch.uint8).fill_(POISON)   # not a valid bool either: only compared as bytes
    return out


def _bytes(tensor):
    return tensor.reshape(-1).view(torch.uint8)


def _assert_received(actual, expected, where):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
    assert torch.equal(_bytes(actual), _bytes(expected)), f"{where}: bytes differ"


def _stress_plan(seed, num_ranks, num_sends, limit):
    """Every rank's ops in time order: ``(time, 'send'|'recv', peer, index)``; deadlock-free: a recv
    comes after its send, and a send that finds ``limit`` tensors in flight comes after the receive
    of the oldest (every blocking call waits for an op with a smaller time on another rank)."""
    random_source = random.Random(seed)
    channels = sorted({(src, (src + step) % num_ranks) for src in range(num_ranks) for step in (1, -1)})
    per_channel = {channel: 0 for channel in channels}
    for _ in range(num_sends):
        per_channel[channels[random_source.randrange(len(channels))]] += 1
    ops = {rank: [] for rank in range(num_ranks)}
    index = 0
    for (src, dst), count in per_channel.items():
        send_times, recv_times = [], []
        for position in range(count):
            send_time = max(random_source.uniform(0, 100), send_times[-1] + 1e-3 if send_times else 0,
                            recv_times[position - limit] + 1e-3 if position >= limit else 0)
            recv_time = max(send_time + random_source.uniform(1e-3, 5), recv_times[-1] + 1e-3 if recv_times else 0)
            send_times.append(send_time)
            recv_times.append(recv_time)
            ops[src].append((send_time, "send", dst, index))
            ops[dst].append((recv_time, "recv", src, index))
            index += 1
    for rank in ops:
        ops[rank].sort()
    return ops, index


def _stress_worker(rank, world_size, seeds, num_sends, limit):
    from deep_ep import ElasticBuffer
    max_bytes = 1000
    hint = ElasticBuffer.get_pp_buffer_size_hint(max_bytes, limit)
    buf = ElasticBuffer(dist.group.WORLD, num_bytes=hint, explicitly_destroy=True, num_cpu_timeout_secs=30)
    buf.pp_set_config(max_bytes, limit)
    checked = 0
    for seed in seeds:
        ops, total = _stress_plan(seed, world_size, num_sends, limit)
        generator = torch.Generator().manual_seed(seed)
        tensors = [_random_tensor(generator, max_bytes) for _ in range(total)]
        for _, op, peer, index in ops[rank]:
            if op == "send":
                sent = tensors[index].clone()
                buf.pp_send(sent, peer)
                _bytes(sent).fill_(0)   # the bytes were copied: reusing the tensor changes nothing
            else:
                out = _poisoned_like(tensors[index])
                buf.pp_recv(out, peer)
                _assert_received(out, tensors[index], f"rank {rank} seed {seed} tensor {index} from {peer}")
                checked += 1
        buf.pp_set_config(max_bytes, limit)   # flush between seeds: every rank agrees all arrived
    buf.destroy()
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_random_interleavings_arrive_in_order(world_size, tmp_path):
    """Random sends to both neighbours, received later in random interleavings: every tensor
    arrives intact, in the order sent on its channel (a seed per run, several runs)."""
    results = run_gloo_ranks(_stress_worker, world_size, tmp_path, [11, 12, 13], 24 * world_size, 3, deadline=240)
    assert sum(results.values()) == 3 * 24 * world_size


def _ring_worker(rank, world_size, rounds):
    """Each rank sends ``rounds`` tensors to the next rank, then to the previous one, then receives
    them all (a pipeline's forward and backward). The limit is per channel: with 2 ranks both
    directions are one channel, which must hold all ``2 * rounds``."""
    from deep_ep import ElasticBuffer
    buf = ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=30)
    assert buf.num_bytes == 0
    limit = rounds if world_size > 2 else 2 * rounds
    buf.pp_set_config(4096, limit)
    next_rank, prev_rank = (rank + 1) % world_size, (rank - 1) % world_size

    def tensor(src, direction, position):
        generator = torch.Generator().manual_seed(1000 * src + 100 * direction + position)
        return torch.randn((position + 1, 7), generator=generator).to(torch.bfloat16)

    for position in range(rounds):
        buf.pp_send(tensor(rank, 0, position), next_rank)
    for position in range(rounds):
        buf.pp_send(tensor(rank, 1, position), prev_rank)
    for position in range(rounds):
        out = _poisoned_like(tensor(prev_rank, 0, position))
        buf.pp_recv(out, prev_rank)
        _assert_received(out, tensor(prev_rank, 0, position), f"rank {rank} forward #{position}")
    for position in range(rounds):
        out = _poisoned_like(tensor(next_rank, 1, position))
        buf.pp_recv(out, next_rank)
        # with 2 ranks next == prev_rank: one channel, so the backward tensors follow the forward ones
        _assert_received(out, tensor(next_rank, 1, position), f"rank {rank} backward #{position}")
    buf.pp_set_config(4096, limit)
    buf.destroy()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_forward_and_backward(world_size, tmp_path):
    """Both ring directions at once; with 2 ranks previous and next are one rank and one channel."""
    run_gloo_ranks(_ring_worker, world_size, tmp_path, 3, deadline=120)


def _limit_worker(rank, world_size, limit, delay):
    from deep_ep import ElasticBuffer
    buf = ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=30)
    buf.pp_set_config(64, limit)
    result = {}
    tensors = [torch.full((8,), position + 1, dtype=torch.int64) for position in range(limit + 1)]
    if rank == 0:
        returned = []
        for tensor in tensors:
            buf.pp_send(tensor, 1)
            returned.append(time.time())
        result["send_returned"] = returned
    elif rank == 1:
        time.sleep(delay)
        result["recv_started"] = time.time()
        for tensor in tensors:
            out = torch.full((8,), -7, dtype=torch.int64)
            buf.pp_recv(out, 0)
            assert torch.equal(out, tensor)
    buf.pp_set_config(64, limit)
    buf.destroy()
    return result


@pytest.mark.parametrize("world_size", [2, 4])
def test_send_beyond_the_limit_waits_for_the_receiver(world_size, tmp_path):
    """With ``limit`` tensors unreceived, the next pp_send returns only after the receiver started
    taking them; the first ``limit`` return at once."""
    limit = 2
    results = run_gloo_ranks(_limit_worker, world_size, tmp_path, limit, 1.5, deadline=120)
    returned, started = results[0]["send_returned"], results[1]["recv_started"]
    assert all(when < started for when in returned[:limit]), (returned, started)
    assert returned[limit] >= started, (returned, started)


def _expect(error, match, fn, *args, **kwargs):
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


def _refusals_worker(rank, world_size):
    from deep_ep import ElasticBuffer
    buf = ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=30)
    next_rank, prev_rank = (rank + 1) % world_size, (rank - 1) % world_size
    sent = torch.arange(6, dtype=torch.float32) + 10 * rank
    _expect(RuntimeError, "pp_set_config.*on every rank first", buf.pp_send, sent, next_rank)
    _expect(RuntimeError, "pp_set_config.*on every rank first", buf.pp_recv, sent, prev_rank)
    _expect(TypeError, "num_max_tensor_bytes must be an int", buf.pp_set_config, 64.0, 2)
    _expect(ValueError, "num_max_inflight_tensors must be >= 1", buf.pp_set_config, 64, 0)
    _expect(ValueError, "num_max_tensor_bytes must be >= 1", buf.pp_set_config, 0, 2)
    _expect(TypeError, "num_max_inflight_tensors must be an int", buf.pp_set_config, 64, True)
    buf.pp_set_config(64, 2)
    bad_calls = [
        (TypeError, "t must be a torch.Tensor", (sent.tolist(), next_rank), {}),
        (TypeError, "dst_rank_idx must be an int", (sent, float(next_rank)), {}),
        (TypeError, "dst_rank_idx must be an int", (sent, True), {}),
        (ValueError, f"dst_rank_idx={world_size} is not a neighbour.*previous rank", (sent, world_size), {}),
        (ValueError, "dst_rank_idx=-1 is not a neighbour.*previous rank", (sent, -1), {}),
        (ValueError, "must be contiguous", (torch.arange(12.0).view(2, 6).t(), next_rank), {}),
        (ValueError, "more than the configured num_max_tensor_bytes", (torch.zeros(17, dtype=torch.float32), next_rank), {}),
        (ValueError, "t is on meta", (torch.empty(4, device="meta"), next_rank), {}),
        (TypeError, "dense", (torch.zeros(4).to_sparse(), next_rank), {}),
        (ValueError, "num_sms must be >= 0", (sent, next_rank), {"num_sms": -1}),
        (TypeError, "num_sms must be an int", (sent, next_rank), {"num_sms": 1.5}),
    ]
    if world_size > 2:
        bad_calls.append((ValueError, "not a neighbour.*previous rank", (sent, rank), {}))
    if world_size > 3:
        bad_calls.append((ValueError, "not a neighbour", (sent, (rank + 2) % world_size), {}))
    for error, match, args, kwargs in bad_calls:
        _expect(error, match, buf.pp_send, *args, **kwargs)
        recv_args = (args[0], prev_rank) if type(args[1]) is int and args[1] == next_rank else args
        _expect(error, match.replace("dst_", "src_"), buf.pp_recv, *recv_args, **kwargs)
    # a window too small for the sizes (only a buffer with a window, num_bytes > 0, checks)
    small = ElasticBuffer(dist.group.WORLD, num_bytes=2 * 1024 * 1024)
    _expect(ValueError, "get_pp_buffer_size_hint", small.pp_set_config, 256 * 1024 + 1, 2)
    small.pp_set_config(256 * 1024, 2)   # exactly 2 MiB
    small.destroy()
    # nothing moved: the first real tensor on each channel is the first one received
    buf.pp_send(sent, next_rank)
    out = torch.full((6,), float("nan"))
    buf.pp_recv(out, prev_rank)
    assert torch.equal(out, torch.arange(6, dtype=torch.float32) + 10 * prev_rank)
    # a receive tensor of another byte size: refused after the tensor arrived, which is consumed
    buf.pp_send(sent, next_rank)
    wrong = torch.full((5,), -1.0)
    _expect(ValueError, "24 bytes, but t holds 20 bytes", buf.pp_recv, wrong, prev_rank)
    assert torch.equal(wrong, torch.full((5,), -1.0))
    buf.pp_send(sent * 2, next_rank)
    buf.pp_recv(out, prev_rank)
    assert torch.equal(out, (torch.arange(6, dtype=torch.float32) + 10 * prev_rank) * 2)
    # tensors sent and not received: pp_set_config refuses on every rank, keeps the channels
    buf.pp_send(sent * 3, next_rank)
    _expect(RuntimeError, f"sent and not received .*1 from rank {prev_rank} to rank {rank}", buf.pp_set_config, 64, 2)
    buf.pp_recv(out, prev_rank)
    assert torch.equal(out, (torch.arange(6, dtype=torch.float32) + 10 * prev_rank) * 3)
    # ranks that disagree on the sizes: every rank raises, the configuration stays
    _expect(RuntimeError, "ranks disagree on num_max_inflight_tensors", buf.pp_set_config, 64, 2 + rank)
    buf.pp_set_config(96, 2)
    buf.pp_send(torch.zeros(24, dtype=torch.float32), next_rank)    # 96 bytes now fit
    buf.pp_recv(torch.empty(24, dtype=torch.float32), prev_rank)
    buf.pp_set_config(96, 2)
    buf.destroy()
    _expect(RuntimeError, "was destroyed", buf.pp_send, sent, next_rank)
    _expect(RuntimeError, "was destroyed", buf.pp_set_config, 64, 2)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bad_input_is_refused_on_every_rank_before_communication(world_size, tmp_path):
    run_gloo_ranks(_refusals_worker, world_size, tmp_path, deadline=120)


def _window_worker(rank, world_size):
    from deep_ep import ElasticBuffer
    hidden, num_tokens = 128, 3
    buf = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=1)
    buf.pp_set_config(1024, 2)
    x = (torch.arange(num_tokens * hidden, dtype=torch.float32).view(num_tokens, hidden) + 1000 * rank)
    x = x.to(torch.bfloat16)
    topk_idx = torch.zeros((num_tokens, 1), dtype=torch.int64)   # every token to expert 0 (rank 0)
    next_rank, prev_rank = (rank + 1) % world_size, (rank - 1) % world_size
    sent = torch.randn(16, generator=torch.Generator().manual_seed(rank))
    buf.pp_send(sent, next_rank)
    _expect(RuntimeError, "dispatch cannot use the buffer's window while pp holds it.*pp_set_config",
            buf.dispatch, x, topk_idx, num_experts=world_size)
    out = torch.full((16,), float("nan"))
    buf.pp_recv(out, prev_rank)
    assert torch.equal(out, torch.randn(16, generator=torch.Generator().manual_seed(prev_rank)))
    # received, but only the collective flush tells every rank that every peer is done
    _expect(RuntimeError, "while pp holds it", buf.dispatch, x, topk_idx, num_experts=world_size)
    buf.pp_set_config(1024, 2)
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx, num_experts=world_size)
    if rank == 0:
        expected = torch.cat([(torch.arange(num_tokens * hidden, dtype=torch.float32).view(num_tokens, hidden)
                               + 1000 * src).to(torch.bfloat16) for src in range(world_size)])
        assert torch.equal(recv_x, expected)
    else:
        assert recv_x.shape[0] == 0
    # another user holding the window: PP refuses before communicating, on every rank
    buf._window_use.hold("agrs", "a session is open")
    _expect(RuntimeError, "pp cannot use the buffer's window while agrs holds it", buf.pp_send, sent, next_rank)
    _expect(RuntimeError, "pp cannot use the buffer's window while agrs holds it", buf.pp_recv, out, prev_rank)
    _expect(RuntimeError, "pp cannot use the buffer's window while agrs holds it", buf.pp_set_config, 1024, 2)
    buf._window_use.release("agrs")
    buf.pp_send(sent * 2, next_rank)
    buf.pp_recv(out, prev_rank)
    assert torch.equal(out, torch.randn(16, generator=torch.Generator().manual_seed(prev_rank)) * 2)
    buf.pp_set_config(1024, 2)
    buf.destroy()


@pytest.mark.parametrize("world_size", [2, 4])
def test_window_is_held_from_pp_traffic_until_the_flush(world_size, tmp_path):
    """Dispatch raises on every rank after PP traffic until pp_set_config flushes it, then works."""
    run_gloo_ranks(_window_worker, world_size, tmp_path, deadline=120)


def _timeout_worker(rank, world_size):
    from deep_ep import ElasticBuffer
    buf = ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=2)
    buf.pp_set_config(64, 2)
    if rank == 0:
        out = torch.full((4,), float("nan"))
        _expect(TimeoutError, "pp_recv with rank 1 did not complete within 2 s", buf.pp_recv, out, 1)
        _expect(RuntimeError, "can no longer be used", buf.pp_send, out, 1)
    else:
        time.sleep(4)   # never sends: rank 0 gives up after the buffer's timeout, not the group's


def test_a_recv_with_no_sender_times_out(tmp_path):
    run_gloo_ranks(_timeout_worker, 2, tmp_path, deadline=60, leave_together=False)


def _one_rank_worker(rank, world_size):
    from deep_ep import ElasticBuffer
    buf = ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=30)
    buf.pp_set_config(32, 2)
    first, second = torch.tensor([1.5, -2.0]), torch.tensor([7, 8, 9], dtype=torch.int16)
    buf.pp_send(first, 0)
    buf.pp_send(second, 0)
    _expect(RuntimeError, "wait for itself forever; pp_recv the oldest first", buf.pp_send, first, 0)
    out_first, out_second = torch.full((2,), float("nan")), torch.full((3,), -1, dtype=torch.int16)
    buf.pp_recv(out_first, 0)
    buf.pp_recv(out_second, 0)
    assert torch.equal(out_first, first) and torch.equal(out_second, second)
    _expect(RuntimeError, "nothing in flight", buf.pp_recv, out_first, 0)
    buf.pp_set_config(32, 2)
    buf.destroy()


def test_one_rank_loops_back(tmp_path):
    run_gloo_ranks(_one_rank_worker, 1, tmp_path, deadline=60)


def test_size_hint_is_deepep_s():
    from deep_ep import ElasticBuffer
    two_mib = 2 * 1024 * 1024
    for num_bytes, inflight in ((1, 1), (4096 * 7168 * 2, 4), (1000, 3), (two_mib // 4, 1), (two_mib // 4 + 1, 1)):
        expected = _align(_align(num_bytes, 32) * inflight * 4, two_mib)
        assert ElasticBuffer.get_pp_buffer_size_hint(num_bytes, inflight) == expected
    assert ElasticBuffer.get_pp_buffer_size_hint(4096 * 7168 * 2, 4) == 896 * 1024 * 1024   # DeepEP test_pp.py defaults: 56 MiB tensors, 4 in flight
    with pytest.raises(ValueError, match="num_max_tensor_bytes must be >= 1"):
        ElasticBuffer.get_pp_buffer_size_hint(0, 1)
    with pytest.raises(TypeError, match="num_max_inflight_tensors must be an int"):
        ElasticBuffer.get_pp_buffer_size_hint(64, 2.0)


class _NoCommunicationBackend:
    """Stands for a GPU backend: any use of it fails the test."""

    calls = 0

    def __getattr__(self, name):
        raise AssertionError(f"the backend was used ({name}) before the refusal")


def test_other_backends_refuse_every_method_before_communicating():
    from deep_ep import ElasticBuffer
    from deep_ep.primitives import WindowUse
    buf = ElasticBuffer.__new__(ElasticBuffer)
    buf._destroyed, buf._backend, buf._window_use = False, _NoCommunicationBackend(), WindowUse()
    tensor = torch.zeros(4)
    for method, args in (("pp_set_config", (64, 2)), ("pp_send", (tensor, 1)), ("pp_recv", (tensor, 1))):
        with pytest.raises(NotImplementedError, match=f"ElasticBuffer.{method}: .*GPU buffers.*CPU backend"):
            getattr(buf, method)(*args)
    assert buf._window_use.holder is None
    buf._destroyed = True


def test_signatures_are_deepep_s():
    """Names, order, defaults and the static hint as in DeepEP V2's ElasticBuffer."""
    import inspect
    from deep_ep import ElasticBuffer
    empty = inspect.Parameter.empty
    expected = {"get_pp_buffer_size_hint": [("num_max_tensor_bytes", empty), ("num_max_inflight_tensors", empty)],
                "pp_set_config": [("self", empty), ("num_max_tensor_bytes", empty),
                                  ("num_max_inflight_tensors", empty)],
                "pp_send": [("self", empty), ("t", empty), ("dst_rank_idx", empty), ("num_sms", 0)],
                "pp_recv": [("self", empty), ("t", empty), ("src_rank_idx", empty), ("num_sms", 0)]}
    for name, params in expected.items():
        got = [(p.name, p.default) for p in inspect.signature(getattr(ElasticBuffer, name)).parameters.values()]
        assert got == params, name
        assert isinstance(inspect.getattr_static(ElasticBuffer, name), staticmethod) == (name == "get_pp_buffer_size_hint")
