"""The public surface matches DeepEP V2's ElasticBuffer (the experimental PP / AGRS / Engram methods
aside): signatures (names, order, defaults: positional calls mean the same), attributes and their
values, EPHandle's field names, the event classes, the module-level functions. The expected lists
are written from DeepEP V2's deep_ep/buffers/elastic.py, utils/event.py and utils/envs.py."""
import inspect
import math
import os

import pytest
import torch
import torch.distributed as dist

import deep_ep
from proc_utils import run_gloo_ranks

_ = inspect.Parameter.empty
DEEPEP_SIGNATURES = {
    "__init__": [("group", _), ("num_bytes", None), ("num_cpu_bytes", 0), ("num_max_tokens_per_rank", 0),
                 ("hidden", 0), ("num_topk", 0), ("use_fp8_dispatch", False), ("deterministic", False),
                 ("allow_hybrid_mode", True), ("allow_multiple_reduction", True),
                 ("prefer_overlap_with_compute", True), ("sl_idx", 3), ("num_allocated_qps", 0),
                 ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100), ("explicitly_destroy", False)],
    "dispatch": [("x", _), ("topk_idx", None), ("topk_weights", None), ("cumulative_local_expert_recv_stats", None),
                 ("num_experts", None), ("num_max_tokens_per_rank", None), ("expert_alignment", None),
                 ("num_sms", 0), ("num_qps", 0), ("previous_event", None), ("previous_event_before_epilogue", None),
                 ("async_with_compute_stream", False), ("allocate_on_comm_stream", False), ("handle", None),
                 ("do_handle_copy", True), ("do_cpu_sync", None), ("do_expand", False), ("do_zero_padding", False),
                 ("use_tma_aligned_col_major_sf", False)],
    "combine": [("x", _), ("handle", _), ("topk_weights", None), ("bias", None), ("num_sms", 0), ("num_qps", 0),
                ("previous_event", None), ("previous_event_before_epilogue", None),
                ("async_with_compute_stream", False), ("allocate_on_comm_stream", False)],
    "get_buffer_size_hint": [("group", _), ("num_max_tokens_per_rank", _), ("hidden", _), ("num_topk", 0),
                             ("use_fp8_dispatch", False), ("allow_hybrid_mode", True),
                             ("allow_multiple_reduction", True)],
    "get_theoretical_num_sms": [("num_experts", _), ("num_topk", _), ("num_scaleout_topk", 0), ("rdma_gbs", 0),
                                ("nvlink_gbs", 0), ("sm_read_gbs", 200), ("sm_write_gbs", 50)],
    "get_theoretical_num_qps": [("num_sms", _)],
    "barrier": [("use_comm_stream", True), ("with_cpu_sync", False), ("sequential", True)],
    "capture": [],
    "get_comm_stream": [],
    "get_physical_domain_size": [],
    "get_logical_domain_size": [],
    "destroy": [],
}
#: deep_ep's extensions: keyword-only, after DeepEP's parameters, off by default.
EXTENSIONS = {"__init__": [("device", None)], "combine": [("apply_dispatch_weights", False)]}
STATIC = ("get_buffer_size_hint", "capture")
DEEPEP_ATTRIBUTES = ("group", "rank_idx", "num_ranks", "num_bytes", "num_max_tokens_per_rank", "num_scaleout_ranks",
                     "num_scaleup_ranks", "scaleout_rank_idx", "scaleup_rank_idx", "num_rdma_ranks",
                     "num_nvlink_ranks", "num_allocated_qps", "allow_hybrid_mode", "allow_multiple_reduction",
                     "prefer_overlap_with_compute", "deterministic", "explicitly_destroy")
DEEPEP_HANDLE_FIELDS = ("do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms", "topk_idx",
                        "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                        "num_unaligned_recv_tokens_per_expert", "num_recv_tokens_per_expert_list",
                        "recv_src_metadata", "dst_buffer_slot_idx", "token_metadata_at_forward",
                        "channel_linked_list", "num_recv_tokens", "num_expanded_tokens")


@pytest.mark.parametrize("name", sorted(DEEPEP_SIGNATURES))
def test_method_signature(name):
    member = inspect.getattr_static(deep_ep.ElasticBuffer, name)
    assert isinstance(member, staticmethod) == (name in STATIC), name
    params = list(inspect.signature(getattr(deep_ep.ElasticBuffer, name)).parameters.values())
    if name not in STATIC:
        assert params[0].name == "self"
        params = params[1:]
    expected = DEEPEP_SIGNATURES[name]
    got = [(p.name, p.default) for p in params[:len(expected)]]
    assert got == expected, name
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params[:len(expected)]), name
    extra = params[len(expected):]
    assert all(p.kind == p.KEYWORD_ONLY for p in extra), name
    # private keywords (deep_ep's own layers, e.g. `deep_ep.legacy.deferred`) are off by default
    assert all(p.default is None for p in extra if p.name.startswith("_")), name
    public = [(p.name, p.default) for p in extra if not p.name.startswith("_")]
    assert public == EXTENSIONS.get(name, []), name


def test_deepep_module_paths():
    """DeepEP's module paths for its classes hold the same objects."""
    from deep_ep.buffers.elastic import ElasticBuffer, EPHandle
    from deep_ep.buffers.legacy import Buffer, Config
    from deep_ep.utils import EventHandle as UtilsEventHandle
    from deep_ep.utils.event import EventHandle, EventOverlap
    assert (ElasticBuffer, EPHandle, Buffer, Config, EventHandle, EventOverlap) == \
        (deep_ep.ElasticBuffer, deep_ep.EPHandle, deep_ep.Buffer, deep_ep.Config, deep_ep.EventHandle,
         deep_ep.EventOverlap)
    assert UtilsEventHandle is deep_ep.EventHandle


def test_module_level_names():
    for name in ("ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "topk_idx_t", "Buffer", "Config",
                 "get_physical_domain_size", "get_logical_domain_size"):
        assert hasattr(deep_ep, name), name
    assert deep_ep.topk_idx_t == torch.int64
    sig = inspect.signature(deep_ep.get_logical_domain_size)
    assert [(p.name, p.default) for p in sig.parameters.values()] == [("group", _), ("allow_hybrid_mode", True)]
    assert list(inspect.signature(deep_ep.get_physical_domain_size).parameters) == ["group"]
    assert set(DEEPEP_HANDLE_FIELDS) <= set(deep_ep.EPHandle.__dataclass_fields__)


def test_event_overlap_api():
    ev = deep_ep.EventOverlap(deep_ep.EventHandle())
    sig = inspect.signature(deep_ep.EventOverlap.current_stream_wait)
    assert [(p.name, p.default) for p in list(sig.parameters.values())[1:]] == [("release_handle", False)]
    assert list(inspect.signature(deep_ep.EventOverlap.register_hook_after_wait).parameters)[1:] == ["hook_after_wait"]
    calls = []
    ev.register_hook_after_wait(lambda: calls.append(1))
    with pytest.raises(RuntimeError, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    assert ev.hook_after_wait is not None
    assert ev(release_handle=True) is ev
    with ev:
        assert calls == []
    assert calls == [1] and ev.event is None and ev.hook_after_wait is None
    # DeepEP's hook_after_wait is a plain attribute: assigning replaces the hook, None removes it
    ev.hook_after_wait = lambda: calls.append(2)
    ev.hook_after_wait = lambda: calls.append(3)
    ev.current_stream_wait()
    ev.hook_after_wait = lambda: calls.append(4)
    ev.hook_after_wait = None
    ev.current_stream_wait()
    assert calls == [1, 3]
    with pytest.raises(TypeError, match="callable or None"):
        ev.hook_after_wait = 5
    ev = deep_ep.EventOverlap(deep_ep.EventHandle(), extra_tensors=(torch.ones(1),))
    ev.current_stream_wait()
    assert ev.event is not None
    ev.current_stream_wait(release_handle=True)
    assert ev.event is None
    deep_ep.EventOverlap().current_stream_wait()      # a synchronous call's event: nothing to wait for
    assert deep_ep.ElasticBuffer.capture().event is None   # no CUDA work in this process


def _attributes_worker(rank, world_size):
    group = dist.group.WORLD
    # every argument positionally, in DeepEP's order
    buf = deep_ep.ElasticBuffer(group, None, 4 << 20, 8, 128, 4, False, True, False, True, False, 5, 7, 30, 20, True)
    for name in DEEPEP_ATTRIBUTES:
        assert hasattr(buf, name), name
    values = {name: getattr(buf, name) for name in DEEPEP_ATTRIBUTES if name != "group"}
    assert buf.group is group
    assert (buf.num_cpu_bytes, buf.sl_idx, buf.config.num_cpu_timeout_secs, buf.config.num_gpu_timeout_secs) == \
        (4 << 20, 5, 30, 20)
    assert buf.num_bytes == deep_ep.ElasticBuffer.get_buffer_size_hint(group, 8, 128, 4, False, False, True) > 0
    assert buf.get_logical_domain_size() == deep_ep.get_logical_domain_size(group) == (1, world_size)
    assert buf.get_physical_domain_size() == deep_ep.get_physical_domain_size(group) == (1, world_size)
    assert buf.get_theoretical_num_sms(16, 4) == 0 and buf.get_theoretical_num_qps(3) == 3   # direct: min(3, 9)
    assert buf.get_comm_stream() is None
    buf.barrier(False, True, False)
    buf.destroy()
    auto = deep_ep.ElasticBuffer(group)
    assert auto.num_allocated_qps == 0 and auto.num_bytes == 0 and auto.sl_idx == 3
    auto.destroy()
    os.environ["EP_OVERRIDE_RDMA_SL"] = "7"       # the environment overrides sl_idx, as in DeepEP
    try:
        overridden = deep_ep.ElasticBuffer(group, sl_idx=1)
        assert overridden.sl_idx == 7 and overridden.config.sl_idx == 7
        overridden.destroy()
        os.environ["EP_OVERRIDE_RDMA_SL"] = "16"
        with pytest.raises(ValueError, match="EP_OVERRIDE_RDMA_SL must be an RDMA service level"):
            deep_ep.ElasticBuffer(group)
        os.environ["EP_OVERRIDE_RDMA_SL"] = ""       # empty counts as unset (a template's ${SL:-})
        unset = deep_ep.ElasticBuffer(group, sl_idx=2)
        assert unset.sl_idx == 2
        unset.destroy()
    finally:
        del os.environ["EP_OVERRIDE_RDMA_SL"]
    return values


def test_buffer_attributes(tmp_path):
    res = run_gloo_ranks(_attributes_worker, 2, tmp_path, deadline=60)
    for rank, values in res.items():
        assert values == dict(rank_idx=rank, num_ranks=2, num_bytes=values["num_bytes"], num_max_tokens_per_rank=8,
                              num_scaleout_ranks=1, num_scaleup_ranks=2, scaleout_rank_idx=0, scaleup_rank_idx=rank,
                              num_rdma_ranks=1, num_nvlink_ranks=2, num_allocated_qps=7, allow_hybrid_mode=False,
                              allow_multiple_reduction=True, prefer_overlap_with_compute=False, deterministic=True,
                              explicitly_destroy=True)


def test_resource_model():
    """deep_ep/resources.py on DeepEP's numbers (tests/test_topology.py checks the model in depth)."""
    from deep_ep.resources import (DeviceResources, default_num_allocated_qps, expected_ranks_per_token,
                                   theoretical_num_qps, theoretical_num_sms)
    h200 = DeviceResources(num_device_sms=132, max_sms=132, nvlink_gbs=450.0)
    assert expected_ranks_per_token(256, 8, 1) == 1.0 and expected_ranks_per_token(8, 8, 4) == 4.0
    miss = math.prod((128 - i) / (256 - i) for i in range(8))
    assert expected_ranks_per_token(256, 8, 2) == pytest.approx(2 * (1 - miss))
    # one node of 8: NVLink-bound writes, 450 / (7/8) / 50 = 10.3 SMs, +25 % -> 13 -> 14
    assert theoretical_num_sms(256, 8, num_ranks=8, resources=h200) == 14
    assert theoretical_num_sms(256, 8, num_ranks=16, resources=h200, num_scaleout_ranks=2, num_rdma_ranks=2) == 12
    assert theoretical_num_sms(256, 8, num_ranks=1, resources=h200) == 132          # EP=1: every SM
    assert theoretical_num_sms(256, 8, num_ranks=8, resources=h200, prefer_overlap_with_compute=False) == 64
    emulated = DeviceResources(num_device_sms=132, max_sms=10, nvlink_gbs=450.0)
    assert theoretical_num_sms(256, 8, num_ranks=8, resources=emulated) == 10
    assert theoretical_num_sms(256, 8, num_ranks=8, resources=None) == 0              # no SMs (CPU)
    assert theoretical_num_qps(0, 129) == 0 and theoretical_num_qps(20, 129) == 129
    assert theoretical_num_qps(5, 129) == 81 and theoretical_num_qps(20, 17, False) == 9
    assert default_num_allocated_qps(h200) == 129 and default_num_allocated_qps(h200, False) == 17
    assert default_num_allocated_qps(None) == 0
