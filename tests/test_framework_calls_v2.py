"""How SGLang (token_dispatcher/deepep_v2.py) and vLLM (DeepEPV2All2AllManager, prepare_finalize/
deepep_v2.py) call DeepEP V2's `deep_ep.ElasticBuffer`, replayed call by call with their keywords
(from their public sources, written here in our own code) on 2 gloo ranks.

Every value they read is checked against the routing of all ranks: the handle's per-rank and
per-expert prefix sums and count list, the received rows, and the combined tokens (identity
experts, so each token comes back once per rank, or once per top-k slot in the expanded layout).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import deep_ep
from proc_utils import run_gloo_ranks

NUM_RANKS = 2
NUM_TOKENS = 24
HIDDEN = 256
NUM_EXPERTS = 8
NUM_TOPK = 3


def _inputs(rank: int, seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    x = (torch.randn(NUM_TOKENS, HIDDEN, generator=generator) + 0.25).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:NUM_TOPK] for _ in range(NUM_TOKENS)])
    topk_idx[::5, -1] = -1                                   # some slots without an expert
    topk_weights = torch.rand(NUM_TOKENS, NUM_TOPK, generator=generator)
    return x, topk_idx, topk_weights


def _gathered(topk_idx: torch.Tensor) -> list:
    every = [torch.empty_like(topk_idx) for _ in range(NUM_RANKS)]
    dist.all_gather(every, topk_idx)
    return every


def _all_x(x: torch.Tensor) -> list:
    every = [torch.empty_like(x) for _ in range(NUM_RANKS)]
    dist.all_gather(every, x)
    return every


def _check_handle(handle, every_topk_idx, rank, alignment, do_expand):
    """The handle fields the frameworks read, against the routing of every rank."""
    num_local = NUM_EXPERTS // NUM_RANKS
    local = range(rank * num_local, (rank + 1) * num_local)
    tokens_from = [int(((idx // num_local) == rank).any(1).sum()) for idx in every_topk_idx]
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == torch.tensor(tokens_from).cumsum(0).tolist()
    per_expert = [sum(int((idx == expert).sum()) for idx in every_topk_idx) for expert in local]
    aligned = [-(-count // alignment) * alignment for count in per_expert]
    assert handle.num_recv_tokens_per_expert_list == aligned
    psum = handle.psum_num_recv_tokens_per_expert.tolist()
    if do_expand:   # the aligned counts of the experts before, plus this expert's own count
        assert psum == [sum(aligned[:i]) + per_expert[i] for i in range(num_local)]
    else:
        assert psum == torch.tensor(aligned).cumsum(0).tolist()
    return sum(tokens_from)


def _identity_combine_want(x, topk_idx, do_expand):
    """What combine returns for identity experts: each row of a token, summed in float32, one rounding."""
    if do_expand:
        copies = (topk_idx >= 0).sum(1)
    else:
        copies = torch.stack([((topk_idx >= 0) & (topk_idx // (NUM_EXPERTS // NUM_RANKS) == owner)).any(1)
                              for owner in range(NUM_RANKS)]).sum(0)
    return (x.float() * copies[:, None]).to(torch.bfloat16)


# ------------------------------------------------------------------------------------ SGLang
def _sglang(rank, num_ranks):
    """SGLang's DeepEP V2 dispatcher: theoretical SM / QP counts, a dispatch with every keyword it
    passes, the handle's prefix sums and count list, a combine with the dispatch's weights."""
    group = dist.group.WORLD
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                                   use_fp8_dispatch=False, allow_hybrid_mode=True, sl_idx=0,
                                   prefer_overlap_with_compute=False)
    num_sms = buffer.get_theoretical_num_sms(NUM_EXPERTS, NUM_TOPK)
    num_qps = buffer.get_theoretical_num_qps(num_sms)
    assert (num_sms, num_qps) == (0, 0)                          # no kernels on CPU
    for step, (alignment, do_expand, do_cpu_sync) in enumerate(((1, False, True), (4, True, True))):
        x, topk_idx, topk_weights = _inputs(rank, step)
        every = _gathered(topk_idx)
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=NUM_EXPERTS,
            num_max_tokens_per_rank=NUM_TOKENS, expert_alignment=alignment, num_sms=num_sms, num_qps=num_qps,
            use_tma_aligned_col_major_sf=False, do_cpu_sync=do_cpu_sync, do_expand=do_expand)
        num_received = _check_handle(handle, every, rank, alignment, do_expand)
        if not do_expand:
            assert recv_x.shape[0] >= num_received
            sources = torch.cat(_all_x(x))
            rows = [(source, token) for source, idx in enumerate(every)
                    for token in range(NUM_TOKENS) if ((idx[token] // (NUM_EXPERTS // NUM_RANKS)) == rank).any()]
            want = torch.stack([sources[source * NUM_TOKENS + token] for source, token in rows])
            assert torch.equal(recv_x[:num_received], want)
        combined_x, combined_topk_weights, event = buffer.combine(recv_x, handle=handle,
                                                                  topk_weights=recv_topk_weights,
                                                                  num_sms=num_sms, num_qps=num_qps)
        assert torch.equal(combined_x, _identity_combine_want(x, topk_idx, do_expand))
        # each weight comes back from the rank that owns its expert; slots without one give 0
        assert torch.equal(combined_topk_weights, torch.where(topk_idx >= 0, topk_weights, 0.0))
    buffer.destroy()


# ------------------------------------------------------------------------------------ vLLM
def _vllm(rank, num_ranks):
    """vLLM's DeepEP V2 manager: every constructor keyword it passes, keyword-only calls, no CPU
    sync, explicit destroy."""
    buffer = deep_ep.ElasticBuffer(group=dist.group.WORLD, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN,
                                   num_topk=NUM_TOPK, use_fp8_dispatch=False, allow_hybrid_mode=True,
                                   prefer_overlap_with_compute=False, allow_multiple_reduction=True,
                                   num_cpu_timeout_secs=60, num_gpu_timeout_secs=30, explicitly_destroy=True)
    assert buffer.get_theoretical_num_sms(num_experts=NUM_EXPERTS, num_topk=NUM_TOPK) == 0
    for step, do_expand in enumerate((False, True)):
        x, topk_idx, topk_weights = _inputs(rank, 10 + step)
        every = _gathered(topk_idx)
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
            x=x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=NUM_EXPERTS,
            num_max_tokens_per_rank=NUM_TOKENS, do_expand=do_expand, do_cpu_sync=False,
            async_with_compute_stream=False)
        assert handle.num_recv_tokens_per_expert_list == []      # no CPU sync: no host counts
        tokens_from = [int(((idx // (NUM_EXPERTS // NUM_RANKS)) == rank).any(1).sum()) for idx in every]
        assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == \
            torch.tensor(tokens_from).cumsum(0).tolist()
        combined_x, combined_topk_weights, event = buffer.combine(x=recv_x, handle=handle, topk_weights=None,
                                                                  async_with_compute_stream=False,
                                                                  allocate_on_comm_stream=False)
        assert combined_topk_weights is None
        assert torch.equal(combined_x, _identity_combine_want(x, topk_idx, do_expand))
    buffer.destroy()


@pytest.mark.parametrize("replay", [_sglang, _vllm], ids=["sglang", "vllm"])
def test_framework_calls_v2(replay, tmp_path):
    run_gloo_ranks(replay, NUM_RANKS, tmp_path, deadline=120)
