"""``torch.compile``: an eager recomp checkpoint traced by Dynamo, and the planner's
compiled plans (the partitioner asked at a memory budget).

Consumers: ``torch/_compile.py`` (the bypassing wrapper, the warning given at trace
time), the planner (``plan/compiled.py``, ``plan/apply.py``, ``plan/profiler.py``) and
the benchmark runner (the memory budget and a backend of its own per compile).
Tested by ``tests/torch/compat/test_compile.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

# --------------------------------------------------------------------------- compiled checkpoints


def dynamo_bypassing_wrapper() -> Callable[..., Any] | None:
    """PyTorch's ``dynamo_bypassing_wrapper`` higher-order op, or None where it is missing.

    Why: under ``torch.compile`` an excluded region's body is traced by Dynamo as
    usual, while the wrapper this op applies runs only when AOTAutograd builds the
    joint graph: there it marks the region's nodes ``MUST_SAVE`` (see
    ``recomp.torch._compile``). That mark decides only if it comes after the
    checkpoint's own tags. It does on 2.9, where the checkpoint tags its Dynamo graph
    before AOTAutograd traces it (``TagActivationCheckpoint.tag_nodes``), and on
    2.13-2.14, where every compiled checkpoint is traced as selective checkpointing,
    whose dispatch mode tags each op as it runs: both before the region's body returns.
    Versions: the op exists, and Dynamo traces it, from 2.9 on (checked: 2.9.1,
    2.13.0, 2.14.1; 2.11 on CUDA). Detected by feature: the op is looked up once, at
    import, without importing Dynamo.
    If it changes: None; a compiled recomp checkpoint then recomputes its excluded
    regions, as a compiled PyTorch checkpoint does, and warns once
    (``ForeignCheckpointWarning``); eager mode is unaffected.
    ``tests/torch/compat/test_compile.py`` checks that the op exists and that its mark reaches the
    partitioner.
    Retired by: a public way to tag the nodes of a traced region.
    """
    try:
        from torch._higher_order_ops.wrap import dynamo_bypassing_wrapper as wrapper
    except ImportError:
        return None
    return wrapper  # type: ignore[no-any-return]


def _no_callback() -> None:
    return None


#: Dynamo's frame callback on this thread (None where Dynamo runs no frame), asked by
#: code that runs eagerly (``torch.compiler.is_compiling()`` is False).
#:
#: Why: a frame of a compiled function that Dynamo gave up on (a graph break it could not
#: resume: it "falls back to eager") runs as it is, with the callback still set, and
#: Dynamo then tries to compile each frame that one calls. recomp's eager checkpoint,
#: called from such a frame (a checkpointed layer whose excluded region writes to an
#: object from outside, as HF's KV cache does), must then run untraced: traced, it hands
#: PyTorch's checkpoint a ``context_fn`` that Dynamo refuses with an internal error.
#: Outside ``torch.compile`` the callback is None: one C call per checkpoint call.
#: ``torch._C._dynamo.eval_frame.get_eval_frame_callback`` itself, not a wrapper (asked at
#: every eager checkpoint call). Versions: checked on 2.9.1 and 2.14.1
#: (``tests/torch/compat/test_compile.py``).
#: If it changes: a function that answers None, and such a frame's checkpoint is traced as
#: before (the error above; plain eager is unaffected).
#: Retired by: a public way to tell that Dynamo runs frames.
dynamo_frame_callback: Callable[[], Any] = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
    "get_eval_frame_callback",
    _no_callback,
)


def run_at_trace_time(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Make Dynamo call ``fn`` when it traces a call of it, instead of tracing into it.

    Why: the warning that exclusions are recomputed under compilation is a Python side
    effect (``warnings.warn``), which Dynamo cannot put in a graph; run when the code
    is traced, it is given once per compilation, and ``fn`` keeps it to once in all.
    Public (``torch.compiler.assume_constant_result``), but it imports Dynamo (seconds):
    applied only where needed. ``fn`` must return a constant.
    """
    return torch.compiler.assume_constant_result(fn)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- compiled plans


def compiled_original(module: Any) -> Any:
    """The module that ``torch.compile(module)`` wrapped, or None if ``module`` is not
    such a wrapper.

    Why: the planner profiles a model eagerly, op by op and hook by hook, and a
    compiled wrapper would show it the original's modules under ``_orig_mod.`` paths,
    which a plan cannot name; the original is what the plan applies to (and the
    compiled wrapper sees the change, since it calls the same module).
    The wrapper's class (``torch._dynamo.eval_frame.OptimizedModule``) is matched by
    name and module so that Dynamo is not imported for a model that was never compiled;
    the original is its ``_orig_mod`` attribute. Checked on 2.9.1, 2.13.0 and 2.14.1.
    If it changes: None, and a compiled model is profiled like any other module.
    Retired by: a public way to get a compiled module's original.
    """
    kind = type(module)
    if kind.__name__ != "OptimizedModule" or not kind.__module__.startswith("torch._dynamo"):
        return None
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, torch.nn.Module) else None


def compiled_backend_name(module: Any) -> str | None:
    """The name of the backend a ``torch.compile`` wrapper compiles with (``"inductor"``,
    ``"aot_eager"``, ...), or None if it cannot be read.

    Why: ``recomp.plan.profile(torch.compile(model))`` plans for the compiler the user
    chose, whose decompositions and partitioner decide what the compiled step keeps.
    The wrapper's Dynamo context holds its frame callback, which holds the backend
    wrapped for debugging, which holds the backend; registered backends carry their
    name in ``__name__``. Checked on 2.9.1 and 2.14.1.
    If it changes: None, and ``profile`` asks for ``backend=``.
    Retired by: a public accessor for a compiled module's backend.
    """
    if compiled_original(module) is None:
        return None
    backend: Any = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    for _ in range(4):
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
        name = getattr(backend, "__name__", None)
        if isinstance(name, str):
            return name
    return None


#: The backends whose partitioning ``partitioning_backend`` reproduces.
PLANNABLE_BACKENDS = ("inductor", "aot_eager")


def partitioning_backend(backend: str, on_joint: Callable[..., None]) -> tuple[Any, Any]:
    """A ``torch.compile`` backend that traces like ``backend`` up to the partition of the
    joint forward-backward graph and runs the graphs without compiling them, and the
    partition function ``backend`` uses. ``on_joint(joint, joint_inputs, kwargs,
    context)`` sees each joint graph before it is partitioned (it must not change it),
    with the tracing context it is partitioned in: partitioning it again later must
    happen inside that context (``in_tracing_context``), where Inductor's joint-graph
    passes find the fake-tensor mode of the graph's constants.

    Why: the planner for compiled models asks the partitioner what it saves at several
    memory budgets. It needs the joint graph as the backend's partitioner gets it:
    Inductor decomposes ops first (``select_decomp_table``) and runs its joint-graph
    passes inside its ``partition_fn`` (``torch._inductor.compile_fx``); ``aot_eager``
    partitions with ``min_cut_rematerialization_partition`` and no decompositions.
    Generating code is not needed, so the forward and backward compilers are no-ops
    (``make_boxed_compiler``). Checked on 2.9.1 and 2.14.1.
    If it changes: an ImportError or a changed graph; ``tests/plan/test_compiled.py`` checks
    that the predicted bytes match a real compiled run.
    Retired by: a public API to query the partitioner's choice at a budget.
    """
    from functorch.compile import make_boxed_compiler
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._guards import TracingContext

    if backend not in PLANNABLE_BACKENDS:
        raise ValueError(
            f"recomp plans for the torch.compile backends {', '.join(PLANNABLE_BACKENDS)}, "
            f"not {backend!r}: compile with one of them, or pass backend="
        )
    decompositions: Any = None
    partition: Any = min_cut_rematerialization_partition
    if backend == "inductor":
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
        partition = partition_fn

    def capture(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        on_joint(joint, joint_inputs, dict(kwargs), TracingContext.try_get())
        return partition(joint, joint_inputs, **kwargs)

    def no_codegen(graph: Any, example_inputs: Any) -> Any:
        return graph

    compiler = make_boxed_compiler(no_codegen)
    traced = aot_autograd(
        fw_compiler=compiler,
        bw_compiler=compiler,
        partition_fn=capture,
        decompositions=decompositions,
        keep_inference_input_mutations=True,
    )
    return traced, partition


def in_tracing_context(context: Any) -> contextlib.AbstractContextManager[Any]:
    """Re-enter the tracing context a joint graph was partitioned in (see
    ``partitioning_backend``; ``torch._guards.tracing``). Checked on 2.9.1 and 2.14.1.
    If it changes: an ImportError when a compiled profile partitions.
    Retired by: a public API to query the partitioner's choice at a budget."""
    from torch._guards import tracing

    return tracing(context) if context is not None else contextlib.nullcontext()


def activation_memory_budget(budget: float) -> contextlib.AbstractContextManager[Any]:
    """``torch._functorch.config.activation_memory_budget`` set to ``budget`` inside.

    Why: a compiled plan is PyTorch's memory-budget partitioner at the budget that lands
    on the user's bytes; the partitioner reads this setting when a graph is compiled.
    The module config's ``patch`` is the documented way to set it for a scope. Checked
    on 2.9.1 and 2.14.1.
    If it changes: AttributeError at the first compiled-plan call.
    Retired by: a public per-compile memory budget.
    """
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)


def fake_mode_of(values: list[Any]) -> Any:
    """The fake-tensor mode of the placeholder values of a traced graph, or None.

    Why: counting the FLOPs a backward graph recomputes runs it on its fake tensors,
    inside their mode. ``torch._guards.detect_fake_mode``. Checked on 2.9.1 and 2.14.1.
    If it changes: None, and the FLOPs are not counted.
    Retired by: a public way to re-enter a traced graph's fake mode.
    """
    try:
        from torch._guards import detect_fake_mode
    except ImportError:  # pragma: no cover - depends on the PyTorch version
        return None
    return detect_fake_mode(values)


def many_recompiles() -> contextlib.AbstractContextManager[Any]:
    """Dynamo's limit of compiled versions per code object raised inside.

    Why: each profile compiles a fresh copy of the model's ``forward`` with a backend of
    its own, which Dynamo counts against the code object's recompile limit (8): a
    process that profiles often would otherwise run its profile eagerly, unseen.
    The setting is ``recompile_limit`` (2.14) or ``cache_size_limit`` (2.9, an alias
    later). Checked on 2.9.1 and 2.14.1.
    If it changes: the limit is left as it is.
    Retired by: a way to compile a module copy without counting against the original.
    """
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            return dynamo_config.patch(name, 1 << 16)
    return contextlib.nullcontext()  # pragma: no cover - depends on the PyTorch version


class _SeparateBackend:
    """A ``torch.compile`` backend equal only to itself (see ``separate_backend``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, graph: Any, example_inputs: Any, **kwargs: Any) -> Any:
        return self._inner(graph, example_inputs, **kwargs)


def separate_backend(
    backend: str, mode: str | None = None, options: dict[str, Any] | None = None
) -> Any:
    """``backend`` (a registered name) as a backend object that Dynamo will not take for
    the backend of any other ``torch.compile`` call.

    Why: Dynamo keys its compiled code by code object and guards, and the guards hold
    the backend by equality (``torch.compile``'s backend wrappers compare their
    settings) and a module by type, not by identity. Two instances of one model class
    compiled with the same backend share the first one's graph, compiled under the
    partitioner's memory budget of that moment: a second model compiled with another
    budget (a plan, or none) would silently run the first one's choice. A backend object
    of its own gives each compile its own cache entries. Inductor is built as
    ``torch.compile`` builds it (``torch._TorchCompileInductorWrapper``, which applies
    ``mode`` and ``options``); other backends come from Dynamo's registry
    (``torch._dynamo.lookup_backend``). Checked on 2.9.1 and 2.14.1.
    If it changes: an AttributeError when compiling with a plan.
    Retired by: the memory budget as part of Dynamo's guards, or a per-compile budget.
    """
    if backend == "inductor":
        inner: Any = torch._TorchCompileInductorWrapper(mode, options, None)  # type: ignore[attr-defined]
    else:
        if mode is not None or options is not None:
            raise ValueError(f"mode= and options= are Inductor's; the backend here is {backend!r}")
        from torch._dynamo import lookup_backend

        inner = lookup_backend(backend)
    return _SeparateBackend(inner)
