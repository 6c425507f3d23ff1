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
PUBLIC_PACKAGES = (
    "recomp",
    "recomp.errors",
    "recomp.torch",
    "recomp.torch.report",
    "recomp.torch.hyperparallel",
    "recomp.mindspore",
    "recomp.mindspore.report",
    "recomp.mindspore.hyperparallel",
    "recomp.plan",
    "recomp.plan.solver",
)
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
    assert {"SwapPolicyError", "SwapNotSupportedError", "BudgetTooSmallError", "PlanFormatError",
            "ReplayStateWarning"} <= set(public)
    members = set(re.findall(r"^\s+- (\w+)$", listed, re.M))
    for name in public:
        assert name in members, f"{name} is not a member of the ::: recomp.errors block of {ERRORS_REFERENCE.name}"


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
    needed = framework.get(package) or framework.get(package.rpartition(".")[0])
    if needed:
        pytest.importorskip(needed)
    module = importlib.import_module(package)
    missing = []
    for name in module.__all__:
        value = getattr(module, name)
        if (inspect.isclass(value) or inspect.isfunction(value)) and not (value.__doc__ or "").strip():
            missing.append(name)
    assert missing == [], f"{package}: no docstring for {missing}"


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_public_module_has_its_reference_entry(package):
    """Each public module is rendered by a ``::: module`` block of a reference page, and
    ``tools/docs/check_site.py`` looks for each of its names on that page."""
    import sys

    sys.path.insert(0, str(paths.ROOT / "tools" / "docs"))
    try:
        import check_site
    finally:
        sys.path.pop(0)
    pages = {p.name: p.read_text() for p in (paths.DOCS / "reference").glob("*.md")}
    rendering = [name for name, text in pages.items() if re.search(rf"^::: {re.escape(package)}$", text, re.M)]
    assert rendering, f"no reference page renders {package}"
    if package != "recomp.errors":  # the errors page is checked against recomp.errors' __all__
        init, page = check_site.REFERENCE[package]
        assert page.replace(".html", ".md").removeprefix("reference/") in rendering
        assert (paths.ROOT / init).exists()
