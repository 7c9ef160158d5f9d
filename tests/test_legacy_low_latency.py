"""DeepEP's V1 low-latency mode (`deep_ep.Buffer.low_latency_dispatch` / `low_latency_combine`) on the
CPU backend over gloo, 1, 2 and 4 ranks.

The checks are those of DeepEP's tests/legacy/test_low_latency.py, re-derived: every rank builds every
rank's inputs from a shared seed and computes here what each local expert must receive (counts, the
per-source layout ranges, source token indices, the rows, FP8 data and scales cast per 128 channels,
float or packed UE8M0 scales in column-major order) and what combine must return (the top-k weighted
sum, in float32 and slot order, of the expert outputs), and compares every element. Hooks, zero-copy
combine, ``out=`` and the refusals are checked too, and DeepEP's double buffering: two results alive
at once (hooks called in either order, equal bit for bit to calls without hooks), and the errors of
a third call, a combine before its dispatch's hook or on a held buffer half, and a second hook call.
Rows past the counts are undefined (DeepEP's): the receive must not pass over the whole layout.
"""
import math

import pytest
import torch
import torch.distributed as dist

import deep_ep
from proc_utils import run_gloo_ranks
from test_legacy_buffer import _to

FP8 = torch.float8_e4m3fn
MAX_TOKENS = 8                      # num_max_dispatch_tokens_per_rank
NUM_TOPK = 3


def _rank_inputs(seed, source, num_ranks, num_experts, hidden):
    """Rank ``source``'s ``(x, topk_idx, topk_weights)``, with masked slots and unique experts per token."""
    generator = torch.Generator().manual_seed(seed * 1000 + source)
    num_tokens = (source * 5 + 3) % (MAX_TOKENS + 1)
    x = (torch.randn(num_tokens, hidden, generator=generator) * 3).to(torch.bfloat16)
    x[:, -128:] = torch.arange(num_tokens, dtype=torch.bfloat16).view(-1, 1)      # DeepEP's token-index tail
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_idx = scores.topk(NUM_TOPK, dim=1).indices
    mask = torch.rand(num_tokens, NUM_TOPK, generator=generator) < 0.2
    topk_idx = torch.where(mask, -1, topk_idx).to(deep_ep.topk_idx_t)
    topk_weights = torch.rand(num_tokens, NUM_TOPK, generator=generator) + 0.1
    return x, topk_idx, topk_weights


def _reference_cast(row, round_scale):
    """One token through DeepEP's FP8 rule, block by block: (fp8 [H], scale_inv float32 [H/128])."""
    data, scales = [], []
    inverse_max = torch.tensor(1 / 448.0, dtype=torch.float32)
    for block in row.float().split(128):
        amax = torch.tensor(max(block.abs().max().item(), 1e-4), dtype=torch.float32)
        if round_scale:
            exponent = math.ceil(math.log2((amax * inverse_max).item()))
            scale, scale_inv = torch.tensor(2.0 ** -exponent), torch.tensor(2.0 ** exponent)
        else:
            scale_inv, scale = amax * inverse_max, torch.tensor(448.0, dtype=torch.float32) / amax
        data.append((block * scale).clamp(-448, 448).to(FP8))
        scales.append(scale_inv.float())
    return torch.cat(data), torch.stack(scales)


def _cast_back(data, scales):
    """bf16 of FP8 rows ``[N, H]`` times their float32 scales ``[N, H/128]``."""
    rows = data.float().view(data.shape[0], -1, 128) * scales.unsqueeze(-1)
    return rows.view(data.shape).to(torch.bfloat16)


def _expert_output(rows, expert):
    """The simulated expert GEMM: a factor that differs per expert, so that a misrouted row shows."""
    return (rows.float() * (1 + expert % 3)).to(torch.bfloat16)


def _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, result, use_fp8, round_scale, use_ue8m0,
                    linked=None):
    """Every element of a dispatch's results; ``linked``: the source ranks this rank exchanges with
    under the rank masks (default all)."""
    linked = set(range(num_ranks)) if linked is None else linked
    recv_x, recv_count, handle, _, _ = result
    num_local = num_experts // num_ranks
    num_rows = num_ranks * MAX_TOKENS
    src_info, layout_range, max_tokens, handle_hidden, handle_experts = handle
    assert (max_tokens, handle_hidden, handle_experts) == (MAX_TOKENS, hidden, num_experts)
    assert src_info.dtype == torch.int32 and src_info.shape == (num_local, num_rows)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (num_local, num_ranks)
    assert recv_count.dtype == torch.int32 and recv_count.shape == (num_local,)
    if use_fp8:
        data, scales = recv_x
        assert data.dtype == FP8 and data.shape == (num_local, num_rows, hidden)
        num_packed = hidden // 512 if use_ue8m0 else hidden // 128
        assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
        assert scales.shape == (num_local, num_rows, num_packed)
        assert scales.stride() == (num_rows * num_packed, 1, num_rows)          # column-major
        if use_ue8m0:
            exponent_bytes = scales.transpose(1, 2).contiguous().view(torch.uint8)
            exponent_bytes = exponent_bytes.view(num_local, num_packed, num_rows, 4).permute(0, 2, 1, 3)
            scales = (exponent_bytes.reshape(num_local, num_rows, hidden // 128).to(torch.int32) << 23) \
                .view(torch.float32)
    else:
        assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (num_local, num_rows, hidden)
    total_received = 0
    for local_expert in range(num_local):
        expert = rank * num_local + local_expert
        begin = 0
        for source in range(num_ranks):
            x, topk_idx, _ = inputs[source]
            tokens = (topk_idx == expert).any(dim=1).nonzero().flatten()
            if source not in linked:
                tokens = tokens[:0]
            count = tokens.numel()
            packed = int(layout_range[local_expert, source])
            assert (packed >> 32, packed & 0xFFFFFFFF) == (begin, count), (expert, source)
            assert src_info[local_expert, begin:begin + count].tolist() == tokens.tolist()
            for offset, token in enumerate(tokens.tolist()):
                row = begin + offset
                if use_fp8:
                    want_data, want_scales = _reference_cast(x[token], round_scale)
                    assert torch.equal(data[local_expert, row].view(torch.uint8), want_data.view(torch.uint8))
                    assert torch.equal(scales[local_expert, row], want_scales)
                    if round_scale:
                        assert torch.equal(torch.frexp(want_scales).mantissa, torch.full_like(want_scales, 0.5))
                else:
                    assert torch.equal(recv_x[local_expert, row], x[token])
            begin += count
        assert int(recv_count[local_expert]) == begin
        assert sum(int((inputs[source][1] == expert).sum()) for source in linked) == begin
        total_received += begin
    assert total_received > 0 or len(linked) < num_ranks
    # DeepEP's own data checks: the token-index tail survives exactly without rounded scales
    if use_fp8:
        received = _cast_back(recv_x[0].view(-1, hidden), scales.reshape(-1, hidden // 128)).view(
            num_local, num_rows, hidden)
    else:
        received = recv_x
    for local_expert in range(num_local):
        count = int(recv_count[local_expert])
        tail = received[local_expert, :count, -128:].float()
        want = src_info[local_expert, :count].float().view(-1, 1).expand_as(tail)
        if not round_scale:
            assert torch.equal(tail, want)
    return received


def _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale, linked=None):
    x, topk_idx, topk_weights = inputs[rank]
    num_local = num_experts // len(inputs)
    total = torch.zeros(x.shape[0], hidden)
    for token in range(x.shape[0]):
        row = x[token:token + 1]
        if use_fp8:
            data, scales = _reference_cast(x[token], round_scale)
            row = _cast_back(data.view(1, -1), scales.view(1, -1))
        for slot in range(NUM_TOPK):
            expert = int(topk_idx[token, slot])
            if expert >= 0 and (linked is None or expert // num_local in linked):
                total[token] += _expert_output(row[0], expert).float() * topk_weights[token, slot]
    return total.to(torch.bfloat16)


def _host(obj):
    """Tensors (in tuples) back on the CPU, other values as they are (`test_legacy_buffer._to`)."""
    if isinstance(obj, tuple):
        return tuple(_host(item) for item in obj)
    return _to(obj, "cpu") if isinstance(obj, torch.Tensor) else obj


def _run_case(buffer, rank, num_ranks, num_experts, hidden, seed, use_fp8, round_scale, use_ue8m0, use_hook,
              device="cpu"):
    """One case on this rank; inputs go to ``device`` (CPU over gloo, or a GPU), results come back to
    the CPU to be compared."""
    inputs = [_rank_inputs(seed, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
    x, topk_idx, topk_weights = _to(inputs[rank], device)
    num_local = num_experts // num_ranks
    stats = torch.zeros(num_local, dtype=torch.int32, device=device)
    result = None
    for _ in range(2):                                            # stats accumulate over calls
        result = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts,
                                             cumulative_local_expert_recv_stats=stats,
                                             dispatch_wait_recv_cost_stats=torch.zeros(num_ranks, dtype=torch.int64,
                                                                                       device=device),
                                             use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                             async_finish=not use_hook, return_recv_hook=use_hook)
        hook, event = result[4], result[3]
        if use_hook:
            hook()
            with pytest.raises(RuntimeError, match="already called"):
                hook()
        else:
            assert hook is None
            event.current_stream_wait()
    host_result = _host(result[:3]) + (None, None)
    assert torch.equal(_host(stats), host_result[1] * 2)
    received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, host_result, use_fp8, round_scale,
                               use_ue8m0)
    handle = result[2]
    expert_x = torch.stack([_expert_output(received[local], rank * num_local + local) for local in range(num_local)])
    expert_x = _to(expert_x, device)
    want = _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale)
    for zero_copy in (False, True):
        source_x = expert_x
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = expert_x
            source_x = torch.zeros_like(expert_x)                # zero-copy reads the buffer, not x
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
        combined, event, hook = buffer.low_latency_combine(source_x, topk_idx, topk_weights, handle,
                                                           zero_copy=zero_copy, async_finish=not use_hook,
                                                           return_recv_hook=use_hook, out=out)
        if use_hook:
            hook()
            with pytest.raises(RuntimeError, match="already called"):
                hook()
        else:
            event.current_stream_wait()
        assert combined is out
        assert torch.equal(_host(combined), want), (rank, use_fp8, round_scale, zero_copy)
    combined, _, hook = buffer.low_latency_combine(expert_x, topk_idx, topk_weights, handle)
    assert hook is None and torch.equal(_host(combined), want)


def _check_refusals(buffer, normal_buffer, rank, num_ranks, num_experts, hidden):
    x, topk_idx, topk_weights = _rank_inputs(99, rank, num_ranks, num_experts, hidden)
    with pytest.raises(RuntimeError, match="low_latency_mode=True"):
        normal_buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts)
    with pytest.raises(ValueError, match="async_finish and return_recv_hook"):
        buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, async_finish=True, return_recv_hook=True)
    big = torch.zeros(MAX_TOKENS + 1, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"{MAX_TOKENS + 1} tokens.*num_max_dispatch_tokens_per_rank={MAX_TOKENS}"):
        buffer.low_latency_dispatch(big, torch.zeros(MAX_TOKENS + 1, 1, dtype=torch.int64), MAX_TOKENS, num_experts)
    with pytest.raises(ValueError, match="round_scale"):
        buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_ue8m0=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        buffer.low_latency_dispatch(torch.zeros(2, 200, dtype=torch.bfloat16), topk_idx[:2], MAX_TOKENS,
                                    num_experts)
    with pytest.raises(ValueError, match="multiple of 512"):
        buffer.low_latency_dispatch(torch.zeros(2, 384, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int64),
                                    MAX_TOKENS, num_experts, round_scale=True, use_ue8m0=True)
    with pytest.raises(ValueError, match="names an expert twice"):
        buffer.low_latency_dispatch(torch.zeros(1, hidden, dtype=torch.bfloat16),
                                    torch.tensor([[1, 1]], dtype=torch.int64), MAX_TOKENS, num_experts)
    with pytest.raises(ValueError, match="expert id"):
        buffer.low_latency_dispatch(torch.zeros(1, hidden, dtype=torch.bfloat16),
                                    torch.tensor([[num_experts]], dtype=torch.int64), MAX_TOKENS, num_experts)
    with pytest.raises(ValueError, match="num_rdma_bytes=.*get_low_latency_rdma_size_hint"):
        buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS * 1000, num_experts)
    with pytest.raises(TypeError, match="cumulative_local_expert_recv_stats must have dtype int32"):
        buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts,
                                    cumulative_local_expert_recv_stats=torch.zeros(num_experts // num_ranks))
    if num_ranks > 1:
        mixed_hidden = 512 if rank == 0 else 384                  # every rank raises, none hangs
        with pytest.raises(RuntimeError, match="ranks disagree on hidden"):
            buffer.low_latency_dispatch(torch.zeros(1, mixed_hidden, dtype=torch.bfloat16),
                                        torch.zeros(1, 1, dtype=torch.int64), MAX_TOKENS, num_experts, use_fp8=False)
    handle = (torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int64), MAX_TOKENS, hidden,
              num_experts)
    with pytest.raises(NotImplementedError, match=r"low_latency_combine\(use_logfmt=True\).*planned"):
        buffer.low_latency_combine(None, topk_idx, topk_weights, handle, use_logfmt=True)
    with pytest.raises(TypeError, match="handle must be"):
        buffer.low_latency_combine(None, topk_idx, topk_weights, handle[:4])
    with pytest.raises(ValueError, match="x must have shape"):
        buffer.low_latency_combine(torch.zeros(1, 1, hidden, dtype=torch.bfloat16), topk_idx, topk_weights, handle)
    # a real handle: passed back rebuilt, or with another top-k width, it is refused before sending
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)
    with pytest.raises(TypeError, match="rebuilt from its items"):
        buffer.low_latency_combine(recv_x, topk_idx, topk_weights, tuple(handle))
    with pytest.raises(ValueError, match="the dispatch's shape"):
        buffer.low_latency_combine(recv_x, topk_idx[:, :2].contiguous(), topk_weights[:, :2].contiguous(), handle)
    combined, _, _ = buffer.low_latency_combine(recv_x, topk_idx, topk_weights, handle)     # still in step
    assert combined.shape == x.shape


def num_experts_for(num_ranks):
    """Experts of the cases: at least NUM_TOPK, two or more per rank (three at 2 ranks)."""
    return max(2 * num_ranks + 2 if num_ranks == 2 else 2 * num_ranks, NUM_TOPK + 1)


#: (hidden, use_fp8, round_scale, use_ue8m0)
CASES = [(384, False, False, False), (384, True, False, False), (384, True, True, False), (512, True, True, True)]


def run_cases(buffer, rank, num_ranks, device="cpu"):
    """Every case, with and without receive hooks, on ``device`` (the GPU suite runs them too)."""
    num_experts = num_experts_for(num_ranks)
    for index, (hidden, use_fp8, round_scale, use_ue8m0) in enumerate(CASES):
        for use_hook in (False, True):
            try:
                _run_case(buffer, rank, num_ranks, num_experts, hidden, index, use_fp8, round_scale, use_ue8m0,
                          use_hook, device)
            except Exception as exc:
                raise AssertionError(f"hidden {hidden} fp8 {use_fp8} round {round_scale} ue8m0 {use_ue8m0} "
                                     f"hook {use_hook}, rank {rank} of {num_ranks}: {exc}") from exc


def _linked(masks, rank, num_ranks):
    """The ranks ``rank`` exchanges with when rank ``r`` masks ``masks[r]``: neither masks the other."""
    return {peer for peer in range(num_ranks) if peer not in masks[rank] and rank not in masks[peer]}


def run_mask_cases(buffer, rank, num_ranks, device="cpu", use_hook=True):
    """Rank masks (``enable_shrink``): every rank but rank 1 masks rank 1, rank 0 also masks the last
    rank (4 ranks and more); a rank exchanges with a peer when neither masks the other. A combine
    follows its dispatch: each rank masks one more peer between the two, which changes nothing until
    the next dispatch. Then the masks are cleared and everything is exchanged again. The dispatches
    use a receive hook unless ``use_hook`` is False."""
    num_experts = num_experts_for(num_ranks)
    num_local = num_experts // num_ranks
    masks = {r: set() for r in range(num_ranks)}
    if num_ranks >= 2:
        for r in range(num_ranks):
            if r != 1:
                masks[r].add(1)
    if num_ranks >= 4:
        masks[0].add(num_ranks - 1)
    status = torch.full((num_ranks,), 7, dtype=torch.int32, device=device)
    buffer.low_latency_query_mask_buffer(status)
    assert _host(status).tolist() == [0] * num_ranks
    buffer.low_latency_update_mask_buffer(0, True)             # then unmasked again
    buffer.low_latency_update_mask_buffer(0)
    for peer in masks[rank]:
        buffer.low_latency_update_mask_buffer(peer, mask=True)
    buffer.low_latency_query_mask_buffer(status)
    assert _host(status).tolist() == [int(r in masks[rank]) for r in range(num_ranks)]
    for round_index, linked in enumerate((_linked(masks, rank, num_ranks), None)):
        hidden, use_fp8, round_scale, use_ue8m0 = CASES[1 + round_index]
        inputs = [_rank_inputs(50 + round_index, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
        x, topk_idx, topk_weights = _to(inputs[rank], device)
        result = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=use_fp8,
                                             round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=use_hook)
        if use_hook:
            result[4]()
        received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs, _host(result[:3]) + (None, None),
                                   use_fp8, round_scale, use_ue8m0, linked)
        expert_x = torch.stack([_expert_output(received[local], rank * num_local + local)
                                for local in range(num_local)])
        if num_ranks >= 2:                      # after the dispatch: its combine does not see it
            buffer.low_latency_update_mask_buffer((rank + 1) % num_ranks, True)
        combined, _, _ = buffer.low_latency_combine(_to(expert_x, device), topk_idx, topk_weights, result[2])
        want = _expected_combine(rank, num_experts, hidden, inputs, use_fp8, round_scale, linked)
        assert torch.equal(_host(combined), want), (rank, linked)
        buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    assert _host(status).tolist() == [0] * num_ranks
    with pytest.raises(ValueError, match="rank_to_mask"):
        buffer.low_latency_update_mask_buffer(num_ranks, True)
    with pytest.raises(TypeError, match="mask_status must have dtype int32"):
        buffer.low_latency_query_mask_buffer(torch.zeros(num_ranks, dtype=torch.int64, device=device))


def _raw(result):
    """A dispatch's ``(recv_x, recv_count, handle)`` on the host, FP8 data as bytes, rows past the counts
    (undefined, as DeepEP's) zeroed: compared bit for bit."""
    recv_x, recv_count, handle = _host(result[:3])
    past = torch.arange(handle[0].shape[1]).unsqueeze(0) >= recv_count.unsqueeze(1)     # [L, R*T_max]
    if isinstance(recv_x, tuple):
        recv_x = tuple(torch.where(past.unsqueeze(-1), 0, part.view(torch.uint8) if part.dtype == FP8 else part)
                       for part in recv_x)
    else:
        recv_x = torch.where(past.unsqueeze(-1), 0, recv_x)
    return recv_x, recv_count, tuple(handle)


def _equal(left, right) -> bool:
    if isinstance(left, tuple):
        return len(left) == len(right) and all(_equal(a, b) for a, b in zip(left, right))
    return torch.equal(left, right) if isinstance(left, torch.Tensor) else left == right


def run_double_buffer_cases(buffer, rank, num_ranks, device="cpu"):
    """DeepEP's double buffering. Two FP8 dispatches with receive hooks in flight, hooked in the other
    order, equal bit for bit to the same dispatches without hooks (and the spec); a third call while
    both are pending (with or without a hook), a combine before its dispatch's hook, a combine on the
    buffer half another pending hook holds and a second call of a hook raise RuntimeError on every
    rank, before anything is sent (the calls after them still pair up); combines with hooks equal the
    spec and the combine without a hook; two micro-batches interleave (dispatch a, its hook, dispatch
    b, combine a)."""
    num_experts = num_experts_for(num_ranks)
    num_local = num_experts // num_ranks
    hidden, use_fp8, round_scale, use_ue8m0 = CASES[2]
    seeds = (60, 61, 62)
    inputs = {seed: [_rank_inputs(seed, source, num_ranks, num_experts, hidden) for source in range(num_ranks)]
              for seed in seeds}
    local = {seed: _to(inputs[seed][rank], device) for seed in seeds}

    def dispatch(seed, use_hook):
        x, topk_idx, _ = local[seed]
        return buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=use_fp8,
                                           round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=use_hook)

    def combine(seed, expert_x, handle, use_hook):
        _, topk_idx, topk_weights = local[seed]
        return buffer.low_latency_combine(expert_x, topk_idx, topk_weights, handle, return_recv_hook=use_hook)

    plain = {seed: _raw(dispatch(seed, False)) for seed in seeds}
    first, second = dispatch(60, True), dispatch(61, True)
    for use_hook in (True, False):
        with pytest.raises(RuntimeError, match="two low-latency results are alive"):
            dispatch(62, use_hook)
    empty = torch.zeros(num_local, num_ranks * MAX_TOKENS, hidden, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="receive hook of the low_latency_dispatch that made this handle was not"):
        combine(60, empty, first[2], False)
    second[4]()
    first[4]()
    with pytest.raises(RuntimeError, match="already called"):
        first[4]()
    expert_x = {}
    for seed, result in ((60, first), (61, second)):
        assert _equal(_raw(result), plain[seed]), (rank, seed)
        received = _check_dispatch(rank, num_ranks, num_experts, hidden, inputs[seed], _host(result[:3]) + (None, None),
                                   use_fp8, round_scale, use_ue8m0)
        expert_x[seed] = _to(torch.stack([_expert_output(received[index], rank * num_local + index)
                                          for index in range(num_local)]), device)
    # first's combine holds its half (0); the next dispatch takes the other, the second dispatch's
    combine_first = combine(60, expert_x[60], first[2], True)
    third = dispatch(62, True)
    with pytest.raises(RuntimeError, match="buffer half of this handle's dispatch is held by a low_latency_dispatch"):
        combine(61, expert_x[61], second[2], True)
    third[4]()
    combine_first[2]()
    with pytest.raises(RuntimeError, match="already called"):
        combine_first[2]()
    assert _equal(_raw(third), plain[62])
    combine_second = combine(61, expert_x[61], second[2], True)
    combine_second[2]()
    for seed, result, handle in ((60, combine_first, first[2]), (61, combine_second, second[2])):
        want = _expected_combine(rank, num_experts, hidden, inputs[seed], use_fp8, round_scale)
        assert torch.equal(_host(result[0]), want), (rank, seed)
        assert torch.equal(_host(combine(seed, expert_x[seed], handle, False)[0]), want), (rank, seed)
    # two micro-batches overlapped as serving frameworks do: a's dispatch and hook, b's dispatch, then
    # a's combine: b's dispatch takes the half whose dispatch was combined, never a's
    combine(62, expert_x[61], third[2], False)
    batch_a = dispatch(60, True)
    batch_a[4]()
    batch_b = dispatch(61, True)
    assert batch_a[2].slot != batch_b[2].slot
    combine_a = combine(60, expert_x[60], batch_a[2], True)
    batch_b[4]()
    combine_a[2]()
    combine_b = combine(61, expert_x[61], batch_b[2], True)
    combine_b[2]()
    for seed, result in ((60, combine_a), (61, combine_b)):
        want = _expected_combine(rank, num_experts, hidden, inputs[seed], use_fp8, round_scale)
        assert torch.equal(_host(result[0]), want), (rank, seed)


def _check_clean(buffer, rank, num_ranks, num_experts):
    """`clean_low_latency_buffer` zeroes both zero-copy combine buffers of its sizes, which a dispatch
    alternates between, and a fresh buffer's come zeroed (a clean there makes none)."""
    x, topk_idx, _ = _rank_inputs(77, rank, num_ranks, num_experts, 512)
    handle = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)[2]
    first = buffer.get_next_low_latency_combine_buffer(handle)
    first.fill_(1.5)
    handle = buffer.low_latency_dispatch(x, topk_idx, MAX_TOKENS, num_experts, use_fp8=False)[2]
    second = buffer.get_next_low_latency_combine_buffer(handle)
    second.fill_(-2.0)
    assert first.data_ptr() != second.data_ptr() and bool((first == 1.5).all()) and bool((second == -2.0).all())
    buffer.clean_low_latency_buffer(MAX_TOKENS, 512, num_experts)
    assert not first.any() and not second.any()
    fresh = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=buffer.num_rdma_bytes, low_latency_mode=True)
    fresh.clean_low_latency_buffer(MAX_TOKENS, 512, num_experts)
    assert "_low_latency_state" not in fresh.__dict__
    assert not fresh.get_next_low_latency_combine_buffer(handle).any()


def _worker(rank, num_ranks):
    num_experts = num_experts_for(num_ranks)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, 512, num_ranks, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True)
    normal_buffer = deep_ep.Buffer(dist.group.WORLD)
    run_cases(buffer, rank, num_ranks)
    run_double_buffer_cases(buffer, rank, num_ranks)
    _check_clean(buffer, rank, num_ranks, num_experts)
    _check_refusals(buffer, normal_buffer, rank, num_ranks, num_experts, 512)
    shrink_buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True)
    run_mask_cases(shrink_buffer, rank, num_ranks)
    for call in (lambda: buffer.low_latency_update_mask_buffer(0, True), buffer.low_latency_clean_mask_buffer,
                 lambda: buffer.low_latency_query_mask_buffer(torch.zeros(num_ranks, dtype=torch.int32))):
        with pytest.raises(RuntimeError, match="enable_shrink=True"):
            call()


def test_size_hint_is_deepeps():
    # DeepEP's layout for 128 tokens, hidden 7168, 64 experts: two sets of send and receive buffers of
    # 128 * 64 * (14336 + 224) bytes each (the combine messages are the larger) and of 256 signal bytes,
    # plus one alignment step of 128.
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 64) == 2 * (2 * 128 * 64 * 14560 + 256) + 128
    with pytest.raises(ValueError, match="multiple of 128"):
        deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 100, 8, 64)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_low_latency_dispatch_combine(world_size, tmp_path):
    run_gloo_ranks(_worker, world_size, tmp_path, deadline=120)


@pytest.mark.parametrize("phase", ["send", "receive"])
def test_split_phase_kernels_compile(phase):
    """The data kernels a receive hook splits (kernels/dispatch.cuh, kernels/combine.cuh with
    EP_DATA_PHASES) compile under NVRTC without spills, for the pair dispatch of the decode shape
    (FP8, hidden 7168, one expert per row, expanded) and its combine."""
    from deep_ep import jit
    from deep_ep.backends import gpu
    from deep_ep.backends.gpu import modules
    phases = modules.SEND_PHASE if phase == "send" else modules.RECEIVE_PHASE
    dispatch = jit.build("deep_ep_dispatch_test", gpu.kernel_source("dispatch"),
                         defines=gpu.dispatch_defines(7168, 56, 1, True, phases), check_spills=True)
    assert modules.DISPATCH_KERNEL in dispatch.kernel_names()
    combine = jit.build("deep_ep_combine_test", gpu.kernel_source("combine"),
                        defines=gpu.combine_defines(7168, 1, True, phases), check_spills=True)
    assert combine.kernel_names() == [modules.COMBINE_KERNEL]
    with pytest.raises(ValueError, match="phases"):
        gpu.dispatch_defines(7168, 56, 1, True, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_legacy_ll_needs_a_gpu():
    """``python -m deep_ep bench --legacy-ll`` (deep_ep/bench/legacy_ll.py) runs on the GPU only."""
    from deep_ep.__main__ import main
    with pytest.raises(SystemExit, match="--legacy-ll runs on the GPU"):
        main(["bench", "--legacy-ll"])


def test_bench_sizes_its_matmul_without_every_graph_timing(capsys):
    """The bench's matmul follows the longest timed call; a missing time (a failed capture) leaves
    the rows as they are, with a warning, instead of failing on NaN."""
    from deep_ep.bench.legacy_ll import _matmul_rows
    assert _matmul_rows((52.7, 47.9), 48.1, 1024) == 1088
    assert _matmul_rows((math.nan, 47.9), 47.9, 1024) == 1024
    assert capsys.readouterr().out == ""
    assert _matmul_rows((math.nan, math.nan), 48.1, 1024) == 1024
    assert _matmul_rows((52.7, 47.9), math.nan, 512) == 512
    assert capsys.readouterr().out.count("no graph timing") == 2


def test_reduce_kernel_compiles():
    """The combine's kernels (kernels/ll_reduce.cuh: the rows' gather, the weighted top-k sum) compile
    under NVRTC without spills, one module for every shape."""
    from deep_ep import jit
    from deep_ep.legacy import ll_reduce
    module = jit.build("deep_ep_ll_reduce", "#include <deep_ep/kernels/ll_reduce.cuh>\n", check_spills=True)
    assert sorted(module.kernel_names()) == sorted(ll_reduce.KERNEL_NAMES)


#: a shape whose layout (L * R * T_max * H elements) is far larger than the pairs (R * T_max * K * H)
TRAFFIC_EXPERTS, TRAFFIC_HIDDEN = 32, 512
#: ops that make no data of their own (allocations, views) or write only the rows they are given
_LAYOUT_SIZED_OK = {"empty.memory_format", "view.default", "slice.Tensor", "transpose.int", "alias.default",
                    "index_copy_.default", "_unsafe_view.default", "as_strided.default", "view.dtype",
                    "detach.default", "unsqueeze.default", "select.int"}


def _traffic_worker(rank, num_ranks):
    """Every op of a dispatch and its combine (FP8, float and UE8M0 scales, BF16, with and without
    hooks) whose output has a quarter of the layout's elements or more: only allocations and views of
    the outputs and the scatter into them, never a pass over the whole layout."""
    from torch.utils._python_dispatch import TorchDispatchMode
    threshold = TRAFFIC_EXPERTS * MAX_TOKENS * TRAFFIC_HIDDEN // 4           # L * R * T_max * H / 4

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.large = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(tensor, torch.Tensor) and tensor.numel() >= threshold:
                    self.large.add(func.__name__)
            return out

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, TRAFFIC_HIDDEN, num_ranks, TRAFFIC_EXPERTS)
    buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True)
    x, topk_idx, topk_weights = _rank_inputs(80, rank, num_ranks, TRAFFIC_EXPERTS, TRAFFIC_HIDDEN)
    found = set()
    for use_fp8, use_ue8m0 in ((True, False), (True, True), (False, False)):
        for use_hook in (False, True):
            record = Record()
            with record:
                recv_x, _, handle, _, hook = buffer.low_latency_dispatch(
                    x, topk_idx, MAX_TOKENS, TRAFFIC_EXPERTS, use_fp8=use_fp8, round_scale=use_ue8m0,
                    use_ue8m0=use_ue8m0, return_recv_hook=use_hook)
                if hook is not None:
                    hook()
            expert_x = torch.ones(recv_x[0].shape if use_fp8 else recv_x.shape, dtype=torch.bfloat16)
            with record:
                _, _, hook = buffer.low_latency_combine(expert_x, topk_idx, topk_weights, handle,
                                                        return_recv_hook=use_hook)
                if hook is not None:
                    hook()
            found |= record.large
    return sorted(found)


def test_no_pass_over_the_whole_layout(tmp_path):
    """The receive work scales with the rows received: no op but allocations, views and the scatter
    makes a tensor of the layout's size (the regression the GPU's timing would show)."""
    results = run_gloo_ranks(_traffic_worker, 1, tmp_path, deadline=120)
    assert set(results[0]) <= _LAYOUT_SIZED_OK, results


# ---------------------------------------------------------------- kernel loads before a call's launches
class _LoadingGroup:
    """An emulated rank's group as the kernel loads see it: ``load_collectively`` records its keys."""

    def __init__(self):
        self.keys = []

    def load_collectively(self, key, load):
        self.keys.append(key)
        load()


def _loading_state(group):
    from deep_ep.legacy.ll_state import LowLatencyState
    state = LowLatencyState()
    state.group = group
    return state


def _record_kernel_loads(monkeypatch) -> list:
    from deep_ep.legacy import ll_layout, ll_reduce
    loads = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ll_reduce, "load_kernel", lambda device: loads.append(("reduce", device.index)))
    monkeypatch.setattr(ll_layout, "load_kernels", lambda device: loads.append(("layout", device.index)))
    return loads


def test_emulated_ranks_load_the_kernels_together_once_per_buffer(monkeypatch):
    """On emulated ranks the layout and reduce kernels load at the group's collective load, at a
    Buffer's first dispatch only (every rank's Buffer calls it then); later calls load nothing."""
    loads = _record_kernel_loads(monkeypatch)
    group = _LoadingGroup()
    device = torch.device("cuda", 1)
    for state in (_loading_state(group), _loading_state(group)):
        for _ in range(3):
            state._load_low_latency_kernels(device)
    assert group.keys == [("deep_ep_ll_kernels", 1)] * 2
    assert loads == [("reduce", 1), ("layout", 1)] * 2


def test_a_process_group_loads_the_kernels_at_each_call_and_cpu_none(monkeypatch):
    loads = _record_kernel_loads(monkeypatch)
    state = _loading_state(object())
    state._load_low_latency_kernels(torch.device("cuda", 0))
    state._load_low_latency_kernels(torch.device("cpu"))
    assert loads == [("reduce", 0), ("layout", 0)]


def test_load_module_loads_a_module_that_lists_no_kernel():
    """The module load (the step that waits for the device) happens in `load_module`, not at a
    first launch, even for a module whose kernel list is empty."""
    from deep_ep.backends.gpu import modules
    steps = []

    class Listed:
        def __init__(self, names):
            self.names = names

        def load(self, device):
            steps.append(("load", device))

        def kernel_names(self):
            return self.names

        def function(self, name):
            return type("Function", (), {"handle": lambda _self, device: steps.append((name, device))})()

    modules.load_module(Listed([]), 3)
    assert steps == [("load", 3)]
    steps.clear()
    modules.load_module(Listed(["deep_ep_notify"]), 0)
    assert steps == [("load", 0), ("deep_ep_notify", 0)]


def _disagreeing_max_tokens_worker(rank, world_size):
    num_experts, hidden = num_experts_for(world_size), 128
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(
        32, hidden, world_size, num_experts), low_latency_mode=True, num_cpu_timeout_secs=30)
    x, topk_idx, _ = _rank_inputs(3, rank, world_size, num_experts, hidden)
    with pytest.raises(RuntimeError, match=r"low_latency_dispatch: ranks disagree on num_max_dispatch_tokens_per_rank "
                                           r"or the top-k width \(this rank: (16|32) and 2\)"):
        buffer.low_latency_dispatch(x[:8], topk_idx[:8, :2].contiguous(), 16 * (rank + 1), num_experts,
                                    use_fp8=False)


def test_ranks_that_disagree_on_the_token_limit_are_told_in_v1_terms(tmp_path):
    run_gloo_ranks(_disagreeing_max_tokens_worker, 2, tmp_path, deadline=120)


def _wide_domain_worker(rank, num_ranks):
    # One NVLink domain of more than 8 ranks (an NVL72 rack's EP=16): low-latency calls reach every
    # rank, as DeepEP's do; normal mode (DeepEP's V1 takes such a domain as nodes of 8) is refused.
    num_experts = num_experts_for(num_ranks)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, 512, num_ranks, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, num_rdma_bytes=hint, low_latency_mode=True)
    assert (buffer.num_rdma_ranks, buffer.num_nvl_ranks) == (1, num_ranks)
    for index, (hidden, use_fp8, round_scale, use_ue8m0) in enumerate(CASES[1:3]):
        _run_case(buffer, rank, num_ranks, num_experts, hidden, index, use_fp8, round_scale, use_ue8m0,
                  use_hook=bool(index))
    x, topk_idx, _ = _rank_inputs(0, rank, num_ranks, num_experts, 512)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
        topk_idx, num_experts)
    with pytest.raises(NotImplementedError, match=f"dispatch / combine with {num_ranks} ranks in one NVLink domain"):
        buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=num_tokens_per_expert)
    with pytest.raises(NotImplementedError, match="in normal mode"):
        deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20)


def test_low_latency_mode_takes_an_nvlink_domain_of_more_than_8_ranks(tmp_path):
    run_gloo_ranks(_wide_domain_worker, 16, tmp_path, deadline=240)


def test_a_wide_domain_makes_no_window_for_normal_mode_calls(monkeypatch):
    """On a GPU, a low-latency Buffer over an NVLink domain of more than 8 ranks, whose normal-mode
    calls are refused, asks for the low-latency window alone, whatever num_nvl_bytes says (the
    windows' creation stood in for, no GPU)."""
    import types
    import deep_ep.buffer as elastic
    from deep_ep.legacy import internode
    made = []
    monkeypatch.setattr(internode, "group_domain_sizes", lambda group, hybrid, device: ((1, 16), None))
    monkeypatch.setattr(elastic, "ElasticBuffer", lambda group, num_bytes=None, **kwargs: made.append(num_bytes))
    owner = types.SimpleNamespace()
    internode._open(owner, object(), 1 << 30, 3 << 20, 1, True, True, torch.device("cuda", 0), False, {})
    assert owner._wide_domain and made == [internode._aligned(3 << 20)]
