"""The import graph of ``src/recomp``: no module imports, directly or through others, a
module that imports it back; and the framework-free core never imports a framework API."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "recomp"

# The framework-free core: imported by both framework APIs, so it stays below them.
CORE = {
    "recomp",
    "recomp.errors",
    "recomp._state",
    "recomp._pytree",
    "recomp._backend",
    "recomp._hooks",
    "recomp._record",
    "recomp._region",
    "recomp._running_stats",
    "recomp._engine",
    "recomp._wrapping",
    "recomp._kv_cache",
    "recomp._testing",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """recomp modules ``name`` imports anywhere in its body (type-checking imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from . import x` imports the module x when there is one, else a name of stem.
            targets = [
                f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_it_should():
    edges = graph()
    assert "recomp._region" in edges["recomp._engine"]
    assert "recomp._record" in edges["recomp._region"]
    assert "recomp.torch._compat" in edges["recomp.torch._backend"]
    # the cycle finder finds a planted cycle
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_recomp():
    assert cycles(graph()) == []


def test_the_core_imports_no_framework_api():
    edges = graph()
    for name in CORE:
        leaks = {m for m in edges[name] if m.startswith(("recomp.torch", "recomp.mindspore"))}
        assert not leaks, f"{name} imports {sorted(leaks)}"
