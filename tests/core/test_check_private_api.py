"""``tools/check_private_api.py``: private framework API only behind the compat fence.

The fence is the package ``recomp/torch/_compat/`` and the module
``recomp/mindspore/_compat.py``; every other recomp module uses no private attribute,
module or name of another package. Checked on the real tree, and on small files that
show each rule flags what it should and passes what it should.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import paths

ROOT = paths.ROOT


def test_no_private_api_outside_the_compat_modules():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "check_private_api.py"),
            str(ROOT / "src" / "recomp"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_checker_finds_private_use(tmp_path):
    (tmp_path / "module.py").write_text(
        "import torch\nfrom torch.utils._pytree import tree_flatten\nx = torch._C\n"
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_private_api.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "torch.utils._pytree" in result.stdout and "._C" in result.stdout


PRIVATE_USE = "import torch\nfrom torch.utils._pytree import tree_flatten\nx = torch._C\n"


def _check_tree(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_private_api.py"), str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _write(root: Path, relative: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PRIVATE_USE)


@pytest.mark.parametrize(
    "outside",
    [
        "torch/_offload.py",
        "torch/_compat.py",  # the fence is the package, not a module of that name
        "torch/_compatible.py",
        "torch/_compat_helpers/module.py",
        "plan/torch/_compat/module.py",  # the fence is anchored at the checked root
        "mindspore/_compat/module.py",  # MindSpore's fence is one module
    ],
)
def test_the_fence_is_the_torch_compat_package_and_the_mindspore_compat_module(tmp_path, outside):
    for inside in (
        "torch/_compat/__init__.py",
        "torch/_compat/dispatch.py",
        "torch/_compat/nested/module.py",
        "mindspore/_compat.py",
    ):
        _write(tmp_path, inside)
    passed = _check_tree(tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    _write(tmp_path, outside)
    failed = _check_tree(tmp_path)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert {line.split(":")[0] for line in failed.stdout.splitlines()} == {outside}


def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_private_api", ROOT / "tools" / "check_private_api.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECKER = _checker()


def _flagged(tmp_path, source: str) -> list[str]:
    path = tmp_path / "module.py"
    path.write_text(textwrap.dedent(source))
    return CHECKER.problems(path, "module.py")


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ('def f(t):\n    return getattr(t, "_version", None)\n', "_version"),
        ('def f(cell):\n    return getattr(cell, "_recompute_cell", None)\n', "_recompute_cell"),
        ('def f(m):\n    return hasattr(m, "_hooks")\n', "_hooks"),
        ('def f(m):\n    setattr(m, "_hooks", 1)\n', "_hooks"),
        ('def f(m):\n    delattr(m, "_hooks")\n', "_hooks"),
        ('def f(m):\n    object.__setattr__(m, "_hooks", 1)\n', "_hooks"),
        ('import inspect\ninspect.getattr_static(int, "_hooks")\n', "_hooks"),
    ],
    ids=[
        "getattr",
        "recompute-not-a-recomp-tag",
        "hasattr",
        "setattr",
        "delattr",
        "object-setattr",
        "getattr_static",
    ],
)
def test_the_checker_finds_private_attributes_named_by_a_string(tmp_path, source, name):
    found = _flagged(tmp_path, source)
    assert len(found) == 1 and repr(name) in found[0], found


def test_the_checker_passes_attributes_named_by_a_string_that_are_not_private(tmp_path):
    assert not _flagged(
        tmp_path,
        """
        def f(t, kind, name):
            getattr(t, "_recomp_region", None)  # recomp's own tag
            hasattr(kind, "_fields")            # namedtuple API
            getattr(t, "__dict__", None)
            getattr(t, name)                    # not a constant
            object.__setattr__(t, "_recomp_function", f)

        class C:
            def g(self):
                return getattr(self, "_own", None)
        """,
    )


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("from transformers.modeling_layers import _helper\n", "_helper"),
        ("from peft.tuners._private import x\n", "peft.tuners._private"),
        ("import accelerate._internal\n", "accelerate._internal"),
        ("from functools import _lru_cache_wrapper\n", "_lru_cache_wrapper"),
        ("import mindspore.common._grad_function\n", "mindspore.common._grad_function"),
    ],
    ids=["transformers", "peft", "accelerate", "stdlib", "mindspore"],
)
def test_the_checker_finds_private_imports_of_any_other_package(tmp_path, source, what):
    found = _flagged(tmp_path, source)
    assert len(found) == 1 and what in found[0], found


def test_the_checker_passes_public_imports_and_recomps_own_modules(tmp_path):
    assert not _flagged(
        tmp_path,
        """
        import peft
        from transformers import PreTrainedModel
        from transformers.modeling_layers import GradientCheckpointingLayer
        from recomp._engine import ExcludedRegion
        from .._engine import ExcludedRegion
        from . import _compat
        """,
    )


@pytest.mark.parametrize(
    "source",
    [
        'import importlib\nimportlib.import_module("mindspore.common._grad_function")\n',
        'import sys\nsys.modules["torch.utils._pytree"]\n',
        'import sys\nsys.modules.get("transformers._private")\n',
    ],
    ids=["import_module", "sys.modules[]", "sys.modules.get"],
)
def test_the_checker_finds_private_modules_named_by_a_string(tmp_path, source):
    found = _flagged(tmp_path, source)
    assert len(found) == 1 and "by name" in found[0], found


def test_the_checker_passes_public_modules_named_by_a_string(tmp_path):
    assert not _flagged(
        tmp_path,
        """
        import importlib, sys
        sys.modules.get("transformers.modeling_layers")
        importlib.import_module("recomp._engine")
        sys.modules[name]
        """,
    )


@pytest.mark.parametrize(
    ("source", "name"),
    [
        (
            """
            from torch.utils import flop_counter

            class Counter(flop_counter.FlopCounterMode):
                def _count_flops(self, func_packet, out, args, kwargs):
                    return super()._count_flops(func_packet, out, args, kwargs)
            """,
            "_count_flops",
        ),
        (
            """
            from torch import nn

            class Block(nn.Module):
                _version = 2
            """,
            "_version",
        ),
        (
            """
            import mindspore

            class Block(mindspore.nn.Cell):
                def __init__(self):
                    super().__init__()
                    self._cells = {}
            """,
            "_cells",
        ),
        (
            """
            from ..torch._compat import TorchDispatchMode

            class Recorder(TorchDispatchMode):
                def _next(self):
                    return 1
            """,
            "_next",
        ),
        (
            """
            from ..torch._compat.dispatch import TorchDispatchMode

            class Recorder(TorchDispatchMode):
                def _next(self):
                    return 1
            """,
            "_next",
        ),
    ],
    ids=[
        "method-override",
        "class-attribute",
        "self-attribute",
        "class-from-compat",
        "class-from-a-compat-module",
    ],
)
def test_the_checker_finds_private_names_defined_on_a_subclass_of_another_packages_class(
    tmp_path, source, name
):
    found = _flagged(tmp_path, source)
    assert len(found) == 1 and f"private name {name} defined on a subclass" in found[0], found


def test_the_checker_passes_public_and_tagged_names_on_subclasses_and_private_names_on_own_classes(
    tmp_path,
):
    assert not _flagged(
        tmp_path,
        """
        import ctypes
        from torch import nn

        class Block(nn.Module):
            _recomp_prefix = "Checkpoint"

            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(2, 2)
                self._recomp_region = None

            def helper(self):
                return self.proj

        class Own:
            def _helper(self):
                self._state = 1

        class Info(ctypes.Structure):
            _fields_ = [("n", ctypes.c_int)]
        """,
    )
