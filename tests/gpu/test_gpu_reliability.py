"""GPU reliability: a rank that skips a call (the error raised by a synchronising call, and by the
next call after an asynchronous one), and a stress loop on emulated ranks with a memory bound whose
every call runs with poisoned outputs (`deep_ep.backends.outputs.poisoned`) and is checked element
by element against the reference.

Skipped without a CUDA device; run by tools/device_suite.sh on the H200. The stress length is
``DEEP_EP_GPU_STRESS_ITERS`` iterations of one dispatch and one combine on each of 8 ranks (default
625: 10,000 calls in all; with 200 iterations the whole `extra` step took 24 s on the H200).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_ep  # noqa: E402
from deep_ep import reference as ref  # noqa: E402
from deep_ep.backends import outputs  # noqa: E402
from gpu_cases import case_seed, handle_to_cpu, random_routing, to_cpu  # noqa: E402
from proc_utils import case_log, rss_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN, EXPERTS, TOPK, MAX_TOKENS = 512, 32, 4, 96


def _inputs(num_ranks: int, g: torch.Generator):
    xs, idxs, ws = [], [], []
    for _ in range(num_ranks):
        T = int(torch.randint(0, MAX_TOKENS + 1, (1,), generator=g))
        idx = random_routing(T, EXPERTS, TOPK, g, mask_prob=0.2)
        xs.append(torch.randn((T, HIDDEN), generator=g).to(torch.bfloat16))
        idxs.append(idx)
        ws.append(torch.rand((T, TOPK), generator=g))
    return xs, idxs, ws


def _two_ranks():
    """Two emulated ranks on GPU 0 and a small batch: (group, device, x [8, HIDDEN] bf16, top-k ids)."""
    from deep_ep.emulated import EmulatedGroup
    dev = torch.device("cuda", 0)
    group = EmulatedGroup(2, device=dev)  # before any CUDA work (it checks the process's CUDA settings)
    x = torch.randn((8, HIDDEN), device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(EXPERTS)[:TOPK] for _ in range(8)]).to(dev)
    return group, dev, x, idx


def _short_timeout_buffer(g):
    return deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                 num_gpu_timeout_secs=3)


def test_rank_skipping_a_call_times_out():
    group, dev, x, idx = _two_ranks()

    def body(g):
        buf = _short_timeout_buffer(g)
        try:
            # One call on every rank first: with emulated ranks, the first use of a kernel module is
            # a collective load (deep_ep.emulated), which a skipping rank would block on the host.
            _, _, _, handle, _ = buf.dispatch(x, idx, num_experts=EXPERTS)
            buf.combine(torch.randn((handle.num_recv_rows, HIDDEN), device=dev).to(torch.bfloat16), handle)
            buf.barrier()
            if g.rank() == 1:
                return None  # skips the next dispatch
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"rank 0: peer rank 1 did not arrive .* notify"):
                buf.dispatch(x, idx, num_experts=EXPERTS)
            assert time.monotonic() - t0 < 3 + 10
            with pytest.raises(RuntimeError, match="no longer usable"):
                buf.dispatch(x, idx, num_experts=EXPERTS)
            return None
        finally:
            buf.get_comm_stream().synchronize()

    group.run(body)


def test_a_refused_then_retried_dispatch_is_named_on_every_rank():
    """Rank 1's arguments are refused (it raises before communicating) and it calls again: it is a call
    ahead of rank 0. The call number travels with every signal, so both ranks' layout kernels see the
    other's and both raise a RuntimeError naming the ranks and their calls at once (the GPU timeout
    is 3 s; a TimeoutError would mean the pairing went unnoticed), and the buffer is unusable.
    The refused argument is made before the ranks start, so that no GPU work of the test's own comes
    between a rank's calls while the other rank's notify kernel waits for it (run alone, the test
    once timed out on rank 0 with the cast made between the calls; the cause is not confirmed)."""
    group, dev, x, idx = _two_ranks()
    idx32 = idx.to(torch.int32)

    def body(g):
        buf = _short_timeout_buffer(g)
        try:
            buf.dispatch(x, idx, num_experts=EXPERTS)                    # call 1 everywhere
            if g.rank() == 1:
                with pytest.raises(TypeError, match="topk_idx must have dtype"):
                    buf.dispatch(x, idx32, num_experts=EXPERTS)          # call 2, refused
            r = g.rank()
            mine, theirs = (2, 3) if r == 0 else (3, 2)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=rf"rank {r} is at call #{mine} of this buffer, "
                                                   rf"rank {1 - r} at call #{theirs}"):
                buf.dispatch(x, idx, num_experts=EXPERTS)                # rank 0: call 2, rank 1: call 3
            assert time.monotonic() - t0 < 2.5   # found at once, not after the GPU timeout (3 s)
            with pytest.raises(RuntimeError, match="no longer usable"):
                buf.dispatch(x, idx, num_experts=EXPERTS)
            return None
        finally:
            buf.get_comm_stream().synchronize()

    group.run(body)


def test_a_refused_then_retried_combine_is_named_at_the_next_call():
    """The same for a combine, whose kernels do not synchronise with the host: each rank's kernel
    records the other's call number, and the next call on every rank (here a barrier) raises it."""
    group, dev, x, idx = _two_ranks()

    def body(g):
        buf = _short_timeout_buffer(g)
        try:
            _, _, _, handle, _ = buf.dispatch(x, idx, num_experts=EXPERTS)
            y = torch.randn((handle.num_recv_rows, HIDDEN), device=dev).to(torch.bfloat16)
            if g.rank() == 1:   # a host tensor: no GPU work between the ranks' calls (see the test above)
                with pytest.raises(TypeError, match="x must have dtype"):
                    buf.combine(torch.zeros(tuple(y.shape)), handle)     # call 2, refused
            buf.combine(y, handle)
            with pytest.raises(RuntimeError, match="at call #"):
                buf.barrier()
            return None
        finally:
            buf.get_comm_stream().synchronize()

    group.run(body)


def test_async_timeout_reaches_the_next_call():
    """A combine whose peer never arrives times out on the GPU with no host wait in the call; the
    kernel copies its error record to mapped host memory, and the rank's next call (a cached
    dispatch, which does not synchronise) raises the TimeoutError from that copy before launching."""
    group, dev, x, idx = _two_ranks()

    def body(g):
        buf = _short_timeout_buffer(g)
        try:
            _, _, _, handle, _ = buf.dispatch(x, idx, num_experts=EXPERTS)
            y = torch.randn((handle.num_recv_rows, HIDDEN), device=dev).to(torch.bfloat16)
            buf.combine(y, handle)
            buf.barrier()
            if g.rank() == 1:
                return None  # skips the next combine
            buf.combine(y, handle)                 # queued; the kernel gives up after 3 s
            buf.get_comm_stream().synchronize()
            with pytest.raises(TimeoutError, match=r"rank 0: peer rank 1 did not arrive .* combine"):
                buf.dispatch(x, handle=handle)
            with pytest.raises(RuntimeError, match="no longer usable"):
                buf.dispatch(x, handle=handle)
            return None
        finally:
            buf.get_comm_stream().synchronize()

    group.run(body)


def test_stress_emulated_ep8_memory_bounded():
    """Alternating dispatch/combine on 8 emulated ranks with random token counts, masks and layouts;
    every iteration of every rank checked against the reference; GPU memory and host RSS bounded."""
    from deep_ep.emulated import EmulatedGroup
    iters = int(os.environ.get("DEEP_EP_GPU_STRESS_ITERS", "625"))
    R = 8
    dev = torch.device("cuda", 0)
    group = EmulatedGroup(R, device=dev)
    g = torch.Generator().manual_seed(case_seed("stress-emulated-ep8", iters))
    plans = []
    for i in range(iters):
        expand = bool(i % 3 == 1)
        xs, idxs, ws = _inputs(R, g)
        plans.append((expand, xs, idxs, ws))

    # The reference of an iteration is computed once, by the first rank thread that needs it, and
    # dropped when all R ranks have checked against it.
    lock = threading.Lock()
    refs: dict = {}

    def reference(i):
        with lock:
            if i not in refs:
                expand, xs, idxs, ws = plans[i]
                exp = ref.reference_dispatch(xs, idxs, ws, EXPERTS, do_expand=expand,
                                             expert_alignment=4 if expand else 1,
                                             num_max_tokens_per_rank=MAX_TOKENS)
                comb = ref.reference_combine([e.recv_x for e in exp], [e.handle for e in exp])
                refs[i] = [exp, [c[0] for c in comb], R]
            entry = refs[i]
            entry[2] -= 1
            if entry[2] == 0:
                del refs[i]
            return entry[0], entry[1]

    def body(grp):
        r = grp.rank()
        buf = deep_ep.ElasticBuffer(grp, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                    num_gpu_timeout_secs=30)
        failures, mem = [], []
        try:
            for i, (expand, xs, idxs, ws) in enumerate(plans):
                with outputs.poisoned():
                    out = buf.dispatch(xs[r].to(dev), idxs[r].to(dev), ws[r].to(dev), num_experts=EXPERTS,
                                       do_expand=expand, expert_alignment=4 if expand else 1,
                                       do_zero_padding=True)
                    recv_x, _, _, handle, _ = out
                    comb, _, _ = buf.combine(recv_x, handle)
                torch.cuda.current_stream().synchronize()
                exp, want = reference(i)
                try:
                    ref.check_dispatch((to_cpu(out[0]), to_cpu(out[1]), to_cpu(out[2]), handle_to_cpu(out[3])),
                                       exp[r], rank=r)
                    ref.check_combine((comb.cpu(), None), (want[r], None), rank=r)
                except AssertionError as exc:
                    failures.append(f"rank {r} iteration {i}: {exc}")
                if i == 10 or i == len(plans) - 1:
                    mem.append((torch.cuda.memory_allocated(dev), rss_bytes()))
            buf.barrier()
        finally:
            buf.destroy()
        return failures, mem

    t0 = time.monotonic()
    results = group.run(body)
    wall = time.monotonic() - t0
    failures = [f for res in results for f in res[0]]
    assert not failures, failures[:5]
    mem = results[0][1]
    if len(mem) == 2:
        (gpu0, rss0), (gpu1, rss1) = mem
        case_log(f"stress: {len(plans)} iterations x {R} ranks = {2 * R * len(plans)} calls, all checked, "
                 f"{wall:.1f} s; GPU memory growth {(gpu1 - gpu0) / 2**20:.2f} MiB, host RSS growth "
                 f"{(rss1 - rss0) / 2**20:.2f} MiB (iterations 10 to last)")
        assert gpu1 - gpu0 < 64 << 20, f"GPU memory grew by {(gpu1 - gpu0) >> 20} MiB over the loop"
        # One process holds all 8 ranks: a leak of a small host object per call (10,000 calls at the
        # default length) would exceed this.
        bound = (32 << 20) + 2 * R * len(plans) * 256
        assert rss1 - rss0 < bound, f"host RSS grew by {(rss1 - rss0) >> 20} MiB over the loop (bound {bound >> 20} MiB)"



def test_capacity_error_at_ep1_reaches_the_next_call(nccl_group):
    """EP=1 through NCCL, no CPU sync, expanded layout: tokens that name each expert twice need more
    rows (16 tokens x 8 pairs) than the worst case the outputs were sized for (16 x min(8, 4)
    experts). The layout stage records a capacity error and copies it to mapped host memory itself (a
    rank alone has no data-kernel wait that would), so the next call raises it before launching, and
    the call after that says the buffer is no longer usable."""
    dev = torch.device("cuda", 0)
    T, E, K = 16, 4, 8
    buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=T, hidden=HIDDEN, num_topk=K)
    try:
        x = torch.randn((T, HIDDEN), device=dev).to(torch.bfloat16)
        idx = (torch.arange(K, device=dev) % E).repeat(T, 1).to(deep_ep.topk_idx_t)
        _, _, _, handle, _ = buf.dispatch(x, idx, num_experts=E, do_cpu_sync=False, do_expand=True)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="more rows than its do_cpu_sync=False outputs hold"):
            buf.dispatch(x, idx, num_experts=E, do_cpu_sync=False, do_expand=True)
        with pytest.raises(RuntimeError, match="no longer usable"):
            buf.dispatch(x, handle=handle)
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def _check_good_dispatch(buf, dev, g, rank: int = 0, num_ranks: int = 1, xs=None, idxs=None, ws=None, on_dev=None,
                         max_tokens: int = MAX_TOKENS):
    """A valid dispatch on ``buf`` (outputs poisoned) matches the reference: the buffer is usable.
    ``on_dev``: this rank's inputs already on the device (emulated ranks copy nothing between calls);
    ``max_tokens``: the buffer's num_max_tokens_per_rank (a field of the handle)."""
    if xs is None:
        xs, idxs, ws = _inputs(num_ranks, g)
    x, idx, w = on_dev or (xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev))
    with outputs.poisoned():
        out = buf.dispatch(x, idx, w, num_experts=EXPERTS)
    torch.cuda.current_stream().synchronize()
    exp = ref.reference_dispatch(xs, idxs, ws, EXPERTS, num_max_tokens_per_rank=max_tokens)
    ref.check_dispatch((to_cpu(out[0]), to_cpu(out[1]), to_cpu(out[2]), handle_to_cpu(out[3])), exp[rank], rank=rank)


@pytest.mark.parametrize("T,expand", [(40, False), (1501, False), (40, True)],
                         ids=["few-tokens", "many-tokens", "expanded"])
@pytest.mark.parametrize("cpu_sync", [True, False], ids=["sync", "nosync"])
def test_an_out_of_range_expert_id_at_ep1_is_named_and_the_buffer_stays_usable(nccl_group, cpu_sync, T, expand):
    """EP=1 through NCCL: an expert id of num_experts in a GPU topk_idx is found by the notify kernel.
    With CPU sync the call raises a ValueError naming the id and its place before the data kernel is
    queued; without, the next call raises it. Either way valid calls after it match the reference.
    With 1501 tokens the notify kernel runs several blocks, more than one of which finds a bad id
    (the first in token order is named; the word that holds it is left ready for the next call)."""
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(case_seed("bad-expert-ep1", int(cpu_sync), T, int(expand)))
    M = max(MAX_TOKENS, T)
    buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=TOPK)
    try:
        _check_good_dispatch(buf, dev, g, max_tokens=M)
        x = torch.randn((T, HIDDEN), generator=g).to(torch.bfloat16).to(dev)
        idx = random_routing(T, EXPERTS, TOPK, g, mask_prob=0.0).to(dev)
        where = (3, 2) if T == 40 else (700, 1)
        if T > 40:
            idx[1300, 3] = -2   # a later block's, not named
        idx[where] = EXPERTS
        match = rf"expert id {EXPERTS} at \[{where[0]}, {where[1]}\]"
        if cpu_sync:
            with pytest.raises(ValueError, match=match):
                buf.dispatch(x, idx, num_experts=EXPERTS, do_expand=expand)
        else:
            buf.dispatch(x, idx, num_experts=EXPERTS, do_cpu_sync=False, num_max_tokens_per_rank=T, do_expand=expand)
            torch.cuda.synchronize()
            with pytest.raises(ValueError, match=match):
                buf.dispatch(x, idx.clamp(min=-1, max=EXPERTS - 1), num_experts=EXPERTS)
        for _ in range(3):
            _check_good_dispatch(buf, dev, g, max_tokens=M)
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def test_an_out_of_range_expert_id_on_one_emulated_rank_is_named_on_every_rank():
    """Two emulated ranks, rank 1's topk_idx holds an id of num_experts: every rank's layout stage
    sees it in the count matrix and raises the same ValueError naming rank 1; nothing moved, and the
    next valid dispatch of every rank matches the reference."""
    group, dev, x, idx = _two_ranks()
    g = torch.Generator().manual_seed(case_seed("bad-expert-ep2", 0))
    xs, idxs, ws = _inputs(2, g)
    bad1 = idx.clone()   # made before the ranks start (no GPU work between their calls)
    bad1[5, 1] = EXPERTS
    on_dev = [(xs[r].to(dev), idxs[r].to(dev), ws[r].to(dev)) for r in range(2)]

    def body(grp):
        buf = _short_timeout_buffer(grp)
        try:
            buf.dispatch(x, idx, num_experts=EXPERTS)
            bad = bad1 if grp.rank() == 1 else idx
            with pytest.raises(ValueError, match=rf"topk_idx on rank 1 holds expert id {EXPERTS} at \[5, 1\]"):
                buf.dispatch(x, bad, num_experts=EXPERTS)
            _check_good_dispatch(buf, dev, None, grp.rank(), 2, xs, idxs, ws, on_dev[grp.rank()])
            return None
        finally:
            buf.get_comm_stream().synchronize()

    group.run(body)
