"""Reading initialised device globals out of a cubin (an ELF64 image), without a GPU.

A kernel module can carry constants computed by the compiler, e.g. ``sizeof`` and ``offsetof`` of
third-party structs under exactly the headers it was built with: declare them as
``extern "C" __device__ const`` arrays with initialisers, and `symbol_bytes` returns their bytes.
Used by `deep_ep.comm.devcomm` to lay out NCCL's device-communicator structs for the loaded NCCL.
"""
from __future__ import annotations

import struct

__all__ = ["symbol_bytes", "function_names"]

_SHT_NOBITS = 8
_STO_CUDA_ENTRY = 0x10   # st_other of a kernel's symbol


def symbol_bytes(cubin: bytes, name: str) -> bytes:
    """The initial bytes of the global ``name`` in ``cubin``.

    A zero-initialised global (placed in a section without file bytes) reads as zeros.

    Raises:
        ValueError: not an ELF64 little-endian image, or no symbol of that name.
    """
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not an ELF64 little-endian image")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = []
    for i in range(shnum):
        off = shoff + i * shentsize
        sh_name, sh_type, _flags, _addr, sh_offset, sh_size, sh_link, _info, _align, sh_entsize = \
            struct.unpack_from("<IIQQQQIIQQ", cubin, off)
        sections.append((sh_name, sh_type, sh_offset, sh_size, sh_link, sh_entsize))
    for _n, sh_type, sh_offset, sh_size, sh_link, sh_entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh_link]
        for j in range(sh_size // (sh_entsize or 24)):
            st_name, _st_info, _st_other, st_shndx, st_value, st_size = \
                struct.unpack_from("<IBBHQQ", cubin, sh_offset + j * (sh_entsize or 24))
            start = strtab[2] + st_name
            sym = cubin[start:cubin.index(b"\0", start)].decode(errors="replace")
            if sym != name or st_shndx == 0 or st_shndx >= len(sections):
                continue
            target = sections[st_shndx]
            if target[1] == _SHT_NOBITS:  # zero-initialised (.bss-like): no bytes in the image
                return bytes(st_size)
            begin = target[2] + st_value
            return bytes(cubin[begin:begin + st_size])
    raise ValueError(f"no symbol {name!r} in the cubin")


def function_names(cubin: bytes, entries_only: bool = False) -> list:
    """Names of the function symbols (``STT_FUNC``) defined in ``cubin``, as stored (mangled for C++);
    with ``entries_only``, only the ``__global__`` entry points (``STO_CUDA_ENTRY`` set).

    Raises:
        ValueError: not an ELF64 little-endian image.
    """
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not an ELF64 little-endian image")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, _shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _n, sh_type, _flags, _addr, sh_offset, sh_size, sh_link, _info, _align, sh_entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab_offset = sections[sh_link][4]
        for j in range(sh_size // (sh_entsize or 24)):
            st_name, st_info, st_other, st_shndx, _value, _size = \
                struct.unpack_from("<IBBHQQ", cubin, sh_offset + j * (sh_entsize or 24))
            if st_info & 0xF != 2 or st_shndx == 0:   # STT_FUNC, defined here
                continue
            if entries_only and not st_other & _STO_CUDA_ENTRY:
                continue
            start = strtab_offset + st_name
            names.append(cubin[start:cubin.index(b"\0", start)].decode(errors="replace"))
    return names
