"""Rules for the test files themselves, checked on their source: a test file that needs
MindSpore at import time skips itself first where MindSpore is missing. The oldest
PyTorch's environment and the trainers' have no MindSpore and collect every file: an
import that fails there is a collection error, not a skip. (Every test environment has
PyTorch; files that need it may import it directly.)"""

from __future__ import annotations

import ast
import pathlib

import paths

TESTS = paths.ROOT / "tests"
SUPPORT = TESTS / "support"
FRAMEWORKS = ("mindspore",)


def _top_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
    return found


def _skips(tree: ast.Module) -> dict[str, int]:
    """The first line at which each framework is skipped for (``pytest.importorskip``)."""
    first: dict[str, int] = {}
    for node in tree.body:
        for call in ast.walk(node):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "importorskip"
                and call.args
                and isinstance(call.args[0], ast.Constant)
            ):
                name = str(call.args[0].value).split(".")[0]
                first.setdefault(name, node.lineno)
    return first


def _framework_of(module: str, support: dict[str, set[str]]) -> set[str]:
    """The frameworks importing ``module`` imports: the framework itself, recomp's package
    for it, or a support module that imports one at its top."""
    parts = module.split(".")
    if parts[0] in FRAMEWORKS:
        return {parts[0]}
    if parts[0] == "recomp" and len(parts) > 1 and parts[1] in FRAMEWORKS:
        return {parts[1]}
    return support.get(parts[0], set())


def _support_frameworks() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in SUPPORT.glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        skipped = _skips(tree)
        found[path.stem] = {
            fw
            for _, module in _top_level_imports(tree)
            for fw in _framework_of(module, {})
            if fw not in skipped
        }
    return found


def unskipped_framework_imports(path: pathlib.Path, support: dict[str, set[str]]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skips = _skips(tree)
    problems = []
    for line, module in _top_level_imports(tree):
        for fw in sorted(_framework_of(module, support)):
            if skips.get(fw, line + 1) > line:
                problems.append(
                    f"{path.name}:{line} imports {module} before "
                    f'pytest.importorskip("{fw}")'
                )
    return problems


def test_test_files_skip_before_importing_mindspore():
    support = _support_frameworks()
    problems = [
        problem
        for path in sorted(TESTS.rglob("test_*.py"))
        if SUPPORT not in path.parents
        for problem in unskipped_framework_imports(path, support)
    ]
    assert not problems, "\n".join(problems)


def test_the_rule_sees_an_unskipped_import(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import pytest\nimport recomp.mindspore as rm\npytest.importorskip('mindspore')\n")
    good = tmp_path / "test_good.py"
    good.write_text("import pytest\nms = pytest.importorskip('mindspore')\nimport recomp.mindspore\n")
    assert len(unskipped_framework_imports(bad, {})) == 1
    assert unskipped_framework_imports(good, {}) == []
