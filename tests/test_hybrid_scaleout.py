"""Hybrid combine order across nodes (`deep_ep.reference`, "Hybrid order") on the CPU.

* `reference_combine(..., num_scaleup_ranks=S)` against a per-token loop written from DeepEP V2's
  recipe (rank, then scale-up group, then across: each level a float32 sum from +0.0 in slot order,
  rounded to bf16 and standing at the group's last slot; then the biases and every slot), on values
  whose float32 sums depend on the order, so that the hybrid order is shown to differ from the flat one;
  without multiple reduction (either layout) the hybrid order is the flat one.
* A gloo group of 4 acting as 2 nodes x 2 (`EP_CPU_NUM_NVLINK_RANKS=2`): combine in hybrid mode gives
  exactly the reference's hybrid order, direct mode (`allow_hybrid_mode=False`) the flat order, both
  layouts, with biases and weights; dispatch outputs are those of the one-node run.
* Emulated nodes on a GPU, host side only: every rank's kernel transport arguments (direct and hybrid
  mode) hold the peer table, rank, GIN state and offsets they are built from, and a struct that
  differs is refused before any launch.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.distributed as dist

from deep_ep.reference import reference_combine, reference_dispatch
from ep_cases import ADVERSARIAL_VALUES, bits_equal

from proc_utils import run_gloo_ranks

RANKS, SCALEUP, EXPERTS, TOPK, HIDDEN, MAX_TOKENS = 4, 2, 16, 4, 128, 20
TOKENS = (7, 0, 20, 13)


def _inputs(seed: int):
    """Every rank's dispatch inputs and combine biases (adversarial values), identical on all ranks."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws, biases = [], [], [], []
    for rank in range(RANKS):
        T = TOKENS[rank]
        xs.append(torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16))
        idx = torch.rand(T, EXPERTS, generator=g).topk(TOPK, dim=1).indices.to(torch.int64)
        idx[torch.rand(T, TOPK, generator=g) < 0.15] = -1
        idxs.append(idx)
        ws.append(torch.rand(T, TOPK, generator=g))
        biases.append(_adversarial((T, HIDDEN), g))
    return xs, idxs, ws, biases


def _adversarial(shape, g) -> torch.Tensor:
    return ADVERSARIAL_VALUES[torch.randint(0, len(ADVERSARIAL_VALUES), shape, generator=g)].to(torch.bfloat16)


def _expert_outputs(results, seed: int):
    """Per rank: bf16 rows for its received layout (rows past the valid count poisoned with NaN)."""
    g = torch.Generator().manual_seed(seed)
    ys = []
    for res in results:
        y = _adversarial((res.recv_x.shape[0], HIDDEN), g)
        y[res.num_valid_rows:] = float("nan")
        ys.append(y)
    return ys


def _loop_combine(ys, handles, biases, num_scaleup_ranks: int, multi: bool):
    """DeepEP's multi-level recipe token by token: per rank bf16 ``[T, H]``."""
    out = []
    L = EXPERTS // RANKS
    for s, h in enumerate(handles):
        combined = torch.empty(h.num_tokens, HIDDEN, dtype=torch.bfloat16)
        for t in range(h.num_tokens):
            owner = [int(e) // L if int(e) >= 0 else -1 for e in h.topk_idx[t].tolist()]
            slots = []                              # bf16 value per slot (zero for a masked slot)
            for k in range(TOPK):
                if owner[k] < 0:
                    slots.append(torch.zeros(HIDDEN, dtype=torch.bfloat16))
                else:
                    row = int(h.dst_buffer_slot_idx[t, k if h.do_expand else owner[k]])
                    slots.append(ys[owner[k]][row])
            if not h.do_expand:                     # one row per (token, rank): it stands at the last slot
                slots = [value if owner[k] < 0 or owner[k] not in owner[k + 1:] else torch.zeros_like(value)
                         for k, value in enumerate(slots)]
            levels = [lambda k: owner[k]] if multi and h.do_expand else []
            if multi and num_scaleup_ranks < RANKS:
                levels.append(lambda k: owner[k] // num_scaleup_ranks if owner[k] >= 0 else -1)
            for group_of in levels:
                grouped = []
                for k in range(TOPK):
                    group = group_of(k)
                    if group < 0 or any(group_of(j) == group for j in range(k + 1, TOPK)):
                        grouped.append(torch.zeros(HIDDEN, dtype=torch.bfloat16))
                        continue
                    acc = torch.zeros(HIDDEN, dtype=torch.float32)
                    for j in range(k + 1):
                        if group_of(j) == group:
                            acc += slots[j].float()
                    grouped.append(acc.to(torch.bfloat16))
                slots = grouped
            acc = biases[s][t].float().clone()
            for value in slots:
                acc += value.float()
            combined[t] = acc.to(torch.bfloat16)
        out.append(combined)
    return out


@pytest.mark.parametrize("do_expand", [False, True])
def test_reference_hybrid_order(do_expand):
    xs, idxs, ws, biases = _inputs(3)
    results = reference_dispatch(xs, idxs, ws, EXPERTS, do_expand=do_expand)
    handles = [res.handle for res in results]
    ys = _expert_outputs(results, 4)
    hybrid = reference_combine(ys, handles, biases=biases, num_scaleup_ranks=SCALEUP)
    flat = reference_combine(ys, handles, biases=biases)
    assert all(bits_equal(a[0], b[0]) for a, b in zip(flat, reference_combine(
        ys, handles, biases=biases, num_scaleup_ranks=RANKS)))
    want_hybrid = _loop_combine(ys, handles, biases, SCALEUP, True)
    want_flat = _loop_combine(ys, handles, biases, RANKS, True)
    for s in range(RANKS):
        assert bits_equal(hybrid[s][0], want_hybrid[s]), s
        assert bits_equal(flat[s][0], want_flat[s]), s
    # the adversarial values make the two orders differ, so the test tells them apart
    assert any(not bits_equal(hybrid[s][0], flat[s][0]) for s in range(RANKS))
    # without multiple reduction every rank's (or slot's) row travels alone: the flat order
    single = reference_combine(ys, handles, biases=biases, allow_multiple_reduction=False,
                               num_scaleup_ranks=SCALEUP)
    want = _loop_combine(ys, handles, biases, SCALEUP, False)
    assert all(bits_equal(single[s][0], want[s]) for s in range(RANKS))


def test_reference_hybrid_bad_scaleup():
    xs, idxs, ws, biases = _inputs(3)
    results = reference_dispatch(xs, idxs, ws, EXPERTS)
    ys = _expert_outputs(results, 4)
    for bad in (0, 3, -2, 2.0, True):
        with pytest.raises(ValueError, match="num_scaleup_ranks"):
            reference_combine(ys, [res.handle for res in results], num_scaleup_ranks=bad)


def _two_nodes_worker(rank, world_size):
    from deep_ep import ElasticBuffer
    xs, idxs, ws, biases = _inputs(5)
    want_dispatch = {do_expand: reference_dispatch(xs, idxs, ws, EXPERTS, do_expand=do_expand)
                     for do_expand in (False, True)}
    os.environ["EP_CPU_NUM_NVLINK_RANKS"] = str(SCALEUP)
    checked = 0
    try:
        for hybrid in (True, False):
            buf = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                num_topk=TOPK, allow_hybrid_mode=hybrid, device="cpu")
            assert buf.get_logical_domain_size() == ((2, 2) if hybrid else (1, 4))
            for do_expand in (False, True):
                want = want_dispatch[do_expand]
                recv_x, _, _, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=EXPERTS,
                                                       do_expand=do_expand)
                valid = want[rank].num_valid_rows
                assert bits_equal(recv_x[:valid], want[rank].recv_x[:valid])
                ys = _expert_outputs(want, 6)
                g = torch.Generator().manual_seed(7)
                weights = [torch.rand((y.shape[0],) if do_expand else (y.shape[0], TOPK), generator=g) for y in ys]
                expected = reference_combine(ys, [res.handle for res in want], weights, biases,
                                             num_scaleup_ranks=SCALEUP if hybrid else None)[rank]
                combined, combined_w, _ = buf.combine(ys[rank], handle, topk_weights=weights[rank],
                                                      bias=biases[rank])
                assert bits_equal(combined, expected[0]), (hybrid, do_expand)
                assert bits_equal(combined_w, expected[1]), (hybrid, do_expand)
                checked += 1
                # without multiple reduction: the flat order in both modes and layouts
                single = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                       num_topk=TOPK, allow_hybrid_mode=hybrid, allow_multiple_reduction=False,
                                       device="cpu")
                handle = single.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=EXPERTS,
                                         do_expand=do_expand)[3]
                expected = reference_combine(ys, [res.handle for res in want], biases=biases,
                                             allow_multiple_reduction=False)[rank]
                assert bits_equal(single.combine(ys[rank], handle, bias=biases[rank])[0], expected[0])
                single.destroy()
                checked += 1
            buf.destroy()
    finally:
        del os.environ["EP_CPU_NUM_NVLINK_RANKS"]
    return checked


def test_cpu_two_nodes_hybrid_combine_order(tmp_path):
    assert run_gloo_ranks(_two_nodes_worker, RANKS, tmp_path, deadline=200) == {r: 8 for r in range(RANKS)}


# ------------------------------------------------------------------ emulated nodes: the kernels' transport arguments
def _host_gin_state(hybrid: bool, num_ranks: int = 4, node_ranks: int = 2, num_bytes: int = 1 << 14):
    """An `EmulatedGinState` of host tensors with the attributes its argument builders read (the real
    one allocates on a GPU): windows of ``num_bytes``, receive halves of 4 KiB after the control region."""
    from deep_ep.backends.gpu.abi import CTRL_BYTES
    from deep_ep.comm import gin
    state = gin.EmulatedGinState.__new__(gin.EmulatedGinState)
    state.settings = gin.EmulatedGinSettings(seed=1, num_contexts=2)
    state.hybrid, state.node_ranks, state.num_contexts, state.num_bytes = hybrid, node_ranks, 2, num_bytes
    state.windows = [torch.zeros(num_bytes, dtype=torch.uint8) for _ in range(num_ranks)]
    state.recv_offset, state.half_bytes = CTRL_BYTES, 4096
    state.staging = torch.zeros(num_ranks * num_ranks * state.half_bytes, dtype=torch.uint8)
    state.forwarding, state.inbox = (torch.zeros(num_ranks * num_bytes, dtype=torch.uint8) for _ in range(2))
    state.args_bytes = ctypes.sizeof(gin.EmulatedGinArgs)
    state.rank_args = torch.zeros(num_ranks * state.args_bytes, dtype=torch.uint8)
    return state


@pytest.mark.parametrize("hybrid", [False, True], ids=["direct", "hybrid"])
def test_emulated_gin_kernel_args_hold_every_field(hybrid):
    """Every rank's TransportArgs (what the notify, dispatch and combine kernels of emulated nodes get)
    holds its peer table, rank, GIN state and offsets, built again and again with allocations in
    between: a byte copy of a temporary struct reads memory freed with it, whose first words (the peer
    table, the rank) the allocator overwrites, and the first kernel that reads them faults."""
    from deep_ep.comm import gin
    from deep_ep.comm.emulated import EmulatedTransportArgs
    state = _host_gin_state(hybrid)
    num_ranks, peers = len(state.windows), 0x7F00_0000_1000
    for attempt in range(200):
        for rank in range(num_ranks):
            base = EmulatedTransportArgs(peers, rank, num_ranks)
            args = state.hybrid_transport_args(base, rank) if hybrid else state.transport_args(base, rank)
            junk = [bytes(64) + bytes([attempt % 256]) for _ in range(8)]   # reuse freed blocks, as other threads do
            window = state.windows[rank].data_ptr()
            assert (args.peers, args.rank, args.num_ranks) == (peers, rank, num_ranks), (attempt, rank)
            assert args.gin == state.rank_args.data_ptr() + rank * ctypes.sizeof(gin.EmulatedGinArgs)
            assert args.stage_offset == state.staging.data_ptr() + rank * num_ranks * 4096 - window
            assert (args.recv_offset, args.half_bytes, args.max_put_bytes) == (state.recv_offset, 4096, 4096)
            assert (args.num_contexts, args.node_ranks) == (2, 2)
            if hybrid:
                assert isinstance(args, gin.GinHybridTransportArgs)
                assert args.forward_offset == state.forwarding.data_ptr() + rank * state.num_bytes - window
                assert args.inbox_offset == state.inbox.data_ptr() + rank * state.num_bytes - window
            state.check_transport_args(args, base, rank)
            del junk


def test_emulated_gin_kernel_args_check_refuses_a_wrong_field():
    from deep_ep.comm.emulated import EmulatedTransportArgs
    state = _host_gin_state(True)
    base = EmulatedTransportArgs(0x7F00_0000_1000, 1, 4)
    for field, value in [("peers", 1), ("rank", 0), ("num_ranks", 32720), ("inbox_offset", 0)]:
        args = state.hybrid_transport_args(base, 1)
        setattr(args, field, value)
        with pytest.raises(RuntimeError, match=rf"rank 1: .*{field} = {value}"):
            state.check_transport_args(args, base, 1)
    with pytest.raises(RuntimeError, match="GinTransportArgs"):   # the direct struct given to hybrid kernels
        state.check_transport_args(state.transport_args(base, 1), base, 1)


class _Recorder:
    """Fakes of the NIC transport's stream, join, module and base: every call in one list."""

    def __init__(self):
        self.calls = []
        self.cuda_stream = 77   # the NIC stream's raw handle

    def wait(self, waiter, producer):
        self.calls.append(("wait", waiter, producer))

    def function(self, name):
        return self

    def launch(self, grid, block, args, stream, device):
        self.calls.append(("nic", grid, stream))

    def destroy(self):
        self.calls.append(("destroy",))


def _nic_transport(recorder):
    from deep_ep.comm import gin
    transport = gin.EmulatedGinDirectTransport.__new__(gin.EmulatedGinDirectTransport)
    transport._nic_stream, transport._join, transport.base = recorder, recorder, recorder
    transport.nic_blocks, transport._nic_args, transport.rank = 1, gin.GinTransportArgs(), 2
    transport.device = torch.device("cpu")
    transport._release_nic = lambda stream, blocks: recorder.calls.append(("release", stream, blocks))
    return transport


def test_nic_is_released_and_joined_when_the_data_launch_fails():
    """A data kernel that fails to launch leaves its NIC kernel waiting for blocks that never come:
    the NIC is told they ended, the data stream still waits for it, and the error is passed on."""
    recorder = _Recorder()
    transport = _nic_transport(recorder)

    def launch():
        recorder.calls.append(("data",))
        raise RuntimeError("launch refused")

    with pytest.raises(RuntimeError, match="launch refused"):
        transport.launch_data(recorder, 5, 8, launch)
    assert recorder.calls == [("wait", 77, 5), ("nic", 1, 77), ("data",), ("release", 5, 8), ("wait", 5, 77)]
    recorder.calls.clear()
    transport.launch_data(recorder, 5, 8, lambda: recorder.calls.append(("data",)))
    assert recorder.calls == [("wait", 77, 5), ("nic", 1, 77), ("data",), ("wait", 5, 77)]


def test_destroy_keeps_a_nic_stream_whose_kernel_never_ended(monkeypatch):
    """destroy waits for the NIC's kernels before recycling its stream; one that does not end leaves the
    stream, the windows and the GIN's memory alive (the kernel may still write them) and raises."""
    from deep_ep.comm import gin
    from deep_ep.cuda import streams
    released = []
    monkeypatch.setattr(streams, "release_stream", released.append)
    recorder = _Recorder()
    transport = _nic_transport(recorder)
    transport.state, transport.base.windows = _host_gin_state(True), recorder
    transport.state.timeout_ns = 2_000_000_000
    assert transport.drain_secs == (gin.NIC_IDLE_TIMEOUTS + 1) * 2 + 5
    transport._drain_nic = lambda: False
    kept = len(gin._ABANDONED)
    with pytest.raises(TimeoutError, match="rank 2: its emulated NIC kernel did not end"):
        transport.destroy()
    assert released == [] and transport._nic_stream is None and ("destroy",) in recorder.calls
    assert len(gin._ABANDONED) == kept + 1 and gin._ABANDONED[-1][1] is transport.state
    gin._ABANDONED.pop()


def test_gin_phase_and_nic_constants_mirror_the_headers():
    """Rail waits, the NIC's and GIN's own waits name their phase on the host; the NIC's idle limit and
    each emulated rank's hardware queues (three streams on nodes) are those the code uses."""
    import re

    from deep_ep import jit
    from deep_ep.backends.gpu.abi import PHASES
    from deep_ep.backends.gpu.errors import raise_recorded
    from deep_ep.comm import gin
    from deep_ep.emulated import connections_needed
    comm = jit.locate.deep_ep_include_dir() / "deep_ep" / "comm"
    assert re.search(r"constexpr int kGinNicIdleTimeouts = (\d+);", (comm / "gin.cuh").read_text()).group(1) == \
        str(gin.NIC_IDLE_TIMEOUTS)
    assert [PHASES[p].split(" ")[0] for p in (16, 17, 18, 19, 20)] == ["GIN", "GIN", "emulated", "dispatch", "combine"]
    with pytest.raises(TimeoutError, match=r"rank 0: peer rank 2 did not arrive .* combine over the network"):
        raise_recorded((1, 0, 2, 20), 3.0, 16)
    assert (connections_needed(4, 3), connections_needed(8, 3), connections_needed(16, 2)) == (14, 26, 32)


def test_hybrid_mode_refuses_receive_hooks_before_anything():
    """A send phase alone (a V1 receive hook) in hybrid mode across nodes raises NotImplementedError
    naming the way out, for dispatch and combine alike, before the call looks at its inputs (a backend
    with nothing but its GIN mode, no handle state): nothing is planned, allocated or queued."""
    import types

    from deep_ep.backends.gpu import modules
    from deep_ep.backends.gpu.combine import run_combine
    from deep_ep.backends.gpu.dispatch import run_dispatch
    backend = types.SimpleNamespace(transport_gin=2)
    with pytest.raises(NotImplementedError, match=r"dispatch's send phase alone.*allow_hybrid_mode=False"):
        run_dispatch(backend, None, None, None, None, num_experts=16, num_max_tokens_per_rank=8, expert_alignment=1,
                     num_sms=1, handle=None, do_handle_copy=False, do_cpu_sync=True, do_expand=False,
                     do_zero_padding=False, use_tma_aligned_col_major_sf=False,
                     cumulative_local_expert_recv_stats=None, phases=modules.SEND_PHASE)
    with pytest.raises(NotImplementedError, match=r"combine's send phase alone.*allow_hybrid_mode=False"):
        run_combine(backend, None, types.SimpleNamespace(), None, None, num_sms=1, phases=modules.SEND_PHASE)


def _mismatched_domains_worker(rank, world_size, what):
    """Rank 0 alone runs direct mode (``what="mode"``) or sees one node of 4 (``what="split"``): every
    rank's first dispatch raises, naming what they disagree on, before anything moves."""
    import deep_ep
    if what == "split" and rank == 0:
        os.environ.pop("EP_CPU_NUM_NVLINK_RANKS", None)
    else:
        os.environ["EP_CPU_NUM_NVLINK_RANKS"] = "2"
    try:
        buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_timeout_secs=30,
                                       allow_hybrid_mode=not (what == "mode" and rank == 0))
        x = torch.randn(4, 64).to(torch.bfloat16)
        topk_idx = torch.randint(0, 8, (4, 2), generator=torch.Generator().manual_seed(rank))
        message = "allow_hybrid_mode" if what == "mode" else "scale-up"
        with pytest.raises(RuntimeError, match=f"ranks disagree on.*{message}.*per-rank values"):
            buffer.dispatch(x, topk_idx, num_experts=8)
        buffer.destroy()
    finally:
        os.environ.pop("EP_CPU_NUM_NVLINK_RANKS", None)


@pytest.mark.parametrize("what", ["mode", "split"])
def test_ranks_of_another_mode_or_node_split_are_refused(what, tmp_path):
    run_gloo_ranks(_mismatched_domains_worker, 4, tmp_path, what, deadline=120)
