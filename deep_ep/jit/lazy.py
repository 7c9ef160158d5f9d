"""A kernel built at its first use, for the small modules that have no build-time structure."""
from __future__ import annotations

import threading

from .builder import build

__all__ = ["LazyKernel"]


class LazyKernel:
    """One kernel of a module that has no build-time structure, built at its first use and kept for
    the process: ``LazyKernel(name, header, kernel)()`` returns the `Function` (thread-safe; later
    calls do no more than an attribute read, so hot paths may call it per launch)."""

    def __init__(self, module_name: str, header: str, kernel_name: str) -> None:
        self.module_name, self.header, self.kernel_name = module_name, header, kernel_name
        self._function = None
        self._lock = threading.Lock()

    def __call__(self):
        function = self._function
        if function is None:
            with self._lock:
                if self._function is None:
                    module = build(self.module_name, f"#include <{self.header}>\n")
                    self._function = module.function(self.kernel_name)
                function = self._function
        return function
