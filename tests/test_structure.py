"""The house rules of the code base, checked by reading it (nothing runs):

* no import cycle between deep_ep's modules (imports anywhere in a file count, lazy ones too);
* no Python module of the package over 500 lines;
* kernels reach peers only through the transport object: no peer-table indexing outside
  ``include/deep_ep/comm/``.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "deep_ep"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict) -> set:
    """deep_ep modules that ``name`` imports (a package means its __init__)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("deep_ep") and t != name:
                out.add(t)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {n: _imports(n, p, modules) for n, p in modules.items()}
    # A module may import its own package's __init__ only if that package does not import it back.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    detail = ["; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) for c in cycles]
    assert not cycles, "import cycles: " + " | ".join(detail)


def test_no_module_over_500_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"


def test_kernels_reach_peers_only_through_the_transport():
    include = PKG / "include" / "deep_ep"
    raw = re.compile(r"\b(peers|bases)\s*\[|\.peers\b|ncclGetLsaPointer|red_release_sys_add")
    hits = []
    for path in include.rglob("*.cuh"):
        if path.parent.name == "comm" or path.parent.name == "common" and path.name == "ptx.cuh":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if raw.search(code):
                hits.append(f"{path.relative_to(include)}:{i}: {line.strip()}")
    assert not hits, "peer access outside include/deep_ep/comm/:\n" + "\n".join(hits)
    # and the kernels do use the transport
    # (the transport is a template parameter of the impls: member templates are called as tr.template f<...>)
    assert re.search(r"tr\.(template )?put_chunk", (include / "impls" / "dispatch_send.cuh").read_text())
    assert re.search(r"tr\.(template )?get_chunk", (include / "impls" / "combine_recv.cuh").read_text())
