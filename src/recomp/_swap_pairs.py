"""The framework-free half of HyperParallel's ``SwapManager``: layer pairs and group names;
and the slot that holds the swap scope a call runs in.

Each framework's ``SwapManager`` (``recomp.torch._swap``, ``recomp.mindspore._swap``)
derives from :class:`SwapManagerBase` and adds what touches tensors: the hook that
starts a layer's backward, and where its offloader asks which group to bring back.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol


class SwapManagerBase:
    """The process's swap manager (every ``SwapManager()`` is the same object).

    Each recomp checkpoint, swap wrapper or ``swap`` call of a layer moves its tensors
    as one group. In backward, the first read of a layer's group brings back, ahead,
    the group of the layer paired with it by :meth:`set_forward_prefetch_layer`, or,
    when none is set, the group of the layer that ran before it in the forward."""

    #: The framework's layer class (``torch.nn.Module``, ``mindspore.nn.Cell``) and what
    #: error messages call its instances.
    layer_type: ClassVar[type]
    layer_kind: ClassVar[str]
    _instance: ClassVar[SwapManagerBase | None] = None

    pairs: weakref.WeakKeyDictionary[Any, weakref.ref[Any]]
    latest: weakref.WeakKeyDictionary[Any, weakref.ref[Any]]
    names: weakref.WeakKeyDictionary[Any, str]
    count: int

    def __new__(cls) -> Any:
        instance = cls.__dict__.get("_instance")
        if instance is None:
            instance = super().__new__(cls)
            instance.pairs = weakref.WeakKeyDictionary()
            instance.latest = weakref.WeakKeyDictionary()
            instance.names = weakref.WeakKeyDictionary()
            instance.count = 0
            instance._started()
            cls._instance = instance
        return instance

    def _started(self) -> None:
        """Set up the framework's own state (once, when the singleton is made)."""

    def set_forward_prefetch_layer(self, first_layer: Any, second_layer: Any) -> None:
        """In backward, when ``second_layer``'s tensors are first read, bring
        ``first_layer``'s back (``first_layer`` runs before it in the forward)."""
        for layer in (first_layer, second_layer):
            if not isinstance(layer, self.layer_type):
                raise TypeError(
                    f"set_forward_prefetch_layer takes {self.layer_kind}, got {layer!r}."
                )
        self.pairs[second_layer] = weakref.ref(first_layer)

    def unregister_forward_prefetch_layer(self, module: Any) -> None:
        """Forget the pairs ``module`` is in."""
        self.pairs.pop(module, None)
        for second, first in list(self.pairs.items()):
            if first() is module:
                self.pairs.pop(second, None)

    def is_last_layer(self, layer: Any | None) -> bool:
        """Whether ``layer`` ends a chain of pairs: a second layer that is no one's first.
        Its tensors stay on the device (its backward runs first)."""
        if layer is None or layer not in self.pairs:
            return False
        return not any(first() is layer for first in self.pairs.values())

    def paired_before(self, layer: Any | None) -> Any | None:
        """The latest group of the layer paired before ``layer``, if any."""
        first = self.pairs.get(layer) if layer is not None else None
        first_layer = first() if first is not None else None
        ref = self.latest.get(first_layer) if first_layer is not None else None
        return ref() if ref is not None else None

    def on_backward(self, layer: Any | None, outputs: Any, hook: Callable[[Callable[[], None]], bool]) -> None:
        """When the gradient of ``layer``'s output is computed, bring back the group of
        the layer paired before it. ``hook(fn)`` registers ``fn`` on the gradient of one
        of the outputs (the framework's part) and says whether it could."""
        first = self.pairs.get(layer) if layer is not None else None
        first_layer = first() if first is not None else None
        ref = self.latest.get(first_layer) if first_layer is not None else None
        if ref is None:
            return

        def bring_back() -> None:
            group = ref()
            if group is not None:
                group.prefetch()

        hook(bring_back)

    def group_name(self, layer: Any | None, function: Any) -> str:
        """The name of ``layer``'s groups (``swap_group_<n>``, in order of first use)."""
        if layer is None:
            return f"swap of {getattr(function, '__qualname__', type(function).__name__)}"
        name = self.names.get(layer)
        if name is None:
            name = self.names[layer] = f"swap_group_{self.count}"
            self.count += 1
        return name

    def group_recorded(self, layer: Any | None, group: Any) -> None:
        """``group`` holds what ``layer``'s latest call moved."""
        if layer is not None:
            self.latest[layer] = weakref.ref(group)

    def paired(self, group: Any) -> Any:
        """The group to bring back when ``group`` is first read: its layer's pair's, or
        None (no pairs set, or its layer has none)."""
        if not self.pairs:
            return None
        for layer, ref in list(self.latest.items()):
            if ref() is group:
                return self.paired_before(layer)
        return None



class _Abortable(Protocol):
    def abort(self) -> None: ...


class ScopeSlot:
    """The swap scope the current thread or task runs in (a context variable): the group of
    the innermost recomp checkpoint, ``swap`` or swap wrapper call. A scope left by an
    exception is aborted (what it had not moved yet is dropped)."""

    def __init__(self, name: str) -> None:
        self._var: contextvars.ContextVar[Any] = contextvars.ContextVar(
            name, default=None
        )

    def current(self) -> Any:
        """The framework's ``SwapScope`` the call runs in, or None."""
        return self._var.get()

    @contextlib.contextmanager
    def active(self, scope: _Abortable) -> Iterator[Any]:
        token = self._var.set(scope)
        try:
            yield scope
        except BaseException:
            scope.abort()
            raise
        finally:
            self._var.reset(token)
