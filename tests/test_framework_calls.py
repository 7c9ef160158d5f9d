"""How SGLang, vLLM, Megatron-LM and TensorRT-LLM call DeepEP's V1 `deep_ep.Buffer`, replayed call by
call with their keywords (from their public sources, written here in our own code) on 2 gloo ranks.

Every result a framework reads is compared with the spec functions of tests/test_legacy_buffer.py
(normal mode) and tests/test_legacy_low_latency.py (low-latency mode): rows, ids, weights, counts,
layouts, and the combined values.
"""
import pytest
import torch
import torch.distributed as dist

import deep_ep
from proc_utils import run_gloo_ranks
from test_legacy_buffer import _assert_same, _inputs, spec_dispatch, spec_recv_x
from test_legacy_low_latency import (MAX_TOKENS, _check_dispatch, _expected_combine, _expert_output, _host,
                                     _rank_inputs, num_experts_for)

NUM_RANKS = 2
HIDDEN = 256                 # normal mode (bf16)
LOW_LATENCY_HIDDEN = 512     # low-latency mode (a multiple of 512 for UE8M0)


# ------------------------------------------------------------------------------------ expectations
def _check_normal_dispatch(result, inputs, num_experts, rank, alignment, config, with_weights=True):
    """The six results of a fresh normal-mode dispatch against the spec; returns the spec."""
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = result
    spec = spec_dispatch(inputs, num_experts, rank, alignment, config.num_channels)
    _assert_same("recv_x", recv_x, spec_recv_x(inputs, spec["rows"]))
    _assert_same("recv_topk_idx", recv_topk_idx, spec["recv_topk_idx"])
    if with_weights:
        _assert_same("recv_topk_weights", recv_topk_weights, spec["recv_topk_weights"])
    assert counts == spec["counts"] and len(handle) in (6, 10) and isinstance(event, deep_ep.EventOverlap)
    return spec


def _scaled(rows, factor):
    """What a rank's experts return in these replays: its rows times ``factor``, in bf16."""
    return (rows.float() * factor).to(torch.bfloat16)


def _expected_normal_combine(x, topk_idx, num_experts):
    """Normal-mode combine of `_scaled` rows (rank ``d`` scales by ``d + 1``): per token, float32,
    the rows of its ranks in rank order, one bf16 rounding."""
    num_local = num_experts // NUM_RANKS
    want = torch.zeros(x.shape, dtype=torch.float32)
    for token, row in enumerate(topk_idx.tolist()):
        for owner in sorted({expert // num_local for expert in row if expert >= 0}):
            want[token] += _scaled(x[token], owner + 1).float()
    return want.to(torch.bfloat16)


def _low_latency_round(buffer, rank, seed, use_fp8, round_scale, use_ue8m0, dispatch_call, combine_call):
    """One low-latency dispatch and combine, made by the framework's ``dispatch_call(x, topk_idx)`` and
    ``combine_call(expert_x, topk_idx, topk_weights, handle)``, both checked against the spec."""
    num_experts = num_experts_for(NUM_RANKS)
    num_local = num_experts // NUM_RANKS
    inputs = [_rank_inputs(seed, source, NUM_RANKS, num_experts, LOW_LATENCY_HIDDEN) for source in range(NUM_RANKS)]
    x, topk_idx, topk_weights = inputs[rank]
    recv_x, recv_count, handle = dispatch_call(x, topk_idx)
    received = _check_dispatch(rank, NUM_RANKS, num_experts, LOW_LATENCY_HIDDEN, inputs,
                               _host((recv_x, recv_count, handle)) + (None, None), use_fp8, round_scale, use_ue8m0)
    expert_x = torch.stack([_expert_output(received[local], rank * num_local + local) for local in range(num_local)])
    combined_x = combine_call(expert_x, topk_idx, topk_weights, handle)
    want = _expected_combine(rank, num_experts, LOW_LATENCY_HIDDEN, inputs, use_fp8, round_scale)
    assert torch.equal(combined_x, want)


# ------------------------------------------------------------------------------------ SGLang
def _sglang(rank, num_ranks):
    """SGLang's DeepEP dispatcher (token_dispatcher/deepep.py), "auto" mode: one buffer for normal
    (prefill) and low-latency (decode) calls, sizes from the configs' hints, clean on mode switch."""
    group = dist.group.WORLD
    num_experts = num_experts_for(num_ranks)
    config = deep_ep.Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                               "num_max_nvl_chunked_recv_tokens": 256, "num_max_rdma_chunked_send_tokens": 6,
                               "num_max_rdma_chunked_recv_tokens": 128})
    num_nvl_bytes = num_rdma_bytes = 0
    hidden_bytes = HIDDEN * 2
    for hint_config in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks),
                        config):
        num_nvl_bytes = max(hint_config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks), num_nvl_bytes)
        num_rdma_bytes = max(hint_config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks), num_rdma_bytes)
    num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, LOW_LATENCY_HIDDEN, num_ranks,
                                                                       num_experts), num_rdma_bytes)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, allow_mnnvl=True)
    assert buffer.group_size == num_ranks and deep_ep.Buffer.num_sms == 20

    for step, alignment in enumerate((128, 1)):
        # normal mode (prefill)
        inputs = _inputs(300 + step, [5, 7], num_experts, 3, HIDDEN, False)
        x, topk_idx, topk_weights = inputs[rank]
        previous_event = deep_ep.Buffer.capture()
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
            buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event, async_finish=True,
                                       allocate_on_comm_stream=True)
        result = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                 num_tokens_per_rank=num_tokens_per_rank,
                                 num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                                 num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event,
                                 async_finish=True, allocate_on_comm_stream=True, expert_alignment=alignment,
                                 config=config)
        result[5].current_stream_wait()
        _check_normal_dispatch(result, inputs, num_experts, rank, alignment, config)
        hidden_states, event = _scaled(result[0], rank + 1), buffer.capture()
        combined_x, _, event = buffer.combine(hidden_states, result[4], async_finish=True, previous_event=event,
                                              allocate_on_comm_stream=True,
                                              config=deep_ep.Buffer.get_combine_config(num_ranks))
        event.current_stream_wait()
        assert torch.equal(combined_x, _expected_normal_combine(x, topk_idx, num_experts))

        # low-latency mode (decode), after cleaning the buffer as SGLang does on a switch
        buffer.clean_low_latency_buffer(MAX_TOKENS, LOW_LATENCY_HIDDEN, num_experts)
        use_ue8m0 = step == 0

        def dispatch_call(x, topk_idx):
            recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
                x, topk_idx, MAX_TOKENS, num_experts, use_fp8=True, async_finish=False, return_recv_hook=True,
                round_scale=use_ue8m0, use_ue8m0=use_ue8m0)
            hook()
            return recv_x, recv_count, handle

        def combine_call(expert_x, topk_idx, topk_weights, handle):
            combined_x, event, hook = buffer.low_latency_combine(x=expert_x, topk_idx=topk_idx,
                                                                 topk_weights=topk_weights, handle=handle,
                                                                 async_finish=False, return_recv_hook=True)
            hook()
            return combined_x

        _low_latency_round(buffer, rank, 400 + step, True, use_ue8m0, use_ue8m0, dispatch_call, combine_call)
        buffer.clean_low_latency_buffer(MAX_TOKENS, LOW_LATENCY_HIDDEN, num_experts)


# ------------------------------------------------------------------------------------ vLLM
def _vllm(rank, num_ranks):
    """vLLM's DeepEP managers (all2all.py) and prepare/finalize (deepep_ht.py, deepep_ll.py): its
    gloo (CPU) group, explicitly destroyed buffers, the rank mask of elastic EP, the RDMA buffer
    zeroed, ``out=`` in combine."""
    cpu_group = dist.new_group(list(range(num_ranks)), backend="gloo")
    num_experts = num_experts_for(num_ranks)
    old_num_sms = deep_ep.Buffer.num_sms
    try:
        # high-throughput
        deep_ep.Buffer.set_num_sms(24)
        ht = deep_ep.Buffer(group=cpu_group, num_nvl_bytes=1 << 20, num_rdma_bytes=0, low_latency_mode=False,
                            num_qps_per_rank=1, explicitly_destroy=True)
        inputs = _inputs(500, [6, 4], num_experts, 3, HIDDEN, False)
        x, topk_idx, topk_weights = inputs[rank]
        previous_event = ht.capture()
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
            ht.get_dispatch_layout(topk_idx=topk_idx, num_experts=num_experts, previous_event=previous_event,
                                   async_finish=False, allocate_on_comm_stream=False)
        config = ht.get_dispatch_config(num_ranks)
        assert config.num_sms == 24
        result = ht.dispatch(x=x, handle=None, num_tokens_per_rank=num_tokens_per_rank,
                             num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                             num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                             expert_alignment=1, config=config, previous_event=event, async_finish=True,
                             allocate_on_comm_stream=False)
        dispatch_event = result[5]
        assert hasattr(dispatch_event, "event")
        dispatch_event.current_stream_wait()
        _check_normal_dispatch(result, inputs, num_experts, rank, 1, config)
        combined_x, combined_weights, event = ht.combine(x=_scaled(result[0], rank + 1), handle=result[4],
                                                         topk_weights=None, config=ht.get_combine_config(num_ranks),
                                                         previous_event=None, async_finish=True,
                                                         allocate_on_comm_stream=False)
        event.current_stream_wait()
        assert combined_weights is None
        assert torch.equal(combined_x, _expected_normal_combine(x, topk_idx, num_experts))
        ht.destroy()

        # low latency
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=MAX_TOKENS, hidden=LOW_LATENCY_HIDDEN, num_ranks=num_ranks,
            num_experts=num_experts)
        ll = deep_ep.Buffer(group=cpu_group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True,
                            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, enable_shrink=True)
        ll.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
        mask_status = torch.ones(num_ranks, dtype=torch.int32)
        ll.low_latency_query_mask_buffer(mask_status)
        assert mask_status.tolist() == [0] * num_ranks
        ll.low_latency_clean_mask_buffer()

        for step, (use_fp8, round_scale) in enumerate(((True, False), (True, True), (False, False))):
            def dispatch_call(a1, topk_ids):
                recv_x, recv_count, handle, event, hook = ll.low_latency_dispatch(
                    a1, topk_ids, MAX_TOKENS, num_experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=False,
                    async_finish=False, return_recv_hook=True)
                hook()
                return recv_x, recv_count, handle

            def combine_call(fused_expert_output, topk_ids, topk_weights, handle):
                output = torch.empty((topk_ids.shape[0], LOW_LATENCY_HIDDEN), dtype=torch.bfloat16)
                combined_x, event, hook = ll.low_latency_combine(fused_expert_output, topk_ids, topk_weights, handle,
                                                                 async_finish=False, zero_copy=False,
                                                                 return_recv_hook=True, out=output)
                hook()
                assert combined_x is output
                return output

            _low_latency_round(ll, rank, 600 + step, use_fp8, round_scale, False, dispatch_call, combine_call)
        ll.destroy()
    finally:
        deep_ep.Buffer.num_sms = old_num_sms


# ------------------------------------------------------------------------------------ Megatron-LM
class _FusedDispatch(torch.autograd.Function):
    """Megatron-LM's fused dispatch (fused_a2a.py): forward a dispatch with float32 weights, backward a
    combine of the gradients with the weights' gradients."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, buffer):
        from deep_ep.utils import EventHandle, EventOverlap
        previous_event = EventOverlap(EventHandle())
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
            buffer.get_dispatch_layout(token_indices, num_experts, previous_event=previous_event, async_finish=True,
                                       allocate_on_comm_stream=True)
        recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle, after_event = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs.float(), num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=event, async_finish=True,
            allocate_on_comm_stream=True)
        after_event.current_stream_wait()
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_token_indices)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        grad_x, grad_token_probs, after_event = ctx.buffer.combine(
            grad_output.contiguous(), ctx.handle, topk_weights=grad_token_probs.float(), previous_event=None,
            async_finish=True, allocate_on_comm_stream=True)
        after_event.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None


class _FusedCombine(torch.autograd.Function):
    """Megatron-LM's fused combine: forward a combine, backward a cached dispatch of the gradient."""

    @staticmethod
    def forward(ctx, x, handle, buffer):
        combined_x, _, after_event = buffer.combine(x, handle=handle, async_finish=True, previous_event=None,
                                                    allocate_on_comm_stream=True)
        after_event.current_stream_wait()
        ctx.buffer, ctx.handle = buffer, handle
        return combined_x

    @staticmethod
    def backward(ctx, grad_output):
        from deep_ep.utils import EventHandle, EventOverlap
        grad_x, _, _, _, _, after_event = ctx.buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                              previous_event=EventOverlap(EventHandle()),
                                                              async_finish=True, allocate_on_comm_stream=True)
        after_event.current_stream_wait()
        return grad_x, None, None


def _megatron(rank, num_ranks):
    """Megatron-LM's (and torchtitan's) training path: dispatch and combine as autograd functions."""
    group = dist.group.WORLD
    num_experts = 4 * num_ranks
    old_num_sms = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(20)
        buffer = deep_ep.Buffer(group, 1 << 20, 0)
        inputs = _inputs(700, [7, 5], num_experts, 3, HIDDEN, False)
        x, topk_idx, topk_weights = inputs[rank]
        x = x.clone().requires_grad_()
        probs = topk_weights.clone().requires_grad_()
        recv_x, recv_indices, recv_probs, tokens_per_expert, handle = _FusedDispatch.apply(
            x, topk_idx, probs, num_experts, buffer)
        config = deep_ep.Buffer.get_dispatch_config(num_ranks)
        _check_normal_dispatch((recv_x.detach(), recv_indices, recv_probs.detach(), tokens_per_expert, handle,
                                deep_ep.EventOverlap()), inputs, num_experts, rank, 1, config)

        # the experts: rows times (rank + 1), then the combine; its backward is a cached dispatch
        expert_out = _scaled(recv_x, rank + 1)
        combined = _FusedCombine.apply(expert_out, handle, buffer)
        assert torch.equal(combined.detach(), _expected_normal_combine(x.detach(), topk_idx, num_experts))
        grads = _inputs(800, [7, 5], num_experts, 3, HIDDEN, False)
        loss_probs = (recv_probs * (rank + 1)).sum()
        torch.autograd.backward([combined, loss_probs], [grads[rank][0], None])
        # combine's backward sent grads[s][t] to the rows of (s, t); dispatch's backward summed them
        # back, times (rank + 1) from the experts' scaling, in rank order
        owners = [sorted({e // (num_experts // num_ranks) for e in row if e >= 0}) for row in topk_idx.tolist()]
        want = torch.zeros(x.shape)
        for token, token_owners in enumerate(owners):
            for owner in token_owners:
                want[token] += _scaled(grads[rank][0][token], owner + 1).float()
        assert torch.equal(x.grad, want.to(torch.bfloat16))
        # every rank a token went to sends its whole row of weight gradients back (rank + 1 each here),
        # summed per column (DeepEP's reduction, which Megatron-LM takes as the probabilities' gradient)
        want_probs = torch.tensor([[float(sum(owner + 1 for owner in token_owners))] * topk_idx.shape[1]
                                   for token_owners in owners])
        assert torch.equal(probs.grad, want_probs)
    finally:
        deep_ep.Buffer.num_sms = old_num_sms


# ------------------------------------------------------------------------------------ TensorRT-LLM
def _tensorrt_llm(rank, num_ranks):
    """TensorRT-LLM's vendored V1 buffer (deep_ep_utils.py): positional low-latency calls, BF16
    dispatch, no hooks, consecutive decode steps."""
    num_experts = num_experts_for(num_ranks)
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, LOW_LATENCY_HIDDEN, num_ranks,
                                                                   num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks)

    def dispatch_call(x, topk_idx):
        recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts,
                                                                              use_fp8=False)
        assert hook is None
        return recv_x, recv_count, handle

    def combine_call(expert_x, topk_idx, topk_weights, handle):
        combined_x, event, hook = buffer.low_latency_combine(expert_x, topk_idx, topk_weights, handle)
        assert hook is None
        return combined_x

    for step in range(3):
        _low_latency_round(buffer, rank, 900 + step, False, False, False, dispatch_call, combine_call)


@pytest.mark.parametrize("replay", [_sglang, _vllm, _megatron, _tensorrt_llm],
                         ids=["sglang", "vllm", "megatron", "tensorrt_llm"])
def test_framework_calls(replay, tmp_path):
    run_gloo_ranks(replay, NUM_RANKS, tmp_path, deadline=120)
