"""Every test under tests/gpu/ asks only for fixtures that exist or arguments it is parametrized with.

Those files are skipped on machines without a GPU, CI's included, before pytest resolves fixtures:
a test asking for an unknown one would fail at setup on the GPU machine only, in device time.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
GPU_TESTS = sorted((TESTS / "gpu").glob("test_*.py"))
BUILTIN_FIXTURES = {"request", "monkeypatch", "tmp_path", "tmp_path_factory", "capsys", "capfd", "caplog", "recwarn",
                    "pytestconfig"}


def _load(path: Path):
    for folder in (str(TESTS), str(path.parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"_gpu_signature_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _is_fixture(obj) -> bool:
    from _pytest.fixtures import FixtureFunctionDefinition
    return isinstance(obj, FixtureFunctionDefinition)


def _fixtures(*modules) -> set:
    return {name for module in modules for name, obj in vars(module).items() if _is_fixture(obj)}


def _parametrized(func) -> set:
    names = set()
    for mark in getattr(func, "pytestmark", []):
        if mark.name == "parametrize":
            argnames = mark.args[0]
            names.update(part.strip() for part in argnames.split(",")) if isinstance(argnames, str) \
                else names.update(argnames)
    return names


def test_the_gpu_test_files_are_found():
    assert len(GPU_TESTS) >= 20


@pytest.mark.parametrize("path", GPU_TESTS, ids=lambda p: p.name)
def test_every_gpu_test_argument_is_a_fixture_or_a_parameter(path):
    conftests = [_load(TESTS / "conftest.py"), _load(TESTS / "gpu" / "conftest.py")]
    module = _load(path)
    known = BUILTIN_FIXTURES | _fixtures(module, *conftests)
    unknown = {}
    for name, func in vars(module).items():
        if name.startswith("test_") and inspect.isfunction(func):
            missing = set(inspect.signature(func).parameters) - known - _parametrized(func)
            if missing:
                unknown[name] = sorted(missing)
    assert not unknown, f"{path.name}: arguments that are neither fixtures nor parameters: {unknown}"
