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
        idx[mask] = -1
        w = torch.rand(T, K, generator=g).float() if case.weights else None
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, (ws if case.weights else None)


def make_combine_inputs(case: Case, rows: list, valid: list, seed_offset: int = 0):
    """Per rank: ys bf16 [rows_d, H] with every unspecified row (``valid[d]`` False) poisoned with NaN,
    combine weights (or None), biases (None / tensor / tuple)."""
    g = torch.Generator().manual_seed(5000 + case.seed + seed_offset)
    ys, tws, biases = [], [], []
    for d in range(case.num_ranks):
        y = (torch.randn(rows[d], case.hidden, generator=g)).to(torch.bfloat16)
        y[~valid[d]] = float("nan")
        ys.append(y)
        if case.combine_weights:
            shape = (rows[d],) if case.do_expand else (rows[d], case.num_topk)
            tw = torch.rand(shape, generator=g).float()
            tw[~valid[d]] = float("nan")
            tws.append(tw)
    for s in range(case.num_ranks):
        bs = tuple((torch.randn(case.num_tokens[s], case.hidden, generator=g)).to(torch.bfloat16)
                   for _ in range(case.num_bias))
        biases.append(None if case.num_bias == 0 else (bs[0] if case.num_bias == 1 else bs))
    return ys, (tws if case.combine_weights else None), biases


# --------------------------------------------------------------------------- the per-token loop spec
@dataclass
class LoopRank:
    rows: list = field(default_factory=list)   # per row: (s, t) or None for padding
    row_k: list = field(default_factory=list)  # expanded: k of the pair; non-expanded: None
    per_expert: list = field(default_factory=list)  # padded counts
    unpadded: list = field(default_factory=list)
    prefix: list = field(default_factory=list)
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
        per_src = [0] * R
        for s in range(R):
            for t in range(idxs[s].shape[0]):
                for k in range(K):
                    e = int(idxs[s][t, k])
                    if e >= 0 and e // L == d:
                        rk.unpadded[e - d * L] += 1
        rk.per_expert = [math.ceil(c / alignment) * alignment for c in rk.unpadded]
        if not do_expand:
            for s in range(R):
                for t in range(idxs[s].shape[0]):
                    if any(int(e) >= 0 and int(e) // L == d for e in idxs[s][t].tolist()):
                        out[s].send_pos[t][d] = len(rk.rows)
                        rk.rows.append((s, t))
                        rk.row_k.append(None)
                        per_src[s] += 1
        else:
            for le in range(L):
                start = len(rk.rows)
                for s in range(R):
                    for t in range(idxs[s].shape[0]):
                        for k in range(K):
                            if int(idxs[s][t, k]) == d * L + le:
                                out[s].send_pos[t][k] = len(rk.rows)
                                rk.rows.append((s, t))
                                rk.row_k.append(k)
                                per_src[s] += 1
                while (len(rk.rows) - start) % alignment:
                    rk.rows.append(None)
                    rk.row_k.append(None)
        acc = 0
        for s in range(R):
            acc += per_src[s]
            rk.prefix.append(acc)
    return out


def check_against_loop(results, xs, idxs, ws, num_experts, do_expand, alignment, zero_padding=True):
    """Compare dispatch outputs ``results[d] = (recv_x, recv_idx, recv_w, handle)`` with the loop
    spec, element by element (rows past the true count: only the specified fields)."""
    R = len(xs)
    L = num_experts // R
    K = idxs[0].shape[1]
    spec = loop_dispatch(xs, idxs, ws, num_experts, do_expand, alignment)
    for d in (results.keys() if isinstance(results, dict) else range(R)):
        recv_x, recv_idx, recv_w, h = results[d][:4]
        data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        sf = recv_x[1] if isinstance(recv_x, tuple) else None
        rk = spec[d]
        n = len(rk.rows)
        assert h.num_recv_tokens_gpu.tolist() == [n], (d, h.num_recv_tokens_gpu, n)
        assert data.shape[0] >= n
        assert h.num_recv_tokens_per_expert.tolist() == rk.per_expert
        assert h.rank_prefix_sum.tolist() == rk.prefix
        assert h.send_pos.tolist() == spec[d].send_pos, (d, h.send_pos.tolist(), spec[d].send_pos)
        for row in range(data.shape[0]):
            src = rk.rows[row] if row < n else None
            if src is None:
                assert int(h.recv_src_rank[row]) == -1 and int(h.recv_src_token[row]) == -1
                if do_expand:
                    assert int(recv_idx[row]) == -1 and float(recv_w[row]) == 0.0
                else:
                    assert (recv_idx[row] == -1).all()
                    if recv_w is not None:
                        assert (recv_w[row] == 0).all()
                if row < n and zero_padding:
                    assert (data[row].float() == 0).all()
                    if sf is not None:
                        assert (sf[row] == 0).all()
                continue
            s, t = src
            assert (int(h.recv_src_rank[row]), int(h.recv_src_token[row])) == (s, t)
            x_s = xs[s][0] if isinstance(xs[s], tuple) else xs[s]
            assert torch.equal(data[row].view(torch.uint8), x_s[t].view(torch.uint8)), (d, row)
            if sf is not None:
                assert torch.equal(sf[row], xs[s][1][t])
            if do_expand:
                k = rk.row_k[row]
                assert int(recv_idx[row]) == int(idxs[s][t, k]) - d * L
                want = float(ws[s][t, k]) if ws is not None else 1.0
                assert float(recv_w[row]) == want
            else:
                for k in range(K):
                    e = int(idxs[s][t, k])
                    local = e >= 0 and e // L == d
                    assert int(recv_idx[row, k]) == (e - d * L if local else -1)
                    if ws is not None:
                        assert float(recv_w[row, k]) == (float(ws[s][t, k]) if local else 0.0)
        if ws is None and not do_expand:
            assert recv_w is None


def loop_combine(ys, handles, tws, biases, ranks=None):
    """design.md "Combine", token by token: per rank (combined_x, combined_topk_weights); only the
    ``ranks`` given (default all) are computed, the others are None."""
    R = len(ys)
    out = []
    for s in range(R):
        if ranks is not None and s not in ranks:
            out.append(None)
            continue
        h = handles[s]
        L = h.num_experts // R
        xs_out = torch.empty(h.num_tokens, h.hidden, dtype=torch.bfloat16)
        cw = torch.zeros(h.num_tokens, h.num_topk) if tws is not None else None
        b = biases[s] if biases is not None else None
        blist = [] if b is None else ([b] if isinstance(b, torch.Tensor) else list(b))
        for t in range(h.num_tokens):
            acc = torch.zeros(h.hidden, dtype=torch.float32)
            if not h.do_expand:
                for d in range(R):
                    p = int(h.send_pos[t, d])
                    if p >= 0:
                        acc += ys[d][p].float()
                        if tws is not None:
                            for k in range(h.num_topk):
                                cw[t, k] += tws[d][p, k]
            else:
                for k in range(h.num_topk):
                    p = int(h.send_pos[t, k])
                    if p >= 0:
                        d = int(h.topk_idx[t, k]) // L
                        acc += handles[d].recv_topk_weights[p] * ys[d][p].float()
                        if tws is not None:
                            cw[t, k] = tws[d][p]
            for bb in blist:
                acc += bb[t].float()
            xs_out[t] = acc.to(torch.bfloat16)
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
                          seed_offset: int):
    """A cached dispatch of fresh data (``case.seed + seed_offset``) with ``handle`` on ``rank``,
    checked element by element against `deep_ep.reference`; returns the dispatch's outputs."""
    from deep_ep.reference import check_dispatch, reference_dispatch

    xs2, _, _ = make_inputs(Case(**{**case.__dict__, "seed": case.seed + seed_offset}))
    out2 = buf.dispatch(xs2[rank], handle=handle, do_expand=case.do_expand, do_zero_padding=case.zero_padding,
                        use_tma_aligned_col_major_sf=case.col_major_sf)
    ref2 = reference_dispatch(xs2, idxs, ws, num_experts, do_expand=case.do_expand,
                              expert_alignment=case.alignment, do_cpu_sync=case.do_cpu_sync,
                              num_max_tokens_per_rank=max_tokens,
                              use_tma_aligned_col_major_sf=case.col_major_sf)[rank]
    if not case.do_expand:
        ref2.recv_topk_weights = None  # a cached non-expanded dispatch returns no weights
    check_dispatch(out2, ref2, do_zero_padding=case.zero_padding, check_handle=False)
    return out2
