"""All-gather / reduce-scatter sessions (AGRS) of ElasticBuffer on the CPU backend, 2 and 4 gloo ranks.

DeepEP's tests/elastic/test_agrs.py checks re-derived: random sequences of sessions, all-gathers
(batched or not, in place or not) and reduce-scatters, handles waited in random order, every output
compared bit for bit with a reference each rank computes for all ranks from a shared seed (inputs
are fresh random values, the session space is poisoned before each session). Then the refusals (each
raised on every rank), ranks that disagree, the window held against a dispatch, and the GPU refusal.
"""
import inspect
import random
import re

import pytest
import torch

import deep_ep
from caller_defaults import caller_defaults
from proc_utils import run_gloo_ranks

AG_DTYPES = (torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.uint8, torch.bool)
RS_DTYPES = (torch.bfloat16, torch.float32)
MAX_OPS = 4
SESSION_BYTES = 48 * 1024


class _Group:
    """A stand-in group for the static size helpers (they use only ``size()``)."""

    def __init__(self, size):
        self._size = size

    def rank(self):
        return 0

    def size(self):
        return self._size


_ = inspect.Parameter.empty
#: DeepEP V2's experimental AGRS signatures (deep_ep/buffers/elastic.py), then deep_ep's extension.
SIGNATURES = {
    "get_agrs_num_max_session_bytes": [("group", _), ("shapes", _), ("dtype", _)],
    "get_agrs_buffer_size_hint": [("group", _), ("num_max_session_bytes", _)],
    "agrs_set_config": [("self", _), ("num_max_session_bytes", _), ("num_max_all_gathers_per_session", _)],
    "create_agrs_session": [("self", _)],
    "destroy_agrs_session": [("self", _)],
    "agrs_new_session": [("self", _), ("enabled", True)],
    "agrs_get_inplace_tensor": [("self", _), ("shapes", _), ("dtype", _)],
    "all_gather": [("self", _), ("t", _)],
    "reduce_scatter": [("self", _), ("t", _), ("average", False)],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_match_deepep(name):
    member = inspect.getattr_static(deep_ep.ElasticBuffer, name)
    assert isinstance(member, staticmethod) == name.startswith("get_"), name
    params = list(inspect.signature(getattr(deep_ep.ElasticBuffer, name)).parameters.values())
    assert [(p.name, p.default) for p in params] == SIGNATURES[name]
    kinds = [p.kind for p in params]
    if name == "reduce_scatter":   # the extension's options are keyword-only
        assert kinds[-1] == inspect.Parameter.KEYWORD_ONLY
        kinds = kinds[:-1]
    assert all(kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for kind in kinds), name
    assert getattr(deep_ep.ElasticBuffer, name).__doc__.count("Raises") == 1, name


def test_size_helpers_match_deepep():
    buffer_class = deep_ep.ElasticBuffer
    # R * numel * itemsize, each rounded up to 32 bytes
    assert buffer_class.get_agrs_num_max_session_bytes(_Group(3), (5, 7), torch.float32) == 448
    assert buffer_class.get_agrs_num_max_session_bytes(_Group(3), [(5, 7), (1,)], torch.bfloat16) == 224 + 32
    assert buffer_class.get_agrs_num_max_session_bytes(_Group(2), torch.Size([4]), torch.uint8) == 32
    assert buffer_class.get_agrs_num_max_session_bytes(_Group(8), [(32, 64, 2048)] * 4, torch.bfloat16) == \
        4 * 8 * 32 * 64 * 2048 * 2
    assert buffer_class.get_agrs_num_max_session_bytes(_Group(2), (), torch.float64) == 32
    assert buffer_class.get_agrs_num_max_session_bytes(_Group(4), (0, 9), torch.float32) == 0
    mib = 1024 * 1024
    # the GPU window's control region (64 KiB) and flag words (35 rows of R words, in 4 KiB) come first
    header = 64 * 1024 + 4096
    for value, hint in ((0, 0), (1, 2 * mib), (2 * mib - header, 2 * mib), (2 * mib - header + 1, 4 * mib),
                        (2 * mib, 4 * mib), (2 * mib + 1, 4 * mib)):
        assert buffer_class.get_agrs_buffer_size_hint(_Group(2), value) == hint
    assert buffer_class.get_agrs_buffer_size_hint(_Group(64), 2 * mib - header) == 4 * mib   # 35 * 64 * 4 > 4 KiB
    with pytest.raises(ValueError, match="at least one shape"):
        buffer_class.get_agrs_num_max_session_bytes(_Group(2), [], torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        buffer_class.get_agrs_num_max_session_bytes(_Group(2), (4,), "float32")
    with pytest.raises(ValueError):
        buffer_class.get_agrs_num_max_session_bytes(_Group(2), (4, -1), torch.float32)
    with pytest.raises(ValueError):
        buffer_class.get_agrs_buffer_size_hint(_Group(2), -1)


# ---------------------------------------------------------------------------- references
def _tensor(seed: tuple, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A fresh random tensor, the same on every rank for the same ``seed``."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(hash(seed) % (2 ** 62))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator, dtype=torch.int64, device="cpu").bool()
    if dtype in (torch.int32, torch.uint8):
        return torch.randint(0, 200, shape, generator=generator, dtype=torch.int64, device="cpu").to(dtype)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu").to(dtype)


def _reduce_reference(inputs: list, rank: int, average: bool) -> torch.Tensor:
    """Rank ``rank``'s rows of the float32 sum of ``inputs`` (one per rank), in rank order."""
    num_ranks = len(inputs)
    rows = inputs[0].shape[0] // num_ranks
    total = inputs[0][rank * rows:(rank + 1) * rows].to(torch.float32, copy=True)
    for tensor in inputs[1:]:
        total += tensor[rank * rows:(rank + 1) * rows].to(torch.float32)
    if average:
        total /= num_ranks
    return total.to(inputs[0].dtype)


def _make_jobs(rng: random.Random, num_jobs: int, num_ranks: int) -> list:
    """Random calls: ``(kind, specs, in_place, batched, average)``, ``specs`` a list of (shape, dtype)."""
    jobs = []
    for _ in range(num_jobs):
        kind = rng.choice(("ag", "ag", "rs"))
        count = rng.choice((1, 1, 2, 3))
        specs = []
        for _ in range(count):
            tail = rng.choice(((), (1,), (3,), (16,), (5, 3)))
            if kind == "ag":
                shape = rng.choice(((), (rng.randint(0, 9), *tail)))
                specs.append((shape, rng.choice(AG_DTYPES)))
            else:
                specs.append(((num_ranks * rng.randint(0, 5), *tail), rng.choice(RS_DTYPES)))
        batched = count > 1 or rng.random() < 0.3
        in_place = kind == "ag" and rng.random() < 0.5
        if in_place:
            specs = [(shape, specs[0][1]) for shape, _ in specs]
        jobs.append((kind, specs, in_place, batched, rng.random() < 0.3))
    return jobs


def _room(num_ranks: int, kind: str, specs: list) -> int:
    shapes = [shape if kind == "ag" else (shape[0] // num_ranks, *shape[1:]) for shape, _ in specs]
    return sum(deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(_Group(num_ranks), shape, dtype)
               for shape, (_, dtype) in zip(shapes, specs))


def _plan(rng: random.Random, jobs: list, num_ranks: int) -> list:
    """DeepEP's stress order: start calls while they fit, wait random in-flight ones, end and start
    sessions; each call counts once (a batched one too), and its room against the session bytes."""
    ops, pending, inflight = [("create", None)], list(range(len(jobs))), []
    rng.shuffle(pending)
    used_ops = used_bytes = 0
    while pending or inflight:
        job = pending[-1] if pending else None
        fits = job is not None and used_ops < MAX_OPS and \
            used_bytes + _room(num_ranks, jobs[job][0], jobs[job][1]) <= SESSION_BYTES
        choices = (["start"] if fits else []) + (["wait"] if inflight else ["end"])
        choice = rng.choice(choices)
        if choice == "start":
            pending.pop()
            used_ops += 1
            used_bytes += _room(num_ranks, jobs[job][0], jobs[job][1])
            inflight.append(job)
            ops.append(("start", job))
        elif choice == "wait":
            ops.append(("wait", inflight.pop(rng.randrange(len(inflight)))))
        else:
            ops += [("end", None), ("create", None)]
            used_ops = used_bytes = 0
    return ops + [("end", None)]


def _start(buf, job_id: int, job: tuple, seed: int, rank: int, num_ranks: int):
    """Start one call; ``(outputs, handle, references)``."""
    kind, specs, in_place, batched, average = job
    inputs = [[_tensor((seed, job_id, index, peer), shape, dtype) for peer in range(num_ranks)]
              for index, (shape, dtype) in enumerate(specs)]
    if kind == "ag":
        tensors = [per_rank[rank] for per_rank in inputs]
        if in_place:   # every tensor of an in-place call has the same dtype (_make_jobs)
            shapes = [shape for shape, _ in specs]
            slots = buf.agrs_get_inplace_tensor(shapes if batched else shapes[0], specs[0][1])
            slots = slots if batched else (slots,)
            for slot, tensor in zip(slots, tensors):
                slot.copy_(tensor)
            tensors = list(slots)
        refs = [torch.stack(per_rank) for per_rank in inputs]
        result = buf.all_gather(tensors if batched else tensors[0])
    else:
        tensors = [per_rank[rank] for per_rank in inputs]
        refs = [_reduce_reference(per_rank, rank, average) for per_rank in inputs]
        if average:
            result = buf.reduce_scatter(tensors if batched else tensors[0], average=True)
        else:
            result = buf.reduce_scatter(tensors if batched else tensors[0])
    *outputs, handle = result
    for output, ref in zip(outputs, refs):
        assert output.shape == ref.shape and output.dtype == ref.dtype, (output.shape, ref.shape)
    return outputs, handle, refs


def _poison(buf) -> None:
    """Fill the session space with 0xFF bytes (NaN in bf16 / float32 / float64): a row not written shows."""
    buf._agrs_session.space.fill_(255)


def _stress_body(rank, num_ranks, seeds):
    buf = deep_ep.ElasticBuffer(torch.distributed.group.WORLD, explicitly_destroy=True,
                                num_bytes=deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(
                                    torch.distributed.group.WORLD, SESSION_BYTES))
    buf.agrs_set_config(SESSION_BYTES, MAX_OPS)
    checked = 0
    for seed in seeds:
        rng = random.Random(seed)   # the same sequence of calls on every rank
        jobs = _make_jobs(rng, 40, num_ranks)
        started = {}
        results = {}
        for op, job_id in _plan(rng, jobs, num_ranks):
            if op == "create":
                buf.create_agrs_session()
                _poison(buf)
            elif op == "end":
                buf.destroy_agrs_session()
            elif op == "start":
                started[job_id] = _start(buf, job_id, jobs[job_id], seed, rank, num_ranks)
            else:
                outputs, handle, refs = started.pop(job_id)
                handle()
                handle()   # a second wait is a no-op
                results[job_id] = [(output.clone(), ref) for output, ref in zip(outputs, refs)]
        assert sorted(results) == list(range(len(jobs)))
        for job_id, pairs in results.items():
            for output, ref in pairs:
                assert torch.equal(output, ref), f"rank {rank}: seed {seed}, call {job_id} {jobs[job_id]}"
                checked += output.numel()
    assert checked > 500
    buf.destroy()
    return checked


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_stress_matches_reference(tmp_path, num_ranks):
    run_gloo_ranks(_stress_body, num_ranks, tmp_path, (7 * num_ranks, 7 * num_ranks + 1), deadline=300)


# ---------------------------------------------------------------------------- refusals
def _raises(kind, pattern, call):
    with pytest.raises(kind, match=pattern):
        call()


def _refusals_body(rank, num_ranks):
    group = torch.distributed.group.WORLD
    buf = deep_ep.ElasticBuffer(group, num_bytes=2 * 1024 * 1024)
    rows = torch.arange(6 * num_ranks, dtype=torch.float32, device="cpu").view(2 * num_ranks, 3) + rank
    # before agrs_set_config, and outside a session
    _raises(RuntimeError, "agrs_set_config before", buf.create_agrs_session)
    _raises(RuntimeError, "inside an AGRS session", lambda: buf.all_gather(rows))
    _raises(RuntimeError, "inside an AGRS session", lambda: buf.reduce_scatter(rows))
    _raises(RuntimeError, "inside an AGRS session", lambda: buf.agrs_get_inplace_tensor((4,), torch.float32))
    _raises(RuntimeError, "inside an AGRS session", buf.destroy_agrs_session)
    # bad configurations
    _raises(ValueError, ">= 1", lambda: buf.agrs_set_config(0, 1))
    _raises(ValueError, ">= 1", lambda: buf.agrs_set_config(1024, 0))
    _raises(ValueError, "<= 32", lambda: buf.agrs_set_config(1024, 33))
    _raises(TypeError, "int", lambda: buf.agrs_set_config(1024.0, 2))
    _raises(ValueError, "exceeds the buffer's num_bytes", lambda: buf.agrs_set_config(4 * 1024 * 1024, 2))
    room = deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(group, [(2, 3)] * 2, torch.float32)
    buf.agrs_set_config(room + 1, 2)   # rounded up to 32: room for two [2, 3] all-gathers and 32 bytes
    buf.create_agrs_session()
    _raises(RuntimeError, "already open", buf.create_agrs_session)
    _raises(RuntimeError, "while an AGRS session is open", lambda: buf.agrs_set_config(room, 2))
    # bad tensors, before any communication
    _raises(ValueError, "contiguous", lambda: buf.all_gather(rows.t()))
    _raises(ValueError, "buffer's device", lambda: buf.all_gather(torch.empty(3, device="meta")))
    _raises(TypeError, "torch.Tensor", lambda: buf.all_gather([rows, 3]))
    _raises(ValueError, "at least one tensor", lambda: buf.all_gather([]))
    _raises(TypeError, "bfloat16 or float32", lambda: buf.reduce_scatter(rows.to(torch.float64)))
    _raises(TypeError, "bfloat16 or float32", lambda: buf.reduce_scatter(rows.to(torch.int32)))
    _raises(ValueError, r"\[R \* n", lambda: buf.reduce_scatter(rows[:2 * num_ranks - 1]))
    _raises(ValueError, r"\[R \* n", lambda: buf.reduce_scatter(torch.ones((), device="cpu")))
    _raises(TypeError, "average", lambda: buf.reduce_scatter(rows, average="yes"))
    # an in-place tensor at the wrong slot, and another view of the space
    slot = buf.agrs_get_inplace_tensor((2, 3), torch.float32)
    slot.copy_(rows[:2])
    _raises(ValueError, "agrs_get_inplace_tensor returned", lambda: buf.all_gather(slot[1:]))
    _raises(ValueError, "unused part", lambda: buf.reduce_scatter(buf.agrs_get_inplace_tensor(
        (num_ranks, 1), torch.float32)))
    gathered, handle = buf.all_gather(slot)
    handle()
    assert torch.equal(gathered, torch.stack([rows[:2] - rank + peer for peer in range(num_ranks)]))
    _raises(ValueError, "agrs_get_inplace_tensor returned", lambda: buf.all_gather(gathered[0]))
    # the session space: 64 + 32 bytes left, one call left
    _raises(RuntimeError, "bytes of the session space", lambda: buf.all_gather(torch.zeros(
        100, dtype=torch.float32, device="cpu")))
    _raises(RuntimeError, "bytes of the session space", lambda: buf.agrs_get_inplace_tensor([(2, 3)] * 2,
                                                                                           torch.float32))
    small = torch.full((1,), rank, dtype=torch.int16, device="cpu")
    out, handle = buf.all_gather(small)
    _raises(RuntimeError, "already holds 2", lambda: buf.all_gather(small))
    _raises(RuntimeError, "already holds 2", lambda: buf.agrs_get_inplace_tensor((1,), torch.int16))
    handle()
    assert out.tolist() == [[peer] for peer in range(num_ranks)]
    buf.destroy_agrs_session()
    _raises(RuntimeError, "after that session ended", handle)
    # the context manager: disabled is a no-op; an exception inside still ends the session
    with buf.agrs_new_session(enabled=False):
        _raises(RuntimeError, "inside an AGRS session", lambda: buf.all_gather(small))
    with pytest.raises(KeyError):
        with buf.agrs_new_session():
            raise KeyError("inside")
    assert buf._window_use.holder is None
    _raises(TypeError, "enabled", lambda: buf.agrs_new_session(enabled="no").__enter__())
    buf.destroy()
    _raises(RuntimeError, "destroyed", buf.create_agrs_session)
    return True


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_refusals_on_every_rank(tmp_path, num_ranks):
    assert run_gloo_ranks(_refusals_body, num_ranks, tmp_path, deadline=120) == {r: True for r in range(num_ranks)}


def _unwaited_and_window_body(rank, num_ranks):
    group = torch.distributed.group.WORLD
    buf = deep_ep.ElasticBuffer(group)   # CPU: no window size given, the session space is allocated
    buf.agrs_set_config(64 * 1024, 8)
    num_experts = 2 * num_ranks
    x = torch.randn((5, 128), dtype=torch.float32, device="cpu").to(torch.bfloat16)
    topk_idx = torch.randint(0, num_experts, (5, 2), dtype=torch.int64, device="cpu")
    outputs = []
    with buf.agrs_new_session():
        assert buf._window_use.holder == "agrs"
        _raises(RuntimeError, "dispatch cannot use the buffer's window while agrs holds it",
                lambda: buf.dispatch(x, topk_idx, num_experts=num_experts))
        first = _tensor((1, rank), (3, 5), torch.bfloat16)
        second = _tensor((2, rank), (num_ranks * 2, 4), torch.float32)
        outputs.append(buf.all_gather(first))
        outputs.append(buf.reduce_scatter(second, average=True))
        outputs.append(buf.all_gather([first, second]))
        outputs[1][1]()   # one handle waited; the session's end waits for the others
    gathered, _ = outputs[0]
    assert torch.equal(gathered, torch.stack([_tensor((1, peer), (3, 5), torch.bfloat16)
                                              for peer in range(num_ranks)]))
    reduced, _ = outputs[1]
    assert torch.equal(reduced, _reduce_reference([_tensor((2, peer), (num_ranks * 2, 4), torch.float32)
                                                   for peer in range(num_ranks)], rank, True))
    pair_first, pair_second, _ = outputs[2]
    assert torch.equal(pair_first, gathered)
    assert torch.equal(pair_second, torch.stack([_tensor((2, peer), (num_ranks * 2, 4), torch.float32)
                                                 for peer in range(num_ranks)]))
    assert all(output[-1].done for output in outputs)
    # the window is free again: a dispatch runs; another primitive holding it refuses a session
    recv_x, *_ = buf.dispatch(x, topk_idx, num_experts=num_experts)
    assert recv_x.shape[1] == 128
    buf._window_use.hold("pp", "a tensor in flight")
    _raises(RuntimeError, "agrs cannot use the buffer's window while pp holds it", buf.create_agrs_session)
    _raises(RuntimeError, "agrs cannot use the buffer's window while pp holds it",
            lambda: buf.agrs_set_config(1024, 1))
    buf._window_use.release("pp")
    buf.destroy()
    return True


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_unwaited_handles_and_the_window(tmp_path, num_ranks):
    run_gloo_ranks(_unwaited_and_window_body, num_ranks, tmp_path, deadline=120)


def _disagreement_body(rank, num_ranks):
    buf = deep_ep.ElasticBuffer(torch.distributed.group.WORLD)
    _raises(RuntimeError, "disagree on the num_max_session_bytes", lambda: buf.agrs_set_config(1024 + 32 * rank, 2))
    buf.agrs_set_config(1024, 2)
    buf.create_agrs_session()
    mine = torch.zeros((rank + 1, 2), dtype=torch.float32, device="cpu")
    _raises(RuntimeError, "disagree on the size in bytes of all_gather", lambda: buf.all_gather(mine))
    same_size = torch.zeros(2, dtype=torch.float32 if rank else torch.int32, device="cpu")
    _raises(RuntimeError, "disagree on the tensor shapes and dtypes", lambda: buf.all_gather(same_size))
    # nothing moved: the session goes on
    gathered, handle = buf.all_gather(torch.full((2,), rank, dtype=torch.int32, device="cpu"))
    handle()
    assert gathered.tolist() == [[peer, peer] for peer in range(num_ranks)]
    # rank 0 gathers, the others reduce-scatter: every rank raises, naming each rank's operation; nothing moved
    rows = torch.ones((num_ranks, 1), dtype=torch.float32, device="cpu")
    others = ", ".join(f"rank {peer} at call #6 (reduce_scatter)" for peer in range(1, num_ranks))
    _raises(RuntimeError, re.escape(f"different operations (rank 0 at call #6 (all_gather), {others})"),
            lambda: buf.all_gather(rows) if rank == 0 else buf.reduce_scatter(rows))
    # a call refused on the other ranks counts there: the ranks are at different calls, the buffer is broken
    if rank:
        _raises(TypeError, "t must be a tensor", lambda: buf.all_gather(3))
    _raises(RuntimeError, "different calls", lambda: buf.all_gather(rows))
    _raises(RuntimeError, "no longer communicate", lambda: buf.all_gather(rows))
    _raises(RuntimeError, "no longer communicate", buf.destroy_agrs_session)
    assert buf._window_use.holder is None   # the session ended all the same
    return True


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_ranks_that_disagree_raise_together(tmp_path, num_ranks):
    run_gloo_ranks(_disagreement_body, num_ranks, tmp_path, deadline=120)


def _caller_defaults_body(rank, num_ranks, device):
    """A session run under DeepEP's harness defaults (bf16 default dtype, maybe a default device)."""
    inputs = [_tensor((3, peer), (2, 7), torch.float32) for peer in range(num_ranks)]
    grads = [_tensor((4, peer), (num_ranks * 3, 5), torch.bfloat16) for peer in range(num_ranks)]
    with caller_defaults(torch.bfloat16, device):
        buf = deep_ep.ElasticBuffer(torch.distributed.group.WORLD)
        buf.agrs_set_config(deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(
            torch.distributed.group.WORLD, [(2, 7), (3, 5)], torch.float32), 2)
        with buf.agrs_new_session():
            slot = buf.agrs_get_inplace_tensor((2, 7), torch.float32)
            slot.copy_(inputs[rank])
            gathered, gather_handle = buf.all_gather(slot)
            reduced, reduce_handle = buf.reduce_scatter(grads[rank])
            reduce_handle()
            gather_handle()
            gathered = gathered.clone()
        buf.destroy()
    assert torch.equal(gathered, torch.stack(inputs))
    assert torch.equal(reduced, _reduce_reference(grads, rank, False))
    return True


@pytest.mark.parametrize("device", [None, "meta"])
def test_sessions_under_caller_defaults(tmp_path, device):
    run_gloo_ranks(_caller_defaults_body, 2, tmp_path, device, deadline=120)


class _OtherBackend:
    device = torch.device("cuda", 0)


def test_other_backends_refuse_every_method():
    buf = object.__new__(deep_ep.ElasticBuffer)   # a backend neither CPU nor GPU, as the AGRS methods see it
    buf._destroyed, buf._backend = False, _OtherBackend()
    tensor = torch.ones(4, dtype=torch.float32, device="cpu")
    calls = {"agrs_set_config": lambda: buf.agrs_set_config(1024, 2),
             "create_agrs_session": buf.create_agrs_session,
             "destroy_agrs_session": buf.destroy_agrs_session,
             "agrs_new_session": lambda: buf.agrs_new_session(enabled=False).__enter__(),
             "agrs_get_inplace_tensor": lambda: buf.agrs_get_inplace_tensor((4,), torch.float32),
             "all_gather": lambda: buf.all_gather(tensor),
             "reduce_scatter": lambda: buf.reduce_scatter(tensor)}
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=rf"ElasticBuffer\.{name}: .*_OtherBackend.*GPU buffers"):
            call()
    buf._destroyed = True
