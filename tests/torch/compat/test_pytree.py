"""``recomp.torch._compat.pytree``: PyTorch's pytree registry. The test fails when PyTorch
changes what recomp relies on."""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import pytest

torch = pytest.importorskip("torch")

from recomp.torch import _compat  # noqa: E402


def test_pytree_registry_knows_the_ecosystem_containers():
    for kind in (OrderedDict, defaultdict, type(torch.randn(3).topk(1))):
        node = _compat.pytree_node(kind)
        assert node is not None, kind
    flatten, unflatten = _compat.pytree_node(OrderedDict)
    children, context = flatten(OrderedDict(a=1, b=2))
    assert unflatten(children, context) == OrderedDict(a=1, b=2)
    assert _compat.pytree_node(int) is None
