"""Fixtures of the GPU suite (run on a CUDA machine by tools/device_suite.sh)."""
import os
import tempfile

import pytest
import torch

# Emulated ranks need these before CUDA initialises (deep_ep/emulated.py): set here, so that
# `pytest tests/gpu` works without them in the environment.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


@pytest.fixture(scope="session")
def nccl_group():
    """A one-rank NCCL process group on GPU 0: torch's own communicator, as a user's job has."""
    import torch.distributed as dist
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="deep_ep_store_"), "store"), 1)
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
