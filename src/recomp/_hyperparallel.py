"""What ``recomp.torch.hyperparallel`` and ``recomp.mindspore.hyperparallel`` share:
HyperParallel's no-op ``context_fn`` and the checks its ``checkpoint`` makes."""

from __future__ import annotations

import contextlib
from typing import Any


class NoopContexts(tuple):  # type: ignore[type-arg]
    """Two null contexts (a forward and a replay context) that are also the
    ``context_fn`` returning them: what :func:`noop_context_fn` returns.

    HyperParallel's ``noop_context_fn()`` returns a ``context_fn``; code also passes the
    function itself as one (``context_fn=noop_context_fn``), whose call must then give
    the two contexts. Both work: calling this gives itself, and it unpacks as the two
    contexts. A null context holds no state, so one pair serves every call."""

    __slots__ = ()

    def __new__(cls) -> NoopContexts:
        return super().__new__(cls, (contextlib.nullcontext(), contextlib.nullcontext()))

    def __call__(self) -> NoopContexts:
        return self

    def __repr__(self) -> str:
        return "noop_context_fn()"


_NOOP = NoopContexts()


def noop_context_fn() -> NoopContexts:
    """HyperParallel's no-op ``context_fn``: ``checkpoint(..., context_fn=noop_context_fn())``
    adds no context. ``context_fn=noop_context_fn`` (the function itself) works too; see
    :class:`NoopContexts`. A checkpoint given either treats it as no ``context_fn``
    (which ``torch.compile`` requires)."""
    return _NOOP


def without_noop(context_fn: Any) -> Any:
    """``context_fn``, or None for :func:`noop_context_fn` and what it returns."""
    if context_fn is noop_context_fn or context_fn is _NOOP:
        return None
    return context_fn


def check_early_stop(early_stop: Any) -> None:
    """HyperParallel's ``checkpoint`` takes a bool ``early_stop`` only (a ``ValueError``)."""
    if not isinstance(early_stop, bool):
        raise ValueError(
            f"early_stop must be a bool (True or False), got {type(early_stop).__name__} "
            f"{early_stop!r}."
        )


def wrapper_options(options: dict[str, Any], early_stop: bool | None) -> dict[str, Any]:
    """HyperParallel's ``checkpoint_wrapper`` options as recomp's, on both frameworks:
    ``early_stop`` a bool (``early_stop`` here: its default, None for none), no
    ``use_reentrant`` (not followed), HyperParallel's no-op ``context_fn`` as none."""
    options = dict(options)
    if early_stop is not None:
        options.setdefault("early_stop", early_stop)
    if "early_stop" in options:
        check_early_stop(options["early_stop"])
    options.pop("use_reentrant", None)
    if "context_fn" in options and without_noop(options["context_fn"]) is None:
        del options["context_fn"]
    return options
