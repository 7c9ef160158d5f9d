"""The README's V1 `deep_ep.Buffer` example runs as written (CPU, 2 gloo ranks) and gives the values
it promises, so the README cannot rot.

The block is a fragment: it uses a group, inputs and expert outputs it does not make. The test
makes the inputs at the README's shapes (hidden 7168, 256 experts, top-8), gives ``y`` and
``expert_y`` (identity experts) just before their first use, and runs the block's two paragraphs
(normal mode, then low-latency mode) as they are, each followed by a check of its result.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from proc_utils import run_gloo_ranks

ROOT = Path(__file__).resolve().parents[1]
NUM_TOKENS = 16
HIDDEN = 7168
NUM_EXPERTS = 256
NUM_TOPK = 8
#: the names the block uses before (or without) defining them: identity experts
STAND_INS = {"y": "y = recv_x", "expert_y": "expert_y = _dequantize(recv_x, scales)"}


def _v1_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    found = [block for block in blocks if "deep_ep.Buffer(" in block]
    assert len(found) == 1, f"expected one V1 example in README.md, found {len(found)}"
    return found[0]


def _with_stand_ins(paragraph: str) -> str:
    lines, defined = [], set()
    for line in paragraph.splitlines():
        for name, definition in STAND_INS.items():
            if name not in defined and re.search(rf"(?<![\w.]){name}(?!\w)", line.split("#")[0]):
                lines.append(definition)
                defined.add(name)
        lines.append(line)
    return "\n".join(lines) + "\n"


def _dequantize(recv_x, scales):
    """bf16 rows from FP8 data and its float32 scales (one per 128 columns)."""
    return (recv_x.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)


def _run(rank, num_ranks):
    import deep_ep
    generator = torch.Generator().manual_seed(rank)
    x = (torch.randn(NUM_TOKENS, HIDDEN, generator=generator) + 0.5).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:NUM_TOPK]
                            for _ in range(NUM_TOKENS)])
    topk_weights = torch.rand(NUM_TOKENS, NUM_TOPK, generator=generator) + 0.1
    normal, decode = _v1_block().split("\n\n")
    namespace = {"deep_ep": deep_ep, "torch": torch, "group": dist.group.WORLD, "x": x, "topk_idx": topk_idx,
                 "topk_weights": topk_weights, "_dequantize": _dequantize}

    exec(_with_stand_ins(normal), namespace)
    # identity experts: each token comes back once per rank its experts live on, summed in float32
    copies = torch.stack([(topk_idx // (NUM_EXPERTS // num_ranks) == owner).any(1) for owner in range(num_ranks)])
    assert torch.equal(namespace["out"], (x.float() * copies.sum(0)[:, None]).to(torch.bfloat16))
    assert namespace["recv_x"].dtype == torch.bfloat16 and namespace["recv_x"].shape[1] == HIDDEN

    exec(_with_stand_ins(decode), namespace)
    recv_x, out = namespace["recv_x"], namespace["out"]
    assert recv_x.dtype == torch.float8_e4m3fn
    assert recv_x.shape == (NUM_EXPERTS // num_ranks, num_ranks * 128, HIDDEN)   # as the README's comment says
    # identity experts, weighted: every expert saw the same FP8 copy of the token (about 6% of error at most)
    want = x.float() * topk_weights.sum(1, keepdim=True)
    assert ((out.float() - want).abs() <= 0.07 * want.abs() + 0.05).all()
    assert out.abs().sum() > 0
    return int(namespace["recv_count"].sum())


def test_readme_v1_example_runs(tmp_path):
    results = run_gloo_ranks(_run, 2, tmp_path, deadline=240)
    assert sum(results.values()) == 2 * NUM_TOKENS * NUM_TOPK    # every top-k slot reached an expert
