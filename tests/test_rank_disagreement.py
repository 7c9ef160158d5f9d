"""Ranks that disagree about where they are: a rank whose arguments were refused (it raised before
communicating) and then retried is one call ahead of its peers. Every public call counts, refused
ones too, and every exchange carries the call number, so the next exchange raises on every rank a
`RuntimeError` naming the ranks and their call numbers, at once, instead of pairing the peers' call
with the retry (and timing out later). The buffer is then unusable on every rank, and says so.

Ranks in different operations at the same call (one dispatches while another configures PP, say):
every collective call opens with a header of one size naming its operation, so every rank raises
the same `RuntimeError` naming each rank's operation and call number, at once, and the buffer goes
on (nothing moved).

CPU gloo here; the same on GPU ranks (the call number travels with every signal) in
tests/gpu/test_gpu_reliability.py.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import deep_ep
from proc_utils import run_gloo_ranks


def _inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn((16, 64), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)]).to(torch.int64)
    return x, idx, torch.rand((16, 2), generator=g)


def _refused_then_retried(rank: int, world: int, op: str):
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=16, hidden=64, num_topk=2,
                                num_cpu_timeout_secs=60, explicitly_destroy=True)
    x, idx, w = _inputs(rank)
    out = {}
    try:
        handle = buf.dispatch(x, idx, w, num_experts=8)[3]
        if op == "combine":
            y = torch.randn((handle.num_recv_rows, 64)).to(torch.bfloat16)
        if rank == 1:   # one rank's arguments are refused; it fixes them and calls again
            try:
                if op == "dispatch":
                    buf.dispatch(x, idx.to(torch.int32), w, num_experts=8)
                else:
                    buf.combine(y.float(), handle)
            except TypeError as exc:
                out["refused"] = str(exc)
        try:
            if op == "dispatch":
                buf.dispatch(x, idx, w, num_experts=8)
            else:
                buf.combine(y, handle)
        except RuntimeError as exc:
            out["error"] = str(exc)
        try:   # the buffer says it is unusable
            buf.dispatch(x, idx, w, num_experts=8)
        except RuntimeError as exc:
            out["after"] = str(exc)
        return out
    finally:
        buf.destroy()


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_refused_call_counts_and_the_next_exchange_names_the_ranks(op, tmp_path):
    results = run_gloo_ranks(_refused_then_retried, 2, tmp_path, op, deadline=60)
    assert "topk_idx must have dtype" in results[1]["refused"] or "x must have dtype" in results[1]["refused"]
    for rank in (0, 1):
        err = results[rank]["error"]
        assert "ranks are at different calls of this buffer" in err, err
        assert "rank 0 at call #2" in err and "rank 1 at call #3" in err, err
        assert "skipped or repeated" in err
        assert "no longer communicate" in results[rank]["after"]


def _operation(buf, name: str, handle, rank: int):
    """Start collective ``name`` on ``buf`` with valid arguments (``handle``: from a dispatch)."""
    if name == "dispatch":
        x, idx, w = _inputs(rank)
        return buf.dispatch(x, idx, w, num_experts=8)
    if name == "combine":
        return buf.combine(torch.ones((handle.num_recv_rows, 64), dtype=torch.bfloat16), handle)
    if name == "barrier":
        return buf.barrier()
    if name == "pp_set_config":
        return buf.pp_set_config(64, 2)
    if name == "agrs_set_config":
        return buf.agrs_set_config(1024, 2)
    if name == "engram_write":
        return buf.engram_write(torch.full((4, 64), rank, dtype=torch.bfloat16))
    raise AssertionError(name)


def _different_operations(rank: int, world: int, first: str, second: str):
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=16, hidden=64, num_topk=2,
                                num_cpu_bytes=2 * 1024 * 1024, num_cpu_timeout_secs=20, explicitly_destroy=True)
    x, idx, w = _inputs(rank)
    try:
        handle = buf.dispatch(x, idx, w, num_experts=8)[3]   # call #1, together
        start = time.monotonic()
        try:
            _operation(buf, first if rank == 0 else second, handle, rank)   # call #2
            error = None
        except RuntimeError as exc:
            error = str(exc)
        seconds = time.monotonic() - start
        buf.barrier()   # nothing moved: the ranks are still in step
        recv_x = buf.dispatch(x, idx, w, num_experts=8)[0]
        return {"error": error, "seconds": seconds, "rows after": recv_x.shape[0],
                "rows expected": handle.num_recv_rows}
    finally:
        buf.destroy()


@pytest.mark.parametrize("first,second", [("dispatch", "pp_set_config"), ("dispatch", "agrs_set_config"),
                                          ("combine", "engram_write"), ("pp_set_config", "agrs_set_config"),
                                          ("barrier", "dispatch"), ("engram_write", "barrier")])
def test_ranks_in_different_operations_raise_together_naming_them(first, second, tmp_path):
    results = run_gloo_ranks(_different_operations, 2, tmp_path, first, second, deadline=60)
    errors = {rank: results[rank]["error"] for rank in (0, 1)}
    for rank in (0, 1):
        err = errors[rank]
        assert err is not None, f"rank {rank} did not raise"
        assert f"rank {rank} of 2" in err, err
        assert f"ranks called different operations (rank 0 at call #2 ({first}), rank 1 at call #2 ({second}))" \
            in err, err
        assert results[rank]["seconds"] < 10, results[rank]   # at once, not after a timeout
        assert results[rank]["rows after"] == results[rank]["rows expected"] > 0, results[rank]
    assert errors[0].replace("rank 0 of 2", "") == errors[1].replace("rank 1 of 2", "")
