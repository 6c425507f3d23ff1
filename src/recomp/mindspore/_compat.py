"""Every use of MindSpore's private API in recomp, in one place.

Each entry says why it is needed, the versions it was checked on, what happens
if MindSpore changes it, and what public API would retire it. Nothing private
is imported at module load: each entry looks its object up when first used and
fails with a ``RecompError`` that names the missing piece, so a rename upstream
breaks only the feature that needs it. ``tests/mindspore/test_compat.py`` has one test per
entry that fails when MindSpore changes underneath.

Checked on MindSpore 2.10.0 (PyNative, CPU).
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

from ..errors import RecompError


def _lookup(module: str, name: str, why: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RecompError(
            f"recomp.mindspore needs {module}.{name} ({why}), which this MindSpore version "
            "does not have. recomp.mindspore was checked on MindSpore 2.10; please report the "
            "version you use."
        ) from exc


# --------------------------------------------------------------------------- the executor


@functools.cache
def _executor() -> Any:
    return _lookup("mindspore.graph.api", "_pynative_executor", "the PyNative executor")


def grad_enabled() -> bool:
    """Whether PyNative records operations for autodiff now.

    Why: outside a gradient computation an excluded region is a plain call.
    Retired by: a public ``mindspore.is_grad_enabled()``.
    """
    return bool(_executor().enable_grad())


def records_gradients() -> bool:
    """Whether PyNative builds a gradient graph now: inside a gradient computation
    (``mindspore.grad``, ``value_and_grad``, ``GradOperation``, a replay) and not under
    ``_no_grad``. Outside one, ``grad_enabled`` is still true.

    Why: outside a gradient computation a checkpoint has nothing to save or replay, and
    recomp calls the block as it is.
    If it changes: False would skip checkpoints that are needed; the fallback answers
    True (the checkpoint runs, as before).
    Retired by: a public query of whether PyNative records gradients.
    """
    executor = _executor()
    grad_flag = getattr(executor, "grad_flag", None)
    if grad_flag is None:
        return True
    return bool(grad_flag()) and bool(executor.enable_grad())


def in_backward() -> bool:
    """True while MindSpore's autodiff engine runs a backward.

    Why: warn when a checkpoint recomp does not control replays a region.
    If it changes: False (the warning is not given).
    Retired by: a public query of the running autodiff engine.
    """
    query = getattr(_executor(), "get_current_autodiff_engine_id", None)
    return bool(query is not None and query() != -1)


def sync() -> None:
    """Wait for the queued kernels to finish.

    Why: in-place kernels run asynchronously and bump a tensor's version counter
    when they run, so counters are read only after the queue is drained (recomp
    drains it once per region call, forward and replayed entry, not per tensor).
    Retired by: version counters bumped at dispatch.
    """
    _executor().sync()


def version(t: Any) -> int | None:
    """The in-place modification counter of ``t`` (valid after :func:`sync`).

    If it changes: None, and mutation checks are skipped.
    Retired by: a public version counter accessor.
    """
    return getattr(t, "_version", None)


def requires_grad(t: Any) -> bool:
    """Whether autodiff tracks ``t`` (integer outputs of recorded ops are marked too).

    Why: the replay must hand back outputs flagged exactly as in the forward,
    since the flag decides what the ops after the region save.
    If it changes: False for every non-Parameter, and the replay may save a
    different sequence (then the framework's checkpoint raises).
    Retired by: ``Tensor.requires_grad`` reflecting autodiff tracking.
    """
    return bool(getattr(t, "_requires_grad", False))


# --------------------------------------------------------------------------- autograd functions


@functools.cache
def function_base() -> type:
    """The base class of custom autograd functions (``forward``/``backward`` with ``ctx``).

    Why: the boundary node after a region (NOTE [ Deferred inputs ] in recomp._engine).
    Retired by: a public custom-function base class.
    """
    return _lookup("mindspore.common._grad_function", "_Function", "custom autograd functions")


@functools.cache
def as_strided() -> Any:
    """The ``as_strided`` operation (functional form).

    Why: rebuild a view of a deferred input that a region saved.
    Retired by: a public ``mindspore.ops.as_strided``.
    """
    return _lookup("mindspore.ops.auto_generate.gen_ops_def", "as_strided", "views of inputs")


# --------------------------------------------------------------------------- random state


def kernel_seeds() -> dict[Any, Any]:
    """The per-operation kernel seeds that CPU random ops (dropout) draw from.

    Why: ``mindspore.get_rng_state`` does not cover them, so a replay would draw
    other dropout masks; recomp saves and restores them with the generator.
    Retired by: kernel seeds included in ``mindspore.get_rng_state()``.
    """
    module = sys.modules.get("mindspore.common.seed") or importlib.import_module(
        "mindspore.common.seed"
    )
    seeds = getattr(module, "_KERNEL_SEED", None)
    if not isinstance(seeds, dict):
        raise RecompError(
            "recomp.mindspore restores MindSpore's per-op kernel seeds "
            "(mindspore.common.seed._KERNEL_SEED), which this MindSpore version does not have. "
            "Pass save_rng_state=False to recomp.mindspore.checkpoint to run without it."
        )
    return seeds


# --------------------------------------------------------------------------- model zoos


@functools.cache
def stop_recomputation_error() -> type:
    """The exception ``mindspore.recompute`` raises to end an early-stopping replay.

    Why: recognise an early stop inside a dropout, which MindSpore 2.10 cannot
    recover from, and raise an error naming the fix instead.
    If it changes: the lookup fails with a RecompError when early_stop=True is used.
    Retired by: MindSpore recovering from an early stop inside any op.
    """
    error: type = _lookup(
        "mindspore.common.recompute", "_StopRecomputationError", "recognising an early stop"
    )
    return error


@functools.cache
def graph_parser_lookups() -> frozenset[Any]:
    """Code objects of the Python functions through which MindSpore's graph compiler
    looks up a Cell's ``construct``: the parser's attribute lookup (every Cell it
    meets, GRAPH_MODE and ``jit``) and the GRAPH_MODE entry (the Cell called first).

    Why: a recomp wrapper raises its PyNative error when the compiler looks it up,
    the one point where Python runs during compilation.
    If it changes: an empty set, and compilation fails with MindSpore's own message.
    Retired by: a public "is the graph compiler running" query.
    """
    codes = set()
    for module, owner, name in (
        ("mindspore.graph._parse.parser", None, "get_attr_from_object"),
        ("mindspore.graph.api", "_CellGraphExecutor", "compile"),
    ):
        try:
            target = importlib.import_module(module)
            if owner is not None:
                target = getattr(target, owner)
            codes.add(getattr(target, name).__code__)
        except (ImportError, AttributeError):
            continue
    return frozenset(codes)


# --------------------------------------------------------------------------- Cell.recompute


def recompute_called(cell: Any) -> bool:
    """Whether ``Cell.recompute()`` was called on ``cell``.

    Why: such a Cell is then run through the checkpointed ``construct`` MindSpore
    captured at that call, never through its ``construct`` attribute, so a recomp
    wrapper put on it later would never run; recomp refuses to wrap it and says
    why. ``Cell.recompute`` keeps that captured call in ``_recompute_cell``.
    If it changes: False, and the refusal is not given (the wrapper then has no
    effect on such a Cell, as before the check existed).
    Retired by: a public query of whether a Cell is set to recompute.
    """
    return getattr(cell, "_recompute_cell", None) is not None


# --------------------------------------------------------------------------- forward hooks


def forward_hooks_run() -> bool:
    """Whether a forward hook registered on a Cell would run as MindSpore runs it.

    Why: libraries replace ``Cell._run_forward_hook``, the private method through
    which ``Cell.__call__`` runs forward hooks; mindnlp 0.3.1 puts in a version
    taking ``(inputs, output)``, while MindSpore 2.10 calls it with
    ``(args, kwargs, output, called_always_called_hook_set)``, so that every Cell
    with a forward hook fails with a ``TypeError``. recomp then does without
    forward hooks (forward pre-hooks are left alone by such libraries).
    If it changes: a method defined outside MindSpore is still taken as replaced.
    Retired by: nothing in recomp; MindSpore owns the method, libraries patch it.
    """
    from mindspore import nn

    method = nn.Cell.__dict__.get("_run_forward_hook")
    return getattr(method, "__module__", "").startswith("mindspore.")


# --------------------------------------------------------------------------- mixed precision


def with_mixed_precision(function: Any, mixed_precision_type: Any) -> Any:
    """``function`` run with a Cell's mixed-precision type set, as ``Cell.__call__`` runs
    its ``construct``.

    Why: ``Cell.__call__`` sets the Cell's ``mixed_precision_type`` (what
    ``auto_mixed_precision`` O1/O2/O3 and ``Cell.to_float`` give it) on the
    PyNative executor around ``construct`` and resets it afterwards. The replay of
    a checkpointed Cell runs its ``construct`` during backward, outside that call,
    so its own ops would run in another precision than in the forward and the
    gradients would differ. Wrapping the checkpointed function restores it.
    If it changes: ``RecompError`` naming the executor method, when a Cell with a
    mixed-precision type is checkpointed.
    Retired by: a public context manager for the executor's mixed-precision type.
    """
    executor = _executor()
    if not hasattr(executor, "set_mixed_precision_type"):
        raise RecompError(
            "recomp.mindspore needs mindspore.graph.api._pynative_executor."
            "set_mixed_precision_type to replay a Cell under auto_mixed_precision, and this "
            "MindSpore has none. Apply auto_mixed_precision outside the checkpointed Cells "
            "(on a function around the model), or report this with your MindSpore version."
        )
    from mindspore._c_expression import MixedPrecisionType

    def run(*args: Any, **kwargs: Any) -> Any:
        executor.set_mixed_precision_type(mixed_precision_type)
        try:
            return function(*args, **kwargs)
        finally:
            executor.set_mixed_precision_type(MixedPrecisionType.NOTSET, False)

    owner = getattr(function, "__self__", None)
    if owner is None:
        return run
    # Still a method of the Cell: the checkpoint finds the Cell through it (its running
    # statistics, dropout cells, collectives, the memory report's layer).
    return types.MethodType(lambda _cell, *args, **kwargs: run(*args, **kwargs), owner)


def no_mixed_precision() -> Any:
    """The mixed-precision type under which ops run in the precision of their inputs."""
    from mindspore._c_expression import MixedPrecisionType

    return MixedPrecisionType.NOTSET


def cell_parameters(cell: Any) -> list[tuple[str, Any]]:
    """``(name, Parameter)`` for each parameter ``cell`` itself holds, by attribute name.

    Why: a checkpoint of a Cell notes them at every call (``recomp._module_state``);
    ``parameters_and_names(expand=False)`` walks a generator and names parameters by
    their global name, where the Cell keeps them in one dict under attribute names.
    If it changes: the public walk, with the attribute name after the last dot.
    Retired by: a public view of a Cell's own parameters by attribute name.
    """
    params = vars(cell).get("_params")
    if isinstance(params, dict):
        return [(n, p) for n, p in params.items() if p is not None]
    return [(n.rsplit(".", 1)[-1], p) for n, p in cell.parameters_and_names(expand=False)]
