"""Session setup shared by every test file.

NCCL headers. Some tests build NCCL device code with the headers the JIT finds in the environment:
on a GPU machine, the nvidia-nccl-cu13 wheel that torch's CUDA build brought. A CPU build of torch
brings none, and the ``test`` extra installs none (requiring one could move torch's NCCL or torch
itself, see pyproject.toml). So when the environment has no NCCL headers and such a test is
selected, the session points the JIT at NCCL 2.28.9's headers, downloaded once into the test cache
(``tests/nccl_wheels.py``), through ``EP_NCCL_INCLUDE_DIR``, which the subprocesses that tests start
inherit. Nothing is downloaded for a run that selects none of those tests.
"""
from __future__ import annotations

import warnings

import pytest

# Test files that call jit.build(use_nccl=True) without naming an include dir (in process or in a
# subprocess they start).
_USES_ENVIRONMENT_NCCL = {"test_jit.py", "test_jit_cache_faults.py", "test_kernels_compile.py"}


@pytest.fixture(scope="session", autouse=True)
def _environment_nccl_headers(request):
    if not {item.path.name for item in request.session.items} & _USES_ENVIRONMENT_NCCL:
        yield
        return
    import nccl_wheels
    from deep_ep.jit import locate
    if nccl_wheels.environment_include_dir() is not None:
        yield
        return
    try:
        inc = nccl_wheels.include_dir(nccl_wheels.OLDEST)
    except nccl_wheels.FetchError as e:
        warnings.warn(f"no NCCL headers in this environment, and {e}; tests that compile NCCL code "
                      "will fail (set EP_NCCL_INCLUDE_DIR to an NCCL >= 2.28 include dir)")
        yield
        return
    patch = pytest.MonkeyPatch()
    patch.setenv("EP_NCCL_INCLUDE_DIR", str(inc))
    locate.clear_cache()
    yield
    patch.undo()
    locate.clear_cache()
