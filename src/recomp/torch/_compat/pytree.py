"""PyTorch's pytree registry, read by recomp's own walker of region outputs.

Consumer: ``torch/_backend.py`` (the registry it hands the framework-free walker).
Tested by ``tests/torch/compat/test_pytree.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def pytree_node(kind: type) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]] | None:
    """(flatten, unflatten) for a type registered as a PyTorch pytree node, else None.

    Why: PyTorch's pytree registry knows the containers of the ecosystem
    (``torch.return_types``, ``OrderedDict``, ``defaultdict``, ``deque``; transformers
    registers ``ModelOutput``; users register their own), so a region's outputs are
    rebuilt exactly as the ecosystem defines them.
    If it changes: None, and recomp's own walker handles the built-in containers,
    their subclasses and dataclasses.
    Retired by: a public pytree registry lookup (``torch.utils.pytree``).
    """
    node = _SUPPORTED_NODES.get(kind) if _SUPPORTED_NODES is not None else None
    if node is None:
        return None
    return node.flatten_fn, node.unflatten_fn


def _supported_nodes() -> dict[type, Any] | None:
    try:
        from torch.utils import _pytree
    except ImportError:
        return None
    nodes = getattr(_pytree, "SUPPORTED_NODES", None)
    return nodes if isinstance(nodes, dict) else None


_SUPPORTED_NODES = _supported_nodes()


#: A number that changes when a type is registered as a PyTorch pytree node: the
#: registry's size (a builtin, as it is read on every walk).
#: Why: recomp's walker remembers which types are leaves; a type registered after it
#: was first walked must be looked into from then on.
#: If it changes: without the registry it is always 0, and so is nothing remembered wrongly.
#: Retired by: a registry that announces registrations, or no leaf cache.
pytree_generation: Callable[[], int] = (
    _SUPPORTED_NODES.__len__ if _SUPPORTED_NODES is not None else int
)
