"""Faults in the JIT's disk cache (compile only, no GPU): every build ends in a valid kernel or a
clear error. Extends tests/test_jit.py (which covers a truncated cubin, unparsable meta.json and 4
racing processes) with: damaged entries of every kind, foreign files and directories in the cache,
a cache that cannot be written (a real non-writable directory, and a read-only cache holding valid
entries), and 8 processes racing to build the same kernel.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deep_ep import envs, jit  # noqa: E402
from deep_ep.jit.cache import DiskCache  # noqa: E402
from proc_utils import communicate_all  # noqa: E402

SRC = r"""
extern "C" __global__ void faults_kernel(float* y, const float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * SCALE;
}
"""
NCCL_SRC = (ROOT / "tests" / "jit_kernels" / "nccl_device_api.cu").read_text()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(root))
    for var in ("EP_JIT_USE_NVCC", "EP_JIT_CHECK_SPILLS", "EP_JIT_DUMP_DIR", "EP_JIT_LINEINFO"):
        for name in envs.names(var):      # DeepEP's names for it too
            monkeypatch.delenv(name, raising=False)
    jit.clear_memory_cache()
    jit.reset_stats()
    from deep_ep.jit import builder
    builder._warned_roots.clear()
    yield root
    jit.clear_memory_cache()


def _build(scale="2.0f"):
    return jit.build("faults", SRC, defines={"SCALE": scale})


def _valid(mod) -> bool:
    return b"faults_kernel" in mod.cubin and mod.cubin[:4] == b"\x7fELF" and "faults_kernel" in mod.kernel_names()


def _rebuild():
    jit.clear_memory_cache()
    jit.reset_stats()
    return _build()


# ---------------------------------------------------------------------------- damaged entries
DAMAGE = {
    "cubin truncated to 0 bytes": lambda e: (e / "kernel.cubin").write_bytes(b""),
    "cubin one bit flipped (same size)": lambda e: (e / "kernel.cubin").write_bytes(
        bytes([(e / "kernel.cubin").read_bytes()[0] ^ 1]) + (e / "kernel.cubin").read_bytes()[1:]),
    "cubin missing": lambda e: (e / "kernel.cubin").unlink(),
    "cubin is a directory": lambda e: ((e / "kernel.cubin").unlink(), (e / "kernel.cubin").mkdir()),
    "meta.json empty": lambda e: (e / "meta.json").write_text(""),
    "meta.json is a JSON list": lambda e: (e / "meta.json").write_text("[1, 2]"),
    "meta.json wrong checksum": lambda e: (e / "meta.json").write_text(json.dumps(
        dict(json.loads((e / "meta.json").read_text()), cubin_sha256="0" * 64))),
    "meta.json of another key": lambda e: (e / "meta.json").write_text(json.dumps(
        dict(json.loads((e / "meta.json").read_text()), key="f" * 64))),
    "meta.json binary garbage": lambda e: (e / "meta.json").write_bytes(os.urandom(300)),
    "entry is a file": lambda e: (shutil.rmtree(e), e.write_bytes(b"not a directory")),
    "entry is empty": lambda e: (shutil.rmtree(e), e.mkdir()),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_entry_is_rebuilt(damage):
    good = _build()
    entry = good.cache_path
    DAMAGE[damage](entry)
    again = _rebuild()
    assert jit.stats()["builds"] == 1 and again.cubin == good.cubin and _valid(again)
    assert DiskCache(entry.parents[2]).load(good.key) is not None      # healed on disk
    leftovers = [p.name for p in entry.parent.iterdir() if ".tmp-" in p.name or ".bad-" in p.name]
    assert not leftovers
    hit = _rebuild()                                                   # and now a plain disk hit
    assert jit.stats() == dict(jit.stats(), builds=0, disk_hits=1) and hit.cubin == good.cubin


def test_foreign_files_and_directories_are_ignored(cache):
    good = _build()
    k2 = good.cache_path.parent
    junk = {cache / "README", cache / "kernels" / "zz" / "notakey", k2 / ".stale.tmp-abc" / "kernel.cubin",
            k2 / "unrelated.bin", cache / "nccl" / "garbage" / "x.h", cache / "sources" / "y.cu"}
    for p in junk:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(64))
    (cache / "kernels" / "emptydir").mkdir()
    (Path(str(good.cache_path) + ".lock")).write_bytes(os.urandom(32))   # a lock file with garbage
    hit = _rebuild()
    assert jit.stats()["disk_hits"] == 1 and hit.cubin == good.cubin
    other = jit.build("faults", SRC, defines={"SCALE": "5.0f"})          # a new build next to the junk
    assert _valid(other) and jit.stats()["builds"] == 1
    assert all(p.exists() for p in junk)                               # nothing foreign was deleted


def test_file_in_place_of_a_cache_directory_builds_in_memory(cache):
    """A file where the cache needs a directory: the kernel is built in memory, with a warning."""
    good = _build()
    shutil.rmtree(good.cache_path.parent)
    good.cache_path.parent.write_text("a file where a directory belongs")
    jit.clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="not writable.*EP_JIT_CACHE_DIR"):
        mod = _build()
    assert _valid(mod) and mod.cubin == good.cubin and mod.cache_path is None


# ---------------------------------------------------------------------------- unwritable cache
_UNWRITABLE = textwrap.dedent("""
    import json, sys, warnings
    sys.path.insert(0, {root!r})
    warnings.simplefilter("always")
    from deep_ep import jit
    m = jit.build("faults", {src!r}, defines={{"SCALE": "1.0f"}})
    n = jit.build("nccl_device_api", {nccl!r}, use_nccl=True)
    print(json.dumps(dict(jit.stats(), path=str(m.cache_path), n=len(m.cubin), nccl=len(n.cubin),
                          kernels=m.kernel_names())))
""")


def _sysfs_dir():
    """A directory even root cannot create (sysfs), or None where this machine lets us."""
    path = Path("/sys/deep_ep_jit_cache_probe")
    try:
        path.mkdir()
    except OSError:
        return path / "cache"
    path.rmdir()
    return None


def test_unwritable_cache_directory_builds_in_memory(tmp_path):
    """A real OS-level non-writable cache root (under /sys: root cannot create it either)."""
    root = _sysfs_dir()
    if root is None:
        pytest.skip("no non-writable directory available on this machine")
    env = dict(os.environ, EP_JIT_CACHE_DIR=str(root), PYTHONPATH=str(ROOT))
    code = _UNWRITABLE.format(root=str(ROOT), src=SRC, nccl=NCCL_SRC)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.splitlines()[-1])
    assert res["builds"] == 2 and res["path"] == "None" and res["n"] > 0 and res["nccl"] > 0
    assert res["kernels"] == ["faults_kernel"]
    assert f"the kernel cache {root} is not writable" in proc.stderr and "Traceback" not in proc.stderr


def _read_only(monkeypatch, root: Path):
    """Make every write under ``root`` fail with EROFS, the way a read-only mount does (chmod does
    not stop root, and this machine cannot mount)."""
    root = str(root)

    def guard(path):
        if str(os.path.abspath(os.fspath(path))).startswith(root):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    real_open, real_mkdir, real_mkdtemp = os.open, os.mkdir, __import__("tempfile").mkdtemp

    def fake_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            guard(path)
        return real_open(path, flags, *a, **k)

    def fake_mkdir(path, *a, **k):
        if not os.path.isdir(path):
            guard(path)
        return real_mkdir(path, *a, **k)

    def fake_mkdtemp(*a, dir=None, **k):
        if dir is not None:
            guard(dir)
        return real_mkdtemp(*a, dir=dir, **k)

    real_builtin_open = open

    def fake_builtin_open(file, mode="r", *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            guard(file)
        return real_builtin_open(file, mode, *a, **k)

    monkeypatch.setattr("builtins.open", fake_builtin_open)
    monkeypatch.setattr("io.open", fake_builtin_open)
    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr("tempfile.mkdtemp", fake_mkdtemp)


def test_read_only_cache_with_entries(cache, monkeypatch):
    """A read-only cache still serves its valid entries; a kernel it lacks is built in memory."""
    good = _build()
    _read_only(monkeypatch, cache)
    with pytest.raises(OSError):          # the guard works
        (cache / "probe").write_text("x")
    hit = _rebuild()
    assert jit.stats()["disk_hits"] == 1 and hit.cubin == good.cubin
    with pytest.warns(RuntimeWarning, match="not writable"):
        new = jit.build("faults", SRC, defines={"SCALE": "7.0f"})
    assert _valid(new) and new.cache_path is None and jit.stats()["builds"] == 1
    with warnings.catch_warnings():       # warned once per cache root
        warnings.simplefilter("error")
        jit.build("faults", SRC, defines={"SCALE": "8.0f"})


def test_compile_error_in_unwritable_cache_is_still_clear(cache, monkeypatch):
    _read_only(monkeypatch, cache)
    with pytest.warns(RuntimeWarning, match="not writable"), pytest.raises(jit.CompileError) as info:
        jit.build("broken", 'extern "C" __global__ void k() { this is not C++; }')
    assert "broken" in str(info.value) and Path(info.value.source_path).exists()
    # kept after the process exits (the private scratch directory is removed then)
    from deep_ep.jit import dumps
    assert Path(info.value.source_path).parent == dumps.kept_sources_dir()


# ---------------------------------------------------------------------------- 8 racing processes
_RACE = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {root!r})
    from deep_ep import jit
    time.sleep(max(0.0, {start} - time.time()))      # start together
    m = jit.build("race", {src!r}, defines={{"SCALE": "3.0f"}})
    print(json.dumps(dict(jit.stats(), key=m.key, sha=__import__("hashlib").sha256(m.cubin).hexdigest())))
""")


def test_eight_processes_race_to_build(cache):
    import time
    (cache / "kernels").mkdir(parents=True)
    (cache / "kernels" / "junk").write_text("foreign")          # with junk in the cache, too
    env = dict(os.environ, EP_JIT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    code = _RACE.format(root=str(ROOT), src=SRC.replace("faults_kernel", "race_kernel"), start=time.time() + 4)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = communicate_all(procs, 180, "a racing build hung")
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    res = [json.loads(o[0].splitlines()[-1]) for o in outs]
    assert len({r["key"] for r in res}) == 1 and len({r["sha"] for r in res}) == 1
    assert sum(r["builds"] for r in res) == 1 and sum(r["disk_hits"] for r in res) == 7
    assert len(list((cache / "kernels").rglob("meta.json"))) == 1
    assert not [p for p in (cache / "kernels").rglob("*") if ".tmp-" in p.name or ".bad-" in p.name]
    assert DiskCache(cache).load(res[0]["key"]) is not None
