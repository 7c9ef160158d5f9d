"""deep_ep.envs: the one place the package reads the environment, with DeepEP V2's names as aliases.

* each DeepEP alias stands for its variable (and reaches what the variable does: line info in the
  compile options, the dump folder, the NCCL include directory, the spill check, the printed
  command), ours wins over it, empty values count as unset, switches read DeepEP's and ours;
* nothing in deep_ep reads the environment other than through deep_ep.envs (two modules aside), and
  every name it reads is declared;
* docs/jit.md's table has every variable, with its DeepEP names, and the removed
  ``DEEP_EP_FAST_DRIVER_CALLS`` is read nowhere.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from deep_ep import envs

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "deep_ep"

#: Modules that read their variables with os.environ themselves (none: every read goes through envs).
DIRECT_READERS: set = set()


@pytest.fixture
def clean(monkeypatch):
    """No variable of deep_ep.envs, and none of their DeepEP names, set."""
    for name in envs.VARIABLES:
        for each in envs.names(name):
            monkeypatch.delenv(each, raising=False)
    return monkeypatch


@pytest.mark.parametrize("ours, deepep", [("EP_JIT_PRINT_CMD", "EP_JIT_PRINT_COMPILER_COMMAND"),
                                          ("EP_JIT_LINEINFO", "EP_JIT_WITH_LINEINFO"),
                                          ("EP_JIT_CHECK_SPILLS", "EP_JIT_PTXAS_CHECK")])
def test_deepep_switches_stand_for_ours(clean, ours, deepep):
    assert not envs.flag(ours)
    clean.setenv(deepep, "1")
    assert envs.flag(ours) and envs.origin(ours) == deepep
    clean.setenv(ours, "0")                       # ours wins, also when it says off
    assert not envs.flag(ours) and envs.origin(ours) == ours
    clean.setenv(ours, "")                        # empty: unset
    assert envs.flag(ours)
    clean.setenv(deepep, "0")
    assert not envs.flag(ours)


@pytest.mark.parametrize("value, on", [("1", True), ("2", True), ("true", True), ("ON", True), ("yes", True),
                                       ("0", False), ("", False), ("false", False), ("Off", False), ("no", False)])
def test_switch_values(clean, value, on):
    clean.setenv("EP_JIT_DEBUG", value)
    assert envs.flag("EP_JIT_DEBUG") is on


def test_defaults(clean):
    assert envs.get("EP_JIT_CACHE_DIR") == "~/.cache/deep_ep/jit" and envs.origin("EP_JIT_CACHE_DIR") is None
    assert envs.flag("DEEP_EP_COOPERATIVE") and not envs.flag("EP_BUFFER_DEBUG")
    assert envs.get("EP_NCCL_INCLUDE_DIR") is None and envs.get("WORLD_SIZE") == "1"
    clean.setenv("DEEP_EP_COOPERATIVE", "0")
    assert not envs.flag("DEEP_EP_COOPERATIVE")
    with pytest.raises(KeyError):
        envs.get("EP_NOT_A_VARIABLE")


def test_lineinfo_alias_reaches_the_compile_options(clean):
    from deep_ep.jit.builder import compile_options
    assert "-lineinfo" not in compile_options(arch="sm_90", defines=None, use_nccl=False)
    clean.setenv("EP_JIT_WITH_LINEINFO", "1")
    assert "-lineinfo" in compile_options(arch="sm_90", defines=None, use_nccl=False)


def test_dump_switches_dump_into_the_cache(clean, tmp_path):
    from deep_ep.jit import dumps
    clean.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "cache"))
    assert dumps.dump_dir() is None
    for name in ("EP_JIT_DUMP_PTX", "EP_JIT_DUMP_SASS", "EP_JIT_DUMP_ASM"):
        clean.setenv(name, "1")
        assert dumps.dump_dir() == tmp_path / "cache" / "dumps"
        clean.setenv(name, "0")
        assert dumps.dump_dir() is None
    clean.setenv("EP_JIT_DUMP_SASS", "1")
    clean.setenv("EP_JIT_DUMP_DIR", str(tmp_path / "mine"))
    assert dumps.dump_dir() == tmp_path / "mine"


def test_nccl_root_dir_gives_the_include_dir(clean, tmp_path):
    from deep_ep.jit import locate
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "nccl.h").write_text("")
    clean.setenv("EP_NCCL_ROOT_DIR", str(tmp_path))
    assert envs.get("EP_NCCL_INCLUDE_DIR") == str(tmp_path / "include")
    assert locate._env_dir("EP_NCCL_INCLUDE_DIR", "nccl.h") == (tmp_path / "include").resolve()
    clean.setenv("EP_NCCL_ROOT_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(locate.JitEnvironmentError, match=r"EP_NCCL_INCLUDE_DIR=.*elsewhere/include \(from "
                                                         r"EP_NCCL_ROOT_DIR\)"):
        locate._env_dir("EP_NCCL_INCLUDE_DIR", "nccl.h")


def test_print_command_alias_prints_the_command(clean, tmp_path, capsys):
    from deep_ep import jit
    clean.setenv("EP_JIT_CACHE_DIR", str(tmp_path))
    clean.setenv("EP_JIT_PRINT_COMPILER_COMMAND", "1")
    jit.clear_memory_cache()
    jit.build("print_command_alias", 'extern "C" __global__ void k(int* p) { p[0] = 7; }')
    assert re.search(r"\[deep_ep\.jit\] nvrtc .*-arch=sm_\d+", capsys.readouterr().out)


def _buffer_debug_worker(rank, world_size):
    import contextlib
    import io

    import torch.distributed as dist

    from deep_ep import ElasticBuffer
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=4, hidden=128, num_topk=2).destroy()
    return out.getvalue()


def test_buffer_debug_prints_each_buffer(clean, tmp_path):
    from proc_utils import run_gloo_ranks
    clean.setenv("EP_BUFFER_DEBUG", "1")
    printed = run_gloo_ranks(_buffer_debug_worker, 2, tmp_path, deadline=120)
    for rank in (0, 1):
        assert re.fullmatch(rf"\[deep_ep\] ElasticBuffer #\d+ on rank {rank}/2: CPUBackend on cpu, \d+ bytes "
                            rf"\(host: 0\)\n", printed[rank]), printed[rank]


# ------------------------------------------------------------------------------ static checks
def _environment_reads(tree: ast.AST):
    """``(line, variable name or None)`` of every read of os.environ / os.getenv in ``tree`` (writes:
    assignments, ``setdefault``, ``del``, are not reads)."""
    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id == "os")

    def name_of(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_environ(node.func.value) and node.func.attr in ("get", "pop", "items", "keys", "values", "copy"):
                yield node.lineno, name_of(node.args[0]) if node.args else None
            elif node.func.attr == "getenv" and isinstance(node.func.value, ast.Name) and node.func.value.id == "os":
                yield node.lineno, name_of(node.args[0]) if node.args else None
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            yield node.lineno, name_of(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.lineno, name_of(node.left)
        elif (isinstance(node, (ast.Call,)) and isinstance(node.func, ast.Name) and node.func.id in ("dict", "list")
              and any(is_environ(a) for a in node.args)):
            yield node.lineno, None


def test_the_environment_is_read_through_envs_only():
    direct = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "deep_ep/envs.py" or rel in DIRECT_READERS:
            continue
        direct += [f"{rel}:{line}: reads {name or 'the environment'} directly"
                   for line, name in _environment_reads(ast.parse(path.read_text()))]
    assert not direct, "read the environment through deep_ep.envs:\n" + "\n".join(direct)


def test_every_name_read_is_declared():
    """Constant names given to envs.get / flag / origin / names anywhere in deep_ep are variables of
    `envs.VARIABLES` (an undeclared one would be a KeyError only when that line runs)."""
    undeclared = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "envs"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value not in envs.VARIABLES):
                undeclared.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.args[0].value}")
        text = path.read_text()
        assert "DEEP_EP_FAST_DRIVER_CALLS" not in text, f"{path}: the ctypes driver path is gone"
    assert not undeclared, "\n".join(undeclared)


def test_the_docs_table_lists_every_variable_and_alias():
    text = (ROOT / "docs" / "jit.md").read_text()
    section = text[text.index("## Environment variables"):text.index("## How things are found")]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    first_cells = {name for row in rows for name in re.findall(r"`([A-Z_]+)`", row.split("|")[1])}
    assert first_cells == set(envs.VARIABLES), first_cells ^ set(envs.VARIABLES)
    for name, variable in envs.VARIABLES.items():
        row = next(r for r in rows if f"`{name}`" in r.split("|")[1])
        for alias in variable.aliases:
            assert f"`{alias.name}`" in row.split("|")[2], (name, alias.name)
    assert "DEEP_EP_FAST_DRIVER_CALLS" not in text
