"""The JIT's disk cache.

Layout (``root`` = ``EP_JIT_CACHE_DIR``, default ``~/.cache/deep_ep/jit``)::

    root/kernels/<key[:2]>/<key>/kernel.cubin   the image
    root/kernels/<key[:2]>/<key>/meta.json      name, kernels, ptxas info, sha256 and size of the cubin
    root/kernels/<key[:2]>/<key>.lock           filelock serialising builders of one key
    root/nccl/<digest>/                         patched NCCL headers + shims (see nccl_headers.py)

An entry is written in a temporary directory next to its final place and renamed into place
(``os.replace``), so readers see a whole entry or none. ``meta.json`` is written last and holds the
cubin's sha256: a truncated or corrupted cubin fails verification and is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from .. import envs

__all__ = ["cache_root", "DiskCache"]


def cache_root() -> Path:
    """``EP_JIT_CACHE_DIR`` if set, else ``~/.cache/deep_ep/jit`` (created on demand)."""
    return Path(envs.get("EP_JIT_CACHE_DIR")).expanduser()


class DiskCache:
    """Content-addressed store of compiled cubins.

    Args:
        root: cache root directory (created if missing).
    """

    META = "meta.json"
    CUBIN = "kernel.cubin"

    def __init__(self, root: Path):
        self.root = Path(root)

    def entry_dir(self, key: str) -> Path:
        """Directory of the entry for ``key`` (may not exist)."""
        return self.root / "kernels" / key[:2] / key

    def lock(self, key: str) -> FileLock:
        """An inter-process lock for building ``key``."""
        d = self.entry_dir(key)
        d.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(d) + ".lock")

    def load(self, key: str) -> tuple[bytes, dict] | None:
        """Return ``(cubin, meta)`` of a valid entry, or None if absent or invalid.

        Invalid entries (missing files, bad JSON, wrong size or sha256) are treated as absent;
        :meth:`store` replaces them.
        """
        d = self.entry_dir(key)
        try:
            meta = json.loads((d / self.META).read_text())
            cubin = (d / self.CUBIN).read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict):  # valid JSON of another shape (a foreign or damaged file)
            return None
        if meta.get("key") != key or meta.get("cubin_size") != len(cubin) \
                or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
            return None
        return cubin, meta

    def store(self, key: str, cubin: bytes, meta: dict) -> Path:
        """Write an entry atomically; returns its directory.

        If a valid entry already exists (another process won the race) it is kept. An invalid
        one is moved aside and removed before the rename.
        """
        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(meta, key=key, cubin_size=len(cubin), cubin_sha256=hashlib.sha256(cubin).hexdigest())
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.tmp-", dir=final.parent))
        try:
            with open(tmp / self.CUBIN, "wb") as f:
                f.write(cubin)
                f.flush()
                os.fsync(f.fileno())
            with open(tmp / self.META, "w") as f:
                json.dump(meta, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                if self.load(key) is not None:
                    return final
                trash = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.bad-", dir=final.parent))
                os.replace(final, trash / "entry")
                shutil.rmtree(trash, ignore_errors=True)
            try:
                os.replace(tmp, final)
            except OSError:  # lost a race to a concurrent writer: keep theirs if valid
                if self.load(key) is None:
                    raise
            return final
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
