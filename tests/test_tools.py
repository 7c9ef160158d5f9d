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


def test_the_write_floor_kernel_compiles():
    """tools/write_floor.py's store kernel, both variants (NVRTC, no GPU needed)."""
    import write_floor
    for streaming in (False, True):
        assert write_floor.kernel(streaming) is not None


def test_the_expand_floor_kernels_compile_and_its_rows_follow_the_layout():
    """tools/expand_floor.py: every variant of its fan-out kernel compiles (NVRTC, no GPU needed),
    and its destination rows are the expanded layout's at alignment 1 (grouped by expert, tokens in
    order within an expert, every row once)."""
    import expand_floor
    for defines in expand_floor.VARIANTS.values():
        for threads in (512, 1024):
            assert expand_floor.build(defines, 7, 8, threads) is not None
    idx = torch.tensor([[0, 2], [1, 0], [2, 1]])
    assert expand_floor.expanded_rows(idx, 3).tolist() == [[0, 4], [2, 1], [5, 3]]
    g = torch.Generator().manual_seed(0)
    idx = torch.rand((50, 16), generator=g).topk(4, dim=1).indices
    pos = expand_floor.expanded_rows(idx, 16).long()
    assert sorted(pos.flatten().tolist()) == list(range(200))
    order = sorted(((int(idx[t, k]), t), int(pos[t, k])) for t in range(50) for k in range(4))
    assert [row for _, row in order] == list(range(200))


def test_host_python_cost_stamps_show_where_each_call_allocates_and_launches():
    """tools/host_python_cost.py --stamps runs, and shows the full dispatch with CPU sync making its
    two handle allocations, launching the notify kernel, making its three outputs and launching the
    data kernel, in that order; the cached dispatch and the combine one launch each."""
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
    assert [k for k, _ in full] == ["a", "a", "L", "a", "a", "a", "L", "end"], full
    times = [float(t) for _, t in full]
    assert times == sorted(times) and times[0] > 0, full
    assert [k for k, _ in kinds["public: cached dispatch"]] == ["a", "a", "L", "end"]
    assert [k for k, _ in kinds["public: combine"]] == ["a", "L", "end"]
