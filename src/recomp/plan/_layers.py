"""Finding a model's checkpointable layers: what the eager and the compiled profiles
share (``profiler``, ``compiled``) and how ``recomp bench`` finds its layers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from ..torch import _compat

LayerSpec = Callable[[nn.Module], bool] | Sequence[str] | None


def find_layers(model: nn.Module, layers: LayerSpec = None) -> list[tuple[str, nn.Module]]:
    """The checkpointable layers: ``model.layers`` by default (or the one ``nn.ModuleList``
    named ``layers`` below the model, as ``model.model.layers`` of a Hugging Face causal
    LM; else, on a Hugging Face model, the outermost sub-modules whose class its
    ``_no_split_modules`` names, those in a ``ModuleList`` if any are: its decoder or
    encoder layers, not BERT's embeddings), the sub-modules for which
    a predicate holds (outermost matches), or sub-module paths."""
    if layers is None:
        stack = getattr(model, "layers", None)
        if stack is None:
            # Wrapped stacks (model.model.layers in HF causal LMs): one ModuleList "layers".
            lists = [
                m
                for name, m in model.named_modules()
                if name.rpartition(".")[2] == "layers" and isinstance(m, nn.ModuleList)
            ]
            if len(lists) == 1:
                stack = lists[0]
        if stack is None:
            names = _compat.hf_no_split_modules(model)
            if names:
                named = find_layers(model, lambda m: type(m).__name__ in names)
                # _no_split_modules also names one-off modules (BERT's embeddings): the
                # layers are the ones stacked in a ModuleList, where there are such.
                stacked = [
                    (path, m)
                    for path, m in named
                    if isinstance(model.get_submodule(path.rpartition(".")[0]), nn.ModuleList)
                ]
                return stacked or named
            raise ValueError(
                f"{type(model).__name__} has no attribute `layers` (nor one nn.ModuleList named "
                "`layers` below it, nor Hugging Face's _no_split_modules): pass layers= (a "
                "predicate such as lambda m: isinstance(m, DecoderLayer), or a list of "
                "sub-module paths)"
            )
        prefix = _path_of(model, stack)
        return [(f"{prefix}.{i}" if prefix else str(i), m) for i, m in enumerate(stack)]
    if callable(layers):
        found = outermost_matches(model, layers)
        if not found:
            raise ValueError("the layers= predicate matched no sub-module of the model")
        return found
    out = []
    for path in layers:
        try:
            out.append((path, model.get_submodule(path)))
        except AttributeError as exc:
            raise ValueError(f"layers=: the model has no sub-module {path!r}") from exc
    return out


def outermost_matches(
    module: nn.Module, predicate: Callable[[nn.Module], bool]
) -> list[tuple[str, nn.Module]]:
    """The sub-modules of ``module`` for which ``predicate`` holds, with their paths, not
    looking inside a match (a match inside a match is part of it)."""
    found: list[tuple[str, nn.Module]] = []

    def visit(parent: nn.Module, path: str) -> None:
        for name, child in parent.named_children():
            child_path = f"{path}.{name}" if path else name
            if predicate(child):
                found.append((child_path, child))
            else:
                visit(child, child_path)

    visit(module, "")
    return found


def _path_of(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ValueError("model.layers is not a sub-module of the model (use an nn.ModuleList)")
