"""Find private attribute use outside the per-framework compat fence.

Run: ``python tools/check_private_api.py [src/recomp]``; exits 1 and lists each
place if it finds one. The rules:

* a module of recomp reads no private attribute (``x._name``) of another object
  or module, except names the module itself defines (its own classes' methods and
  attributes: private to the module, not to one object) and recomp's own tags on
  objects (``_recomp...``);
* the same holds for attributes named by a constant string:
  ``getattr(x, "_name")``, ``hasattr``, ``setattr``, ``delattr``,
  ``object.__getattribute__`` / ``__setattr__`` / ``__delattr__`` and
  ``inspect.getattr_static``;
* no private module or name of another package (torch, mindspore, transformers,
  peft, accelerate, ..., the standard library too) is imported, with ``import`` /
  ``from ... import`` or by a constant string (``importlib.import_module``,
  ``sys.modules[...]``, ``sys.modules.get``);
* a class that derives from another package's class (``nn.Module``,
  ``FlopCounterMode``, or a class a compat module hands out) defines no private
  name of its own (method, class attribute, ``self._name = ...``) except
  ``_recomp...``: such a name either overrides the base class's internals or
  can collide with them in a later version;
* framework-private API (``torch._C``, ``from torch.utils._pytree import ...``,
  ``mindspore.common._grad_function``, ``tensor._version``, transformers'
  private layer attributes) appears only inside the fence: the package
  ``torch/_compat/`` (every module in it) and the module ``mindspore/_compat.py``,
  each use with its reason.

recomp's own private modules (``recomp._engine``) are package-internal and may
be imported by name; what they define without a leading underscore is theirs
to share.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# The fence, relative to the checked root: a path ending in "/" is a package (every
# module below it is inside), any other a single module.
FENCE = ("torch/_compat/", "mindspore/_compat.py")
OWN_PACKAGE = "recomp"


# Public API that carries an underscore to stay clear of field names.
NAMEDTUPLE_API = {"_fields", "_asdict", "_replace", "_make", "_field_defaults"}

# Functions that read or write an attribute named by their second argument.
ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}
ATTRIBUTE_METHODS = {
    ("object", "__getattribute__"),
    ("object", "__setattr__"),
    ("object", "__delattr__"),
    ("inspect", "getattr_static"),
}


def inside_fence(relative: str) -> bool:
    """Whether the module at ``relative`` (a POSIX path below the root) may use private API."""
    return any(
        relative.startswith(entry) if entry.endswith("/") else relative == entry for entry in FENCE
    )


def _private(name: str) -> bool:
    if name in NAMEDTUPLE_API or _sunder(name):
        return False
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sunder(name: str) -> bool:
    """``_fields_``, ``_missing_``: documented hooks of ctypes and enum, not private."""
    return len(name) > 2 and name[0] == name[-1] == "_" and name[1] != "_" and name[-2] != "_"


def _own_tag(name: str) -> bool:
    return name.startswith("_recomp_")


def _private_module(dotted: str) -> bool:
    return any(_private(part) for part in dotted.split("."))


def _other_package(module: str) -> bool:
    return module.split(".")[0] != OWN_PACKAGE


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


def _foreign_names(tree: ast.AST) -> set[str]:
    """Names bound by imports from other packages, or from recomp's compat modules and
    their sub-modules (which hand out framework classes)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _other_package(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            compat = "_compat" in module.split(".") or any(a.name == "_compat" for a in node.names)
            if (node.level == 0 and _other_package(module)) or compat:
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root_name(node: ast.expr) -> str | None:
    """``a`` for ``a``, ``a.b.c``, ``a.b()``, ``a[...]``."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            break
    return node.id if isinstance(node, ast.Name) else None


def _constant_string(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _attribute_call_name(node: ast.Call) -> str | None:
    """The constant attribute name a getattr-like call reads or writes, if any."""
    func = node.func
    if isinstance(func, ast.Name) and func.id in ATTRIBUTE_FUNCTIONS:
        return _constant_string(node.args[1]) if len(node.args) > 1 else None
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and (func.value.id, func.attr) in ATTRIBUTE_METHODS
    ):
        return _constant_string(node.args[1]) if len(node.args) > 1 else None
    return None


def _module_by_string(node: ast.AST) -> str | None:
    """The constant module name of ``importlib.import_module("m")``, ``import_module("m")``,
    ``sys.modules["m"]`` or ``sys.modules.get("m")``."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("import_module", "__import__") and node.args:
            return _constant_string(node.args[0])
        if (
            name == "get"
            and isinstance(func, ast.Attribute)
            and _is_sys_modules(func.value)
            and node.args
        ):
            return _constant_string(node.args[0])
    if isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
        return _constant_string(node.slice)
    return None


def _is_sys_modules(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "modules"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _class_private_names(cls: ast.ClassDef) -> list[tuple[ast.AST, str]]:
    """Private names a class body defines: methods, class attributes, ``self._x = ...``."""
    found: list[tuple[ast.AST, str]] = []
    for statement in cls.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((statement, statement.name))
            for node in ast.walk(statement):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    targets = [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        found.append((target, target.attr))
        elif isinstance(statement, ast.Assign):
            found.extend((t, t.id) for t in statement.targets if isinstance(t, ast.Name))
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            found.append((statement.target, statement.target.id))
    return [(node, name) for node, name in found if _private(name) and not _own_tag(name)]


def problems(path: Path, relative: str) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    own = _defined_names(tree)
    foreign = _foreign_names(tree)

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{relative}:{getattr(node, 'lineno', '?')}: {what}")

    def exempt(owner: ast.expr, name: str) -> bool:
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            return True
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
            return True
        return _own_tag(name) or name in own

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not exempt(node.value, node.attr):
                report(node, f"private attribute .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not _other_package(node.module):
                continue
            if _private_module(node.module):
                report(node, f"import from private module {node.module}")
            else:
                for alias in node.names:
                    if _private(alias.name):
                        report(node, f"private name {alias.name} imported from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _other_package(alias.name) and _private_module(alias.name):
                    report(node, f"import of private module {alias.name}")
        elif isinstance(node, ast.ClassDef):
            bases = [b for b in node.bases if _root_name(b) in foreign]
            if bases:
                base = ast.unparse(bases[0])
                for where, name in _class_private_names(node):
                    report(where, f"private name {name} defined on a subclass of {base}")

        if isinstance(node, ast.Call):
            name = _attribute_call_name(node)
            if name is not None and _private(name) and not exempt(node.args[0], name):
                report(node, f"private attribute {name!r} by name")
        module = _module_by_string(node)
        if module is not None and _other_package(module) and _private_module(module):
            report(node, f"private module {module} by name")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).parents[1] / "src" / "recomp")
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if inside_fence(relative):
            continue
        found.extend(problems(path, relative))
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} private API use(s) outside the compat fence", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
