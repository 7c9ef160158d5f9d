"""The GPU test matrix, shared by the device suite (tests/gpu/) and the CPU compile test
(tests/test_kernels_compile.py, which builds every kernel instantiation listed here under NVRTC),
and the checks the GPU tests share."""
from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import dataclass, replace

import torch

from deep_ep import reference as ref


def case_seed(*parts) -> int:
    """A seed of its own for each case: CRC-32 of the parts' text (case name, parameters, test id).
    Cases never share inputs, so an output left unwritten cannot hold a previous case's correct
    values; the same case always draws the same inputs (a failure reproduces)."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def to_cpu(x):
    """A CPU copy with the same shape and strides (``.cpu()`` makes a tensor that is not dense, such as
    TMA-aligned column-major scale factors, contiguous)."""
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return tuple(to_cpu(t) for t in x)
    if isinstance(x, torch.Tensor):
        if x.is_contiguous() or x.numel() == 0:
            return x.cpu()
        span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
        flat = x.as_strided((span,), (1,)).cpu()
        return flat.as_strided(x.shape, x.stride())
    return x


def handle_to_cpu(h):
    """A copy of handle ``h`` with every tensor on the CPU, ``buffer_id = -1`` (as the reference's) and
    no backend state (nothing is cloned on the device)."""
    return dataclasses.replace(h, buffer_id=-1, backend_state=None,
                               **{f: to_cpu(getattr(h, f)) for f in ref.HANDLE_TENSOR_FIELDS})


def random_routing(tokens: int, num_experts: int, num_topk: int, g: torch.Generator,
                   mask_prob: float = 0.1) -> torch.Tensor:
    """int64 ``[tokens, num_topk]`` distinct expert ids per token, each masked (-1) with ``mask_prob``."""
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:num_topk] for _ in range(tokens)]).to(torch.int64) \
        if tokens else torch.empty((0, num_topk), dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < mask_prob] = -1
    return idx


@dataclass(frozen=True)
class Case:
    """One dispatch + combine configuration, run on every rank."""
    name: str
    num_ranks: int = 2
    hidden: int = 256
    num_experts: int = 16
    num_topk: int = 4
    tokens: tuple = (64, 37)          # per rank (cycled when shorter than num_ranks); 0 = empty rank
    fp8: str = ""                     # "", "fp32" (per-128 scales) or "ue8m0" (packed int32)
    expand: bool = False
    alignment: int = 1
    zero_padding: bool = True
    weights: bool = True
    num_bias: int = 0
    mask_prob: float = 0.1
    do_cpu_sync: bool = True
    cached: bool = True               # also run a cached dispatch with the handle, fresh x
    col_major_sf: bool = False
    num_sms: int = 8
    notify_groups_max: int = 0        # the notify kernel's cap on groups (0: the backend's default)
    # a buffer with allow_multiple_reduction=False: expanded, the combine sums every slot's row at the
    # source (its topk_weights are not reduced: they need multiple reduction); non-expanded, only hybrid
    # mode across nodes tells it apart (forwarders pass each rank's row on unreduced: the flat order;
    # tests/gpu/test_gpu_scaleout.py makes such cases)
    single_reduction: bool = False
    apply_dispatch_weights: bool = False   # expanded, with weights: combine(apply_dispatch_weights=True)

    def tokens_of(self, rank: int) -> int:
        return self.tokens[rank % len(self.tokens)]

    @property
    def max_tokens(self) -> int:
        return max(self.tokens_of(r) for r in range(self.num_ranks))

    def dispatch_structure(self) -> tuple:
        """(data_bytes, num_sf, topk, expand) of the dispatch module this case builds."""
        if self.fp8 == "fp32":
            return self.hidden, self.hidden // 128, self.num_topk, self.expand
        if self.fp8 == "ue8m0":
            return self.hidden, (self.hidden + 511) // 512, self.num_topk, self.expand
        return self.hidden * 2, 0, self.num_topk, self.expand

    def combine_structure(self) -> tuple:
        """(hidden, topk, expand) of the combine module this case builds (`modules.combine_layout`)."""
        from deep_ep.backends.gpu.modules import combine_layout
        return self.hidden, self.num_topk, combine_layout(self.expand, not self.single_reduction)


_BASE = [
    Case("bf16"),
    Case("bf16-expand", expand=True),
    Case("bf16-expand-align128", expand=True, alignment=128, num_bias=1),
    Case("bf16-expand-align128-nozero", expand=True, alignment=128, zero_padding=False),
    Case("bf16-noweights-bias2", weights=False, num_bias=2),
    Case("bf16-nosync", do_cpu_sync=False, num_bias=1),
    Case("bf16-expand-nosync", expand=True, alignment=8, do_cpu_sync=False),
    Case("bf16-expand-align2", expand=True, alignment=2, mask_prob=0.3),
    # Expanded without weights, and with no tokens, with and without CPU sync (the rank alone of EP=1
    # is the empty one).
    Case("bf16-expand-noweights", expand=True, alignment=4, weights=False, num_bias=1),
    Case("bf16-expand-empty-rank", expand=True, alignment=4, tokens=(0, 50, 17)),
    Case("bf16-expand-nosync-empty-rank", expand=True, alignment=8, tokens=(0, 50, 17), do_cpu_sync=False),
    Case("bf16-empty-rank", tokens=(0, 50, 17)),
    Case("bf16-all-masked", mask_prob=1.0),
    # About one token in seven selects no expert: fewer rows than tokens even on a rank alone.
    Case("bf16-mostly-masked", mask_prob=0.6),
    Case("fp8-fp32", fp8="fp32", hidden=512),
    Case("fp8-ue8m0-colmajor", fp8="ue8m0", hidden=1024, col_major_sf=True),
    Case("fp8-fp32-expand-colmajor", fp8="fp32", hidden=512, expand=True, alignment=4, col_major_sf=True),
    Case("fp8-fp32-expand", fp8="fp32", hidden=512, expand=True),
    Case("hidden2880-top4", hidden=2880, num_topk=4, num_experts=32, tokens=(33, 70)),
    Case("top8-expand", num_topk=8, num_experts=32, expand=True, alignment=16),
    # The most experts a window holds: the notify kernel's dynamic shared memory (a row of counts per
    # warp) and its static part exceed 48 KB together.
    Case("experts1024-top8", num_topk=8, num_experts=1024, tokens=(48, 29)),
    # More tokens than one notify block takes (several blocks meeting at grid barriers) and, with the
    # grid capped at one block, many tokens per group.
    Case("bf16-many-tokens", tokens=(1501, 600), mask_prob=0.3, num_sms=16),
    Case("bf16-many-tokens-one-block", tokens=(1501, 600), mask_prob=0.3, do_cpu_sync=False, notify_groups_max=8),
    # Without CPU sync: tokens that select no expert (rows between the count and the worst case,
    # marked by the data kernel), an empty rank, column-major scale factors, and the default SMs
    # (every SM of the device at EP=1, most of them without a token).
    Case("bf16-nosync-mostly-masked", mask_prob=0.6, do_cpu_sync=False),
    Case("bf16-nosync-empty-rank", tokens=(0, 50, 17), do_cpu_sync=False),
    Case("fp8-ue8m0-colmajor-nosync", fp8="ue8m0", hidden=1024, col_major_sf=True, do_cpu_sync=False),
    Case("bf16-nosync-default-sms", do_cpu_sync=False, num_sms=0),
    # Expanded on a buffer without multiple reduction: every (token, slot) row summed at the source in
    # slot order; with biases, dispatch weights applied, masked slots, FP8 dispatch, no CPU sync, an
    # empty rank, and few tokens of a wide row (a token's row split over several warps).
    Case("bf16-expand-single", expand=True, single_reduction=True, num_bias=1),
    Case("bf16-expand-single-applyw-bias2", expand=True, alignment=8, single_reduction=True, num_bias=2,
         apply_dispatch_weights=True, mask_prob=0.3),
    Case("fp8-fp32-expand-single", fp8="fp32", hidden=512, expand=True, single_reduction=True),
    Case("top8-expand-single-nosync", num_topk=8, num_experts=32, expand=True, alignment=16, single_reduction=True,
         do_cpu_sync=False, weights=False),
    Case("bf16-expand-single-empty-rank", expand=True, alignment=4, tokens=(0, 50, 17), single_reduction=True,
         apply_dispatch_weights=True),
    Case("bf16-expand-single-decode", hidden=2048, expand=True, tokens=(3, 2), single_reduction=True, num_bias=1),
]


CASES_ENV = "DEEP_EP_GPU_CASES"


def selected(cases: list) -> list:
    """``cases`` whose base name (the name without its ``ep<R>-`` prefix) is listed, comma-separated,
    in $DEEP_EP_GPU_CASES; all of them when it is unset or empty (tools/mutation_check.py sets it to
    run a few cases of each test).

    Raises:
        ValueError: a listed name is not a case (a typo would otherwise select nothing and pass).
    """
    names = {n.strip() for n in os.environ.get(CASES_ENV, "").split(",") if n.strip()}
    if not names:
        return list(cases)
    known = {c.name for c in _BASE}
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(f"${CASES_ENV} names unknown cases {unknown}; known: {sorted(known)}")
    return [c for c in cases if c.name.split("-", 1)[1] in names]


def cases_for(num_ranks: int) -> list:
    """The matrix at a given rank count (expert counts scaled so every rank owns experts)."""
    out = []
    for c in _BASE:
        experts = max(c.num_experts, num_ranks * 2)
        experts = (experts + num_ranks - 1) // num_ranks * num_ranks
        out.append(replace(c, num_ranks=num_ranks, num_experts=experts, name=f"ep{num_ranks}-{c.name}"))
    return out


RANK_COUNTS = (1, 2, 4, 8)


def all_cases() -> list:
    return [c for r in RANK_COUNTS for c in cases_for(r)]


def run_legacy_on_emulated_ranks(body, num_ranks: int) -> None:
    """``body(group, num_ranks)`` on ``num_ranks`` ranks emulated on GPU 0, with `deep_ep.Buffer`'s
    class-wide SM count lowered for the call so that every rank's blocks are resident at once (8
    ranks x DeepEP's 20 SMs would not fit on 132), then restored."""
    import deep_ep
    from deep_ep.emulated import EmulatedGroup
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0))
    num_sms = deep_ep.Buffer.num_sms
    deep_ep.Buffer.set_num_sms(min(num_sms, torch.cuda.get_device_properties(0).multi_processor_count
                                   // num_ranks // 2 * 2))
    try:
        group.run(body, num_ranks)
    finally:
        deep_ep.Buffer.set_num_sms(num_sms)
