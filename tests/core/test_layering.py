"""The import graph of ``src/recomp``: layers that only import downwards, and no circle.

From the bottom: the framework-free core (``recomp/*.py``), the framework packages
(``recomp.torch``, ``recomp.mindspore``), the planner (``recomp.plan``), the commands
(``recomp.cli``: bench, plan, report) and their entry point (``recomp.__main__``).
Imports inside functions count too: a lazy import still ties the importer to what it
imports. (``recomp.cli.torch`` and ``recomp.cli.mindspore`` belong to the ``cli`` layer.)"""

from __future__ import annotations

import ast
import pathlib

import paths

SRC = paths.SRC
PACKAGE = SRC / "recomp"

# Rank of each layer; a module may import its own layer's modules and lower layers only.
RANKS = {"core": 0, "torch": 1, "mindspore": 1, "plan": 2, "cli": 3, "main": 4}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The recomp modules ``path`` imports, anywhere in the file, relative imports
    resolved; ``from package import name`` counts as an import of the sub-module
    ``package.name`` where that is a module."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "recomp")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "recomp":
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found |= subs or {target}
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def layer_of(module: str) -> str:
    if module == "recomp.__main__":
        return "main"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in RANKS:
        return parts[1]
    return "core"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: imports_of(path, known) for name, path in modules.items()}


def test_plan_does_not_import_the_command_line():
    modules = _modules()
    plan = {n: p for n, p in modules.items() if layer_of(n) == "plan"}
    assert "recomp.plan.profiler" in plan and "recomp.plan.planner" in plan
    offending = {
        name: sorted(t for t in imports_of(path, set(modules)) if layer_of(t) == "cli")
        for name, path in plan.items()
    }
    assert not {k: v for k, v in offending.items() if v}


def test_every_import_goes_down_or_sideways_within_a_layer():
    wrong = [
        (source, target)
        for source, targets in _graph().items()
        for target in targets
        if RANKS[layer_of(target)] > RANKS[layer_of(source)]
        or (
            RANKS[layer_of(target)] == RANKS[layer_of(source)]
            and layer_of(target) != layer_of(source)
        )
    ]
    assert not wrong, wrong


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_circle():
    """No module reaches itself through imports. A package's ``__init__`` that imports its
    own sub-modules (to re-export them) is not a circle with them: Python runs a parent
    package before any of its sub-modules whatever they import, so edges from a module
    to its own parent packages are left out."""
    graph = {
        source: {t for t in targets if t not in _ancestors(source) and t != source}
        for source, targets in _graph().items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            circle = visit(node)
            assert circle is None, " -> ".join(circle)


def test_the_checks_see_a_bad_import(tmp_path):
    """The walker finds an import of the command line hidden in a function of the planner."""
    bad = PACKAGE / "plan" / "profiler.py"
    code = bad.read_text() + "\n\ndef _late():\n    from ..cli.torch import runner\n"
    fake = tmp_path / "src" / "recomp" / "plan" / "profiler.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(code)
    global SRC
    saved = SRC
    SRC = tmp_path / "src"
    try:
        found = imports_of(fake, {"recomp.cli.torch.runner"})
    finally:
        SRC = saved
    assert "recomp.cli.torch.runner" in found
    assert layer_of("recomp.cli.torch.runner") == "cli"


# The framework-free core, bottom up, as docs/mechanism.md ("Where things live") lists
# it: each module imports only modules before it here. Unlike the checks above, this one
# counts imports under ``if TYPE_CHECKING:`` too: a type-only circle still means two
# modules that cannot be understood one without the other.
CORE_ORDER = [
    "recomp.errors",
    "recomp._moved",
    "recomp._selection",
    "recomp._state",
    "recomp._policy",
    "recomp._hyperparallel",
    "recomp._swap_pairs",
    "recomp._pytree",
    "recomp._backend",
    "recomp._hooks",
    "recomp._saved_hooks",
    "recomp._offload_plan",
    "recomp._offload_session",
    "recomp._pipeline_swap",
    "recomp._rng_trackers",
    "recomp._record",
    "recomp._op_policy",
    "recomp._region",
    "recomp._module_state",
    "recomp._engine",
    "recomp._kv_cache",
    "recomp._collectives",
    "recomp._wrapping",
    "recomp._recompute_policy",
    "recomp._report",
    "recomp._testing",
    "recomp",
]


def _all_imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """Like ``imports_of``, but type-checking imports included."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found |= subs or {target}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= imports_of_node(node, known)
    return found


def imports_of_node(node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == "recomp"}
    target = node.module or ""
    if target.split(".")[0] != "recomp":
        return set()
    return ({f"{target}.{a.name}" for a in node.names} & known) or {target}


def _imports_out_of_order(order: list[str], modules: dict[str, pathlib.Path]) -> list[tuple[str, str]]:
    """The imports (type-checking ones included) by a module of ``order`` of itself or of
    a module after it in ``order``."""
    rank = {name: i for i, name in enumerate(order)}
    known = set(modules)
    return [
        (name, target)
        for name in order
        for target in _all_imports(modules[name], known)
        if target in rank and rank[target] >= rank[name] and target != name
    ]


def test_the_core_imports_only_what_comes_before_it():
    modules = _modules()
    core = {n for n in modules if layer_of(n) == "core" and n != "recomp.__main__"}
    assert core == set(CORE_ORDER), "a core module is missing from CORE_ORDER (and the docs)"
    known = set(modules)
    wrong = _imports_out_of_order(CORE_ORDER, modules)
    for name in CORE_ORDER:
        for target in _all_imports(modules[name], known):
            if layer_of(target) != "core":
                wrong.append((name, target))  # the core imports no framework package
    assert not wrong, wrong


# The PyTorch swap package, bottom up, as docs/mechanism.md lists it: each module imports
# only those before it here (type-checking imports too), the index (its ``__init__``) last.
SWAP_ORDER = [
    "recomp.torch._swap.pool",
    "recomp.torch._swap.manager",
    "recomp.torch._swap.buckets",
    "recomp.torch._swap.scope",
    "recomp.torch._swap.hooks",
    "recomp.torch._swap.selective",
    "recomp.torch._swap.checkpoint",
    "recomp.torch._swap",
]


def test_the_swap_package_imports_only_what_comes_before_it():
    modules = _modules()
    package = SWAP_ORDER[-1]
    found = {n for n in modules if n == package or n.startswith(package + ".")}
    assert found == set(SWAP_ORDER), "a module of the swap package is missing from SWAP_ORDER"
    wrong = _imports_out_of_order(SWAP_ORDER, modules)
    assert not wrong, wrong


# Context variables the test seam (``recomp._testing.process_global_state``) replaces by
# assigning the module attribute: a module that imported one by name would keep the old
# one, so everything but its owner and the seam reads it through its accessor.
SWAPPED_VARIABLES = {
    "ACTIVE_REGION": ("recomp._region", "active_region()"),
    "CURRENT": ("recomp._state", "get_recompute_state()"),
}


def test_swapped_context_variables_are_read_through_their_accessors():
    wrong = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                used = [a.name for a in node.names if a.name in SWAPPED_VARIABLES]
            elif isinstance(node, ast.Attribute) and node.attr in SWAPPED_VARIABLES:
                used = [node.attr]
            else:
                continue
            for variable in used:
                owner, accessor = SWAPPED_VARIABLES[variable]
                if name not in (owner, "recomp._testing"):
                    wrong.append(f"{name}:{node.lineno} reads {variable}; use {accessor}")
    assert not wrong, wrong
