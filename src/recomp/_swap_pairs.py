"""The framework-free half of HyperParallel's swap names: the ``SwapManager``'s layer pairs
and group names; the slot that holds the swap scope a call runs in, and the ways a call
gets one (a layer's call, a block of its own, the hooks ``swap_wrapper`` puts on a layer).

Each framework's ``SwapManager`` (``recomp.torch._swap.manager``, ``recomp.mindspore._swap``)
derives from :class:`SwapManagerBase` and adds what touches tensors (which outputs take
a gradient hook, where its offloader asks which group to bring back); each framework's
``SwapScope`` chooses and moves the tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterable, Iterator
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

    def grad_outputs(self, outputs: Any) -> Iterator[Any]:
        """The tensors of ``outputs`` whose gradient is computed (the framework's part)."""
        raise NotImplementedError

    def prefetch_on_backward(self, layer: Any | None, outputs: Any) -> None:
        """When the gradient of ``layer``'s output is computed (the start of its backward),
        bring back the group of the layer paired before it."""
        first = self.pairs.get(layer) if layer is not None else None
        first_layer = first() if first is not None else None
        ref = self.latest.get(first_layer) if first_layer is not None else None
        if ref is None:
            return

        def bring_back(grad: Any) -> None:
            group = ref()
            if group is not None:
                group.prefetch()

        for t in self.grad_outputs(outputs):
            t.register_hook(bring_back)
            return

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



class _Scope(Protocol):
    def finish(self, outputs: Any) -> None: ...

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
    def active(self, scope: _Scope) -> Iterator[Any]:
        token = self._var.set(scope)
        try:
            yield scope
        except BaseException:
            scope.abort()
            raise
        finally:
            self._var.reset(token)

    @contextlib.contextmanager
    def layer_call(
        self, scope: _Scope, hooks: contextlib.AbstractContextManager[Any] | None = None
    ) -> Iterator[Callable[[Any], Any]]:
        """One call of a layer in ``scope`` (with ``hooks``, the framework's saved-tensors
        hooks, inside it): yields ``finish(outputs)``, which the call's result goes
        through (the scope moves what it chose) and which returns it."""

        def finish(out: Any) -> Any:
            scope.finish(out)
            return out

        with self.active(scope):
            if hooks is None:
                yield finish
            else:
                with hooks:
                    yield finish


class OwnScopes:
    """For a block that is a swap scope of its own where none is around it
    (``async_save_on_cpu`` outside a layer): the scope ``make()`` gives is finished when
    the block ends without an exception, aborted otherwise. Re-enterable."""

    def __init__(self, slot: ScopeSlot, make: Callable[[], _Scope]) -> None:
        self.slot = slot
        self.make = make
        self.entered: list[tuple[_Scope, Any] | None] = []

    def enter(self) -> None:
        own = None
        if self.slot.current() is None:
            scope = self.make()
            active = self.slot.active(scope)
            active.__enter__()
            own = (scope, active)
        self.entered.append(own)

    def exit(self, *exc_info: Any) -> None:
        own = self.entered.pop()
        if own is None:
            return
        scope, active = own
        try:
            if exc_info[0] is None:
                scope.finish(None)
        finally:
            active.__exit__(*exc_info)


class SwapHooks:
    """The forward pre-hook and forward hook ``swap_wrapper`` puts on a layer: each call
    runs in what ``open_call(layer)`` gives (a :meth:`ScopeSlot.layer_call`, or None for
    a plain call)."""

    def __init__(
        self, open_call: Callable[[Any], contextlib.AbstractContextManager[Any] | None]
    ) -> None:
        self.open_call = open_call
        self.active: list[tuple[Any, Any]] = []
        self.handles: list[Any] = []

    def before(self, layer: Any, args: Any) -> None:
        call = self.open_call(layer)
        finish = call.__enter__() if call is not None else None
        self.active.append((call, finish))

    def after(self, layer: Any, args: Any, output: Any) -> None:
        call, finish = self.active.pop()
        if call is None:
            return
        if output is None:  # the forward raised (an always-called hook) or returned nothing
            failed = RuntimeError("the layer's forward raised")
            call.__exit__(RuntimeError, failed, None)  # aborts the scope
            return
        try:
            finish(output)
        finally:
            call.__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class SwapWrappers:
    """The layers ``swap_wrapper`` put :class:`SwapHooks` on (held weakly)."""

    def __init__(self) -> None:
        self.hooks: weakref.WeakKeyDictionary[Any, SwapHooks] = weakref.WeakKeyDictionary()

    def install(self, layer: Any, hooks: SwapHooks) -> Any:
        """Put ``hooks`` on ``layer`` in place of those it had; returns ``layer``."""
        old = self.hooks.pop(layer, None)
        if old is not None:
            old.remove()
        hooks.handles = [
            layer.register_forward_pre_hook(hooks.before),
            layer.register_forward_hook(hooks.after, always_call=True),
        ]
        self.hooks[layer] = hooks
        return layer

    def remove(self, layers: Iterable[Any]) -> bool:
        """Take the hooks off ``layers``; whether any had some."""
        if not self.hooks:
            return False
        removed = False
        for layer in layers:
            hooks = self.hooks.pop(layer, None)
            if hooks is not None:
                hooks.remove()
                removed = True
        return removed
