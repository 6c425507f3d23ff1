"""Find private attribute use outside the per-framework compat modules.

Run: ``python tools/check_private_api.py [src/recomp]``; exits 1 and lists each
place if it finds one. The rules:

* a module of recomp reads no private attribute (``x._name``) of another object
  or module, except names the module itself defines (its own classes' methods and
  attributes: private to the module, not to one object) and recomp's own tags on
  objects (``_recomp...``);
* framework-private API (``torch._C``, ``from torch.utils._pytree import ...``,
  ``mindspore.common._grad_function``, ``tensor._version``) appears only in
  ``torch/_compat.py`` and ``mindspore/_compat.py``, each use with its reason.

recomp's own private modules (``recomp._engine``) are package-internal and may
be imported by name; what they define without a leading underscore is theirs
to share.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

COMPAT = {"torch/_compat.py", "mindspore/_compat.py"}
FRAMEWORKS = ("torch", "mindspore")


# Public API that carries an underscore to stay clear of field names.
NAMEDTUPLE_API = {"_fields", "_asdict", "_replace", "_make", "_field_defaults"}


def _private(name: str) -> bool:
    if name in NAMEDTUPLE_API:
        return False
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(tree: ast.AST) -> set[str]:
    """Private names this module defines: functions, methods, class attributes and
    attributes assigned on ``self``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__slots__" and node.value is not None:
                        names.update(
                            c.value
                            for c in ast.walk(node.value)
                            if isinstance(c, ast.Constant) and isinstance(c.value, str)
                        )
                elif (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return {n for n in names if _private(n)}


def problems(path: Path, relative: str) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    own = _defined_names(tree)

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{relative}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            if node.attr.startswith("_recomp") or node.attr in own:
                continue
            report(node, f"private attribute .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] in FRAMEWORKS and any(_private(p) for p in parts):
                report(node, f"import from private module {node.module}")
            elif parts[0] in FRAMEWORKS:
                for alias in node.names:
                    if _private(alias.name):
                        report(node, f"private name {alias.name} imported from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in FRAMEWORKS and any(_private(p) for p in parts):
                    report(node, f"import of private module {alias.name}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).parents[1] / "src" / "recomp")
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative in COMPAT:
            continue
        found.extend(problems(path, relative))
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} private API use(s) outside the compat modules", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
