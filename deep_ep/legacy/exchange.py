"""How `deep_ep.Buffer` expresses DeepEP's V1 intranode exchanges as `ElasticBuffer` calls.

* The data moves with *rank routing*: token ``t`` names one expert per destination rank ``d`` (the
  first of ``d``, in slot ``d``; -1 where ``is_token_in_rank[t, d]`` is False). The receive order is
  then V1's (source rank, then source token), and combine adds a token's rows in rank order after the
  biases, as V1's kernel does.
* The top-k ids and weights of each token and the counts V1's notify step exchanges (per-expert
  counts, tokens per destination rank, token count) travel as raw int32 words in the rows of one
  small dispatch with the same routing, one extra token per destination carrying the counts.
* Combine's top-k weights go back with one small dispatch the other way, and are summed over the
  token's ranks in rank order (V1's reduction).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["rank_routing", "exchange_metadata", "reduce_weights_back", "channel_counts", "settle"]


def settle(device: torch.device) -> None:
    """Wait (polling, `deep_ep.emulated.wait_for_stream`) for the current stream's work on a CUDA
    device, so that the host reads which follow (counts, masks) never block inside the driver, which
    emulated ranks forbid. Nothing to do on CPU."""
    if device.type == "cuda":
        from ..emulated import wait_for_stream
        wait_for_stream()


def rank_routing(is_token_in_rank: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """int64 ``[T, R]``: slot ``d`` names expert ``d * num_local_experts`` where the token goes to
    rank ``d``, else -1."""
    num_ranks = is_token_in_rank.shape[1]
    first = torch.arange(num_ranks, device=is_token_in_rank.device) * num_local_experts
    return torch.where(is_token_in_rank, first.unsqueeze(0), torch.full_like(first, -1).unsqueeze(0)).contiguous()


def _words(rows: int, width: int, device) -> torch.Tensor:
    # int32 words of a row, as many as make the bf16 row a multiple of 16 bytes
    return torch.zeros((rows, -(-max(width, 1) // 4) * 4), dtype=torch.int32, device=device)


def exchange_metadata(buffer, routing: torch.Tensor, topk_idx: Optional[torch.Tensor],
                      topk_weights: Optional[torch.Tensor], counts: torch.Tensor, num_experts: int,
                      num_sms: int, token_words: Optional[torch.Tensor] = None) -> tuple:
    """One dispatch with ``routing`` (`rank_routing`) carrying each token's top-k ids and weights (and
    ``token_words``, int32 ``[T, W]``, when given), plus one token per destination rank carrying
    ``counts`` (int32 ``[R, C]``, row ``d`` for rank ``d``).

    Returns ``(recv_topk_idx int64 [n, K] global ids or None, recv_topk_weights float32 [n, K] or
    None, recv_counts int32 [R, C] by source rank, recv_token_words int32 [n, W] or None)``, ``n`` the
    received tokens in V1's order.
    """
    num_tokens, num_ranks = routing.shape
    device = routing.device
    num_topk = 0 if topk_idx is None else topk_idx.shape[1]
    num_words = 2 * num_topk if topk_weights is not None else num_topk
    num_extra = 0 if token_words is None else token_words.shape[1]
    words = _words(num_tokens + num_ranks, max(num_words + num_extra, counts.shape[1]), device)
    if topk_idx is not None:
        words[:num_tokens, :num_topk] = topk_idx.to(torch.int32)
    if topk_weights is not None:
        words[:num_tokens, num_topk:2 * num_topk] = topk_weights.view(torch.int32)
    if token_words is not None:
        words[:num_tokens, num_words:num_words + num_extra] = token_words
    words[num_tokens:, :counts.shape[1]] = counts
    # the counts token for rank d names d's first expert only
    counts_routing = torch.full((num_ranks, num_ranks), -1, dtype=routing.dtype, device=device)
    counts_routing[:, 0] = torch.arange(num_ranks, device=device) * (num_experts // num_ranks)
    recv, _, _, handle, _ = buffer.dispatch(words.view(torch.bfloat16), topk_idx=torch.cat([routing, counts_routing]),
                                            num_experts=num_experts, num_sms=num_sms)
    recv = recv.view(torch.int32)
    settle(device)
    # each source's block ends with its counts token
    counts_rows = handle.rank_prefix_sum.long() - 1
    is_token = torch.ones(recv.shape[0], dtype=torch.bool, device=device)
    is_token[counts_rows] = False
    tokens = recv[is_token]
    recv_topk_idx = None if topk_idx is None else tokens[:, :num_topk].to(torch.int64)
    recv_topk_weights = None if topk_weights is None else \
        tokens[:, num_topk:2 * num_topk].contiguous().view(torch.float32)
    recv_token_words = None if token_words is None else tokens[:, num_words:num_words + num_extra].contiguous()
    return recv_topk_idx, recv_topk_weights, recv[counts_rows][:, :counts.shape[1]], recv_token_words


def reduce_weights_back(buffer, topk_weights: torch.Tensor, recv_src_rank: torch.Tensor,
                        is_token_in_rank: torch.Tensor, num_experts: int, num_sms: int,
                        num_nvl_ranks: int = 0) -> torch.Tensor:
    """V1's combine of top-k weights: each received row's weights (float32 ``[n, K]``) go back to the
    row's source rank, which sums, per token, the rows of the ranks it went to in rank order; across
    nodes (DeepEP's internode combine) the ranks of each node first, from 0.0, then the nodes' sums in
    node order, all in float32.

    Args:
        recv_src_rank: int ``[n]`` source rank of each received row.
        is_token_in_rank: bool ``[T, R]`` the dispatch's routing.
        num_nvl_ranks: ranks per node (0: one node).

    Returns:
        float32 ``[T, K]``.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    num_nvl_ranks = num_nvl_ranks or num_ranks
    num_topk = topk_weights.shape[1]
    device = topk_weights.device
    words = _words(topk_weights.shape[0], num_topk, device)
    words[:, :num_topk] = topk_weights.view(torch.int32)
    routing = (recv_src_rank.to(torch.int64) * (num_experts // num_ranks)).unsqueeze(1).contiguous()
    recv, _, _, handle, _ = buffer.dispatch(words.view(torch.bfloat16), topk_idx=routing, num_experts=num_experts,
                                            num_sms=num_sms)
    values = recv.view(torch.int32)[:, :num_topk].contiguous().view(torch.float32)
    settle(device)
    ends = handle.rank_prefix_sum.tolist()
    combined = torch.zeros((num_tokens, num_topk), dtype=torch.float32, device=device)
    start = 0
    for first in range(0, num_ranks, num_nvl_ranks):
        node_sum = combined if num_nvl_ranks == num_ranks else torch.zeros_like(combined)
        for rank in range(first, first + num_nvl_ranks):
            # rank d's rows of this rank's tokens are in token order
            tokens = is_token_in_rank[:, rank].nonzero().squeeze(1)
            node_sum[tokens] += values[start:ends[rank]]
            start = ends[rank]
        if node_sum is not combined:
            reached = is_token_in_rank[:, first:first + num_nvl_ranks].any(1)
            combined[reached] += node_sum[reached]
    return combined


def channel_counts(tokens: torch.Tensor, mask: torch.Tensor, num_tokens: int, num_channels: int) -> torch.Tensor:
    """int64 ``[C]``: how many of ``tokens`` (indices in ``[0, num_tokens)``, where ``mask``) fall in
    each of DeepEP's channels (channel ``c`` holds tokens ``[c * ceil(T / C), (c + 1) * ceil(T / C))``)."""
    per_channel = max(-(-num_tokens // num_channels), 1)
    channel = (tokens.long() // per_channel).clamp_(max=num_channels - 1)
    return torch.bincount(channel[mask], minlength=num_channels)[:num_channels]
