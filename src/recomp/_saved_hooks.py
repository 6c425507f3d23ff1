"""A user's ``saved_tensors_hooks=(pack, unpack)`` on an excluded region: a placement
(``recomp._hooks.Placement``) that hands each tensor the region keeps for its backward
(saved tensors and the cached output; not parameters, deferred inputs or the
checkpoint's own inputs, which are kept elsewhere) to ``pack`` once, and gives
``unpack`` what ``pack`` returned each time backward or a replay reads it."""

from __future__ import annotations

from typing import Any


def check_hooks_pair(hooks: Any, api: str) -> tuple[Any, Any]:
    """``saved_tensors_hooks=(pack, unpack)``: two callables, checked before anything runs."""
    if (
        not isinstance(hooks, (tuple, list))
        or len(hooks) != 2
        or not all(callable(h) and not isinstance(h, type) for h in hooks)
    ):
        raise ValueError(
            f"{api}(..., saved_tensors_hooks=...) takes a pair (pack, unpack) of callables: "
            f"pack(tensor) returns what to keep, unpack(kept) returns the tensor; got "
            f"{hooks!r}. Pass saved_tensors_hooks=(pack, unpack)."
        )
    return hooks[0], hooks[1]


def exclude_placer(offload: Any, hooks: Any, resolve: Any) -> Any:
    """The placer of ``checkpoint_exclude_wrapper(..., offload=..., saved_tensors_hooks=...)``
    (``resolve``: the framework's reading of ``offload``); the two exclude each other."""
    placer = resolve(offload)
    if hooks is None:
        return placer
    user = UserHooks(hooks, "checkpoint_exclude_wrapper")
    if placer is not None:
        raise ValueError(
            "checkpoint_exclude_wrapper(..., saved_tensors_hooks=...) cannot be combined with "
            "offload: both decide where the region's kept tensors live. Pass one of them "
            "(a pack hook can copy to the host itself)."
        )
    return user


class UserHooks:
    """The region option: one placement per region call. Equal when given the same pair,
    so that a region wrapped again inline with the same pair is the same region."""

    __slots__ = ("pack", "unpack")

    def __init__(self, hooks: Any, api: str) -> None:
        self.pack, self.unpack = check_hooks_pair(hooks, api)

    def __eq__(self, other: object) -> bool:
        # ``==``: a bound method is a new object at each attribute read.
        return (
            isinstance(other, UserHooks)
            and bool(other.pack == self.pack)
            and bool(other.unpack == self.unpack)
        )

    __hash__ = None  # type: ignore[assignment]

    def open_group(self, name: str) -> _Placement:
        return _Placement(self)

    def input_hooks(self) -> tuple[Any, Any]:
        """The pair for what a checkpoint saves of its inputs. An empty tensor holds no
        memory and stays as it is, unseen by ``pack``: PyTorch's checkpoint in older releases
        (2.9) saves an empty placeholder of its own beside the inputs."""
        pack, unpack = self.pack, self.unpack

        def pack_input(tensor: Any) -> Any:
            if tensor.numel() == 0:
                return tensor
            return _Packed(unpack, pack(tensor))

        return pack_input, _unpack_input


def _unpack_input(held: Any) -> Any:
    return held.get() if isinstance(held, _Packed) else held


class _Placement:
    __slots__ = ("hooks",)

    def __init__(self, hooks: UserHooks) -> None:
        self.hooks = hooks

    def put(self, tensor: Any) -> _Packed:
        return _Packed(self.hooks.unpack, self.hooks.pack(tensor))

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class _Packed:
    """What ``pack`` returned for one tensor (``recomp._hooks.Held``)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, unpack: Any, packed: Any) -> None:
        self.unpack = unpack
        self.packed = packed

    def get(self) -> Any:
        return self.unpack(self.packed)

    def changed(self) -> bool:
        return False
