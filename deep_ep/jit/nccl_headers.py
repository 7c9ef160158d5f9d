"""NVRTC compatibility layer for NCCL's device headers (``nccl_device.h``, ``nccl_device/``).

NCCL's device headers are written for nvcc. Under NVRTC they need (measured with NCCL 2.28.9 and
2.32.3, see ``docs/jit.md``):

* **libc / C++ library shims.** NVRTC ships no C library headers and no C++ standard library.
  :data:`SHIMS` holds small replacements (``stdint.h``, ``linux/types.h``, ...). The C ones are
  plain typedefs and macros: NCCL includes some of them inside ``extern "C"`` blocks, so they must
  not pull C++ headers. The C++ ones (``cstdint``, ``type_traits``, ...) forward to CCCL's
  ``cuda/std`` equivalents and make them visible in ``std``.
* **``__host__`` declarations.** NCCL declares its host API with ``__host__``; NVRTC rejects host
  functions. The patched copies drop ``__host__`` and the build uses ``-default-device``.
* **``typeof``** (GNU, DOCA GPUNetIO headers; NVRTC knows neither ``typeof`` nor ``__typeof__``)
  becomes ``DEEP_EP_NVRTC_TYPEOF(x)`` = ``remove_reference<decltype((x))>`` from the
  ``deep_ep_nvrtc_compat.h`` shim, included at the top of each such header. DOCA >= 2.32's
  non-GNU fallback ``#define TYPEOF(x) decltype(x)`` (a reference for ``x = *p``) gets the same.
* **``__builtin_memcpy``** (2.32 GPI backend) becomes ``memcpy`` (an NVRTC builtin).
* **Zero-length arrays.** ``nccl::utility::loadConst`` (2.28) instantiates every branch of an
  ``if`` chain on ``alignof(T)``; for small ``T`` some declare ``part[0]``, which NVRTC rejects.
  The chain becomes ``if constexpr``.
* **Trailing attributes.** NVRTC ignores ``__attribute__((packed))`` / ``aligned`` written after
  a struct's closing brace (``struct {...} __attribute__((packed)) name;``), so sizes change. The
  patch moves every such attribute list next to the ``struct``/``union`` keyword.

Not patched: the EFA GDA GIN backend (2.29+, AWS EFA) uses GNU statement expressions and a
flexible array member that NVRTC rejects; builds define ``NCCL_GIN_EFA_GDA_ENABLE=0`` (see
``builder.compile_options``) unless the caller defines it.

The patched copy lives in the JIT cache under ``nccl/<sha256 of originals + PATCH_VERSION + shims>``,
written atomically; the repository never holds NCCL code.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

__all__ = ["SHIMS", "PATCH_VERSION", "patch_header_text", "prepare", "tree_digest", "nccl_header_version"]

#: Bump whenever the patching rules or the shims change: it is part of the patched tree's name.
PATCH_VERSION = 7

_C_SHIMS = {
    # Types and macros spelled exactly as CCCL's NVRTC branch of cuda/std/cstdint spells them, so
    # that both may be included in either order (identical typedefs and macro redefinitions).
    "stdint.h": """
#include <limits.h>
typedef signed char int8_t; typedef signed short int16_t; typedef signed int int32_t; typedef signed long long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int8_t int_fast8_t; typedef int16_t int_fast16_t; typedef int32_t int_fast32_t; typedef int64_t int_fast64_t;
typedef uint8_t uint_fast8_t; typedef uint16_t uint_fast16_t; typedef uint32_t uint_fast32_t; typedef uint64_t uint_fast64_t;
typedef int8_t int_least8_t; typedef int16_t int_least16_t; typedef int32_t int_least32_t; typedef int64_t int_least64_t;
typedef uint8_t uint_least8_t; typedef uint16_t uint_least16_t; typedef uint32_t uint_least32_t; typedef uint64_t uint_least64_t;
typedef int64_t intptr_t; typedef uint64_t uintptr_t; typedef int64_t intmax_t; typedef uint64_t uintmax_t;
#define INT8_MIN   SCHAR_MIN
#define INT16_MIN  SHRT_MIN
#define INT32_MIN  INT_MIN
#define INT64_MIN  LLONG_MIN
#define INT8_MAX   SCHAR_MAX
#define INT16_MAX  SHRT_MAX
#define INT32_MAX  INT_MAX
#define INT64_MAX  LLONG_MAX
#define UINT8_MAX  UCHAR_MAX
#define UINT16_MAX USHRT_MAX
#define UINT32_MAX UINT_MAX
#define UINT64_MAX ULLONG_MAX
#define INTPTR_MIN  INT64_MIN
#define INTPTR_MAX  INT64_MAX
#define UINTPTR_MAX UINT64_MAX
#define INTMAX_MIN  INT64_MIN
#define INTMAX_MAX  INT64_MAX
#define UINTMAX_MAX UINT64_MAX
#define PTRDIFF_MIN INT64_MIN
#define PTRDIFF_MAX INT64_MAX
#define SIZE_MAX UINT64_MAX
#define INT8_C(X)   ((::int_least8_t)(X))
#define INT16_C(X)  ((::int_least16_t)(X))
#define INT32_C(X)  ((::int_least32_t)(X))
#define INT64_C(X)  ((::int_least64_t)(X))
#define UINT8_C(X)  ((::uint_least8_t)(X))
#define UINT16_C(X) ((::uint_least16_t)(X))
#define UINT32_C(X) ((::uint_least32_t)(X))
#define UINT64_C(X) ((::uint_least64_t)(X))
""",
    "stddef.h": """
typedef unsigned long size_t; typedef long ptrdiff_t;
#ifndef NULL
#define NULL 0
#endif
#ifndef offsetof
#define offsetof(t, m) __builtin_offsetof(t, m)
#endif
""",
    "stdbool.h": """
#ifndef __cplusplus
#define bool _Bool
#define true 1
#define false 0
#endif
#define __bool_true_false_are_defined 1
""",
    # Spelled as CCCL's NVRTC branch of cuda/std/climits spells them (identical redefinitions).
    "limits.h": """
#define CHAR_BIT 8
#define SCHAR_MIN         (-128)
#define SCHAR_MAX         127
#define UCHAR_MAX         255
#define __CHAR_UNSIGNED__ ('\\xff' > 0) // CURSED
#if __CHAR_UNSIGNED__
#define CHAR_MIN 0
#define CHAR_MAX UCHAR_MAX
#else
#define CHAR_MIN SCHAR_MIN
#define CHAR_MAX SCHAR_MAX
#endif
#define SHRT_MIN  (-SHRT_MAX - 1)
#define SHRT_MAX  0x7fff
#define USHRT_MAX 0xffff
#define INT_MIN   (-INT_MAX - 1)
#define INT_MAX   0x7fffffff
#define UINT_MAX  0xffffffff
#define LONG_MIN  (-LONG_MAX - 1)
#ifdef __LP64__
#define LONG_MAX  LLONG_MAX
#define ULONG_MAX ULLONG_MAX
#else
#define LONG_MAX  INT_MAX
#define ULONG_MAX UINT_MAX
#endif
#define LLONG_MIN  (-LLONG_MAX - 1)
#define LLONG_MAX  0x7fffffffffffffffLL
#define ULLONG_MAX 0xffffffffffffffffUL
""",
    "stdlib.h": "#include <stddef.h>\n",
    "stdio.h": "#include <stddef.h>\n",  # NVRTC declares device printf itself
    "string.h": "#include <stddef.h>\n",  # NVRTC provides memcpy/memset as builtins
    "math.h": "",
    "errno.h": "#define EPERM 1\n#define ENOENT 2\n#define EIO 5\n#define EAGAIN 11\n#define ENOMEM 12\n"
               "#define EBUSY 16\n#define EINVAL 22\n#define ENOSPC 28\n#define ETIMEDOUT 110\n",
    "assert.h": "#ifndef assert\n#define assert(e) ((void)0)\n#endif\n",
    "linux/types.h": """
typedef unsigned char __u8; typedef unsigned short __u16; typedef unsigned int __u32; typedef unsigned long long __u64;
typedef signed char __s8; typedef short __s16; typedef int __s32; typedef long long __s64;
typedef __u16 __be16; typedef __u32 __be32; typedef __u64 __be64;
typedef __u16 __le16; typedef __u32 __le32; typedef __u64 __le64;
""",
}

# C++ library headers: forward to CCCL and expose its names in std (qualified lookup follows the
# using-directive). Only included outside extern "C" blocks.
_CXX_FORWARD = {
    "cstdint": "cuda/std/cstdint", "cstddef": "cuda/std/cstddef", "type_traits": "cuda/std/type_traits",
    "utility": "cuda/std/utility", "limits": "cuda/std/limits", "algorithm": None,
    "cassert": "cuda/std/cassert", "cstring": "cuda/std/cstring", "new": None,
}


def _cxx_shim(name: str, target: str | None) -> str:
    body = []
    if name == "algorithm":
        body.append("#include <cuda/std/__algorithm/min.h>\n#include <cuda/std/__algorithm/max.h>")
    elif name == "new":
        # Placement new is a builtin declaration in NVRTC; nothing to add.
        body.append("#include <cuda/std/cstddef>")
    else:
        body.append(f"#include <{target}>")
    body.append("namespace std { using namespace ::cuda::std; }")
    return "\n".join(body) + "\n"


def _build_shims() -> dict[str, str]:
    out = {}
    for name, text in _C_SHIMS.items():
        guard = "DEEP_EP_SHIM_" + re.sub(r"\W", "_", name).upper()
        out[name] = (f"/* deep_ep NVRTC shim for <{name}>: plain C declarations only. */\n"
                     f"#ifndef {guard}\n#define {guard}\n{text.strip()}\n#endif\n")
    for name, target in _CXX_FORWARD.items():
        guard = "DEEP_EP_SHIM_CXX_" + name.upper()
        out[name] = (f"/* deep_ep NVRTC shim for <{name}>: forwards to CCCL. */\n#pragma once\n"
                     f"#ifndef {guard}\n#define {guard}\n{_cxx_shim(name, target)}#endif\n")
    return out


# Included at the top of every patched header that used GNU typeof. NVRTC knows neither typeof nor
# __typeof__; GNU typeof(e) is the type of e without reference. extern "C++" keeps it valid when
# the header is included inside an extern "C" block.
SHIMS_COMPAT = """/* deep_ep: NVRTC stand-ins for GNU extensions used by NCCL's device headers. */
#ifndef DEEP_EP_NVRTC_COMPAT_H
#define DEEP_EP_NVRTC_COMPAT_H
extern "C++" {
namespace deep_ep_nvrtc {
template <class T> struct remove_ref { typedef T type; };
template <class T> struct remove_ref<T&> { typedef T type; };
template <class T> struct remove_ref<T&&> { typedef T type; };
}  // namespace deep_ep_nvrtc
}
#define DEEP_EP_NVRTC_TYPEOF(...) typename ::deep_ep_nvrtc::remove_ref<decltype((__VA_ARGS__))>::type
#endif
"""

#: Shim headers by relative path (generated into the cache next to the patched NCCL tree).
SHIMS: dict[str, str] = _build_shims()
SHIMS["deep_ep_nvrtc_compat.h"] = SHIMS_COMPAT

# ---------------------------------------------------------------------------------------------
# Patching


def _mask_comments_and_strings(text: str) -> str:
    """Same length as ``text``; comments and string/char literals replaced by spaces."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


_TRAILING_ATTR = re.compile(r"\}(\s*(?:__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)\s*)+)")


def _move_trailing_attributes(text: str) -> tuple[str, int]:
    """Move ``} __attribute__((...))`` lists to just after the matching ``struct``/``union`` keyword.

    Returns the new text and the number of moves. Braces inside comments and strings are ignored.
    """
    masked = _mask_comments_and_strings(text)
    edits = []  # (insert_pos, attr_text, remove_start, remove_end)
    for m in _TRAILING_ATTR.finditer(masked):
        close = m.start()
        depth, i = 0, close
        while i >= 0:
            if masked[i] == "}":
                depth += 1
            elif masked[i] == "{":
                depth -= 1
                if depth == 0:
                    break
            i -= 1
        if i < 0:
            continue
        head = masked[max(0, i - 400):i]
        # The struct/union keyword (optionally followed by attributes already and a tag name).
        km = None
        for km in re.finditer(r"\b(struct|union)\b", head):
            pass
        if km is None or re.search(r"[;{}()]", head[km.end():]):
            continue
        insert_at = max(0, i - 400) + km.end()
        attrs = " ".join(a.strip() for a in re.findall(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)", m.group(1)))
        edits.append((insert_at, " " + attrs, m.start(1), m.end(1)))
    # Apply edits from the end so earlier offsets stay valid (insert positions precede removals).
    ops = []
    for insert_at, attrs, rs, re_ in edits:
        ops.append((insert_at, insert_at, attrs))
        ops.append((rs, re_, " "))
    ops.sort(key=lambda o: o[0], reverse=True)
    for start, end, repl in ops:
        text = text[:start] + repl + text[end:]
    return text, len(edits)


_TYPEOF = re.compile(r"(?<![\w])(?:typeof|__typeof__|__typeof)\s*\(")
# DOCA >= 2.32's fallback for non-GNU compilers: decltype(x), a reference for x = *p.
_TYPEOF_DECLTYPE = re.compile(r"(#\s*define\s+TYPEOF\s*\(\s*(\w+)\s*\)\s*)decltype\s*\(\s*\2\s*\)")
_COMPAT_INCLUDE = '#include "deep_ep_nvrtc_compat.h" /* deep_ep: NVRTC compatibility (typeof) */\n'
_BUILTIN_MEMCPY = re.compile(r"\b__builtin_memcpy\s*\(")
_LOADCONST_IF = re.compile(r"\bif\s*\(\s*alignof\s*\(")


def patch_header_text(rel_path: str, text: str) -> tuple[str, list[str]]:
    """Apply the NVRTC compatibility rules to one NCCL header.

    Args:
        rel_path: path relative to the NCCL include directory (for the report only).
        text: the original content.

    Returns:
        ``(patched_text, applied)`` where ``applied`` lists human-readable descriptions.
    """
    applied = []
    lines = text.split("\n")
    new_lines, n_host = [], 0
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith("#") and re.match(r"#\s*(ifndef|ifdef|define\s+__host__\b|undef)", stripped):
            new_lines.append(line)
            continue
        new, k = re.subn(r"\b__host__\b", "/*__host__*/", line)
        n_host += k
        new_lines.append(new)
    text = "\n".join(new_lines)
    if n_host:
        applied.append(f"__host__ removed x{n_host}")
    text, k = _TYPEOF.subn("DEEP_EP_NVRTC_TYPEOF(", text)
    text, k2 = _TYPEOF_DECLTYPE.subn(r"\1DEEP_EP_NVRTC_TYPEOF(\2)", text)
    k += k2
    if k:
        text = _COMPAT_INCLUDE + text
        applied.append(f"typeof(x) -> remove_reference<decltype((x))> x{k}")
    text, k = _BUILTIN_MEMCPY.subn("memcpy(", text)
    if k:
        applied.append(f"__builtin_memcpy -> memcpy x{k}")
    text, k = _LOADCONST_IF.subn("if constexpr (alignof(", text)
    if k:
        applied.append(f"if (alignof(...)) -> if constexpr x{k}")
    text, k = _move_trailing_attributes(text)
    if k:
        applied.append(f"trailing __attribute__ moved to struct/union keyword x{k}")
    return text, applied


# ---------------------------------------------------------------------------------------------
# Trees

def _header_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".h", ".hpp", ".cuh", ".inl", ""))


def tree_digest(root: Path, files: list[Path] | None = None) -> str:
    """sha256 over the relative paths and contents of every header file under ``root``."""
    h = hashlib.sha256()
    for p in files if files is not None else _header_files(root):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


_prepared: dict[tuple, tuple[Path, Path, str, dict]] = {}


def prepare(nccl_include: Path, cache_dir: Path) -> tuple[Path, Path, str, dict]:
    """Return ``(patched_nccl_dir, shim_dir, digest, report)``, creating them in the cache if needed.

    Args:
        nccl_include: the original NCCL include directory (holds ``nccl.h``, ``nccl_device.h``).
        cache_dir: the JIT cache root; the tree goes to ``cache_dir/nccl/<digest>/``.

    ``digest`` covers the originals' content, :data:`PATCH_VERSION` and the shims, so it changes
    whenever anything the kernel could see changes. ``report`` maps relative header paths to the
    list of patches applied (as recorded when the tree was created). Memoised per process by the
    originals' (path, mtime, size) signature; creation is atomic (temp dir + rename) under a lock.
    """
    nccl_include = Path(nccl_include).resolve()
    files = [p for p in _header_files(nccl_include) if p.suffix in (".h", ".hpp", ".cuh")]
    sig = (str(nccl_include), str(cache_dir), tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files))
    hit = _prepared.get(sig)
    if hit is not None and hit[0].exists():
        return hit
    h = hashlib.sha256(tree_digest(nccl_include, files).encode())
    h.update(f"patch-v{PATCH_VERSION}".encode())
    for name in sorted(SHIMS):
        h.update(name.encode() + b"\0" + SHIMS[name].encode())
    digest = h.hexdigest()[:32]
    root = Path(cache_dir) / "nccl" / digest
    if not (root / "COMPLETE").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root) + ".lock"):
            if not (root / "COMPLETE").exists():
                _write_tree(nccl_include, files, root)
    report = {}
    rep_file = root / "PATCHES.txt"
    for line in rep_file.read_text().splitlines():
        path, _, what = line.partition(": ")
        report[path] = what.split("; ") if what else []
    out = (root / "include", root / "shims", digest, report)
    _prepared[sig] = out
    return out


def _write_tree(src_root: Path, files: list[Path], final: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        lines = []
        for p in files:
            rel = p.relative_to(src_root)
            text, applied = patch_header_text(str(rel), p.read_text(encoding="utf-8", errors="surrogateescape"))
            dst = tmp / "include" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text, encoding="utf-8", errors="surrogateescape")
            if applied:
                lines.append(f"{rel}: {'; '.join(applied)}")
        for name, text in SHIMS.items():
            dst = tmp / "shims" / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
        (tmp / "PATCHES.txt").write_text("\n".join(lines) + "\n")
        (tmp / "SOURCE.txt").write_text(str(src_root) + "\n")
        (tmp / "COMPLETE").write_text("ok\n")
        if final.exists():  # an incomplete leftover: move it aside, then replace
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def nccl_header_version(include_dir: str | os.PathLike) -> int:
    """``NCCL_VERSION_CODE`` computed from ``nccl.h``'s ``NCCL_MAJOR/MINOR/PATCH`` (e.g. 22809).

    Raises:
        FileNotFoundError: no ``nccl.h`` in ``include_dir``.
        ValueError: the version macros are missing.
    """
    text = (Path(include_dir) / "nccl.h").read_text(errors="replace")
    vals = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"#define\s+NCCL_{key}\s+(\d+)", text)
        if not m:
            raise ValueError(f"{include_dir}/nccl.h: NCCL_{key} not found")
        vals[key] = int(m.group(1))
    major, minor, patch = vals["MAJOR"], vals["MINOR"], vals["PATCH"]
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch
