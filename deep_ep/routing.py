"""Routing tools: MoE gates and synthetic routing generators for benchmarks and tests.

Everything here works on plain torch tensors on any device and involves no communication. The
outputs use the layout dispatch consumes: ``topk_idx`` ``[num_tokens, top_k]`` int64 with ``-1``
meaning "no selection", ``topk_weights`` ``[num_tokens, top_k]`` float32.

Gates
-----
* :func:`deepseek_v3_gate`: group-limited sigmoid gate of DeepSeek-V3 / R1 (and Kimi-K2 with one
  group), as described in the DeepSeek-V3 technical report (arXiv:2412.19437, section 2.1.2,
  "auxiliary-loss-free load balancing" and "node-limited routing") and its published config
  (``scoring_func="sigmoid"``, ``topk_method="noaux_tc"``, ``n_group``, ``topk_group``,
  ``norm_topk_prob``, ``routed_scaling_factor``).
* :func:`softmax_topk_gate`: softmax over all experts, then top-k, optionally renormalised over the
  chosen k (Qwen3 with ``renormalize=True``; DeepSeek-V2-Lite with ``renormalize=False``).
* :func:`topk_softmax_gate`: top-k of the raw logits, then softmax over those k (Mixtral, GPT-OSS).
  Mathematically this equals ``softmax_topk_gate(..., renormalize=True)``; it is kept separate
  because that is how those models compute it (fewer exponentials, different rounding).

Generators (all take a ``torch.Generator`` for reproducibility)
---------------------------------------------------------------
* :func:`balanced_routing`: each token picks ``top_k`` distinct experts uniformly at random.
* :func:`imbalanced_routing`: one hot rank receives ``hot_rank_ratio`` times the mean number of
  (token, expert) pairs per rank.
* :func:`zipf_routing`: Zipf-skewed expert popularity, distinct experts per token.
* :func:`mask_routing`: sets random entries to ``-1``.
* :func:`random_weights`: positive weights that sum to one over each row's valid entries.

Presets
-------
:data:`MODEL_PRESETS` maps a model name to a :class:`ModelPreset` (hidden size, experts, top-k and
gate parameters from the models' published configurations), and :func:`gate` applies a preset's
gate to a logits tensor.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import torch

__all__ = [
    "ModelPreset",
    "MODEL_PRESETS",
    "get_preset",
    "gate",
    "deepseek_v3_gate",
    "softmax_topk_gate",
    "topk_softmax_gate",
    "balanced_routing",
    "imbalanced_routing",
    "zipf_routing",
    "mask_routing",
    "random_weights",
    "expert_load",
    "rank_load",
]


# ---------------------------------------------------------------------------------------------
# Gates
# ---------------------------------------------------------------------------------------------


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [num_tokens, num_experts], got {getattr(logits, 'shape', type(logits))}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def deepseek_v3_gate(
    logits: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    *,
    num_groups: int,
    topk_groups: int,
    top_k: int,
    routed_scaling_factor: float,
    normalize: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 group-limited sigmoid gate (``noaux_tc``).

    Args:
        logits: ``[T, E]`` floating point, the router's output ``x @ W_gate^T``. Computed in fp32.
        correction_bias: ``[E]`` per-expert bias (``e_score_correction_bias``) used for *selection
            only*, or ``None`` for zeros.
        num_groups: ``n_group``; experts are split into ``num_groups`` contiguous groups of
            ``E / num_groups``.
        topk_groups: ``topk_group``; how many groups each token may route to.
        top_k: experts per token (``num_experts_per_tok``).
        routed_scaling_factor: multiplies the final weights (2.5 for DeepSeek-V3).
        normalize: ``norm_topk_prob``; divide the chosen scores by their sum before scaling.

    Returns:
        ``(topk_idx, topk_weights)``: ``[T, top_k]`` int64 expert ids, in descending order of the
        biased score, and ``[T, top_k]`` float32 weights.

    Algorithm (DeepSeek-V3 report, eqs. 15-16 plus node-limited routing):
        ``s = sigmoid(logits)``; ``b = s + correction_bias`` (selection scores);
        group score = sum of the two largest ``b`` in the group; keep the ``topk_groups`` best
        groups; choose the ``top_k`` largest ``b`` among the experts of the kept groups;
        weights = the *unbiased* ``s`` of the chosen experts, divided by their sum when
        ``normalize``, times ``routed_scaling_factor``.
    """
    _check_logits(logits)
    num_tokens, num_experts = logits.shape
    _check_top_k(top_k, num_experts)
    if num_groups < 1 or num_experts % num_groups != 0:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of num_groups={num_groups}")
    experts_per_group = num_experts // num_groups
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be in [1, num_groups={num_groups}], got {topk_groups}")
    if topk_groups * experts_per_group < top_k:
        raise ValueError(
            f"top_k={top_k} experts cannot be chosen from {topk_groups} groups of {experts_per_group}"
        )

    scores = torch.sigmoid(logits.float())
    if correction_bias is None:
        biased = scores
    else:
        if correction_bias.shape != (num_experts,):
            raise ValueError(f"correction_bias must have shape [{num_experts}], got {tuple(correction_bias.shape)}")
        biased = scores + correction_bias.to(device=scores.device, dtype=torch.float32)

    # Group scores: sum of the two best (biased) experts of each group (a single expert if the
    # group has only one).
    grouped = biased.view(num_tokens, num_groups, experts_per_group)
    group_scores = grouped.topk(min(2, experts_per_group), dim=-1).values.sum(dim=-1)  # [T, G]
    kept_groups = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, kept_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, experts_per_group).reshape(num_tokens, num_experts)

    masked = biased.masked_fill(~expert_mask, float("-inf"))
    topk_idx = masked.topk(top_k, dim=-1).indices  # sorted, descending
    topk_weights = scores.gather(1, topk_idx)
    if normalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    return topk_idx.to(torch.int64), topk_weights.to(torch.float32)


def softmax_topk_gate(
    logits: torch.Tensor, top_k: int, *, renormalize: bool = True
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax gate: ``p = softmax(logits)`` over all experts (fp32), keep the ``top_k`` largest.

    Args:
        logits: ``[T, E]`` floating point.
        top_k: experts per token.
        renormalize: divide the chosen probabilities by their sum (Qwen3's ``norm_topk_prob=True``);
            DeepSeek-V2-Lite uses ``False``.

    Returns:
        ``(topk_idx [T, top_k] int64, topk_weights [T, top_k] float32)``, by descending probability.
    """
    _check_logits(logits)
    _check_top_k(top_k, logits.shape[1])
    probs = torch.softmax(logits.float(), dim=-1)
    topk_weights, topk_idx = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx.to(torch.int64), topk_weights.to(torch.float32)


def topk_softmax_gate(logits: torch.Tensor, top_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / GPT-OSS gate: the ``top_k`` largest logits, then a softmax over those ``k``.

    Args:
        logits: ``[T, E]`` floating point.
        top_k: experts per token.

    Returns:
        ``(topk_idx [T, top_k] int64, topk_weights [T, top_k] float32)``, by descending logit.
    """
    _check_logits(logits)
    _check_top_k(top_k, logits.shape[1])
    values, topk_idx = logits.float().topk(top_k, dim=-1)
    return topk_idx.to(torch.int64), torch.softmax(values, dim=-1).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# Model presets
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """MoE layer shape and gate of a public model (values from the model's published config).

    ``gate_kind`` is one of ``"deepseek_v3"`` (:func:`deepseek_v3_gate`), ``"softmax_topk"``
    (:func:`softmax_topk_gate`, renormalised when ``normalize``) or ``"topk_softmax"``
    (:func:`topk_softmax_gate`).
    """

    name: str
    hidden: int
    num_experts: int
    top_k: int
    gate_kind: str
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    normalize: bool = True
    num_shared_experts: int = 0
    expert_intermediate: Optional[int] = None

    def experts_per_rank(self, num_ranks: int) -> int:
        """Local experts per rank; raises ``ValueError`` if the experts do not split evenly."""
        if num_ranks < 1 or self.num_experts % num_ranks != 0:
            raise ValueError(
                f"{self.name}: num_experts={self.num_experts} is not divisible by {num_ranks} ranks"
            )
        return self.num_experts // num_ranks


MODEL_PRESETS: Dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("deepseek-v3", 7168, 256, 8, "deepseek_v3", num_groups=8, topk_groups=4,
                    routed_scaling_factor=2.5, normalize=True, num_shared_experts=1,
                    expert_intermediate=2048),
        ModelPreset("kimi-k2", 7168, 384, 8, "deepseek_v3", num_groups=1, topk_groups=1,
                    routed_scaling_factor=2.827, normalize=True, num_shared_experts=1),
        ModelPreset("qwen3-235b-a22b", 4096, 128, 8, "softmax_topk", normalize=True,
                    expert_intermediate=1536),
        ModelPreset("qwen3-30b-a3b", 2048, 128, 8, "softmax_topk", normalize=True,
                    expert_intermediate=768),
        ModelPreset("gpt-oss-120b", 2880, 128, 4, "topk_softmax"),
        ModelPreset("mixtral-8x7b", 4096, 8, 2, "topk_softmax"),
        ModelPreset("deepseek-v2-lite", 2048, 64, 6, "softmax_topk", normalize=False,
                    num_shared_experts=2),
    )
}


def get_preset(name: str) -> ModelPreset:
    """Look up a preset by name (case-insensitive; ``_`` and ``-`` are interchangeable)."""
    key = name.lower().replace("_", "-")
    if key not in MODEL_PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[key]


def gate(
    preset: ModelPreset, logits: torch.Tensor, correction_bias: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Apply ``preset``'s gate to ``logits [T, E]`` → ``(topk_idx int64, topk_weights float32)``."""
    if logits.dim() != 2 or logits.shape[1] != preset.num_experts:
        raise ValueError(f"{preset.name}: logits must be [T, {preset.num_experts}], got {tuple(logits.shape)}")
    if preset.gate_kind == "deepseek_v3":
        return deepseek_v3_gate(
            logits, correction_bias, num_groups=preset.num_groups, topk_groups=preset.topk_groups,
            top_k=preset.top_k, routed_scaling_factor=preset.routed_scaling_factor,
            normalize=preset.normalize,
        )
    if preset.gate_kind == "softmax_topk":
        return softmax_topk_gate(logits, preset.top_k, renormalize=preset.normalize)
    if preset.gate_kind == "topk_softmax":
        return topk_softmax_gate(logits, preset.top_k)
    raise ValueError(f"unknown gate kind {preset.gate_kind!r}")


# ---------------------------------------------------------------------------------------------
# Routing generators
# ---------------------------------------------------------------------------------------------


def _check_routing_shape(num_tokens: int, num_experts: int, top_k: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    _check_top_k(top_k, num_experts)


def _rand(shape, generator: Optional[torch.Generator], device) -> torch.Tensor:
    # Draw on the generator's device (CPU by default) and move, so a seed means the same routing
    # on every device.
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, dtype=torch.float32, device=gen_device).to(device)


def _random_subsets(num_rows: int, num_items: int, size: int, generator, device) -> torch.Tensor:
    """``[num_rows, size]`` int64: per row, a uniformly random ``size``-subset of ``range(num_items)``
    in random order (top-``size`` of i.i.d. uniform keys)."""
    if size == 0 or num_rows == 0:
        return torch.empty(num_rows, size, dtype=torch.int64, device=device)
    return _rand((num_rows, num_items), generator, device).topk(size, dim=-1).indices


def balanced_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    generator: Optional[torch.Generator] = None,
    device="cpu",
) -> torch.Tensor:
    """Uniform routing: each token picks ``top_k`` distinct experts uniformly at random.

    Every expert (hence every rank) gets ``num_tokens * top_k / num_experts`` pairs in expectation.
    Returns ``[num_tokens, top_k]`` int64.
    """
    _check_routing_shape(num_tokens, num_experts, top_k)
    return _random_subsets(num_tokens, num_experts, top_k, generator, device)


def imbalanced_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    num_ranks: int,
    hot_rank_ratio: float,
    hot_rank: int = 0,
    generator: Optional[torch.Generator] = None,
    device="cpu",
) -> torch.Tensor:
    """Routing where rank ``hot_rank`` receives ``hot_rank_ratio`` times the mean load.

    Load is counted in (token, expert) pairs, i.e. expert work; the mean over ranks is
    ``num_tokens * top_k / num_ranks``. Each token sends ``n_t`` of its ``top_k`` selections to
    distinct experts of the hot rank and the rest to distinct experts of the other ranks (uniformly),
    with ``n_t`` = ``floor(f)`` or ``ceil(f)`` at random so that ``E[n_t] = f =
    top_k * hot_rank_ratio / num_ranks``. The other ranks share the remaining load evenly
    (in expectation). ``hot_rank_ratio=1`` is balanced; values below 1 make a cold rank.

    Constraints: ``0 <= f <= min(top_k, L)`` and ``top_k - f <= E - L`` (``L = E / num_ranks``).
    Returns ``[num_tokens, top_k]`` int64, entries of a row distinct and in random order.
    """
    _check_routing_shape(num_tokens, num_experts, top_k)
    if num_ranks < 1 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts={num_experts} must be divisible by num_ranks={num_ranks}")
    if not 0 <= hot_rank < num_ranks:
        raise ValueError(f"hot_rank must be in [0, {num_ranks}), got {hot_rank}")
    num_local = num_experts // num_ranks
    num_other = num_experts - num_local
    f = top_k * float(hot_rank_ratio) / num_ranks
    max_f = min(top_k, num_local)
    min_f = max(0, top_k - num_other)
    if not min_f <= f <= max_f + 1e-12:
        lo, hi = min_f * num_ranks / top_k, max_f * num_ranks / top_k
        raise ValueError(
            f"hot_rank_ratio={hot_rank_ratio} is not reachable with {num_ranks} ranks, {num_experts} "
            f"experts and top_k={top_k}: it must lie in [{lo:g}, {hi:g}]"
        )
    f = min(max(f, min_f), max_f)

    # n_t: selections that go to the hot rank.
    base = math.floor(f)
    frac = f - base
    n_hot = torch.full((num_tokens,), base, dtype=torch.int64, device=device)
    if frac > 0:
        n_hot += (_rand((num_tokens,), generator, device) < frac).to(torch.int64)

    hot = _random_subsets(num_tokens, num_local, min(top_k, num_local), generator, device)
    hot = hot + hot_rank * num_local
    cold = _random_subsets(num_tokens, num_other, min(top_k, num_other), generator, device)
    cold = torch.where(cold >= hot_rank * num_local, cold + num_local, cold)

    # Column j of a row takes hot[j] when j < n_t, else cold[j - n_t].
    cols = torch.arange(top_k, device=device).unsqueeze(0)
    use_hot = cols < n_hot.unsqueeze(1)
    hot_pick = hot.gather(1, cols.clamp(max=hot.shape[1] - 1).expand(num_tokens, -1)) if hot.shape[1] else None
    cold_cols = (cols - n_hot.unsqueeze(1)).clamp(min=0, max=max(cold.shape[1] - 1, 0))
    cold_pick = cold.gather(1, cold_cols) if cold.shape[1] else None
    if hot_pick is None:
        out = cold_pick
    elif cold_pick is None:
        out = hot_pick
    else:
        out = torch.where(use_hot, hot_pick, cold_pick)

    # Shuffle each row so hot experts are not always first.
    order = _rand((num_tokens, top_k), generator, device).argsort(dim=-1)
    return out.gather(1, order)


def zipf_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    alpha: float,
    shuffle_experts: bool = True,
    popularity_order: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    device="cpu",
) -> torch.Tensor:
    """Zipf-skewed routing: expert popularity ``p_i ∝ 1 / i**alpha`` for popularity rank ``i = 1..E``.

    Each token draws ``top_k`` distinct experts by weighted sampling without replacement
    (Gumbel-top-k on ``log p``), so the hottest experts saturate at one selection per token and
    every row stays distinct. With ``shuffle_experts`` (default) popularity ranks are assigned to
    expert ids by a random permutation (hot experts scattered over ranks); otherwise expert 0 is
    the most popular, then 1, ... (so rank 0 is the hottest rank). ``popularity_order`` (``[E]``
    int64 permutation, ``popularity_order[i]`` = the expert of popularity rank ``i + 1``) fixes the
    assignment explicitly, e.g. to share one popularity ranking between ranks that each generate
    their own tokens; it overrides ``shuffle_experts``. ``alpha=0`` is uniform.
    Returns ``[num_tokens, top_k]`` int64, in descending sampling-key order.
    """
    _check_routing_shape(num_tokens, num_experts, top_k)
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    log_p = -float(alpha) * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64, device="cpu"))
    if popularity_order is not None:
        perm = popularity_order.to(device="cpu", dtype=torch.int64)
        if perm.shape != (num_experts,) or not torch.equal(perm.sort().values, torch.arange(num_experts, device="cpu")):
            raise ValueError("popularity_order must be a permutation of range(num_experts)")
        log_p = torch.empty_like(log_p).scatter_(0, perm, log_p)
    elif shuffle_experts:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        perm = torch.randperm(num_experts, generator=generator, device=gen_device).cpu()
        log_p = torch.empty_like(log_p).scatter_(0, perm, log_p)  # expert perm[i] gets rank i
    log_p = log_p.to(device=device, dtype=torch.float32)
    if num_tokens == 0:
        return torch.empty(0, top_k, dtype=torch.int64, device=device)
    u = _rand((num_tokens, num_experts), generator, device).clamp_(1e-12, 1 - 1e-7)
    gumbel = -torch.log(-torch.log(u))
    return (log_p.unsqueeze(0) + gumbel).topk(top_k, dim=-1).indices


def mask_routing(
    topk_idx: torch.Tensor, prob: float, *, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Return a copy of ``topk_idx`` with each entry replaced by ``-1`` with probability ``prob``
    (independently; a row may become all ``-1``: a token sent nowhere)."""
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {prob}")
    if prob == 0.0:
        return topk_idx.clone()
    drop = _rand(tuple(topk_idx.shape), generator, topk_idx.device) < prob
    return topk_idx.masked_fill(drop, -1)


def random_weights(
    topk_idx: torch.Tensor, *, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Random gate weights for ``topk_idx [T, K]``: float32 ``[T, K]``, positive on valid entries,
    0 where ``topk_idx == -1``, each row's valid entries summing to 1 (rows with none are all 0)."""
    w = _rand(tuple(topk_idx.shape), generator, topk_idx.device) + 0.05
    w = w.masked_fill(topk_idx < 0, 0.0)
    return (w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# Load statistics
# ---------------------------------------------------------------------------------------------


def expert_load(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[num_experts]`` int64: (token, expert) pairs per expert (``-1`` entries ignored)."""
    valid = topk_idx[topk_idx >= 0]
    return torch.bincount(valid.flatten().to(torch.int64), minlength=num_experts)


def rank_load(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[num_ranks]`` int64: (token, expert) pairs per rank, experts split evenly in order."""
    return expert_load(topk_idx, num_experts).view(num_ranks, -1).sum(dim=-1)
