"""Any layer class can be wrapped, whatever its bases put first (the ``fw`` fixture,
``tests/support/frameworks.py``): Megatron-Core's ``class Router(ABC, MegatronModule)``,
``Generic[T]`` first, a class with ``__slots__``. The wrapped layer keeps its class name,
``isinstance``, parameter names and exact gradients, copies stay wrapped, and
``unwrap`` gives the class back (see NOTE [ Keeping the instance layout of a wrapped
class ] in ``recomp._wrapping``).
"""

from __future__ import annotations

import abc
import copy
from typing import Any, Generic, TypeVar

import pytest

from frameworks import assert_same
from recomp._wrapping import recomp_wrapper_of

T = TypeVar("T")


class _SlotFree:
    __slots__ = ()


class _Slotted:
    __slots__ = ("extra",)


LEADING_BASES = {
    "abc_first": abc.ABC,
    "generic_first": Generic[T],  # type: ignore[valid-type]
    "slot_free_mixin_first": _SlotFree,
    # A base with slots of its own: PyTorch only (a Cell's C++ layout excludes one).
    "slots_first": _Slotted,
}


def layer_classes(fw, lead: Any) -> tuple[type, type]:
    """(Outer, Inner) layer classes whose bases put ``lead`` before the framework's
    layer class, through an intermediate class as Megatron-Core's ``MegatronModule``."""
    root = fw.nn.Module if fw.name == "torch" else fw.nn.Cell

    class FrameworkLayer(root):  # type: ignore[misc, valid-type]
        pass

    class Router(lead, FrameworkLayer):  # type: ignore[misc, valid-type]
        @abc.abstractmethod
        def route(self, x: Any) -> Any: ...

        def __init__(self, **children: Any) -> None:
            super().__init__()
            for key, child in children.items():
                setattr(self, key, child)

    class Inner(Router):
        def route(self, x: Any) -> Any:
            return fw.ops.tanh(self.proj(x))

    class Outer(Router):
        def route(self, x: Any) -> Any:
            return self.out(self.inner(x) * fw.ops.sin(x))

    setattr(Inner, fw.method, lambda self, x: self.route(x))
    setattr(Outer, fw.method, lambda self, x: self.route(x))
    return Outer, Inner


@pytest.mark.parametrize("lead", sorted(LEADING_BASES))
def test_a_layer_whose_bases_put_another_class_first_is_wrapped(fw, lead):
    if lead == "slots_first" and fw.name == "mindspore":
        pytest.skip("a Cell cannot also derive from a class with slots")
    Outer, Inner = layer_classes(fw, LEADING_BASES[lead])
    ref, model = fw.twins(lambda: Outer(inner=Inner(proj=fw.dense(4, 4)), out=fw.dense(4, 4)))
    names = [name for name, _ in fw.named_layers(model)]
    params = [getattr(p, "name", None) for p in fw.parameters(model)]
    fw.api.checkpoint_exclude_wrapper(model.inner)
    fw.api.checkpoint_wrapper(model)
    assert recomp_wrapper_of(model) is fw.api.CheckpointWrapper
    assert recomp_wrapper_of(model.inner) is fw.api.ExcludeWrapper
    assert isinstance(model, Outer) and isinstance(model.inner, Inner)
    assert fw.class_name(model) == "Outer" and fw.class_name(model.inner) == "Inner"
    assert [name for name, _ in fw.named_layers(model)] == names
    assert [getattr(p, "name", None) for p in fw.parameters(model)] == params
    x = fw.tensor(3, 4)
    for step in (1, 2):
        loss_ref, g_ref = fw.grads(ref, x)
        loss, g = fw.grads(model, x)
        assert_same([loss_ref], [loss])
        assert_same(g_ref, g)
        assert model.inner.region_runs == step
    clone = copy.deepcopy(model)  # (local classes do not pickle)
    assert recomp_wrapper_of(clone) is fw.api.CheckpointWrapper
    assert_same(fw.grads(ref, x)[1], fw.grads(clone, x)[1])
    fw.api.unwrap(model)
    assert type(model) is Outer and type(model.inner) is Inner
    assert_same(fw.grads(ref, x)[1], fw.grads(model, x)[1])
