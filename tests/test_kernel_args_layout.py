"""The host mirrors of the kernels' by-value argument structs (ctypes, deep_ep/backends/gpu/abi.py and
deep_ep/comm/emulated.py) must have the device structs' layout, field for field: a mismatch would
make every kernel read garbage. The shared constants and layout words must parse from the one source.

Checked on the CPU: a probe module, compiled with NVRTC against the real headers, holds the size and
every field offset of the device struct in an initialised device array, read back from its cubin
(`deep_ep.jit.elf`). Nothing runs."""
import ctypes
import os
import re
import struct
from pathlib import Path

import pytest

from deep_ep import jit
from deep_ep.backends.gpu import abi
from deep_ep.backends.gpu.agrs import AgrsFlagArgs, AgrsWaitArgs
from deep_ep.backends.gpu.pp import PpArgs
from deep_ep.comm import devcomm
from deep_ep.comm.emulated import EmulatedTransportArgs
from deep_ep.jit.elf import symbol_bytes


def _device_layout(cxx: str, fields: list, header: str) -> list:
    """[sizeof, offset of each field] of ``cxx`` as the device compiler lays it out."""
    exprs = [f"sizeof({cxx})"] + [f"offsetof({cxx}, {f})" for f in fields]
    src = (f"#include <cuda/std/cstddef>\n#include <deep_ep/{header}>\n"
           'extern "C" __device__ const unsigned long long deep_ep_args_probe[] = {' + ", ".join(exprs) + "};\n")
    mod = jit.build(f"deep_ep_args_probe_{cxx.split('::')[-1]}", src, defines={})
    raw = symbol_bytes(mod.cubin, "deep_ep_args_probe")
    return list(struct.unpack(f"<{len(exprs)}Q", raw))


@pytest.mark.parametrize("cls, cxx, header", [
    (abi.NotifyArgs, "deep_ep::NotifyArgs", "impls/notify.cuh"),
    (abi.LayoutArgs, "deep_ep::LayoutArgs", "impls/layout.cuh"),
    (abi.DispatchArgs, "deep_ep::DispatchArgs", "impls/dispatch_args.cuh"),
    (abi.CombineArgs, "deep_ep::CombineArgs", "impls/combine_args.cuh"),
    (EmulatedTransportArgs, "deep_ep::comm::TransportArgs", "comm/transport.cuh"),
    (PpArgs, "deep_ep::PpArgs", "impls/pp.cuh"),
    (AgrsWaitArgs, "deep_ep::AgrsWaitArgs", "impls/agrs.cuh"),
    (AgrsFlagArgs, "deep_ep::AgrsFlagArgs", "impls/agrs.cuh"),
], ids=["NotifyArgs", "LayoutArgs", "DispatchArgs", "CombineArgs", "EmulatedTransportArgs", "PpArgs", "AgrsWaitArgs",
        "AgrsFlagArgs"])
def test_ctypes_mirror_matches_device_struct(cls, cxx, header):
    fields = [name for name, _ in cls._fields_]
    device = _device_layout(cxx, fields, header)
    host = [ctypes.sizeof(cls)] + [getattr(cls, f).offset for f in fields]
    assert device == host, "\n".join(f"{n}: device {d}, ctypes {h}" for n, d, h in
                                     zip(["sizeof"] + fields, device, host) if d != h)


def test_layout_words_match_the_device_index():
    """`abi.LayoutIndex` (parsed from EP_LAYOUT_WORDS) gives the device struct's offsets."""
    R, L, E = 5, 7, 35
    names = [n for n, _ in abi._LAYOUT_WORDS]
    src = ("#include <deep_ep/common/abi.cuh>\n"
           'extern "C" __device__ const unsigned long long deep_ep_layout_probe[] = {' +
           ", ".join(f"deep_ep::LayoutIndex({R}, {L}, {E}).{n}()" for n in names + ["size"]) + "};\n")
    mod = jit.build("deep_ep_layout_probe", src, defines={})
    raw = symbol_bytes(mod.cubin, "deep_ep_layout_probe")
    device = list(struct.unpack(f"<{len(names) + 1}Q", raw))
    ix = abi.LayoutIndex(R, L, E)
    assert device == [getattr(ix, n) for n in names] + [ix.size]
    assert names[:4] == ["num_out_rows", "num_tok_rows", "tok_prefix", "rank_prefix_sum"]
    assert ix.size == 2 + 3 * R + 4 * L + E
    cached = abi.layout_index(R, L, E)    # what a dispatch uses: the same offsets, made once per shape
    assert cached is abi.layout_index(R, L, E) and vars(cached) == vars(ix)


def test_shared_constants_parse_from_the_header():
    c = abi.CONSTANTS
    assert c["kMaxRanks"] == abi.MAX_RANKS == 1024 and c["kCtrlEpoch"] == c["kMaxRanks"]
    assert abi.CTRL_ERROR_OFFSET == (c["kMaxRanks"] + 4) * 4
    assert {c[f"kPhase{name}"] for name in ("Notify", "Dispatch", "Combine", "Barrier")} == {1, 2, 3, 4}
    assert abi.READBACK["seq"] == 0 and abi.READBACK["counts"] > max(v for k, v in abi.READBACK.items() if k != "counts")


def test_every_phase_is_defined_once_and_named():
    """Every kernel's phase codes live in common/abi.cuh, each code once, each with a name for timeout
    messages (a GIN put and a pp_send once shared code 16, and a PP error check read one as the other)."""
    c = abi.CONSTANTS
    phases = {name: value for name, value in c.items() if name.startswith("kPhase")}
    assert len(set(phases.values())) == len(phases) == len(abi.PHASES) == 13
    assert set(abi.PHASES) == set(phases.values()) and all(abi.PHASES.values())
    include = Path(abi.__file__).resolve().parents[2] / "include" / "deep_ep"
    elsewhere = [f"{path.name}: {m.group(1)}" for path in sorted(include.rglob("*.cuh")) if path.name != "abi.cuh"
                 for m in re.finditer(r"constexpr\s+int\s+(k\w*Phase\w*)\s*=", path.read_text())
                 if not m.group(1).startswith("kLl")]   # ll_direct's kLl*Phase* are launch modes, not waits
    # the GIN self-test kernel's phase is its own (a test of the transport, never a user's call)
    assert elsewhere == ["gin_selftest.cuh: kPhase"], elsewhere
    from deep_ep.backends.gpu import pp
    assert (pp._PHASE_SEND, pp._PHASE_RECV) == (c["kPhasePpSend"], c["kPhasePpRecv"])
    # error codes, likewise: one list, each code once
    errors = {name: value for name, value in c.items() if name.startswith("kErr")}
    assert sorted(errors.values()) == list(range(1, len(errors) + 1)) and pp._ERR_BYTE_COUNT == c["kErrPpByteCount"]
    assert not [f"{path.name}: {m.group(1)}" for path in include.rglob("*.cuh") if path.name != "abi.cuh"
                for m in re.finditer(r"constexpr\s+int\s+(kErr\w*)\s*=", path.read_text())]


def _nccl_header_dirs() -> list:
    """The NCCL headers the JIT uses, and the newest release's if the JIT tests fetched them."""
    dirs = [("installed", None)]
    newest = Path(os.environ.get("EP_TEST_NCCL_CACHE", Path.home() / ".cache" / "deep_ep" / "test-nccl"))
    for inc in sorted(newest.glob("*/nvidia/nccl/include")):
        dirs.append((inc.parts[-4], str(inc)))
    return dirs


@pytest.mark.parametrize("name, inc", _nccl_header_dirs(), ids=lambda v: v if isinstance(v, str) and "/" not in v else "")
def test_devcomm_layout_probe(name, inc, monkeypatch):
    """The device-communicator probe builds against every NCCL release the tests have headers of,
    and the layout it reads is sane: the window handle follows the ncclDevComm in TransportArgs, the
    requirement fields lie inside the struct, and 2.29+ carries NCCL's size/magic/version header."""
    from deep_ep.jit import builder
    monkeypatch.setattr(builder, "_check_nccl_versions", lambda *a: None)  # no libnccl is loaded here
    layout = devcomm._layout(inc)
    assert layout.devcomm_size > 0 and layout.window_offset >= layout.devcomm_size
    assert layout.transport_args_size == layout.window_offset + 8
    assert len(layout.requirements) == layout.requirements_size
    assert all(0 < off < layout.requirements_size for off in layout.offsets.values())
    if layout.version >= 22900:
        size, magic, ver = struct.unpack_from("<QII", layout.requirements)
        assert (size, magic, ver) == (layout.requirements_size, 0xCAFEBEEF, layout.version)
    else:
        assert layout.requirements == bytes(layout.requirements_size) and not layout.properties


def test_every_readback_word_the_host_reads_is_named_in_the_header():
    """The host reads the layout kernel's report by name (``READBACK["out_rows"]``): every name it uses
    is one the header's kReadback* constants give, at the header's index."""
    import re
    from pathlib import Path

    from deep_ep.backends.gpu.abi import CONSTANTS, READBACK

    src = "".join(p.read_text() for p in (Path(__file__).parents[1] / "deep_ep" / "backends" / "gpu").glob("*.py"))
    used = set(re.findall(r'READBACK\["(\w+)"\]', src))
    assert used and used <= set(READBACK), sorted(used - set(READBACK))
    assert READBACK["out_rows"] == CONSTANTS["kReadbackOutRows"]
    assert READBACK["tok_rows"] == CONSTANTS["kReadbackTokRows"]
