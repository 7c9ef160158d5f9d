"""deep_ep.emulated.ensure_cuda_settings: the CUDA settings emulated ranks need, set before CUDA
initialises and refused (with a clear message) once it is too late. Runs without a GPU."""
import pytest
import torch

from deep_ep import emulated


@pytest.fixture
def env(monkeypatch):
    # setenv first, so that monkeypatch restores the variables (unset ones too) after the test
    for name in ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_sets_both_before_cuda_initialises(env):
    import os
    env.setattr(torch.cuda, "is_initialized", lambda: False)
    emulated.ensure_cuda_settings(8)
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


def test_keeps_enough_connections(env):
    import os
    env.setattr(torch.cuda, "is_initialized", lambda: False)
    env.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    emulated.ensure_cuda_settings(2)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


def test_too_late_for_lazy_loading(env):
    env.setattr(torch.cuda, "is_initialized", lambda: True)
    env.setattr(emulated, "_eager_loading", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA_MODULE_LOADING=EAGER"):
        emulated.ensure_cuda_settings(2)


@pytest.mark.parametrize("value, ranks, ok", [(None, 3, True), (None, 4, False), ("16", 7, True),
                                              ("16", 8, False), ("32", 8, True), ("32", 16, True)])
def test_too_few_connections(env, value, ranks, ok):
    env.setattr(torch.cuda, "is_initialized", lambda: True)
    env.setenv("CUDA_MODULE_LOADING", "EAGER")
    if value is not None:
        env.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    if ok:
        emulated.ensure_cuda_settings(ranks)
    else:
        with pytest.raises(RuntimeError, match=f"{ranks} emulated ranks need CUDA_DEVICE_MAX_CONNECTIONS"):
            emulated.ensure_cuda_settings(ranks)

