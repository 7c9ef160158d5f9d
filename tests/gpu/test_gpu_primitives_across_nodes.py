"""The experimental primitives on emulated nodes (`EmulatedGroup(4, num_nvlink_ranks=2)`, hybrid and
direct mode): every method of pipeline send/recv, all-gather / reduce-scatter and Engram raises
`NotImplementedError` on every rank (their GPU paths reach peers by loads, stores and copy engines,
within one NVLink domain) before it holds the window. Run by
``EXTRA_FILES=tests/gpu/test_gpu_primitives_across_nodes.py bash tools/device_suite.sh extra``."""
from __future__ import annotations

import pytest
import torch

import deep_ep

DEVICE = torch.device("cuda", 0)


def _calls(primitive: str, rank: int, num_ranks: int) -> tuple:
    """``(method, args)`` of each public method of ``primitive``, with arguments it would accept."""
    tensor = torch.zeros(8, dtype=torch.float32, device=DEVICE)
    if primitive == "pp":
        return (("pp_set_config", (64, 2)), ("pp_send", (tensor, (rank + 1) % num_ranks)),
                ("pp_recv", (tensor, (rank - 1) % num_ranks)))
    if primitive == "agrs":
        return (("agrs_set_config", (1024, 2)), ("create_agrs_session", ()), ("all_gather", (tensor,)),
                ("reduce_scatter", (tensor,)), ("destroy_agrs_session", ()))
    storage = torch.ones(16, 128, dtype=torch.bfloat16, device=DEVICE)
    return (("engram_write", (storage,)), ("engram_fetch", (torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),)))


def _body(group, primitive: str, hybrid: bool) -> int:
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=16, hidden=256, num_topk=4, allow_hybrid_mode=hybrid,
                                explicitly_destroy=True, num_cpu_timeout_secs=120)
    try:
        for method, args in _calls(primitive, group.rank(), group.size()):
            with pytest.raises(NotImplementedError, match=rf"ElasticBuffer\.{method}: .* runs within one NVLink "
                                                          r"domain only"):
                getattr(buf, method)(*args)
        assert buf._window_use.holder is None
        return buf._backend.transport_gin
    finally:
        buf.destroy()


@pytest.mark.parametrize("primitive", ["pp", "agrs", "engram"])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "direct"])
def test_emulated_nodes_refuse_the_primitives(primitive, hybrid):
    from deep_ep.emulated import EmulatedGroup
    modes = EmulatedGroup(4, device=DEVICE, num_nvlink_ranks=2).run(_body, primitive, hybrid)
    assert modes == [2 if hybrid else 1] * 4
