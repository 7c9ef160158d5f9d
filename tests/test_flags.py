"""Flags are taken as DeepEP takes them: a bool, or an int 0 / 1 (DeepEP's own tests pass
``allow_hybrid_mode=1``, ``do_cpu_sync=1``), a numpy bool or a one-element torch tensor holding 0 / 1;
`checks.check_bool` turns them into bools and refuses anything else. Over gloo (2 spawned ranks),
a buffer made and called with such flags behaves exactly as one made and called with bools."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from deep_ep import checks
from proc_utils import run_gloo_ranks

T, H, K, E, M = 6, 256, 4, 8, 12


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), (1, True), (0, False), (np.True_, True), (np.bool_(False), False),
    (np.int64(1), True), (np.int32(0), False), (torch.tensor(True), True), (torch.tensor(0), False),
    (torch.tensor([1], dtype=torch.int8), True)])
def test_a_flag_is_a_bool_or_0_or_1(value, expected):
    got = checks.check_bool("flag", value)
    assert type(got) is bool and got is expected


@pytest.mark.parametrize("value", [2, -1, 1.0, 0.0, "yes", "", None, [1], np.float64(1.0), np.int64(2),
                                   np.array([True, False]), torch.tensor(1.0), torch.tensor([1, 0]),
                                   torch.tensor(2), torch.empty(0, dtype=torch.bool), object()])
def test_anything_else_is_refused(value):
    with pytest.raises(TypeError, match=r"flag must be a bool \(or an int 0 / 1\), got"):
        checks.check_bool("flag", value)


def _inputs(rank):
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g).topk(K, 1).indices
    idx[::3, -1] = -1
    return x, idx, torch.rand(T, K, generator=g)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b))
    return a == b


def _round(buf, x, idx, w, flags):
    """A fresh dispatch, a cached one and a combine with ``flags`` (names -> values); their outputs
    (the received rows up to the true count: without CPU sync the rest is unspecified)."""
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(
        x, idx, w, num_experts=E, num_max_tokens_per_rank=M, expert_alignment=2, do_cpu_sync=flags["sync"],
        do_expand=flags["expand"], do_zero_padding=flags["padding"], do_handle_copy=flags["copy"],
        async_with_compute_stream=flags["off"], allocate_on_comm_stream=flags["off"])
    assert type(handle.do_expand) is bool and type(handle.do_cpu_sync) is bool
    again = buf.dispatch(x, topk_weights=w, handle=handle, do_expand=flags["expand"], do_cpu_sync=flags["off"],
                         do_zero_padding=flags["padding"])
    assert again[3] is handle
    y = recv_x.float().mul(0.5).to(torch.bfloat16)
    combined = buf.combine(y, handle, bias=x, async_with_compute_stream=flags["off"],
                           apply_dispatch_weights=flags["expand"])
    rows = int((handle.psum_num_recv_tokens_per_expert if flags["expand"]
                else handle.psum_num_recv_tokens_per_scaleup_rank)[-1])

    def specified(outputs):
        return [None if t is None else t[:rows] for t in outputs]
    return specified((recv_x, recv_idx, recv_w)), specified(again[:3]), combined[:2], rows


def _worker(rank, world_size):
    from deep_ep import ElasticBuffer, get_logical_domain_size
    group = dist.group.WORLD
    with_bools = ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K, use_fp8_dispatch=False,
                               deterministic=True, allow_hybrid_mode=True, allow_multiple_reduction=True,
                               prefer_overlap_with_compute=False, explicitly_destroy=False)
    with_ints = ElasticBuffer(group, None, 0, M, H, K, 0, 1, 1, np.True_, torch.tensor(False), 3, 0, 300, 100, 0)
    for name in ("deterministic", "allow_hybrid_mode", "allow_multiple_reduction", "prefer_overlap_with_compute",
                 "explicitly_destroy"):
        got, want = getattr(with_ints, name), getattr(with_bools, name)
        assert type(got) is bool and got is want, name
        assert getattr(with_ints.config, name) is want, name
    assert with_ints.config.use_fp8_dispatch is False and with_ints.num_bytes == with_bools.num_bytes
    assert ElasticBuffer.get_buffer_size_hint(group, M, H, K, 1, 0, 1) == \
        ElasticBuffer.get_buffer_size_hint(group, M, H, K, True, False, True)
    assert get_logical_domain_size(group, 1) == get_logical_domain_size(group, True)
    x, idx, w = _inputs(rank)
    bools = [dict(sync=s, expand=e, padding=e, copy=not s, off=False) for s in (True, False) for e in (False, True)]
    ints = [dict(sync=int(s), expand=np.bool_(e), padding=torch.tensor(e), copy=np.int64(not s), off=0)
            for s in (True, False) for e in (False, True)]
    for as_bools, as_ints in zip(bools, ints):
        want = _round(with_bools, x, idx, w, as_bools)
        for buf in (with_ints, with_bools):   # both buffers, the int flags on plans made by bools too
            got = _round(buf, x, idx, w, as_ints)
            assert _equal(got, want), (rank, as_bools)
    with_ints.barrier(use_comm_stream=1, with_cpu_sync=np.True_, sequential=0)
    with_ints.destroy()
    with_bools.destroy()


def test_int_flags_over_gloo(tmp_path):
    run_gloo_ranks(_worker, 2, tmp_path, deadline=180)
