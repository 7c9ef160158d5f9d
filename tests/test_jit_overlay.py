"""``EP_JIT_INCLUDE_OVERLAY``: a copy of ``deep_ep/include`` whose headers shadow the package's.

NVRTC compiles on the CPU; nothing is launched. The overlay is searched first, its content is part
of the cache key (a build against it never shares an entry with a plain build), and a directory
without a ``deep_ep`` folder is refused.
"""
from __future__ import annotations

import shutil

import pytest

from deep_ep import jit
from deep_ep.jit import locate

SOURCE = '#include <deep_ep/common/abi.cuh>\nextern "C" __global__ void max_ranks(int* out) { out[0] = deep_ep::kMaxRanks; }\n'


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EP_JIT_INCLUDE_OVERLAY", raising=False)
    for var in ("EP_JIT_USE_NVCC", "EP_JIT_CHECK_SPILLS", "EP_JIT_DUMP_DIR", "EP_JIT_LINEINFO"):
        monkeypatch.delenv(var, raising=False)
    jit.clear_memory_cache()
    jit.reset_stats()
    yield
    jit.clear_memory_cache()


def _copy_of_the_tree(tmp_path):
    overlay = tmp_path / "overlay"
    shutil.copytree(locate.deep_ep_include_dir(), overlay)
    return overlay


def test_overlay_headers_shadow_the_package_and_key_the_cache(tmp_path, monkeypatch):
    plain = jit.build("overlay_probe", SOURCE)
    overlay = _copy_of_the_tree(tmp_path)
    monkeypatch.setenv("EP_JIT_INCLUDE_OVERLAY", str(overlay))
    same_content = jit.build("overlay_probe", SOURCE)
    # an unchanged copy compiles to the same code, under a key of its own
    assert same_content.key != plain.key and same_content.cubin == plain.cubin
    options = jit.compile_options(arch="sm_90", defines=None, use_nccl=False)
    includes = [o for o in options if o.startswith("-I")]
    assert includes[:2] == [f"-I{overlay.resolve()}", f"-I{locate.deep_ep_include_dir()}"]

    abi = overlay / "deep_ep" / "common" / "abi.cuh"
    text = abi.read_text()
    assert text.count("constexpr int kMaxRanks = 1024;") == 1
    abi.write_text(text.replace("constexpr int kMaxRanks = 1024;", "constexpr int kMaxRanks = 4096;"))
    jit.clear_memory_cache()
    patched = jit.build("overlay_probe", SOURCE)
    assert patched.key not in (plain.key, same_content.key) and patched.cubin != plain.cubin

    monkeypatch.delenv("EP_JIT_INCLUDE_OVERLAY")
    jit.clear_memory_cache()
    jit.reset_stats()
    again = jit.build("overlay_probe", SOURCE)
    assert again.key == plain.key and again.cubin == plain.cubin and jit.stats()["disk_hits"] == 1


def test_overlay_without_a_deep_ep_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("EP_JIT_INCLUDE_OVERLAY", str(tmp_path / "empty"))
    with pytest.raises(locate.JitEnvironmentError, match="EP_JIT_INCLUDE_OVERLAY"):
        jit.build("overlay_probe", SOURCE)
