"""The kernels' names meet DeepEP V2's own test of ElasticBuffer (tests/elastic/test_ep.py), without a
GPU: it profiles each call with torch.profiler and times it by the table lines whose name contains
``dispatch_impl`` and ``dispatch_copy_epilogue_impl`` (every dispatch: fresh, expanded, cached) or
``combine_impl`` and ``combine_reduce_epilogue_impl`` (combine). Each substring must match one line of
a call's table: none makes its average 0 (and the test divides by it), two or more fail its check.
Our data kernels do both phases in one kernel, so each name holds both substrings of its call.
DeepEP's V1 test (tests/legacy/test_low_latency.py) times a receive hook's halves by the profiler
events whose names contain ``::dispatch`` and ``::combine``: the data kernels are C++ kernels in
namespace ``deep_ep``, whose profiler names are their qualified names.
"""
import re
from pathlib import Path

import pytest

from deep_ep.backends.gpu import modules

DISPATCH_NAMES = ("dispatch_impl", "dispatch_copy_epilogue_impl")
COMBINE_NAMES = ("combine_impl", "combine_reduce_epilogue_impl")
# The kernels of each call DeepEP's test times, and the barrier it runs between calls.
CALLS = {
    "fresh dispatch": ((modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL), DISPATCH_NAMES),
    "cached dispatch": ((modules.CACHED_DISPATCH_KERNEL,), DISPATCH_NAMES),
    "combine": ((modules.COMBINE_KERNEL,), COMBINE_NAMES),
}
INCLUDE = Path(modules.__file__).parents[2] / "include" / "deep_ep" / "kernels"


def _entry_points(kind: str) -> list:
    """The ``__global__`` entry points declared in kernels/<kind>.cuh: ``extern "C"`` ones by name,
    the others (C++, inside ``namespace deep_ep``) by qualified name."""
    source = (INCLUDE / f"{kind}.cuh").read_text()
    names = re.findall(r'extern "C" __global__ void __launch_bounds__\([^)]*\)\s+(\w+)\(', source)
    for block in re.findall(r"namespace deep_ep \{(.*?)\}  // namespace deep_ep", source, re.S):
        names += ["deep_ep::" + name for name in
                  re.findall(r'(?<!extern "C" )__global__ void __launch_bounds__\([^)]*\)\s+(\w+)\(', block)]
    return names


def test_the_host_names_the_kernels_the_sources_declare():
    assert sorted(_entry_points("dispatch")) == sorted([modules.NOTIFY_KERNEL, modules.DISPATCH_KERNEL,
                                                        modules.CACHED_DISPATCH_KERNEL])
    assert _entry_points("combine") == [modules.COMBINE_KERNEL]
    assert _entry_points("barrier") == [modules.BARRIER_KERNEL]


@pytest.mark.parametrize("call", sorted(CALLS))
def test_each_timed_name_matches_exactly_one_kernel_of_its_call(call):
    """Each substring DeepEP's test looks for matches one kernel of the call (with the barrier it runs
    before each call in the same table), and the name is short enough to stay whole in the profiler
    table's name column (100 characters)."""
    kernels, substrings = CALLS[call]
    table = kernels + (modules.BARRIER_KERNEL,)
    for substring in substrings:
        matching = [name for name in table if substring in name]
        assert len(matching) == 1, (call, substring, matching)
    for name in kernels:
        assert re.fullmatch(r"([A-Za-z_]\w*::)?[A-Za-z_]\w*", name) and len(name) < 100, name


def test_the_notify_kernel_and_the_barrier_match_no_timed_name():
    for name in (modules.NOTIFY_KERNEL, modules.BARRIER_KERNEL):
        assert not [s for s in DISPATCH_NAMES + COMBINE_NAMES if s in name], name


def test_dispatch_kernels_match_no_combine_name_and_back():
    for name in (modules.DISPATCH_KERNEL, modules.CACHED_DISPATCH_KERNEL):
        assert all(s in name for s in DISPATCH_NAMES) and not any(s in name for s in COMBINE_NAMES), name
    assert all(s in modules.COMBINE_KERNEL for s in COMBINE_NAMES)
    assert not any(s in modules.COMBINE_KERNEL for s in DISPATCH_NAMES)


def test_the_data_kernels_match_deepeps_v1_hook_names():
    """DeepEP's V1 low-latency test counts the kernels named ``...::dispatch...`` / ``...::combine...``
    per call (two with a receive hook: its send and receive halves are one kernel each)."""
    for name in (modules.DISPATCH_KERNEL, modules.CACHED_DISPATCH_KERNEL):
        assert "::" in name and "::combine" not in name
    assert "::dispatch" in modules.DISPATCH_KERNEL and "::combine" in modules.COMBINE_KERNEL
    assert "::" not in modules.NOTIFY_KERNEL and "::" not in modules.BARRIER_KERNEL


def test_the_direct_low_latency_kernels_match_deepeps_v1_hook_names():
    """The V1 low-latency direct kernels (deep_ep/legacy/ll_direct.py): one kernel per call, named
    ``deep_ep::dispatch...`` or ``deep_ep::combine...`` (DeepEP's V1 test times a call by the one
    profiler-table line holding "dispatch" / "combine", and counts its launches, two with a receive
    hook: the send and the receive phase), as kernels/ll_direct.cuh declares them, and matching none
    of V2's timed names."""
    from deep_ep.legacy import ll_direct
    assert sorted(_entry_points("ll_direct")) == sorted(ll_direct.KERNEL_NAMES)
    assert ll_direct.DISPATCH_KERNEL.startswith("deep_ep::dispatch") and "combine" not in ll_direct.DISPATCH_KERNEL
    assert ll_direct.COMBINE_KERNEL.startswith("deep_ep::combine") and "dispatch" not in ll_direct.COMBINE_KERNEL
    for name in ll_direct.KERNEL_NAMES:
        assert not [s for s in DISPATCH_NAMES + COMBINE_NAMES if s in name], name
        assert re.fullmatch(r"([A-Za-z_]\w*::)?[A-Za-z_]\w*", name) and len(name) < 100, name


def test_qualified_names_from_symbols():
    from deep_ep.jit.runtime import qualified_name
    assert qualified_name("_ZN7deep_ep12combine_implENS_11CombineArgsEi") == "deep_ep::combine_impl"
    assert qualified_name("_ZN7deep_ep4comm3putEv") == "deep_ep::comm::put"
    assert qualified_name("deep_ep_notify") == "deep_ep_notify"
    assert qualified_name("_Z3foov") == "_Z3foov"
