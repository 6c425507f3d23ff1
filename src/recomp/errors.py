"""Every error and warning class recomp defines. Each message names what is involved and
the fix.

The classes are the same objects wherever recomp raises them (the framework packages,
the planner); import them from here. ``recomp`` re-exports them all.
"""

from __future__ import annotations

__all__ = [
    "BudgetTooSmallError",
    "CachedValueMutatedError",
    "CollectiveReplayedWarning",
    "DoubleCheckpointError",
    "EarlierExclusionsWarning",
    "ForeignCheckpointWarning",
    "IneffectiveSelectionWarning",
    "InstanceRequiredError",
    "NestedExclusionError",
    "OffloadTraceWarning",
    "OutputNotSavedError",
    "ParameterChangedError",
    "PlanFormatError",
    "RecompError",
    "RecompInternalError",
    "ReplayMismatchError",
    "ReplayStateWarning",
    "RunningStatisticsWarning",
    "SelectionError",
    "SwapNotSupportedError",
    "SwapPolicyError",
    "UnreplayableDropoutWarning",
    "WrapperNotReachedWarning",
]


class RecompError(RuntimeError):
    """Base class of recomp's run-time errors (a ``RuntimeError``): ``except
    recomp.RecompError`` catches every error recomp raises while a model runs. Raised
    itself where no narrower class fits: MindSpore's graph mode, ``torch.jit.script`` of
    a wrapped model, ``unwrap`` between a forward and its backward, a region output that
    hides tensors, a trainer setting recomp cannot honour. The message names the module
    and the fix; Troubleshooting lists the cases."""


class RecompInternalError(RecompError):
    """An invariant recomp relies on did not hold: a bug in recomp, not in your code."""


def internal_error(what: str) -> RecompInternalError:
    """The error for a broken invariant of recomp's own (``what`` says which)."""
    return RecompInternalError(
        f"Internal error in recomp: {what}. This is a bug in recomp, not in your model; "
        "please report it with the code that triggered it."
    )


def internal_assert(condition: bool, what: str) -> None:
    """Check one of recomp's own invariants (the numbered rules of the NOTE blocks in
    ``recomp._region``). Unlike ``assert`` it also runs under ``python -O``; a
    failure means recomp itself is wrong, and the message says so."""
    if not condition:
        raise internal_error(what)


class NestedExclusionError(RecompError):
    """An excluded region was called while another excluded region was running (a
    ``checkpoint_exclude_wrapper`` inside another one). The outer region already keeps
    everything inside it out of the replay: remove the inner wrapper. The message names
    both by their module paths in the checkpointed module (``'layers.0.mlp'`` inside
    ``'layers.0'``) where they are modules below it, and by their classes."""


class SelectionError(TypeError, ValueError):
    """What was passed to choose modules is not a selection recomp can use: the
    ``checkpoint_fn``/``exclude_fn``/``offload_fn``/``copy_output_fn`` of
    ``apply_activation_checkpointing`` and ``hf_activation_checkpointing``, or the
    ``exclude`` of a trainer install. A selection is a module class, a module path (a
    string, ``fnmatch`` wildcards allowed: ``"layers.*.self_attn"``), a function of a
    module, or a list or tuple of these. Raised for anything else (a number, a module
    instance where its class or path was meant) and, where the model is known, for a path
    that matches no module of it; the message names the argument and what to pass.
    Raised before anything is wrapped: the model is as it was. A ``TypeError`` and a
    ``ValueError``, so either ``except`` clause catches it."""


class InstanceRequiredError(TypeError, ValueError):
    """A class was passed where recomp needs the module (or function) itself:
    ``checkpoint_wrapper(MyBlock)`` instead of ``checkpoint_wrapper(MyBlock(...))``, the
    same for ``checkpoint_exclude_wrapper``, ``checkpoint``, ``swap_wrapper``, ``unwrap``
    and the model of ``apply_activation_checkpointing``. Calling the class would build a
    new module rather than run one. Nothing is changed. A ``TypeError`` and a
    ``ValueError``, so either ``except`` clause catches it."""


class ReplayMismatchError(RecompError):
    """The replay of a checkpoint did not run as the forward did, so its gradients would
    be wrong: it called excluded regions differently or did not reach one (a Python
    branch that changed between the two), saved other tensors, issued other collectives
    (PyTorch), or, with ``determinism_check="values"`` or ``debug=True``, saved other
    values (state read outside the inputs changed before backward). The message says
    which and the fix; with ``debug=True`` it lists the ops of both. Once
    ``recomp.torch`` is imported it also derives from
    ``torch.utils.checkpoint.CheckpointError``, so either ``except`` clause catches it."""


class CachedValueMutatedError(RecompError):
    """A cached output or saved tensor of an excluded region was changed in place after
    the region returned (``out += identity``, ``ReLU(inplace=True)`` after it), or a
    region changed an input it had saved; its backward would read the changed value.
    Make the later op out of place, or pass ``copy_output=True`` (``copy_output_fn`` in
    ``apply_activation_checkpointing``) to cache a copy those changes do not reach."""


class ParameterChangedError(RecompError):
    """A parameter or buffer that a checkpointed forward (or an excluded region) read was
    changed in place between that forward and its backward: an optimizer step, weight
    clipping or another update ran before a backward that still needed the forward (a
    GAN's ``opt_d.step()`` between ``d_loss.backward(retain_graph=True)`` and
    ``g_loss.backward()``). The replay would recompute with the new values, and the
    gradients would be wrong; without checkpointing autograd refuses the same step. Run
    every backward that needs a forward before changing the parameters it read, or run
    the forward again after the change. The message names the module and the tensor.
    Also raised for a tensor among a checkpoint's arguments that the framework's
    checkpoint does not save itself (a keyword argument, a tensor in a list, dict or
    tuple) and that changed in place before the replay (PyTorch)."""


def changed_before_backward(
    tensors: list[tuple[str, str | None]], owner: str, reader: str
) -> ParameterChangedError:
    """The error for ``tensors`` (``("parameter", "0.weight")``, ``("buffer", None)`` for
    one without a known name) of ``owner`` (``"the checkpointed Block"``), changed in
    place before ``reader`` (``"its replay"``) read them."""
    groups: dict[str, list[str]] = {}
    for kind, path in tensors:
        groups.setdefault(kind, []).append(repr(path) if path else "")
    parts = []
    for kind, paths in groups.items():
        named = [p for p in paths if p]
        shown = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
        unnamed = len(paths) - len(named)
        if named:
            parts.append(f"{kind}{'s' if len(named) > 1 else ''} {shown}")
        if unnamed:
            parts.append(f"{unnamed} {kind}{'s' if unnamed > 1 else ''} of unknown name")
    what = " and ".join(parts)
    return ParameterChangedError(
        f"{what[0].upper()}{what[1:]} of {owner} changed in place between this checkpoint's forward and its "
        f"backward, so {reader} would use the new values and the gradients would be wrong "
        "(without checkpointing, autograd refuses this step too). An optimizer step, weight "
        "clipping or another in-place update before this backward is the usual cause: run "
        "every backward that needs this forward before the change (step after backward), or "
        "run the forward again after it (in a GAN step: the generator's loss through a new "
        "forward of the discriminator after its optimizer step)."
    )


def changed_argument(paths: list[str], called: str) -> ParameterChangedError:
    """The error for tensors among the arguments of a checkpoint of ``called`` (given as
    keyword arguments, or in lists, dicts and tuples: ``paths``, such as ``"mask"`` or
    ``"argument 0[2]"``) that changed in place between its forward and its replay."""
    shown = ", ".join(repr(p) for p in paths[:4]) + (
        f" and {len(paths) - 4} more" if len(paths) > 4 else ""
    )
    return ParameterChangedError(
        f"The tensor{'s' if len(paths) > 1 else ''} {shown} among the arguments of the "
        f"checkpoint of {called} changed in place between its forward and its backward, so "
        "its replay would read the new values and the gradients would be wrong (without "
        "checkpointing, autograd refuses this step too wherever the forward saved them; "
        "PyTorch's checkpoint refuses it for positional tensor arguments). A buffer reused "
        "for the next micro-batch or step before this backward is the usual cause: pass "
        "a tensor that stays as it is until the backward (a new one, or a clone), or run the "
        "backward before the write."
    )


class OutputNotSavedError(RecompError):
    """A ``save_output=False`` placeholder reached code other than an excluded region.
    ``save_output=False`` is only for a region whose output goes straight into another
    excluded region (whose saved tensors hold it); remove it anywhere else."""


class DoubleCheckpointError(RecompError):
    """A module recomp checkpoints (or excludes) is also checkpointed by a plain PyTorch
    checkpoint around recomp's: Hugging Face's own switch beside recomp's wrapper,
    PyTorch's ``checkpoint_wrapper`` (which Lightning's and Accelerate's activation
    checkpointing options apply), ``torch.utils.checkpoint``.
    ``recomp.torch.hf_activation_checkpointing`` makes recomp HF's checkpoint function
    instead."""


class ForeignCheckpointWarning(UserWarning):
    """An excluded region is replayed by a checkpoint that recomp does not control (such
    as ``mindspore.recompute``, or PyTorch's compiled checkpoint where PyTorch lacks what
    exclusion under ``torch.compile`` needs): there the exclusion is not in effect, and
    the gradients stay right. Checkpoint the layer with recomp's ``checkpoint_wrapper``.
    Issued once per wrapper."""


class CollectiveReplayedWarning(UserWarning):
    """A checkpoint's replay runs a collective again instead of reading the result its
    forward kept (the result was changed in place, or was not kept); on MindSpore, a
    collective that runs in recomputed code outside every excluded region."""


class WrapperNotReachedWarning(UserWarning):
    """The model's first forward after ``apply_activation_checkpointing`` called none of
    the modules it wrapped, so no checkpoint or exclusion took effect."""


class IneffectiveSelectionWarning(UserWarning):
    """Part of what was asked for does not take effect: a ``checkpoint_fn`` that matches
    no module, an ``exclude_fn`` that excludes nothing inside a checkpoint, or an
    excluded module called through its ``forward``/``construct`` method."""


class EarlierExclusionsWarning(UserWarning):
    """``apply_activation_checkpointing(..., exclude_fn=...)`` on a model whose
    checkpointed modules already hold excluded regions that this ``exclude_fn`` does not
    select (an earlier call's): the call adds its exclusions to those, which stay. To
    replace them, call ``unwrap(model)`` first and apply again."""


class RunningStatisticsWarning(UserWarning):
    """Recomputed code holds a BatchNorm-like module whose running statistics recomp
    cannot find, so a replay would update them a second time."""


class ReplayStateWarning(UserWarning):
    """A checkpointed forward updated module state in place that recomp kept no copy of
    (see NOTE [ Which state a checkpoint call copies ] in ``recomp._module_state``), so
    that call's replay read the updated value."""


class UnreplayableDropoutWarning(UserWarning):
    """Recomputed code holds a dropout whose random state the framework cannot restore:
    on MindSpore, an active subclass of ``nn.Dropout`` with a ``construct`` of its own,
    which recomp cannot make draw the same mask in the replay. Exclude it
    (``apply_activation_checkpointing`` does so by itself) or use ``nn.Dropout``."""


# --------------------------------------------------------------------------- swap


class SwapPolicyError(RecompError, ValueError):
    """A policy function returned something that is not a policy (a
    ``CheckpointPolicy`` or a bool), or a swap was asked for where none can happen
    (``MUST_SWAP`` with no recomp checkpoint around it, or under ``torch.compile``).
    Raised by both frameworks; also a ``ValueError``."""


class OffloadTraceWarning(UserWarning):
    """A step under an offload session saved tensors of other shapes, types or order
    than the traced step: it ran without the plan (tensors move when the budget is
    passed, as in the traced step) and the next step is traced again. The message
    names the first save that differs."""


class SwapNotSupportedError(RecompError, NotImplementedError):
    """A part of HyperParallel's activation-memory API that recomp cannot run on
    MindSpore 2.10 PyNative: ``group_swap``, ``cpu_pool`` and ``PinnedMemoryPool``,
    ``swap_tensor_wrapper`` inside a swapped layer, recompute sessions, PyTorch's
    native selective checkpointing. The message says what MindSpore lacks and what to
    do instead. Also a ``NotImplementedError``."""


# --------------------------------------------------------------------------- planner


def format_bytes(n: float) -> str:
    """Bytes as MiB (or GiB from 1 GiB on), for messages (the planner's too)."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / float(1 << 20):.2f} MiB"


class BudgetTooSmallError(ValueError):
    """The planner's memory budget is below the least activation memory any plan keeps
    (``recomp.plan.make_plan``, ``recomp plan``). ``budget_bytes`` and
    ``minimum_bytes`` say by how much; the message names the budget to give. A
    ``ValueError``, raised before anything runs (not a ``RecompError``)."""

    def __init__(self, budget_bytes: int, minimum_bytes: int, detail: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        super().__init__(
            f"memory budget {format_bytes(budget_bytes)} is below {format_bytes(minimum_bytes)}, "
            f"the least activation memory any plan keeps{detail}. Give a budget of at least "
            f"{format_bytes(minimum_bytes)} (or 0%), or make the layers smaller (batch, sequence)."
        )


class PlanFormatError(ValueError):
    """A plan file that this version of recomp cannot read (``recomp.plan.load_plan``):
    another format version, or a field missing or of the wrong type. A ``ValueError``."""
