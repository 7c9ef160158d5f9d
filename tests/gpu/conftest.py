"""Fixtures of the GPU suite (run on a CUDA machine by tools/device_suite.sh)."""
import os

import pytest
import torch

# Emulated ranks need these before CUDA initialises (deep_ep/emulated.py): set here, so that
# `pytest tests/gpu` works without them in the environment.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


def pytest_collection_modifyitems(config, items):
    """Every test of this folder needs a CUDA device: skipped without one (a file that forgets its own
    skip mark is covered too)."""
    if torch.cuda.is_available():
        return
    mark = pytest.mark.skip(reason="needs a CUDA device")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if os.path.abspath(str(item.path)).startswith(here + os.sep):
            item.add_marker(mark)


def pytest_runtest_logreport(report):
    """With ``DEEP_EP_FAIL_LOG`` set (tools/device_suite.sh sets it), each failure's report is appended
    to that file the moment it happens: a device run whose time runs out still brings back why the
    tests before it failed (pytest prints them only at the end)."""
    path = os.environ.get("DEEP_EP_FAIL_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(scope="session")
def nccl_group():
    """A one-rank NCCL process group on GPU 0: torch's own communicator, as a user's job has."""
    from deep_ep.bench.gpu_timing import single_rank_nccl_group
    yield single_rank_nccl_group(torch.device("cuda", 0))
