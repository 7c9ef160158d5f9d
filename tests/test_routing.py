"""Tests of deep_ep.routing: gates against per-token loops, distinctness, generator statistics."""

import math

import pytest
import torch

from deep_ep import routing


# ---------------------------------------------------------------------------------------------
# Per-token loop references, written independently of the vectorised code.
# ---------------------------------------------------------------------------------------------


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def loop_deepseek_v3(logits, bias, num_groups, topk_groups, top_k, scale, normalize):
    T, E = logits.shape
    per_group = E // num_groups
    idx_rows, w_rows = [], []
    for t in range(T):
        s = [_sigmoid(float(logits[t, e])) for e in range(E)]
        b = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        gscore = []
        for g in range(num_groups):
            members = sorted((b[e] for e in range(g * per_group, (g + 1) * per_group)), reverse=True)
            gscore.append(sum(members[:2]))
        groups = sorted(range(num_groups), key=lambda g: -gscore[g])[:topk_groups]
        cands = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(cands, key=lambda e: -b[e])[:top_k]
        w = [s[e] for e in chosen]
        if normalize:
            tot = sum(w)
            w = [v / tot for v in w]
        idx_rows.append(chosen)
        w_rows.append([v * scale for v in w])
    return torch.tensor(idx_rows, dtype=torch.int64), torch.tensor(w_rows, dtype=torch.float64)


def loop_softmax_topk(logits, top_k, renormalize):
    idx_rows, w_rows = [], []
    for row in logits.tolist():
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        tot = sum(ex)
        p = [v / tot for v in ex]
        chosen = sorted(range(len(row)), key=lambda e: -p[e])[:top_k]
        w = [p[e] for e in chosen]
        if renormalize:
            s = sum(w)
            w = [v / s for v in w]
        idx_rows.append(chosen)
        w_rows.append(w)
    return torch.tensor(idx_rows), torch.tensor(w_rows, dtype=torch.float64)


def loop_topk_softmax(logits, top_k):
    idx_rows, w_rows = [], []
    for row in logits.tolist():
        chosen = sorted(range(len(row)), key=lambda e: -row[e])[:top_k]
        vals = [row[e] for e in chosen]
        m = max(vals)
        ex = [math.exp(v - m) for v in vals]
        idx_rows.append(chosen)
        w_rows.append([v / sum(ex) for v in ex])
    return torch.tensor(idx_rows), torch.tensor(w_rows, dtype=torch.float64)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Gates
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "E,G,TG,K,scale,normalize,with_bias",
    [
        (256, 8, 4, 8, 2.5, True, True),  # DeepSeek-V3
        (64, 8, 3, 6, 1.0, False, True),
        (48, 1, 1, 8, 2.827, True, True),  # Kimi-K2-like (one group)
        (32, 4, 2, 4, 1.5, True, False),
        (16, 16, 4, 4, 1.0, True, True),  # one expert per group
    ],
)
def test_deepseek_v3_gate_matches_loop(E, G, TG, K, scale, normalize, with_bias):
    g = _gen(E + K)
    logits = torch.randn(37, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3 if with_bias else None
    idx, w = routing.deepseek_v3_gate(
        logits, bias, num_groups=G, topk_groups=TG, top_k=K, routed_scaling_factor=scale, normalize=normalize
    )
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (37, K)
    ref_idx, ref_w = loop_deepseek_v3(logits, bias, G, TG, K, scale, normalize)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-6)
    if normalize:
        torch.testing.assert_close(w.sum(-1).double(), torch.full((37,), scale, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    # Group limit: at most TG distinct groups per token.
    assert int((idx // (E // G)).sort(-1).values.diff(dim=-1).ne(0).sum(-1).add(1).max()) <= TG


def test_deepseek_v3_gate_bias_only_affects_selection():
    g = _gen(1)
    logits = torch.randn(20, 32, generator=g)
    bias = torch.zeros(32)
    bias[5] = 100.0  # expert 5 always chosen, its weight stays its unbiased sigmoid score
    idx, w = routing.deepseek_v3_gate(logits, bias, num_groups=4, topk_groups=2, top_k=3,
                                      routed_scaling_factor=1.0, normalize=False)
    assert (idx[:, 0] == 5).all()
    torch.testing.assert_close(w[:, 0], torch.sigmoid(logits[:, 5]))


def test_deepseek_v3_gate_bad_args():
    logits = torch.randn(4, 32)
    with pytest.raises(ValueError):
        routing.deepseek_v3_gate(logits, None, num_groups=5, topk_groups=1, top_k=2, routed_scaling_factor=1.0)
    with pytest.raises(ValueError):
        routing.deepseek_v3_gate(logits, None, num_groups=8, topk_groups=1, top_k=5, routed_scaling_factor=1.0)
    with pytest.raises(ValueError):
        routing.deepseek_v3_gate(logits, torch.zeros(31), num_groups=8, topk_groups=2, top_k=2, routed_scaling_factor=1.0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_gate_matches_loop(renormalize):
    logits = torch.randn(25, 64, generator=_gen(2)) * 3
    idx, w = routing.softmax_topk_gate(logits, 6, renormalize=renormalize)
    ref_idx, ref_w = loop_softmax_topk(logits, 6, renormalize)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-7)


def test_topk_softmax_gate_matches_loop_and_equals_renormalised_softmax():
    logits = torch.randn(25, 8, generator=_gen(3)) * 3
    idx, w = routing.topk_softmax_gate(logits, 2)
    ref_idx, ref_w = loop_topk_softmax(logits, 2)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-7)
    idx2, w2 = routing.softmax_topk_gate(logits, 2, renormalize=True)
    assert torch.equal(idx, idx2)
    torch.testing.assert_close(w, w2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(routing.MODEL_PRESETS))
def test_presets_gate(name):
    p = routing.get_preset(name)
    logits = torch.randn(16, p.num_experts, generator=_gen(4))
    bias = torch.randn(p.num_experts, generator=_gen(5)) * 0.1 if p.gate_kind == "deepseek_v3" else None
    idx, w = routing.gate(p, logits, bias)
    assert idx.shape == (16, p.top_k) and w.shape == (16, p.top_k)
    _assert_distinct(idx)
    assert (w > 0).all()


def test_preset_values():
    v3 = routing.get_preset("DeepSeek_V3")
    assert (v3.hidden, v3.num_experts, v3.top_k, v3.num_groups, v3.topk_groups, v3.routed_scaling_factor) == (
        7168, 256, 8, 8, 4, 2.5)
    assert routing.get_preset("mixtral-8x7b").num_experts == 8
    assert routing.get_preset("gpt-oss-120b").hidden == 2880
    assert not routing.get_preset("deepseek-v2-lite").normalize
    with pytest.raises(KeyError):
        routing.get_preset("nope")
    with pytest.raises(ValueError):
        routing.get_preset("mixtral-8x7b").experts_per_rank(3)


# ---------------------------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------------------------


def _assert_distinct(idx):
    for row in idx.tolist():
        valid = [e for e in row if e >= 0]
        assert len(valid) == len(set(valid)), row


def test_balanced_routing():
    T, E, K = 4096, 64, 8
    idx = routing.balanced_routing(T, E, K, generator=_gen(6))
    assert idx.dtype == torch.int64 and idx.shape == (T, K)
    assert idx.min() >= 0 and idx.max() < E
    _assert_distinct(idx)
    load = routing.expert_load(idx, E).double()
    mean = T * K / E
    assert (load - mean).abs().max() < 6 * math.sqrt(mean)
    # Seeded: same generator seed, same routing.
    assert torch.equal(idx, routing.balanced_routing(T, E, K, generator=_gen(6)))
    assert routing.balanced_routing(0, E, K).shape == (0, K)


@pytest.mark.parametrize(
    "E,K,R,ratio,hot",
    [(256, 8, 4, 2.0, 0), (256, 8, 8, 3.0, 5), (128, 4, 4, 1.5, 3), (256, 8, 4, 1.0, 1), (64, 6, 8, 0.5, 2),
     (8, 2, 4, 3.0, 2)],
)
def test_imbalanced_routing_hot_ratio(E, K, R, ratio, hot):
    T = 8192
    idx = routing.imbalanced_routing(T, E, K, num_ranks=R, hot_rank_ratio=ratio, hot_rank=hot, generator=_gen(7))
    assert idx.shape == (T, K) and idx.min() >= 0 and idx.max() < E
    _assert_distinct(idx)
    load = routing.rank_load(idx, E, R).double()
    mean = T * K / R
    assert abs(load[hot] / mean - ratio) < 0.03 * max(ratio, 1)
    others = torch.cat([load[:hot], load[hot + 1:]])
    expected_other = (T * K - ratio * mean) / (R - 1)
    assert ((others - expected_other).abs() / mean).max() < 0.05


def test_imbalanced_routing_unreachable_ratio():
    with pytest.raises(ValueError, match="not reachable"):
        routing.imbalanced_routing(10, 256, 8, num_ranks=4, hot_rank_ratio=5.0)


def test_zipf_routing_skew():
    T, E, K = 8192, 64, 4
    idx = routing.zipf_routing(T, E, K, alpha=1.2, shuffle_experts=False, generator=_gen(8))
    assert idx.shape == (T, K)
    _assert_distinct(idx)
    load = routing.expert_load(idx, E).double()
    # Popularity decreases with the expert's Zipf rank (expert 0 hottest without shuffling).
    assert load[0] > 3 * load.median()
    top, bottom = load[:8].mean(), load[-8:].mean()
    assert top > 10 * bottom
    # Roughly monotone: compare consecutive blocks of 8 experts.
    blocks = load.view(8, 8).mean(-1)
    assert (blocks.diff() < 0).all()
    # alpha = 0 is uniform.
    flat = routing.expert_load(routing.zipf_routing(T, E, K, alpha=0.0, generator=_gen(9)), E).double()
    assert flat.max() / flat.min() < 1.4
    # Shuffled: the same multiset of loads shape, hot experts not at index 0 in general.
    shuffled = routing.zipf_routing(T, E, K, alpha=1.2, generator=_gen(10))
    _assert_distinct(shuffled)
    assert routing.expert_load(shuffled, E).max() > 3 * routing.expert_load(shuffled, E).double().median()


@pytest.mark.parametrize("prob", [0.0, 0.1, 0.5, 1.0])
def test_mask_routing(prob):
    idx = routing.balanced_routing(4000, 32, 4, generator=_gen(11))
    masked = routing.mask_routing(idx, prob, generator=_gen(12))
    assert masked.shape == idx.shape and masked.dtype == torch.int64
    kept = masked >= 0
    assert torch.equal(masked[kept], idx[kept])
    assert ((masked == -1) | kept).all()
    frac = (~kept).double().mean().item()
    assert abs(frac - prob) < 0.02
    _assert_distinct(masked)


def test_random_weights():
    idx = routing.mask_routing(routing.balanced_routing(500, 32, 4, generator=_gen(13)), 0.3, generator=_gen(14))
    w = routing.random_weights(idx, generator=_gen(15))
    assert w.dtype == torch.float32 and w.shape == idx.shape
    assert (w[idx < 0] == 0).all() and (w[idx >= 0] > 0).all()
    has_any = (idx >= 0).any(-1)
    torch.testing.assert_close(w[has_any].sum(-1), torch.ones(int(has_any.sum())))
    assert (w[~has_any] == 0).all()


def test_zipf_routing_shared_popularity_order():
    order = torch.randperm(32, generator=_gen(16))
    a = routing.zipf_routing(4000, 32, 4, alpha=1.5, popularity_order=order, generator=_gen(17))
    b = routing.zipf_routing(4000, 32, 4, alpha=1.5, popularity_order=order, generator=_gen(18))
    for idx in (a, b):  # different tokens, same hottest expert
        assert int(routing.expert_load(idx, 32).argmax()) == int(order[0])
    with pytest.raises(ValueError):
        routing.zipf_routing(4, 32, 4, alpha=1.0, popularity_order=torch.zeros(32, dtype=torch.int64))
