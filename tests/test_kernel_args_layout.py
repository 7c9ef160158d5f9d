"""The host mirrors of the kernels' by-value argument structs (ctypes, deep_ep/backends/gpu.py) must
have the device structs' layout, field for field: a mismatch would make every kernel read garbage.

Checked on the CPU: a probe kernel, compiled with NVRTC against the real headers, stores the size
and every field offset of the device struct; the values are read back from its PTX (NVRTC has no
constant-expression offsetof) and compared with the ctypes layout. Nothing runs."""
import ctypes
import re

import pytest

from deep_ep import jit
from deep_ep.backends import gpu


def _device_layout(cxx: str, fields: list, tmp_path, monkeypatch) -> list:
    """[sizeof, offset of each field] of ``cxx`` as the device compiler lays it out."""
    exprs = [f"sizeof({cxx})"] + [f"(reinterpret_cast<const char*>(&probe_obj.{f}) - "
                                  f"reinterpret_cast<const char*>(&probe_obj))" for f in fields]
    src = ("#include <deep_ep/entry.cuh>\n"
           f"__device__ {cxx} probe_obj;\n"
           'extern "C" __global__ void deep_ep_args_probe(unsigned long long* out) {\n' +
           "".join(f"    out[{i}] = (unsigned long long)({e});\n" for i, e in enumerate(exprs)) + "}\n")
    dump = tmp_path / "dump"
    monkeypatch.setenv("EP_JIT_DUMP_DIR", str(dump))
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "cache"))  # a cache hit dumps no PTX
    jit.build(f"deep_ep_args_probe_{cxx.split('::')[-1]}", src, defines={})
    ptx = next(dump.glob("deep_ep_args_probe_*.ptx")).read_text()
    regs = {m.group(1): int(m.group(2)) for m in re.finditer(r"mov\.[ub]64\s+(%rd\d+),\s*(\d+);", ptx)}
    vals = {}
    for m in re.finditer(r"st\.global\.[ub]64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|\d+);", ptx):
        vals[int(m.group(1) or 0) // 8] = regs[m.group(2)] if m.group(2).startswith("%") else int(m.group(2))
    assert len(vals) == len(exprs), f"could not read {len(exprs) - len(vals)} values from the PTX"
    return [vals[i] for i in range(len(exprs))]


@pytest.mark.parametrize("cls, cxx", [(gpu._DispatchArgs, "deep_ep::DispatchArgs"),
                                      (gpu._CombineArgs, "deep_ep::CombineArgs")],
                         ids=["DispatchArgs", "CombineArgs"])
def test_ctypes_mirror_matches_device_struct(cls, cxx, tmp_path, monkeypatch):
    fields = [name for name, _ in cls._fields_]
    device = _device_layout(cxx, fields, tmp_path, monkeypatch)
    host = [ctypes.sizeof(cls)] + [getattr(cls, f).offset for f in fields]
    assert device == host, "\n".join(f"{n}: device {d}, ctypes {h}" for n, d, h in
                                     zip(["sizeof"] + fields, device, host) if d != h)
