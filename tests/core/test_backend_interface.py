"""The engine asks a framework two kinds of questions, about tensors (``Backend``) and
about modules (``Modules``, a backend's ``modules``); neither answers the other's."""

from __future__ import annotations

import importlib
import inspect

import pytest

from recomp._backend import Backend, Modules


def _members(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_the_two_interfaces_share_no_name():
    assert _members(Backend) & _members(Modules) == set()


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_each_backend_answers_module_questions_only_through_its_modules(framework):
    pytest.importorskip(framework)
    backend = importlib.import_module(f"recomp.{framework}._backend").BACKEND
    module_names = _members(Modules)
    for cls in type(backend).__mro__:
        if cls is not object:
            assert _members(cls) & module_names == set(), cls
    assert isinstance(backend.modules, Modules)
    assert backend.modules.backend is backend
    # Every question the core leaves to the framework is answered by it.
    for name, value in vars(Modules).items():
        if inspect.isfunction(value) and _raises_not_implemented(value):
            assert getattr(type(backend.modules), name) is not value, name


def _raises_not_implemented(fn) -> bool:
    return "raise NotImplementedError" in inspect.getsource(fn)


def test_no_recomp_module_asks_a_module_question_of_the_backend():
    # Asked of the backend itself, a module question fails at run time only on the path
    # that asks it: look for one in the source of every recomp module.
    import pathlib
    import re

    import recomp

    names = "|".join(sorted(_members(Modules)))
    pattern = re.compile(rf"\b(?:backend|BACKEND)\.(?:{names})\b")
    root = pathlib.Path(recomp.__file__).parent
    found = [
        f"{path.relative_to(root)}:{number}"
        for path in root.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
