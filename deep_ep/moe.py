"""A reference Mixture-of-Experts layer built on the differentiable `deep_ep.ops`, and the same model
in one process without communication (`DenseMoE`), for checking and for learning from.

Per token: a gate picks ``top_k`` of ``E`` experts and their weights (`deep_ep.routing`: softmax
top-k, renormalised or not, or DeepSeek-V3's sigmoid gate with group-limited top-k); the token is
dispatched to the ranks holding them; each expert (a SwiGLU or GELU MLP without biases) runs on its
rows; every expert output is multiplied by its gate weight (combine sums rows as they are) and
combine brings the sum back. Expert ``e`` lives on rank ``e // L`` (``L = E / R`` experts per rank);
the gate's weight is replicated: its gradient, like that of any data-parallel parameter, must be
summed over the ranks by the caller (e.g. ``torch.distributed.all_reduce``) before the optimiser
step.

Numbers, for both classes: the gate runs in float32; tokens travel in bf16; the expert MLPs run in
bf16 on bf16 weights (cast from the float32 parameters), their activations in float32; the weighted
outputs are rounded to bf16 before combine, which sums them in float32. `DenseMoE` does the same
arithmetic on all tokens at once; the two differ only in the order of the final float32 sums and in
the bf16 rounding of each rank's partial sum, so their outputs agree to about one bf16 rounding.

Rows of an expert are computed together: ``torch._grouped_mm`` on the rows grouped by expert (the
expanded layout already groups them, padded to ``expert_alignment``; the non-expanded layout is
sorted by expert locally), or, where grouped GEMM is not available for the sizes or the torch build,
a loop over the experts with masks (same results up to rounding, ``L`` times the arithmetic).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops, routing, shapes

__all__ = ["moe_parameters", "gate_logits", "route", "expert_mlp", "grouped_expert_mlp", "DenseMoE", "MoELayer"]

_BF16 = torch.bfloat16
_GATES = ("softmax_topk", "deepseek_v3")
_ACTIVATIONS = ("swiglu", "gelu")


def moe_parameters(hidden: int, ffn_hidden: int, num_experts: int, *, activation: str = "swiglu",
                   generator: Optional[torch.Generator] = None, device=None) -> dict:
    """Initial parameters of an MoE layer, all experts (float32, on ``device``):
    ``gate_weight [E, H]``, ``w1 [E, F, H]``, ``w2 [E, H, F]`` and, for SwiGLU, ``w3 [E, F, H]``
    (normal, standard deviation ``1/sqrt(fan_in)``). Draws from ``generator`` on the CPU, so the same
    seed gives the same parameters on every device.

    Raises:
        ValueError: a size below 1, or an unknown activation.
    """
    if min(hidden, ffn_hidden, num_experts) < 1:
        raise ValueError(f"hidden, ffn_hidden and num_experts must be >= 1, got {hidden}, {ffn_hidden}, {num_experts}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")

    def normal(*shape, fan_in):
        return (torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu") / math.sqrt(fan_in)).to(device)
    params = {"gate_weight": normal(num_experts, hidden, fan_in=hidden),
              "w1": normal(num_experts, ffn_hidden, hidden, fan_in=hidden),
              "w2": normal(num_experts, hidden, ffn_hidden, fan_in=ffn_hidden)}
    if activation == "swiglu":
        params["w3"] = normal(num_experts, ffn_hidden, hidden, fan_in=hidden)
    return params


def gate_logits(x: Tensor, gate_weight: Tensor) -> Tensor:
    """float32 ``[T, E]``: ``x @ gate_weight^T`` in float32."""
    return F.linear(x.float(), gate_weight.float())


def route(logits: Tensor, top_k: int, gate: str = "softmax_topk", *, renormalize: bool = True,
          correction_bias: Optional[Tensor] = None, num_groups: int = 1, topk_groups: int = 1,
          routed_scaling_factor: float = 1.0) -> tuple:
    """``(topk_idx int64 [T, top_k], topk_weights float32 [T, top_k])`` from ``logits`` with the
    ``gate`` of `deep_ep.routing` ("softmax_topk": `routing.softmax_topk_gate`; "deepseek_v3":
    `routing.deepseek_v3_gate`). The weights are differentiable in the logits.

    Raises:
        ValueError: an unknown gate, or the gate's own errors.
    """
    if gate == "softmax_topk":
        return routing.softmax_topk_gate(logits, top_k, renormalize=renormalize)
    if gate == "deepseek_v3":
        return routing.deepseek_v3_gate(logits, correction_bias, num_groups=num_groups, topk_groups=topk_groups,
                                        top_k=top_k, routed_scaling_factor=routed_scaling_factor,
                                        normalize=renormalize)
    raise ValueError(f"gate must be one of {_GATES}, got {gate!r}")


def _activate(a: Tensor, b: Optional[Tensor]) -> Tensor:
    """The MLP's hidden activation in float32, rounded to bf16: SwiGLU ``silu(a) * b`` or ``gelu(a)``."""
    if b is None:
        return F.gelu(a.float()).to(_BF16)
    return (F.silu(a.float()) * b.float()).to(_BF16)


def expert_mlp(x: Tensor, w1: Tensor, w2: Tensor, w3: Optional[Tensor]) -> Tensor:
    """One expert on bf16 rows ``x [N, H]``: ``act(x w1^T [, x w3^T]) w2^T`` in bf16 (``w1 [F, H]``,
    ``w2 [H, F]``, ``w3 [F, H]`` or None for GELU), returns bf16 ``[N, H]``."""
    a = F.linear(x, w1.to(_BF16))
    b = F.linear(x, w3.to(_BF16)) if w3 is not None else None
    return F.linear(_activate(a, b), w2.to(_BF16))


def _grouped_mm_usable(x: Tensor, w1: Tensor, w2: Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    # row strides of bf16 operands must be multiples of 16 bytes
    return w1.shape[1] % 8 == 0 and w2.shape[1] % 8 == 0


def grouped_expert_mlp(x: Tensor, group_ends: Tensor, w1: Tensor, w2: Tensor, w3: Optional[Tensor],
                       use_grouped_mm: Optional[bool] = None) -> Tensor:
    """The experts on rows grouped by expert: rows ``[group_ends[e-1], group_ends[e])`` go through
    expert ``e`` (`expert_mlp`'s arithmetic).

    Args:
        x: bf16 ``[N, H]``; group_ends: int32 ``[L]`` ascending, ``group_ends[-1] == N``.
        w1, w3: ``[L, F, H]`` (w3 None for GELU); w2: ``[L, H, F]``.
        use_grouped_mm: None picks ``torch._grouped_mm`` when the torch build and the sizes allow it
            (``F`` and ``H`` multiples of 8), False the loop over experts with masks.

    Returns:
        bf16 ``[N, H]``.
    """
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_usable(x, w1, w2)
    if use_grouped_mm:
        offs = group_ends.to(torch.int32)

        def mm(inp, w):
            return torch._grouped_mm(inp, w.to(_BF16).transpose(-2, -1), offs=offs)
        a = mm(x, w1)
        b = mm(x, w3) if w3 is not None else None
        return mm(_activate(a, b), w2)
    row_expert = torch.searchsorted(group_ends.to(torch.int64), torch.arange(x.shape[0], device=x.device),
                                    right=True)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        y = expert_mlp(x, w1[e], w2[e], w3[e] if w3 is not None else None)
        out = torch.where((row_expert == e).unsqueeze(1), y, out)
    return out


class DenseMoE(nn.Module):
    """The MoE layer in one process: every expert local, no communication (the reference
    `MoELayer` is checked against).

    Args:
        params: `moe_parameters`' dict (copied into parameters: ``gate_weight``, ``w1``, ``w2``, ``w3``).
        top_k, gate, renormalize, num_groups, topk_groups, routed_scaling_factor: the gate (`route`).

    ``forward(x [T, H]) -> [T, H]`` in ``x``'s dtype.
    """

    def __init__(self, params: dict, top_k: int, *, gate: str = "softmax_topk", renormalize: bool = True,
                 num_groups: int = 1, topk_groups: int = 1, routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.gate_weight = nn.Parameter(params["gate_weight"].clone())
        self.w1 = nn.Parameter(params["w1"].clone())
        self.w2 = nn.Parameter(params["w2"].clone())
        self.register_parameter("w3", nn.Parameter(params["w3"].clone()) if "w3" in params else None)
        self.num_experts = self.gate_weight.shape[0]
        self.register_buffer("correction_bias", torch.zeros(self.num_experts, dtype=torch.float32,
                                                                device=self.gate_weight.device))
        self.gate_args = dict(top_k=top_k, gate=gate, renormalize=renormalize, num_groups=num_groups,
                              topk_groups=topk_groups, routed_scaling_factor=routed_scaling_factor)

    def route(self, x: Tensor) -> tuple:
        """``(topk_idx, topk_weights)`` of ``x``."""
        return route(gate_logits(x, self.gate_weight), correction_bias=self.correction_bias, **self.gate_args)

    def forward(self, x: Tensor) -> Tensor:
        topk_idx, topk_weights = self.route(x)
        xb = x.to(_BF16)
        out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            tok, slot = (topk_idx == e).nonzero(as_tuple=True)
            y = expert_mlp(xb[tok], self.w1[e], self.w2[e], self.w3[e] if self.w3 is not None else None)
            out = out.index_add(0, tok, (y.float() * topk_weights[tok, slot].unsqueeze(1)).to(_BF16).float())
        return out.to(_BF16).to(x.dtype)


class MoELayer(nn.Module):
    """The MoE layer over expert-parallel ranks: gate -> `deep_ep.ops.dispatch` -> local experts ->
    `deep_ep.ops.combine`. Trainable (autograd flows through dispatch and combine) and traceable by
    ``torch.compile(fullgraph=True)``.

    Args:
        buffer: the `ElasticBuffer` (its rank and group size decide the local experts).
        params: `moe_parameters`' dict for *all* experts (the same on every rank); this rank keeps the
            gate and its ``L = E / R`` experts ``[rank * L, (rank + 1) * L)``.
        top_k, gate, renormalize, num_groups, topk_groups, routed_scaling_factor: the gate (`route`).
        do_expand: dispatch in the expanded layout (rows grouped by expert; default) or not (one row
            per token and rank, sorted by expert locally).
        expert_alignment: pad each expert's rows to a multiple (expanded layout).
        do_cpu_sync: size the receive tensors exactly (default) or for the worst case.
        fuse_gate_weights: (expanded layout) let combine multiply the rows by the gate weights
            (``apply_dispatch_weights``) instead of the layer.
        use_grouped_mm: see `grouped_expert_mlp`.

    ``forward(x [T, H]) -> [T, H]`` in ``x``'s dtype (collective: every rank calls it together).
    ``correction_bias`` (a buffer, zeros) is DeepSeek-V3's selection bias; the layer never updates it
    (its load-balancing update is the training loop's business).

    Raises:
        ValueError: experts not divisible by the ranks, an unknown gate, ``fuse_gate_weights`` without
            the expanded layout.
    """

    def __init__(self, buffer, params: dict, top_k: int, *, gate: str = "softmax_topk", renormalize: bool = True,
                 num_groups: int = 1, topk_groups: int = 1, routed_scaling_factor: float = 1.0,
                 do_expand: bool = True, expert_alignment: int = 1, do_cpu_sync: bool = True,
                 fuse_gate_weights: bool = False, use_grouped_mm: Optional[bool] = None) -> None:
        super().__init__()
        E = params["gate_weight"].shape[0]
        R, r = buffer.num_ranks, buffer.rank
        if E % R:
            raise ValueError(f"{E} experts cannot be split evenly over {R} ranks")
        if gate not in _GATES:
            raise ValueError(f"gate must be one of {_GATES}, got {gate!r}")
        if fuse_gate_weights and not do_expand:
            raise ValueError("fuse_gate_weights needs the expanded layout (do_expand=True)")
        L = E // R
        self.buffer, self.num_experts, self.num_local_experts = buffer, E, L
        self.first_expert = r * L
        local = slice(r * L, (r + 1) * L)
        self.gate_weight = nn.Parameter(params["gate_weight"].clone())
        self.w1 = nn.Parameter(params["w1"][local].clone())
        self.w2 = nn.Parameter(params["w2"][local].clone())
        self.register_parameter("w3", nn.Parameter(params["w3"][local].clone()) if "w3" in params else None)
        self.register_buffer("correction_bias", torch.zeros(E, dtype=torch.float32, device=self.gate_weight.device))
        self.gate_args = dict(top_k=top_k, gate=gate, renormalize=renormalize, num_groups=num_groups,
                              topk_groups=topk_groups, routed_scaling_factor=routed_scaling_factor)
        self.do_expand, self.expert_alignment, self.do_cpu_sync = do_expand, expert_alignment, do_cpu_sync
        self.fuse_gate_weights, self.use_grouped_mm = fuse_gate_weights, use_grouped_mm

    def replicated_parameters(self) -> list:
        """The parameters every rank holds a copy of (the gate): sum their gradients over the ranks."""
        return [self.gate_weight]

    def route(self, x: Tensor) -> tuple:
        """``(topk_idx, topk_weights)`` of ``x``."""
        return route(gate_logits(x, self.gate_weight), correction_bias=self.correction_bias, **self.gate_args)

    def _experts(self, x: Tensor, group_ends: Tensor) -> Tensor:
        return grouped_expert_mlp(x, group_ends, self.w1, self.w2, self.w3, self.use_grouped_mm)

    def forward(self, x: Tensor) -> Tensor:
        topk_idx, topk_weights = self.route(x)
        recv_x, recv_idx, recv_w, handle = ops.dispatch(
            self.buffer, x.to(_BF16), topk_idx, topk_weights, num_experts=self.num_experts,
            expert_alignment=self.expert_alignment, do_cpu_sync=self.do_cpu_sync, do_expand=self.do_expand)
        if self.do_expand:
            y = self._expanded(recv_x, recv_w, handle)
        else:
            y = self._non_expanded(recv_x, recv_idx, recv_w)
        out, _ = ops.combine(self.buffer, y, handle, apply_dispatch_weights=self.fuse_gate_weights)
        return out.to(x.dtype)

    def _group_ends(self, counts: Tensor, num_rows) -> Tensor:
        """int32 ``[L]``: where each expert's rows end, the last at ``num_rows`` (rows past the true
        count are zero and go to the last expert, which maps them to zero)."""
        ends = torch.cumsum(counts.to(torch.int64), 0)
        last = torch.arange(self.num_local_experts, device=counts.device) == self.num_local_experts - 1
        return torch.where(last, num_rows, ends).to(torch.int32)

    def _expanded(self, recv_x: Tensor, recv_w: Tensor, handle) -> Tensor:
        aligned = shapes.align_up(handle.num_unaligned_recv_tokens_per_expert.to(torch.int64), self.expert_alignment)
        y = self._experts(recv_x, self._group_ends(aligned, recv_x.shape[0]))
        if self.fuse_gate_weights:
            return y
        return (y.float() * recv_w.unsqueeze(1)).to(_BF16)

    def _non_expanded(self, recv_x: Tensor, recv_idx: Tensor, recv_w: Tensor) -> Tensor:
        rows, K = recv_idx.shape
        L = self.num_local_experts
        key = torch.where(recv_idx >= 0, recv_idx, L).reshape(-1)        # no expert: after the last one
        order = torch.argsort(key, stable=True)
        counts = (key.unsqueeze(1) == torch.arange(L, device=key.device)).sum(0)
        pair_row = torch.div(order, K, rounding_mode="floor")
        valid = (key[order] < L).unsqueeze(1)
        xp = torch.where(valid, recv_x[pair_row], torch.zeros((), dtype=recv_x.dtype, device=recv_x.device))
        yp = self._experts(xp, self._group_ends(counts, rows * K))
        yp = (yp.float() * recv_w.reshape(-1)[order].unsqueeze(1)).to(_BF16).float()
        y = torch.zeros((rows, recv_x.shape[1]), dtype=torch.float32, device=recv_x.device).index_add(0, pair_row, yp)
        return y.to(_BF16)
