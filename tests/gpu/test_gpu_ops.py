"""deep_ep.ops and deep_ep.moe on the GPU: the checks of tests/test_ops.py and tests/test_ops_ranks.py
on CUDA tensors.

* gradients (dispatch fresh and cached, combine with weights, biases and ``apply_dispatch_weights``;
  BF16 and FP8 forward; both layouts, with and without a host sync) against `deep_ep.reference`
  bit for bit and dense equivalents: EP=1 through a one-rank NCCL group, and 2 and 4 emulated ranks
  (whose backward passes autograd runs in one engine thread for all ranks: this is where a
  collective module load or a host wait in a backward would hang);
* ``torch.compile(fullgraph=True)`` with inductor, EP=1: one graph, no break, the operators' outputs
  and every gradient equal to eager (the MoE layer's within bf16 rounding: inductor fuses its
  arithmetic);
* the MoE layer against its dense equivalent (EP=1 and emulated), and the training example with 2
  emulated ranks (loss down, equal to the dense model's within its tolerance).

Skipped without a CUDA device.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)

import test_ops as grads  # noqa: E402
import test_ops_ranks as ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN_MAX, TOPK_MAX = 512, 4


# a rank that waits for a peer which never comes reports it within this many seconds (not the default 100)
TIMEOUT = float(os.environ.get("DEEP_EP_TEST_GPU_TIMEOUT", "20"))


def _buffer(group, num_max_tokens_per_rank: int = grads.MAX_TOKENS, **kwargs):
    import deep_ep
    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=HIDDEN_MAX,
                                 num_topk=TOPK_MAX, num_gpu_timeout_secs=TIMEOUT, num_cpu_timeout_secs=TIMEOUT,
                                 **kwargs)


def _gradient_cases(rank, R, buf, device, check_leaks):
    for i, case in enumerate(grads.cases(R) + grads.fp8_cases(R)):
        if not case.apply_dispatch_weights:
            grads.check_dispatch_grads(buf, case, rank, R, device, seed=900 + i, check_leaks=check_leaks)
        if case.x_format == "bf16":
            grads.check_combine_grads(buf, case, rank, R, device, seed=950 + i, check_leaks=check_leaks)


def test_gradients_ep1(nccl_group):
    buf = _buffer(nccl_group)
    try:
        _gradient_cases(0, 1, buf, torch.device("cuda", 0), check_leaks=True)
    finally:
        buf.destroy()


def _run_ranks(group, body) -> None:
    """``body`` on every emulated rank (each returns True); then no operator handle outlives its tensors."""
    from deep_ep import ops
    assert group.run(body) == [True] * group.num_ranks
    gc.collect()
    assert ops.num_live_handles() == 0


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_gradients_emulated(num_ranks):
    from deep_ep.emulated import EmulatedGroup
    group = EmulatedGroup(num_ranks)

    def body(rank_group):
        buf = _buffer(rank_group)
        try:
            _gradient_cases(rank_group.rank(), num_ranks, buf, group.device, check_leaks=False)
        finally:
            buf.destroy()
        return True

    _run_ranks(group, body)


def test_compile_inductor_ep1(nccl_group):
    from deep_ep import moe
    T = 40
    buf = _buffer(nccl_group, num_max_tokens_per_rank=T)
    device = torch.device("cuda", 0)
    try:
        E, H, K = 8, 64, 3
        x, idx, w, b = ranks.routing_inputs(0, T, H, E, K, device)
        for do_expand, sync, A in ranks.compile_configurations():
            ranks.check_compiled(ranks.ops_function(buf, idx, E, do_expand, sync, A), (x, w, b), "inductor")
        params = moe.moe_parameters(H, 32, E, generator=torch.Generator().manual_seed(5), device=device)
        target = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device)
        for kwargs in (dict(do_expand=True, expert_alignment=8), dict(do_expand=False, do_cpu_sync=False)):
            layer = moe.MoELayer(buf, params, K, **kwargs)
            ranks.check_compiled(ranks.moe_function(layer, target), (x.float(),), "inductor", tolerance=2.0 ** -5)
    finally:
        buf.destroy()


# the GPU's bf16 products round differently from the CPU's dense model: a few more units
_GPU_TOLERANCES = dict(output_units=8, gradient_fraction=2.0 ** -5)


def test_moe_layer_ep1(nccl_group):
    buf = _buffer(nccl_group, num_max_tokens_per_rank=24)
    try:
        for i, config in enumerate(ranks.moe_configurations()):
            ranks.check_moe_layer(buf, 0, 1, config, torch.device("cuda", 0), lambda t: None, [24], seed=40 + i,
                                  **_GPU_TOLERANCES)
    finally:
        buf.destroy()


class _ThreadSum:
    """In-place sum of a tensor over emulated ranks (threads with a stream each), in rank order."""

    def __init__(self, group) -> None:
        self.group, self.slots = group, [None] * group.num_ranks

    def __call__(self, rank: int, t: torch.Tensor) -> None:
        from deep_ep.emulated import wait_for_stream
        wait_for_stream()          # polled, not a blocking driver wait (see deep_ep.emulated)
        self.slots[rank] = t
        self.group.barrier()
        total = sum(s.clone() for s in self.slots)
        wait_for_stream()
        self.group.barrier()
        t.copy_(total)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_moe_layer_emulated(num_ranks):
    from deep_ep.emulated import EmulatedGroup
    group = EmulatedGroup(num_ranks)
    reduce = _ThreadSum(group)
    tokens = {2: [20, 13], 4: [9, 17, 0, 12]}[num_ranks]

    def body(rank_group):
        import deep_ep
        rank = rank_group.rank()
        buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=24, hidden=32, num_topk=3,
                                    num_gpu_timeout_secs=TIMEOUT, num_cpu_timeout_secs=TIMEOUT)
        try:
            for i, config in enumerate(ranks.moe_configurations()):
                ranks.check_moe_layer(buf, rank, num_ranks, config, group.device, lambda t: reduce(rank, t), tokens,
                                      seed=40 + i, **_GPU_TOLERANCES)
        finally:
            buf.destroy()
        return True

    _run_ranks(group, body)


def test_training_example_emulated():
    example = os.path.join(os.path.dirname(TESTS), "examples", "train_moe.py")
    proc = subprocess.run([sys.executable, example, "--gpu-emulated", "2"], capture_output=True, text=True,
                          timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "went down" in proc.stdout and "within the tolerance" in proc.stdout
