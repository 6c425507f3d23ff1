"""The pytree walker remembers leaf types per registry, and forgets them when a type is
registered: a walk under one registry never decides what another registry's walk sees."""

from __future__ import annotations

import pytest

from recomp import _pytree


class Pair:
    """A container only the test registries know."""

    def __init__(self, a, b):
        self.a, self.b = a, b


def _pair_node(kind):
    if kind is Pair:
        return (lambda p: ([p.a, p.b], None)), (lambda children, _: Pair(*children))
    return None


def test_a_leaf_for_the_plain_walk_is_still_a_node_for_a_registry():
    pair = Pair(1, 2)
    leaves, spec = _pytree.flatten(pair)  # no registry: a leaf, and remembered as one
    assert leaves == [pair] and spec.kind == "leaf"

    registry = _pytree.Registry(_pair_node)
    leaves, spec = _pytree.flatten(pair, registry)
    assert leaves == [1, 2]
    assert spec.kind == "registered"
    rebuilt = _pytree.unflatten(["x", "y"], spec)
    assert type(rebuilt) is Pair and (rebuilt.a, rebuilt.b) == ("x", "y")


def test_a_type_registered_after_its_first_walk_is_looked_into_from_then_on():
    known: dict[type, object] = {}
    registry = _pytree.Registry(known.get, lambda: len(known))  # type: ignore[arg-type]
    pair = Pair(1, 2)
    assert _pytree.flatten(pair, registry)[0] == [pair]
    known[Pair] = _pair_node(Pair)
    assert _pytree.flatten(pair, registry)[0] == [1, 2]


def test_torch_registry_after_a_plain_walk():
    torch = pytest.importorskip("torch")
    from torch.utils import _pytree as torch_pytree

    from recomp.torch._backend import BACKEND

    class Registered:
        def __init__(self, t):
            self.t = t

    x = torch.ones(2)
    # A plain walk (MindSpore's, or the opaque-tensor check) sees it first: a leaf.
    assert _pytree.flatten(Registered(x))[1].kind == "leaf"
    torch_pytree.register_pytree_node(
        Registered, lambda r: ([r.t], None), lambda children, _: Registered(children[0])
    )
    try:
        leaves, spec = BACKEND.flatten(Registered(x))
        assert leaves == [x] and spec.kind == "registered"
        assert BACKEND.opaque_tensors(Registered(x)) == ["t"]  # the plain walk still can't see
    finally:
        torch_pytree._deregister_pytree_node(Registered)
