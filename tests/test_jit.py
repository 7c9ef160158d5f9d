"""Tests of deep_ep.jit that run without a GPU (NVRTC compiles; nothing is launched).

Run: ``python3 -m pytest -q tests/test_jit.py``. The NCCL tests compile against NCCL 2.28.9's and
2.32.3's headers and against the environment's: a release the environment does not have is
downloaded once (200 to 300 MB) and only its headers kept, in ``~/.cache/deep_ep/test-nccl`` (or
``EP_TEST_NCCL_CACHE``; see tests/nccl_wheels.py); those tests skip if the download fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deep_ep import envs, jit  # noqa: E402
from deep_ep.jit import locate, nccl_headers  # noqa: E402

import nccl_wheels  # noqa: E402

KERNELS = Path(__file__).resolve().parent / "jit_kernels"
OLDEST_NCCL, NEWEST_NCCL = nccl_wheels.OLDEST, nccl_wheels.NEWEST

SIMPLE = r"""
#include <cuda/std/cstdint>
extern "C" __global__ void axpy(float* y, const float* x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i] * SCALE;
}
"""


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """One JIT cache per test session (so the first NCCL build is cold), fresh in-memory caches."""
    root = tmp_path_factory.getbasetemp() / "jit-cache"
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(root))
    for var in ("EP_JIT_USE_NVCC", "EP_JIT_CHECK_SPILLS", "EP_JIT_DUMP_DIR", "EP_JIT_LINEINFO"):
        for name in envs.names(var):      # DeepEP's names for it too
            monkeypatch.delenv(name, raising=False)
    jit.clear_memory_cache()
    jit.reset_stats()
    yield root


def _fetched(version: str) -> Path:
    try:
        return nccl_wheels.include_dir(version)
    except nccl_wheels.FetchError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def oldest_nccl_include():
    """Include dir of NCCL 2.28.9's headers (the environment's, or fetched into the test cache)."""
    return _fetched(OLDEST_NCCL)


@pytest.fixture(scope="session")
def newest_nccl_include():
    """Include dir of the newest NCCL release's headers (the environment's, or fetched)."""
    return _fetched(NEWEST_NCCL)


def _nccl_include(version: str, request) -> Path:
    """Include dir for a parametrized NCCL case: a release, or "environment" (what the JIT finds
    by itself; tests/conftest.py supplies 2.28.9 when the environment has none)."""
    if version == "environment":
        return locate.nccl_include_dir()
    return request.getfixturevalue("oldest_nccl_include" if version == OLDEST_NCCL else "newest_nccl_include")


# ---------------------------------------------------------------------------------------------
# Basics


@pytest.mark.skipif(torch.cuda.is_available(), reason="the device's arch comes first where torch sees a GPU")
def test_an_arch_nvrtc_lacks_is_named_before_any_compile(monkeypatch):
    """An arch this NVRTC cannot compile for (from EP_JIT_ARCH where torch sees no GPU, or passed)
    raises JitEnvironmentError naming it, where it came from and the archs NVRTC has, before any
    source is dumped or compiled; the archs it has build."""
    from deep_ep.jit import compiler
    assert 90 in compiler.nvrtc_archs() and 70 not in compiler.nvrtc_archs()
    monkeypatch.setenv("EP_JIT_ARCH", "sm_70")
    before = jit.stats()["builds"]
    with pytest.raises(jit.JitEnvironmentError, match=r"cannot compile for sm_70 \(EP_JIT_ARCH\); it compiles "
                                                      r"for sm_75, .*sm_90.*Set EP_JIT_ARCH"):
        jit.build("axpy_old_arch", SIMPLE, defines={"SCALE": "1.0f"})
    with pytest.raises(jit.JitEnvironmentError, match=r"sm_1000 \(passed to jit.build\)"):
        jit.build("axpy_old_arch", SIMPLE, defines={"SCALE": "1.0f"}, arch="1000")
    assert jit.stats()["builds"] == before
    assert not list(Path(os.environ["EP_JIT_CACHE_DIR"]).glob("sources/axpy_old_arch-*"))
    monkeypatch.setenv("EP_JIT_ARCH", "sm_90a")
    assert jit.build("axpy_new_arch", SIMPLE, defines={"SCALE": "1.0f"}).arch == "sm_90a"


def test_simple_kernel_compiles_and_reports(capsys):
    mod = jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"})
    assert mod.cubin[:4] == b"\x7fELF"
    assert mod.kernel_names() == ["axpy"]
    assert mod.registers["axpy"] > 0
    assert mod.spills["axpy"] == (0, 0, 0)
    assert (mod.cache_path / "kernel.cubin").read_bytes() == mod.cubin
    assert mod.arch == "sm_90" and "-arch=sm_90" in mod.options and "-std=c++17" in mod.options
    assert "--use_fast_math" not in mod.options
    f = mod.function("axpy")
    with pytest.raises(KeyError):
        mod.function("nope")
    s = jit.stats()
    assert s["builds"] == 1 and s["compile_seconds"] > 0
    jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"})
    assert jit.stats()["memory_hits"] == 1
    # Different defines or arch -> different key.
    assert jit.build("axpy", SIMPLE, defines={"SCALE": "2.0f"}).key != mod.key
    assert jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"}, arch="sm_90a").key != mod.key
    if jit.cuda_device_count() == 0:
        import torch
        with pytest.raises(RuntimeError, match="no CUDA device"):
            f.launch(1, 32, (torch.empty(0), None, 1.0, 0))


def test_launch_without_gpu_is_clear_error():
    if jit.cuda_device_count():
        pytest.skip("a GPU is present")
    mod = jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"})
    with pytest.raises(jit.LaunchError, match="no CUDA device"):
        mod.function("axpy").launch(1, 1, (None, None, 1.0, 0))


def test_compile_error_carries_log_and_source(tmp_path):
    bad = 'extern "C" __global__ void broken(int* p) { p[0] = undefined_identifier; }\n'
    with pytest.raises(jit.CompileError) as info:
        jit.build("broken", bad)
    err = info.value
    assert "undefined_identifier" in err.log
    assert err.source_path and Path(err.source_path).exists()
    assert "undefined_identifier" in Path(err.source_path).read_text()
    assert err.source_path in str(err)


def test_spill_check_fails_big_local_array():
    src = r"""
    extern "C" __global__ void local_array(int* out, int i) {
      int a[512];
      for (int j = 0; j < 512; ++j) a[j] = out[j] * j;
      out[0] = a[i & 511];
    }
    """
    mod = jit.build("local_array", src)  # fine without the check
    assert mod.spills["local_array"][2] > 0
    with pytest.raises(jit.SpillError, match="local memory"):
        jit.build("local_array", src, check_spills=True)
    # Environment switch too, and a clean kernel passes.
    jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"}, check_spills=True)


def test_arg_marshalling_layout():
    """Packing of launch arguments, checked without a GPU through the internal packer."""
    import ctypes
    import struct

    import torch
    from deep_ep.jit.args import _Plan, pack_args

    class Pair(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int32), ("b", ctypes.c_int64)]

    t = torch.arange(4, dtype=torch.int32)
    empty = torch.empty(0)
    args = (t, empty, None, 7, -2.5, True, jit.u32(2**32 - 1), jit.i64(-5), jit.u64(2**64 - 1), jit.ptr(0x1000),
            jit.f32(0.5), Pair(3, 4), b"\x01\x02\x03")
    plan = _Plan(args)
    buf, table = pack_args(plan, args)
    base = ctypes.addressof(buf)
    ptrs = struct.unpack_from(f"={len(args)}Q", buf, table - base)
    raw = bytes(buf)

    def at(i, fmt):
        return struct.unpack_from("=" + fmt, raw, ptrs[i] - base)[0]

    assert at(0, "Q") == t.data_ptr()
    assert at(1, "Q") == empty.data_ptr()
    assert at(2, "Q") == 0
    assert at(3, "i") == 7
    assert at(4, "f") == -2.5
    assert at(5, "i") == 1
    assert at(6, "I") == 2**32 - 1
    assert at(7, "q") == -5
    assert at(8, "Q") == 2**64 - 1
    assert at(9, "Q") == 0x1000
    assert at(10, "f") == 0.5
    assert raw[ptrs[11] - base: ptrs[11] - base + 16] == bytes(Pair(3, 4))
    assert (ptrs[11] - base) % 16 == 0
    assert raw[ptrs[12] - base: ptrs[12] - base + 3] == b"\x01\x02\x03"
    with pytest.raises(OverflowError):
        pack_args(_Plan((2**31,)), (2**31,))
    with pytest.raises(OverflowError):
        jit.u32(-1)
    with pytest.raises(TypeError):
        _Plan(("string",))


def test_launch_overhead_with_fake_driver(monkeypatch):
    """CPU time of the launch path (argument packing + bookkeeping) with a fake cuLaunchKernel."""
    import torch
    from deep_ep.cuda import driver as cuda_driver
    from deep_ep.jit import runtime

    calls = []

    class FakeDriver:
        @staticmethod
        def cuLaunchKernel(*a):
            calls.append(a)
            return (0,)

    mod = jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"})
    f = mod.function("axpy")
    f._handles[0] = object()
    monkeypatch.setattr(cuda_driver, "_driver", FakeDriver)
    monkeypatch.setattr(runtime, "enter_context", lambda device: None)
    monkeypatch.setattr(runtime, "_resolve_stream", lambda stream: (0, 0))
    y, x = torch.zeros(1024), torch.ones(1024)
    args = (y, x, 2.0, 1024)
    f.launch(4, 256, args)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        f.launch(4, 256, args)
    us = (time.perf_counter() - t0) / n * 1e6
    print(f"\nlaunch path CPU time (fake driver): {us:.2f} us/launch")
    assert len(calls) == n + 1
    assert calls[-1][1:8] == (4, 1, 1, 256, 1, 1, 0)   # (timings are reported, never asserted)


# ---------------------------------------------------------------------------------------------
# NCCL device API under NVRTC


@pytest.mark.parametrize("version", [OLDEST_NCCL, NEWEST_NCCL, "environment"])
def test_nccl_device_api_kernel_compiles(version, request):
    """The NCCL device API probe and the library's own NCCL module (the device-communicator layout
    probe of deep_ep.comm.devcomm) compile against each release's headers; the second build is a disk
    hit."""
    inc = _nccl_include(version, request)
    found = jit.nccl_header_version(inc)
    if version == "environment":
        if found in (nccl_wheels.version_code(OLDEST_NCCL), nccl_wheels.version_code(NEWEST_NCCL)):
            pytest.skip(f"the environment's NCCL ({found}) is one of the releases compiled above")
    else:
        assert found == nccl_wheels.version_code(version)
    from deep_ep.comm.devcomm import PROBE_SOURCE
    probe = jit.build("deep_ep_devcomm_probe", PROBE_SOURCE, use_nccl=True, nccl_include_dir=inc)
    assert probe.cubin[:4] == b"\x7fELF"
    src = (KERNELS / "nccl_device_api.cu").read_text()
    # the probe may already be on disk (other tests of the session share the cache): count from here
    builds, disk_hits = jit.stats()["builds"], jit.stats()["disk_hits"]
    t0 = time.perf_counter()
    mod = jit.build("nccl_device_api", src, use_nccl=True, nccl_include_dir=inc)
    cold = time.perf_counter() - t0
    assert mod.kernel_names() == ["nccl_device_api_probe"]
    assert jit.stats()["builds"] == builds + 1
    # Second build, disk path (in-memory cache cleared): a cache hit.
    jit.clear_memory_cache()
    t0 = time.perf_counter()
    again = jit.build("nccl_device_api", src, use_nccl=True, nccl_include_dir=inc)
    hit = time.perf_counter() - t0
    assert again.key == mod.key and again.cubin == mod.cubin
    assert jit.stats()["disk_hits"] == disk_hits + 1 and jit.stats()["builds"] == builds + 1
    # Shown with `pytest -rP` (or -s), not in the quiet output.
    print(f"\nNCCL {found}: cold NVRTC build {cold * 1e3:.0f} ms, disk-cache hit {hit * 1e3:.1f} ms, "
          f"info {mod.info}")


def test_disk_cache_hit_in_fresh_process(tmp_path):
    """A fresh interpreter finds the entry the first one wrote (reports the build() time of the hit)."""
    env = dict(os.environ, EP_JIT_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    code = textwrap.dedent(f"""
        import json, time, sys
        sys.path.insert(0, {str(ROOT)!r})
        from deep_ep import jit
        src = open({str(KERNELS / 'nccl_device_api.cu')!r}).read()
        t = time.perf_counter(); m = jit.build("nccl_device_api", src, use_nccl=True)
        print(json.dumps(dict(jit.stats(), t=time.perf_counter() - t, key=m.key)))
    """)
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["builds"] == 1 and runs[1]["builds"] == 0 and runs[1]["disk_hits"] == 1
    assert runs[0]["key"] == runs[1]["key"]
    print(f"\nfresh process: first build() {runs[0]['t'] * 1e3:.0f} ms, cache-hit build() {runs[1]['t'] * 1e3:.0f} ms "
          "(includes first-call setup: torch/NVRTC imports)")


def test_a_copied_cache_serves_a_copied_package(tmp_path):
    """The cache a job filled, copied elsewhere, serves the package installed elsewhere (docs/jit.md,
    "Shipping a warm cache"): no key depends on a path. One of the GPU backend's own modules is
    built by the package at its place with cache A, then looked up by a copy of the package with a
    copy of A."""
    import shutil
    code = textwrap.dedent("""
        import json, sys
        from deep_ep import jit
        from deep_ep.backends.gpu import modules
        key, mod = modules.build_module("barrier", (), transport_nccl=False)
        print(json.dumps(dict(jit.stats(), key=mod.key, file=jit.__file__)))
    """)

    def run(package_parent: Path, cache: Path) -> dict:
        env = dict(os.environ, EP_JIT_CACHE_DIR=str(cache), PYTHONPATH=str(package_parent), EP_JIT_ARCH="sm_90")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                             cwd=str(tmp_path))
        return json.loads(out.stdout.splitlines()[-1])

    first = run(ROOT, tmp_path / "cache-a")
    moved = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "deep_ep", moved / "deep_ep", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(tmp_path / "cache-a", tmp_path / "cache-b")
    second = run(moved, tmp_path / "cache-b")
    assert second["file"].startswith(str(moved)) and not first["file"].startswith(str(moved))
    assert first["builds"] == 1 and second["builds"] == 0 and second["disk_hits"] == 1
    assert first["key"] == second["key"]


def test_nccl_version_mismatch_is_clear_error(monkeypatch, newest_nccl_include):
    from deep_ep.jit import builder
    monkeypatch.setattr(builder, "loaded_nccl_version", lambda: 22809)
    with pytest.raises(jit.NcclVersionMismatch) as info:
        jit.build("nccl_device_api", (KERNELS / "nccl_device_api.cu").read_text(), use_nccl=True,
                  nccl_include_dir=newest_nccl_include)
    msg = str(info.value)
    assert "2.32.3" in msg and "2.28.9" in msg and "nvidia-nccl-cu" in msg and "EP_NCCL_INCLUDE_DIR" in msg


def test_loaded_nccl_version_none_without_libnccl():
    v = jit.loaded_nccl_version()
    maps = Path("/proc/self/maps").read_text()
    if "libnccl" not in maps:
        assert v is None
    else:
        assert isinstance(v, int) and v > 20000


def test_patched_headers_live_in_cache_not_repo(_cache_dir, oldest_nccl_include):
    patched, shims, digest, report = nccl_headers.prepare(oldest_nccl_include, _cache_dir)
    assert str(patched).startswith(str(_cache_dir)) and (shims / "stdint.h").exists()
    for sub in ("deep_ep", "tests", "docs"):  # the package and the tracked trees hold no NCCL copy
        assert not list((ROOT / sub).rglob("nccl_device.h"))
    # Report of what was patched in 2.28.9 (see docs/jit.md).
    joined = json.dumps(report)
    assert "if constexpr" in joined and "trailing __attribute__" in joined and "__host__" in joined


# ---------------------------------------------------------------------------------------------
# Cache key and robustness


def test_header_content_changes_key(tmp_path):
    inc = tmp_path / "inc"
    (inc / "mylib").mkdir(parents=True)
    hdr = inc / "mylib" / "value.h"
    hdr.write_text("#define MYVALUE 1\n")
    src = '#include <mylib/value.h>\nextern "C" __global__ void k(int* o) { o[0] = MYVALUE; }\n'
    a = jit.build("hdr", src, include_dirs=(inc,))
    hdr.write_text("#define MYVALUE 2\n")
    jit.clear_memory_cache()
    b = jit.build("hdr", src, include_dirs=(inc,))
    assert a.key != b.key and a.cubin != b.cubin
    # Same for the deep_ep include tree: a header added under it changes the key.
    jit.clear_memory_cache()
    deep_ep_inc = locate.deep_ep_include_dir() / "deep_ep"
    probe = deep_ep_inc / f"_jit_test_probe_{os.getpid()}.cuh"
    try:
        probe.write_text("// probe\n")
        c = jit.build("hdr", src, include_dirs=(inc,))
    finally:
        probe.unlink()
    assert c.key != b.key


def test_corrupt_entry_is_rebuilt():
    mod = jit.build("axpy", SIMPLE, defines={"SCALE": "3.0f"})
    cubin = mod.cache_path / "kernel.cubin"
    cubin.write_bytes(cubin.read_bytes()[:100])  # truncate
    jit.clear_memory_cache()
    jit.reset_stats()
    again = jit.build("axpy", SIMPLE, defines={"SCALE": "3.0f"})
    assert jit.stats()["builds"] == 1 and jit.stats()["disk_hits"] == 0
    assert again.cubin == mod.cubin and cubin.read_bytes() == mod.cubin
    # Corrupt metadata too.
    (mod.cache_path / "meta.json").write_text("{not json")
    jit.clear_memory_cache()
    jit.build("axpy", SIMPLE, defines={"SCALE": "3.0f"})
    assert jit.stats()["builds"] == 2
    json.loads((mod.cache_path / "meta.json").read_text())


def test_concurrent_processes_one_entry(tmp_path):
    cache = tmp_path / "cache"
    env = dict(os.environ, EP_JIT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    src = SIMPLE.replace("axpy", "axpy_concurrent")
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from deep_ep import jit
        m = jit.build("concurrent", {src!r}, defines={{"SCALE": "1.0f"}})
        print(json.dumps(dict(jit.stats(), key=m.key, n=len(m.cubin))))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    res = [json.loads(o[0].splitlines()[-1]) for o in outs]
    assert len({r["key"] for r in res}) == 1
    assert sum(r["builds"] for r in res) == 1 and sum(r["disk_hits"] for r in res) == 3
    entries = [p for p in (cache / "kernels").rglob("meta.json")]
    assert len(entries) == 1
    leftovers = [p for p in (cache / "kernels").rglob("*") if ".tmp-" in p.name or ".bad-" in p.name]
    assert not leftovers
    from deep_ep.jit.cache import DiskCache
    assert DiskCache(cache).load(res[0]["key"]) is not None


def test_missing_nvrtc_override_names_package(monkeypatch, tmp_path):
    monkeypatch.setenv("EP_NCCL_INCLUDE_DIR", str(tmp_path))
    locate.clear_cache()
    try:
        with pytest.raises(jit.JitEnvironmentError, match="EP_NCCL_INCLUDE_DIR"):
            locate.nccl_include_dir()
    finally:
        monkeypatch.delenv("EP_NCCL_INCLUDE_DIR")
        locate.clear_cache()
    assert "nvidia-nccl-cu" in locate.package_hint("nccl")
    assert "nvidia-cuda-nvrtc" in locate.package_hint("nvrtc")


@pytest.mark.skipif(not locate.find_tool("nvcc"), reason="nvcc not installed")
def test_nvcc_backend(monkeypatch):
    monkeypatch.setenv("EP_JIT_USE_NVCC", "1")
    mod = jit.build("axpy_nvcc", SIMPLE, defines={"SCALE": "1.0f"})
    assert mod.kernel_names() == ["axpy"] and mod.cubin[:4] == b"\x7fELF"
    assert mod.info["axpy"]["registers"] > 0


def test_dump_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("EP_JIT_DUMP_DIR", str(tmp_path))
    jit.build("axpy_dump", SIMPLE, defines={"SCALE": "4.0f"})
    names = {p.suffix for p in tmp_path.iterdir()}
    assert {".cu", ".ptx", ".cubin", ".log"} <= names


# ---------------------------------------------------------------------------------------------
# Struct layouts: NVRTC (patched headers) vs nvcc (original headers)

_LAYOUT_FILES = ("nccl_device/impl/core__types.h", "nccl_device/impl/comm__types.h",
                 "nccl_device/gin/proxy/gin_proxy_device_host_common.h",
                 "nccl_device/gin/gdaki/gin_gdaki_device_host_common.h",
                 "nccl_device/gin/gdaki/doca_gpunetio/common/doca_gpunetio_verbs_dev.h",
                 "nccl_device/gin/gdaki/doca_gpunetio/common/doca_gpunetio_verbs_def.h",
                 "nccl_device/gin/gin_device_host_common.h")
# Structs whose every plain member's offset is checked (others: size and alignment).
_OFFSET_STRUCTS = ("ncclDevComm", "ncclWindow_vidmem", "doca_gpu_dev_verbs_qp", "doca_gpu_dev_verbs_wqe",
                   "doca_gpu_dev_verbs_cq", "ncclGinGdakiGPUContext", "ncclGinProxyGpuCtx_t")


def _layout_items(inc: Path) -> list[str]:
    """C++ constant expressions (sizeof/alignof/offsetof) over NCCL's GIN / device structs."""
    items = []
    for rel in _LAYOUT_FILES:
        path = inc / rel
        if not path.exists():
            continue
        text = nccl_headers._mask_comments_and_strings(path.read_text())
        names = re.findall(r"^(?:typedef\s+)?struct\s+(?:__attribute__\s*\(\(.*?\)\)\s*)*(\w+)\s*\{", text, re.M)
        names += re.findall(r"^\}\s*(?:__attribute__\s*\(\(.*?\)\)\s*)*(\w+_t)\s*;", text, re.M)
        for name in names:
            if re.search(rf"template\s*<[^>]*>\s*struct\s+{name}\b", text):
                continue
            t = name if name.endswith("_t") else f"struct {name}"
            items += [f"sizeof({t})", f"alignof({t})"]
            if name in _OFFSET_STRUCTS:
                items += [f"offsetof({t}, {m})" for m in _plain_members(text, name)]
    return list(dict.fromkeys(items))


def _plain_members(text: str, name: str) -> list[str]:
    m = re.search(rf"struct\s+(?:__attribute__\s*\(\(.*?\)\)\s*)*{name}\s*\{{", text) or \
        re.search(rf"\{{([^{{}}]*)\}}\s*{name}\s*;", text)
    if m is None:
        return []
    if m.re.pattern.startswith("struct"):
        start, depth, i = m.end(), 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        body = text[start:i - 1]
    else:
        body = m.group(1)
    out, depth = [], 0
    for stmt in re.split(r";", body):
        depth_before = depth
        depth += stmt.count("{") - stmt.count("}")
        if depth_before or "{" in stmt or "}" in stmt or "(" in stmt or re.search(r"[^:]:[^:]", stmt) \
                or stmt.strip().startswith("#") or "#" in stmt:
            continue
        for decl in stmt.split(","):
            mm = re.search(r"(\w+)\s*(\[[^\]]*\])?\s*$", decl.strip())
            if mm and len(stmt.split()) >= 2:
                out.append(mm.group(1))
    return out


def _nvcc_layout(inc: Path, items: list[str], tmp: Path) -> dict[str, int]:
    """Values of ``items`` as nvcc's *device* compilation sees them (original headers).

    Each value is read back from an error message: ``Show<(expr)>`` names an incomplete class
    template, so nvcc reports ``incomplete type "Show<24ULL>"`` on the item's line. Nothing runs.
    """
    head = "#include <cstddef>\n#include <nccl_device.h>\ntemplate <unsigned long long V> struct Show;\n" \
           "__device__ void layout_probe() {\n"
    first = head.count("\n") + 1
    src = head + "".join(f"  Show<(unsigned long long)({e})> v{i};\n" for i, e in enumerate(items)) + "}\n"
    (tmp / "layout.cu").write_text(src)
    nvcc = locate.find_tool("nvcc")
    proc = subprocess.run([nvcc, "-cubin", "-std=c++17", "-arch=sm_90", "-Xcudafe", "--error_limit=100000",
                           f"-I{inc}", "-o", os.devnull, str(tmp / "layout.cu")], capture_output=True, text=True)
    found = {int(m.group(1)) - first: int(m.group(2))
             for m in re.finditer(r"layout\.cu\((\d+)\): error: incomplete type \"Show<(\d+)ULL>\"", proc.stderr)}
    missing = [items[i] for i in range(len(items)) if i not in found]
    assert not missing, f"nvcc gave no value for {missing[:10]}:\n{proc.stderr[-3000:]}"
    return {items[i]: found[i] for i in range(len(items))}


def _nvrtc_layout(inc: Path, items: list[str], tmp: Path, monkeypatch) -> dict[str, int]:
    """Values of ``items`` under NVRTC with the patched headers, read back from the PTX.

    NVRTC has no ``__builtin_offsetof`` (CCCL's NVRTC ``offsetof`` is not a constant expression),
    so instead of static_asserts the probe kernel stores each value to ``out[i]``; ptxas-free PTX
    shows them as ``mov.u64 %rdN, VALUE`` + ``st.global.u64 [%rdM+8*i], %rdN``.
    """
    src = "#include <nccl_device.h>\nextern \"C\" __global__ void layout_probe(unsigned long long* out) {\n" + \
        "".join(f"  out[{i}] = (unsigned long long)({e});\n" for i, e in enumerate(items)) + "}\n"
    dump = tmp / "dump"
    monkeypatch.setenv("EP_JIT_DUMP_DIR", str(dump))
    jit.build("nccl_layout", src, use_nccl=True, nccl_include_dir=inc)
    ptx = next(dump.glob("nccl_layout-*.ptx")).read_text()
    regs = {m.group(1): int(m.group(2)) for m in re.finditer(r"mov\.[ub]64\s+(%rd\d+),\s*(\d+);", ptx)}
    vals = {}
    for m in re.finditer(r"st\.global\.[ub]64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|\d+);", ptx):
        off = int(m.group(1) or 0)
        vals[off // 8] = regs[m.group(2)] if m.group(2).startswith("%") else int(m.group(2))
    assert len(vals) == len(items), f"could not read {len(items) - len(vals)} values from the PTX"
    return {items[i]: vals[i] for i in range(len(items))}


@pytest.mark.skipif(not locate.find_tool("nvcc"), reason="nvcc not installed: no reference layout")
@pytest.mark.parametrize("version", [OLDEST_NCCL, NEWEST_NCCL])
def test_struct_layouts_match_nvcc(version, request, tmp_path, monkeypatch):
    inc = _nccl_include(version, request)
    items = _layout_items(inc)
    assert any("ncclGinProxyGfd_t" in i for i in items) and any("doca_gpu_dev_verbs_qp" in i for i in items)
    assert any(i.startswith("offsetof(struct ncclDevComm") for i in items)
    expected = _nvcc_layout(inc, items, tmp_path)
    got = _nvrtc_layout(inc, items, tmp_path, monkeypatch)
    diff = {e: (got[e], v) for e, v in expected.items() if got[e] != v}
    assert not diff, f"NCCL {version}: NVRTC vs nvcc layout differences (nvrtc, nvcc): {diff}"
    print(f"\nNCCL {version}: {len(expected)} sizeof/alignof/offsetof values under NVRTC match nvcc, e.g. "
          f"sizeof(ncclDevComm)={expected['sizeof(struct ncclDevComm)']}, "
          f"sizeof(ncclGinProxyGfd_t)={expected['sizeof(ncclGinProxyGfd_t)']}")


def _fake_context_driver(state: dict):
    """Base class of a fake CUDA driver whose current context is ``state["current"]``."""
    class Driver:
        @staticmethod
        def cuCtxGetCurrent():
            return 0, state["current"]

        @staticmethod
        def cuCtxSetCurrent(ctx):
            state["current"] = int(ctx)
            return (0,)
    return Driver


def test_launch_restores_the_callers_context(monkeypatch):
    """A launch (plain or prepared) on another device's context restores the caller's afterwards,
    also when the launch fails; nothing is switched when the right context is already current
    (fake driver: records the current context at each launch)."""
    import ctypes

    from deep_ep.cuda import driver as cuda_driver
    from deep_ep.jit import runtime

    state = {"current": 1, "launched_in": [], "fail": False}

    class FakeDriver(_fake_context_driver(state)):
        @staticmethod
        def cuLaunchKernel(*a):
            state["launched_in"].append(state["current"])
            return (1 if state["fail"] else 0,)

    mod = jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"})
    f = mod.function("axpy")
    f._handles[0] = object()
    monkeypatch.setattr(cuda_driver, "_driver", FakeDriver)
    monkeypatch.setattr(cuda_driver, "primary_context", lambda device: 100 + device)
    monkeypatch.setattr(runtime, "_resolve_stream", lambda stream: (0, 0))
    monkeypatch.setattr(runtime, "_err_name", lambda err: f"error {int(err)}")
    f.launch(1, 32, (None, None, 1.0, 0), stream=0)
    assert state["launched_in"] == [100] and state["current"] == 1   # device 0's context, then back
    prepared = runtime.PreparedLaunch(f, object(), 0, 1, 32, (ctypes.c_int(1),))
    prepared.launch(0)
    assert state["launched_in"][-1] == 100 and state["current"] == 1
    state["fail"] = True
    with pytest.raises(jit.LaunchError):
        prepared.launch(0)
    with pytest.raises(jit.LaunchError):
        f.launch(1, 32, (None, None, 1.0, 0), stream=0)
    assert state["current"] == 1
    state["current"], state["fail"] = 100, False    # already current: no switch at all
    monkeypatch.setattr(FakeDriver, "cuCtxSetCurrent", staticmethod(lambda ctx: pytest.fail("switched")))
    prepared.launch(0)
    assert state["current"] == 100


def test_prepared_cooperative_launch(monkeypatch):
    """`Function.prepare(..., cooperative=True)` and `Function.launch(..., cooperative=True)` (no
    cluster) launch through cuLaunchCooperativeKernel with the same grid, block and parameters; a
    refusal (grid too large to be resident at once) is a LaunchError naming the launch kind (fake
    driver)."""
    import ctypes

    from deep_ep.cuda import driver as cuda_driver
    from deep_ep.jit import runtime

    state = {"current": 100, "plain": [], "coop": [], "refuse": False}

    class FakeDriver(_fake_context_driver(state)):
        @staticmethod
        def cuLaunchKernel(h, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            state["plain"].append((gx, bx, smem, stream, params))
            return (0,)

        @staticmethod
        def cuLaunchCooperativeKernel(h, gx, gy, gz, bx, by, bz, smem, stream, params):
            state["coop"].append((gx, bx, smem, stream, params))
            return (720 if state["refuse"] else 0,)

        class CUfunction_attribute:
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = "max dynamic"

        @staticmethod
        def cuFuncSetAttribute(h, attribute, value):
            state["limits"].append((attribute, value))
            return (0,)

    state["limits"] = []
    mod = jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"})
    f = mod.function("axpy")
    f._handles[0] = object()
    monkeypatch.setattr(cuda_driver, "_driver", FakeDriver)
    monkeypatch.setattr(cuda_driver, "primary_context", lambda device: 100 + device)
    monkeypatch.setattr(runtime, "_err_name", lambda err: f"error {int(err)}")
    coop = f.prepare(132, 512, (ctypes.c_int(1),), device=0, cooperative=True)
    coop.launch(7)
    assert state["plain"] == [] and state["coop"][0][:4] == (132, 512, 0, 7)
    assert state["coop"][0][4] == ctypes.addressof(coop._table)
    f.prepare(132, 512, (ctypes.c_int(1),), device=0).launch(7)
    assert len(state["plain"]) == 1 and len(state["coop"]) == 1
    # dynamic shared memory and a grid given at launch (the notify kernel's: both vary with the call)
    sized = f.prepare(8, 32, (ctypes.c_int(1),), device=0, cooperative=True, smem=1028)
    sized.launch(5, grid=3)
    sized.launch(5)
    assert state["coop"][-2][:4] == (3, 32, 1028, 5) and state["coop"][-1][:4] == (8, 32, 1028, 5)
    # The function's limit follows the largest dynamic shared memory asked for, also below 48 KB (with
    # static shared memory, 40 KB dynamic can be over the 48 KB a block gets without opting in), once.
    f.prepare(8, 32, (ctypes.c_int(1),), device=0, smem=40 * 1024, cooperative=True).launch(5)
    f.prepare(8, 32, (ctypes.c_int(1),), device=0, smem=40 * 1024)
    f.prepare(8, 32, (ctypes.c_int(1),), device=0, smem=1028)
    assert state["limits"] == [("max dynamic", 1028), ("max dynamic", 40 * 1024)]
    sized.update(0, ctypes.c_int(42))       # in place: the launch table still points at the argument
    assert sized.args[0].value == 42 and sized._table[0] == ctypes.addressof(sized.args[0])
    with pytest.raises(TypeError):
        sized.update(0, ctypes.c_int64(1))
    # Function.launch(cooperative=True) without a cluster: the same entry point, the packed table
    monkeypatch.setattr(runtime, "_resolve_stream", lambda stream: (0, stream))
    f.launch(66, 256, (None, None, 1.0, 0), stream=9, cooperative=True)
    assert len(state["plain"]) == 1 and state["coop"][-1][:4] == (66, 256, 0, 9)
    assert isinstance(state["coop"][-1][4], int) and state["coop"][-1][4] != 0
    state["refuse"] = True
    with pytest.raises(jit.LaunchError, match="cooperative=True"):
        coop.launch(7)
    with pytest.raises(jit.LaunchError, match="cooperative=True"):
        f.launch(66, 256, (None, None, 1.0, 0), stream=9, cooperative=True)


def test_backend_rewords_a_refused_cooperative_launch():
    """The GPU backend turns the driver's COOPERATIVE_LAUNCH_TOO_LARGE into a LaunchError that names
    the rank, the kernel and the `num_sms` to lower, and marks the buffer unusable (it is out of step
    with its peers); other launch errors pass through unchanged."""
    from types import SimpleNamespace

    from deep_ep.backends.gpu import GPUBackend

    class Refused:
        function = SimpleNamespace(name="deep_ep_cached_dispatch_impl_with_dispatch_copy_epilogue_impl")

        def __init__(self, message):
            self.message = message

        def launch(self, hstream):
            raise jit.LaunchError(self.message)

    fake = SimpleNamespace(rank=3, comm_handle=0, launch_stream=0, calls=7, broken=None, transport_gin=False,
                           call_record=SimpleNamespace(launched_call=0))
    with pytest.raises(jit.LaunchError, match="^launch failed: CUDA_ERROR_INVALID_VALUE$"):
        GPUBackend.launch_data(fake, Refused("launch failed: CUDA_ERROR_INVALID_VALUE"), 132)
    assert fake.broken is None
    with pytest.raises(jit.LaunchError, match=r"rank 3: .* all 132 blocks of deep_ep_cached_dispatch_impl_with_dispatch_copy_epilogue_impl .* "
                                              r"no longer be used .* smaller num_sms"):
        GPUBackend.launch_data(fake, Refused("... (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: too many blocks)"), 132)
    assert fake.broken == "cooperative launch refused"   # later calls raise before launching anything


def test_kernel_names_from_the_cubin_without_ptxas_info():
    """A module whose compiler log named no kernel lists them from the cubin's entry symbols (its
    loads and handles then cover every kernel)."""
    from deep_ep.jit.runtime import Module
    mod = jit.build("axpy", SIMPLE, defines={"SCALE": "1.0f"})
    assert Module(mod.name, mod.cubin, mod.key, None, {}).kernel_names() == ["axpy"]
    assert Module("junk", b"not an image", "key", None, {}).kernel_names() == []


def test_a_sass_dump_without_a_disassembler_warns_once(monkeypatch, tmp_path):
    """EP_JIT_DUMP_DIR with neither cuobjdump nor nvdisasm found: the other dumps are written and a
    RuntimeWarning says why there is no .sass, once per process."""
    from deep_ep.jit import dumps
    monkeypatch.setattr(locate, "find_tool", lambda name: None)
    monkeypatch.setattr(dumps, "_warned", set())
    monkeypatch.setenv("EP_JIT_DUMP_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="no .sass dump .*neither cuobjdump nor nvdisasm was found"):
        jit.build("axpy_dumped", SIMPLE, defines={"SCALE": "5.0f"})
    assert {p.suffix for p in tmp_path.iterdir()} == {".cu", ".ptx", ".cubin", ".log"}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jit.build("axpy_dumped", SIMPLE, defines={"SCALE": "6.0f"})
