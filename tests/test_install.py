"""Installing deep-ep-nvrtc, or any extra of it, never changes the user's torch.

The failure this guards against: an extra that pinned nvidia-nccl-cu13 made pip replace the user's
torch by an older release whose CUDA wheels pin that same NCCL, without a word. Torch's CUDA wheels
pin their NCCL (and their CUDA libraries) to one release each, so any requirement of ours on those
packages can move torch.

How it is checked, and why this way. A real install is the plain test, but with a CUDA torch it
downloads gigabytes and takes minutes, and even with a CPU torch it takes about a minute (53 s on
the 2-core CI machine), a third of the rest of the suite. pip's own resolver answers the same
question without installing: ``pip install --dry-run --report`` prints what pip *would* install,
from package metadata (where the index serves metadata files; where it does not, pip downloads
the wheels to read theirs). So every run of the suite makes the cheap checks:

1. ``test_requirements_leave_torch_alone`` (offline): pyproject.toml's requirements pin no torch
   and name no NCCL package in any extra; the distribution has its own name.
2. ``test_install_keeps_this_environments_torch`` (package index, seconds): a dry run of the README's
   install, ``-e .[test]``, plus the GPU and plot extras, into the running environment: neither
   torch nor any CUDA package torch requires may be in the install set. That is the user's case
   exactly, for the torch this environment holds.
3. ``test_extras_resolve_beside_another_torch`` (package index, about 20 s): the same requirements
   resolved from scratch together with ``torch==V``, where V is the newest torch the index offers
   (its CUDA build pins an NCCL newer than 2.28.9, so an extra requiring NCCL 2.28.9 fails here):
   pip must find a solution that keeps V and the NCCL V pins. Older releases (2.11.0, which pins NCCL 2.28.9;
   2.8.0, a CUDA 12 build, with the ``cu12`` extra) run only with
   ``DEEP_EP_TEST_INSTALL_RELEASES=1``: on an index without metadata files each is a download of
   about a gigabyte.

and, with ``DEEP_EP_TEST_INSTALL=1`` (CI sets it, .ci/run: the one place that pays the minute),
the real thing:

4. ``test_real_install_keeps_torch``: a clean venv, a torch (``DEEP_EP_TEST_INSTALL_TORCH``, a pip
   requirement; default: this environment's torch release), then the README's
   ``pip install -e ".[test]"``; torch's version must be unchanged, and it must differ from the torch
   the test extra picks when none is installed (else the test could not tell anything). Then
   ``deep_ep`` imports from this checkout.

Tests that need the package index skip when it cannot be reached.
"""
from __future__ import annotations

import json
import os
import subprocess
import shutil
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DIST = "deep-ep-nvrtc"
REAL = os.environ.get("DEEP_EP_TEST_INSTALL") == "1"
RELEASES = os.environ.get("DEEP_EP_TEST_INSTALL_RELEASES") == "1"
ALL_EXTRAS = "test,cu13,plot"
_NETWORK_TROUBLE = ("Could not fetch URL", "Failed to establish a new connection", "Temporary failure in name",
                    "Network is unreachable", "ConnectTimeout", "Read timed out", "ProxyError",
                    "No matching distribution found for torch==")


def _pip(*args: str, python: str = sys.executable, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    """Fail with pip's error, or skip when the index cannot be reached."""
    if proc.returncode == 0:
        return
    lines = (proc.stderr or proc.stdout).splitlines()
    err = "\n".join(line for line in lines if not line.startswith("WARNING:"))[-3000:]
    if "ResolutionImpossible" not in err and any(s in err for s in _NETWORK_TROUBLE):
        pytest.skip(f"{what}: the package index cannot be reached or lacks a release:\n{err[-600:]}")
    pytest.fail(f"{what} failed (exit {proc.returncode}):\n{err}")


def _dry_run(tmp_path: Path, *requirements: str, scratch: bool, what: str, python: str = sys.executable) -> dict:
    """``{canonical name: (version, metadata)}`` of what ``pip install`` would install."""
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    args = ["install", "--dry-run", "-q", "--report", str(report)] + (["--ignore-installed"] if scratch else [])
    _check(_pip(*args, *requirements, python=python), what)
    return {canonicalize_name(i["metadata"]["name"]): (i["metadata"]["version"], i["metadata"])
            for i in json.loads(report.read_text())["install"]}


def _pins(meta: dict, name: str) -> str | None:
    """The version ``meta`` (a distribution's metadata) pins ``name`` to with ``==``, or None."""
    for line in meta.get("requires_dist", []):
        req = Requirement(line)
        if canonicalize_name(req.name) == name and (req.marker is None or req.marker.evaluate({"extra": ""})):
            exact = [s.version for s in req.specifier if s.operator == "=="]
            if exact:
                return exact[0]
    return None


def test_requirements_leave_torch_alone():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST
    reqs = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    reqs += [(extra, Requirement(r)) for extra, rs in project["optional-dependencies"].items() for r in rs]
    assert {"test", "cu13", "cu12", "plot"} <= set(project["optional-dependencies"])
    for where, req in reqs:
        name = canonicalize_name(req.name)
        assert not name.startswith("nvidia-nccl"), f"{where} requires {req}: it can move torch's NCCL, or torch"
        if name == "torch":
            assert where == "dependencies" and all(s.operator == ">=" for s in req.specifier), \
                f"{where} constrains torch beyond a lower bound: {req}"
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"{where} pins {req}"


def test_install_keeps_this_environments_torch(tmp_path):
    torch_version = metadata.version("torch")
    would = _dry_run(tmp_path, "-e", f".[{ALL_EXTRAS}]", scratch=False, what=f"dry run of -e .[{ALL_EXTRAS}]")
    assert DIST in would
    # torch and the CUDA stack torch itself requires (its NCCL above all) stay as they are.
    guarded = {"torch"}
    for line in metadata.requires("torch") or []:
        name = canonicalize_name(Requirement(line).name)
        if name.startswith(("nvidia-", "cuda-", "triton")):
            guarded.add(name)
    moved = {n: would[n][0] for n in guarded if n in would}
    assert not moved, f"installing .[{ALL_EXTRAS}] beside torch {torch_version} would install {moved}"


_OLDER = pytest.mark.skipif(not RELEASES, reason="about a gigabyte to download: DEEP_EP_TEST_INSTALL_RELEASES=1")
_RELEASES = [("newest", ALL_EXTRAS), pytest.param("2.11.0", ALL_EXTRAS, marks=_OLDER),
             pytest.param("2.8.0", "cu12,plot", marks=_OLDER)]


@pytest.mark.parametrize("release,extras", _RELEASES)
def test_extras_resolve_beside_another_torch(release, extras, tmp_path):
    if release == "newest":
        release = _dry_run(tmp_path, "--no-deps", "torch", scratch=True, what="finding the newest torch")["torch"][0]
    would = _dry_run(tmp_path, f"torch=={release}", "-e", f".[{extras}]", scratch=True,
                     what=f"resolving torch=={release} with .[{extras}]")
    version, torch_meta = would["torch"]
    assert version == release
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        pinned = _pins(torch_meta, name)
        if pinned is not None:
            assert would[name][0] == pinned, f"torch {release} pins {name}=={pinned}; .[{extras}] moved it"


@pytest.mark.skipif(not REAL, reason="a real install into a fresh venv takes minutes: DEEP_EP_TEST_INSTALL=1")
def test_real_install_keeps_torch(tmp_path):
    wanted = os.environ.get("DEEP_EP_TEST_INSTALL_TORCH", f"torch=={metadata.version('torch')}")
    otherwise = _dry_run(tmp_path, ".[test]", scratch=True, what="the torch .[test] picks alone")["torch"][0]
    venv = tmp_path / "venv"
    try:
        _real_install(venv, wanted, otherwise)
    finally:
        shutil.rmtree(venv, ignore_errors=True)   # about a gigabyte with torch


def _real_install(venv: Path, wanted: str, otherwise: str) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    _check(_pip("install", "-q", wanted, python=python), f"pip install {wanted}")

    def torch_version():
        return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                              text=True, check=True, timeout=300).stdout.strip()

    before = torch_version()
    if before == otherwise:
        pytest.skip(f"{wanted} is the torch .[test] picks anyway ({otherwise}); set DEEP_EP_TEST_INSTALL_TORCH "
                    "to another release")
    _check(_pip("install", "-q", "-e", ".[test]", python=python), 'pip install -e ".[test]"')
    assert torch_version() == before
    out = subprocess.run([python, "-c", "import deep_ep, importlib.metadata as m; "
                          f"print(deep_ep.__version__, m.version({DIST!r}), deep_ep.__file__)"],
                         capture_output=True, text=True, check=True, timeout=300, cwd=venv).stdout.split()
    assert out[0] == out[1] and Path(out[2]).is_relative_to(ROOT), out
