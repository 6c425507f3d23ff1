"""recomp inside DeepSpeed: model code that calls DeepSpeed's checkpoint runs recomp's.

Megatron-DeepSpeed-style model code checkpoints its layers with
``deepspeed.checkpointing.checkpoint(function, *args)``. :func:`install` puts a recomp
checkpoint in that function's place, so the model code and its choice of what to
checkpoint stay as they are, and::

    import recomp.torch.deepspeed

    recomp.torch.deepspeed.install(exclude=("self_attention",))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

What changes in the replay: excluded modules (classes, module paths, predicates; see
``recomp.torch._trainer_patch.Exclusions``) run once and are not replayed, so ZeRO-3
gathers their parameters for their backward only; collectives in the recomputed code
run once (``exclude_collectives``; ZeRO's own parameter all-gathers are not kept: that
would hold gathered parameters); DeepSpeed's RNG tracker (``get_cuda_rng_tracker()``)
is restored for the replay, as DeepSpeed's checkpoint does (``recomp._rng_trackers``).

Where the function is looked up:

* ``deepspeed.checkpointing`` *is* ``deepspeed.runtime.activation_checkpointing.checkpointing``
  (the package re-exports the module itself, there is no ``deepspeed/checkpointing.py``:
  ``import deepspeed.checkpointing`` fails). Its ``checkpoint`` and
  ``non_reentrant_checkpoint`` are both replaced, by one function: code that looks them
  up at call time (``deepspeed.checkpointing.checkpoint(...)``,
  ``from deepspeed import checkpointing``) runs recomp.
* ``from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint``
  binds the function it finds: run it after :func:`install` (before it, that name
  keeps DeepSpeed's checkpoint).
* ``PipelineModule(activation_checkpoint_func=checkpointing.checkpoint)`` is a default
  argument, bound when DeepSpeed was imported: :func:`install` replaces that default
  too, so a ``PipelineModule`` built while recomp is installed checkpoints with recomp
  (one built before keeps DeepSpeed's function). Since ``checkpoint`` and
  ``non_reentrant_checkpoint`` are the same function then, the pipeline engine treats
  it as the non-reentrant checkpoint it is: it does not make stage inputs require
  gradients, and ``_is_checkpointable`` applies its non-reentrant rule.
* After ``remove()``, a recomp function that code still holds (a pipeline built while
  installed, a name bound by ``from ... import``) hands its calls to the function
  ``deepspeed.checkpointing.checkpoint`` is then.

``deepspeed.checkpointing.configure`` (and the ``activation_checkpointing`` section of a
DeepSpeed config given to it) is read at each checkpoint call:

* ``partition_activations``: each checkpoint's floating-point inputs are kept split
  over the model-parallel group (DeepSpeed's ``mp_group``) until the replay gathers
  them, as DeepSpeed does: recomp's ``partition_inputs``. With a model-parallel size of
  1 the part is the whole tensor and nothing changes.
* ``cpu_checkpointing`` / ``checkpoint_in_cpu``: the inputs are kept in host memory
  until the replay (recomp's ``swap_inputs=True``; on a machine without an accelerator
  they are there already). Together with ``partition_activations`` above size 1
  (DeepSpeed's slices in host memory) recomp refuses, naming both options.
* ``contiguous_memory_optimization``: copying checkpoint inputs into buffers made in
  advance (fragmentation, not the amount kept); recomp does not, and warns once
  (``IneffectiveSelectionWarning``).
* ``synchronize``: honoured; the accelerator is synchronized at the start and end of
  each checkpoint's forward and of its replay.
* ``profile``: DeepSpeed's timers are not run; recomp warns once.

The returned value follows DeepSpeed's convention: a tuple or list of one element
comes back as that element, a longer one as a tuple.

DeepSpeed is imported by :func:`install`, never when recomp is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

from .._region import check_flag
from ..errors import IneffectiveSelectionWarning, RecompError
from ._api import checkpoint as recomp_checkpoint
from ._trainer_patch import Exclusions, Installation, replace_attributes

__all__ = ["CHECKPOINTING", "install"]

#: DeepSpeed's module that ``deepspeed.checkpointing`` is.
CHECKPOINTING = "deepspeed.runtime.activation_checkpointing.checkpointing"
_PIPELINE = "deepspeed.runtime.pipe.module"
_NAMES = ("checkpoint", "non_reentrant_checkpoint")
_API = "recomp.torch.deepspeed.install"
_REMOVE = (
    "or call remove() on the handle recomp.torch.deepspeed.install() returned to "
    "checkpoint with DeepSpeed's own function"
)


def install(exclude: Any = (), *, exclude_collectives: bool = True) -> Installation:
    """Make DeepSpeed's checkpoint functions run recomp checkpoints until the returned
    handle's ``remove()`` (or the end of its ``with`` block).

    ``exclude``: the modules inside each checkpointed function that run once and are
    never replayed: classes, module paths matched against the end of a module's dotted
    name below the modules the function runs through (``"self_attention"``,
    ``"layers.*.mlp"``), functions of a module, or a list of these (the selection every
    recomp argument that chooses modules takes; anything else raises
    :class:`~recomp.errors.SelectionError` before anything is installed).
    ``exclude_collectives``: as for
    :func:`recomp.torch.checkpoint` (collectives in recomputed code run once).

    Raises ``ImportError`` when DeepSpeed cannot be imported, ``RecompError`` when
    recomp is installed in DeepSpeed already.
    """
    check_flag("exclude_collectives", exclude_collectives)
    exclusions = Exclusions(exclude, _API)
    try:
        checkpointing = importlib.import_module(CHECKPOINTING)
    except ImportError as exc:
        raise ImportError(
            f"recomp.torch.deepspeed needs DeepSpeed, which cannot be imported here ({exc}). "
            "Install it with `pip install deepspeed`."
        ) from exc
    original = getattr(checkpointing, "checkpoint", None)
    handle: list[Installation] = []
    replacement = _recomp_in_deepspeed(
        checkpointing, original, exclusions, exclude_collectives, handle
    )
    installation = replace_attributes(
        "deepspeed", [(CHECKPOINTING, name) for name in _NAMES], replacement, exclusions=exclusions
    )
    handle.append(installation)
    _replace_pipeline_default(installation, original, replacement)
    return installation


def _replace_pipeline_default(
    installation: Installation, original: Any, replacement: Callable[..., Any]
) -> None:
    """``PipelineModule.__init__``'s ``activation_checkpoint_func`` default, bound to
    DeepSpeed's function when DeepSpeed was imported."""
    try:
        pipeline = importlib.import_module(_PIPELINE)
    except ImportError:  # a DeepSpeed without pipelines
        return
    init = getattr(getattr(pipeline, "PipelineModule", None), "__init__", None)
    defaults = getattr(init, "__defaults__", None)
    if original is None or not defaults or not any(d is original for d in defaults):
        return
    installation.replace(
        init, "__defaults__", tuple(replacement if d is original else d for d in defaults)
    )


def _recomp_in_deepspeed(
    checkpointing: Any,
    original: Any,
    exclusions: Exclusions,
    exclude_collectives: bool,
    handle: list[Installation],
) -> Callable[..., Any]:
    warned: set[str] = set()
    lock = threading.Lock()

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """recomp's checkpoint in DeepSpeed's place (``recomp.torch.deepspeed.install``);
        DeepSpeed's signature: keyword arguments go to ``function``."""
        if not handle or not handle[0].installed:
            return _after_removal(checkpointing, checkpoint, original)(function, *args, **kwargs)
        synchronize, inputs = _settings(checkpointing, warned, lock)
        exclusions.apply_within(function)
        run = functools.partial(function, **kwargs) if kwargs else function
        if synchronize is None:
            outputs = recomp_checkpoint(
                run, *args, exclude_collectives=exclude_collectives, **inputs
            )
        else:
            synchronize()
            outputs = recomp_checkpoint(
                run,
                *args,
                exclude_collectives=exclude_collectives,
                context_fn=lambda: (contextlib.nullcontext(), _Synchronized(synchronize)),
                **inputs,
            )
            synchronize()
        return _as_deepspeed_returns(outputs)

    return checkpoint


def _after_removal(checkpointing: Any, stale: Any, original: Any) -> Callable[..., Any]:
    """The function a recomp checkpoint held after ``remove()`` hands its calls to: what
    ``deepspeed.checkpointing.checkpoint`` is now (DeepSpeed's, or a newer install's)."""
    current = getattr(checkpointing, "checkpoint", None)
    if current is None or current is stale:
        current = original
    if current is None:
        raise RecompError(
            "recomp.torch.deepspeed: recomp was removed and DeepSpeed's checkpoint "
            "function cannot be found."
        )
    return current  # type: ignore[no-any-return]


class _Synchronized:
    """Synchronize the accelerator when the replay starts and when it ends."""

    def __init__(self, synchronize: Callable[[], Any]) -> None:
        self.synchronize = synchronize

    def __enter__(self) -> None:
        self.synchronize()

    def __exit__(self, *exc_info: Any) -> None:
        self.synchronize()


def _settings(
    checkpointing: Any, warned: set[str], lock: threading.Lock
) -> tuple[Callable[[], Any] | None, dict[str, Any]]:
    """What ``deepspeed.checkpointing.configure`` asked for, as recomp's: the
    accelerator's synchronize function when ``synchronize`` is on, and the checkpoint's
    options for where its inputs are kept (``partition_inputs``, ``swap_inputs``)."""
    inputs: dict[str, Any] = {}
    size = getattr(checkpointing, "mp_size", 1) or 1
    if getattr(checkpointing, "PARTITION_ACTIVATIONS", False) and size > 1:
        group = getattr(checkpointing, "mp_group", None)
        if group is None:
            raise RecompError(
                "recomp.torch.deepspeed: partition_activations is on with a model-parallel "
                f"size of {size}, but DeepSpeed's checkpointing has no model-parallel group "
                "to split the inputs over: pass mpu_= to deepspeed.checkpointing.configure "
                f"(or to deepspeed.initialize), {_REMOVE}."
            )
        inputs["partition_inputs"] = group
    if getattr(checkpointing, "CPU_CHECKPOINT", False):
        if inputs:
            raise RecompError(
                "recomp.torch.deepspeed: cpu_checkpointing together with "
                f"partition_activations at a model-parallel size of {size} asks for the "
                "inputs' slices in host memory; recomp keeps them split on the device or "
                "whole in host memory, not both. Set one of the two to false, "
                f"{_REMOVE}."
            )
        inputs["swap_inputs"] = True  # in host memory until the replay
    for flag, message in _WARNED_SETTINGS:
        if getattr(checkpointing, flag, False) and flag not in warned:
            with lock:
                first = flag not in warned
                warned.add(flag)
            if first:
                warnings.warn(message, IneffectiveSelectionWarning, stacklevel=3)
    if not getattr(checkpointing, "SYNCHRONIZE", False):
        return None, inputs
    accelerator = checkpointing.get_accelerator()
    return accelerator.synchronize, inputs


_WARNED_SETTINGS = (
    (
        "CONTIGUOUS_CHECKPOINTING",
        "recomp.torch.deepspeed: contiguous_memory_optimization has no effect: recomp does "
        "not copy checkpoint inputs into buffers allocated in advance (what is kept is "
        "the same; memory may fragment more).",
    ),
    (
        "PROFILE_TIME",
        "recomp.torch.deepspeed: profile has no effect: DeepSpeed's timers do not run "
        "around recomp's checkpoints.",
    ),
)


def _as_deepspeed_returns(outputs: Any) -> Any:
    """What DeepSpeed's checkpoint returns for ``outputs``: a sequence of one element
    as the element, a longer one as a tuple, anything else as it is."""
    if isinstance(outputs, (tuple, list)):
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    return outputs
