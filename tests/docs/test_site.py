"""The documentation site's promises that need no build: the README stays a front page,
every error and warning class recomp defines has its entry in Troubleshooting and in the
reference, every page is in the navigation, every public name has a docstring for the
reference to show. (``make docs`` builds the site with ``--strict``; ``make docs-check``
looks at it in a browser.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest

import paths

TROUBLESHOOTING = paths.DOCS / "troubleshooting.md"
ERRORS_REFERENCE = paths.DOCS / "reference" / "errors.md"
PUBLIC_PACKAGES = ("recomp", "recomp.torch", "recomp.mindspore", "recomp.plan")
BASES = {"Exception", "BaseException", "Warning", "UserWarning", "RuntimeError", "ValueError",
         "TypeError", "NotImplementedError"}


def test_readme_is_a_front_page():
    lines = paths.README.read_text().count("\n")
    assert lines < 250, f"README.md has {lines} lines; move the details into docs/"


def exception_classes() -> dict[str, str]:
    """Every class under src/recomp that derives (directly or through another one found
    here) from an exception or warning: name -> file."""
    trees = {f: ast.parse(f.read_text()) for f in sorted(paths.SRC.joinpath("recomp").rglob("*.py"))}
    known, found = set(BASES), {}
    changed = True
    while changed:
        changed = False
        for file, tree in trees.items():
            for node in ast.walk(tree):
                if not isinstance(node, ast.ClassDef) or node.name in known:
                    continue
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & known:
                    known.add(node.name)
                    found[node.name] = str(file.relative_to(paths.ROOT))
                    changed = True
    return found


def test_the_class_search_finds_the_errors_module():
    found = exception_classes()
    assert {"RecompError", "ReplayMismatchError", "ReplayStateWarning", "SwapPolicyError",
            "SwapNotSupportedError", "BudgetTooSmallError", "PlanFormatError"} <= set(found)


@pytest.mark.parametrize(("name", "where"), sorted(exception_classes().items()))
def test_every_error_and_warning_has_a_troubleshooting_entry(name, where):
    headings = re.findall(r"^## (\S+)\s*$", TROUBLESHOOTING.read_text(), re.M)
    assert name in headings, f"{name} ({where}) has no '## {name}' section in {TROUBLESHOOTING.name}"


def test_every_public_error_and_warning_is_in_the_reference():
    import recomp.errors

    listed = ERRORS_REFERENCE.read_text()
    public = [n for n, v in vars(recomp.errors).items()
              if isinstance(v, type) and issubclass(v, (Exception, Warning)) and v.__module__ == "recomp.errors"]
    for name in [*public, "SwapPolicyError", "SwapNotSupportedError", "BudgetTooSmallError", "PlanFormatError"]:
        assert name in listed, f"{name} is missing from {ERRORS_REFERENCE.name}"


def test_every_page_is_in_the_navigation():
    nav = (paths.ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w/.-]+\.md)\s*$", nav, re.M))
    pages = {str(p.relative_to(paths.DOCS)) for p in paths.DOCS.rglob("*.md")}
    assert pages - listed == set(), "pages outside the navigation"
    assert listed - pages == set(), "navigation entries without a page"


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_public_name_has_a_docstring(package):
    # recomp.plan's lazily imported names (profile, apply_plan) need PyTorch.
    framework = {"recomp.torch": "torch", "recomp.mindspore": "mindspore", "recomp.plan": "torch"}
    if package in framework:
        pytest.importorskip(framework[package])
    module = importlib.import_module(package)
    missing = []
    for name in module.__all__:
        value = getattr(module, name)
        if (inspect.isclass(value) or inspect.isfunction(value)) and not (value.__doc__ or "").strip():
            missing.append(name)
    assert missing == [], f"{package}: no docstring for {missing}"
