"""Every kernel instantiation the GPU suite and the bench use compiles under NVRTC, with no spills.

Runs on machines without a GPU (CI): compiling needs only the NVRTC and header wheels.
"""
from __future__ import annotations

import pytest

from deep_ep import jit
from deep_ep.backends import gpu
from deep_ep.routing import MODEL_PRESETS as PRESETS

from gpu_cases import all_cases


def _structures():
    dispatch, combine = set(), set()
    for c in all_cases():
        dispatch.add(c.dispatch_structure())
        combine.add(c.combine_structure())
    # the bench's presets: bf16 and FP8 (fp32 scales), expanded or not
    for p in PRESETS.values():
        for expand in (False, True):
            dispatch.add((p.hidden * 2, 0, p.top_k, expand))
            if p.hidden % 128 == 0:
                dispatch.add((p.hidden, p.hidden // 128, p.top_k, expand))
            combine.add((p.hidden, p.top_k, expand))
    return sorted(dispatch), sorted(combine)


DISPATCH, COMBINE = _structures()


@pytest.mark.parametrize("structure", DISPATCH, ids=lambda s: "d{}_sf{}_k{}_{}".format(*s))
def test_dispatch_module_compiles(structure):
    mod = jit.build("deep_ep_dispatch_test", gpu.kernel_source(), defines=gpu.dispatch_defines(*structure),
                    check_spills=True)
    assert {"deep_ep_notify", "deep_ep_layout", "deep_ep_dispatch", "deep_ep_dispatch_cached"} <= set(mod.kernel_names())


@pytest.mark.parametrize("structure", COMBINE, ids=lambda s: "h{}_k{}_{}".format(*s))
def test_combine_module_compiles(structure):
    mod = jit.build("deep_ep_combine_test", gpu.kernel_source(), defines=gpu.combine_defines(*structure),
                    check_spills=True)
    assert {"deep_ep_combine"} <= set(mod.kernel_names())
