"""DeepEP's V1 `deep_ep.Buffer` (normal mode, intranode) on the CPU backend over gloo, 1, 2 and 4 ranks
(the same cases across nodes: tests/test_legacy_internode.py, which checks the internode handle with
`spec_internode_handle` here).

The checks are those of DeepEP's tests/legacy/test_intranode.py, re-derived: every rank builds every
rank's inputs from a shared seed and computes here, token by token, what each rank must receive
(rows by source rank, then source token; local expert ids, -1 elsewhere; aligned per-expert counts;
the six handle tensors) and what combine must return (the sum of the rows a token's ranks send back,
the top-k weights summed likewise); every element is compared. Signatures are checked against the
lists written from DeepEP's deep_ep/buffers/legacy.py and csrc/legacy/buffer.hpp.
"""
import inspect
import math

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.legacy import LegacyHandle
from ep_cases import ADVERSARIAL_VALUES
from proc_utils import run_gloo_ranks

FP8 = torch.float8_e4m3fn
_ = inspect.Parameter.empty

V1_SIGNATURES = {
    "__init__": [("group", _), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "get_dispatch_layout": [("topk_idx", _), ("num_experts", _), ("previous_event", None), ("async_finish", False),
                            ("allocate_on_comm_stream", False)],
    "dispatch": [("x", _), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                 ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                 ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": [("x", _), ("handle", _), ("topk_weights", None), ("bias", None), ("config", None),
                ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "internode_dispatch": [("x", _), ("handle", None), ("num_tokens_per_rank", None),
                           ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                           ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                           ("expert_alignment", 1), ("config", None), ("previous_event", None),
                           ("async_finish", False), ("allocate_on_comm_stream", False)],
    "internode_combine": [("x", _), ("handle", _), ("topk_weights", None), ("bias", None), ("config", None),
                          ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "low_latency_dispatch": [("x", _), ("topk_idx", _), ("num_max_dispatch_tokens_per_rank", _),
                             ("num_experts", _), ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False),
                             ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("x", _), ("topk_idx", _), ("topk_weights", _), ("handle", _), ("use_logfmt", False),
                            ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False),
                            ("out", None), ("combine_wait_recv_cost_stats", None)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_experts", _)],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", _), ("hidden", _), ("num_ranks", _),
                                       ("num_experts", _)],
    "low_latency_update_mask_buffer": [("rank_to_mask", _), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", _)],
    "low_latency_clean_mask_buffer": [],
    "get_next_low_latency_combine_buffer": [("handle", _)],
    "get_local_buffer_tensor": [("dtype", _), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_comm_stream": [], "destroy": [], "capture": [], "is_sm90_compiled": [], "set_num_sms": [("new_num_sms", _)],
    "get_dispatch_config": [("num_ranks", _)], "get_combine_config": [("num_ranks", _)],
}
#: keywords of DeepEP's side branches (antgroup-opt, hybrid-ep, eager-rdma, mori-ep and the overlap
#: pull requests), keyword-only here, with their defaults there
SIDE_BRANCH_SIGNATURES = {
    "__init__": [("use_fabric", False), ("allow_nvlink_for_normal_mode", True), ("eager_support", False)],
    "get_low_latency_rdma_size_hint": [("eager_support", False)],
    "internode_dispatch": [("num_worst_tokens", 0)],
    "low_latency_dispatch": [("topk_weights", None), ("x_global_scale", None), ("use_nvfp4", False),
                             ("use_ue8m0_for_sf", False), ("use_eager", False)],
    "low_latency_combine": [("overlap", False), ("packed_recv_count", None), ("comp_signal", None), ("block_m", 64),
                            ("threshold", 0), ("num_sms", 3), ("src_signals", None),
                            ("src_signal_expect_value", 0), ("use_eager", False)],
}
#: a value other than the default for each of them
SIDE_BRANCH_VALUES = {"use_fabric": True, "allow_nvlink_for_normal_mode": False, "eager_support": True,
                      "num_worst_tokens": 16, "topk_weights": torch.ones(1, 1), "x_global_scale": torch.ones(1),
                      "use_nvfp4": True, "use_ue8m0_for_sf": 1, "use_eager": True, "overlap": True,
                      "packed_recv_count": torch.zeros(1, dtype=torch.int32), "comp_signal": torch.zeros(1),
                      "block_m": 128, "threshold": 1, "num_sms": 8, "src_signals": torch.zeros(1),
                      "src_signal_expect_value": 2}
#: deep_ep's own keyword-only extensions, after the side branches' keywords, off by default
EXTENSIONS = {"__init__": [("device", None), ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100)]}
STATIC = ("capture", "is_sm90_compiled", "set_num_sms", "get_dispatch_config", "get_combine_config",
          "get_low_latency_rdma_size_hint")


# ------------------------------------------------------------------------------------ no process group
@pytest.mark.parametrize("name", sorted(V1_SIGNATURES))
def test_signature_is_deepeps(name):
    params = list(inspect.signature(getattr(deep_ep.Buffer, name)).parameters.values())
    if name not in STATIC:
        assert params[0].name == "self"
        params = params[1:]
    named = [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert named == V1_SIGNATURES[name]
    keyword_only = [(p.name, p.default) for p in params if p.kind == p.KEYWORD_ONLY]
    assert keyword_only == SIDE_BRANCH_SIGNATURES.get(name, []) + EXTENSIONS.get(name, [])
    assert not [p for p in params if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert (name in STATIC) == isinstance(inspect.getattr_static(deep_ep.Buffer, name), staticmethod)
    assert name == "__init__" or getattr(deep_ep.Buffer, name).__doc__


def test_public_names():
    from deep_ep.utils import EventHandle, EventOverlap
    assert EventHandle is deep_ep.EventHandle and EventOverlap is deep_ep.EventOverlap
    assert deep_ep.Buffer.num_sms == 20 and deep_ep.Buffer.is_sm90_compiled() is True
    assert {"Buffer", "Config"} <= set(deep_ep.__all__)


def test_config():
    config = deep_ep.Config()
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 258)
    assert deep_ep.Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                             "num_max_nvl_chunked_recv_tokens": 256, "num_max_rdma_chunked_send_tokens": 16,
                             "num_max_rdma_chunked_recv_tokens": 128}).num_max_rdma_chunked_recv_tokens == 128
    assert config.num_channels == 10
    with pytest.raises(ValueError, match="less than"):
        deep_ep.Config(20, 8, 8)
    with pytest.raises(ValueError, match="at most half"):
        deep_ep.Config(20, 6, 256, 100, 50)
    with pytest.raises(TypeError):
        deep_ep.Config(20.0)
    for hidden_bytes, num_ranks in ((7168 * 2, 8), (4096 * 2, 2), (2048, 4)):
        size = config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
        channels_slots = config.num_channels * num_ranks * config.num_max_nvl_chunked_recv_tokens
        assert size % 128 == 0 and size >= channels_slots * hidden_bytes
        assert config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) == 0
    # DeepEP's formula for 2 nodes of 8, 12 channels of 128 RDMA slots: two sets of slots of hidden
    # bytes, 8 bytes of source metadata, 128 top-k ids (8 bytes) and weights, 128 scales and an int4,
    # plus the channels' counters (18 ints, twice, per node and channel)
    config = deep_ep.Config(24, 8, 512, 16, 128)
    per_token = 7168 * 2 + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16
    assert config.get_rdma_buffer_size_hint(7168 * 2, 16) == 12 * 2 * 18 * 2 * 4 + 2 * 12 * 2 * 128 * per_token
    with pytest.raises(ValueError, match="multiple of it"):
        config.get_rdma_buffer_size_hint(7168 * 2, 12)


def test_default_configs_and_sms():
    old = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(24)
        config = deep_ep.Buffer.get_dispatch_config(8)
        assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens) == \
            (24, 6, 256)
        config = deep_ep.Buffer.get_combine_config(2)
        assert (config.num_sms, config.num_max_nvl_chunked_send_tokens) == (24, 10)
        with pytest.raises(ValueError, match="even"):
            deep_ep.Buffer.set_num_sms(23)
        with pytest.raises(ValueError, match="Unsupported number of EP ranks: 3"):
            deep_ep.Buffer.get_dispatch_config(3)
    finally:
        deep_ep.Buffer.num_sms = old


# ------------------------------------------------------------------------------------ the spec, per token
def _inputs(seed, tokens, num_experts, num_topk, hidden, fp8, mask_prob=0.25):
    """Every rank's ``(x, topk_idx, topk_weights)`` (x bf16 or an FP8 tuple; with an odd seed the
    scales are column-major, as a TMA-aligned FP8 cast gives them and DeepEP accepts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for num_tokens in tokens:
        if fp8:
            scales = torch.rand(num_tokens, hidden // 128, generator=g) + 0.5
            x = ((torch.randn(num_tokens, hidden, generator=g) * 8).to(FP8),
                 scales.t().contiguous().t() if seed % 2 else scales)
        else:
            x = (torch.randn(num_tokens, hidden, generator=g) * 4).to(torch.bfloat16)
        scores = torch.rand(num_tokens, num_experts, generator=g)
        idx = scores.topk(num_topk, dim=1).indices.to(torch.int64)
        idx[torch.rand(num_tokens, num_topk, generator=g) < mask_prob] = -1
        out.append((x, idx, torch.rand(num_tokens, num_topk, generator=g)))
    return out


def _rows(x, rows):
    if isinstance(x, tuple):
        return tuple(t[rows] for t in x)
    return x[rows]


def _bits(x):
    if isinstance(x, tuple):
        return tuple(_bits(t) for t in x)
    return x.view(torch.uint8) if x.dtype == FP8 else x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _assert_same(name, got, want):
    got, want = _bits(got), _bits(want)
    if isinstance(want, tuple):
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(f"{name}[{i}]", g, w)
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    want = want.to(got.device)  # the spec is computed on the CPU
    assert torch.equal(got, want), f"{name} differs at {(got != want).nonzero()[:4].tolist()}"


def spec_dispatch(inputs, num_experts, dst, alignment, num_channels):
    """What rank ``dst`` receives, token by token (DeepEP V1's intranode semantics)."""
    R = len(inputs)
    L = num_experts // R
    owners = [[{int(e) // L for e in row if e >= 0} for row in idx.tolist()] for _, idx, _ in inputs]
    rows = [(s, t) for s in range(R) for t in range(len(owners[s])) if dst in owners[s][t]]
    sent = torch.tensor([[sum(d in o for o in owners[s]) for d in range(R)] for s in range(R)], dtype=torch.int32)
    per_expert = [0] * L
    recv_idx, recv_w = [], []
    for s, t in rows:
        ids = inputs[s][1][t].tolist()
        recv_idx.append([e - dst * L if e >= 0 and e // L == dst else -1 for e in ids])
        recv_w.append([float(w) if i >= 0 else 0.0 for w, i in zip(inputs[s][2][t].tolist(), recv_idx[-1])])
        for i in recv_idx[-1]:
            if i >= 0:
                per_expert[i] += 1

    def channel_of(t, num_tokens):
        return min(t // max(math.ceil(num_tokens / num_channels), 1), num_channels - 1)

    T = len(owners[dst])
    channel_prefix = torch.zeros(R, num_channels, dtype=torch.int32)
    for t in range(T):
        for d in owners[dst][t]:
            channel_prefix[d, channel_of(t, T):] += 1
    recv_channel_prefix = torch.zeros(R, num_channels, dtype=torch.int32)
    for s, t in rows:
        recv_channel_prefix[s, channel_of(t, len(owners[s])) + 1:] += 1
    send_head = torch.full((T, R), -1, dtype=torch.int32)
    for d in range(R):
        row = int(sent[:, d][:dst].sum())
        for t in range(T):
            if d in owners[dst][t]:
                send_head[t, d] = row
                row += 1
    K = inputs[0][1].shape[1]
    return dict(
        rows=rows,
        recv_topk_idx=torch.tensor(recv_idx, dtype=torch.int64).view(-1, K),
        recv_topk_weights=torch.tensor(recv_w, dtype=torch.float32).view(-1, K),
        counts=[-(-c // alignment) * alignment for c in per_expert],
        rank_prefix_matrix=sent.cumsum(0).to(torch.int32),
        channel_prefix_matrix=channel_prefix, recv_channel_prefix_matrix=recv_channel_prefix,
        recv_src_idx=torch.tensor([t for _, t in rows], dtype=torch.int32), send_head=send_head,
        owners=owners)


def spec_internode_handle(inputs, num_experts, rank, num_channels, nodes, num_rows, spec):
    """DeepEP's internode handle items of rank ``rank`` over ``nodes`` nodes, as ``(name, value)``
    pairs, token by token from the inputs (``spec``: `spec_dispatch`'s for this rank)."""
    R = len(inputs)
    S = R // nodes
    owners = spec["owners"]

    def channel_of(t, num_tokens):
        return min(t // max(math.ceil(num_tokens / num_channels), 1), num_channels - 1)

    def to_node(s, n):
        return [t for t in range(len(owners[s])) if any(d // S == n for d in owners[s][t])]

    T = len(owners[rank])
    rdma_prefix = torch.zeros(nodes, num_channels, dtype=torch.int32)
    send_rdma_head = torch.full((T, nodes), -1, dtype=torch.int32)
    for n in range(nodes):
        seen = [0] * num_channels
        for t in to_node(rank, n):
            rdma_prefix[n, channel_of(t, T):] += 1
            send_rdma_head[t, n] = seen[channel_of(t, T)]
            seen[channel_of(t, T)] += 1
    recv_rdma_prefix = torch.zeros(nodes, num_channels, dtype=torch.int32)
    for m in range(nodes):
        source = m * S + rank % S
        for t in to_node(source, rank // S):
            recv_rdma_prefix[m, channel_of(t, len(owners[source])):] += 1
    recv_gbl_rank_prefix_sum = spec["rank_prefix_matrix"][:, rank].contiguous()
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), recv_gbl_rank_prefix_sum[:-1]])
    meta = torch.zeros(num_rows, 2, dtype=torch.int32)
    for row, (s, t) in enumerate(spec["rows"]):
        meta[row, 0] = s // S
        meta[row, 1] = sum(1 << (d % S) for d in owners[s][t] if d // S == rank // S)
    in_rank = torch.zeros(T, R, dtype=torch.bool)
    for t in range(T):
        for d in owners[rank][t]:
            in_rank[t, d] = True
    return [("is_token_in_rank", in_rank), ("rdma_channel_prefix_matrix", rdma_prefix),
            ("gbl_channel_prefix_matrix", spec["channel_prefix_matrix"]),
            ("recv_rdma_channel_prefix_matrix", recv_rdma_prefix),
            ("recv_rdma_rank_prefix_sum", recv_rdma_prefix[:, -1].cumsum(0).to(torch.int32)),
            ("recv_gbl_channel_prefix_matrix", spec["recv_channel_prefix_matrix"] + starts.unsqueeze(1)),
            ("recv_gbl_rank_prefix_sum", recv_gbl_rank_prefix_sum), ("recv_src_meta", meta.view(torch.uint8)),
            ("send_rdma_head", send_rdma_head), ("send_nvl_head", None)]


def _order_sensitive(shape, g):
    """bf16 values whose float32 sums round differently in different orders."""
    return ADVERSARIAL_VALUES[torch.randint(0, len(ADVERSARIAL_VALUES), shape, generator=g)].to(torch.bfloat16)


def spec_recv_x(inputs, rows):
    if not rows:
        x = inputs[0][0]
        return _rows(x, torch.zeros(0, dtype=torch.long))
    parts = [_rows(inputs[s][0], torch.tensor([t])) for s, t in rows]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[i] for p in parts]) for i in range(2))
    return torch.cat(parts)


# ------------------------------------------------------------------------------------ gloo workers
CASES = [
    # name, tokens per rank (for 2 / 4 ranks), experts per rank, top-k, fp8, with top-k, alignment, worst
    ("bf16-topk", 3, 3, False, True, 1, 0),
    ("bf16-no-topk", 2, 4, False, False, 1, 0),
    ("fp8-topk-align", 2, 3, True, True, 4, 0),
    ("fp8-no-topk-worst", 1, 2, True, False, 1, 1),
    ("bf16-topk-worst-align", 2, 4, False, True, 3, 1),
]
TOKENS = {1: [[13], [0]], 2: [[13, 0], [7, 11]], 4: [[6, 0, 9, 3], [5, 8, 0, 7]],
          8: [[6, 0, 9, 3, 4, 4, 1, 7], [5, 8, 0, 7, 2, 0, 6, 3]]}


def _to(obj, device):
    """A tensor, a tuple of them or None, on ``device``. To the CPU, after the current stream's work
    is done (polled: emulated ranks must never block inside the driver while a peer still has to
    reach a call, `deep_ep.legacy.exchange.settle`)."""
    if str(device) == "cpu" and torch.cuda.is_available():
        from deep_ep.legacy.exchange import settle
        settle(torch.device("cuda"))
    if isinstance(obj, tuple):
        return tuple(_to(t, device) for t in obj)
    return None if obj is None else obj.to(device)


def _run_case(buffer, rank, R, case_index, case, device="cpu"):
    """One case on this rank; inputs go to ``device`` (CPU over gloo, or a GPU), results come back to
    the CPU to be compared."""
    from deep_ep import EventOverlap
    name, experts_per_rank, K, fp8, with_topk, alignment, worst = case
    E = max(experts_per_rank, -(-K // R)) * R      # at least K experts
    hidden = 256 if fp8 else 64
    tokens = TOKENS[R][case_index % 2]
    inputs = _inputs(100 * R + case_index, tokens, E, K, hidden, fp8)
    x, topk_idx, topk_weights = inputs[rank]
    x_dev, topk_idx_dev, topk_weights_dev = _to(inputs[rank], device)
    int_flags = case_index % 2 == 1              # DeepEP's tests pass flags as ints too
    async_finish = 1 if int_flags else bool(case_index % 3 == 0)
    previous = buffer.capture() if case_index % 2 == 0 else None

    # layout
    per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
        topk_idx_dev, E, previous_event=previous, async_finish=async_finish)
    nodes = buffer.num_rdma_ranks
    assert isinstance(event, EventOverlap) and (per_rdma_rank is None) == (nodes == 1)
    L = E // R
    want_in_rank = torch.zeros(len(topk_idx), R, dtype=torch.bool)
    for t, row in enumerate(topk_idx.tolist()):
        for e in row:
            if e >= 0:
                want_in_rank[t, e // L] = True
    if nodes > 1:
        want_per_node = [sum(bool(want_in_rank[t, n * R // nodes:(n + 1) * R // nodes].any())
                             for t in range(len(topk_idx))) for n in range(nodes)]
        _assert_same("num_tokens_per_rdma_rank", per_rdma_rank, torch.tensor(want_per_node, dtype=torch.int32))
    _assert_same("is_token_in_rank", in_rank, want_in_rank)
    _assert_same("num_tokens_per_rank", per_rank, want_in_rank.sum(0).to(torch.int32))
    _assert_same("num_tokens_per_expert", per_expert,
                 torch.tensor([(topk_idx == e).sum().item() for e in range(E)], dtype=torch.int32))

    # dispatch
    config = deep_ep.Config(deep_ep.Buffer.num_sms, 6, 256)
    spec = spec_dispatch(inputs, E, rank, alignment, config.num_channels)
    num_recv = len(spec["rows"])
    num_worst = (sum(tokens) + 1) if worst else 0
    args = dict(x=x_dev, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                num_tokens_per_rdma_rank=per_rdma_rank,
                expert_alignment=alignment, num_worst_tokens=num_worst, config=config, async_finish=async_finish,
                previous_event=previous, allocate_on_comm_stream=0 if int_flags else False)
    if with_topk:
        args.update(topk_idx=topk_idx_dev, topk_weights=topk_weights_dev)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(**args)
    event.current_stream_wait()
    assert handle.is_token_in_rank is in_rank
    per_rank, per_expert, in_rank = _to((per_rank, per_expert, in_rank), "cpu")
    recv_x, recv_topk_idx, recv_topk_weights = _to((recv_x, recv_topk_idx, recv_topk_weights), "cpu")
    matrices = _to(tuple(handle), "cpu")
    rows = num_worst or num_recv
    want_x = spec_recv_x(inputs, spec["rows"])
    got_x = _rows(recv_x, slice(0, num_recv))
    _assert_same("recv_x", got_x, want_x)
    assert (recv_x[0] if fp8 else recv_x).shape[0] == rows
    if with_topk:
        _assert_same("recv_topk_idx", recv_topk_idx[:num_recv], spec["recv_topk_idx"])
        _assert_same("recv_topk_weights", recv_topk_weights[:num_recv], spec["recv_topk_weights"])
        assert recv_topk_idx.shape[0] == rows and (recv_topk_idx[num_recv:] == -1).all()
        assert (recv_topk_weights[num_recv:] == 0).all()
    else:
        assert recv_topk_idx is None and recv_topk_weights is None
    assert counts == ([] if worst else spec["counts"])
    assert isinstance(handle, LegacyHandle) and isinstance(handle, tuple) and len(handle) == (6 if nodes == 1 else 10)
    sources = [s for s, _ in spec["rows"]]
    if nodes > 1:
        want = spec_internode_handle(inputs, E, rank, config.num_channels, nodes, rows, spec)
        for i, (name, value) in enumerate(want):
            if value is None:
                assert matrices[i] is None, name
            else:
                _assert_same(name, matrices[i], value)
        # DeepEP's internode test: the rows of source i end at recv_gbl_rank_prefix_sum[i]
        ends = matrices[6].tolist()
    else:
        for i, key in enumerate(("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix")):
            _assert_same(key, matrices[i], spec[key])
        _assert_same("recv_src_idx", matrices[3][:num_recv], spec["recv_src_idx"])
        assert matrices[3].shape == (rows,) and (matrices[3][num_recv:] == -1).all()
        _assert_same("send_head", matrices[5], spec["send_head"])
        # DeepEP's test: the rows of source i sit between rank_prefix_matrix[i - 1][rank] and [i][rank]
        ends = [int(matrices[0][i][rank]) for i in range(R)]
    for i in range(R):
        lo = ends[i - 1] if i else 0
        assert sources[lo:ends[i]] == [i] * (ends[i] - lo)

    # cached dispatch: new data, same layout
    new_inputs = _inputs(7000 + 100 * R + case_index, tokens, E, K, hidden, fp8)
    cached = buffer.dispatch(_to(new_inputs[rank][0], device), handle=handle, config=config, async_finish=async_finish,
                             previous_event=buffer.capture())
    cached[5].current_stream_wait()
    assert cached[1:5] == (None, None, None, None)
    _assert_same("cached recv_x", _rows(_to(cached[0], "cpu"), slice(0, num_recv)),
                 spec_recv_x(new_inputs, spec["rows"]))

    # combine: values whose float32 sums depend on their order (biases, then ranks in rank order
    # is DeepEP's); weights of any width, not zero where the expert is another rank's (DeepEP's test
    # fills those too): every rank's row counts
    g = torch.Generator().manual_seed(9000 + case_index)
    num_bias = case_index % 3
    combine_topk = K if with_topk else 5
    ys, tws, biases = [], [], []
    for d in range(R):
        n = len(spec_dispatch(inputs, E, d, alignment, config.num_channels)["rows"])
        y = _order_sensitive((num_worst or n, hidden), g)
        y[n:] = float("nan")                       # never read
        ys.append(y)
        tw = torch.randn(num_worst or n, combine_topk, generator=g)
        tw[n:] = float("nan")
        tws.append(tw)
    for s in range(R):
        bias = tuple(_order_sensitive((tokens[s], hidden), g) for _ in range(num_bias))
        biases.append(None if num_bias == 0 else bias[0] if num_bias == 1 else bias)
    combined_x, combined_w, event = buffer.combine(
        ys[rank].to(device), handle, topk_weights=tws[rank].to(device), bias=_to(biases[rank], device),
        config=deep_ep.Buffer.get_combine_config(R) if R > 1 else None, async_finish=async_finish,
        previous_event=buffer.capture())
    event.current_stream_wait()
    combined_x, combined_w = _to((combined_x, combined_w), "cpu")
    T = len(topk_idx)
    bias = biases[rank] if isinstance(biases[rank], tuple) else (biases[rank],) if num_bias else ()
    want = torch.zeros(T, hidden)
    for b in bias:
        want = want + b.float()
    want_w = torch.zeros(T, combine_topk)
    # across nodes DeepEP's internode combine sums each node's ranks first (rows rounded to bf16,
    # weights in float32), then the nodes in node order (deep_ep.reference's hybrid order)
    scaleup = R // nodes
    assert buffer.elastic_buffer.num_scaleup_ranks == scaleup
    node_sums = [torch.zeros(T, hidden) for _ in range(nodes)] if nodes > 1 else None
    node_weights = [torch.zeros(T, combine_topk) for _ in range(nodes)]
    reached = torch.zeros(T, nodes, dtype=torch.bool)
    for d in range(R):
        spec_d = spec_dispatch(inputs, E, d, alignment, config.num_channels)
        for row, (s, t) in enumerate(spec_d["rows"]):
            if s == rank:
                if node_sums is None:
                    want[t] += ys[d][row].float()
                else:
                    node_sums[d // scaleup][t] += ys[d][row].float()
                reached[t, d // scaleup] = True
                node_weights[d // scaleup][t] += tws[d][row]
    for node, node_sum in enumerate(node_sums or ()):
        want[reached[:, node]] += node_sum[reached[:, node]].to(torch.bfloat16).float()
    for node, node_weight in enumerate(node_weights):
        want_w[reached[:, node]] += node_weight[reached[:, node]]
    _assert_same("combined_x", combined_x, want.to(torch.bfloat16))
    _assert_same("combined_topk_weights", combined_w, want_w)
    assert buffer.combine(ys[rank].to(device), handle, bias=_to(biases[rank], device))[1] is None

    # round trip (DeepEP's check): combining what was received gives x times the token's rank count;
    # the sum starts from +0.0, so a token sent nowhere comes back +0.0, never x * 0 (-0.0 where x < 0)
    if not fp8:
        back = _to(buffer.combine(recv_x.to(device), handle)[0], "cpu")
        _assert_same("round trip", back, (x.float() * in_rank.sum(1, keepdim=True) + 0.0).to(torch.bfloat16))


def _check_refusals(buffer, rank, R):
    """Bad input raises on every rank before any communication (the buffer stays usable)."""
    E, K = 4 * R, 2
    x, topk_idx, topk_weights = _inputs(55, [5] * R, E, K, 64, False)[rank]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    good = dict(x=x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_weights)
    bad = [
        (ValueError, "is_token_in_rank does not match", dict(is_token_in_rank=~in_rank, num_tokens_per_rank=
                                                             (~in_rank).sum(0, dtype=torch.int32))),
        (ValueError, "column sums", dict(num_tokens_per_rank=per_rank + 1)),
        (ValueError, r"x has 4 tokens but is_token_in_rank \(from get_dispatch_layout\) has 5", dict(x=x[:4])),
        (ValueError, "num_tokens_per_expert does not match", dict(num_tokens_per_expert=per_expert.flip(0))),
        (TypeError, "num_tokens_per_rank must have dtype int32", dict(num_tokens_per_rank=per_rank.long())),
        (ValueError, "is required without a handle", dict(is_token_in_rank=None)),
        (ValueError, "topk_weights needs topk_idx", dict(topk_idx=None)),
        (ValueError, "expert id", dict(topk_idx=topk_idx.masked_fill(topk_idx == topk_idx.max(), E))),
        (ValueError, "expert_alignment must be >= 1", dict(expert_alignment=0)),
        (TypeError, "config must be a deep_ep.Config", dict(config={"num_sms": 20})),
        (TypeError, "async_finish must be a bool", dict(async_finish=2)),
        (TypeError, "x must have dtype bfloat16", dict(x=x.float())),
    ]
    for kind, message, change in bad:
        with pytest.raises(kind, match=message):
            buffer.dispatch(**{**good, **change})
    if R > 1:
        with pytest.raises(ValueError, match="multiple of the group size"):
            buffer.get_dispatch_layout(topk_idx, E + 1)
    recv_x, _, _, _, handle, _ = buffer.dispatch(**good)
    with pytest.raises(ValueError, match="takes no topk_idx"):
        buffer.dispatch(x, handle=handle, topk_idx=topk_idx)
    with pytest.raises(TypeError, match="handle must be the handle"):
        buffer.combine(recv_x, tuple(handle))
    with pytest.raises(ValueError, match="x must have shape"):
        buffer.combine(recv_x[1:], handle)
    with pytest.raises(ValueError, match="bias"):
        buffer.combine(recv_x, handle, bias=x[:, :8].contiguous())
    with pytest.raises(TypeError, match="topk_weights must have dtype float32"):
        buffer.combine(recv_x, handle, topk_weights=torch.zeros(recv_x.shape[0], K, dtype=torch.float64))
    assert buffer.combine(recv_x, handle)[0].shape == x.shape    # still in step


def _check_planned(buffer):
    group = dist.group.WORLD
    calls = {"__init__": lambda **kwargs: deep_ep.Buffer(group, **kwargs),
             "get_low_latency_rdma_size_hint": lambda **kwargs: deep_ep.Buffer.get_low_latency_rdma_size_hint(
                 128, 512, 2, 8, **kwargs),
             "internode_dispatch": lambda **kwargs: buffer.internode_dispatch(None, **kwargs),
             "low_latency_dispatch": lambda **kwargs: buffer.low_latency_dispatch(None, None, 128, 8, **kwargs),
             "low_latency_combine": lambda **kwargs: buffer.low_latency_combine(None, None, None, None, **kwargs)}
    for method, keywords in SIDE_BRANCH_SIGNATURES.items():
        if method == "internode_dispatch":      # num_worst_tokens is supported there
            continue
        for keyword, default in keywords:
            with pytest.raises(NotImplementedError, match=rf"deep_ep\.Buffer\.{method}\({keyword}=.*side branches"):
                calls[method](**{keyword: SIDE_BRANCH_VALUES[keyword]})
    # the defaults pass on to the usual checks (flags as ints too)
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 512, 2, 8, eager_support=0) > 0
    deep_ep.Buffer(group, use_fabric=False, allow_nvlink_for_normal_mode=1, eager_support=False)
    with pytest.raises(RuntimeError, match="low_latency_mode=True"):
        buffer.low_latency_dispatch(torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64),
                                    128, 8, topk_weights=None, use_nvfp4=0, use_eager=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_fp9'"):
        buffer.low_latency_dispatch(None, None, 128, 8, use_fp9=True)
    assert deep_ep.Buffer(group, num_rdma_bytes=1 << 20).num_rdma_bytes == 1 << 20   # stored, as DeepEP's
    with pytest.raises(ValueError, match="num_qps_per_rank must be >= 1"):
        deep_ep.Buffer(group, num_rdma_bytes=1 << 20, low_latency_mode=True, num_qps_per_rank=0)
    with pytest.raises(NotImplementedError, match="comm=.*planned"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(ValueError, match="either 'group' or 'comm'"):
        deep_ep.Buffer(None)


def _check_local_buffer_tensor(rank):
    """DeepEP's views of its buffers: sizes, offsets, dtypes, writes kept; bad requests refused."""
    buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=4096, num_rdma_bytes=1 << 16, low_latency_mode=True)
    rdma = buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True)
    assert rdma.dtype == torch.int8 and rdma.shape == (1 << 16,)
    rdma.fill_(rank + 1)
    again = buffer.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()
    assert not rdma.any() and again.data_ptr() == rdma.data_ptr()
    nvl = buffer.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), offset=64)
    assert nvl.shape == (4, 8) and nvl.dtype == torch.float32
    assert buffer.get_local_buffer_tensor(torch.bfloat16, offset=4000).shape == (48,)
    with pytest.raises(ValueError, match="more than the"):
        buffer.get_local_buffer_tensor(torch.int32, torch.Size([1025]))
    with pytest.raises(ValueError, match="multiple of"):
        buffer.get_local_buffer_tensor(torch.int32, offset=2)
    with pytest.raises(TypeError, match="dtype"):
        buffer.get_local_buffer_tensor("int8")


def _worker(rank, world_size):
    from deep_ep import EventOverlap
    buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=0, num_rdma_bytes=0)
    assert (buffer.rank, buffer.group_size, buffer.num_sms) == (rank, world_size, 20)
    assert buffer.get_comm_stream() is None and isinstance(buffer.capture(), EventOverlap)
    for index, case in enumerate(CASES):
        try:
            _run_case(buffer, rank, world_size, index, case)
        except Exception as exc:
            raise AssertionError(f"case {case[0]}, rank {rank}: {exc}") from exc
    # no tokens anywhere
    empty_idx = torch.empty(0, 2, dtype=torch.int64)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(empty_idx, 2 * world_size)
    out = buffer.dispatch(torch.empty(0, 64, dtype=torch.bfloat16), num_tokens_per_rank=per_rank,
                          is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=empty_idx,
                          topk_weights=torch.empty(0, 2), expert_alignment=4)
    assert out[0].shape == (0, 64) and out[1].shape == (0, 2) and out[3] == [0, 0]
    assert buffer.combine(out[0], out[4], topk_weights=out[2])[0].shape == (0, 64)
    _check_refusals(buffer, rank, world_size)
    _check_planned(buffer)
    _check_local_buffer_tensor(rank)
    # a low-latency Buffer of num_nvl_bytes=0 has no window for normal mode on a GPU: refused here too
    low_latency_only = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True)
    idx = torch.tensor([[0, 1]])
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 2 * world_size)
    with pytest.raises(ValueError, match="num_nvl_bytes=0"):
        low_latency_only.dispatch(torch.ones(1, 64, dtype=torch.bfloat16), topk_idx=idx, topk_weights=torch.ones(1, 2),
                                  num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=per_expert)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        buffer.destroy()
    other = deep_ep.Buffer(dist.group.WORLD, explicitly_destroy=True)
    x = torch.randn(4, 64).to(torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 4)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 2 * world_size)
    received = buffer.dispatch(x, topk_idx=idx, topk_weights=torch.ones(4, 2), num_tokens_per_rank=per_rank,
                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match=r"was made by deep_ep\.Buffer #\d+, but is used with deep_ep\.Buffer #"):
        other.combine(received[0], received[4])   # the user made Buffers: the message names that class
    other.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        other.get_comm_stream()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_legacy_buffer_intranode(world_size, tmp_path):
    run_gloo_ranks(_worker, world_size, tmp_path, deadline=120)


def _refused_peer_worker(rank, world_size):
    """Rank 1's dispatch is refused (float32 x); rank 0's waits for it no longer than the Buffer's
    num_cpu_timeout_secs, then names rank 1, while rank 1's process is still alive."""
    import time
    buffer = deep_ep.Buffer(dist.group.WORLD, num_cpu_timeout_secs=2)
    E, K = 4 * world_size, 2
    x, topk_idx, topk_weights = _inputs(56, [5] * world_size, E, K, 64, False)[rank]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    call = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_weights)
    start = time.monotonic()
    if rank == 1:
        with pytest.raises(TypeError, match="x must have dtype bfloat16"):
            buffer.dispatch(x.float(), **call)
        time.sleep(6)   # alive: rank 0 learns nothing from an exit
    else:
        with pytest.raises(TimeoutError, match="rank 1"):
            buffer.dispatch(x, **call)
        assert time.monotonic() - start < 5


def test_a_refused_peer_is_named_after_the_buffers_timeout(tmp_path):
    with pytest.raises(ValueError, match="num_cpu_timeout_secs must be > 0"):
        deep_ep.Buffer(None, comm=object(), num_cpu_timeout_secs=0)
    run_gloo_ranks(_refused_peer_worker, 2, tmp_path, deadline=60, leave_together=False)
