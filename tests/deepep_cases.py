"""DeepEP V2's own test of `ElasticBuffer` (tests/elastic/test_ep.py of deepseek-ai/DeepEP), every check
of it, re-derived in our code as one per-rank body: `run_ep_modes(buffer, device, ...)`.

The body runs on any backend: CPU gloo ranks (tests/test_deepep_compat.py), emulated GPU ranks in
threads, or one NCCL rank. Every rank generates every rank's inputs from the shared seed, so the
references are computed locally (DeepEP computes its dispatch reference with NCCL all-to-alls).

What it reproduces, for each of the 144 modes of `enumerate_ep_modes` (handle copy, alignment 128/1,
FP8 or not, 0/1/2 biases, previous event, async, allocation stream):
* a non-expanded, an expanded (column-major FP8 scales), a cached and a cached expanded dispatch
  (with ``topk_weights`` and zero padding), then a combine and an expanded ("reduced") combine of
  generated data (`pre_combine_data`: a sine per (global token, top-k slot));
* dispatch data bit for bit against `reference_dispatch_deepep` per source rank, the handle's prefix
  sums and per-expert counts, the source indices of ``recv_src_metadata``, folding of the expanded
  rows, zero padding of the cached expanded dispatch, cached = fresh, handle copies, the stats
  counter, the deterministic double dispatch (``buffer.deterministic``);
* both combines bit for bit against `reference_combine_deepep` (multi-level reduction recipes), and
  the reduced top-k weights equal to the dispatched ones.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
PRIME = 131071


# ---------------------------------------------------------------------------------------------- modes
def enumerate_ep_modes():
    """The 144 mode tuples ``(do_handle_copy, expert_alignment, use_fp8_dispatch, num_bias,
    with_previous_event, async_with_compute_stream, allocate_on_comm_stream)``: a previous event
    needs allocation on the communication stream, so it pairs only with that."""
    for do_handle_copy in (1, 0):
        for expert_alignment in (128, 1):
            for use_fp8_dispatch in (1, 0):
                for num_bias in (0, 1, 2):
                    for with_previous_event in (0, 1):
                        for async_with_compute_stream in (0, 1):
                            for allocate_on_comm_stream in ((1,) if with_previous_event else (0, 1)):
                                yield (do_handle_copy, expert_alignment, use_fp8_dispatch, num_bias,
                                       with_previous_event, async_with_compute_stream, allocate_on_comm_stream)


# ---------------------------------------------------------------------------------------------- data
def align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def cast_to_fp8(x: torch.Tensor) -> tuple:
    """Per token and 128 channels: ``(float8_e4m3fn [T, H], float32 scales [T, H / 128])``, the block's
    largest magnitude mapped to 448 (e4m3's largest finite value)."""
    T, H = x.shape
    blocks = x.float().view(T, H // 128, 128)
    amax = blocks.abs().amax(2).clamp(min=1e-4)
    return (blocks * (448.0 / amax).unsqueeze(2)).to(FP8).view(T, H), amax / 448.0


def cast_back(x) -> torch.Tensor:
    """bf16 of a dispatched ``x`` (an FP8 pair is multiplied back by its scales)."""
    if not isinstance(x, tuple):
        return x
    data, sf = x
    T, H = data.shape
    return (data.float().view(T, H // 128, 128) * sf.float().unsqueeze(2)).view(T, H).to(torch.bfloat16)


def pre_combine_data(src_global_idx: torch.Tensor, num_ranks: int, num_max_tokens_per_rank: int, num_topk: int,
                     hidden: int, seed: int) -> torch.Tensor:
    """bf16 ``[n, K, H]``: what the experts return for slot ``j`` of the token with global index
    ``g = rank * M + token``, channel ``c``: ``sin(u * (c + 1) + sin(seed))`` with
    ``u = ((g * K + j) * 131071 mod (R * M * K) + 1) / (R * M * K)``, so every (token, slot) has its
    own row whichever rank computes it."""
    period = num_ranks * num_max_tokens_per_rank * num_topk
    slot_seed = src_global_idx.to(torch.int64).unsqueeze(1) * num_topk + \
        torch.arange(num_topk, device=src_global_idx.device).unsqueeze(0)
    u = ((slot_seed * PRIME % period).float() + 1) / period
    channels = torch.arange(1, hidden + 1, device=src_global_idx.device, dtype=torch.float32)
    return torch.sin(u.unsqueeze(-1) * channels + math.sin(float(seed))).to(torch.bfloat16)


def ordered_sum(y: torch.Tensor, start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 of ``start`` (float32, or +0.0) plus every ``y[:, k]`` (``[n, K, H]``) in slot order."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device) if start is None \
        else start.clone()
    for k in range(y.shape[1]):
        acc += y[:, k].float()
    return acc.to(torch.bfloat16)


def make_routing(num_tokens: int, num_experts: int, num_topk: int, masked_ratio: float, g: torch.Generator):
    """``(topk_weights float32 [T, K], topk_idx int64 [T, K])``: the top-k of random scores, a
    fraction ``masked_ratio`` of the selections masked (-1, weight 0)."""
    scores = torch.rand(num_tokens, num_experts, generator=g) + 1e-3
    weights, idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)
    if masked_ratio > 0:
        masked = torch.rand(idx.shape, generator=g) < masked_ratio
        idx = idx.masked_fill(masked, -1)
        weights = weights.masked_fill(masked, 0)
    return weights, idx.to(torch.int64)


# ---------------------------------------------------------------------------------------------- references
def reference_dispatch_deepep(xs, idxs, ws, rank: int, num_max_tokens_per_rank: int, num_experts: int):
    """What rank ``rank`` receives, as DeepEP's reference lays it out (tokens by source rank, then
    source token; not expanded): ``(recv_x, recv_topk_idx (local ids, -1 elsewhere), recv_topk_weights
    (as sent), recv_src_token_idx int32 (global indices), num_recv_tokens_per_rank list)``."""
    R = len(xs)
    L = num_experts // R
    parts = {"data": [], "sf": [], "idx": [], "w": [], "src": []}
    per_rank = []
    for s in range(R):
        owner = torch.where(idxs[s] >= 0, idxs[s] // L, -1)
        sel = (owner == rank).any(1).nonzero().flatten()
        per_rank.append(int(sel.numel()))
        data, sf = xs[s] if isinstance(xs[s], tuple) else (xs[s], None)
        parts["data"].append(data[sel])
        if sf is not None:
            parts["sf"].append(sf[sel])
        local = owner[sel] == rank
        parts["idx"].append(torch.where(local, idxs[s][sel] - rank * L, -1))
        parts["w"].append(ws[s][sel])
        parts["src"].append((s * num_max_tokens_per_rank + sel).to(torch.int32))
    data = torch.cat(parts["data"])
    recv_x = (data, torch.cat(parts["sf"])) if parts["sf"] else data
    return recv_x, torch.cat(parts["idx"]), torch.cat(parts["w"]), torch.cat(parts["src"]), per_rank


def reference_combine_deepep(y: torch.Tensor, topk_idx: torch.Tensor, num_ranks: int, num_experts: int, bias,
                             reduce_in_rank: bool, num_scaleup_ranks: int = 0) -> torch.Tensor:
    """DeepEP's combine reference on one rank: ``y`` bf16 ``[T, K, H]`` (zero for masked slots).

    ``reduce_in_rank``: the slots of each rank are summed first (float32 from +0.0, in slot order,
    rounded to bf16) and the partial stands at the rank's last slot, zeros at its other slots; with
    ``0 < num_scaleup_ranks < num_ranks`` too (hybrid mode across nodes) the slots of each node are
    then summed the same way; then the biases' float32 sum plus every slot in order, rounded to bf16."""
    T, K, H = y.shape
    L = num_experts // num_ranks
    owner = torch.where(topk_idx >= 0, topk_idx // L, -1)
    if reduce_in_rank:
        y = _grouped_reduce(y, owner)
        if 0 < num_scaleup_ranks < num_ranks:
            y = _grouped_reduce(y, torch.where(owner >= 0, owner // num_scaleup_ranks, -1))
    start = None
    if isinstance(bias, tuple):
        start = bias[0].float() + bias[1].float()
    elif bias is not None:
        start = bias.float()
    return ordered_sum(y, start)


def _grouped_reduce(y: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """Each group's slots (``owner`` ``[T, K]``, -1 for none) summed in float32 from +0.0 in slot
    order, rounded to bf16, standing at the group's last slot; zeros at its other slots."""
    T, K, H = y.shape
    grouped = torch.zeros_like(y)
    for k in range(K):
        later = (owner[:, k + 1:] == owner[:, k:k + 1]).any(1)
        stands = (~later).nonzero().flatten()
        partial = torch.zeros(stands.numel(), H, dtype=torch.float32, device=y.device)
        for j in range(k + 1):
            same = owner[stands, j] == owner[stands, k]
            partial[same] += y[stands[same], j].float()
        grouped[stands, k] = partial.to(torch.bfloat16)
    return grouped


# ---------------------------------------------------------------------------------------------- checks
def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as same-width integers (compares -0.0 / NaN / FP8 exactly)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    bad = bits(a) != bits(b)
    assert not bad.any(), f"{what}: {int(bad.sum())} element(s) differ, first at {bad.nonzero()[0].tolist()}"


def fold_expanded(expanded, indices: torch.Tensor, valid: torch.Tensor):
    """One row per received token from the expanded rows of its slots (``indices`` ``[n, K]``, safe
    where ``valid``), checking that all its valid slots hold the same row."""
    if isinstance(expanded, tuple):
        return tuple(fold_expanded(t, indices, valid) for t in expanded)
    gathered = expanded[indices]                                        # [n, K, ...]
    first = valid.to(torch.int32).argmax(1)
    folded = gathered[torch.arange(gathered.shape[0], device=indices.device), first]
    same = (bits(gathered) == bits(folded).unsqueeze(1)).flatten(2).all(-1) | ~valid
    assert same.all(), "expanded rows of one token differ"
    return folded


def _launch(buffer, name: str, with_previous_event: int, async_with_compute_stream: int, params: dict):
    if with_previous_event:
        params = params | dict(previous_event=buffer.capture())
    values = getattr(buffer, name)(**params)
    if async_with_compute_stream:
        values[-1].current_stream_wait()
    return values


# ---------------------------------------------------------------------------------------------- the body
def run_ep_modes(buffer, device, *, num_tokens: int = 16, hidden: int = 128, num_topk: int = 4,
                 num_experts: int = 16, do_cpu_sync: bool = True, masked_ratio: float = 0.1, seed: int = 0,
                 modes=None, order_differs: Optional[list] = None) -> int:
    """Every check of DeepEP's test for each mode (default: all 144) on this rank; returns the number
    of modes run. ``num_tokens`` is M; rank ``r`` dispatches ``max(1, M - r)`` tokens.
    ``order_differs``: a list that gets, per mode run in hybrid mode across nodes with multiple
    reduction, whether the expected combine differs from the flat order's (so a caller can tell that
    its checks tell the two orders apart)."""
    R, rank = buffer.num_ranks, buffer.rank_idx
    M, H, K, E = num_tokens, hidden, num_topk, num_experts
    L = E // R
    num_scaleout_ranks, num_scaleup_ranks = buffer.get_logical_domain_size()
    num_sms = buffer.get_theoretical_num_sms(E, K)
    num_qps = buffer.get_theoretical_num_qps(num_sms)
    multi = buffer.allow_multiple_reduction
    tokens = [max(1, M - r) for r in range(R)]
    routing = [make_routing(tokens[r], E, K, masked_ratio, torch.Generator().manual_seed(seed * 1000 + r))
               for r in range(R)]
    ws = [w.to(device) for w, _ in routing]
    idxs = [i.to(device) for _, i in routing]
    topk_weights, topk_idx = ws[rank], idxs[rank]
    T = tokens[rank]
    count = 0
    for mode_index, mode in enumerate(enumerate_ep_modes()):
        if modes is not None and mode_index not in modes:
            continue
        (do_handle_copy, expert_alignment, use_fp8_dispatch, num_bias, with_previous_event,
         async_with_compute_stream, allocate_on_comm_stream) = mode
        A = expert_alignment
        g = torch.Generator().manual_seed(seed * 100003 + mode_index)
        xs_bf16 = [torch.randn(tokens[r], H, generator=g).to(torch.bfloat16).to(device) for r in range(R)]
        xs = [cast_to_fp8(x) if use_fp8_dispatch else x for x in xs_bf16]
        x = xs[rank]
        bias = None
        bg = torch.Generator().manual_seed(seed * 7919 + mode_index * 31 + rank)
        if num_bias:
            biases = tuple(torch.randn(T, H, generator=bg).to(torch.bfloat16).to(device) for _ in range(num_bias))
            bias = biases[0] if num_bias == 1 else biases

        # references
        ref_recv_x, ref_recv_topk_idx, ref_recv_topk_weights, ref_recv_src_token_idx, ref_num_recv_tokens_per_rank = \
            reference_dispatch_deepep(xs, idxs, ws, rank, M, E)
        ref_y = pre_combine_data(rank * M + torch.arange(T, device=device), R, M, K, H, seed)
        ref_y[topk_idx == -1] = 0
        # hybrid mode across nodes reduces within each node too, with multiple reduction only
        scaleup = num_scaleup_ranks if multi else 0
        ref_combined_y = reference_combine_deepep(ref_y, topk_idx, R, E, bias, True, scaleup)
        ref_reduced_combined_y = reference_combine_deepep(ref_y, topk_idx, R, E, bias, multi, scaleup)
        if order_differs is not None and 0 < scaleup < R:
            flat = reference_combine_deepep(ref_y, topk_idx, R, E, bias, True)
            order_differs.append(bool((bits(flat) != bits(ref_combined_y)).any()))

        # dispatches
        dispatch_args = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, num_sms=num_sms, num_qps=num_qps,
                             num_max_tokens_per_rank=M, num_experts=E, expert_alignment=A,
                             async_with_compute_stream=bool(async_with_compute_stream),
                             allocate_on_comm_stream=bool(allocate_on_comm_stream),
                             do_handle_copy=bool(do_handle_copy), do_cpu_sync=do_cpu_sync)
        recv_x, recv_topk_idx, recv_topk_weights, handle, _ = \
            _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream, dispatch_args)
        recv_x_bf16 = cast_back(recv_x)
        expanded_dispatch_args = dispatch_args | dict(do_expand=True, use_tma_aligned_col_major_sf=True)
        expanded_recv_x, expanded_recv_topk_idx, expanded_recv_topk_weights, expanded_handle, _ = \
            _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream, expanded_dispatch_args)
        expanded_recv_x_bf16 = cast_back(expanded_recv_x)
        cached_dispatch_args = dict(x=x, num_sms=num_sms, num_qps=num_qps,
                                    async_with_compute_stream=bool(async_with_compute_stream),
                                    allocate_on_comm_stream=bool(allocate_on_comm_stream), handle=handle)
        cached_recv_x, cached_recv_topk_idx, _, cached_handle, _ = \
            _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream, cached_dispatch_args)
        cached_expanded_args = cached_dispatch_args | dict(topk_weights=topk_weights, do_expand=True,
                                                           use_tma_aligned_col_major_sf=True, do_zero_padding=True,
                                                           handle=expanded_handle)
        cached_expanded_recv_x, _, cached_expanded_recv_topk_weights, _, _ = \
            _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream, cached_expanded_args)

        num_recv_tokens = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
        assert num_recv_tokens == int(expanded_handle.psum_num_recv_tokens_per_scaleup_rank[-1]), \
            "the expanded layout must not change the number of received tokens"

        # combine inputs from the received source indices
        src_token_global_idx = handle.recv_src_metadata[:num_recv_tokens, 0]
        assert torch.equal(ref_recv_src_token_idx, torch.sort(src_token_global_idx).values)
        local_y = pre_combine_data(src_token_global_idx, R, M, K, H, seed)
        local_y[recv_topk_idx[:num_recv_tokens] == -1] = 0
        input_for_combine = torch.empty_like(recv_x_bf16, dtype=torch.bfloat16)
        input_for_combine[:num_recv_tokens] = ordered_sum(local_y)
        expanded_src = expanded_handle.recv_src_metadata[:num_recv_tokens, 0]
        assert torch.equal(ref_recv_src_token_idx, torch.sort(expanded_src).values)
        local_y_expand = pre_combine_data(expanded_src, R, M, K, H, seed)
        # one extra row takes the slots that are not local (-1)
        input_for_expand_combine = torch.empty((expanded_recv_x_bf16.shape[0] + 1, H), dtype=torch.bfloat16,
                                               device=device)
        input_for_expand_combine[expanded_handle.recv_src_metadata[:num_recv_tokens, 2:].flatten().long()] = \
            local_y_expand.view(-1, H)
        input_for_expand_combine = input_for_expand_combine[:-1]

        # combines
        call = dict(num_sms=num_sms, num_qps=num_qps, async_with_compute_stream=bool(async_with_compute_stream),
                    allocate_on_comm_stream=bool(allocate_on_comm_stream))
        combined_x, combined_topk_weights, _ = _launch(
            buffer, "combine", with_previous_event, async_with_compute_stream,
            dict(x=input_for_combine, topk_weights=recv_topk_weights, bias=bias, handle=handle) | call)
        reduced_args = dict(x=input_for_expand_combine, bias=bias, handle=expanded_handle) | call
        if multi:   # the expanded layout reduces weights only with multiple reduction
            reduced_args["topk_weights"] = expanded_recv_topk_weights
        reduced_combined_x, reduced_combined_topk_weights, _ = _launch(
            buffer, "combine", with_previous_event, async_with_compute_stream, reduced_args)

        # ---- checks: handle copies
        assert (topk_idx.data_ptr() != handle.topk_idx.data_ptr()) == bool(do_handle_copy)
        assert (topk_idx.data_ptr() != cached_handle.topk_idx.data_ptr()) == bool(do_handle_copy)
        assert handle.topk_idx.data_ptr() == cached_handle.topk_idx.data_ptr()

        # the valid part of worst-case outputs
        if not do_cpu_sync:
            def head(t):
                return tuple(u[:num_recv_tokens] for u in t) if isinstance(t, tuple) else t[:num_recv_tokens]
            recv_x, cached_recv_x, recv_x_bf16 = head(recv_x), head(cached_recv_x), head(recv_x_bf16)
            recv_topk_idx, recv_topk_weights = head(recv_topk_idx), head(recv_topk_weights)
            cached_recv_topk_idx = head(cached_recv_topk_idx)
            handle.recv_src_metadata = handle.recv_src_metadata[:num_recv_tokens]
            expanded_handle.recv_src_metadata = expanded_handle.recv_src_metadata[:num_recv_tokens]
        expanded_indices = expanded_handle.recv_src_metadata[:, 2:].long()
        expanded_mask = expanded_indices >= 0
        valid_expanded_indices = expanded_indices[expanded_mask]

        # deterministic double dispatch
        if buffer.deterministic:
            twice = _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream, dispatch_args)
            if not do_cpu_sync:
                assert num_recv_tokens == int(twice[3].psum_num_recv_tokens_per_scaleup_rank[-1])
            assert_equal(cast_back(twice[0])[:num_recv_tokens], recv_x_bf16, "deterministic recv_x")
            assert_equal(twice[1][:num_recv_tokens], recv_topk_idx, "deterministic recv_topk_idx")
            assert_equal(twice[2][:num_recv_tokens], recv_topk_weights, "deterministic recv_topk_weights")
            assert_equal(twice[3].recv_src_metadata[:num_recv_tokens, :1], handle.recv_src_metadata[:, :1],
                         "deterministic source indices")
            twice = _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream, expanded_dispatch_args)
            assert_equal(cast_back(twice[0])[valid_expanded_indices], expanded_recv_x_bf16[valid_expanded_indices],
                         "deterministic expanded recv_x")
            if A == 1:  # padding weights are not specified otherwise
                assert_equal(twice[2], expanded_recv_topk_weights, "deterministic expanded recv_topk_weights")

        # the stats counter
        stats = torch.zeros(L, dtype=torch.int32, device=device)
        _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream,
                dispatch_args | dict(cumulative_local_expert_recv_stats=stats))

        # expanded layout
        assert expanded_recv_topk_idx is None
        assert expanded_handle.recv_src_metadata.size(0) == num_recv_tokens
        safe_indices = expanded_indices.masked_fill(~expanded_mask, 0)
        cached_expanded_recv_x_bf16 = cast_back(cached_expanded_recv_x)
        assert_equal(cached_expanded_recv_x_bf16[valid_expanded_indices], expanded_recv_x_bf16[valid_expanded_indices],
                     "cached expanded recv_x")
        assert_equal(cached_expanded_recv_topk_weights[valid_expanded_indices],
                     expanded_recv_topk_weights[valid_expanded_indices], "cached expanded recv_topk_weights")
        for e in range(L):
            start = int(expanded_handle.psum_num_recv_tokens_per_expert[e])
            end = align(start, A)
            assert (cached_expanded_recv_x_bf16[start:end] == 0).all(), f"padding of expert {e} not zero"
            assert (cached_expanded_recv_topk_weights[start:end] == 0).all(), f"padding weights of expert {e}"
        expanded_recv_x_folded = fold_expanded(expanded_recv_x, safe_indices, expanded_mask)
        expanded_recv_topk_weights_folded = expanded_recv_topk_weights[safe_indices]

        # cached = fresh
        if use_fp8_dispatch:
            assert_equal(cached_recv_x[0], recv_x[0], "cached FP8 data")
            assert_equal(cached_recv_x[1], recv_x[1], "cached FP8 scales")
        else:
            assert_equal(cached_recv_x, recv_x, "cached recv_x")
        assert_equal(cached_recv_topk_idx, recv_topk_idx, "cached recv_topk_idx")
        assert torch.equal(handle.dst_buffer_slot_idx, cached_handle.dst_buffer_slot_idx)
        assert torch.equal(handle.psum_num_recv_tokens_per_scaleup_rank,
                           cached_handle.psum_num_recv_tokens_per_scaleup_rank)
        assert handle.num_recv_tokens_per_expert_list == cached_handle.num_recv_tokens_per_expert_list

        # counts: per expert, per source rank
        assert recv_x_bf16.shape == cast_back(ref_recv_x).shape and recv_x_bf16.shape[0] == num_recv_tokens
        for e in range(L if do_cpu_sync else 0):
            ref_count = int((ref_recv_topk_idx == e).sum())
            assert ref_count == int(stats[e]), (e, ref_count, int(stats[e]))
            assert align(ref_count, A) == handle.num_recv_tokens_per_expert_list[e]
        psum = [0] + handle.psum_num_recv_tokens_per_expert.tolist()
        expanded_psum = [0] + expanded_handle.psum_num_recv_tokens_per_expert.tolist()
        for e in range(L):
            ref_count = int((ref_recv_topk_idx == e).sum())
            assert align(ref_count, A) == psum[e + 1] - psum[e], (rank, e, ref_count, psum)
            assert ref_count == expanded_psum[e + 1] - align(expanded_psum[e], A), (rank, e, ref_count, expanded_psum)
        rank_psum = [0] + handle.psum_num_recv_tokens_per_scaleup_rank.tolist()
        for i in range(num_scaleup_ranks):
            assert rank_psum[i + 1] - rank_psum[i] == sum(ref_num_recv_tokens_per_rank[i::num_scaleup_ranks])

        # dispatch data, per source rank, in the order of the source indices
        for check_x, check_idx, check_w, check_handle in (
                (expanded_recv_x_folded, None, expanded_recv_topk_weights_folded, expanded_handle),
                (recv_x, recv_topk_idx, recv_topk_weights, handle)):
            order = torch.sort(check_handle.recv_src_metadata[:, 0])
            for i in range(R):
                lo = sum(ref_num_recv_tokens_per_rank[:i])
                hi = lo + ref_num_recv_tokens_per_rank[i]
                assert torch.equal(ref_recv_src_token_idx[lo:hi], order.values[lo:hi])
                rows = order.indices[lo:hi]
                ref_mask = ref_recv_topk_idx[lo:hi] < 0
                assert_equal(check_w[rows].masked_fill(ref_mask, 0), ref_recv_topk_weights[lo:hi].masked_fill(ref_mask, 0),
                             f"recv_topk_weights from rank {i}")
                if check_idx is not None:
                    assert_equal(check_idx[rows], ref_recv_topk_idx[lo:hi], f"recv_topk_idx from rank {i}")
                if use_fp8_dispatch:
                    assert_equal(check_x[0][rows], ref_recv_x[0][lo:hi], f"FP8 data from rank {i}")
                    assert_equal(check_x[1][rows], ref_recv_x[1][lo:hi], f"FP8 scales from rank {i}")
                else:
                    assert_equal(check_x[rows], ref_recv_x[lo:hi], f"recv_x from rank {i}")

        # combines, bit for bit
        assert_equal(combined_x, ref_combined_y, "combined_x")
        assert_equal(reduced_combined_x, ref_reduced_combined_y, "reduced combined_x")
        assert_equal(combined_topk_weights, topk_weights, "combined_topk_weights")
        if multi:
            assert_equal(reduced_combined_topk_weights, topk_weights, "reduced combined_topk_weights")
        count += 1
    return count
