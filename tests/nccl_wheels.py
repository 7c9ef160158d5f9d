"""NCCL headers for the tests, kept in a cache outside the Python environment.

The tests compile NCCL device code with NVRTC against three NCCL releases besides the environment's
own: ``OLDEST`` (2.28.9, the first release with the device API, which torch 2.11's CUDA 13 wheels
ship and the GPU machine runs), ``TORCH_2_13`` (2.29.7, which torch 2.12's and 2.13's CUDA 13 wheels
pin) and ``NEWEST`` (2.32.3, the newest release the header compatibility layer was checked
against). Neither is installed into the environment: torch's CUDA wheels pin
nvidia-nccl-cu13 to one release, so requiring another one would make pip replace torch's NCCL, or
torch itself. Instead the wheel is downloaded once with ``pip download --no-deps`` and only its
``include`` tree (about 1 MB) is kept, in ``~/.cache/deep_ep/test-nccl/<version>`` (the root can be
moved with ``EP_TEST_NCCL_CACHE``); the wheel itself (200 to 300 MB) is deleted. When the environment
already has the wanted release, its own headers are used and nothing is downloaded.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from deep_ep import jit
from deep_ep.jit import locate

OLDEST = "2.28.9"
TORCH_2_13 = "2.29.7"
NEWEST = "2.32.3"

__all__ = ["OLDEST", "TORCH_2_13", "NEWEST", "FetchError", "cache_root", "version_code", "environment_include_dir",
           "include_dir"]


class FetchError(RuntimeError):
    """The wheel could not be downloaded or unpacked (the message carries pip's error)."""


def cache_root() -> Path:
    """Where the unpacked headers live: ``EP_TEST_NCCL_CACHE``, else ``~/.cache/deep_ep/test-nccl``."""
    return Path(os.environ.get("EP_TEST_NCCL_CACHE", Path.home() / ".cache" / "deep_ep" / "test-nccl"))


def version_code(version: str) -> int:
    """``"2.28.9"`` -> ``22809``, the form of ``NCCL_VERSION_CODE`` and ``jit.nccl_header_version``."""
    major, minor, patch = (int(p) for p in version.split("."))
    return major * 10000 + minor * 100 + patch


def environment_include_dir() -> Path | None:
    """The NCCL include dir the JIT finds in this environment (``EP_NCCL_INCLUDE_DIR``, the
    nvidia-nccl wheel torch brought, a CUDA toolkit), or None when there is none."""
    try:
        return locate.nccl_include_dir()
    except jit.JitEnvironmentError:
        return None


def include_dir(version: str) -> Path:
    """Include dir (holding ``nccl.h`` and ``nccl_device.h``) of nvidia-nccl-cu13 ``version``.

    Uses the environment's headers when they are that release, else the cache, else downloads the
    wheel into the cache. Safe when several test sessions fetch the same release at once.

    Raises:
        FetchError: the download or the unpacking failed (no network, no such release).
    """
    env = environment_include_dir()
    if env is not None and jit.nccl_header_version(env) == version_code(version):
        return env
    root = cache_root()
    inc = root / version / "nvidia" / "nccl" / "include"
    if (inc / "nccl_device.h").exists():
        return inc
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".fetch-{version}-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                               f"nvidia-nccl-cu13=={version}"], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob(f"nvidia_nccl_cu13-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise FetchError(f"could not download nvidia-nccl-cu13=={version}: "
                             f"{(proc.stderr or proc.stdout).strip()[-400:]}")
        unpacked = Path(tmp) / "unpacked"
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                z.extractall(unpacked, [n for n in z.namelist() if "/include/" in n])
        except (OSError, zipfile.BadZipFile) as e:
            raise FetchError(f"could not unpack {wheels[0].name}: {e}") from e
        try:
            os.replace(unpacked, root / version)
        except OSError:  # another session unpacked it first
            shutil.rmtree(unpacked, ignore_errors=True)
    if not (inc / "nccl_device.h").exists():
        raise FetchError(f"nvidia-nccl-cu13=={version} has no nvidia/nccl/include/nccl_device.h")
    return inc
