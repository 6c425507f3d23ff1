"""``apply_plan``: wrap a PyTorch model as a plan says, with recomp's public wrappers."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from .planfile import Plan, load_plan
from .policy import offload_policy, partitioner_context_fn, selective_context_fn


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, name = path.rpartition(".")
    return (model.get_submodule(head) if head else model), name


def _resolve(model: nn.Module, path: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        raise ValueError(
            f"the plan names {what} {path!r}, which the model does not have (it has "
            f"{_nearest_children(model, path)}): the plan was made for another model (or for "
            "this one before it was wrapped); make the plan for this model"
        ) from exc


def _nearest_children(model: nn.Module, path: str) -> str:
    """The sub-modules of the deepest module on ``path`` that exists, as paths."""
    parts = path.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        head = ".".join(parts[:depth])
        try:
            parent = model.get_submodule(head)
        except AttributeError:
            continue
        names = [f"{head}.{n}" if head else n for n, _ in parent.named_children()]
        return _listed(names) if names else f"no sub-module at {head or 'its top'}"
    return "none of it"  # not reached: the model itself exists


def _listed(paths: list[str], limit: int = 6) -> str:
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(repr(p) for p in paths[:limit]) + more


def _check_layer_counts(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan made for a model with fewer layers: where the plan's layers sit in a
    ``ModuleList``/``Sequential``, every layer of the same class there must be planned,
    or the ones left over would train without the memory the plan was made for."""
    planned = [layer.path for layer in plan.layers]
    by_parent: dict[str, list[str]] = {}
    for path in planned:
        by_parent.setdefault(path.rpartition(".")[0], []).append(path)
    for parent_path, paths in by_parent.items():
        parent = model.get_submodule(parent_path) if parent_path else model
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            continue
        classes = {type(model.get_submodule(p)).__name__ for p in paths}
        same = [
            f"{parent_path}.{name}" if parent_path else name
            for name, child in parent.named_children()
            if type(child).__name__ in classes
        ]
        left = [p for p in same if p not in planned]
        if left:
            where = repr(parent_path) if parent_path else "the model"
            raise ValueError(
                f"the plan was made for {len(paths)} layer(s) in {where} ({_listed(paths)}), "
                f"the model has {len(same)} there ({_listed(same)}): {_listed(left)} would be "
                "left out of the plan. The plan was made for another model: make the plan for "
                "this one (recomp plan, or profile and make_plan); nothing was wrapped"
            )


def apply_plan(
    model: nn.Module,
    plan: Plan | dict[str, Any] | str | os.PathLike[str],
    *,
    partition_inputs: Any = None,
) -> nn.Module:
    """Apply ``plan`` (a :class:`Plan`, its dict, or a JSON file path) to ``model`` in place.

    Layers with option ``full`` get ``recomp.torch.checkpoint_wrapper``; with
    ``exclude:A+B`` their sub-modules ``A`` and ``B`` get ``checkpoint_exclude_wrapper``
    and the layer a ``checkpoint_wrapper``; ``selective`` (and ``selective+exclude:...``)
    gives the ``checkpoint_wrapper`` the policy that keeps the outputs of expensive ops
    (``recomp.plan.policy``); ``none`` leaves the layer alone. A compiled plan's
    ``partitioner`` layers are left alone too, and ``partitioner+exclude:A+B`` wraps ``A``
    and ``B`` as exclusions inside a checkpoint whose policy leaves every other op to
    PyTorch's partitioner: compiled, the regions are never recomputed (compile the model
    with the plan's budget: :func:`recomp.plan.compile_with_plan`). ``full+swap-inputs``
    gives the ``checkpoint_wrapper`` ``swap_inputs=True``; ``swap`` gives the layer
    ``recomp.torch.swap_wrapper`` (no checkpoint), and ``offload`` the same with
    ``recomp.plan.policy.offload_policy`` (the storages of at least 1 MiB move);
    ``exclude-offload:A+B`` is ``exclude:A+B`` with ``offload=True`` on the regions
    (what they keep waits on the host); ``full+partition-inputs`` gives the
    ``checkpoint_wrapper`` ``partition_inputs=`` the process group given here as
    ``partition_inputs`` (the tensor-parallel group the plan was made for: required
    when the plan has such a layer). Every checkpoint gets
    the plan's ``exclude_collectives`` (the profile's: True unless it was made with
    False), so it keeps the results of collectives as predicted, but those of
    ``full+replay-collectives`` (and ``...+exclude:A+B``), which get
    ``exclude_collectives=False``: their replay runs the collectives again. Whatever a wrapper
    returns is assigned back to the parent module, so wrappers that return a new
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
        swap_wrapper,
    )

    plan = load_plan(plan)
    partitioned = [lp.path for lp in plan.layers if lp.partition_inputs]
    if partitioned and partition_inputs is None:
        raise ValueError(
            f"the plan keeps the inputs of {_listed(partitioned)} split over the "
            "tensor-parallel ranks (full+partition-inputs): give apply_plan(..., "
            "partition_inputs=group), the tensor-parallel process group; nothing was wrapped"
        )
    given = model
    # A torch.compile wrapper calls its original module: the plan's paths are the original's.
    model = _compat.compiled_original(model) or model
    work: list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]] = []
    for layer_plan in plan.layers:
        _resolve(model, layer_plan.path, "layer")
    _check_layer_counts(model, plan)
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
        if layer_plan.swapped or layer_plan.offloaded:
            parent, name = _parent(model, path)
            policy = offload_policy if layer_plan.offloaded else None
            setattr(parent, name, swap_wrapper(layer, policy_fn=policy))
            continue
        if not layer_plan.checkpointed:
            continue
        for region_path, region in regions:
            parent, name = _parent(layer, region_path)
            wrapped = checkpoint_exclude_wrapper(
                region, name=f"{path}.{region_path}", offload=layer_plan.offloads_regions
            )
            setattr(parent, name, wrapped)
        parent, name = _parent(model, path)
        keep = plan.exclude_collectives and not layer_plan.replays_collectives
        options: dict[str, Any] = {"exclude_collectives": keep}
        if layer_plan.selective:
            options["context_fn"] = selective_context_fn()
        elif layer_plan.partitioner:
            options["context_fn"] = partitioner_context_fn()
        elif layer_plan.swap_inputs:
            options["swap_inputs"] = True
        elif layer_plan.partition_inputs:
            options["partition_inputs"] = partition_inputs
        setattr(parent, name, checkpoint_wrapper(layer, **options))
    return given


def compile_with_plan(
    model: nn.Module, plan: Plan | dict[str, Any] | str | os.PathLike[str], **compile_kwargs: Any
) -> nn.Module:
    """Apply a compiled plan (``recomp.plan.profile(torch.compile(model), ...)``) to
    ``model`` and compile it: ``torch.compile(model, backend=<the plan's>,
    **compile_kwargs)`` (``mode``, ``options``, ``fullgraph``, ``dynamic`` as there),
    whose every call runs with the plan's ``torch._functorch.config.
    activation_memory_budget`` (the partitioner reads it when a graph is compiled, at
    the first call and at any recompilation), leaving the setting as it was outside.
    The model is compiled separately from any other model of its class (Dynamo would
    otherwise reuse a graph compiled under another budget). Returns the compiled
    module."""
    import torch

    from recomp.torch import _compat

    plan = load_plan(plan)
    if plan.compiled is None:
        raise ValueError(
            "this plan was made for an eager model: apply it with apply_plan(model, plan) and "
            "compile the model as usual, or make a compiled plan from "
            "profile(torch.compile(model), ...)"
        )
    if _compat.compiled_original(model) is not None:
        raise ValueError(
            "compile_with_plan compiles the model itself: pass the module, not "
            "torch.compile(module)"
        )
    backend = compile_kwargs.pop("backend", plan.compiled["backend"])
    if not isinstance(backend, str):
        raise ValueError(
            "compile_with_plan takes the backend by name (inductor, aot_eager): the plan was "
            f"made for {plan.compiled['backend']!r}"
        )
    # A backend object of its own: Dynamo would otherwise hand this model the graph it
    # compiled for another instance of its class, under another budget (see _compat).
    own = _compat.separate_backend(
        backend, compile_kwargs.pop("mode", None), compile_kwargs.pop("options", None)
    )
    apply_plan(model, plan)
    compiled: Any = torch.compile(model, backend=own, **compile_kwargs)
    budget = float(plan.compiled["activation_memory_budget"])
    active: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        setting = _compat.activation_memory_budget(budget)
        setting.__enter__()
        active.append(setting)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if active:
            active.pop().__exit__(None, None, None)

    compiled.register_forward_pre_hook(enter)
    compiled.register_forward_hook(leave, always_call=True)
    return compiled  # type: ignore[no-any-return]
