"""Engram remote-memory fetch on GPU buffers: a one-rank NCCL group and 2, 4 and 8 ranks emulated on
one device, the shards in the windows (``storage_location="device"``, the default) and in pinned host
memory (``"host"``). Every rank draws every rank's shard from the case's seed, so it knows the whole table;
each rank writes a fresh random shard (random bits: bf16, FP8 with float32 or packed int32 factors,
row sizes on the kernel's 16-byte, 4-byte and byte paths), fetches its own shapes with outputs
poisoned, and compares every element's bits (and the factors' strides, in both layouts) with
`engram_fetch_reference` over the whole table. Also: repeated fetches and a second write replacing
the table, the hook (the current stream waits for the gather; a second call returns the same
tensors), out-of-range indices found on the GPU (zeroed rows, raised by the next fetch), refusals
before any launch, ranks that disagree (the old table stays), dispatch writing beside the table
without touching it, a host shard holding the written bytes and outliving its owner's buffer while a
peer still fetches from it (emulated nodes refusing: tests/gpu/test_gpu_primitives_across_nodes.py). Hosts
read results only after `deep_ep.emulated.wait_for_stream`. Run by
``EXTRA_FILES=tests/gpu/test_gpu_engram.py bash tools/device_suite.sh extra``; across processes (host
shards shared through the driver, 2 or more GPUs) by ``torchrun --nproc-per-node 2
tests/gpu/test_gpu_engram.py``.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402
from deep_ep.primitives.engram import engram_fetch_reference  # noqa: E402
from gpu_cases import case_seed, to_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", 0)
TIMEOUT = 120
NUM_ENTRIES = 40
NUM_PER_TOKEN = 3
MAX_TOKENS = 16
#: (name, storage dtype, hidden, sf dtype, packs per entry): rows of 384, 66, 384, 1024 and 100 bytes
FORMATS = (("bf16", torch.bfloat16, 192, None, 0), ("bf16_odd", torch.bfloat16, 33, None, 0),
           ("fp8", torch.float8_e4m3fn, 384, torch.float32, 3), ("fp8_ue8m0", torch.float8_e4m3fn, 1024, torch.int32, 2),
           ("fp8_narrow", torch.float8_e4m3fn, 100, torch.float32, 1))


def _wait(stream=None):
    from deep_ep.emulated import wait_for_stream
    wait_for_stream(stream, timeout_secs=TIMEOUT)


def _run(num_ranks, body, *args):
    """``body(group, *args)`` on every rank: a one-rank NCCL group, or emulated ranks; results by rank."""
    if num_ranks == 1:
        from deep_ep.bench.gpu_timing import single_rank_nccl_group
        return [body(single_rank_nccl_group(DEVICE), *args)]
    from deep_ep.emulated import EmulatedGroup
    return EmulatedGroup(num_ranks, device=DEVICE).run(body, *args)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _random_bits(shape, dtype, generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def _table(fmt, seed: int, num_ranks: int, num_entries: int = NUM_ENTRIES) -> tuple:
    """Every rank's shard ``[num_ranks * num_entries, hidden]`` and the replicated factors (or None)."""
    _, dtype, hidden, sf_dtype, packs = fmt
    generator = torch.Generator().manual_seed(seed)
    table = _random_bits((num_ranks * num_entries, hidden), dtype, generator)
    sf_table = None if sf_dtype is None else _random_bits((num_ranks * num_entries, packs), sf_dtype, generator)
    return table, sf_table


def _indices(num_tokens: int, num_total: int, seed: int, num_entries: int = NUM_ENTRIES) -> torch.Tensor:
    """int32 ``[num_tokens, NUM_PER_TOKEN]``: random entries, the table's first and last and every shard
    boundary first."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, num_total, (num_tokens, NUM_PER_TOKEN), generator=generator, dtype=torch.int32)
    edges = sorted({0, num_total - 1} | {b + d for b in range(0, num_total, num_entries) for d in (-1, 0)
                                         if 0 <= b + d < num_total})
    flat = indices.view(-1)
    flat[:min(len(edges), flat.numel())] = torch.tensor(edges, dtype=torch.int32)[:flat.numel()]
    return indices


def _check(result, table, sf_table, indices, col_major, where):
    """Every element of a fetch's ``(data, sf)`` (on the device, its stream waited for) against the
    reference: bits, shapes, dtypes, the factors' strides."""
    data, sf = to_cpu(result[0]), to_cpu(result[1])
    want_data, want_sf = engram_fetch_reference(table, sf_table, indices, col_major)
    assert data.shape == want_data.shape and data.dtype == table.dtype, where
    assert torch.equal(_bits(data), _bits(want_data)), where
    if sf_table is None:
        assert sf is None, where
        return
    assert sf.shape == want_sf.shape and sf.dtype == sf_table.dtype, where
    assert sf.stride() == want_sf.stride(), where
    assert torch.equal(_bits(sf), _bits(want_sf)), where


def _sizes(num_entries: int = NUM_ENTRIES) -> tuple:
    """``(num_bytes, num_cpu_bytes)`` for every format of `FORMATS`."""
    hints = [deep_ep.ElasticBuffer.get_engram_storage_size_hint(num_entries, hidden, MAX_TOKENS * NUM_PER_TOKEN,
                                                                 dtype) for _, dtype, hidden, _, _ in FORMATS]
    gpu_bytes, cpu_bytes = max(h[0] for h in hints), max(h[1] for h in hints)
    return gpu_bytes + cpu_bytes, cpu_bytes


def _buffer(group, num_bytes, num_cpu_bytes, **kwargs):
    return deep_ep.ElasticBuffer(group, num_bytes=num_bytes, num_cpu_bytes=num_cpu_bytes, explicitly_destroy=True,
                                 num_cpu_timeout_secs=TIMEOUT, **kwargs)


def _write(buf, fmt, seed, rank, num_ranks, num_entries: int = NUM_ENTRIES, location: str = "host") -> tuple:
    """Write this rank's shard of a fresh table in ``location``; the device copies passed are spoiled
    afterwards (the table is a copy). Returns the whole table (CPU)."""
    table, sf_table = _table(fmt, seed, num_ranks, num_entries)
    storage = table[rank * num_entries:(rank + 1) * num_entries].to(DEVICE, copy=True)
    sf = None if sf_table is None else sf_table.to(DEVICE, copy=True)
    buf.engram_write(storage, sf=sf, storage_location=location)
    storage.view(torch.uint8).fill_(0xAB)
    if sf is not None:
        sf.view(torch.uint8).fill_(0xCD)
    return table, sf_table


def _fetch_body(group, location):
    rank, num_ranks = group.rank(), group.size()
    buf = _buffer(group, *_sizes())
    num_total = num_ranks * NUM_ENTRIES
    checked = 0
    try:
        for position, fmt in enumerate(FORMATS):
            for write_round in range(2):   # the second write replaces the table
                seed = case_seed("engram fetch", num_ranks, fmt[0], write_round)
                table, sf_table = _write(buf, fmt, seed, rank, num_ranks, location=location)
                pending = []
                for repeat in range(3):
                    num_tokens = 1 + (5 * rank + 7 * repeat + position) % MAX_TOKENS   # shapes differ by rank
                    indices = _indices(num_tokens, num_total, seed + 97 * rank + repeat)
                    on_device = indices.to(DEVICE)
                    for col_major in ((False, True) if sf_table is not None else (False,)):
                        with outputs.poisoned():
                            hook = buf.engram_fetch(on_device, use_tma_aligned_col_major_sf=col_major)
                        result = hook()
                        again = hook()
                        assert again[0] is result[0] and again[1] is result[1]
                        where = (f"rank {rank} {location} {fmt[0]} write {write_round} fetch {repeat} "
                                 f"col_major={col_major}")
                        pending.append((result, indices, col_major, where))
                _wait()
                for result, indices, col_major, where in pending:
                    _check(result, table, sf_table, indices, col_major, where)
                    checked += 1
        return checked
    finally:
        buf.destroy()


@pytest.mark.parametrize("location", ["host", "device"])
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_fetch_matches_the_table(num_ranks, location):
    fetches = 3 * 2 * sum(2 if fmt[3] is not None else 1 for fmt in FORMATS)
    assert _run(num_ranks, _fetch_body, location) == [fetches] * num_ranks


def _stream_body(group):
    """The gather queues behind a sleep on a side stream; the hook, called on a third stream, makes
    that stream wait: a copy queued there after it sees the entries, not the poison."""
    rank, num_ranks = group.rank(), group.size()
    buf = _buffer(group, *_sizes())
    try:
        table, _ = _write(buf, FORMATS[0], case_seed("engram streams", num_ranks), rank, num_ranks)
        indices = _indices(MAX_TOKENS, num_ranks * NUM_ENTRIES, 11 + rank)
        on_device = indices.to(DEVICE)
        fetching, consuming = torch.cuda.Stream(DEVICE), torch.cuda.Stream(DEVICE)
        _wait()
        with torch.cuda.stream(fetching):
            torch.cuda._sleep(300_000_000)   # about 0.15 s at H200 clocks
            with outputs.poisoned():
                hook = buf.engram_fetch(on_device)
        with torch.cuda.stream(consuming):
            data, _ = hook()
            copy = data.clone()
        _wait(consuming)
        _wait(fetching)
        _check((copy, None), table, None, indices, False, f"rank {rank}")
    finally:
        buf.destroy()


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_the_hook_orders_the_current_stream_after_the_gather(num_ranks):
    _run(num_ranks, _stream_body)


def _expect(error, match, fn, *args, **kwargs):
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


def _refusals_body(group, location):
    rank, num_ranks = group.rank(), group.size()
    num_bytes, num_cpu_bytes = _sizes()
    buf = _buffer(group, num_bytes, num_cpu_bytes)
    num_total = num_ranks * NUM_ENTRIES
    fmt = FORMATS[2]   # FP8 with float32 factors
    try:
        good = _indices(4, num_total, 5 + rank)
        on_device = good.to(DEVICE)
        _expect(RuntimeError, "call engram_write", buf.engram_fetch, on_device)
        table, sf_table = _table(fmt, case_seed("engram refusals", num_ranks), num_ranks)
        storage = table[rank * NUM_ENTRIES:(rank + 1) * NUM_ENTRIES].to(DEVICE, copy=True)
        sf = sf_table.to(DEVICE, copy=True)
        bf16 = _random_bits((NUM_ENTRIES, 256), torch.bfloat16, torch.Generator().manual_seed(rank)).to(DEVICE)
        # engram_write: refused on every rank alike, before any communication
        for args, kind, text in (((storage,), ValueError, "FP8 storage needs sf"),
                                 ((bf16, sf), ValueError, "sf is for FP8 storage only"),
                                 ((storage, sf[:-1]), ValueError, "sf must have shape"),
                                 ((storage, sf.double()), TypeError, "sf must have dtype"),
                                 ((storage.cpu(), sf), ValueError, "storage must be on cuda"),
                                 ((bf16.float(),), TypeError, "storage must have dtype"),
                                 ((bf16.t(),), ValueError, "contiguous"),
                                 ((torch.zeros(num_cpu_bytes // 512 + 1, 256, dtype=torch.bfloat16, device=DEVICE),),
                                  ValueError, "more than the buffer's num_cpu_bytes")):
            _expect(kind, text, buf.engram_write, *args, storage_location=location)
        _expect(ValueError, "storage_location must be one of", buf.engram_write, storage, sf, storage_location="gpu")
        _expect(TypeError, "storage_location must be a str", buf.engram_write, storage, sf, storage_location=None)
        buf.engram_write(storage, sf=sf, storage_location=location)
        # engram_fetch: refused before any launch, the window left free
        for bad, kind, text, kwargs in ((on_device.long(), TypeError, "dtype int32", {}),
                                        (on_device.view(-1), ValueError, "shape", {}),
                                        (on_device.t(), ValueError, "contiguous", {}),
                                        (good, ValueError, "must be on cuda", {}),
                                        (torch.zeros(num_bytes // 384 + 1, 1, dtype=torch.int32, device=DEVICE),
                                         ValueError, "receive area", {}),
                                        (on_device, TypeError, "num_qps", {"num_qps": 1.5}),
                                        (on_device, TypeError, "use_tma_aligned_col_major_sf",
                                         {"use_tma_aligned_col_major_sf": "yes"})):
            _expect(kind, text, buf.engram_fetch, bad, **kwargs)
        assert buf._window_use.holder is None
        # the window: a second fetch before the hook is refused, and so is a dispatch
        hook = buf.engram_fetch(on_device)
        _expect(RuntimeError, "earlier fetch's hook has not been called", buf.engram_fetch, on_device)
        _expect(RuntimeError, "dispatch cannot use the buffer's window while engram holds it", buf.dispatch,
                torch.zeros((2, 128), dtype=torch.bfloat16, device=DEVICE),
                torch.zeros((2, 1), dtype=torch.int64, device=DEVICE), num_experts=num_ranks)
        first = hook()
        # out of range: found on the GPU, the row zeroed, raised by the next fetch, then gone
        for bad_value in (num_total, -1, 2 ** 31 - 1):
            bad = good.clone()
            bad[2, 1] = bad_value
            with outputs.poisoned():
                result = buf.engram_fetch(bad.to(DEVICE), use_tma_aligned_col_major_sf=True)()
            _wait()
            want = engram_fetch_reference(table, sf_table, good, True)
            data, got_sf = to_cpu(result[0]), to_cpu(result[1])
            hidden, packs = fmt[2], fmt[4]
            zeroed = data.view(4, NUM_PER_TOKEN, hidden)[2, 1]
            assert (_bits(zeroed) == 0).all() and (_bits(got_sf[2, packs:2 * packs]) == 0).all()
            data.view(4, NUM_PER_TOKEN, hidden)[2, 1] = want[0].view(4, NUM_PER_TOKEN, hidden)[2, 1]
            got_sf[2, packs:2 * packs] = want[1][2, packs:2 * packs]
            _check((data, got_sf), table, sf_table, good, True, f"rank {rank} around entry {bad_value}")
            _expect(ValueError, rf"entry {bad_value} at flat position {2 * NUM_PER_TOKEN + 1} .*\[0, {num_total}\)",
                    buf.engram_fetch, on_device)
            result = buf.engram_fetch(on_device)()
            _wait()
            _check(result, table, sf_table, good, False, f"rank {rank} after {bad_value}")
        _wait()
        _check(first, table, sf_table, good, False, f"rank {rank} first")
        if num_ranks > 1:
            # ranks that disagree: the same RuntimeError on every rank, and the old table stays
            _expect(RuntimeError, r"ranks disagree on hidden: per-rank values \[128, 256",
                    buf.engram_write, bf16[:, :128 * (rank + 1)].contiguous(), storage_location=location)
            _expect(RuntimeError, "ranks disagree on the values of sf", buf.engram_write, storage, sf + rank,
                    storage_location=location)
            _expect(RuntimeError, "ranks disagree on num_entries", buf.engram_write, storage[:NUM_ENTRIES - rank],
                    sf[:num_ranks * (NUM_ENTRIES - rank)], storage_location=location)
            _expect(RuntimeError, r"ranks disagree on storage_location .*per-rank values \[1, 0",
                    buf.engram_write, storage, sf, storage_location=("host", "device")[rank % 2])
            result = buf.engram_fetch(on_device)()
            _wait()
            _check(result, table, sf_table, good, False, f"rank {rank} after the refused writes")
        buf.barrier()
    finally:
        buf.destroy()
    # a window with no room before the storage (no receive area): refused before any communication
    small = _buffer(group, num_cpu_bytes, num_cpu_bytes)
    try:
        _expect(ValueError, "bytes of window before the storage", small.engram_write, bf16)
        small.barrier()
    finally:
        small.destroy()


@pytest.mark.parametrize("location", ["host", "device"])
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_bad_input_is_refused(num_ranks, location):
    _run(num_ranks, _refusals_body, location)


def _dispatch_body(group):
    """A buffer for dispatch and Engram (DeepEP's sizing: the storage's bytes added to num_bytes): two
    dispatches (both receive halves) between fetches of every entry of every shard leave the table
    intact. The storage is about as large as the rest of the window, so rows laid out over the whole
    window would land in it."""
    rank, num_ranks = group.rank(), group.size()
    num_entries, hidden, num_tokens, num_per_token = 16384, 128, 8, 4
    fmt = ("bf16", torch.bfloat16, hidden, None, 0)
    num_total = num_ranks * num_entries
    gpu_bytes, cpu_bytes = deep_ep.ElasticBuffer.get_engram_storage_size_hint(num_entries, hidden, num_total)
    dispatch_bytes = deep_ep.ElasticBuffer.get_buffer_size_hint(group, num_tokens, hidden, 1)
    buf = _buffer(group, dispatch_bytes + gpu_bytes + cpu_bytes, cpu_bytes)
    x = torch.full((num_tokens, hidden), float(rank + 1), dtype=torch.bfloat16, device=DEVICE)
    topk_idx = (torch.arange(num_tokens, dtype=torch.int64, device=DEVICE) % num_ranks).view(num_tokens, 1)
    try:
        table, _ = _write(buf, fmt, case_seed("engram dispatch", num_ranks), rank, num_ranks, num_entries,
                          location="device")
        generator = torch.Generator().manual_seed(rank)
        indices = torch.randperm(num_total, generator=generator).to(torch.int32).view(-1, num_per_token)
        on_device = indices.to(DEVICE)
        _wait()
        results = [buf.engram_fetch(on_device)()]
        for _ in range(2):
            recv_x, *_ = buf.dispatch(x, topk_idx, num_experts=num_ranks)
            results.append(buf.engram_fetch(on_device)())
        _wait()
        assert recv_x.shape[1] == hidden and recv_x.shape[0] > 0
        for position, result in enumerate(results):
            _check(result, table, None, indices, False, f"rank {rank} fetch {position}")
    finally:
        buf.destroy()


def test_dispatch_leaves_the_table_alone():
    """Two emulated ranks: a rank alone stages no rows in its window, so one rank proves nothing. The
    shards in the windows: the case where rows could land in them."""
    _run(2, _dispatch_body)


def _host_shard_body(group):
    """Each rank's host shard holds its written bytes (read on the host); rank 0 destroys its buffer
    first and rank 1 then fetches every entry, rank 0's included, before destroying its own."""
    import ctypes
    rank, num_ranks = group.rank(), group.size()
    buf = _buffer(group, *_sizes())
    fmt = FORMATS[3]   # FP8 with packed UE8M0 factors
    try:
        table, sf_table = _write(buf, fmt, case_seed("engram host shard", num_ranks), rank, num_ranks)
        shard = buf._engram.host_shard
        mine = table[rank * NUM_ENTRIES:(rank + 1) * NUM_ENTRIES].contiguous()
        written = ctypes.string_at(shard.memory.host_ptr, mine.numel() * mine.element_size())
        assert written == bytes(mine.view(torch.uint8).numpy()), f"rank {rank}: the host shard's bytes"
        indices = torch.arange(num_ranks * NUM_ENTRIES, dtype=torch.int32).view(-1, 4)
        on_device = indices.to(DEVICE)
        if rank == 0:
            buf.destroy()
        group.barrier()
        if rank != 0:
            with outputs.poisoned():
                result = buf.engram_fetch(on_device, use_tma_aligned_col_major_sf=True)()
            _wait()
            _check(result, table, sf_table, indices, True, f"rank {rank} after rank 0's destroy")
    finally:
        buf.destroy()


def test_a_host_shard_holds_the_bytes_and_outlives_its_owner():
    _run(2, _host_shard_body)


def _main() -> None:
    """One process per GPU, the NCCL world group: host shards shared across processes (the driver's
    virtual memory API) and device shards, every fetch case and the refusals. Run by
    ``torchrun --nproc-per-node 2 tests/gpu/test_gpu_engram.py`` (2 or more GPUs)."""
    global DEVICE
    import torch.distributed as dist
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl", device_id=DEVICE)
    group = dist.group.WORLD
    fetches = 3 * 2 * sum(2 if fmt[3] is not None else 1 for fmt in FORMATS)
    try:
        for location in ("host", "device"):
            assert _fetch_body(group, location) == fetches
            _refusals_body(group, location)
            print(f"rank {group.rank()} of {group.size()}: Engram storage in {location} memory passed", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
