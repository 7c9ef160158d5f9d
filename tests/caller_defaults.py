"""A caller's torch defaults around deep_ep's calls, as DeepEP's test harness sets them
(``torch.set_default_dtype(torch.bfloat16)``, ``torch.set_default_device('cuda')``) before it makes
an `ElasticBuffer`. Every tensor the library makes names its device and dtype, so its results must
not change under them.

The default dtype is process-wide; the default device is per thread (a torch function mode).
`caller_defaults` sets both in the calling thread, `default_device` the device alone (for threads,
such as emulated ranks, started inside a `caller_defaults` of the main thread). `UnderDefaults`
wraps a buffer so that every call of one of its methods runs under them, while the test's own
inputs and references are made under torch's usual defaults.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch


@contextlib.contextmanager
def default_device(device: Optional[str]):
    """``torch.set_default_device(device)`` in this thread for the block (nothing for None)."""
    if device is None:
        yield
        return
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None if previous.type == "cpu" else previous)


@contextlib.contextmanager
def caller_defaults(dtype: torch.dtype = torch.bfloat16, device: Optional[str] = None):
    """The default dtype (process-wide) and, in this thread, the default device for the block;
    both restored after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with default_device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


class UnderDefaults:
    """``buffer`` whose methods run under `caller_defaults` (``dtype``, ``device``); attributes that
    are not methods read through as they are."""

    def __init__(self, buffer, dtype: torch.dtype = torch.bfloat16, device: Optional[str] = None) -> None:
        self._wrapped = buffer
        self._dtype = dtype
        self._device = device

    def __getattr__(self, name: str):
        value = getattr(self._wrapped, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def call(*args, **kwargs):
            with caller_defaults(self._dtype, self._device):
                return value(*args, **kwargs)
        return call
