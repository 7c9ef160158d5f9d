"""Configuration of a bench run, its inputs (regenerated identically on every rank), and byte counts.

Every rank regenerates every rank's inputs from the seed (:func:`make_rank_inputs`), so each rank can
evaluate `deep_ep.reference` for itself without communication.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import routing
from .fp8 import dequantize_fp8, quantize_fp8

__all__ = [
    "CPU_DEFAULT_TOKENS", "GPU_DEFAULT_TOKENS", "CPU_DEFAULT_ITERS", "GPU_DEFAULT_ITERS",
    "BANDWIDTH_FORMULA", "BenchConfig", "make_config", "Workload", "make_topk", "make_rank_inputs",
    "expert_output", "token_copies", "floor_rows", "written_rows", "floor_bytes", "logical_bytes", "bandwidth_gbps",
    "num_rows",
]

CPU_DEFAULT_TOKENS = 512
GPU_DEFAULT_TOKENS = 4096
CPU_DEFAULT_ITERS = 5
GPU_DEFAULT_ITERS = 50

BANDWIDTH_FORMULA = (
    "logical bytes / median time; bytes of rank s = copies_s * bytes_per_token, copies_s = "
    "sum over tokens of the number of destination ranks (non-expanded) or of valid (token, expert) "
    "pairs (expanded), local copies included; bytes_per_token = 2*hidden (bf16), hidden + 4*num_sf "
    "(FP8 dispatch), 2*hidden for combine; GB = 1e9 bytes"
)


@dataclasses.dataclass
class BenchConfig:
    """Everything that determines a bench run's inputs and layout (JSON-serialisable).

    ``num_experts`` is the number of experts dispatched to (the model's, or with EPLB the physical
    slots of the balanced run, see :class:`Workload`). ``bias``: bias tensors given to combine (0-2);
    ``combine_check``: ``"exact"`` (bit for bit) or ``"tolerant"`` (bf16 tolerance); ``eplb``:
    redundant expert slots (0 = no EPLB run).
    """

    model: str
    hidden: int
    num_experts: int
    top_k: int
    num_ranks: int
    tokens: int
    fp8: bool
    fp8_scale: str
    expand: bool
    alignment: int
    routing: str
    hot_ratio: float
    zipf_alpha: float
    mask_prob: float
    iters: int
    warmup: int
    seed: int
    check: bool
    num_sms: int = 0
    bias: int = 0
    combine_check: str = "exact"
    eplb: int = 0

    @property
    def max_tokens(self) -> int:
        """``num_max_tokens_per_rank`` given to the buffer, dispatch and reference (at least 1)."""
        return max(self.tokens, 1)

    @property
    def num_sf(self) -> int:
        """Scale-factor elements (4 bytes each) per token in FP8 mode."""
        return self.hidden // 128 if self.fp8_scale == "fp32" else self.hidden // 512

    @property
    def dispatch_bytes_per_token(self) -> int:
        """Bytes of one dispatched row: bf16 data, or FP8 data plus its 4-byte scale factors."""
        return self.hidden + 4 * self.num_sf if self.fp8 else 2 * self.hidden

    @property
    def combine_bytes_per_token(self) -> int:
        """Bytes of one combined row (bf16)."""
        return 2 * self.hidden


def make_config(args: argparse.Namespace, num_ranks: int, *, gpu: bool) -> BenchConfig:
    """Validate ``args`` for ``num_ranks`` ranks and build the :class:`BenchConfig`.

    Raises:
        SystemExit: impossible combinations, with every problem in one message, before any process
            or communication starts.
    """
    preset = routing.get_preset(args.model)
    tokens = args.tokens if args.tokens is not None else (GPU_DEFAULT_TOKENS if gpu else CPU_DEFAULT_TOKENS)
    iters = args.iters if args.iters is not None else (GPU_DEFAULT_ITERS if gpu else CPU_DEFAULT_ITERS)
    cfg = BenchConfig(
        model=preset.name, hidden=preset.hidden, num_experts=preset.num_experts, top_k=preset.top_k,
        num_ranks=num_ranks, tokens=tokens, fp8=bool(args.fp8), fp8_scale=args.fp8_scale,
        expand=bool(args.expand), alignment=args.alignment, routing=args.routing,
        hot_ratio=args.hot_ratio, zipf_alpha=args.zipf_alpha, mask_prob=args.mask_prob,
        iters=iters, warmup=args.warmup, seed=args.seed, check=bool(args.check),
        num_sms=int(getattr(args, "num_sms", 0) or 0), bias=int(getattr(args, "bias", 0) or 0),
        combine_check=getattr(args, "combine_check", "exact"), eplb=int(getattr(args, "eplb", 0) or 0),
    )
    errors = []
    if num_ranks < 1:
        errors.append(f"need at least 1 rank, got {num_ranks}")
    elif cfg.num_experts % num_ranks:
        errors.append(f"{cfg.model} has {cfg.num_experts} experts, not divisible by {num_ranks} ranks")
    if cfg.tokens < 0:
        errors.append(f"--tokens must be >= 0, got {cfg.tokens}")
    if cfg.alignment < 1:
        errors.append(f"--alignment must be >= 1, got {cfg.alignment}")
    if cfg.num_sms < 0:
        errors.append(f"--num-sms must be >= 0, got {cfg.num_sms}")
    if cfg.iters < 1 or cfg.warmup < 0:
        errors.append("--iters must be >= 1 and --warmup >= 0")
    if not 0.0 <= cfg.mask_prob <= 1.0:
        errors.append(f"--mask-prob must be in [0, 1], got {cfg.mask_prob}")
    if cfg.bias not in (0, 1, 2):
        errors.append(f"--bias takes 0, 1 or 2 (bias tensors given to combine), got {cfg.bias}")
    if cfg.combine_check not in ("exact", "tolerant"):
        errors.append(f"--combine-check takes exact or tolerant, got {cfg.combine_check!r}")
    if getattr(args, "fp8_scale", "fp32") != "fp32" and not cfg.fp8:
        errors.append(f"--fp8-scale {args.fp8_scale} applies to FP8 dispatch: add --fp8")
    if cfg.fp8:
        unit = 128 if cfg.fp8_scale == "fp32" else 512
        if cfg.hidden % unit:
            errors.append(f"--fp8 with {cfg.fp8_scale} scales needs hidden % {unit} == 0; "
                          f"{cfg.model} has hidden {cfg.hidden}")
    if cfg.eplb < 0:
        errors.append(f"--eplb takes the number of redundant expert slots (>= 0), got {cfg.eplb}")
    elif cfg.eplb and num_ranks >= 1 and (cfg.num_experts + cfg.eplb) % num_ranks:
        errors.append(f"--eplb {cfg.eplb}: {cfg.num_experts} experts + {cfg.eplb} redundant slots = "
                      f"{cfg.num_experts + cfg.eplb} physical slots, not divisible by {num_ranks} ranks")
    if cfg.routing == "imbalanced" and not errors:
        try:
            routing.imbalanced_routing(1, cfg.num_experts, cfg.top_k, num_ranks=num_ranks,
                                       hot_rank_ratio=cfg.hot_ratio)
        except ValueError as exc:
            errors.append(f"--hot-ratio: {exc}")
    if cfg.routing == "zipf" and cfg.zipf_alpha < 0:
        errors.append("--zipf-alpha must be >= 0")
    if errors:
        raise SystemExit("error: " + "; ".join(errors))
    return cfg


def _generator(cfg: BenchConfig, rank: int, stream: int) -> torch.Generator:
    """A CPU generator for (seed, rank, stream): any rank can regenerate any rank's inputs."""
    return torch.Generator().manual_seed((cfg.seed * 1_000_003 + rank * 10_007 + stream) % (2**62))


def make_topk(cfg: BenchConfig, rank: int) -> Dict[str, torch.Tensor]:
    """Routing of source ``rank``: ``topk_idx [T, K]`` int64 and ``topk_weights [T, K]`` float32."""
    T, E, K, R = cfg.tokens, cfg.num_experts, cfg.top_k, cfg.num_ranks
    gen = _generator(cfg, rank, 1)
    if cfg.routing == "balanced":
        idx = routing.balanced_routing(T, E, K, generator=gen)
    elif cfg.routing == "imbalanced":
        idx = routing.imbalanced_routing(T, E, K, num_ranks=R, hot_rank_ratio=cfg.hot_ratio, hot_rank=0,
                                         generator=gen)
    elif cfg.routing == "zipf":
        # One popularity ranking for all ranks (seed only), tokens drawn per rank.
        order = torch.randperm(E, generator=torch.Generator().manual_seed(cfg.seed + 12345), device="cpu")
        idx = routing.zipf_routing(T, E, K, alpha=cfg.zipf_alpha, popularity_order=order, generator=gen)
    elif cfg.routing == "gate":
        preset = routing.get_preset(cfg.model)
        logits = torch.randn(T, E, generator=gen, dtype=torch.float32, device="cpu")
        bias = torch.randn(E, generator=torch.Generator().manual_seed(cfg.seed + 54321), dtype=torch.float32,
                           device="cpu") * 0.1
        idx, _ = routing.gate(preset, logits, bias if preset.gate_kind == "deepseek_v3" else None)
    else:
        raise ValueError(f"unknown routing {cfg.routing!r}")
    if cfg.mask_prob > 0:
        idx = routing.mask_routing(idx, cfg.mask_prob, generator=gen)
    weights = routing.random_weights(idx, generator=gen)
    return {"topk_idx": idx, "topk_weights": weights}


def make_rank_inputs(cfg: BenchConfig, rank: int, device="cpu") -> Dict[str, Any]:
    """All inputs of source ``rank``, regenerated identically on every rank from ``cfg.seed``.

    Returns ``{"x": bf16 [T, H] or (fp8 [T, H], sf [T, num_sf]), "x_bf16": bf16 [T, H],
    "topk_idx": int64 [T, K], "topk_weights": float32 [T, K], "biases": tuple of cfg.bias bf16
    [T, H]}`` on ``device``.
    """
    out: Dict[str, Any] = make_topk(cfg, rank)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=_generator(cfg, rank, 2), dtype=torch.float32,
                    device="cpu").to(torch.bfloat16)
    out["x_bf16"] = x
    out["x"] = quantize_fp8(x, cfg.fp8_scale) if cfg.fp8 else x
    out["biases"] = tuple(
        torch.randn(cfg.tokens, cfg.hidden, generator=_generator(cfg, rank, 3 + i), dtype=torch.float32,
                    device="cpu").to(torch.bfloat16)
        for i in range(cfg.bias))
    return {k: _to(v, device) for k, v in out.items()}


def _to(v, device):
    if isinstance(v, tuple):
        return tuple(t.to(device) for t in v)
    return v.to(device)


@dataclasses.dataclass
class Workload:
    """What one pass of the bench dispatches: the generated routing of ``cfg`` (``name="logical"``),
    or the same tokens routed to other expert ids, e.g. EPLB's physical replicas
    (``topk_idx[s]`` replaces source rank ``s``'s ids, ``num_experts`` the expert count).
    Picklable (sent to the CPU runner's processes)."""

    cfg: BenchConfig
    name: str = "logical"
    topk_idx: Optional[List[torch.Tensor]] = None
    num_experts: int = 0

    @property
    def run_cfg(self) -> BenchConfig:
        """``cfg`` with the expert count this pass dispatches to."""
        if not self.num_experts or self.num_experts == self.cfg.num_experts:
            return self.cfg
        return dataclasses.replace(self.cfg, num_experts=self.num_experts)

    def inputs(self, rank: int, device="cpu") -> Dict[str, Any]:
        """:func:`make_rank_inputs` of source ``rank``, with this pass's expert ids."""
        out = make_rank_inputs(self.cfg, rank, device)
        if self.topk_idx is not None:
            out["topk_idx"] = self.topk_idx[rank].to(device)
        return out


def expert_output(cfg: BenchConfig, recv_x, rank: int) -> torch.Tensor:
    """What the bench feeds to combine on ``rank``, standing in for the experts' outputs: the received
    rows (bf16, FP8 dequantised) times ``1 + (rank + 1) / 16``, rounded to bf16. Each rank's factor
    differs, so that a token's rows from several ranks differ and a combine summing them in another
    order than the reference's (hybrid mode's) rounds differently."""
    rows = dequantize_fp8(recv_x, cfg.fp8_scale) if cfg.fp8 else recv_x
    return (rows.float() * (1.0 + (rank + 1) / 16.0)).to(torch.bfloat16)


def num_rows(recv_x) -> int:
    """Rows of a dispatch's ``recv_x`` (a bf16 tensor or an FP8 ``(data, sf)`` tuple)."""
    return int((recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0])


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------


def token_copies(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, expand: bool) -> List[int]:
    """Copies of this rank's tokens per destination rank (``[num_ranks]`` ints).

    Non-expanded: the number of tokens with at least one expert on rank ``d``. Expanded: the number
    of valid ``(token, expert)`` pairs whose expert is on ``d``. ``-1`` entries are ignored.
    """
    local = num_experts // num_ranks
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // local, torch.full_like(topk_idx, num_ranks))
    if expand:
        counts = torch.bincount(dest.flatten(), minlength=num_ranks + 1)[:num_ranks]
    else:
        hit = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
        hit.scatter_(1, dest, True)
        counts = hit[:, :num_ranks].sum(dim=0)
    return [int(c) for c in counts.tolist()]


def floor_rows(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, expand: bool) -> float:
    """Rows a device copy must move to match one rank's dispatch (or combine) HBM traffic.

    A dispatch reads each token with at least one valid expert once and writes one row per copy
    (`token_copies`); combine reads the copies and writes each token once. A copy of ``n`` rows reads
    and writes ``n`` rows, so the matching copy moves ``(tokens + copies) / 2`` rows.
    """
    copies = sum(token_copies(topk_idx, num_experts, num_ranks, expand))
    tokens = int((topk_idx >= 0).any(dim=1).sum()) if topk_idx.numel() else 0
    return (copies + tokens) / 2


def written_rows(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, expand: bool) -> tuple:
    """Rows one rank's dispatch and combine write at least: ``(copies, tokens)``, the dispatch one row
    per copy (`token_copies`), combine each token with a valid expert once (the floor's write half,
    `deep_ep.bench.gpu_timing.floor_us`)."""
    copies = sum(token_copies(topk_idx, num_experts, num_ranks, expand))
    tokens = int((topk_idx >= 0).any(dim=1).sum()) if topk_idx.numel() else 0
    return copies, tokens


def floor_bytes(cfg: BenchConfig, topk_idxs: Sequence[torch.Tensor], num_ranks: int) -> Dict[str, Tuple[int, int]]:
    """The floor's bytes for the ranks whose routing is ``topk_idxs`` (one ``[T, K]`` tensor per rank,
    of ``num_ranks`` ranks in all): ``{"dispatch": (moved, written), "combine": (moved, written)}``,
    each the sum over those ranks of one rank's (`floor_rows` moved each way, `written_rows`
    written), times the bytes of a dispatched / combined row. One rank's at EP=1 or under torchrun;
    every rank's with emulated ranks, which share one GPU's HBM."""
    moved = sum(floor_rows(idx, cfg.num_experts, num_ranks, cfg.expand) for idx in topk_idxs)
    written = [written_rows(idx, cfg.num_experts, num_ranks, cfg.expand) for idx in topk_idxs]
    copies, tokens = sum(w[0] for w in written), sum(w[1] for w in written)
    return {"dispatch": (int(moved * cfg.dispatch_bytes_per_token), copies * cfg.dispatch_bytes_per_token),
            "combine": (int(moved * cfg.combine_bytes_per_token), tokens * cfg.combine_bytes_per_token)}


def logical_bytes(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, expand: bool,
                  bytes_per_token: int) -> int:
    """Logical bytes a source rank moves: ``sum(token_copies(...)) * bytes_per_token``."""
    return sum(token_copies(topk_idx, num_experts, num_ranks, expand)) * bytes_per_token


def bandwidth_gbps(num_bytes: float, seconds: float) -> float:
    """``num_bytes / 1e9 / seconds`` (``nan`` for a zero time)."""
    return num_bytes / 1e9 / seconds if seconds > 0 else float("nan")
