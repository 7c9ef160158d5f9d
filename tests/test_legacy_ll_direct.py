"""The host side of DeepEP's V1 low-latency direct kernels (`deep_ep.legacy.ll_direct`), without a
GPU: the switch (``DEEP_EP_LL_DIRECT``, off by default), where the path applies, the window's regions
(both halves within `window_bytes`, which DeepEP's RDMA size hint covers past the control region),
the control words both halves keep (past the shared ones, inside the control region) and the flags'
fingerprints. The kernels run in tests/gpu/test_gpu_legacy_ll_direct.py."""
from __future__ import annotations

import types

import pytest
import torch

from deep_ep.backends.gpu.abi import CONSTANTS, CTRL_BYTES
from deep_ep.legacy import ll_direct
from deep_ep.legacy.layouts import low_latency_rdma_size_hint


def test_the_switch_is_off_by_default(monkeypatch):
    monkeypatch.delenv("DEEP_EP_LL_DIRECT", raising=False)
    assert not ll_direct.enabled()
    monkeypatch.setenv("DEEP_EP_LL_DIRECT", "1")
    assert ll_direct.enabled()
    monkeypatch.setenv("DEEP_EP_LL_DIRECT", "0")
    assert not ll_direct.enabled()


def _owner(enable_shrink=False, group_size=8, transport_gin=0):
    backend = types.SimpleNamespace(transport_gin=transport_gin)
    elastic = types.SimpleNamespace(_backend=backend)
    return types.SimpleNamespace(enable_shrink=enable_shrink, group_size=group_size, _alive=lambda: elastic)


def test_where_the_direct_path_applies(monkeypatch):
    monkeypatch.setenv("DEEP_EP_LL_DIRECT", "1")
    cuda = torch.device("cuda", 0)
    assert ll_direct.applies(_owner(), cuda, 256, 8, 128)
    assert not ll_direct.applies(_owner(), torch.device("cpu"), 256, 8, 128)        # the CPU backend
    assert not ll_direct.applies(_owner(enable_shrink=True), cuda, 256, 8, 128)    # rank masks
    assert not ll_direct.applies(_owner(transport_gin=1), cuda, 256, 8, 128)       # emulated nodes
    assert not ll_direct.applies(_owner(), cuda, ll_direct.MAX_EXPERTS + 8, 8, 128)
    assert not ll_direct.applies(_owner(), cuda, 256, ll_direct.MAX_TOPK + 1, 128)
    monkeypatch.setenv("DEEP_EP_LL_DIRECT", "0")
    assert not ll_direct.applies(_owner(), cuda, 256, 8, 128)


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

