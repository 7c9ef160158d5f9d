"""Helpers of the device tools (tools/) that run on CPU too."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
from tune_gpu import bit_equal, parse_variant  # noqa: E402


def test_bit_equal_compares_bytes_so_poison_equals_itself():
    """The test poison of a float output is all-ones bytes, a NaN: the variant sweeps compare outputs
    byte for byte, so untouched poisoned rows match while torch.equal says they differ."""
    a = torch.empty(3, 4, dtype=torch.bfloat16)
    a.view(torch.uint8).fill_(0xFF)
    b = a.clone()
    assert not torch.equal(a, b) and bit_equal(a, b)
    b[1, 2] = 1.0
    assert not bit_equal(a, b)
    assert not bit_equal(a, a.view(4, 3)) and not bit_equal(a, a.view(torch.int16))
    assert not bit_equal(a.t(), b.t().contiguous())
    assert bit_equal(torch.empty(0, 7), torch.empty(0, 7))
    c = torch.randn(5, 6)
    assert bit_equal(c.t(), c.t().contiguous())


def test_parse_variant():
    assert parse_variant("send_unroll=16, LOAD_NO_L1=1") == {"EP_SEND_UNROLL": 16, "EP_LOAD_NO_L1": 1}
    assert parse_variant("") == {}


def test_host_python_cost_stamps_show_where_each_call_allocates_and_launches():
    """tools/host_python_cost.py --stamps runs, and shows the full dispatch with CPU sync making its
    two handle allocations, launching the notify kernel, making its four outputs once the counts
    are in (recv_x, recv_topk_idx, recv_topk_weights, recv_src_metadata) and launching the data
    kernel, in that order; the cached dispatch and the combine one launch each."""
    import re
    import subprocess
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tools" / "host_python_cost.py"), "--stamps"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    kinds = {}
    for line in out.splitlines()[1:]:
        name, _, stamps = line.strip().partition("  ")
        kinds[name] = [re.match(r"([a-zL]+)([0-9.]+)$", s).groups() for s in stamps.split()]
    full = kinds["public: full dispatch, CPU sync"]
    assert [k for k, _ in full] == ["a", "a", "L", "a", "a", "a", "a", "L", "end"], full
    times = [float(t) for _, t in full]
    assert times == sorted(times) and times[0] > 0, full
    assert [k for k, _ in kinds["public: cached dispatch"]] == ["a", "a", "L", "end"]
    assert [k for k, _ in kinds["public: combine"]] == ["a", "L", "end"]


def test_the_torchrun_suite_calls_each_gpu_body_with_its_arguments(monkeypatch):
    """tools/torchrun_suite.py runs bodies of the GPU test files on the world group: every body it
    names exists and takes the arguments it passes (checked against the signatures, without a GPU)."""
    import inspect
    import torchrun_suite
    import test_gpu_agrs
    import test_gpu_barrier
    import test_gpu_engram
    import test_gpu_legacy
    import test_gpu_legacy_ll_direct
    import test_gpu_pp
    calls = []
    for module in (test_gpu_agrs, test_gpu_barrier, test_gpu_engram, test_gpu_legacy, test_gpu_legacy_ll_direct,
                   test_gpu_pp):
        if hasattr(module, "DEVICE"):
            monkeypatch.setattr(module, "DEVICE", module.DEVICE)   # restored afterwards
        for name, value in list(vars(module).items()):
            if name.startswith("_") and name.endswith("body") and callable(value):
                def checked(*args, _original=value, _name=f"{module.__name__}.{name}", **kwargs):
                    inspect.signature(_original).bind(*args, **kwargs)   # TypeError on a mismatch
                    calls.append(_name)
                monkeypatch.setattr(module, name, checked)
    device = torch.device("cuda", 3)
    cases = torchrun_suite._module_cases(4, device)
    for _, body, _ in cases:
        body(object())
    assert len(calls) == len(cases) == 9 and test_gpu_pp.DEVICE == device
    assert [name for name, _, _ in torchrun_suite._module_cases(3, device)][0] == "v1-low-latency"   # no V1 tokens
