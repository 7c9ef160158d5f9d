"""DeepEP's V1 ``Buffer`` across NVLink domains (nodes): which `ElasticBuffer` each mode runs on, the
RDMA counts of `get_dispatch_layout`, and DeepEP's 10-item internode handle.

Contract (docs/design.md, "DeepEP's V1 Buffer across nodes"): the group's physical domains
(`deep_ep.topology`) decide, as DeepEP's rank count does there (nodes of at most 8 ranks; a group of
several nodes is "internode"). Low-latency calls run on an
`ElasticBuffer` in direct mode (``allow_hybrid_mode=False``: DeepEP's low-latency kernels send every
token straight to its expert's rank) with ``num_allocated_qps = num_qps_per_rank``. Normal mode runs
on one in hybrid mode (a token crosses the network once per node, then NVLink forwarding, as DeepEP's
internode kernels), on the CPU backend and on emulated GPU nodes alike; its combine sums in DeepEP's
internode order (each node's ranks, rounded to bf16, then the nodes), which is `ElasticBuffer`'s
hybrid order for the rank routing `deep_ep.legacy.exchange` uses.
"""
from __future__ import annotations

import torch

from ..backends import group_domain_sizes, is_cpu_group
from ..comm.nccl import creation_hold
from ..shapes import align_up
from .config import NUM_MAX_NVL_PEERS
from .exchange import channel_counts
from .handle import LegacyHandle
from .planned import planned

__all__ = ["open_elastic_buffers", "normal_mode_buffer", "InternodeHandle", "InternodeMethods", "rdma_counts",
           "rdma_channel_prefix", "node_bits", "build_handle"]


def open_elastic_buffers(owner, group, num_nvl_bytes: int, num_rdma_bytes: int, num_qps_per_rank: int,
                         low_latency_mode: bool, explicitly_destroy: bool, device, timeouts: dict) -> None:
    """Make the `ElasticBuffer` objects of ``owner`` (a `deep_ep.Buffer`) and set its domain
    attributes: ``elastic_buffer`` (normal mode; hybrid across nodes; on the GPU within one node
    with ``num_nvl_bytes=0``, low-latency mode too), ``num_rdma_ranks``, ``num_nvl_ranks``,
    ``_low_latency_options`` (the keywords of every low-latency `ElasticBuffer`, ``timeouts`` among
    them: every buffer's ``num_cpu_timeout_secs`` / ``num_gpu_timeout_secs``) and
    ``_low_latency_cpu_buffer`` (the CPU backend's low-latency buffer across nodes, else None). On the
    GPU in low-latency mode, buffer half 0's window (``_low_latency_extra_buffer``,
    `deep_ep.legacy.ll_state`) is made here too: across nodes in direct mode, of the normal-mode
    window's size; within one node of ``num_rdma_bytes`` where ``num_nvl_bytes`` is not 0.

    Why two windows within one node: the direct low-latency kernels (`deep_ep.legacy.ll_direct`)
    write rows into the peers' windows with no handshake first, and each protocol orders its writes
    only after the peers' reads of its own earlier calls. In one window a peer done with its
    normal-mode combine could send low-latency rows over rows this rank still sums (or the other
    way round); DeepEP keeps the two in separate buffers, and so does this.

    Raises:
        NotImplementedError: an NVLink domain of more than 8 ranks in normal mode (DeepEP's V1 nodes
            have at most 8; its low-latency mode, like this one's, takes any domain).
        ValueError: ``num_qps_per_rank`` 0 where RDMA QPs are needed (low-latency mode, or several nodes).
        as `ElasticBuffer` (e.g. an NCCL group over several nodes).
    """
    on_cpu = is_cpu_group(group, device)
    # a GPU group's domains come from NCCL's LSA team: the hold keeps a private communicator (a gloo
    # group with GPU tensors) alive until the buffers below are made on it, so it is created once
    with creation_hold(group, on_cpu):
        _open(owner, group, num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, low_latency_mode, explicitly_destroy,
              device, on_cpu, timeouts)


def _aligned(num_bytes: int) -> int:
    from ..backends.gpu.window import BUFFER_ALIGNMENT
    return align_up(num_bytes, BUFFER_ALIGNMENT)


def _open(owner, group, num_nvl_bytes: int, num_rdma_bytes: int, num_qps_per_rank: int, low_latency_mode: bool,
          explicitly_destroy: bool, device, on_cpu: bool, timeouts: dict) -> None:
    from ..buffer import ElasticBuffer
    num_rdma_ranks, num_nvl_ranks = group_domain_sizes(group, True, device)[0]
    # DeepEP's V1 takes a domain of more than 8 ranks (an NVL72 rack) as nodes of 8 in normal mode;
    # its low-latency mode reaches every rank directly, as here, whatever the domain's size.
    owner._wide_domain = num_nvl_ranks > NUM_MAX_NVL_PEERS
    if owner._wide_domain and not low_latency_mode:
        planned(f"__init__ with {num_nvl_ranks} ranks in one NVLink domain in normal mode (DeepEP's V1 takes "
                f"them as nodes of {NUM_MAX_NVL_PEERS}); low_latency_mode=True buffers take any domain",
                "normal-mode calls in NVLink domains of more than 8 ranks")
    across = num_rdma_ranks > 1
    if (low_latency_mode or across) and num_qps_per_rank < 1:
        raise ValueError("num_qps_per_rank must be >= 1 in low-latency mode or across NVLink domains "
                         "(DeepEP's QPs per peer), got 0")
    owner.num_rdma_ranks, owner.num_nvl_ranks = num_rdma_ranks, num_nvl_ranks
    owner._low_latency_options = dict(timeouts, **(dict(allow_hybrid_mode=False, num_allocated_qps=num_qps_per_rank)
                                                    if across else {}))
    owner._low_latency_cpu_buffer = None
    num_bytes = low_latency_bytes = None
    if not on_cpu:
        # across nodes (and with num_nvl_bytes=0) one window of both sizes, as before the split; else
        # normal mode's of num_nvl_bytes and low-latency mode's of num_rdma_bytes (docstring above);
        # a domain too wide for normal-mode calls gets no window for them
        num_nvl_bytes = 0 if owner._wide_domain else num_nvl_bytes
        split = low_latency_mode and not across and num_nvl_bytes > 0
        num_bytes = _aligned(num_nvl_bytes + (num_rdma_bytes if low_latency_mode and not split else 0))
        if split and num_rdma_bytes > 0:
            # rank masks past the direct kernels' limits take the expanded path, whose window for
            # half 0 may need more than DeepEP's hint: it keeps the combined size it had before the
            # split (a call beyond it makes a window then, which cannot happen during a CUDA-graph
            # capture)
            low_latency_bytes = _aligned(num_rdma_bytes + (num_nvl_bytes if getattr(owner, "enable_shrink", False)
                                                           else 0))
        if num_bytes == 0:
            raise ValueError("deep_ep.Buffer: num_nvl_bytes=0 leaves no GPU window for normal-mode calls: pass "
                             "Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) (or low_latency_mode=True "
                             "with num_rdma_bytes)")
    # across nodes in hybrid mode (ElasticBuffer's default), on either backend
    owner.elastic_buffer = ElasticBuffer(group, num_bytes=num_bytes, explicitly_destroy=explicitly_destroy,
                                         device=device, **timeouts)
    if low_latency_mode and (across or low_latency_bytes):
        direct = ElasticBuffer(group, num_bytes=low_latency_bytes or num_bytes, explicitly_destroy=explicitly_destroy,
                               device=device, **owner._low_latency_options)
        if on_cpu:
            owner._low_latency_cpu_buffer = direct
        else:   # made now, not at the first call: a call may be captured in a CUDA graph
            owner.__dict__["_low_latency_extra_buffer"] = direct
    if low_latency_mode and not on_cpu and not across and getattr(owner, "enable_shrink", False):
        from .ll_direct import prepare
        prepare(owner)


def normal_mode_buffer(owner):
    """The `ElasticBuffer` of ``owner``'s (a `deep_ep.Buffer`) normal-mode calls.

    Raises:
        RuntimeError: destroyed. NotImplementedError: a low-latency Buffer whose NVLink domain has
            more than 8 ranks. ValueError: a low-latency Buffer of ``num_nvl_bytes=0`` within one
            node, whose one GPU window its low-latency calls use (`open_elastic_buffers`; refused on
            the CPU backend too, whose jobs are the GPU's tests).
    """
    buffer = owner._alive()
    if getattr(owner, "_wide_domain", False):
        planned(f"dispatch / combine with {owner.num_nvl_ranks} ranks in one NVLink domain (DeepEP's V1 takes them "
                f"as nodes of {NUM_MAX_NVL_PEERS}); this buffer's low-latency calls work",
                "normal-mode calls in NVLink domains of more than 8 ranks")
    if owner.low_latency_mode and owner.num_nvl_bytes == 0 and owner.num_rdma_ranks == 1:
        raise ValueError("deep_ep.Buffer: normal-mode dispatch / combine need an NVLink buffer, and this one was made "
                         "with num_nvl_bytes=0 (its window is the low-latency one): pass num_nvl_bytes="
                         "Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) as well")
    return buffer


def rdma_counts(is_token_in_rank: torch.Tensor, num_rdma_ranks: int) -> torch.Tensor:
    """int32 ``[num_rdma_ranks]``: the tokens going to each node (a token once per node), DeepEP's
    ``num_tokens_per_rdma_rank``."""
    num_tokens, num_ranks = is_token_in_rank.shape
    in_node = is_token_in_rank.view(num_tokens, num_rdma_ranks, num_ranks // num_rdma_ranks).any(2)
    return in_node.sum(0, dtype=torch.int32)


def node_bits(is_token_in_rank: torch.Tensor, num_rdma_ranks: int) -> torch.Tensor:
    """int32 ``[T, num_rdma_ranks]``: per token and node, bit ``j`` set where the token goes to rank
    ``j`` of that node (DeepEP's ``SourceMeta.is_token_in_nvl_rank_bits``)."""
    num_tokens, num_ranks = is_token_in_rank.shape
    num_nvl_ranks = num_ranks // num_rdma_ranks
    weights = 1 << torch.arange(num_nvl_ranks, dtype=torch.int32, device=is_token_in_rank.device)
    return (is_token_in_rank.view(num_tokens, num_rdma_ranks, num_nvl_ranks).to(torch.int32) * weights).sum(
        2, dtype=torch.int32)


def _per_channel_index(mask: torch.Tensor, num_tokens: int, num_channels: int) -> torch.Tensor:
    """int32 ``[T]``: each masked token's index among the masked tokens of its channel, -1 elsewhere."""
    per_channel = max(-(-num_tokens // num_channels), 1)
    channel = (torch.arange(num_tokens, device=mask.device) // per_channel).clamp(max=num_channels - 1)
    running = mask.to(torch.int64).cumsum(0) - 1
    first = torch.zeros(num_channels, dtype=torch.int64, device=mask.device)
    counts = torch.bincount(channel[mask], minlength=num_channels)[:num_channels]
    first[1:] = counts.cumsum(0)[:-1]
    return torch.where(mask, running - first[channel], -1).to(torch.int32)


def rdma_channel_prefix(is_token_in_rank: torch.Tensor, num_rdma_ranks: int, num_channels: int) -> torch.Tensor:
    """int32 ``[num_rdma_ranks, C]``: per destination node, the inclusive prefix over DeepEP's channels
    of this rank's tokens going there (a token once per node)."""
    num_tokens, num_ranks = is_token_in_rank.shape
    in_node = is_token_in_rank.view(num_tokens, num_rdma_ranks, num_ranks // num_rdma_ranks).any(2)
    tokens = torch.arange(num_tokens, device=is_token_in_rank.device)
    return torch.stack([channel_counts(tokens, in_node[:, node], num_tokens, num_channels)
                        for node in range(num_rdma_ranks)]).cumsum(1).to(torch.int32)


class InternodeHandle(LegacyHandle):
    """DeepEP's V1 internode handle: a 10-tuple ``(is_token_in_rank, rdma_channel_prefix_matrix,
    gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
    recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head,
    send_nvl_head)``, plus the `EPHandle` of the dispatch in ``ep_handle`` (passed back as it is).

    ``N`` nodes of ``S`` ranks, ``R = N * S``, ``C`` channels (token ``t`` in channel ``t // ceil(T /
    C)``), this rank ``(n, j)`` = rank ``n * S + j``:
        is_token_in_rank                 bool  [T, R]  the dispatch's routing
        rdma_channel_prefix_matrix       int32 [N, C]  per destination node, inclusive channel prefix of
                                         this rank's tokens going there (once per node)
        gbl_channel_prefix_matrix        int32 [R, C]  per destination rank, the same per rank
        recv_rdma_channel_prefix_matrix  int32 [N, C]  per source node ``m``: rank ``(m, j)``'s
                                         ``rdma_channel_prefix_matrix`` row of this node
        recv_rdma_rank_prefix_sum        int32 [N]     inclusive prefix over ``m`` of the tokens rank
                                         ``(m, j)`` sends to this node (what DeepEP's forwarder receives)
        recv_gbl_channel_prefix_matrix   int32 [R, C]  per source rank, the first row of each of its
                                         channels in this rank's receive
        recv_gbl_rank_prefix_sum         int32 [R]     inclusive prefix over source ranks of the rows
                                         received (rows of source ``s`` end there)
        recv_src_meta                    uint8 [rows, 8]  per received row, two int32: the source's node
                                         and the bits of the ranks of this node the token went to
        send_rdma_head                   int32 [T, N]  per token and node, its index among this channel's
                                         tokens going to that node (-1: not sent there)
        send_nvl_head                    None: DeepEP's holds the forwarders' ring-buffer slots, which
                                         depend on its kernels' arrival order; nothing here forwards
    """


def build_handle(rank: int, is_token_in_rank: torch.Tensor, sent: torch.Tensor, source_tokens: list,
                 ep_handle, num_rows: int, num_channels: int, num_rdma_ranks: int, received_words) -> LegacyHandle:
    """The V1 handle of a dispatch: `LegacyHandle` on one node, `InternodeHandle` across nodes.

    Args:
        rank: this rank. is_token_in_rank: bool ``[T, R]``. sent: int64 ``[R, R]``, ``N[s, d]`` tokens
            rank ``s`` sent to rank ``d``. source_tokens: each rank's token count. ep_handle: the
            `EPHandle` of the data dispatch. num_rows: receive rows (with ``num_worst_tokens`` padding).
        num_channels: DeepEP's channels of the config. num_rdma_ranks: nodes.
        received_words: across nodes, ``(rdma_rows, src_bits)``: int32 ``[R, C]``, row ``s`` rank
            ``s``'s ``rdma_channel_prefix_matrix`` row of this node, and int32 ``[n]``, each received
            token's bits for this node; None on one node.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    device = is_token_in_rank.device
    tokens = torch.arange(num_tokens, device=device)
    channel_prefix_matrix = torch.stack([channel_counts(tokens, is_token_in_rank[:, dst], num_tokens, num_channels)
                                         for dst in range(num_ranks)]).cumsum(1).to(torch.int32)
    recv_rank = ep_handle.recv_src_rank.long()
    recv_channel_prefix_matrix = torch.zeros((num_ranks, num_channels), dtype=torch.int32, device=device)
    for src in range(num_ranks):
        inclusive = channel_counts(ep_handle.recv_src_token, recv_rank == src, source_tokens[src],
                                   num_channels).cumsum(0)
        recv_channel_prefix_matrix[src, 1:] = inclusive[:-1].to(torch.int32)
    recv_src_idx = ep_handle.recv_src_token.to(torch.int32)
    num_recv = recv_src_idx.shape[0]
    if num_rows > num_recv:
        recv_src_idx = torch.cat([recv_src_idx, recv_src_idx.new_full((num_rows - num_recv,), -1)])
    rank_prefix_matrix = sent.cumsum(0).to(torch.int32)
    if received_words is None:
        send_head = ep_handle.dst_buffer_slot_idx.to(torch.int32)
        return LegacyHandle((rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                             is_token_in_rank, send_head), ep_handle, num_rows)
    rdma_rows, src_bits = received_words
    num_nvl_ranks = num_ranks // num_rdma_ranks
    peers = torch.arange(rank % num_nvl_ranks, num_ranks, num_nvl_ranks, device=device)   # (m, j) for each m
    recv_rdma_channel_prefix_matrix = rdma_rows[peers].to(torch.int32).contiguous()
    recv_rdma_rank_prefix_sum = recv_rdma_channel_prefix_matrix[:, -1].cumsum(0).to(torch.int32)
    recv_gbl_rank_prefix_sum = rank_prefix_matrix[:, rank].contiguous()
    rank_starts = torch.cat([recv_gbl_rank_prefix_sum.new_zeros(1), recv_gbl_rank_prefix_sum[:-1]])
    recv_gbl_channel_prefix_matrix = recv_channel_prefix_matrix + rank_starts.unsqueeze(1)
    meta = torch.zeros((num_rows, 2), dtype=torch.int32, device=device)
    meta[:num_recv, 0] = (recv_rank // num_nvl_ranks).to(torch.int32)
    meta[:num_recv, 1] = src_bits
    in_node = is_token_in_rank.view(num_tokens, num_rdma_ranks, num_nvl_ranks).any(2)
    send_rdma_head = torch.stack([_per_channel_index(in_node[:, node], num_tokens, num_channels)
                                  for node in range(num_rdma_ranks)], dim=1) if num_tokens else \
        torch.empty((0, num_rdma_ranks), dtype=torch.int32, device=device)
    items = (is_token_in_rank, rdma_channel_prefix(is_token_in_rank, num_rdma_ranks, num_channels),
             channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
             recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, meta.view(torch.uint8), send_rdma_head, None)
    return InternodeHandle(items, ep_handle, num_rows)


class InternodeMethods:
    """DeepEP's V1 ``internode_dispatch`` / ``internode_combine`` (`deep_ep.Buffer` inherits them):
    DeepEP's `dispatch` / `combine` call them across nodes; here both run the same code, which
    picks the path from the group's domains."""

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, config=None, previous_event=None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False, *, num_worst_tokens: int = 0):
        """`dispatch` with DeepEP's internode signature (``num_worst_tokens``, of DeepEP's side
        branches, is keyword-only here and supported). Returns and raises as `dispatch`."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """`combine` with DeepEP's internode signature. Returns and raises as `combine`."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)
