"""Shared test material: seeded inputs for every rank, and an independent per-token loop spec.

The loop spec below is written from docs/design.md directly, token by token in plain Python, without
looking at deep_ep.reference; the tests compare deep_ep.reference and the CPU backend against it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

FP8 = torch.float8_e4m3fn


@dataclass
class Case:
    """One dispatch + combine configuration, identical on every rank."""
    name: str
    num_ranks: int
    num_tokens: list                 # per rank
    hidden: int = 128
    num_topk: int = 3
    num_experts: int = 8
    x_format: str = "bf16"           # "bf16", "fp8" (float32 sf), "fp8_ue8m0" (int32 packed sf)
    col_major_sf: bool = False
    do_expand: bool = False
    alignment: int = 1
    zero_padding: bool = True
    weights: bool = True
    mask_prob: float = 0.2
    do_cpu_sync: bool = True
    max_tokens: int = 0              # num_max_tokens_per_rank passed to dispatch (0 = None)
    num_bias: int = 0
    combine_weights: bool = True
    allow_multiple_reduction: bool = True
    apply_dispatch_weights: bool = False
    adversarial: bool = False        # combine inputs from values whose float32 sums depend on the order
    duplicate_prob: float = 0.0      # tokens whose last slot repeats the expert of their first
    cached: bool = True
    stats: bool = True
    seed: int = 0


def make_inputs(case: Case):
    """Every rank's dispatch inputs: lists xs, topk_idxs, topk_weights (or None)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    xs, idxs, ws = [], [], []
    E, K, H = case.num_experts, case.num_topk, case.hidden
    for s in range(case.num_ranks):
        T = case.num_tokens[s]
        if case.x_format == "bf16":
            x = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16)
        else:
            data = (torch.randn(T, H, generator=g) * 8).to(FP8)
            if case.x_format == "fp8":
                sf = torch.rand(T, H // 128, generator=g) + 0.5
            else:
                sf = torch.randint(-2**31, 2**31 - 1, (T, math.ceil(H / 512)), generator=g, dtype=torch.int32)
            x = (data, sf)
        scores = torch.rand(T, E, generator=g)
        idx = scores.topk(K, dim=1).indices.to(torch.int64) if T else torch.empty(0, K, dtype=torch.int64)
        mask = torch.rand(T, K, generator=g) < case.mask_prob
        if case.duplicate_prob:
            dup = torch.rand(T, generator=g) < case.duplicate_prob
            idx[dup, K - 1] = idx[dup, 0]
        idx[mask] = -1
        w = torch.rand(T, K, generator=g).float() if case.weights else None
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, (ws if case.weights else None)


#: bf16 values whose float32 sums round differently in different orders (1 + 2**-24 ties back to 1,
#: 1 + 2**-8 is a bf16 tie, ...): with these, any change of the combine order shows in the bits.
ADVERSARIAL_VALUES = torch.tensor([1.0, -1.0, 2.0 ** -8, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -7, 3 * 2.0 ** -24, 0.5])


def _values(shape, g, adversarial: bool) -> torch.Tensor:
    if adversarial:
        return ADVERSARIAL_VALUES[torch.randint(0, len(ADVERSARIAL_VALUES), shape, generator=g)].to(torch.bfloat16)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def make_combine_inputs(case: Case, rows: list, valid: list, seed_offset: int = 0):
    """Per rank: ys bf16 [rows_d, H] with every unspecified row (``valid[d]`` False) poisoned with NaN,
    combine weights (or None), biases (None / tensor / tuple)."""
    g = torch.Generator().manual_seed(5000 + case.seed + seed_offset)
    ys, tws, biases = [], [], []
    for d in range(case.num_ranks):
        y = _values((rows[d], case.hidden), g, case.adversarial)
        y[~valid[d]] = float("nan")
        ys.append(y)
        if case.combine_weights:
            shape = (rows[d],) if case.do_expand else (rows[d], case.num_topk)
            tw = torch.rand(shape, generator=g).float()
            tw[~valid[d]] = float("nan")
            tws.append(tw)
    for s in range(case.num_ranks):
        bs = tuple(_values((case.num_tokens[s], case.hidden), g, case.adversarial) for _ in range(case.num_bias))
        biases.append(None if case.num_bias == 0 else (bs[0] if case.num_bias == 1 else bs))
    return ys, (tws if case.combine_weights else None), biases


# --------------------------------------------------------------------------- the per-token loop spec
@dataclass
class LoopRank:
    rows: list = field(default_factory=list)   # per row: (s, t) or None for padding
    row_k: list = field(default_factory=list)  # expanded: k of the pair; non-expanded: None
    tokens: list = field(default_factory=list)  # received tokens (s, t), in received order
    slot_rows: list = field(default_factory=list)  # per received token: the row of each slot or -1
    per_expert: list = field(default_factory=list)  # aligned counts
    unpadded: list = field(default_factory=list)
    prefix_tokens: list = field(default_factory=list)
    prefix_pairs: list = field(default_factory=list)
    send_pos: list = field(default_factory=list)     # this rank as source: [T][R or K]


def loop_dispatch(xs, idxs, ws, num_experts, do_expand, alignment):
    """design.md, token by token. Returns per rank a LoopRank (layout only; data is looked up)."""
    R = len(xs)
    L = num_experts // R
    K = idxs[0].shape[1]
    out = [LoopRank() for _ in range(R)]
    for s in range(R):
        T = idxs[s].shape[0]
        out[s].send_pos = [[-1] * (K if do_expand else R) for _ in range(T)]
    for d in range(R):
        rk = out[d]
        rk.unpadded = [0] * L
        tokens_from, pairs_from = [0] * R, [0] * R
        for s in range(R):
            for t in range(idxs[s].shape[0]):
                mine = [k for k in range(K) if int(idxs[s][t, k]) >= 0 and int(idxs[s][t, k]) // L == d]
                if mine:
                    rk.tokens.append((s, t))
                    rk.slot_rows.append([-1] * K)
                    tokens_from[s] += 1
                    pairs_from[s] += len(mine)
                for k in mine:
                    rk.unpadded[int(idxs[s][t, k]) - d * L] += 1
        rk.per_expert = [math.ceil(c / alignment) * alignment for c in rk.unpadded]
        if not do_expand:
            for i, (s, t) in enumerate(rk.tokens):
                out[s].send_pos[t][d] = len(rk.rows)
                rk.rows.append((s, t))
                rk.row_k.append(None)
        else:
            for le in range(L):
                start = len(rk.rows)
                for i, (s, t) in enumerate(rk.tokens):
                    for k in range(K):
                        if int(idxs[s][t, k]) == d * L + le:
                            out[s].send_pos[t][k] = len(rk.rows)
                            rk.slot_rows[i][k] = len(rk.rows)
                            rk.rows.append((s, t))
                            rk.row_k.append(k)
                while (len(rk.rows) - start) % alignment:
                    rk.rows.append(None)
                    rk.row_k.append(None)
        acc_t = acc_p = 0
        for s in range(R):
            acc_t += tokens_from[s]
            acc_p += pairs_from[s]
            rk.prefix_tokens.append(acc_t)
            rk.prefix_pairs.append(acc_p)
    return out


def check_against_loop(results, xs, idxs, ws, num_experts, do_expand, alignment, zero_padding=True,
                       num_max_tokens_per_rank=0):
    """Compare dispatch outputs ``results[d] = (recv_x, recv_idx, recv_w, handle)`` with the loop
    spec, element by element (rows past the true count: only the specified fields)."""
    R = len(xs)
    L = num_experts // R
    K = idxs[0].shape[1]
    M = num_max_tokens_per_rank
    spec = loop_dispatch(xs, idxs, ws, num_experts, do_expand, alignment)
    for d in (results.keys() if isinstance(results, dict) else range(R)):
        recv_x, recv_idx, recv_w, h = results[d][:4]
        data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        sf = recv_x[1] if isinstance(recv_x, tuple) else None
        rk = spec[d]
        n = len(rk.rows)
        assert data.shape[0] >= n and data.shape[0] == h.num_recv_rows
        assert h.num_unaligned_recv_tokens_per_expert.tolist() == rk.unpadded
        assert h.psum_num_recv_tokens_per_scaleup_rank.tolist() == rk.prefix_tokens
        assert h.rank_prefix_sum.tolist() == (rk.prefix_pairs if do_expand else rk.prefix_tokens)
        psum, acc = [], 0
        for e in range(L):
            psum.append(acc + (rk.unpadded[e] if do_expand else rk.per_expert[e]))
            acc += rk.per_expert[e]
        assert h.psum_num_recv_tokens_per_expert.tolist() == psum, (h.psum_num_recv_tokens_per_expert, psum)
        if h.do_cpu_sync:
            assert h.num_recv_tokens == len(rk.tokens) and h.num_expanded_tokens == sum(rk.per_expert)
            assert h.num_recv_tokens_per_expert_list == rk.per_expert
        else:
            assert h.num_recv_tokens_per_expert_list == []
        assert h.dst_buffer_slot_idx.tolist() == spec[d].send_pos, (d, h.dst_buffer_slot_idx.tolist(), spec[d].send_pos)
        meta = h.recv_src_metadata
        assert meta.shape == (h.num_recv_tokens, K + 2) and meta.dtype == torch.int32
        for i in range(meta.shape[0]):
            if i >= len(rk.tokens):
                assert (meta[i] == -1).all(), (d, i, meta[i])
                continue
            s, t = rk.tokens[i]
            last = max(k for k in range(K) if int(idxs[s][t, k]) >= 0 and int(idxs[s][t, k]) // L == d)
            want = [s * M + t, s * K + last] + (rk.slot_rows[i] if do_expand else [-1] * K)
            assert meta[i].tolist() == want, (d, i, meta[i].tolist(), want)
        if do_expand:
            assert recv_idx is None
        if ws is None:
            assert recv_w is None
        src_rank, src_token = h.recv_src_rank, h.recv_src_token
        for row in range(data.shape[0]):
            src = rk.rows[row] if row < n else None
            if src is None:
                assert int(src_rank[row]) == -1 and int(src_token[row]) == -1
                if not do_expand:
                    assert (recv_idx[row] == -1).all()
                if recv_w is not None:
                    assert (recv_w[row] == 0).all()
                if row < n and zero_padding:
                    assert (data[row].float() == 0).all()
                    if sf is not None:
                        assert (sf[row] == 0).all()
                continue
            s, t = src
            assert (int(src_rank[row]), int(src_token[row])) == (s, t)
            x_s = xs[s][0] if isinstance(xs[s], tuple) else xs[s]
            assert torch.equal(data[row].view(torch.uint8), x_s[t].view(torch.uint8)), (d, row)
            if sf is not None:
                assert torch.equal(sf[row], xs[s][1][t])
            if do_expand:
                if ws is not None:
                    assert float(recv_w[row]) == float(ws[s][t, rk.row_k[row]])
            else:
                for k in range(K):
                    e = int(idxs[s][t, k])
                    local = e >= 0 and e // L == d
                    assert int(recv_idx[row, k]) == (e - d * L if local else -1)
                    if ws is not None:
                        assert float(recv_w[row, k]) == (float(ws[s][t, k]) if local else 0.0)


def loop_combine(ys, handles, tws, biases, ranks=None, allow_multiple_reduction=True,
                 apply_dispatch_weights=False):
    """design.md "Combine", token by token: per rank (combined_x, combined_topk_weights); only the
    ``ranks`` given (default all) are computed, the others are None."""
    R = len(ys)
    out = []
    for s in range(R):
        if ranks is not None and s not in ranks:
            out.append(None)
            continue
        h = handles[s]
        L, K, H = h.num_experts // R, h.num_topk, h.hidden
        multi = allow_multiple_reduction or not h.do_expand
        xs_out = torch.empty(h.num_tokens, H, dtype=torch.bfloat16)
        cw = torch.zeros(h.num_tokens, K) if tws is not None else None
        b = biases[s] if biases is not None else None
        blist = [] if b is None else ([b] if isinstance(b, torch.Tensor) else [x for x in b if x is not None])
        zero = torch.zeros(H, dtype=torch.float32)
        for t in range(h.num_tokens):
            acc = blist[0][t].float().clone() if blist else torch.zeros(H, dtype=torch.float32)
            for bb in blist[1:]:
                acc += bb[t].float()
            owner = [int(e) // L if int(e) >= 0 else -1 for e in h.topk_idx[t].tolist()]

            def row_of(k):
                return int(h.dst_buffer_slot_idx[t, k if h.do_expand else owner[k]])

            def c(k):
                d, r = owner[k], row_of(k)
                v = ys[d][r].float()
                if apply_dispatch_weights:
                    v = handles[d].recv_topk_weights[r] * v
                return v
            if multi:
                partial = {}
                for d in sorted(set(o for o in owner if o >= 0)):
                    if not h.do_expand:
                        partial[d] = ys[d][int(h.dst_buffer_slot_idx[t, d])]
                    else:
                        p = torch.zeros(H, dtype=torch.float32)
                        for k in range(K):
                            if owner[k] == d:
                                p += c(k)
                        partial[d] = p.to(torch.bfloat16)
                for k in range(K):
                    last = owner[k] >= 0 and owner[k] not in owner[k + 1:]
                    acc += partial[owner[k]].float() if last else zero
            else:
                for k in range(K):
                    acc += c(k) if owner[k] >= 0 else zero
            xs_out[t] = acc.to(torch.bfloat16)
            if tws is not None:
                for k in range(K):
                    if owner[k] >= 0:
                        w = tws[owner[k]]
                        cw[t, k] = w[row_of(k)] if h.do_expand else w[row_of(k), k]
        out.append((xs_out, cw))
    return out


def bits_equal(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def check_cached_dispatch(buf, case: Case, rank: int, handle, idxs, ws, num_experts: int, max_tokens: int,
                          seed_offset: int, with_weights: bool = False):
    """A cached dispatch of fresh data (``case.seed + seed_offset``) with ``handle`` on ``rank``
    (with fresh ``topk_weights`` too when ``with_weights``: the backward of a dispatch), checked
    element by element against `deep_ep.reference`; returns the dispatch's outputs."""
    from deep_ep.reference import check_dispatch, reference_dispatch

    xs2, _, ws2 = make_inputs(Case(**{**case.__dict__, "seed": case.seed + seed_offset, "weights": True}))
    out2 = buf.dispatch(xs2[rank], handle=handle, topk_weights=ws2[rank] if with_weights else None,
                        do_expand=case.do_expand, do_zero_padding=case.zero_padding,
                        use_tma_aligned_col_major_sf=case.col_major_sf)
    ref2 = reference_dispatch(xs2, idxs, ws2 if with_weights else None, num_experts, do_expand=case.do_expand,
                              expert_alignment=case.alignment, do_cpu_sync=case.do_cpu_sync,
                              num_max_tokens_per_rank=max_tokens,
                              use_tma_aligned_col_major_sf=case.col_major_sf)[rank]
    check_dispatch(out2, ref2, do_zero_padding=case.zero_padding, check_handle=False)
    return out2
