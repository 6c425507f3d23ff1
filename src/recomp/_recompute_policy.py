"""HyperParallel's declarative recompute regions, framework-free: ``RecomputePolicy`` (what
its model adapters declare), ``ActivationCheckpointSelection`` (which layers its trainer
config chooses), the application of the two to a model, and ``apply_submodule_checkpointing``
(its checkpoints on a layer's attention, MLP and norms). ``recomp.torch.hyperparallel`` and
``recomp.mindspore.hyperparallel`` give them HyperParallel's names, with each framework's
wrappers.

NOTE [ Declared recompute regions ]
A ``RecomputePolicy`` says, for one model, where a replay is safe: ``region_patterns`` name
the modules whose forward may run again, ``exclude_patterns`` the modules inside them that
must run once (the producer or consumer of a state shared across layers, a cache writer, a
collective). ``apply_recompute_policy`` reads both as recomp selections (module paths with
``fnmatch`` wildcards, matched against the end of each module's dotted path at a dot, so
that HyperParallel's full paths select the modules they select there), holds the regions
to the chosen layers (``LayerChoice``: NOTE [ A model's layers ] in ``_selection.py``) and
plans the whole wrapping before changing anything (``_wrapping.plan_checkpointing``):

  - each outermost module ``region_patterns`` selects in the chosen layers is a checkpoint
    (a layer pattern gives one region per layer, keeping one copy of its input; leaf
    patterns give one per sub-module);
  - inside the regions, each outermost module ``exclude_patterns`` selects is an excluded
    region. HyperParallel also wraps the deeper matches, deepest first; here what is
    inside an excluded region already runs once, with it, so those add nothing.

Refused, nothing wrapped (``SelectionError``, a ``ValueError``, where a selection is at
fault; ``ValueError`` otherwise; ``TypeError`` for a policy of the wrong type): a policy
without region patterns; a pattern that matches no module of the model; region patterns
that select no module in the chosen layers; exclude patterns that select nothing inside
the regions; a region that is itself excluded (it would be checkpointed and run once); a
bad layer choice (both or neither of ``layer_count`` and ``layer_indices``, a negative or
repeated index, an index past the last layer, a count above the number of layers). Only
then are Hugging Face's own checkpointing turned off (each region would be checkpointed
twice) and the modules wrapped; with ``swap_inputs``, the regions at one place in
consecutive chosen layers of one container are paired for prefetch (``SwapManager``);
last, ``on_applied(model)`` runs once. ``layer_count=0`` checks the policy and wraps
nothing. Without a selection the regions are taken anywhere in the model.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ._selection import LayerChoice, Selection, find_layers, walk_named
from ._wrapping import ModelOps, check_model, check_wrappable, plan_checkpointing, recomp_wrapper_of
from .errors import SelectionError

#: ``ActivationCheckpointSelection.source``: HyperParallel's whole-layer modes, and the
#: model's declared regions.
SOURCES = ("default", "model_adapter_safe_regions")


@dataclass(frozen=True)
class RecomputePolicy:
    """Where one model may be recomputed (HyperParallel's ``RecomputePolicy`` of
    ``hyper_parallel.models.adapter_spec``, the same fields).

    ``region_patterns``: module paths (``fnmatch`` wildcards) of the regions to
    checkpoint, such as ``("model.layers.*",)`` for whole layers or
    ``("model.layers.*.mlp", "model.layers.*.input_layernorm")`` for parts of them.
    ``exclude_patterns``: module paths inside those regions that run once and are not
    replayed (``("model.layers.*.self_attn",)``). ``on_applied``: called with the model
    once the regions are in place. A list is taken as a tuple; a lone string, an empty
    pattern or an ``on_applied`` that cannot be called raises ``TypeError``. An empty
    ``region_patterns`` is accepted here and refused when applied, as in HyperParallel."""

    region_patterns: tuple[str, ...]
    exclude_patterns: tuple[str, ...] = ()
    on_applied: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        for name in ("region_patterns", "exclude_patterns"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (tuple, list)):
                raise TypeError(
                    f"RecomputePolicy.{name} must be a tuple of module path patterns, such "
                    f"as ('model.layers.*',); got {type(value).__name__} ({value!r})."
                )
            bad = [p for p in value if not isinstance(p, str) or not p.strip()]
            if bad:
                raise TypeError(
                    f"RecomputePolicy.{name} holds {bad[0]!r}, which is not a module path "
                    f"pattern: each entry is a non-empty string such as 'model.layers.*.mlp'."
                )
            object.__setattr__(self, name, tuple(value))
        if self.on_applied is not None and not callable(self.on_applied):
            raise TypeError(
                f"RecomputePolicy.on_applied must be a function of the model or None; got "
                f"{type(self.on_applied).__name__}."
            )

    @classmethod
    def of(cls, value: Any, api: str) -> RecomputePolicy:
        """``value`` as a RecomputePolicy: itself, or one made from an object with the same
        fields (HyperParallel's own class); anything else raises ``TypeError``."""
        if isinstance(value, cls):
            return value
        if hasattr(value, "region_patterns"):
            return cls(
                region_patterns=value.region_patterns,
                exclude_patterns=getattr(value, "exclude_patterns", ()),
                on_applied=getattr(value, "on_applied", None),
            )
        raise TypeError(
            f"{api} needs a RecomputePolicy(region_patterns=..., exclude_patterns=...), got "
            f"{type(value).__name__} ({value!r})."
        )


@dataclass
class ActivationCheckpointSelection:
    """Which layers to checkpoint (HyperParallel's ``ActivationCheckpointSelection`` of
    its trainer config, the same fields and checks).

    ``source="model_adapter_safe_regions"`` with exactly one of ``layer_count`` (the
    first that many layers, 0 for none) and ``layer_indices`` (a non-empty list of
    distinct layer positions from 0); ``source="default"`` (HyperParallel's whole-layer
    modes) takes neither. Positions count the model's layers in order, several stacks one
    after the other (NOTE [ A model's layers ]). Anything else raises ``ValueError``
    naming the field."""

    source: str = "default"
    layer_count: int | None = None
    layer_indices: list[int] | None = None

    def __post_init__(self) -> None:
        count, indices = self.layer_count, self.layer_indices
        if self.source not in SOURCES:
            raise ValueError(
                f"ActivationCheckpointSelection.source must be one of {SOURCES}, got "
                f"{self.source!r}."
            )
        if self.source == "default":
            if count is not None or indices is not None:
                raise ValueError(
                    "ActivationCheckpointSelection: layer_count and layer_indices are only "
                    "valid with source='model_adapter_safe_regions' (source='default' "
                    "checkpoints every layer)."
                )
            return
        if (count is None) == (indices is None):
            raise ValueError(
                "ActivationCheckpointSelection with source='model_adapter_safe_regions' "
                "takes exactly one of layer_count (the first N layers) and layer_indices "
                f"(those positions); got layer_count={count!r}, layer_indices={indices!r}."
            )
        if count is not None:
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(
                    f"ActivationCheckpointSelection.layer_count must be a non-negative "
                    f"integer (0 checkpoints no layer), got {count!r}."
                )
            return
        if isinstance(indices, (str, bytes)) or not isinstance(indices, (list, tuple)) or not indices:
            raise ValueError(
                f"ActivationCheckpointSelection.layer_indices must be a non-empty list of "
                f"layer positions (from 0), such as [0, 4, 8]; got {indices!r}."
            )
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(
                f"ActivationCheckpointSelection.layer_indices must hold non-negative "
                f"integers (layer positions from 0); got {bad[0]!r}."
            )
        if len(set(indices)) != len(indices):
            twice = sorted({i for i in indices if indices.count(i) > 1})
            raise ValueError(
                f"ActivationCheckpointSelection.layer_indices must not contain duplicates; "
                f"{', '.join(map(str, twice))} appear(s) more than once."
            )

    @classmethod
    def of(cls, value: Any, api: str) -> ActivationCheckpointSelection | None:
        """``value`` checked as a selection: None; an ActivationCheckpointSelection; a
        mapping or an object with its fields (HyperParallel's config; ``source``, if not
        given, is the regions'). Anything else raises ``TypeError``."""
        if value is None:
            return None
        if isinstance(value, Mapping):
            fields = {"source": "model_adapter_safe_regions", **value}
        elif hasattr(value, "layer_count") or hasattr(value, "layer_indices"):
            fields = {
                "source": getattr(value, "source", "model_adapter_safe_regions"),
                "layer_count": getattr(value, "layer_count", None),
                "layer_indices": getattr(value, "layer_indices", None),
            }
        else:
            raise TypeError(
                f"{api}: selection must be an ActivationCheckpointSelection (or None for "
                f"every layer), got {type(value).__name__} ({value!r})."
            )
        unknown = sorted(set(fields) - {"source", "layer_count", "layer_indices"})
        if unknown:
            raise TypeError(
                f"{api}: selection has unknown field(s) {', '.join(map(repr, unknown))}; it "
                f"takes source, layer_count and layer_indices."
            )
        return cls(**fields)

    def choose(self, layers: list[tuple[str, Any]], api: str, model_name: str) -> list[tuple[str, Any]]:
        """The chosen ones of ``layers`` (every one for ``source='default'``)."""
        if self.layer_count is not None:
            if self.layer_count > len(layers):
                raise ValueError(
                    f"{api}: selection.layer_count={self.layer_count} is more than the "
                    f"{len(layers)} layer(s) of {model_name} ({layers[0][0]!r} to "
                    f"{layers[-1][0]!r}); pass at most {len(layers)}."
                )
            return layers[: self.layer_count]
        if self.layer_indices is None:
            return layers
        choice = LayerChoice(tuple(self.layer_indices), "selection.layer_indices")
        return choice.resolve(layers, api, model_name)


def apply_recompute_policy(
    ops: ModelOps,
    model: Any,
    policy: Any,
    selection: Any,
    *,
    api: str,
    wrap_checkpoint: Callable[[Any], Any],
    wrap_exclude: Callable[[Any, str], Any],
    pair: Callable[[Any, Any], None] | None = None,
    also_exclude: Callable[[Any], bool] | None = None,
) -> Any:
    """Checkpoint the regions ``policy`` declares in the layers ``selection`` chooses,
    excluding what it excludes (NOTE [ Declared recompute regions ]). ``wrap_checkpoint``
    and ``wrap_exclude`` wrap one module; ``pair(a, b)``, where given, pairs two
    checkpoints for prefetch; ``also_exclude``: the framework's own exclusions. Returns
    the model."""
    check_model(ops, model, api)
    policy = RecomputePolicy.of(policy, api)
    chooser = ActivationCheckpointSelection.of(selection, api)
    if not policy.region_patterns:
        raise ValueError(
            f"{api}: the RecomputePolicy declares no region (region_patterns is empty), so "
            f"there is nothing to checkpoint. Name the modules to recompute, such as "
            f"RecomputePolicy(region_patterns=('model.layers.*',))."
        )
    model_name = type(model).__name__
    named = walk_named(ops.children, model)
    regions = Selection.parse(
        list(policy.region_patterns), "region_patterns", api, ops.module_type, required=True
    )
    excludes = Selection.parse(
        list(policy.exclude_patterns) or None, "exclude_patterns", api, ops.module_type
    )
    for selected in (regions, excludes):
        if selected is not None:
            selected.check_paths(api, named, model_name)
    assert regions is not None  # required
    chosen: list[tuple[str, Any]] | None = None
    if chooser is not None:
        layers = find_layers(ops.children, model, ops.layer_containers, api, "selection")
        chosen = chooser.choose(layers, api, model_name)
        if not chosen:
            return model  # layer_count=0: no layer is checkpointed
        regions = regions.within(chosen)
    plan = plan_checkpointing(ops, model, regions, excludes, also_exclude, api)
    where = "the model" if chosen is None else f"the {len(chosen)} chosen layer(s)"
    if not plan.checkpoints:
        raise SelectionError(
            f"{api}: region_patterns {_listed(policy.region_patterns)} select no module in "
            f"{where} of {model_name}, so there is no region to checkpoint. Check the "
            f"patterns against the layers' paths ({_listed([p for p, _ in (chosen or named)][:3])}"
            f" ...) or choose other layers."
        )
    if plan.excluded_checkpoints:
        raise ValueError(
            f"{api}: {_listed(plan.excluded_checkpoints)} is both a recompute region and "
            f"excluded from the replay (exclude_patterns matches it): a module is either "
            f"replayed or run once. Exclude modules inside the region, or make "
            f"region_patterns select the module around it."
        )
    if excludes is not None and not plan.exclusions:
        raise SelectionError(
            f"{api}: exclude_patterns {_listed(policy.exclude_patterns)} select no module "
            f"inside the regions in {where} ({_listed(plan.checkpoints[:3])} ...), so they "
            f"would keep nothing out of the replay. Point them at modules inside the "
            f"regions, or leave them out."
        )
    _turn_off_hf_checkpointing(ops, model)
    plan.carry_out(wrap_checkpoint, wrap_exclude)
    if pair is not None and chosen is not None:
        new = [(path, m) for m, path, is_checkpoint in plan.planned if is_checkpoint]
        for first, second in _prefetch_pairs(new, chosen):
            pair(first, second)
    if policy.on_applied is not None:
        policy.on_applied(model)
    return model


def _prefetch_pairs(
    regions: list[tuple[str, Any]], layers: list[tuple[str, Any]]
) -> Iterable[tuple[Any, Any]]:
    """Consecutive regions at one place (the same path below their layers) in the layers
    of one container, in layer order."""
    chains: dict[tuple[str, str], list[Any]] = {}
    for layer_path, _ in layers:  # in the model's order
        for path, module in regions:
            if path == layer_path or path.startswith(layer_path + "."):
                container = layer_path.rpartition(".")[0]
                chains.setdefault((container, path[len(layer_path):]), []).append(module)
    for chain in chains.values():
        yield from itertools.pairwise(chain)


def _turn_off_hf_checkpointing(ops: ModelOps, model: Any) -> None:
    """Hugging Face's own checkpointing, where it is on: a region would be checkpointed
    twice."""
    if not any(
        getattr(m, "gradient_checkpointing", False) is True for _, m in walk_named(ops.children, model)
    ):
        return
    disable = getattr(model, "activation_checkpointing_disable", None) or getattr(
        model, "gradient_checkpointing_disable", None
    )
    if disable is not None:
        disable()


# HyperParallel's names for a layer's parts, the first present of each group wrapped.
_SUBMODULE_GROUPS = (
    ("mlp", "feed_forward", "ffn"),
    ("self_attn", "attention", "attn", "linear_attn"),
    ("input_layernorm", "attention_norm", "layer_norm1", "norm1"),
    ("post_attention_layernorm", "ffn_norm", "layer_norm2", "norm2"),
)
_ATTENTION_GROUP = 1
# Wrapped wherever present.
_SUBMODULE_EXTRAS = ("mlp_moe_gen", "input_layernorm_moe_gen", "post_attention_layernorm_moe_gen")


def apply_submodule_checkpointing(
    ops: ModelOps,
    layers: Any,
    has_kv_sharing: bool,
    *,
    api: str,
    wrap_checkpoint: Callable[[Any], Any],
) -> int:
    """Checkpoint each layer's MLP, attention (unless ``has_kv_sharing``: the attention
    then writes a cache shared across layers and must not run again) and two norms, each
    the first child present of HyperParallel's names for it, and its ``*_moe_gen`` parts.
    A part already wrapped by recomp is left as it is (and the group's other names are
    not tried). Every part is checked before any is wrapped. Returns how many were
    wrapped."""
    if not isinstance(has_kv_sharing, bool):
        raise TypeError(f"{api}: has_kv_sharing must be a bool, got {has_kv_sharing!r}.")
    if isinstance(layers, ops.module_type) or not isinstance(layers, Iterable):
        raise TypeError(
            f"{api} takes a list of layers (such as list(model.model.layers)), got "
            f"{type(layers).__name__}."
        )
    layers = list(layers)
    for layer in layers:
        if not isinstance(layer, ops.module_type):
            raise TypeError(
                f"{api}: every layer must be a {ops.module_type.__name__}, got "
                f"{type(layer).__name__}."
            )
    parts: dict[int, Any] = {}
    for layer in layers:
        children = dict(ops.children(layer))
        for index, names in enumerate(_SUBMODULE_GROUPS):
            if index == _ATTENTION_GROUP and has_kv_sharing:
                continue
            present = next((children[n] for n in names if n in children), None)
            if present is not None and recomp_wrapper_of(present) is None:
                parts.setdefault(id(present), present)
        for name in _SUBMODULE_EXTRAS:
            part = children.get(name)
            if part is not None and recomp_wrapper_of(part) is None:
                parts.setdefault(id(part), part)
    for part in parts.values():
        check_wrappable(ops, part, ops.checkpoint_wrapper, api)
    for part in parts.values():
        wrap_checkpoint(part)
    return len(parts)


def check_swap_inputs(swap_inputs: Any, api: str) -> None:
    """HyperParallel takes a bool ``swap_inputs`` only."""
    if not isinstance(swap_inputs, bool):
        raise ValueError(f"{api}: swap_inputs must be a bool, got {swap_inputs!r}.")


def _listed(items: Iterable[str]) -> str:
    return ", ".join(repr(i) for i in items)
