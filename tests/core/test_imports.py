"""The framework-free core: imports, pytree, errors when a framework is missing."""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict, defaultdict, namedtuple

import pytest

from recomp import _pytree
from trees import assert_same_tree

BLOCK_FRAMEWORKS = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'mindspore', 'numpy'):\n"
    "            raise ImportError('blocked: ' + name)\n"
    "sys.meta_path.insert(0, Block())\n"
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_FRAMEWORKS + code], capture_output=True, text=True, timeout=120
    )


def test_core_imports_without_any_framework():
    proc = run(
        "import recomp; print(recomp.is_recomputing(), recomp.get_recompute_state()); "
        "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch','mindspore')))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["False None", "[]"]


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_framework_api_without_the_framework_names_the_extra(framework):
    proc = run(f"import recomp.{framework}")
    assert proc.returncode != 0
    assert f"pip install recomp[{framework}]" in proc.stderr


Point = namedtuple("Point", ["x", "y"])


@pytest.mark.parametrize(
    "tree",
    [
        1,
        (1, [2, 3], {"a": 4, "b": (5,)}),
        {"p": Point(1, [2, {"q": 3}]), "r": None},
        [],
        OrderedDict(z=1, a=2),
    ],
)
def test_pytree_round_trip(tree):
    leaves, spec = _pytree.flatten(tree)
    rebuilt = _pytree.unflatten(leaves, spec)
    assert rebuilt == tree
    assert_same_tree(rebuilt, tree)  # == cannot tell a namedtuple from a tuple
    assert len(_pytree.leaf_paths(spec)) == len(leaves)


def test_pytree_paths_and_spec_equality():
    _, spec = _pytree.flatten(((1, {"mask": 2}), {"scale": 3}))
    assert _pytree.leaf_paths(spec) == ["[0][0]", "[0][1]['mask']", "[1]['scale']"]
    assert spec == _pytree.flatten(((7, {"mask": 8}), {"scale": 9}))[1]
    assert spec != _pytree.flatten(((7, {"mask": 8}), {"other": 9}))[1]


@pytest.mark.parametrize(
    ("actual", "expected"),
    [
        ((1, 2), Point(1, 2)),
        ({"z": 1, "a": 2}, OrderedDict(z=1, a=2)),
        (OrderedDict(a=2, z=1), OrderedDict(z=1, a=2)),
        ([(1, [2])], [(1, (2,))]),
        (defaultdict(list, a=1), defaultdict(int, a=1)),
        ({"p": Point(1, 2.0)}, {"p": Point(1, 2)}),
    ],
    ids=["namedtuple", "ordereddict", "key-order", "nested", "default-factory", "leaf-type"],
)
def test_tree_comparison_sees_what_equality_does_not(actual, expected):
    with pytest.raises(AssertionError):
        assert_same_tree(actual, expected)
