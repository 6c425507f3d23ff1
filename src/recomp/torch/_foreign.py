"""A second, plain PyTorch checkpoint around what recomp checkpoints: refused.

A plain (non-reentrant) PyTorch checkpoint around a recomp checkpoint replays it
in backward like any other code: recomp's checkpoint runs again, its excluded
regions included, so the exclusion does not take effect, and the forward has
kept the regions' tensors for nothing. Trainers add such a checkpoint when their
own activation checkpointing is switched on as well as recomp's: Hugging Face's
(``gradient_checkpointing``, found on the layer by ``_hf.py``), and PyTorch's
``checkpoint_wrapper`` as Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)``
and Accelerate's FSDP plugin apply it, which also inserts
``_checkpoint_wrapped_module.`` into every parameter name below it.

recomp raises :class:`~recomp.errors.DoubleCheckpointError` naming the switch to
turn off, as early as it can see the second checkpoint:

* when PyTorch's ``checkpoint_wrapper`` takes a module that recomp wrapped, or
  one that holds such modules (its constructor checks first, a guard installed when
  ``recomp.torch`` is imported): before anything ran, no name changed. Nothing global
  that other models run through: no module registration hook, which every model's
  forward would call for each ``ModuleList`` slice and compiled graphs guard on;
* otherwise when a recomp checkpoint's forward starts inside the forward of a
  plain checkpoint (``torch.utils.checkpoint.checkpoint`` called by hand): the
  plain checkpoint is closed first (PyTorch 2.9 would leave it open), and recomp
  has opened nothing yet.

An excluded region under a plain checkpoint with no recomp checkpoint around it
is still only warned about, in backward (``ForeignCheckpointWarning``), unless
PyTorch's wrapper is the one that took it. PyTorch's wrapper given recomp's function
(``checkpoint_wrapper(module, checkpoint_fn=recomp.torch.checkpoint)``) checkpoints with
recomp: it is not refused.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

from torch import nn

from .._state import get_recompute_state
from .._wrapping import CHECKPOINT_KWARGS, REGION, default_name
from ..errors import DoubleCheckpointError
from . import _compat

__all__ = ["refuse_double_checkpoint", "refuse_enclosing_checkpoint"]

# Where trainers switch their own checkpointing on; every message names them.
TRAINER_SWITCHES = (
    "Lightning: leave FSDPStrategy's activation_checkpointing_policy (and the older "
    "activation_checkpointing) unset. Accelerate: FullyShardedDataParallelPlugin("
    "activation_checkpointing=False). timm: leave model.set_grad_checkpointing() off (train.py's "
    "--grad-checkpointing). diffusers: leave enable_gradient_checkpointing() off, or let recomp "
    "be its function (recomp.torch.unwrap(model), then "
    "recomp.torch.hf_activation_checkpointing(model, exclude_fn=...)). Your own code: do not "
    "apply PyTorch's checkpoint_wrapper or apply_activation_checkpointing to modules that recomp "
    "wrapped."
)


def refuse_double_checkpoint(message: str) -> NoReturn:
    """Raise ``DoubleCheckpointError(message)`` from inside the forward of a plain PyTorch
    checkpoint, closing that checkpoint first (PyTorch 2.9 would leave it open). Only
    before recomp's own checkpoint has opened anything."""
    error = DoubleCheckpointError(message)
    _compat.close_enclosing_checkpoint(error)
    raise error


def checkpointed_name(function: Any) -> str:
    """How messages name what a checkpoint runs: ``Class.forward`` for a module's method,
    else the function's name. Built only where a message needs it."""
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        return f"{type(owner).__name__}.{getattr(function, '__name__', 'forward')}"
    return repr(default_name(function))


def refuse_enclosing_checkpoint(function: Any) -> None:
    """Raise if the recomp checkpoint of ``function`` is starting inside the forward of a
    plain PyTorch checkpoint (one that recomp does not control)."""
    if get_recompute_state() is not None:
        # Inside a recomp checkpoint (nested ones are recomp's), or in its replay.
        return
    if _compat.top_checkpoint_hooks() is None:
        return
    refuse_double_checkpoint(
        f"recomp's checkpoint of {checkpointed_name(function)} is running inside a plain PyTorch checkpoint "
        "(torch.utils.checkpoint.checkpoint, or PyTorch's checkpoint_wrapper as trainers apply "
        "it for their activation checkpointing option): in backward that checkpoint would run "
        "recomp's again, excluded regions included, so the exclusion would not take effect. "
        "recomp already checkpoints it; turn the other activation checkpointing off. "
        + TRAINER_SWITCHES
    )


def check_checkpoint_wrapper(
    recomp_checkpoint: Any, module: Any, checkpoint_fn: Any, reentrant: bool
) -> Any:
    """Called by PyTorch's checkpoint wrapper before it takes ``module`` (installed when
    this module is imported). Around modules recomp excludes (and none it checkpoints),
    PyTorch's own non-reentrant checkpoint becomes recomp's: returns
    ``recomp.torch.checkpoint`` as the wrapper's ``checkpoint_fn``, so that the trainers'
    switches (accelerate's and Lightning's FSDP activation checkpointing, with
    ``offload_wrapper`` around it) checkpoint with the exclusions in effect. Raises where
    recomp checkpoints ``module`` or modules below it (two checkpoints), or where the
    wrapper asks for the reentrant checkpoint or another function. ``recomp_checkpoint``:
    ``recomp.torch.checkpoint`` (``_api`` installs this check with it bound)."""
    if not isinstance(module, nn.Module):
        return None
    checkpointed, excluded = _recomp_wrapped(module)
    if not checkpointed and not excluded:
        return None
    if _is_recomp_checkpoint(checkpoint_fn):
        # checkpoint_wrapper(module, checkpoint_fn=recomp.torch.checkpoint): the wrapper
        # checkpoints with recomp, which keeps excluded regions out of its replay (nested
        # recomp checkpoints are recomp's too).
        return None
    if not checkpointed and checkpoint_fn is None and not reentrant:
        return recomp_checkpoint
    what = type(module).__name__
    renames = (
        f"it would also insert '_checkpoint_wrapped_module.' into the name of every "
        f"parameter below it. {what} was not wrapped."
    )
    if checkpointed:
        found = (
            f"{what}, which recomp checkpoints"
            if checkpointed == [""]
            else f"{what}, which holds modules that recomp checkpoints ({_shown(checkpointed)})"
        )
        message = (
            f"PyTorch's checkpoint_wrapper is wrapping {found}: its plain checkpoint would "
            "replay recomp's in backward, excluded regions included (the exclusion would not "
            f"take effect), and {renames} recomp already checkpoints these modules; turn the "
            "other activation checkpointing off. "
        )
    else:
        asked = (
            "the reentrant checkpoint (checkpoint_impl=CheckpointImpl.REENTRANT)"
            if reentrant
            else f"another checkpoint function ({checkpoint_fn!r})"
        )
        message = (
            f"PyTorch's checkpoint_wrapper is wrapping {what}, which holds modules that recomp "
            f"excludes ({_shown(excluded)}), with {asked}: that checkpoint would replay them "
            f"(recomp stands in for PyTorch's own non-reentrant checkpoint only); {renames} "
            "Leave checkpoint_impl and checkpoint_fn at their defaults, or checkpoint with "
            "recomp (recomp.torch.apply_activation_checkpointing(model, checkpoint_fn=..., "
            "exclude_fn=...)). "
        )
    raise DoubleCheckpointError(message + TRAINER_SWITCHES)


def _is_recomp_checkpoint(function: Any) -> bool:
    """Whether ``function`` (a wrapper's ``checkpoint_fn``, maybe a ``functools.partial``)
    is ``recomp.torch.checkpoint`` (told by name: ``_api`` imports this module)."""
    for _ in range(8):
        if (
            getattr(function, "__module__", None) == "recomp.torch._api"
            and getattr(function, "__qualname__", None) == "checkpoint"
        ):
            return True
        if not isinstance(function, functools.partial):
            return False
        function = function.func
    return False


def _recomp_wrapped(module: nn.Module) -> tuple[list[str], list[str]]:
    """Paths below ``module`` (``""``: itself) of the modules recomp checkpoints and of
    those it excludes."""
    checkpointed: list[str] = []
    excluded: list[str] = []
    for path, sub in module.named_modules():
        own = vars(sub)
        if CHECKPOINT_KWARGS in own:
            checkpointed.append(path)
        elif REGION in own:
            excluded.append(path)
    return checkpointed, excluded


def _shown(paths: list[str], limit: int = 3) -> str:
    shown = ", ".join(p or "itself" for p in paths[:limit])
    return shown if len(paths) <= limit else f"{shown} and {len(paths) - limit} more"
