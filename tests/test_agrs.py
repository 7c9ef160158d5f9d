"""All-gather / reduce-scatter sessions (AGRS) of ElasticBuffer on the CPU backend, 2 and 4 gloo ranks.

DeepEP's tests/elastic/test_agrs.py checks re-derived: random sequences of sessions, all-gathers
(batched or not, in place or not) and reduce-scatters, handles waited in random order, every output
compared bit for bit with a reference each rank computes for all ranks from a shared seed (inputs
are fresh random values, the session space is poisoned before each session). Then the refusals (each
raised on every rank), ranks that disagree, the window held against a dispatch, and the GPU refusal.
"""
import random

import pytest
import torch

import deep_ep
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
    for value, hint in ((0, 0), (1, 2 * mib), (2 * mib, 2 * mib), (2 * mib + 1, 4 * mib)):
        assert buffer_class.get_agrs_buffer_size_hint(_Group(2), value) == hint
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
    assert checked > 1000
    buf.destroy()
    return checked


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_stress_matches_reference(tmp_path, num_ranks):
    run_gloo_ranks(_stress_body, num_ranks, tmp_path, (7 * num_ranks, 7 * num_ranks + 1), deadline=300)
