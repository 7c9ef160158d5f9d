"""The host side of DeepEP's V1 low-latency direct kernels (`deep_ep.legacy.ll_direct`), without a
GPU: where the path applies, the window's regions
(both halves within `window_bytes`, which DeepEP's RDMA size hint covers past the control region),
the control words both halves keep (past the shared ones, inside the control region) and the flags'
fingerprints; and the host code on a byte-level model of the kernels and the windows
(tests/ll_direct_model.py) against the spec of tests/test_legacy_low_latency.py, ranks' sends before
their receives. The kernels themselves run in tests/gpu/test_gpu_legacy_ll_direct.py."""
from __future__ import annotations

import types

import pytest
import torch

import ll_direct_model
from deep_ep.backends.gpu.abi import CONSTANTS, CTRL_BYTES
from deep_ep.legacy import ll_direct
from deep_ep.legacy.layouts import low_latency_rdma_size_hint
from deep_ep.legacy.ll_state import LowLatencyState
from test_legacy_low_latency import (CASES, MAX_TOKENS, NUM_TOPK, _check_dispatch, _expected_combine, _expert_output,
                                     _rank_inputs, num_experts_for)


def _owner(enable_shrink=False, group_size=8, transport_gin=0):
    backend = types.SimpleNamespace(transport_gin=transport_gin)
    elastic = types.SimpleNamespace(_backend=backend)
    return types.SimpleNamespace(enable_shrink=enable_shrink, group_size=group_size, _alive=lambda: elastic)


def test_where_the_direct_path_applies():
    cuda = torch.device("cuda", 0)
    assert ll_direct.applies(_owner(), cuda, 256, 8, 128)
    assert not ll_direct.applies(_owner(), torch.device("cpu"), 256, 8, 128)        # the CPU backend
    assert ll_direct.applies(_owner(enable_shrink=True), cuda, 256, 8, 128)        # rank masks too
    assert ll_direct.applies(_owner(), cuda, 256, 8, ll_direct.MAX_SLOTS + 1)
    assert not ll_direct.applies(_owner(enable_shrink=True), cuda, 256, 8, ll_direct.MAX_SLOTS + 1)  # a count's bits
    assert not ll_direct.applies(_owner(group_size=ll_direct.MAX_RANKS + 8), cuda, 1024, 8, 128)
    assert not ll_direct.applies(_owner(transport_gin=1), cuda, 256, 8, 128)       # emulated nodes
    assert not ll_direct.applies(_owner(), cuda, ll_direct.MAX_EXPERTS + 8, 8, 128)
    assert not ll_direct.applies(_owner(), cuda, 256, ll_direct.MAX_TOPK + 1, 128)


@pytest.mark.parametrize("num_ranks, num_experts, num_slots, hidden, num_topk",
                         [(1, 256, 128, 7168, 8), (8, 256, 128, 7168, 8), (8, 288, 256, 7168, 9), (2, 6, 8, 384, 3),
                          (72, 288, 128, 4096, 8)])
def test_both_halves_fit_the_window_deepeps_hint_sizes(num_ranks, num_experts, num_slots, hidden, num_topk):
    """Per half: rows [L, R, T] of up to 2 * hidden bytes, then their scales, their pair words and the
    combine's T * K rows, 128-byte aligned and in that order; both halves past the control region,
    within `window_bytes`, which DeepEP's size hint covers past the control region (the Buffer's
    window: the hint rounded up to whole 2 MiB)."""
    num_local = num_experts // num_ranks
    need = ll_direct.window_bytes(num_ranks, num_local, num_slots, hidden, num_topk)
    assert need <= low_latency_rdma_size_hint(num_slots, hidden, num_ranks, num_experts) + CTRL_BYTES
    rows = num_local * num_ranks * num_slots
    end = CTRL_BYTES
    for half in (0, 1):
        regions = ll_direct._regions(half, num_ranks, num_local, num_slots, hidden, num_topk)
        offsets = [regions.rows, regions.scales, regions.pairs, regions.combine]
        sizes = [rows * 2 * hidden, rows * hidden // 128 * 4, rows * 4, num_slots * num_topk * 2 * hidden]
        assert offsets[0] == end
        for offset, size, following in zip(offsets, sizes, offsets[1:] + [None]):
            assert offset % 128 == 0
            end = offset + size
            assert following is None or following >= end
    assert end <= need


def test_the_control_words_of_both_halves_fit_the_control_region():
    constants = ll_direct._CONSTANTS
    shared_end = CONSTANTS["kCtrlTag"] + 4 * CONSTANTS["kMaxRanks"] + 2     # comm/push.cuh's words end there
    assert constants["kLlDirectCtrlWord"] >= shared_end
    assert (constants["kLlDirectCtrlWord"] + 2 * constants["kLlDirectHalfWords"]) * 4 <= CTRL_BYTES
    assert constants["kLlDirectCombineFlags"] >= constants["kLlDirectDispatchFlags"] + 2 * ll_direct.MAX_EXPERTS
    assert (constants["kLlDirectCtrlWord"] + constants["kLlDirectDispatchFlags"]) % 2 == 0   # 8-byte flags


def test_fingerprints_tell_configurations_apart():
    base = ll_direct._fingerprint("dispatch", 7168, 8, 128, 256, True).value
    assert 0 <= base < 2 ** 16
    assert base == ll_direct._fingerprint("dispatch", 7168, 8, 128, 256, True).value
    others = {ll_direct._fingerprint("dispatch", hidden, 8, 128, 256, fp8).value
              for hidden, fp8 in ((4096, True), (7168, False), (512, True))}
    assert base not in others


@pytest.mark.parametrize("phase, call", [("kPhaseDispatch", "low_latency_dispatch"),
                                         ("kPhaseCombine", "low_latency_combine")])
def test_a_fingerprint_mismatch_names_the_ranks_and_the_call(phase, call):
    """A direct flag with this call's tag but another fingerprint (kErrFingerprint: rank, peer, the
    wait's phase) is raised as ranks that disagree on that call's sizes, not as ranks at different calls."""
    from deep_ep.backends.gpu.abi import ERR_FINGERPRINT
    from deep_ep.backends.gpu.errors import raise_recorded
    with pytest.raises(RuntimeError, match=rf"ranks 1 and 3 disagree on a {call}: rank 3's call paired with rank 1's"
                                           r".* has other sizes \(hidden, top-k, num_max_dispatch_tokens_per_rank") as info:
        raise_recorded((ERR_FINGERPRINT, 1, 3, CONSTANTS[phase]), 10.0, 128, calls=5)
    assert "call #" not in str(info.value)



class _Owner(LowLatencyState):
    """One rank of a `deep_ep.Buffer` as `deep_ep.legacy.ll_direct` sees it, its window in the kernels'
    model (tests/ll_direct_model.py)."""

    def __init__(self, rank: int, windows: list, enable_shrink: bool = False) -> None:
        self.rank, self.group_size, self.enable_shrink = rank, len(windows), enable_shrink
        self._rank_state = torch.zeros(2 * len(windows), dtype=torch.int32)   # the Buffer's: mask, failed
        self._rank_mask = self._rank_state[:len(windows)]
        self.num_nvl_bytes = 0   # a low-latency Buffer: its one window is the low-latency one
        backend = types.SimpleNamespace(
            transport_args=types.SimpleNamespace(rank=rank, windows=windows), timeout_ns=10 ** 9,
            err_record=types.SimpleNamespace(device_ptr=0), raise_if_broken=lambda: None,
            device_resources=lambda: types.SimpleNamespace(max_sms=4, num_device_sms=4), config=types.SimpleNamespace(num_cpu_bytes=0),
            transport_gin=0, emulated=False, cooperative=False)
        self.elastic = types.SimpleNamespace(_backend=backend, num_bytes=windows[rank].numel(),
                                             device=torch.device("cpu"), is_destroyed=False)

    def _alive(self):
        return self.elastic


def _model_ranks(monkeypatch, num_ranks: int, hidden: int, enable_shrink: bool = False) -> tuple:
    """``(num_experts, local experts, owners)``: ``num_ranks`` ranks whose direct kernels run on the
    byte-level model (tests/ll_direct_model.py), their windows sized for ``hidden``."""
    monkeypatch.setattr(ll_direct, "_launch", ll_direct_model.launch)
    monkeypatch.setattr(ll_direct, "_load", lambda backend: None)
    num_experts = num_experts_for(num_ranks)
    num_local = num_experts // num_ranks
    need = ll_direct.window_bytes(num_ranks, num_local, MAX_TOKENS, hidden, NUM_TOPK)
    windows = [torch.zeros(need, dtype=torch.uint8) for _ in range(num_ranks)]
    return num_experts, num_local, [_Owner(rank, windows, enable_shrink) for rank in range(num_ranks)]


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}_fp8{:d}_round{:d}_ue8m0{:d}".format(*c))
def test_the_protocol_on_a_model_of_the_kernels(monkeypatch, num_ranks, case):
    """`ll_direct.dispatch` and `ll_direct.combine` with receive hooks on every rank (every rank's send
    before any receive, as the kernels may run), their kernels replaced by a byte-level model on
    the windows: three rounds (the halves' tags advancing), zero-copy and ``out=`` combines, each
    result equal to the spec of tests/test_legacy_low_latency.py."""
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_experts, num_local, owners = _model_ranks(monkeypatch, num_ranks, hidden)
    for round_index, seed in enumerate((11, 12, 13)):
        inputs = [_rank_inputs(seed, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
        stats = [torch.zeros(num_local, dtype=torch.int32) for _ in range(num_ranks)]
        results = [ll_direct.dispatch(owners[rank], inputs[rank][0], inputs[rank][1], MAX_TOKENS, num_experts,
                                      use_fp8, round_scale, use_ue8m0, False, True, stats[rank])
                   for rank in range(num_ranks)]
        for result in results:
            result[4]()
        expert_x = []
        for rank, result in enumerate(results):
            assert result[2].slot == 0 and result[2].direct is not None
            received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, result[:3] + (None, None),
                                       use_fp8, round_scale, use_ue8m0)
            assert torch.equal(stats[rank], result[1])
            expert_x.append(torch.stack([_expert_output(received[local], rank * num_local + local)
                                         for local in range(num_local)]))
        zero_copy = round_index == 1
        outs = [torch.full(inputs[rank][0].shape, float("nan"), dtype=torch.bfloat16) for rank in range(num_ranks)]
        combines = []
        for rank in range(num_ranks):
            source = expert_x[rank]
            if zero_copy:
                owners[rank]._combine_buffer(MAX_TOKENS, hidden, num_experts)[:, :, :] = source
                source = torch.zeros_like(source)
            combines.append(ll_direct.combine(owners[rank], source, inputs[rank][1], inputs[rank][2], results[rank][2],
                                              zero_copy, False, True, outs[rank] if round_index == 2 else None))
        for combined in combines:
            combined[2]()
        for rank, combined in enumerate(combines):
            assert combined[0] is outs[rank] or round_index != 2
            want = _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale)
            assert torch.equal(combined[0], want), (rank, round_index)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "h{}_fp8{:d}_round{:d}_ue8m0{:d}".format(*c))
def test_calls_without_hooks_launch_both_phases_at_once(monkeypatch, case):
    """On one rank, calls without receive hooks: one launch each, of both phases (the kernel's send,
    then its receive), its grid within the rank's SMs (all blocks resident); results equal to the spec
    over three rounds."""
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_experts, num_local, owners = _model_ranks(monkeypatch, 1, hidden)
    launches = []

    def recording(owner, window, name, blocks, args, device):
        assert 1 <= blocks <= 4      # the model backend's max_sms
        launches.append((name, args[1]))
        ll_direct_model.launch(owner, window, name, blocks, args, device)

    monkeypatch.setattr(ll_direct, "_launch", recording)
    for seed in (31, 32, 33):
        inputs = [_rank_inputs(seed, 0, 1, num_experts, hidden)]
        launches.clear()
        result = ll_direct.dispatch(owners[0], inputs[0][0], inputs[0][1], MAX_TOKENS, num_experts, use_fp8,
                                    round_scale, use_ue8m0, False, False, None)
        assert result[4] is None
        assert launches == [(ll_direct.DISPATCH_KERNEL, ll_direct.BOTH_PHASES)], launches
        received = _check_dispatch(0, 1, num_experts, hidden, inputs, result[:3] + (None, None), use_fp8,
                                   round_scale, use_ue8m0)
        expert_x = torch.stack([_expert_output(received[local], local) for local in range(num_local)])
        combined = ll_direct.combine(owners[0], expert_x, inputs[0][1], inputs[0][2], result[2], False, False, False,
                                     None)
        assert combined[2] is None
        assert launches[1:] == [(ll_direct.COMBINE_KERNEL, ll_direct.BOTH_PHASES)], launches
        want = _expected_combine(0, num_experts, hidden, inputs, use_fp8, round_scale)
        assert want.abs().sum() > 0 and torch.equal(combined[0], want)


def test_emulated_ranks_launch_the_phases_one_after_the_other(monkeypatch):
    """An emulated rank's calls without receive hooks launch the send phase, then the receive phase
    (grids of ranks sharing one device: a spinning receive must not hold the SMs a peer's send needs);
    the results stay the spec's."""
    hidden, use_fp8, round_scale, use_ue8m0 = CASES[0]
    num_experts, num_local, owners = _model_ranks(monkeypatch, 1, hidden)
    owners[0].elastic._backend.emulated = True
    launches = []

    def recording(owner, window, name, blocks, args, device):
        launches.append((name, args[1]))
        ll_direct_model.launch(owner, window, name, blocks, args, device)

    monkeypatch.setattr(ll_direct, "_launch", recording)
    inputs = [_rank_inputs(41, 0, 1, num_experts, hidden)]
    result = ll_direct.dispatch(owners[0], inputs[0][0], inputs[0][1], MAX_TOKENS, num_experts, use_fp8,
                                round_scale, use_ue8m0, False, False, None)
    received = _check_dispatch(0, 1, num_experts, hidden, inputs, result[:3] + (None, None), use_fp8, round_scale,
                               use_ue8m0)
    expert_x = torch.stack([_expert_output(received[local], local) for local in range(num_local)])
    combined = ll_direct.combine(owners[0], expert_x, inputs[0][1], inputs[0][2], result[2], False, False, False, None)
    assert launches == [(name, phase) for name in (ll_direct.DISPATCH_KERNEL, ll_direct.COMBINE_KERNEL)
                        for phase in (ll_direct.SEND_PHASE, ll_direct.RECEIVE_PHASE)], launches
    assert torch.equal(combined[0], _expected_combine(0, num_experts, hidden, inputs, use_fp8, round_scale))


@pytest.mark.parametrize("backend_cooperative", [True, False])
def test_one_launch_is_cooperative_where_the_data_kernels_are(monkeypatch, backend_cooperative):
    """A launch of both phases is cooperative when the backend launches its data kernels so (its
    receiving blocks wait for its sending blocks: all must be resident); a phase alone never is."""
    calls = []

    class _Function:
        def launch(self, grid, block, args, *, stream, device, cooperative):
            calls.append((args[1], cooperative))

    module = types.SimpleNamespace(function=lambda name: _Function())
    monkeypatch.setattr(ll_direct, "_load", lambda backend: module)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "stream")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    window = types.SimpleNamespace(_backend=types.SimpleNamespace(cooperative=backend_cooperative))
    owner = types.SimpleNamespace()
    for phase in (ll_direct.BOTH_PHASES, ll_direct.SEND_PHASE, ll_direct.RECEIVE_PHASE):
        ll_direct._launch(owner, window, ll_direct.DISPATCH_KERNEL, 4, (None, phase), torch.device("cpu"))
    assert calls == [(ll_direct.BOTH_PHASES, backend_cooperative), (ll_direct.SEND_PHASE, False),
                     (ll_direct.RECEIVE_PHASE, False)]


def test_combines_alternate_halves_of_their_own():
    """Two combines of one handle in a row take different halves (a fast rank's second combine must
    not overwrite the rows and flags a slow rank still waits for in the first); a half whose last
    combine's receive hook was not called yet is refused before anything is sent."""
    owner = types.SimpleNamespace()
    assert [ll_direct._combine_half(owner) for _ in range(3)] == [0, 1, 0]
    owner._ll_direct_combine["pending"][1] = 0     # a combine hook on half 1 not called yet
    with pytest.raises(RuntimeError, match="last two combines were not called yet"):
        ll_direct._combine_half(owner)
    owner._ll_direct_combine["pending"][1] = None
    assert ll_direct._combine_half(owner) == 1


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_a_slow_rank_keeps_its_combine_when_peers_run_the_next(monkeypatch, num_ranks):
    """Two combines of one handle in a row (as DeepEP's tests make them), with receive hooks: every
    rank but 0 receives the first and sends the second before rank 0 receives the first (on a GPU,
    rank 0 still waiting for one peer's flag while the others move on). Rank 0's first result is
    still the first combine's, and every second result (weights doubled) the second's."""
    hidden, use_fp8, round_scale, use_ue8m0 = CASES[0]
    num_experts, num_local, owners = _model_ranks(monkeypatch, num_ranks, hidden)
    inputs = [_rank_inputs(21, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
    results = [ll_direct.dispatch(owners[rank], inputs[rank][0], inputs[rank][1], MAX_TOKENS, num_experts, use_fp8,
                                  round_scale, use_ue8m0, False, True, None) for rank in range(num_ranks)]
    for result in results:
        result[4]()
    expert_x = []
    for rank, result in enumerate(results):
        received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, result[:3] + (None, None),
                                   use_fp8, round_scale, use_ue8m0)
        expert_x.append(torch.stack([_expert_output(received[local], rank * num_local + local)
                                     for local in range(num_local)]))

    def combine(rank: int, scale: float):
        return ll_direct.combine(owners[rank], expert_x[rank], inputs[rank][1], inputs[rank][2] * scale,
                                 results[rank][2], False, False, True, None)

    first = [combine(rank, 1.0) for rank in range(num_ranks)]
    second = [None] * num_ranks
    for rank in range(1, num_ranks):
        first[rank][2]()
        second[rank] = combine(rank, 2.0)
    first[0][2]()
    second[0] = combine(0, 2.0)
    for rank in range(num_ranks):
        second[rank][2]()
        want = _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale)
        assert torch.equal(first[rank][0], want), rank
        assert torch.equal(second[rank][0], want * 2), rank


def _masked_round(owners, ranks, seed, case, dispatch_linked, combine_linked, combining=None):
    """One dispatch and combine with receive hooks on ``ranks`` (the others make no call; every
    call's send before any receive), their kernels on the model: each rank's results against the
    spec for the sources it exchanges with (``dispatch_linked[rank]``, ``combine_linked[rank]``).
    ``combining``: the ranks that make the combine (default ``ranks``)."""
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_ranks = len(owners)
    num_experts = num_experts_for(num_ranks)
    num_local = num_experts // num_ranks
    inputs = [_rank_inputs(seed, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
    results = {rank: ll_direct.dispatch(owners[rank], inputs[rank][0], inputs[rank][1], MAX_TOKENS, num_experts,
                                        use_fp8, round_scale, use_ue8m0, False, True, None) for rank in ranks}
    for result in results.values():
        result[4]()
    expert_x = {}
    for rank, result in results.items():
        received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, result[:3] + (None, None), use_fp8,
                                   round_scale, use_ue8m0, dispatch_linked[rank])
        expert_x[rank] = torch.stack([_expert_output(received[local], rank * num_local + local)
                                      for local in range(num_local)])
    combining = ranks if combining is None else combining
    combines = {rank: ll_direct.combine(owners[rank], expert_x[rank], inputs[rank][1], inputs[rank][2],
                                        results[rank][2], False, False, True, None) for rank in combining}
    for combined in combines.values():
        combined[2]()
    for rank, combined in combines.items():
        want = _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale, combine_linked[rank])
        assert torch.equal(combined[0], want), rank


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_rank_masks_on_the_model(monkeypatch, num_ranks):
    """Rank masks on the direct kernels (tests/test_legacy_low_latency.py's cases: every rank but 1
    masks rank 1, rank 0 also masks the last rank): a rank exchanges with a peer when neither masks
    the other, told by the peer's absent flags without a timeout, so no mask changes; then every
    mask is cleared and everything is exchanged again."""
    from test_legacy_low_latency import _linked
    _, _, owners = _model_ranks(monkeypatch, num_ranks, CASES[1][0], enable_shrink=True)
    masks = {rank: {1} - {rank} for rank in range(num_ranks)}
    if num_ranks >= 4:
        masks[0].add(num_ranks - 1)
    for rank, owner in enumerate(owners):
        for peer in masks[rank]:
            owner._rank_mask[peer] = 1
    linked = {rank: _linked(masks, rank, num_ranks) for rank in range(num_ranks)}
    _masked_round(owners, range(num_ranks), 61, CASES[1], linked, linked)
    for rank, owner in enumerate(owners):
        assert owner._rank_mask.tolist() == [int(peer in masks[rank]) for peer in range(num_ranks)]
        owner._rank_mask.zero_()
    everyone = {rank: set(range(num_ranks)) for rank in range(num_ranks)}
    _masked_round(owners, range(num_ranks), 62, CASES[2], everyone, everyone)


def test_a_rank_that_stops_is_masked_and_not_waited_for(monkeypatch):
    """DeepEP's failure simulation on 4 ranks: rank 1 stops before a dispatch, rank 3 after a dispatch
    (no combine). Their peers' waits for them time out, which masks them instead of failing the
    call: results as if they had sent nothing, the masks say so, and later calls leave them out
    without waiting (the model never reads a flag of a masked rank: one would not come)."""
    num_ranks = 4
    _, _, owners = _model_ranks(monkeypatch, num_ranks, CASES[1][0], enable_shrink=True)
    monkeypatch.setattr(ll_direct_model, "TIMEOUTS", [])
    dispatch_linked = {rank: {0, 2, 3} for rank in range(num_ranks)}
    combine_linked = {rank: {0, 2} for rank in range(num_ranks)}
    _masked_round(owners, [0, 2, 3], 71, CASES[1], dispatch_linked, combine_linked, combining=[0, 2])
    assert [owner._rank_mask.tolist() for owner in owners] == [[0, 1, 0, 1], [0, 0, 0, 0], [0, 1, 0, 1],
                                                                [0, 1, 0, 0]]
    assert sorted(ll_direct_model.TIMEOUTS) == [(0, 1, "dispatch"), (0, 3, "combine"), (2, 1, "dispatch"),
                                                (2, 3, "combine"), (3, 1, "dispatch")]
    alive = {0, 2}
    linked = {rank: set(alive) for rank in range(num_ranks)}
    _masked_round(owners, sorted(alive), 72, CASES[0], linked, linked)
    _masked_round(owners, sorted(alive), 73, CASES[2], linked, linked)
    assert [owners[rank]._rank_mask.tolist() for rank in alive] == [[0, 1, 0, 1]] * 2
    assert len(ll_direct_model.TIMEOUTS) == 5        # none since: masked ranks are not waited for
    assert [owners[rank]._rank_state[num_ranks:].tolist() for rank in alive] == [[0, 1, 0, 1]] * 2   # failed


def test_a_mask_changed_during_a_call_takes_effect_at_the_next_dispatch(monkeypatch):
    """A dispatch runs on the mask as it was when called (its receive hook, called after the mask
    changed, still takes every source), and its combine follows the dispatch's decisions (a mask
    changed after the dispatch leaves that combine as it was): otherwise one rank could write
    combine rows a peer no longer waits for. The next dispatch takes the new masks."""
    from test_legacy_low_latency import _linked
    num_ranks = 4
    hidden, use_fp8, round_scale, use_ue8m0 = case = CASES[1]
    num_experts, num_local, owners = _model_ranks(monkeypatch, num_ranks, hidden, enable_shrink=True)
    inputs = [_rank_inputs(81, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
    results = [ll_direct.dispatch(owners[rank], inputs[rank][0], inputs[rank][1], MAX_TOKENS, num_experts, use_fp8,
                                  round_scale, use_ue8m0, False, True, None) for rank in range(num_ranks)]
    masks = {0: {2}, 1: set(), 2: {3}, 3: set()}
    for rank, peers in masks.items():               # after the sends, before the receive hooks
        for peer in peers:
            owners[rank]._rank_mask[peer] = 1
    for result in results:
        result[4]()
    expert_x = []
    for rank, result in enumerate(results):
        received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, result[:3] + (None, None), use_fp8,
                                   round_scale, use_ue8m0)
        expert_x.append(torch.stack([_expert_output(received[local], rank * num_local + local)
                                     for local in range(num_local)]))
    combines = [ll_direct.combine(owners[rank], expert_x[rank], inputs[rank][1], inputs[rank][2], results[rank][2],
                                  False, False, True, None) for rank in range(num_ranks)]
    for combined in combines:
        combined[2]()
    for rank, combined in enumerate(combines):
        assert torch.equal(combined[0], _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale))
    linked = {rank: _linked(masks, rank, num_ranks) for rank in range(num_ranks)}
    assert linked[0] == {0, 1, 3} and linked[3] == {0, 1, 3}
    _masked_round(owners, range(num_ranks), 82, case, linked, linked)
    assert [owner._rank_mask.tolist() for owner in owners] == [[0, 0, 1, 0], [0] * 4, [0, 0, 0, 1], [0] * 4]


def test_a_rank_masked_by_a_peer_that_moved_on_is_not_held_up(monkeypatch):
    """Rank 0 masks rank 1 (alive; it masks nobody), so nothing makes rank 0 wait for rank 1: it makes
    three whole steps on the buffer half of rank 1's dispatch before rank 1 calls its receive hook, and
    overwrites its absent flag in rank 1's window with a later call's. Rank 1 takes a flag
    of a later call as absent: no timeout, no mask, both results without the other."""
    monkeypatch.setattr(ll_direct_model, "TIMEOUTS", [])
    hidden, use_fp8, round_scale, use_ue8m0 = CASES[0]
    num_experts, num_local, owners = _model_ranks(monkeypatch, 2, hidden, enable_shrink=True)
    owners[0]._rank_mask[1] = 1
    alone = [{0}, {1}]

    def step(rank: int, seed: int, before_hook=lambda: None):
        inputs = [_rank_inputs(seed, source, 2, num_experts, hidden) for source in range(2)]
        result = ll_direct.dispatch(owners[rank], inputs[rank][0], inputs[rank][1], MAX_TOKENS, num_experts, use_fp8,
                                    round_scale, use_ue8m0, False, True, None)
        before_hook()
        result[4]()
        received = _check_dispatch(rank, 2, num_experts, hidden, inputs, result[:3] + (None, None), use_fp8,
                                   round_scale, use_ue8m0, alone[rank])
        expert_x = torch.stack([_expert_output(received[local], rank * num_local + local)
                                for local in range(num_local)])
        combined = ll_direct.combine(owners[rank], expert_x, inputs[rank][1], inputs[rank][2], result[2], False, False,
                                     True, None)
        combined[2]()
        want = _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale, alone[rank])
        assert torch.equal(combined[0], want), rank
        return result[2].slot

    halves = []
    step(1, 91, before_hook=lambda: halves.extend([step(0, 91), step(0, 92), step(0, 93)]))
    assert halves == [0, 0, 0]        # a dispatch takes a half no pending hook holds: here always 0
    assert ll_direct_model.TIMEOUTS == []
    assert [owner._rank_mask.tolist() for owner in owners] == [[0, 1], [0, 0]]


@pytest.mark.parametrize("low_latency_window, transport_gin", [(False, 0), (True, 0), (False, 1)])
def test_a_shrink_buffer_loads_the_direct_kernels_at_creation(monkeypatch, low_latency_window, transport_gin):
    """With ``enable_shrink`` the direct kernels are built and loaded when the Buffer is made, on every
    window its low-latency calls may use (its own, and its low-latency one when it has one), then the
    ranks meet at a barrier: a first call's build could otherwise outlast the peers' timeout and get
    a healthy rank masked. Not across nodes (no direct kernels there)."""
    calls = []
    monkeypatch.setattr(ll_direct, "_load", lambda backend: calls.append(("load", backend.name)))

    def window(name):
        backend = types.SimpleNamespace(name=name, transport_gin=transport_gin)
        return types.SimpleNamespace(_backend=backend, barrier=lambda: calls.append(("barrier", name)))

    own = window("own")
    owner = types.SimpleNamespace(_alive=lambda: own)
    if low_latency_window:
        owner._low_latency_extra_buffer = window("low-latency")
    ll_direct.prepare(owner)
    loads = [("load", "own")] + ([("load", "low-latency")] if low_latency_window else [])
    assert calls == ([] if transport_gin else loads + [("barrier", "own")])


def test_a_combine_leaves_out_a_rank_found_failed_after_its_dispatch(monkeypatch):
    """Two micro-batches on 4 ranks, as a decode step overlaps them: dispatch A (every rank), then
    dispatch B, which rank 2 never makes: the others' waits time out once and take rank 2 as failed.
    Combine A, whose dispatch took rank 2 in, leaves it out without a second timeout (its slots add
    nothing), and combine B too; cleaning the mask forgets the failure."""
    monkeypatch.setattr(ll_direct_model, "TIMEOUTS", [])
    num_ranks = 4
    hidden, use_fp8, round_scale, use_ue8m0 = CASES[1]
    num_experts, num_local, owners = _model_ranks(monkeypatch, num_ranks, hidden, enable_shrink=True)
    alive, everyone = [0, 1, 3], set(range(num_ranks))
    inputs = {seed: [_rank_inputs(seed, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
              for seed in (101, 102)}
    batches = {}
    for seed, ranks, linked in ((101, range(num_ranks), everyone), (102, alive, set(alive))):
        results = {rank: ll_direct.dispatch(owners[rank], inputs[seed][rank][0], inputs[seed][rank][1], MAX_TOKENS,
                                            num_experts, use_fp8, round_scale, use_ue8m0, False, True, None)
                   for rank in ranks}
        for result in results.values():
            result[4]()
        batches[seed] = {}
        for rank, result in results.items():
            received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs[seed],
                                       result[:3] + (None, None), use_fp8, round_scale, use_ue8m0, linked)
            batches[seed][rank] = (result[2], torch.stack([_expert_output(received[local], rank * num_local + local)
                                                           for local in range(num_local)]))
    assert sorted(ll_direct_model.TIMEOUTS) == [(rank, 2, "dispatch") for rank in alive]
    for seed in (101, 102):
        combines = {rank: ll_direct.combine(owners[rank], batches[seed][rank][1], inputs[seed][rank][1],
                                            inputs[seed][rank][2], batches[seed][rank][0], False, False, True, None)
                    for rank in alive}
        for combined in combines.values():
            combined[2]()
        for rank, combined in combines.items():
            want = _expected_combine(rank, num_experts, hidden, inputs[seed], use_fp8, round_scale, set(alive))
            assert torch.equal(combined[0], want), (seed, rank)
    assert len(ll_direct_model.TIMEOUTS) == len(alive)
    assert [owners[rank]._rank_state.tolist() for rank in alive] == [[0, 0, 1, 0] * 2] * len(alive)
    from deep_ep.legacy.low_latency import LowLatencyMethods
    LowLatencyMethods.low_latency_clean_mask_buffer(owners[0])    # the Buffer's method on this owner
    assert owners[0]._rank_state.tolist() == [0] * 8


def _dispatch_on(owner, inputs, rank, case, hook=True):
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_experts = num_experts_for(len(inputs))
    return ll_direct.dispatch(owner, inputs[rank][0], inputs[rank][1], MAX_TOKENS, num_experts, use_fp8, round_scale,
                              use_ue8m0, False, hook, None)


def test_a_late_receive_still_reads_a_call_that_included_it(monkeypatch):
    """Rank 0 takes rank 1 in a dispatch, then masks it and, waiting for it no more, makes two more
    dispatches, the second on the half of the first, whose absent flag overwrites the count rank 1
    has not read yet (its receive hook comes late). The absent flag carries that count (it names
    the call as the last that included rank 1), so rank 1's late receive still takes rank 0's rows:
    no row lost, no timeout."""
    monkeypatch.setattr(ll_direct_model, "TIMEOUTS", [])
    case = CASES[1]
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_experts, num_local, owners = _model_ranks(monkeypatch, 2, hidden, enable_shrink=True)
    inputs = [_rank_inputs(111, source, 2, num_experts, hidden) for source in range(2)]
    first = [_dispatch_on(owners[rank], inputs, rank, case) for rank in range(2)]
    first[0][4]()
    owners[0]._rank_mask[1] = 1
    halves = []
    for seed in (112, 113):
        later = _dispatch_on(owners[0], [_rank_inputs(seed, source, 2, num_experts, hidden) for source in range(2)], 0,
                             case)
        later[4]()
        halves.append(later[2].slot)
    assert [first[0][2].slot] + halves == [0, 1, 0]
    first[1][4]()                                     # rank 1's receive, after rank 0 moved on
    for rank in range(2):
        _check_dispatch(rank, 2, num_experts, hidden, inputs, first[rank][:3] + (None, None), use_fp8, round_scale,
                        use_ue8m0)
    assert ll_direct_model.TIMEOUTS == [] and owners[1]._rank_mask.tolist() == [0, 0]


def test_a_late_combine_receive_still_reads_a_combine_that_included_it(monkeypatch):
    """The same for combines: rank 0 takes rank 1 in a dispatch and its combine, then masks it and
    makes two more steps; its combine on the first combine's half overwrites the flag of the first
    combine, whose receive rank 1 makes late. The absent flag names that combine as the last that
    included rank 1, so rank 1 still adds rank 0's rows."""
    monkeypatch.setattr(ll_direct_model, "TIMEOUTS", [])
    case = CASES[0]
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_experts, num_local, owners = _model_ranks(monkeypatch, 2, hidden, enable_shrink=True)
    inputs = [_rank_inputs(121, source, 2, num_experts, hidden) for source in range(2)]
    results = [_dispatch_on(owners[rank], inputs, rank, case) for rank in range(2)]
    combines = []
    for rank, result in enumerate(results):
        result[4]()
        received = _check_dispatch(rank, 2, num_experts, hidden, inputs, result[:3] + (None, None), use_fp8,
                                   round_scale, use_ue8m0)
        expert_x = torch.stack([_expert_output(received[local], rank * num_local + local)
                                for local in range(num_local)])
        combines.append(ll_direct.combine(owners[rank], expert_x, inputs[rank][1], inputs[rank][2], result[2], False,
                                          False, True, None))
    combines[0][2]()
    owners[0]._rank_mask[1] = 1
    for seed in (122, 123):
        step_inputs = [_rank_inputs(seed, source, 2, num_experts, hidden) for source in range(2)]
        result = _dispatch_on(owners[0], step_inputs, 0, case)
        result[4]()
        expert_x = torch.zeros(num_local, 2 * MAX_TOKENS, hidden, dtype=torch.bfloat16)
        ll_direct.combine(owners[0], expert_x, step_inputs[0][1], step_inputs[0][2], result[2], False, False, False,
                          None)
    combines[1][2]()                                  # rank 1's combine receive, after rank 0 moved on
    for rank in range(2):
        want = _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale)
        assert torch.equal(combines[rank][0], want), rank
    assert ll_direct_model.TIMEOUTS == [] and owners[1]._rank_mask.tolist() == [0, 0]


def test_receive_hooks_wait_once_for_a_failed_rank(monkeypatch):
    """Two dispatches in flight (receive hooks) on 3 ranks, rank 2 never making them: the first hook's
    receive times out on rank 2 and takes it as failed; the second's, from a copy of the mask made
    before that, leaves rank 2 out without waiting for it again."""
    monkeypatch.setattr(ll_direct_model, "TIMEOUTS", [])
    case = CASES[1]
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_experts, num_local, owners = _model_ranks(monkeypatch, 3, hidden, enable_shrink=True)
    inputs = {seed: [_rank_inputs(seed, source, 3, num_experts, hidden) for source in range(3)] for seed in (131, 132)}
    results = {seed: [_dispatch_on(owners[rank], inputs[seed], rank, case) for rank in (0, 1)] for seed in (131, 132)}
    for seed in (131, 132):
        for rank in (0, 1):
            results[seed][rank][4]()
            _check_dispatch(rank, 3, num_experts, hidden, inputs[seed], results[seed][rank][:3] + (None, None),
                            use_fp8, round_scale, use_ue8m0, {0, 1})
    assert sorted(ll_direct_model.TIMEOUTS) == [(0, 2, "dispatch"), (1, 2, "dispatch")]


def test_unmasking_a_rank_forgets_its_failure():
    """`low_latency_update_mask_buffer(r, False)` clears both the mask and the failure a timeout
    recorded for ``r`` (else its combines would go on leaving it out); masking sets the mask only;
    `low_latency_clean_mask_buffer` clears everything."""
    from deep_ep.legacy.low_latency import LowLatencyMethods
    owner = _Owner(0, [torch.zeros(8, dtype=torch.uint8)] * 3, enable_shrink=True)
    owner._rank_state.copy_(torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.int32))
    LowLatencyMethods.low_latency_update_mask_buffer(owner, 1, False)
    assert owner._rank_state.tolist() == [0, 0, 1, 0, 0, 1]
    LowLatencyMethods.low_latency_update_mask_buffer(owner, 0, True)
    assert owner._rank_state.tolist() == [1, 0, 1, 0, 0, 1]
    LowLatencyMethods.low_latency_clean_mask_buffer(owner)
    assert owner._rank_state.tolist() == [0] * 6


def _skip_calls(windows, half: int, count: int) -> None:
    """Advance every window's dispatch count on ``half`` by ``count`` calls (as that many calls would)."""
    for window in windows:
        offset = ll_direct_model._word(half, "kLlDirectDispatchSeq") * 4
        value = int(window[offset:offset + 4].clone().view(torch.int32)[0]) + count
        window[offset:offset + 4] = torch.tensor([value], dtype=torch.int32).view(torch.uint8)


def test_an_absent_flag_never_names_a_live_call_after_its_tag_wraps(monkeypatch):
    """Rank 0 masks rank 1 for 2^15 calls on a half after a call that included it: the 15 bits of
    that call's tag, which its absent flags carry, come round to a live call's. The word moves to
    name a call far ahead once the included call is 2^13 calls old, so rank 1's receive one call
    behind (rank 0 moved on) takes rank 0 as absent, not as that old call's count."""
    monkeypatch.setattr(ll_direct_model, "TIMEOUTS", [])
    case = CASES[0]
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_experts, num_local, owners = _model_ranks(monkeypatch, 2, hidden, enable_shrink=True)
    windows = owners[0].elastic._backend.transport_args.windows

    def dispatch(rank, seed, hook=True):
        inputs = [_rank_inputs(seed, source, 2, num_experts, hidden) for source in range(2)]
        result = _dispatch_on(owners[rank], inputs, rank, case)
        assert result[2].slot == 0
        if hook:
            result[4]()
            owners[rank]._uncombined()[0] = None          # as if combined: the next dispatch takes half 0 too
        return inputs, result

    first = [dispatch(rank, 141, hook=False)[1] for rank in range(2)]    # call 1 includes rank 1
    for rank, result in enumerate(first):
        result[4]()
        owners[rank]._uncombined()[0] = None
    owners[0]._rank_mask[1] = 1
    calls = 1
    while calls < 1 << 15:                                 # rank 0 alone, every 2^13 - 1 calls one for real
        step = min((1 << 13) - 1, (1 << 15) - 1 - calls)
        _skip_calls(windows, 0, step)
        calls += step
        dispatch(0, 142)
        _skip_calls(windows[1:], 0, 1)                     # rank 1 counted that call as made
        calls += 1
    inputs, late = dispatch(1, 143, hook=False)            # call 2^15 + 1: the tag's 15 bits are call 1's
    assert ll_direct_model._seq(windows[1], 0, "kLlDirectDispatchSeq") + 1 == (1 << 15) + 1
    dispatch(0, 143)
    dispatch(0, 144)                                       # rank 0 moves on, overwriting its flag
    late[4]()
    _check_dispatch(1, 2, num_experts, hidden, inputs, late[:3] + (None, None), use_fp8, round_scale, use_ue8m0, {1})
    assert ll_direct_model.TIMEOUTS == []


def test_a_receive_2_to_the_14_calls_behind_takes_a_moved_word_as_absent(monkeypatch):
    """A rank nobody waits for (rank 0 masks rank 1, which masks nobody) may lag any number of calls:
    at a lag of exactly 2^14, the word rank 0's absent flag carries, moved to name a call 2^14 ahead
    of the flag's, has the 15 bits of rank 1's call. A named call must be less than 2^13 calls
    before the flag's own, so rank 1 still takes rank 0 as absent (not as in, with no rows)."""
    monkeypatch.setattr(ll_direct_model, "TIMEOUTS", [])
    case = CASES[0]
    hidden, use_fp8, round_scale, use_ue8m0 = case
    num_experts, num_local, owners = _model_ranks(monkeypatch, 2, hidden, enable_shrink=True)
    windows = owners[0].elastic._backend.transport_args.windows
    owners[0]._rank_mask[1] = 1
    inputs = [_rank_inputs(151, source, 2, num_experts, hidden) for source in range(2)]
    late = _dispatch_on(owners[1], inputs, 1, case)          # call 1 of rank 1, its hook late
    _skip_calls(windows[:1], 0, 1 << 14)
    ahead = _dispatch_on(owners[0], inputs, 0, case)         # rank 0's call 2^14 + 1 on the half
    assert ahead[2].slot == 0 and late[2].slot == 0
    late[4]()
    _check_dispatch(1, 2, num_experts, hidden, inputs, late[:3] + (None, None), use_fp8, round_scale, use_ue8m0, {1})
    assert late[2].direct.present.tolist() == [0, 1]
