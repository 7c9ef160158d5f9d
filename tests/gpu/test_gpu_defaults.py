"""The GPU backend under a caller's torch defaults: ``torch.set_default_device('cuda')`` and
``torch.set_default_dtype(torch.bfloat16)``, as DeepEP's test harness sets them before it makes an
`ElasticBuffer` (tests/caller_defaults.py).

A subset of tests/gpu/test_gpu_backend.py's cases (bf16 and FP8, expanded with padding, without CPU
sync, biases, an empty rank), checked against `deep_ep.reference` bit for bit by its `run_case`, with
the buffer made and every call made under those defaults: EP=1 on real NCCL and 2 emulated ranks.
Also the asynchronous calls at EP=1 (a captured ``previous_event``, ``async_with_compute_stream``,
``allocate_on_comm_stream``) against the synchronous ones. The test's own inputs and references are
made under torch's usual defaults, which every test restores after it.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from caller_defaults import caller_defaults, default_device  # noqa: E402
from gpu_cases import case_seed, cases_for, handle_to_cpu, random_routing, to_cpu  # noqa: E402
from test_gpu_backend import run_case  # noqa: E402

from deep_ep import reference as ref  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPE, DEVICE = torch.bfloat16, "cuda"
SUBSET = ("bf16", "bf16-expand-align128", "bf16-noweights-bias2", "bf16-nosync", "bf16-expand-nosync",
          "bf16-expand-empty-rank", "fp8-fp32-expand-colmajor", "fp8-ue8m0-colmajor-nosync")


def _subset(num_ranks: int) -> list:
    return [c for c in cases_for(num_ranks) if c.name.split("-", 1)[1] in SUBSET]


@pytest.fixture(autouse=True)
def _defaults_restored():
    yield
    assert torch.get_default_dtype() == torch.float32, "a test left the default dtype changed"
    assert torch.get_default_device().type == "cpu", "a test left the default device changed"


@pytest.mark.parametrize("case", _subset(1), ids=lambda c: c.name)
def test_ep1_real_nccl(case, nccl_group):
    def on_rank(body):
        with caller_defaults(DTYPE, DEVICE):
            return {0: body(nccl_group)}
    run_case(case, on_rank, torch.device("cuda", 0))


def test_emulated_two_ranks():
    """Every case of the subset on 2 emulated ranks (threads: the default device is set in each)."""
    from deep_ep.emulated import EmulatedGroup

    def in_thread(body):
        def run(rank_group):
            with default_device(DEVICE):
                return body(rank_group)
        return run

    dev = torch.device("cuda", 0)
    with caller_defaults(DTYPE, DEVICE):
        group = EmulatedGroup(2, device=dev)
    for case in _subset(2):
        def on_ranks(body):
            with caller_defaults(DTYPE, DEVICE):
                return group.run(in_thread(body))
        try:
            run_case(case, on_ranks, dev)
        except Exception as exc:
            raise AssertionError(f"case {case.name}: {exc}") from exc


def test_ep1_async_calls(nccl_group):
    """A dispatch and a combine waiting for a captured event, returning at once with an event and
    allocating on the communication stream, equal to the synchronous calls and to the reference."""
    import deep_ep

    num_tokens, hidden, num_topk, num_experts = 96, 512, 6, 32
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(case_seed("defaults-async"))
    x = torch.randn((num_tokens, hidden), generator=g, dtype=torch.float32).to(torch.bfloat16)
    topk_idx = random_routing(num_tokens, num_experts, num_topk, g)
    topk_weights = torch.rand((num_tokens, num_topk), generator=g, dtype=torch.float32)
    expected = ref.reference_dispatch([x], [topk_idx], [topk_weights], num_experts,
                                      num_max_tokens_per_rank=num_tokens)[0]
    x_dev, idx_dev, w_dev = x.to(dev), topk_idx.to(dev), topk_weights.to(dev)

    with caller_defaults(DTYPE, DEVICE):
        buf = deep_ep.ElasticBuffer(nccl_group, num_max_tokens_per_rank=num_tokens, hidden=hidden,
                                    num_topk=num_topk, explicitly_destroy=True)
        try:
            num_sms = buf.get_theoretical_num_sms(num_experts, num_topk)
            num_qps = buf.get_theoretical_num_qps(num_sms)
            args = dict(num_experts=num_experts, num_sms=num_sms, num_qps=num_qps,
                        num_max_tokens_per_rank=num_tokens)
            sync_out = buf.dispatch(x_dev, idx_dev, w_dev, **args)
            async_out = buf.dispatch(x_dev, idx_dev, w_dev, previous_event=buf.capture(),
                                     async_with_compute_stream=True, allocate_on_comm_stream=True, **args)
            async_out[4].current_stream_wait()
            recv_x = sync_out[0]
            y = (recv_x.float() * 0.5).to(torch.bfloat16)
            sync_comb = buf.combine(y, sync_out[3], topk_weights=sync_out[2], num_sms=num_sms)
            async_comb = buf.combine(y, async_out[3], topk_weights=sync_out[2], num_sms=num_sms,
                                     previous_event=buf.capture(), async_with_compute_stream=True,
                                     allocate_on_comm_stream=True)
            async_comb[2].current_stream_wait()
            buf.barrier()
            torch.cuda.synchronize()
            outs = [(to_cpu(out[0]), to_cpu(out[1]), to_cpu(out[2]), handle_to_cpu(out[3]))
                    for out in (sync_out, async_out)]
            combined = [(to_cpu(out[0]), to_cpu(out[1])) for out in (sync_comb, async_comb)]
            y_cpu = y.cpu()
        finally:
            buf.destroy()
    expected_comb = ref.reference_combine([y_cpu], [expected.handle], [expected.recv_topk_weights])[0]
    assert expected_comb[0].abs().sum() > 0
    for out in outs:
        ref.check_dispatch(out, expected)
    for out in combined:
        ref.check_combine(out, expected_comb)
