"""Wide groups on one GPU: many emulated nodes (10 x 1, 16 x 1 and 8 x 2 ranks, direct and hybrid
mode), and one NVLink domain of 72 emulated ranks (NVL72's size: the kernels' paths for more ranks
than a warp has lanes).

Each split runs two cases of tests/gpu_cases.py through `test_gpu_backend.run_case` at small token
counts (BF16 expanded without CPU sync, FP8 with per-128 scales): outputs poisoned first, every
element compared with deep_ep.reference (dispatch bit for bit; combine bit for bit in the reference's
flat order in direct mode and with one rank per node, in its hybrid order across nodes of 2), a
cached dispatch and a second combine with the same handle.

How far one GPU can emulate (docs/scaleout.md, "How large a job"): every rank's blocks must be
resident at once, and a rank of an emulated node runs its data kernel beside an NIC kernel of
``ceil(contexts * R * 32 / 256)`` blocks, so on 132 SMs a rank keeps ``132 // R`` SMs less those
(16 ranks with 2 contexts: 4 data blocks; 32 ranks: none, so no split of 32 ranks is tried). And every
stream needs a hardware queue of its own (``CUDA_DEVICE_MAX_CONNECTIONS``, at most 32): a rank of an
emulated node has three streams (compute, communication, NIC), so 10 ranks are the most that get
a queue per stream (``3 * 10 + 2 = 32``); 16 ranks share queues, and a rank's work queued behind
another rank's waiting kernel stalls until that kernel's GPU timeout. The 16-rank splits are here
to find out whether that bites: a stall fails the case with a `TimeoutError` after the GPU timeout
(10 s here unless ``DEEP_EP_TEST_GPU_TIMEOUT`` says otherwise), and a test still running after
``DEEP_EP_WIDE_DEADLINE`` seconds (default 150) dumps every thread's stack and ends the process.

Skipped without a CUDA device; run with
``EXTRA_FILES="tests/gpu/test_gpu_scaleout_wide.py" bash tools/device_suite.sh extra`` (about 2 minutes
on an H200, most of it building the kernels; not run yet).
"""
from __future__ import annotations

import dataclasses
import faulthandler
import functools
import os
import sys
import traceback

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_cases import case_seed, cases_for  # noqa: E402
from proc_utils import case_log  # noqa: E402

import deep_ep  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NIC_THREADS, NIC_WARP_THREADS = 256, 32   # deep_ep.comm.gin.NIC_THREADS; a warp per (context, destination)
CONTEXTS = 2
CASE_NAMES = ("bf16-expand-nosync", "fp8-fp32")
TOKENS = (7, 0, 12, 3, 5)                 # per rank, cycled: an empty rank in every split
DIRECT_SHAPES = [(10, 1), (16, 1), (8, 2)]
HYBRID_SHAPES = [(16, 1), (8, 2)]


@pytest.fixture(autouse=True)
def _deadline(monkeypatch):
    """A short GPU timeout, and a process deadline per test: a stall ends in a clear failure."""
    monkeypatch.setenv("DEEP_EP_TEST_GPU_TIMEOUT", os.environ.get("DEEP_EP_TEST_GPU_TIMEOUT", "10"))
    faulthandler.dump_traceback_later(float(os.environ.get("DEEP_EP_WIDE_DEADLINE", "150")), exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _data_blocks(num_ranks: int, nodes: bool = True) -> int:
    """SMs one emulated rank's data kernel may use (beside its NIC kernel on emulated nodes:
    `GPUBackend._sm_limit`)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nic_blocks = -(-CONTEXTS * num_ranks * NIC_WARP_THREADS // NIC_THREADS) if nodes else 0
    return sms // num_ranks - nic_blocks


def _group(nodes: int, per_node: int, seed: int):
    from deep_ep.comm.gin import EmulatedGinSettings
    from deep_ep.emulated import EmulatedGroup
    return EmulatedGroup(nodes * per_node, device=torch.device("cuda", 0), num_nvlink_ranks=per_node, timeout_secs=60,
                         gin_settings=EmulatedGinSettings(seed=seed, num_contexts=CONTEXTS))


def _cases(num_ranks: int, nodes: bool = True) -> list:
    blocks = _data_blocks(num_ranks, nodes)
    if blocks < 1:
        pytest.skip(f"{num_ranks} emulated ranks leave no SM for a data kernel beside the NIC's blocks")
    cases = [dataclasses.replace(c, tokens=TOKENS, num_sms=min(c.num_sms, blocks))
             for c in cases_for(num_ranks) if c.name.split("-", 1)[1] in CASE_NAMES]
    assert len(cases) == len(CASE_NAMES)
    return cases


def _run(label: str, nodes: int, per_node: int, cases: list, group) -> None:
    from test_gpu_backend import run_case
    dev = torch.device("cuda", 0)
    for case in cases:
        name = f"{label}-{nodes}x{per_node}-{case.name}"
        case_log(f"{name}: start")
        try:
            run_case(case, group.run, dev, seed=case_seed(case.name, label, nodes, per_node))
        except Exception as exc:
            case_log(f"{name}: FAIL {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise
        case_log(f"{name}: ok")


@pytest.mark.parametrize("shape", DIRECT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_wide_direct(shape, monkeypatch):
    """Direct mode: every rank of another node reached through the emulated GIN."""
    nodes, per_node = shape
    cases = _cases(nodes * per_node)
    group = _group(nodes, per_node, seed=11)

    def domains(g):
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=16, hidden=256, num_topk=4, allow_hybrid_mode=False)
        try:
            return (buf.num_rdma_ranks, buf.num_nvlink_ranks, buf.get_logical_domain_size(), buf._backend.transport_gin)
        finally:
            buf.destroy()

    assert group.run(domains) == [(nodes, per_node, (1, nodes * per_node), 1)] * (nodes * per_node)
    monkeypatch.setattr(deep_ep, "ElasticBuffer", functools.partial(deep_ep.ElasticBuffer, allow_hybrid_mode=False))
    _run("direct", nodes, per_node, cases, group)


@pytest.mark.parametrize("shape", HYBRID_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_wide_hybrid(shape, monkeypatch):
    """Hybrid mode (the default): handles count per scale-up rank; with one rank per node the buffer
    runs direct mode's transport and its combine sums in the flat order (docs/scaleout.md), across
    nodes of 2 in the hybrid order."""
    from deep_ep import reference as ref
    nodes, per_node = shape
    cases = _cases(nodes * per_node)
    group = _group(nodes, per_node, seed=13)
    if per_node > 1:
        monkeypatch.setattr(ref, "reference_combine",
                            functools.partial(ref.reference_combine, num_scaleup_ranks=per_node))
    flat_dispatch = ref.reference_dispatch

    def hybrid_dispatch(*args, **kwargs):
        results = flat_dispatch(*args, **kwargs)
        for result in results:
            psum = result.handle.psum_num_recv_tokens_per_scaleup_rank
            counts = torch.diff(psum, prepend=psum.new_zeros(1))
            result.handle.psum_num_recv_tokens_per_scaleup_rank = torch.cumsum(
                counts.view(-1, per_node).sum(0), 0).to(torch.int32)
        return results

    monkeypatch.setattr(ref, "reference_dispatch", hybrid_dispatch)
    _run("hybrid", nodes, per_node, cases, group)


def test_one_nvlink_domain_of_72_ranks():
    """72 emulated ranks on one node (one SM each), the size of an NVL72 domain: every loop over
    destination ranks strides past the 32 lanes of a warp, and combine reads the rows of owners
    beyond lane 31 from memory rather than from a lane. 146 streams share the 32 hardware queues."""
    from deep_ep.emulated import EmulatedGroup
    num_ranks = 72
    cases = _cases(num_ranks, nodes=False)
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0), timeout_secs=60)
    _run("one-node", 1, num_ranks, cases, group)
