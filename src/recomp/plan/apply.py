"""``apply_plan``: wrap a PyTorch model as a plan says, with recomp's public wrappers."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from .planfile import Plan, load_plan
from .policy import selective_context_fn


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, name = path.rpartition(".")
    return (model.get_submodule(head) if head else model), name


def _resolve(model: nn.Module, path: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        raise ValueError(
            f"the plan names {what} {path!r}, which the model does not have: was the plan made "
            "for another model (or for this one before it was wrapped)?"
        ) from exc


def apply_plan(model: nn.Module, plan: Plan | dict[str, Any] | str | os.PathLike[str]) -> nn.Module:
    """Apply ``plan`` (a :class:`Plan`, its dict, or a JSON file path) to ``model`` in place.

    Layers with option ``full`` get ``recomp.torch.checkpoint_wrapper``; with
    ``exclude:A+B`` their sub-modules ``A`` and ``B`` get ``checkpoint_exclude_wrapper``
    and the layer a ``checkpoint_wrapper``; ``selective`` (and ``selective+exclude:...``)
    gives the ``checkpoint_wrapper`` the policy that keeps the outputs of expensive ops
    (``recomp.plan.policy``); ``none`` leaves the layer alone. Every checkpoint gets the
    plan's ``exclude_collectives`` (the profile's: True unless it was made with False),
    so it keeps the results of collectives as predicted. Whatever a
    wrapper returns is assigned back to the parent module, so wrappers that return a new
    module and wrappers that change the module in place both work. Every path is checked
    before anything is wrapped: a plan that does not fit leaves the model unchanged.
    A ``torch.compile`` wrapper gets the plan applied to its original module. Returns
    the model.
    """
    from recomp.torch import (
        CheckpointWrapper,
        ExcludeWrapper,
        _compat,
        checkpoint_exclude_wrapper,
        checkpoint_wrapper,
    )

    plan = load_plan(plan)
    given = model
    # A torch.compile wrapper calls its original module: the plan's paths are the original's.
    model = _compat.compiled_original(model) or model
    work: list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]] = []
    for layer_plan in plan.layers:
        layer = _resolve(model, layer_plan.path, "layer")
        if any(isinstance(m, (CheckpointWrapper, ExcludeWrapper)) for m in layer.modules()):
            raise ValueError(
                f"layer {layer_plan.path!r} is already wrapped by recomp: apply a plan to the "
                "model as it was profiled, without checkpoint wrappers"
            )
        if layer_plan.type is not None and type(layer).__name__ != layer_plan.type:
            raise ValueError(
                f"the plan expects a layer of type {layer_plan.type} at {layer_plan.path!r}, the "
                f"model has a {type(layer).__name__}: the plan was made for another model"
            )
        regions = [
            (path, _resolve(layer, path, f"in layer {layer_plan.path!r} the region"))
            for path in layer_plan.excluded
        ]
        work.append((layer_plan.path, layer, regions))
    for (path, layer, regions), layer_plan in zip(work, plan.layers):
        if not layer_plan.checkpointed:
            continue
        for region_path, region in regions:
            parent, name = _parent(layer, region_path)
            setattr(parent, name, checkpoint_exclude_wrapper(region, name=f"{path}.{region_path}"))
        parent, name = _parent(model, path)
        options: dict[str, Any] = {"exclude_collectives": plan.exclude_collectives}
        if layer_plan.selective:
            options["context_fn"] = selective_context_fn()
        setattr(parent, name, checkpoint_wrapper(layer, **options))
    return given
