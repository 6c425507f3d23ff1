"""Plans for compiled models: PyTorch's memory-budget partitioner, aimed at the user's bytes.

NOTE [ Planning for a compiled model ]

Eagerly, recomp decides what a step keeps layer by layer, and the planner predicts it
from one instrumented forward. Under ``torch.compile`` none of that holds: AOTAutograd
traces forward and backward into one joint graph, and its min-cut partitioner decides,
op by op, which forward values the backward gets (saved) and which it computes again.
Compiled, the partitioner already recomputes cheap element-wise ops, and with
``torch._functorch.config.activation_memory_budget`` below 1 it solves a knapsack:
the least recompute (by its runtime estimate) whose saved bytes fit the budget. At the
same bytes that is at least as fast as any layer-level choice an eager profile can
make (measured: the eager planner's plans, compiled, ran 0 to 6 % slower than the
budget at the same bytes), so a compiled plan hands the choice to the partitioner and
plans only the number:

  * The profile traces a copy of the model with a backend that reproduces the chosen
    one up to partitioning (``_compat.partitioning_backend``: Inductor's decompositions
    and joint-graph passes, or ``aot_eager``'s plain graph) and keeps each joint graph.
  * For a budget ``b`` it partitions a copy of every joint graph as the backend would,
    and reads off the result exactly: the bytes of the activation storages the forward
    hands to the backward (graph inputs and parameters excluded: they are held
    anyway; views of one storage counted once), and the FLOPs of the backward graph
    above those of the default partition (``b = 1``), which is the recompute the budget
    adds (``FlopCounterMode`` on the graph's fake tensors).
  * What the loss function saves outside the compiled model (the model's output, for
    a mean square) is counted once, by a saved-tensors hook around the loss, and added
    to every budget's bytes.
  * A percentage budget spans the partitioner's own range: 0 % is the least it can
    keep (``b = MIN_BUDGET``; at exactly 0 it would recompute even ``MUST_SAVE`` nodes),
    100 % what it keeps by default (``b = 1``). Bytes are bytes. The plan is the largest
    ``b`` whose saved bytes fit, found by bisection (the saved bytes grow with ``b``).
  * Compiling with the plan (``compile_with_plan``) sets ``b`` around every call and
    gives the model a backend object of its own: Dynamo's cache does not guard on the
    budget, and would hand a second model of the same class the first one's graph.
  * Regions the user wants kept whole (``keep=``: attention, an expert dispatch, any
    sub-module that must run once) get recomp's compiled mark: the layer is wrapped in
    a recomp checkpoint whose policy leaves every op to the partitioner
    (``PREFER_SAVE``, which it treats as untagged) and the region in an exclusion,
    whose ops are ``MUST_SAVE`` (see ``recomp.torch._compile``): the knapsack never
    trades them. Collectives need no mark: the partitioner never recomputes them.

What the plan predicts is what the partitioner decides; what the step then holds
also includes what the compiled kernels allocate around it, which ``recomp plan
--compile`` measures beside the prediction.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from ..errors import BudgetTooSmallError
from ..torch import _compat
from ._layers import find_layers
from .budget import Budget, parse_budget
from .modelcall import call_model, default_loss, fresh_inputs, tensors_of
from .planfile import LayerPlan, Plan, partitioner_option

# The smallest budget tried: the partitioner's least memory that still saves MUST_SAVE
# nodes (at exactly 0 it keeps only the graph's inputs, recomputing everything).
MIN_BUDGET = 2.0**-12
# The search for the budget stops when the saved bytes are within this share of the
# partitioner's range below the target, when the bracket's two ends are that close
# (no budget lands nearer), when the budget is known to RESOLUTION, or after
# MAX_SEARCH_STEPS bisection steps, each a partition of every graph (about a second for
# a small model on a CPU: the min cut runs in Python).
CLOSE_ENOUGH = 0.005
RESOLUTION = 2.0**-10
MAX_SEARCH_STEPS = 8


@dataclass(frozen=True)
class PartitionOutcome:
    """What the partitioner decides at one ``activation_memory_budget``."""

    memory_budget: float
    saved_bytes: int  # activation storages the forward hands to the backward
    layer_bytes: dict[str, int] = field(default_factory=dict)  # saved bytes per layer path


@dataclass
class _JointGraph:
    """One joint forward-backward graph as the backend's partitioner receives it."""

    graph: Any
    inputs: Any
    kwargs: dict[str, Any]
    context: Any  # the tracing context it was partitioned in
    fake_mode: Any  # the fake-tensor mode of its values


class CompiledProfile:
    """A compiled model's joint graphs, which answer what the partitioner keeps at a
    budget (:meth:`outcome`). Made by ``recomp.plan.profile(torch.compile(model), ...)``;
    :func:`recomp.plan.make_plan` turns it into a plan."""

    is_compiled = True

    def __init__(
        self,
        backend: str,
        joints: list[_JointGraph],
        partition: Callable[..., Any],
        layers: list[tuple[str, str]],
        kept_regions: dict[str, list[str]],
        notes: list[str],
        outside_bytes: int = 0,
    ) -> None:
        self.backend = backend
        # What the loss function saves outside the compiled model (the model's output,
        # say), held whatever the budget.
        self.outside_bytes = outside_bytes
        self.layers = layers  # (path, type name)
        self.kept_regions = kept_regions  # layer path -> region paths inside it
        self.notes = notes
        self._joints = joints
        self._partition = partition
        self._outcomes: dict[float, PartitionOutcome] = {}
        self._backwards: dict[float, list[Any]] = {}  # partitioned backward graphs
        self._flops: dict[float, int | None] = {}

    @property
    def graphs(self) -> int:
        return len(self._joints)

    def outcome(self, memory_budget: float) -> PartitionOutcome:
        """Partition every joint graph at ``memory_budget`` (cached)."""
        if not MIN_BUDGET <= memory_budget <= 1.0:
            raise ValueError(f"memory_budget lies in [{MIN_BUDGET}, 1], got {memory_budget}")
        found = self._outcomes.get(memory_budget)
        if found is None:
            found = self._outcomes[memory_budget] = self._partition_all(memory_budget)
        return found

    @property
    def default(self) -> PartitionOutcome:
        """The partitioner's default choice (budget 1): 100 %."""
        return self.outcome(1.0)

    @property
    def least(self) -> PartitionOutcome:
        """The least the partitioner keeps (budget ``MIN_BUDGET``): 0 %."""
        return self.outcome(MIN_BUDGET)

    def recompute_flops(self, memory_budget: float) -> int | None:
        """FLOPs the backward graphs run at ``memory_budget`` beyond those at budget 1:
        what the budget makes the backward recompute (None if they cannot be counted)."""
        at, default = self._backward_flops(memory_budget), self._backward_flops(1.0)
        return None if at is None or default is None else max(0, at - default)

    def _backward_flops(self, memory_budget: float) -> int | None:
        self.outcome(memory_budget)
        if memory_budget not in self._flops:
            total: int | None = 0
            for graph in self._backwards[memory_budget]:
                flops = _graph_flops(graph)
                total = None if total is None or flops is None else total + flops
            self._flops[memory_budget] = total
        return self._flops[memory_budget]

    def _partition_all(self, memory_budget: float) -> PartitionOutcome:
        saved = 0
        per_layer: dict[str, int] = {}
        backwards = []
        paths = [path for path, _ in self.layers]
        for joint in self._joints:
            # As AOTAutograd partitions: in the graph's tracing context and fake mode
            # (Inductor's joint-graph passes trace replacements that make new tensors).
            with (
                _compat.in_tracing_context(joint.context),
                joint.fake_mode or contextlib.nullcontext(),
                _compat.activation_memory_budget(memory_budget),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")
                forward, backward = self._partition(
                    _copy_graph(joint.graph), joint.inputs, **dict(joint.kwargs)
                )
            nbytes, layer_bytes = _saved_activations(
                forward, joint.kwargs["num_fwd_outputs"], paths
            )
            saved += nbytes
            for path, n in layer_bytes.items():
                per_layer[path] = per_layer.get(path, 0) + n
            backwards.append(backward)
        self._backwards[memory_budget] = backwards
        return PartitionOutcome(memory_budget, saved, per_layer)

    def to_dict(self) -> dict[str, Any]:
        """A summary (the graphs stay in the process)."""
        return {
            "compiled": True,
            "backend": self.backend,
            "graphs": self.graphs,
            "layers": [{"path": p, "type": t} for p, t in self.layers],
            "kept_regions": self.kept_regions,
            "least_bytes": self.least.saved_bytes + self.outside_bytes,
            "default_bytes": self.default.saved_bytes + self.outside_bytes,
            "outside_bytes": self.outside_bytes,
            "notes": list(self.notes),
        }


def _copy_graph(module: Any) -> Any:
    """A copy of a traced graph module that partitioning may change: new nodes, the same
    fake tensors in their ``meta`` (a deep copy would make new ones, of a new fake mode,
    which Inductor's joint-graph passes then mix with the graph inputs' mode)."""
    copied = torch.fx.GraphModule(module, copy.deepcopy(module.graph))
    copied.meta = dict(getattr(module, "meta", {}))
    return copied


def _module_path(stack: dict[str, Any] | None) -> str | None:
    """The innermost module path of a node's ``nn_module_stack``, in ``named_modules``
    form (``layers.0.attn``; Dynamo writes ``L['self'].layers[0].attn``,
    ``L['self']._modules['layers']._modules['0'].attn`` or ``L['args'][0].layers.0.attn``)."""
    if not stack:
        return None
    entry = list(stack.values())[-1]
    text = entry[0] if isinstance(entry, tuple) else str(entry)
    # The root: L['self'], or L['args'][0] when the model was called with keywords.
    text = re.sub(r"^L(\[[^\]]*\])+", "", text)
    text = re.sub(r"\._modules\['([^']*)'\]", r".\1", text)
    text = re.sub(r"\[(\d+)\]", r".\1", text)
    text = re.sub(r"\['([^']*)'\]", r".\1", text)
    return text.lstrip(".")


def _layer_of(path: str | None, layers: list[str]) -> str | None:
    if path is None:
        return None
    best = None
    for layer in layers:
        if (path == layer or path.startswith(layer + ".")) and (
            best is None or len(layer) > len(best)
        ):
            best = layer
    return best


def _saved_activations(
    forward: Any, user_outputs: int, layers: list[str]
) -> tuple[int, dict[str, int]]:
    """Bytes of the activation storages a partitioned forward graph saves for backward
    (its outputs after the user's): graph inputs (parameters, the batch) excluded, one
    storage counted once, attributed to the layer whose code made it."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    seen: set[Any] = set()
    total = 0
    per_layer: dict[str, int] = {}
    for node in output.args[0][user_outputs:]:
        value = getattr(node, "meta", {}).get("val")
        if not isinstance(value, torch.Tensor) or node.op == "placeholder":
            continue
        storage = value.untyped_storage()
        key = StorageWeakRef(storage)
        if key in seen:
            continue
        seen.add(key)
        nbytes = int(storage.nbytes())
        total += nbytes
        layer = _layer_of(_module_path(node.meta.get("nn_module_stack")), layers)
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + nbytes
    return total, per_layer


def _graph_flops(graph: Any) -> int | None:
    """FLOPs of a partitioned graph, run on its own fake tensors (None if it cannot be)."""
    values = [n.meta.get("val") for n in graph.graph.nodes if n.op == "placeholder"]
    mode = _compat.fake_mode_of(values)
    if mode is None:
        return None
    try:
        with mode, FlopCounterMode(display=False) as counter:
            torch.fx.Interpreter(graph).run(*values)
    except Exception:  # a graph that cannot run on fake tensors: no FLOP figure
        return None
    return int(counter.get_total_flops())


def profile_compiled(
    compiled: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    *,
    layers: Any = None,
    keep: Callable[[nn.Module], bool] | None = None,
    backend: str | None = None,
) -> CompiledProfile:
    """Trace a copy of the module that ``compiled`` (a ``torch.compile`` wrapper) calls,
    as ``backend`` (default: the wrapper's own) would, and keep its joint graphs.
    ``keep`` chooses sub-modules of the layers to keep whole (never recomputed)."""

    original = _compat.compiled_original(compiled)
    if original is None:
        raise TypeError("profile_compiled expects a torch.compile wrapper (torch.compile(model))")
    backend = backend or _compat.compiled_backend_name(compiled)
    if backend is None:
        raise ValueError(
            "cannot tell which backend this torch.compile wrapper uses: pass backend= "
            f"({' or '.join(_compat.PLANNABLE_BACKENDS)})"
        )
    loss_fn = loss_fn or default_loss
    # The regions are chosen on the model as given (``keep`` may compare identities),
    # and marked in the copy that is traced.
    kept_regions = {} if keep is None else _kept_regions(find_layers(original, layers), keep)
    model = copy.deepcopy(original)
    found = find_layers(model, layers)
    if kept_regions:
        from .apply import apply_plan

        apply_plan(model, compiled_plan_layers(found, kept_regions))
    joints: list[_JointGraph] = []

    def on_joint(joint: Any, joint_inputs: Any, kwargs: dict[str, Any], context: Any) -> None:
        mode = _compat.fake_mode_of(list(joint_inputs))
        joints.append(_JointGraph(_copy_graph(joint), joint_inputs, kwargs, context, mode))

    traced, partition = _compat.partitioning_backend(backend, on_joint)
    rng = torch.get_rng_state()
    try:
        with _compat.many_recompiles():
            step = torch.compile(model, backend=traced, dynamic=False)
            given = fresh_inputs(inputs)
            output = call_model(step, given)
            outside = _StorageCounter(model, given)
            with torch.autograd.graph.saved_tensors_hooks(outside.pack, lambda t: t):
                loss = loss_fn(output)
            del output
            loss.backward()
    finally:
        torch.set_rng_state(rng)
    if not joints:
        raise RuntimeError(
            "torch.compile traced no graph with a backward for this model and input (is "
            "any parameter trainable, and does the loss depend on the model's output?)"
        )
    notes = []
    if len(joints) > 1:
        notes.append(
            f"the model compiles into {len(joints)} graphs (graph breaks): one budget applies "
            "to each, and the plan's bytes are their sum"
        )
    return CompiledProfile(
        backend,
        joints,
        partition,
        [(path, type(layer).__name__) for path, layer in found],
        kept_regions,
        notes,
        outside.nbytes,
    )


class _StorageCounter:
    """A pack hook that adds up the activation storages autograd saves (parameters and
    inputs excluded, each storage once)."""

    def __init__(self, model: nn.Module, inputs: Any) -> None:
        held = [*model.parameters(), *model.buffers(), *tensors_of(inputs)]
        self._seen = {StorageWeakRef(t.untyped_storage()) for t in held}
        self.nbytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage())
        if key not in self._seen:
            self._seen.add(key)
            self.nbytes += int(t.untyped_storage().nbytes())
        return t


def _kept_regions(
    layers: list[tuple[str, nn.Module]], keep: Callable[[nn.Module], bool]
) -> dict[str, list[str]]:
    """Per layer path, the paths of its sub-modules that ``keep`` chooses (outermost)."""
    kept: dict[str, list[str]] = {}
    for path, layer in layers:
        regions = [name for name, m in layer.named_modules() if name and keep(m)]
        # Outermost matches only: a region inside a kept region is kept with it.
        outermost = [r for r in regions if not any(r.startswith(o + ".") for o in regions)]
        if outermost:
            kept[path] = outermost
    if not kept:
        raise ValueError("keep= matched no sub-module inside the layers")
    return kept


def compiled_plan_layers(layers: list[tuple[str, nn.Module]], kept: dict[str, list[str]]) -> Plan:
    """A plan skeleton naming each layer's kept regions (for marking the profiled copy)."""
    return Plan(
        budget_bytes=0,
        layers=[
            LayerPlan(path, partitioner_option(kept.get(path, ())), type=type(layer).__name__)
            for path, layer in layers
        ],
        compiled={"backend": "", "activation_memory_budget": 1.0},
    )


def make_compiled_plan(profile: CompiledProfile, budget: str | int | float | Budget) -> Plan:
    """The largest ``activation_memory_budget`` whose saved bytes fit ``budget``."""
    parsed = parse_budget(budget)
    least, default, outside = profile.least, profile.default, profile.outside_bytes
    target = parsed.resolve(least.saved_bytes + outside, default.saved_bytes + outside)
    if target < least.saved_bytes + outside:
        raise BudgetTooSmallError(
            target,
            least.saved_bytes + outside,
            " compiled (what the partitioner keeps at its least)",
        )
    if default.saved_bytes + outside <= target:
        chosen = default
    else:
        chosen = _largest_fitting(profile, target - outside)
    layers = [
        LayerPlan(
            path=path,
            option=partitioner_option(profile.kept_regions.get(path, ())),
            kept_bytes=chosen.layer_bytes.get(path, 0),
            type=kind,
            reason=_reason(profile.kept_regions.get(path, ())),
        )
        for path, kind in profile.layers
    ]
    return Plan(
        budget_bytes=target,
        layers=layers,
        budget=parsed.text,
        predicted={
            "activation_bytes": chosen.saved_bytes + outside,
            "replay_flops": profile.recompute_flops(chosen.memory_budget),
            "least_bytes": least.saved_bytes + outside,
            "default_bytes": default.saved_bytes + outside,
            "outside_bytes": outside,
        },
        compiled={
            "backend": profile.backend,
            "activation_memory_budget": chosen.memory_budget,
        },
    )


def _largest_fitting(profile: CompiledProfile, target: int) -> PartitionOutcome:
    """The outcome of (nearly) the largest budget whose saved bytes fit ``target``.

    Below 1 the partitioner solves a knapsack whose capacity grows with the budget, so
    the saved bytes grow with it in steps: bisection. Budget 1 is another algorithm
    (the runtime-optimized cut, no knapsack), whose bytes can lie well above the
    knapsack's at ``1 - RESOLUTION``: that budget is tried first, as the upper end."""
    low = profile.least
    high = profile.outcome(1.0 - RESOLUTION)
    if high.saved_bytes <= target:
        return high
    close = CLOSE_ENOUGH * (profile.default.saved_bytes - low.saved_bytes)
    for _ in range(MAX_SEARCH_STEPS):
        if target - low.saved_bytes <= close or high.saved_bytes - low.saved_bytes <= close:
            break
        if high.memory_budget - low.memory_budget <= RESOLUTION:
            break
        probe = profile.outcome((low.memory_budget + high.memory_budget) / 2)
        if probe.saved_bytes <= target:
            low = probe
        else:
            high = probe
    return low


def _reason(kept: tuple[str, ...] | list[str]) -> str:
    if kept:
        return f"the partitioner chooses; {'+'.join(kept)} kept whole (never recomputed)"
    return "the partitioner chooses"


__all__ = [
    "MIN_BUDGET",
    "CompiledProfile",
    "PartitionOutcome",
    "make_compiled_plan",
    "profile_compiled",
]
