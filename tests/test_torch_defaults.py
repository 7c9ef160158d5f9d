"""deep_ep under a caller's torch defaults (DeepEP's harness sets ``torch.set_default_dtype(bf16)`` and
``torch.set_default_device('cuda')`` before it makes a buffer).

* A lint over deep_ep/**/*.py (read with ast, nothing runs): every torch tensor-factory call names
  its ``device=``, and its ``dtype=`` wherever the factory would otherwise take the default float
  dtype; no factory is imported under another name (``from torch import zeros``).
* CPU-backend cases (gloo, 2 ranks) with every buffer call under a bf16 default dtype, and under a
  bf16 default dtype with ``meta`` as the default device, checked bit for bit as in
  tests/test_cpu_backend.py. tests/gpu/test_gpu_defaults.py does the same on the GPU.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from caller_defaults import UnderDefaults, caller_defaults
from proc_utils import run_gloo_ranks

PKG = Path(__file__).resolve().parents[1] / "deep_ep"

#: torch functions that make a tensor on the default device unless given ``device=`` (those of
#: torch.utils._device that deep_ep could call; ``from_numpy`` / ``frombuffer`` share host memory and
#: the source's dtype, so they are left out).
FACTORIES = {"arange", "as_tensor", "asarray", "empty", "empty_permuted", "empty_strided", "eye", "full",
             "linspace", "logspace", "ones", "rand", "randint", "randn", "randperm", "range", "scalar_tensor",
             "tensor", "tril_indices", "triu_indices", "zeros"}
#: Integer results (int64) whatever the default dtype, unless a float is among their arguments.
INTEGRAL = {"arange", "range", "randint", "randperm", "tril_indices", "triu_indices"}
#: The dtype follows the data: the default float dtype unless the data are integers or booleans.
FROM_DATA = {"tensor": 0, "as_tensor": 0, "asarray": 0, "scalar_tensor": 0, "full": 1}


def _integral_literal(node: ast.AST) -> bool:
    """Whether ``node`` is a literal made of ints and bools only (nested lists / tuples, signs)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (bool, int))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _integral_literal(node.operand)
    if isinstance(node, (ast.List, ast.Tuple)):
        return all(_integral_literal(e) for e in node.elts)
    return False


def _has_float_literal(nodes) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, float) for node in nodes for n in ast.walk(node))


def factory_problems(source: str, filename: str = "<source>") -> list:
    """``file:line: message`` for every torch factory call in ``source`` that lacks ``device=`` or a
    needed ``dtype=``, and every factory imported from torch by name."""
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            for alias in node.names:
                if alias.name in FACTORIES:
                    problems.append(f"{filename}:{node.lineno}: 'from torch import {alias.name}' hides a "
                                    f"factory call from this check: call torch.{alias.name}")
            continue
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        name = node.func.attr
        keywords = {k.arg for k in node.keywords}
        missing = []
        if "device" not in keywords:
            missing.append("device=")
        if "dtype" not in keywords:
            if name in INTEGRAL:
                needs_dtype = _has_float_literal(node.args + [k.value for k in node.keywords])
            elif name in FROM_DATA:
                position = FROM_DATA[name]
                data = node.args[position] if len(node.args) > position else None
                needs_dtype = data is None or not _integral_literal(data)
            else:
                needs_dtype = True
            if needs_dtype:
                missing.append("dtype=")
        if missing:
            problems.append(f"{filename}:{node.lineno}: torch.{name}(...) without {' and '.join(missing)} "
                            f"(a caller's torch.set_default_device / set_default_dtype would apply)")
    return problems


def test_every_factory_call_names_device_and_dtype():
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        problems += factory_problems(path.read_text(), str(path.relative_to(PKG.parent)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, flagged", [
    ("torch.empty(3, dtype=torch.int32)", True),                     # no device
    ("torch.zeros(3, device=d)", True),                              # default float dtype
    ("torch.zeros(3, dtype=torch.float32, device=d)", False),
    ("torch.arange(n, device=d)", False),                            # int64 whatever the default
    ("torch.arange(0.0, 1.0, 0.1, device=d)", True),                 # a float range: default dtype
    ("torch.tensor([1, -2, True], device=d)", False),
    ("torch.tensor([1.5], device=d)", True),
    ("torch.tensor(values, device=d)", True),                        # data unknown here
    ("torch.full((2,), -1, device=d)", False),
    ("torch.full((2,), 0.5, device=d)", True),
    ("torch.empty_like(x)", False),                                  # device and dtype from x
    ("from torch import zeros", True),
])
def test_factory_lint_rules(source, flagged):
    assert bool(factory_problems("import torch\n" + source)) == flagged


# ------------------------------------------------------------------------------ CPU backend runs
#: Bf16, FP8 (both scale-factor forms), expanded with padding, without CPU sync, biases, the fused
#: dispatch weighting and an order-sensitive combine: the CPU backend's paths in a few cases.
CASES = ["R2-bf16-flat-A1-sync", "R2-bf16-exp-A128-nosync", "R2-fp8-exp-A1-sync", "R2-fp8_ue8m0-flat-A1-nosync",
         "R2-all-empty", "R2-apply-weights", "R2-order-exp-multi-b2"]


def _worker(rank, world_size, device):
    from test_cpu_backend import BUFFER_MAX_TOKENS, _cases, _run_case

    from deep_ep import ElasticBuffer
    with caller_defaults(torch.bfloat16, device):
        buffers = {flag: ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=BUFFER_MAX_TOKENS, hidden=512,
                                       num_topk=8, allow_multiple_reduction=flag) for flag in (True, False)}
    buffers = {flag: UnderDefaults(buf, torch.bfloat16, device) for flag, buf in buffers.items()}
    ran = []
    for case in _cases(world_size):
        if case.name in CASES:
            _run_case(buffers[case.allow_multiple_reduction], case, rank)
            ran.append(case.name)
    buffers[True].barrier()
    for buf in buffers.values():
        buf.destroy()
    assert torch.get_default_dtype() == torch.float32 and torch.get_default_device().type == "cpu"
    return ran


@pytest.mark.parametrize("device", [None, "meta"], ids=["bf16", "bf16-meta"])
def test_cpu_backend_under_caller_defaults(device, tmp_path):
    results = run_gloo_ranks(_worker, 2, tmp_path, device, deadline=300)
    assert results == {0: CASES, 1: CASES}
