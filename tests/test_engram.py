"""Engram remote-memory fetch on the CPU backend (gloo, 2 and 4 spawned ranks), re-deriving the checks
of DeepEP's tests/elastic/test_engram.py: each rank writes a fresh random shard, the whole table is
all-gathered with plain torch.distributed, and every fetched element (data bits, and for FP8 the
factors of both kinds in both layouts, strides included) is compared with the table's rows, outputs
poisoned. Also: the size hint's numbers, out-of-range and other refusals before anything moves, the
window held between a fetch and its hook (dispatch refused), one-sided fetches (one rank fetches while
the others wait in a barrier), ranks that disagree, a group over several hosts, a backend without
Engram refusing every method before any communication, and `destroy` releasing every primitive's
state (the Engram mappings, PP channels, an open AGRS session). GPU buffers: tests/test_engram_gpu.py
(the kernels' build and argument layout), tests/test_engram_gpu_host.py (the host code, kernels stood
in for), both on the CPU, and tests/gpu/test_gpu_engram.py.
"""
import glob
import inspect
import os

import pytest
import torch
import torch.distributed as dist

import deep_ep
from caller_defaults import caller_defaults
from deep_ep.backends import outputs
from deep_ep.bench.fp8 import quantize_fp8
from proc_utils import run_gloo_ranks

MIB2 = 2 * 1024 * 1024
NUM_ENTRIES = 40
NUM_PER_TOKEN = 3
#: (storage format, hidden): bf16; FP8 with float32 factors (hidden / 128 packs); FP8 with UE8M0
#: exponents packed four to an int32 (hidden / 512 packs).
FORMATS = (("bf16", 192), ("fp8", 384), ("fp8_ue8m0", 1024))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _all_gather_rows(t: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Every rank's ``t`` stacked in rank order (moved as bytes: gloo has no FP8)."""
    raw = t.contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(num_ranks)]
    dist.all_gather(parts, raw)
    return torch.cat(parts).view(t.dtype)


def _shard(x_format: str, hidden: int, seed: int) -> tuple:
    """A fresh random shard ``(storage, local sf or None)``."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(NUM_ENTRIES, hidden, generator=gen) * 3).to(torch.bfloat16)
    if x_format == "bf16":
        return values, None
    return quantize_fp8(values, "ue8m0" if x_format == "fp8_ue8m0" else "fp32")


def _indices(num_tokens: int, num_total: int, seed: int) -> torch.Tensor:
    """int32 ``[num_tokens, NUM_PER_TOKEN]`` random entries, the table's first and last, and every
    shard boundary among them."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num_total, (num_tokens, NUM_PER_TOKEN), generator=gen, dtype=torch.int32)
    edges = sorted({0, num_total - 1} | {b + d for b in range(0, num_total, NUM_ENTRIES) for d in (-1, 0)
                                         if 0 <= b + d < num_total})
    flat = idx.view(-1)
    flat[:min(len(edges), flat.numel())] = torch.tensor(edges, dtype=torch.int32)[:flat.numel()]
    return idx


def _expected(table, sf_table, indices, col_major):
    """DeepEP's check, derived directly: the table's rows, token by token."""
    num_tokens = indices.shape[0]
    data = table[indices.view(-1).long()].reshape(num_tokens, -1)
    sf = None if sf_table is None else sf_table[indices.view(-1).long()].reshape(num_tokens, -1)
    return data, sf


def _check_fetch(buffer, table, sf_table, indices, col_major):
    with outputs.poisoned():
        hook = buffer.engram_fetch(indices, use_tma_aligned_col_major_sf=col_major)
    data, sf = hook()
    want_data, want_sf = _expected(table, sf_table, indices, col_major)
    num_tokens = indices.shape[0]
    assert data.shape == (num_tokens, NUM_PER_TOKEN * table.shape[1]) and data.dtype == table.dtype
    assert torch.equal(_bits(data), _bits(want_data))
    if sf_table is None:
        assert sf is None
        return
    columns = NUM_PER_TOKEN * sf_table.shape[1]
    assert sf.shape == (num_tokens, columns) and sf.dtype == sf_table.dtype
    strides = (1, (num_tokens + 3) // 4 * 4) if col_major else (columns, 1)
    assert sf.stride() == strides
    assert torch.equal(sf, want_sf)
    reference = deep_ep.primitives.engram.engram_fetch_reference(table, sf_table, indices, col_major)
    assert torch.equal(_bits(reference[0]), _bits(data)) and torch.equal(reference[1], sf)
    assert reference[1].stride() == sf.stride()
    again = hook()
    assert again[0] is data and again[1] is sf


def _tiny_dispatch(buffer, rank, num_ranks):
    """A real dispatch (collective): it works only while the window is free."""
    x = torch.full((4, 128), float(rank + 1), dtype=torch.bfloat16)
    topk = torch.arange(8, dtype=torch.int64).view(4, 2) % (2 * num_ranks)   # every rank gets rows
    recv_x, *_ = buffer.dispatch(x, topk_idx=topk, num_experts=2 * num_ranks)
    assert recv_x.shape[1] == 128 and recv_x.shape[0] > 0


def _fetch_ranks(rank, num_ranks, round_seed, under_defaults):
    shm_files = f"/dev/shm/deep_ep-engram-{os.getpid()}-*"
    for position, (x_format, hidden) in enumerate(FORMATS):
        dtype = torch.bfloat16 if x_format == "bf16" else torch.float8_e4m3fn
        num_tokens = 5 + rank                  # ranks fetch different shapes
        gpu_bytes, cpu_bytes = deep_ep.ElasticBuffer.get_engram_storage_size_hint(
            NUM_ENTRIES, hidden, 16 * NUM_PER_TOKEN, dtype)
        buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_bytes=gpu_bytes + cpu_bytes, num_cpu_bytes=cpu_bytes,
                                       explicitly_destroy=True)
        num_total = num_ranks * NUM_ENTRIES
        for write_round in range(2):           # a second write replaces the table
            seed = 1000 * round_seed + 100 * position + 10 * write_round
            storage, local_sf = _shard(x_format, hidden, seed + rank)
            table = _all_gather_rows(storage, num_ranks)
            sf_table = None if local_sf is None else _all_gather_rows(local_sf, num_ranks)
            if under_defaults:   # DeepEP's harness: its defaults, and inference mode
                with caller_defaults(torch.bfloat16, "meta"), torch.inference_mode():
                    buffer.engram_write(storage, sf=sf_table)
            else:
                buffer.engram_write(storage, sf=sf_table)
            assert not glob.glob(shm_files), "engram_write left its segment in /dev/shm"
            storage.view(torch.uint8).fill_(0xAB)    # the table is a copy
            indices = _indices(num_tokens, num_total, seed + 7 * rank + 1)
            for col_major in ((False, True) if local_sf is not None else (False,)):
                if under_defaults:
                    with caller_defaults(torch.bfloat16, "meta"), torch.inference_mode():
                        _check_fetch(buffer, table, sf_table, indices, col_major)
                else:
                    _check_fetch(buffer, table, sf_table, indices, col_major)

        # The window: held from the fetch to its hook; dispatch and a second fetch refused meanwhile.
        hook = buffer.engram_fetch(indices)
        with pytest.raises(RuntimeError, match="dispatch cannot use the buffer's window while engram holds it"):
            _tiny_dispatch(buffer, rank, num_ranks)
        with pytest.raises(RuntimeError, match="earlier fetch's hook has not been called"):
            buffer.engram_fetch(indices)
        hook()
        _tiny_dispatch(buffer, rank, num_ranks)

        # Refusals, before anything is read; none of them holds the window.
        for bad, kind, text in ((indices.clone().fill_(num_total), ValueError, f"entry {num_total} at"),
                                (indices.clone().fill_(-1), ValueError, r"entry -1 at \[0, 0\]"),
                                (indices.long(), TypeError, "dtype int32"),
                                (indices.view(-1), ValueError, "shape"),
                                (indices.t(), ValueError, "contiguous"),
                                (torch.zeros(gpu_bytes // (hidden * dtype.itemsize) + 1, 1, dtype=torch.int32),
                                 ValueError, "receive area")):
            with pytest.raises(kind, match=text):
                buffer.engram_fetch(bad)
        assert buffer._window_use.holder is None
        with pytest.raises(TypeError, match="num_qps"):
            buffer.engram_fetch(indices, num_qps=1.5)
        _tiny_dispatch(buffer, rank, num_ranks)

        # One-sided: only the last rank fetches; the others wait in a barrier meanwhile.
        if rank == num_ranks - 1:
            for _ in range(3):
                _check_fetch(buffer, table, sf_table, _indices(2, num_total, seed + 3), False)
        buffer.barrier()
        buffer.destroy()
    return True


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_engram_fetch(num_ranks, tmp_path):
    results = run_gloo_ranks(_fetch_ranks, num_ranks, tmp_path, num_ranks, num_ranks == 2, deadline=240)
    assert results == {rank: True for rank in range(num_ranks)}


def _write_refusals(rank, num_ranks):
    _, cpu_bytes = deep_ep.ElasticBuffer.get_engram_storage_size_hint(NUM_ENTRIES, 256, 0)
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_bytes=cpu_bytes, explicitly_destroy=True)
    storage, sf = _shard("fp8", 256, rank)
    sf_table = _all_gather_rows(sf, num_ranks)
    bf16 = storage.float().to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="call engram_write"):
        buffer.engram_fetch(torch.zeros(1, 1, dtype=torch.int32))
    # Refused on every rank alike, before any communication (the call counts stay in step).
    for args, kind, text in (((storage,), ValueError, "FP8 storage needs sf"),
                             ((bf16, sf_table), ValueError, "sf is for FP8 storage only"),
                             ((storage, sf), ValueError, "sf must have shape"),
                             ((storage, sf_table.double()), TypeError, "sf must have dtype"),
                             ((storage.float(),), TypeError, "storage must have dtype"),
                             ((bf16.t(),), ValueError, "contiguous"),
                             ((torch.zeros(0, 8, dtype=torch.bfloat16),), ValueError, "at least one entry"),
                             ((torch.zeros(cpu_bytes // 512 + 1, 256, dtype=torch.bfloat16),), ValueError,
                              "more than the buffer's num_cpu_bytes")):
        with pytest.raises(kind, match=text):
            buffer.engram_write(*args)
    for bad, kind in (("gpu", ValueError), (0, TypeError)):
        with pytest.raises(kind, match="storage_location must"):
            buffer.engram_write(bf16, storage_location=bad)
    # Ranks that disagree: the same RuntimeError on every rank; the buffer stays usable.
    with pytest.raises(RuntimeError, match=r"ranks disagree on hidden: per-rank values \[128, 256"):
        buffer.engram_write(bf16[:, :128 * (rank + 1)].contiguous())
    with pytest.raises(RuntimeError, match="ranks disagree on num_entries"):
        buffer.engram_write(bf16[:NUM_ENTRIES - rank])
    with pytest.raises(RuntimeError, match="ranks disagree on storage format"):
        buffer.engram_write(*((storage, sf_table) if rank == 0 else (bf16,)))
    with pytest.raises(RuntimeError, match="ranks disagree on the values of sf"):
        buffer.engram_write(storage, sf_table + rank)
    buffer.engram_write(bf16, storage_location="device")   # host memory all the same on the CPU backend
    table = _all_gather_rows(bf16, num_ranks)
    _check_fetch(buffer, table, None, _indices(3, num_ranks * NUM_ENTRIES, 5), False)
    # A rank that cannot create its segment, or cannot map a peer's (faked): every rank raises, no
    # file is left behind, and the buffer stays usable.
    import deep_ep.backends.cpu.engram as cpu_engram
    shm_dir, map_segment = cpu_engram.SHM_DIR, cpu_engram._map
    if rank == 1:
        cpu_engram.SHM_DIR = "/nonexistent-shm-dir"
    with pytest.raises(RuntimeError, match=r"failed on rank\(s\) \[1\]: could not create a shared-memory segment"):
        buffer.engram_write(bf16)
    cpu_engram.SHM_DIR = shm_dir

    def unreachable(path, num_bytes):   # this rank's own segment only
        if not path.endswith(f"-rank{rank}"):
            raise FileNotFoundError(path)
        return map_segment(path, num_bytes)
    if rank == 0:
        cpu_engram._map = unreachable
    with pytest.raises(NotImplementedError, match=r"failed on rank\(s\) \[0\]: could not map a peer's segment"):
        buffer.engram_write(bf16 + 1)
    cpu_engram._map = map_segment
    assert not glob.glob(f"/dev/shm/deep_ep-engram-{os.getpid()}-*")
    _check_fetch(buffer, table, None, _indices(3, num_ranks * NUM_ENTRIES, 6), False)
    buffer.engram_write(bf16)
    # A group over several hosts (faked): refused on every rank.
    cpu_engram.host_identity = lambda: f"host-{rank % 2}"
    with pytest.raises(NotImplementedError, match=r"one host.*2 hosts: \[\[0\], \[1\]\]"):
        buffer.engram_write(bf16)
    buffer.barrier()
    buffer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.engram_write(bf16)
    return True


def test_engram_write_refusals(tmp_path):
    assert run_gloo_ranks(_write_refusals, 2, tmp_path, deadline=120) == {0: True, 1: True}


def _mapped_segments() -> list:
    """This process's mappings of Engram shared-memory segments (/proc/self/maps lines)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "deep_ep-engram-" in line]


def _destroy_releases(rank, num_ranks):
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_bytes=MIB2, num_cpu_timeout_secs=30,
                                   explicitly_destroy=True)
    assert not _mapped_segments()
    buffer.engram_write(torch.full((8, 64), rank + 1, dtype=torch.bfloat16))
    indices = torch.tensor([[8 * peer for peer in range(num_ranks)]], dtype=torch.int32)
    data, _ = buffer.engram_fetch(indices)()
    buffer.pp_set_config(64, 2)
    buffer.agrs_set_config(1024, 2)
    buffer.create_agrs_session()   # left open: destroy ends it
    gathered, handle = buffer.all_gather(torch.full((2,), rank + 1, dtype=torch.int32))
    handle()
    session = buffer._agrs_session
    mapped_before = len(_mapped_segments())
    buffer.destroy()
    released = {"mapped after": len(_mapped_segments()), "engram": buffer._engram,
                "pipeline": buffer._pp_pipeline, "session open": session.open, "space": session.space,
                "window": buffer._window_use.holder}
    row = torch.zeros(2, dtype=torch.int32)
    calls = {"engram_write": lambda: buffer.engram_write(torch.zeros((8, 64), dtype=torch.bfloat16)),
             "engram_fetch": lambda: buffer.engram_fetch(indices),
             "pp_set_config": lambda: buffer.pp_set_config(64, 2),
             "pp_send": lambda: buffer.pp_send(row, (rank + 1) % num_ranks),
             "pp_recv": lambda: buffer.pp_recv(row, (rank - 1) % num_ranks),
             "agrs_set_config": lambda: buffer.agrs_set_config(1024, 2),
             "create_agrs_session": buffer.create_agrs_session,
             "all_gather": lambda: buffer.all_gather(row),
             "reduce_scatter": lambda: buffer.reduce_scatter(torch.zeros(num_ranks)),
             "destroy_agrs_session": buffer.destroy_agrs_session}
    refusals = {}
    for name, call in calls.items():
        try:
            call()
            refusals[name] = "no exception"
        except RuntimeError as exc:
            refusals[name] = str(exc)
    return {"data": data[0].tolist(), "gathered": gathered.tolist(), "mapped before": mapped_before,
            "released": released, "refusals": refusals}


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_destroy_releases_every_primitive(num_ranks, tmp_path):
    results = run_gloo_ranks(_destroy_releases, num_ranks, tmp_path, deadline=90)
    for rank, result in results.items():
        assert result["data"] == [float(peer + 1) for peer in range(num_ranks) for _ in range(64)], rank
        assert result["gathered"] == [[peer + 1] * 2 for peer in range(num_ranks)], rank   # outputs outlive destroy
        assert result["mapped before"] == num_ranks, result   # every rank's shard was mapped
        assert result["released"] == {"mapped after": 0, "engram": None, "pipeline": None, "session open": False,
                                      "space": None, "window": None}, result
        for name, message in result["refusals"].items():
            assert "was destroyed; create a new one" in message, (rank, name, message)


@pytest.mark.parametrize("num_entries,hidden,max_tokens,dtype,want", [
    # DeepEP's test defaults: 512 tokens x 24 entries of 128 bf16 values, 524288 entries per rank
    (524288, 128, 512 * 24, torch.bfloat16, (2 * MIB2, 64 * MIB2)),
    (524288, 128, 512 * 24, torch.float8_e4m3fn, (MIB2, 32 * MIB2)),
    (1000, 100, 10, torch.bfloat16, (MIB2, MIB2)),             # 200-byte entries take 224
    (9362, 100, 0, torch.bfloat16, (0, MIB2)),                 # 9362 * 224 bytes fit 2 MiB
    (9363, 100, 0, torch.bfloat16, (0, 2 * MIB2)),             # 9363 * 224 bytes do not
    (0, 0, 0, torch.bfloat16, (0, 0)),
])
def test_storage_size_hint(num_entries, hidden, max_tokens, dtype, want):
    got = deep_ep.ElasticBuffer.get_engram_storage_size_hint(num_entries, hidden, max_tokens, dtype)
    entry = -(-hidden * dtype.itemsize // 32) * 32
    derived = tuple(-(-n * entry // MIB2) * MIB2 for n in (max_tokens, num_entries))
    assert got == derived
    assert got == want


def test_storage_size_hint_refusals():
    hint = deep_ep.ElasticBuffer.get_engram_storage_size_hint
    with pytest.raises(TypeError, match="dtype"):
        hint(10, 128, 4, torch.float32)
    with pytest.raises(ValueError, match="num_entries"):
        hint(-1, 128, 4)
    with pytest.raises(TypeError, match="hidden"):
        hint(10, 128.0, 4)


def test_signatures():
    """DeepEP's names, order and defaults (and engram_write's keyword-only storage_location)."""
    cls = deep_ep.ElasticBuffer
    assert isinstance(inspect.getattr_static(cls, "get_engram_storage_size_hint"), staticmethod)
    expect = {"get_engram_storage_size_hint": [("num_entries", None), ("hidden", None),
                                               ("num_max_tokens_per_rank", None), ("dtype", torch.bfloat16)],
              "engram_write": [("self", None), ("storage", None), ("sf", None), ("storage_location", "device")],
              "engram_fetch": [("self", None), ("indices", None), ("num_qps", 0),
                               ("use_tma_aligned_col_major_sf", False)]}
    for name, params in expect.items():
        got = [(p.name, None if p.default is p.empty else p.default)
               for p in inspect.signature(getattr(cls, name)).parameters.values()]
        assert got == params, name
    extra = inspect.signature(cls.engram_write).parameters["storage_location"]
    assert extra.kind is inspect.Parameter.KEYWORD_ONLY


class _BackendStub:
    """Stands for a backend without Engram: any use of it (a communication) fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the backend was used ({name}) before the refusal")


def test_a_backend_without_engram_refuses_every_method():
    buffer = deep_ep.ElasticBuffer.__new__(deep_ep.ElasticBuffer)
    buffer._destroyed = False
    buffer._backend = _BackendStub()
    storage = torch.zeros(4, 128, dtype=torch.bfloat16)
    for method, args in (("engram_write", (storage,)), ("engram_fetch", (torch.zeros(1, 1, dtype=torch.int32),))):
        with pytest.raises(NotImplementedError, match=rf"ElasticBuffer.{method} .*not implemented for this backend "
                                                      rf"\(_BackendStub\).*GPU buffers and the CPU backend"):
            getattr(buffer, method)(*args)
    buffer._destroyed = True   # nothing to release


def _dropped_hook(rank, num_ranks):
    g, c = deep_ep.ElasticBuffer.get_engram_storage_size_hint(10, 64, 16)
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_bytes=g + c, num_cpu_bytes=c, device="cpu",
                                   num_cpu_timeout_secs=30)
    table = torch.randn(10, 64).to(torch.bfloat16)
    buffer.engram_write(table)
    indices = torch.tensor([[rank * 10 + 3]], dtype=torch.int32)
    kept = buffer.engram_fetch(indices)
    with pytest.raises(RuntimeError, match="an earlier fetch's hook has not been called"):
        buffer.engram_fetch(indices)          # a live hook still holds the window
    with pytest.raises(RuntimeError, match="while engram holds it"):
        _tiny_dispatch(buffer, rank, num_ranks)
    del kept                                  # dropped uncalled: the next use of the buffer ends the hold
    data, _ = buffer.engram_fetch(indices)()
    assert torch.equal(_bits(data), _bits(table[3:4]))
    buffer.engram_fetch(indices)              # dropped at once
    _tiny_dispatch(buffer, rank, num_ranks)   # dispatch and combine go ahead
    buffer.engram_fetch(indices)
    buffer.pp_set_config(64, 1)
    cycle = [buffer.engram_fetch(indices)]
    cycle.append(cycle)                       # dropped, but kept by a reference cycle until a collection
    del cycle
    _tiny_dispatch(buffer, rank, num_ranks)   # the refusal's check collects it first
    buffer.destroy()
    return True


def test_a_dropped_hook_stops_holding_the_window(tmp_path):
    assert run_gloo_ranks(_dropped_hook, 2, tmp_path, deadline=120) == {0: True, 1: True}
