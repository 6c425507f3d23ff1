"""Public PyTorch API: ``checkpoint``, the two module wrappers, and model-wide wrapping."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from .. import _engine, _wrapping
from .._hyperparallel import without_noop
from .._module_state import warn_unhandled
from .._region import active_region
from .._saved_hooks import UserHooks, exclude_placer
from .._selection import Selection
from .._state import get_recompute_state
from .._wrapping import (
    CHECKPOINT_KWARGS,
    REGION,
    RegionCounters,
    check_callable,
    check_options,
    default_name,
)
from ..errors import RecompError
from . import _compat, _compile, _hf, _kept, _offload_session, _partition, _swap
from ._backend import BACKEND
from ._collective_cache import collectives_may_run, keep_collective_results
from ._debug import debug_options
from ._foreign import check_checkpoint_wrapper, refuse_enclosing_checkpoint
from ._hf import adapt_hf_layer_call, guard_model_cache
from ._offload import Offloader, resolve
from ._plain import PlainFunction
from ._value_check import value_check_option

# The options a checkpoint wrapper passes to every checkpoint of its module: PyTorch's
# non-reentrant checkpoint's and recomp's own.
CHECKPOINT_OPTIONS = (
    "context_fn",
    "cpu_pool",
    "debug",
    "determinism_check",
    "early_stop",
    "exclude_collectives",
    "group_swap",
    "partition_inputs",
    "policy_fn",
    "preserve_rng_state",
    "saved_tensors_hooks",
    "swap_inputs",
    "use_reentrant",
)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    use_reentrant: bool | None = None,
    exclude_collectives: bool = True,
    policy_fn: Callable[..., Any] | list[Any] | None = None,
    swap_inputs: bool = False,
    group_swap: bool = False,
    cpu_pool: Any = None,
    partition_inputs: Any = None,
    saved_tensors_hooks: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` with recomp's recompute state installed.

    Built on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; its
    options (``preserve_rng_state``, ``determinism_check``, ``early_stop``, ...)
    pass through; ``debug=True`` (or PyTorch's ``set_checkpoint_debug_enabled``)
    adds a log of the forward's and the replay's ops, excluded regions marked, to
    replay errors. ``context_fn`` is composed with recomp's own contexts, which
    are entered first. Excluded regions called inside run once in the forward
    and are skipped when the forward is replayed during backward. What a replay
    recomputes is kept until a backward pass reads it, so a backward split into
    passes over one graph (zero-bubble pipeline schedules) replays once; see
    :func:`recompute_handle` to run the replay ahead of backward.

    Collectives in the recomputed code (DTensor redistributions, functional
    collectives, ``torch.distributed`` calls) also run once: the forward keeps
    their results until backward and the replay reads them instead of
    communicating again. ``exclude_collectives=False`` communicates again in
    the replay and keeps nothing.

    ``partition_inputs=group`` (a ``torch.distributed`` process group, usually the
    tensor-parallel one) keeps each floating-point input the checkpoint saves split
    over the group until the replay, 1/n per rank, and gathers it there (one
    all-gather per input): Megatron-Core's ``distribute_saved_activations`` and
    DeepSpeed's ``partition_activations``; NOTE [ Partitioned checkpoint inputs ] in
    ``recomp.torch._partition``.

    ``saved_tensors_hooks=(pack, unpack)`` applies a pair of saved-tensors hooks to what
    the checkpoint keeps (compression, a custom store): the inputs it saves for its
    replay and what the excluded regions called inside it keep for their backward
    (saved tensors and cached outputs; a region's own ``offload`` or
    ``saved_tensors_hooks`` wins). ``pack`` runs once per tensor in the forward,
    ``unpack`` once per read. For those tensors the pair takes the place of an enclosing
    ``torch.autograd.graph.saved_tensors_hooks`` (the innermost hooks apply, as in
    PyTorch; the enclosing ones still see what the code around the checkpoint saves).
    It cannot be given with ``swap_inputs`` or ``partition_inputs``, which keep the
    inputs their own way.

    HyperParallel's options: ``policy_fn`` (per op, a function or a list of ops to
    save, see :func:`recomp.torch.hyperparallel.create_selective_checkpoint_contexts`;
    ``CheckpointPolicy.MUST_SWAP`` keeps an op's output on the host until backward),
    ``swap_inputs=True`` (the checkpoint's own saved inputs go to the host until the
    replay), ``group_swap`` and ``cpu_pool`` (a
    :class:`recomp.torch.hyperparallel.PinnedMemoryPool`; NOTE [ Swap scopes ] in
    ``recomp.torch._swap.scope``). ``context_fn=noop_context_fn()`` (HyperParallel's) is no
    ``context_fn``.
    """
    if use_reentrant is not None:
        _engine.check_use_reentrant(use_reentrant, BACKEND.package)
    if exclude_collectives is not True:
        _engine.check_flag("exclude_collectives", exclude_collectives)
    if context_fn is not None:  # HyperParallel's no-op: none (torch.compile wants that)
        context_fn = without_noop(context_fn)
    if _compile.is_compiling():
        if partition_inputs is not None or saved_tensors_hooks is not None:
            raise ValueError(
                "recomp.torch.checkpoint under torch.compile does not support "
                "partition_inputs or saved_tensors_hooks: they run in eager mode only."
            )
        context_fn = _swap.CheckpointSwap(
            policy_fn, swap_inputs, group_swap, cpu_pool
        ).compiled_context_fn(context_fn)
        # PyTorch's partitioner never recomputes a functional collective (which is what
        # Dynamo makes of every collective) unless told to: nothing to add here. A
        # compiled program saves no tensor through hooks: no value check there. (The
        # eager call checked the function already; Dynamo 2.9 cannot trace that check.)
        value_check_option(kwargs, debug=False, compiled=True)
        return _compile.checkpoint(function, args, kwargs, context_fn)
    if isinstance(function, type) or not callable(function):
        check_callable(function, "checkpoint", "module")
    user: Any = None if saved_tensors_hooks is None else UserHooks(saved_tensors_hooks, "checkpoint")
    if user is not None and (partition_inputs is not None or swap_inputs):
        raise ValueError(
            "checkpoint(..., saved_tensors_hooks=...) cannot be combined with "
            "partition_inputs or swap_inputs=True: each keeps the checkpoint's saved "
            "inputs its own way. Pass one of them."
        )
    eager = _eager_checkpoint if _compat.dynamo_frame_callback() is None else _untraced()
    return eager(
        function,
        args,
        kwargs,
        context_fn,
        exclude_collectives,
        user,
        policy_fn,
        swap_inputs,
        group_swap,
        cpu_pool,
        partition_inputs,
    )


def _eager_checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    exclude_collectives: bool = True,
    user: Any = None,
    policy_fn: Callable[..., Any] | list[Any] | None = None,
    swap_inputs: bool = False,
    group_swap: bool = False,
    cpu_pool: Any = None,
    partition_inputs: Any = None,
) -> Any:
    """:func:`checkpoint` in eager mode, its options checked (``user``: the pair of
    saved-tensors hooks given, as ``UserHooks``). A checkpoint wrapper given no options
    calls it directly: the defaults need no check."""
    if _TORCH_CALL.pending:
        _TORCH_CALL.pending = False
        raise RecompError(
            "recomp.torch.checkpoint was called again by the function it called as "
            "PyTorch's checkpoint: torch.utils.checkpoint.checkpoint had been replaced by a "
            "function that calls recomp's checkpoint before recomp.torch was imported, and "
            "recomp took that replacement for PyTorch's own. Import recomp.torch before "
            "replacing torch.utils.checkpoint.checkpoint."
        )
    if not torch.is_grad_enabled() and get_recompute_state() is None:
        # NOTE [ Nothing to checkpoint without gradients ]: no graph is built, so nothing
        # is saved, kept or replayed. Outside every recomp checkpoint, the call is the
        # function's own call, with no checkpoint machinery around it (PyTorch's
        # checkpoint would still stash the RNG state, infer devices and enter the
        # contexts). Inside one, the engine still runs, so that a replay of the
        # enclosing checkpoint finds the same nested calls as its forward did.
        return function(*args, **_function_kwargs(kwargs))
    if user is None and partition_inputs is None and not swap_inputs:
        # An offload session keeps what the checkpoint keeps (NOTE [ Offload sessions ]).
        user = _offload_session.active_placer()
    # No swap, no partition, no pair of hooks (the common call): none of their parts.
    plain = (
        policy_fn is None
        and swap_inputs is False
        and group_swap is False
        and cpu_pool is None
        and partition_inputs is None
        and user is None
        and context_fn is None  # a user's selective checkpointing may swap (MUST_SWAP)
    )
    swap = None if plain else _swap.CheckpointSwap(policy_fn, swap_inputs, group_swap, cpu_pool)
    partitioned = None if partition_inputs is None else _partition.for_call(partition_inputs)
    if _hf.LAYERS_MODULE in sys.modules:  # HF's layers exist: this may be one
        adapt_hf_layer_call(function, kwargs)
    refuse_enclosing_checkpoint(function)
    if "debug" in kwargs or _compat.checkpoint_debug_switch() is not None:
        parts, kwargs, torch_debug_off = debug_options(kwargs)
    else:
        parts, torch_debug_off = [], None
    if parts or kwargs.get("determinism_check") == "values":
        value_check = value_check_option(kwargs, debug=bool(parts), function=function)
        if value_check is not None:
            parts.append(value_check)
    if _engine.SWITCHES.kept_replays:
        parts.append(_kept.KEPT_REPLAYS)
    if exclude_collectives and collectives_may_run():
        parts.append(keep_collective_results(function))
    selective = None if swap is None else swap.part()
    if selective is not None:
        parts.append(selective)
    call = _engine.begin(
        BACKEND,
        args,
        kwargs,
        context_fn,
        parts,
        align_rng=kwargs.get("preserve_rng_state", True),
        function=function,
        placer=user,
    )
    if swap is None and torch_debug_off is None:
        try:
            return _torch_checkpoint(call.function, args, kwargs, call.context_fn)
        except BaseException as exc:
            _compat.finish_failed_checkpoint(exc)  # PyTorch 2.9 leaves it open
            raise
    if partitioned is not None:
        saved_inputs = partitioned.hooks()
    elif user is not None:
        saved_inputs = BACKEND.saved_tensors_hooks(*user.input_hooks())
    else:
        saved_inputs = None
    scope = (
        contextlib.nullcontext(_identity)
        if swap is None
        else swap.scope(function, context_fn, saved_inputs)
    )
    with torch_debug_off or contextlib.nullcontext(), scope as finish:
        return _run_checkpoint(function, args, kwargs, call, finish, partitioned)


def _untraced() -> Callable[..., Any]:
    """``_eager_checkpoint`` for where Dynamo runs the frames a compiled function calls
    but runs this call's caller eagerly (it gave up on that frame): untraced, with
    everything it calls (``_compat.dynamo_frame_callback``), as PyTorch's checkpoint runs.
    Made on first use: disabling Dynamo imports it, which a program that never compiles
    does not load (and one asked here has)."""
    if not _UNTRACED:
        _UNTRACED.append(torch.compiler.disable(_eager_checkpoint))
    return _UNTRACED[0]


_UNTRACED: list[Callable[..., Any]] = []


def _identity(out: Any) -> Any:
    return out


def _run_checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: _engine.CheckpointCall,
    finish: Callable[[Any], Any] | None,
    partitioned: _partition.PartitionedInputs | None = None,
) -> Any:
    try:
        out = _torch_checkpoint(call.function, args, kwargs, call.context_fn)
        if finish is not None:
            out = finish(out)
        if partitioned is not None:
            partitioned.forward_done()
        return out
    except BaseException as exc:
        _compat.finish_failed_checkpoint(exc)  # PyTorch 2.9 leaves it open
        raise


class _TorchCall(threading.local):
    """Whether this thread called PyTorch's checkpoint and it has not started the call's
    contexts yet: a recomp checkpoint entered then was called by that function itself."""

    pending = False


_TORCH_CALL = _TorchCall()


def _torch_checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context_fn: Callable[[], tuple[Any, Any]],
) -> Any:
    """PyTorch's checkpoint (as bound when recomp was imported) on ``function``."""
    checkpoint = _compile.torch_checkpoint
    if checkpoint is _compile.PYTORCH_CHECKPOINT:  # PyTorch's own: nothing to guard
        return checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    def started() -> tuple[Any, Any]:
        _TORCH_CALL.pending = False
        return context_fn()

    _TORCH_CALL.pending = True
    try:
        return checkpoint(function, *args, use_reentrant=False, context_fn=started, **kwargs)
    finally:
        _TORCH_CALL.pending = False


#: Options of PyTorch's checkpoint itself, never passed on to the checkpointed function.
_TORCH_CHECKPOINT_OPTIONS = frozenset(
    {"preserve_rng_state", "determinism_check", "debug", "early_stop", "respect_saved_tensors_hooks"}
)


def _function_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    if _TORCH_CHECKPOINT_OPTIONS.isdisjoint(kwargs):
        return kwargs
    return {k: v for k, v in kwargs.items() if k not in _TORCH_CHECKPOINT_OPTIONS}


#: Names that make a keyword argument of a wrapped module's call an option of its checkpoint.
_OPTION_NAMES = frozenset(CHECKPOINT_OPTIONS)


def _refuse_script(module: nn.Module) -> nn.Module:
    """``torch.jit.script`` asks every module for its scriptable form first: a wrapped one
    answers with an error that names the way out, instead of TorchScript's complaint
    about the type annotations of recomp's attributes."""
    wrapper = "checkpoint_wrapper" if isinstance(module, CheckpointWrapper) else (
        "checkpoint_exclude_wrapper"
    )
    raise RecompError(
        f"torch.jit.script cannot compile {type(module).__name__}: recomp wrapped it "
        f"({wrapper}) and TorchScript cannot run recomp's checkpoints or excluded regions. "
        f"Script the model before wrapping it, call recomp.torch.unwrap(model) first, or "
        f"use torch.compile, which compiles wrapped models."
    )


class CheckpointWrapper(_wrapping.WrapperMixin, nn.Module):
    """The class of every module wrapped by :func:`checkpoint_wrapper` derives from this.

    ``forward`` runs the module's own ``forward`` as a recomp :func:`checkpoint`.
    Hooks registered on the module itself run outside the checkpoint (where
    FSDP2's all-gather and reduce-scatter hooks must be); hooks of its
    sub-modules run inside it.
    """

    _recomp_prefix = "Checkpointed"
    _recomp_public = ("checkpoint_kwargs",)
    _recomp_checkpoint_kwargs: dict[str, Any]
    _recomp_instance_method: Callable[..., Any] | None

    __prepare_scriptable__ = _refuse_script

    @staticmethod
    def _recomp_allocate(cls: type) -> Any:
        return object.__new__(cls)

    @property
    def checkpoint_kwargs(self) -> dict[str, Any]:
        """Options passed to every :func:`checkpoint` of this module."""
        kwargs: dict[str, Any] = self._recomp_checkpoint_kwargs
        return kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own = self._recomp_instance_method or super().forward
        if not torch.is_grad_enabled() and get_recompute_state() is None:
            if not _compile.is_compiling():
                # NOTE [ Nothing to checkpoint without gradients ] (in checkpoint above)
                return own(*args, **kwargs)
        elif not _compile.is_compiling():
            options = self._recomp_checkpoint_kwargs
            if not options and (not kwargs or _OPTION_NAMES.isdisjoint(kwargs)):
                # No option (the common wrapper): the eager call, with no option to check
                # (untraced where Dynamo gave up on a compiled function's frame that
                # called this one: ``_untraced``).
                if _compat.dynamo_frame_callback() is None:
                    return _eager_checkpoint(own, args, kwargs)
                return _untraced()(own, args, kwargs)
        return checkpoint(own, *args, **self._recomp_checkpoint_kwargs, **kwargs)

    def extra_repr(self) -> str:
        own = ", ".join(f"{k}={v!r}" for k, v in self._recomp_checkpoint_kwargs.items())
        return ", ".join(part for part in (super().extra_repr(), own) if part)


class ExcludeWrapper(RegionCounters, _wrapping.WrapperMixin, nn.Module):
    """The class of every module wrapped by :func:`checkpoint_exclude_wrapper` derives from this.

    Inside a recomp checkpoint, a call of the module (its hooks included) runs
    once in the forward, keeps its saved tensors and output, and returns the
    cached output when the forward is replayed. Anywhere else it is a plain
    call. ``region_runs`` and ``region_skips`` count executions and skipped
    replays; ``region_saved_bytes`` is what the last call keeps for backward.
    """

    _recomp_prefix = "Excluded"
    _recomp_public = ("region", "region_runs", "region_skips", "region_saved_bytes", "save_output")
    _recomp_region: _engine.ExcludedRegion

    __prepare_scriptable__ = _refuse_script

    @staticmethod
    def _recomp_allocate(cls: type) -> Any:
        return object.__new__(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _compile.is_compiling():
            # Nothing of the region's own is read: a value read here would be a guard of
            # the compiled graph (its name differs per layer: one graph per layer).
            return _compile.excluded_call(super().__call__, args, kwargs)
        region = self._recomp_region
        if not torch.is_grad_enabled() and get_recompute_state() is None:
            # NOTE [ Nothing to checkpoint without gradients ]: what region.call does
            # there, without its checks (each needs gradients or a checkpoint).
            out = super().__call__(*args, **kwargs)
            region.runs += 1
            return out
        return region.call(super().__call__, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The check warns only with gradients on (see ExcludedRegion.check_method_call);
        # called through the wrapper (the region is active: every call of the region),
        # there is nothing to check. Compiled, nothing is checked (Dynamo 2.9 cannot
        # trace the context variable).
        region = self._recomp_region
        if (
            torch.is_grad_enabled()
            and not _compile.is_compiling()
            and active_region() is not region
        ):
            region.check_method_call("forward")
        return super().forward(*args, **kwargs)

    def extra_repr(self) -> str:
        own = f"region={self.region.name!r}, save_output={self.save_output}"
        if isinstance(self.region.placer, UserHooks):
            own += ", saved_tensors_hooks=(pack, unpack)"
        elif self.region.placer is not None:
            own += ", offload=True"
        return ", ".join(part for part in (super().extra_repr(), own) if part)


def checkpoint_wrapper(module: Any, **checkpoint_kwargs: Any) -> Any:
    """Make every call of ``module`` a recomp :func:`checkpoint` (options pass through).

    Wraps in place and returns the same module: its class becomes a subclass of
    its own class and :class:`CheckpointWrapper`, so names, containers and
    ``isinstance`` checks are unchanged. :func:`unwrap` undoes it. A plain
    function is put in a small module first.
    """
    check_callable(module, "checkpoint_wrapper", "module")
    check_options("checkpoint_wrapper", checkpoint_kwargs, CHECKPOINT_OPTIONS)
    _engine.check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", None), BACKEND.package)
    if "exclude_collectives" in checkpoint_kwargs:
        _engine.check_flag("exclude_collectives", checkpoint_kwargs["exclude_collectives"])
    if not isinstance(module, nn.Module):
        module = PlainFunction(module)
    _wrapping.check_wrappable(MODEL_OPS, module, CheckpointWrapper, "checkpoint_wrapper")
    warn_unhandled(BACKEND, module, "checkpoint_wrapper")
    return _wrapping.wrap_in_place(
        MODEL_OPS, module, CheckpointWrapper, {CHECKPOINT_KWARGS: checkpoint_kwargs}
    )


def checkpoint_exclude_wrapper(
    module: Any,
    *,
    save_output: bool = True,
    copy_output: bool = False,
    name: str | None = None,
    offload: bool | Offloader = False,
    saved_tensors_hooks: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None,
) -> Any:
    """Make a module or function a region that recomp checkpoints never replay.

    Wraps a module in place and returns it (see :func:`checkpoint_wrapper`); a
    plain function comes back as a small module around it.
    ``save_output=False`` does not cache the output; the replay hands a
    zero-element placeholder on. Use it only when the output goes straight into
    another excluded region (whose saved tensors already hold it): a chain of
    excluded regions then keeps one copy. Any other use raises
    :class:`recomp.errors.OutputNotSavedError` during backward.
    ``name`` appears in error messages (default: the module's class name).
    ``copy_output=True`` caches a copy of the output instead of an alias: for a
    region whose output the code after it changes in place (a library's
    ``out += identity`` after a normalization, ``ReLU(inplace=True)``), which
    otherwise raises :class:`recomp.errors.CachedValueMutatedError`. It costs
    one more copy of the output.

    ``offload=True`` copies what the region keeps for its backward (its saved
    tensors and cached output, not parameters, deferred inputs or the
    checkpoint's inputs) to pinned host memory on a side CUDA stream, releases
    the device copy once that is done, and brings it back ahead of the region's
    backward. On a machine without CUDA it does nothing (unless the
    ``RECOMP_OFFLOAD_HOST_COPY=1`` test mode is on). An :class:`Offloader` passed
    instead of True sets the size threshold and collects its own counters.

    ``saved_tensors_hooks=(pack, unpack)`` hands the same tensors (what the region
    keeps for its backward, cached output included) to a pair of saved-tensors hooks
    instead: ``pack`` once per tensor in the forward, ``unpack`` once per read. Inside
    the region the pair replaces an enclosing ``torch.autograd.graph.saved_tensors_hooks``
    for those tensors. It cannot be given with ``offload``.
    """
    check_callable(module, "checkpoint_exclude_wrapper", "module")
    placer = exclude_placer(offload, saved_tensors_hooks, resolve)
    if _wrapping.same_region(module, ExcludeWrapper, name, save_output, copy_output, placer):
        return module  # wrapped inline again (in the checkpointed function): the same region
    region = _engine.ExcludedRegion(
        BACKEND, name or default_name(module), save_output, copy_output, placer
    )
    if not isinstance(module, nn.Module):
        module = PlainFunction(module)
    _wrapping.check_wrappable(MODEL_OPS, module, ExcludeWrapper, "checkpoint_exclude_wrapper")
    return _wrapping.wrap_in_place(MODEL_OPS, module, ExcludeWrapper, {REGION: region})


def unwrap(module: Any) -> Any:
    """Undo recomp's wrapping of ``module`` and of every module below it, in place.

    Restores each wrapped module's class and removes recomp's attributes; returns
    ``module`` (or, for a function given to ``checkpoint_exclude_wrapper``, the function).
    Layers :func:`hf_activation_checkpointing` took over get back the checkpoint function
    Hugging Face had given them (PyTorch's): HF's own switch stays as it is. The hooks of
    ``swap_wrapper`` are removed too.
    """
    if isinstance(module, type):
        raise _wrapping.instance_required(module, "unwrap", "module wrapped by recomp")
    swapped = _swap.unwrap_swaps(module)
    taken = _hf.recomp_hf_layers(module) if isinstance(module, nn.Module) else []
    if (taken or swapped) and not any(
        _wrapping.recomp_wrapper_of(m) is not None for m in module.modules()
    ):
        _hf.undo_hf_checkpointing(taken)  # hf_activation_checkpointing without exclusions
        return module  # or only swap wrappers below it
    result = _wrapping.unwrap(MODEL_OPS, module)
    _hf.undo_hf_checkpointing(taken)
    return result


# What each selection argument may be (see recomp._selection).
Selects = type | str | Callable[[nn.Module], bool] | list[Any] | tuple[Any, ...]


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    checkpoint_fn: Selects | None = None,
    exclude_fn: Selects | None = None,
    offload_fn: Selects | None = None,
    copy_output_fn: Selects | None = None,
    layers: Sequence[int] | None = None,
    **checkpoint_kwargs: Any,
) -> nn.Module:
    """Checkpoint every sub-module ``checkpoint_fn`` selects, excluding inside them every
    sub-module ``exclude_fn`` selects. Wraps in place and returns the model; every name
    (``named_modules``, ``named_parameters``, ``state_dict``) stays as it was::

        apply_activation_checkpointing(
            model, checkpoint_fn=DecoderLayer, exclude_fn="layers.*.self_attn"
        )

    Each of ``checkpoint_fn``, ``exclude_fn``, ``offload_fn`` and ``copy_output_fn`` is a
    *selection*: a module class (``isinstance``), a module path (a string matched against
    the end of each module's dotted path in ``model``, at a dot, with ``fnmatch``
    wildcards: ``"self_attn"``, ``"layers.*.mlp"``), a function of a module returning
    true for the modules to select, or a list or tuple of these (a module any of them
    selects). Anything else, a module instance where its class or path was meant, or a
    path that matches no module of ``model`` raises :class:`recomp.SelectionError`, and
    a class passed as ``model`` :class:`recomp.InstanceRequiredError`, before anything is
    wrapped.

    Checkpoints are not nested: below a checkpointed module only exclusions are
    applied. Every module is checked before any is wrapped: on an error the model is
    unchanged. ``offload_fn`` selects the excluded modules that get ``offload=True``
    (a function may also return an :class:`Offloader`, see
    :func:`checkpoint_exclude_wrapper`), and ``copy_output_fn`` those that get
    ``copy_output=True``: for an excluded module whose output the code after it changes
    in place (torchvision's BatchNorms, followed by ``ReLU(inplace=True)`` and
    ``out += identity``). Other options pass to :func:`checkpoint_wrapper`,
    ``exclude_collectives`` among them (see :func:`checkpoint`).

    ``layers`` holds the checkpoints to some of the model's layers, by position from 0:
    ``range(16)`` (the first 16), ``[0, 4, 8]``, ``range(0, 32, 2)`` (every other one).
    ``checkpoint_fn`` then selects among the modules of those layers (the layers
    themselves, or regions inside them), and without ``checkpoint_fn`` the chosen layers
    are checkpointed whole; ``range(0)`` checkpoints nothing. The layers are a Hugging
    Face model's decoder (or encoder) layers, else the blocks of a container named
    ``layers``, else the children of a model that is itself a ``Sequential`` or
    ``ModuleList``. A number (``layers=4``), a negative or repeated position, a position
    past the last layer or a model without layers raises :class:`recomp.SelectionError`
    before anything is wrapped.

    Called again on a model wrapped before, it leaves every wrapper in place and adds:
    checkpoints where ``checkpoint_fn`` selects modules outside every checkpoint,
    excluded regions where ``exclude_fn`` selects modules inside one. It never removes an
    earlier call's exclusions; where an earlier checkpoint holds excluded regions this
    ``exclude_fn`` does not select, it says so with an
    :class:`recomp.EarlierExclusionsWarning` naming them. To replace the exclusions,
    :func:`unwrap` the model first and apply again.
    """
    _wrapping.check_something_to_checkpoint("apply_activation_checkpointing", checkpoint_fn, layers)
    selected = _wrapping.read_selections(
        MODEL_OPS,
        model,
        "apply_activation_checkpointing",
        {
            "checkpoint_fn": checkpoint_fn,
            "exclude_fn": exclude_fn,
            "offload_fn": offload_fn,
            "copy_output_fn": copy_output_fn,
        },
        required=("checkpoint_fn",) if layers is None else (),
    )
    chosen = _wrapping.read_layers(MODEL_OPS, model, "apply_activation_checkpointing", layers)
    exclude_region = exclusion_options(
        "apply_activation_checkpointing", selected, checkpoint_kwargs
    )
    _wrapping.apply_activation_checkpointing(
        MODEL_OPS,
        model,
        _wrapping.held_to_layers(selected["checkpoint_fn"], chosen),
        selected["exclude_fn"],
        lambda m: checkpoint_wrapper(m, **checkpoint_kwargs),
        exclude_region,
    )
    guard_model_cache(model)
    return model


def exclusion_options(
    api: str, selected: dict[str, Selection | None], checkpoint_kwargs: dict[str, Any]
) -> Callable[[nn.Module, str], Any]:
    """Check the checkpoint options of a whole-model call (``api``) and that its option
    selections come with an ``exclude_fn``, before anything is wrapped; return the
    function that makes an excluded region of a module at a path. Pops ``use_reentrant``
    from the options."""
    select_offload, select_copy = selected["offload_fn"], selected["copy_output_fn"]
    check_options(api, checkpoint_kwargs, CHECKPOINT_OPTIONS)
    _engine.check_use_reentrant(checkpoint_kwargs.pop("use_reentrant", None), BACKEND.package)
    if "exclude_collectives" in checkpoint_kwargs:
        _engine.check_flag("exclude_collectives", checkpoint_kwargs["exclude_collectives"])
    _wrapping.check_option_fns(
        selected["exclude_fn"], offload_fn=select_offload, copy_output_fn=select_copy
    )
    if checkpoint_kwargs.get("saved_tensors_hooks") is not None:
        UserHooks(checkpoint_kwargs["saved_tensors_hooks"], api)  # checked before wrapping
        if select_offload is not None:
            raise ValueError(
                f"{api}(..., saved_tensors_hooks=...) cannot be combined with offload_fn: "
                "the excluded regions keep their tensors through the hooks. Pass one of them."
            )

    def exclude_region(module: nn.Module, path: str) -> Any:
        return checkpoint_exclude_wrapper(
            module,
            name=path,
            offload=_offload_choice(select_offload, path, module),
            copy_output=select_copy is not None and select_copy.matches(path, module),
        )

    return exclude_region


def _offload_choice(selection: Selection | None, path: str, module: nn.Module) -> Any:
    """The ``offload=`` of an excluded module: what a function of ``offload_fn`` returned
    for it (True, False or an Offloader), else whether the selection selects it."""
    if selection is None:
        return False
    for predicate in selection.predicates:
        choice = predicate(module)
        if isinstance(choice, Offloader) or choice:
            return choice
    return Selection(selection.argument, selection.classes, selection.patterns).matches(
        path, module
    )


def hf_activation_checkpointing(
    model: nn.Module,
    *,
    exclude_fn: Selects | None = None,
    offload_fn: Selects | None = None,
    copy_output_fn: Selects | None = None,
    **checkpoint_kwargs: Any,
) -> nn.Module:
    """Make recomp Hugging Face's activation checkpointing for a ``transformers`` model::

        hf_activation_checkpointing(model, exclude_fn=LlamaAttention)
        trainer = SFTTrainer(model=model, ...)  # gradient_checkpointing=True, TRL's default

    Turns HF's checkpointing on (``model.activation_checkpointing_enable()``) with recomp's
    :func:`checkpoint` as the function each ``GradientCheckpointingLayer`` is checkpointed
    with, and excludes inside those layers every sub-module ``exclude_fn`` selects (a
    selection, as in :func:`apply_activation_checkpointing`: a class, a module path such as
    ``"layers.*.self_attn"`` measured from ``model``, a function of a module, or a list of
    these; ``offload_fn`` and ``copy_output_fn`` as there too).
    HF's switch then means recomp: a later ``activation_checkpointing_enable()`` /
    ``gradient_checkpointing_enable()`` (``Trainer`` and TRL call it for
    ``gradient_checkpointing=True``; PEFT) keeps recomp as the function, with the keyword
    arguments it was given; ``use_reentrant=True`` among them warns and is not followed
    (recomp's checkpoint is non-reentrant). HF's ``every_n_layers`` keeps its meaning
    and its ``offload=True`` is recomp's ``swap_inputs=True`` (each layer's inputs in host
    memory until its replay). ``activation_checkpointing_disable()`` turns
    the layers' checkpointing off (the excluded modules then run as plain calls). Other
    options pass to :func:`checkpoint` (HF's keyword arguments win on a key both name).
    :func:`unwrap` undoes it. ``model`` is the HF model (a ``PreTrainedModel``, or a
    ``PeftModel`` around one); wraps in place and returns it.

    A ``diffusers`` model (a UNet, a Flux or SD3 transformer: a ``ModelMixin`` that supports
    gradient checkpointing, or a ``PeftModel`` around one) is taken the same way: its switch,
    ``enable_gradient_checkpointing()`` (what its training scripts call for
    ``--gradient_checkpointing``), is turned on with recomp's checkpoint as the function,
    and keeps it when turned on again with diffusers' default function;
    ``disable_gradient_checkpointing()`` turns it off. diffusers checkpoints sub-modules of
    its blocks (resnets, transformer blocks): ``exclude_fn`` takes effect for the modules
    inside those.
    """
    api = "hf_activation_checkpointing"
    if isinstance(model, type):
        raise _wrapping.instance_required(model, api, "Hugging Face model")
    layers, diffusers = _hf.hf_switch_modules(model) if isinstance(model, nn.Module) else ([], None)
    if not layers:
        raise ValueError(
            f"hf_activation_checkpointing found no transformers GradientCheckpointingLayer in "
            f"{type(model).__name__}, and it is not a diffusers model that supports gradient "
            f"checkpointing: it makes recomp the checkpoint function of a Hugging Face model's "
            f"own switch. For other models use apply_activation_checkpointing."
        )
    selected = _wrapping.read_selections(
        MODEL_OPS,
        model,
        api,
        {"exclude_fn": exclude_fn, "offload_fn": offload_fn, "copy_output_fn": copy_output_fn},
    )
    exclude_region = exclusion_options(api, selected, checkpoint_kwargs)
    # A transformers layer checkpoints itself; a diffusers block hands the function any of
    # its sub-modules.
    doubled = [
        path or "(the model itself)"
        for path, m in (model.named_modules() if diffusers is not None else layers)
        if isinstance(m, CheckpointWrapper)
    ]
    if doubled:
        raise ValueError(
            f"hf_activation_checkpointing: recomp's checkpoint_wrapper already checkpoints "
            f"{', '.join(doubled[:3])}{' ...' if len(doubled) > 3 else ''}; with HF's "
            f"checkpointing on as well they would be checkpointed twice. Call "
            f"recomp.torch.unwrap(model) first (then pass exclude_fn here)."
        )
    enable: Callable[[], Any] | None = (
        diffusers.enable_gradient_checkpointing
        if diffusers is not None
        else getattr(model, "activation_checkpointing_enable", None)
        or getattr(model, "gradient_checkpointing_enable", None)
    )
    if enable is None or not getattr(model, "supports_gradient_checkpointing", True):
        raise ValueError(
            f"hf_activation_checkpointing needs the Hugging Face model itself (a "
            f"PreTrainedModel that supports activation checkpointing, or a PeftModel around "
            f"one); {type(model).__name__} has no activation_checkpointing_enable."
        )
    owner = _hf.HFCheckpointing(checkpoint, checkpoint_kwargs)
    layer_ids = {id(m) for _, m in layers}
    _wrapping.apply_activation_checkpointing(
        MODEL_OPS,
        model,
        Selection("checkpoint_fn", predicates=(lambda m: id(m) in layer_ids,)),
        selected["exclude_fn"],
        lambda m: m,  # HF checkpoints the layers; recomp's function is installed below
        exclude_region,
        api="hf_activation_checkpointing",
    )
    for _, layer in layers:
        owner.install(layer)
    enable()
    for _, layer in layers:
        owner.adopt(layer)
    return model


def _rebase_parametrization(module: nn.Module, wrapped: type, base: type) -> type | None:
    """The class of a module parametrized (``weight_norm``, ``spectral_norm``) after recomp
    wrapped it, with recomp's class taken out from under it: PyTorch gives each
    parametrized module a class of its own, derived from the class the module had,
    whose namespace holds the parametrized attributes; the same namespace over the
    original class is what parametrizing the unwrapped module would have given."""
    cls = type(module)
    if not torch.nn.utils.parametrize.is_parametrized(module) or cls.__bases__ != (wrapped,):
        return None
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, (base,), namespace)


MODEL_OPS = _wrapping.ModelOps(
    framework="torch",
    module_type=nn.Module,
    checkpoint_wrapper=CheckpointWrapper,
    exclude_wrapper=ExcludeWrapper,
    method="forward",
    children=lambda m: list(m.named_children()),
    is_compiling=torch.compiler.is_compiling,
    # An instance ``forward`` is moved aside by wrap_in_place; nothing else bypasses it.
    check_reachable=lambda module, api: None,
    rebase_foreign=_rebase_parametrization,
    layer_containers=(nn.ModuleList, nn.Sequential, nn.ModuleDict),
    # Outside every recomp checkpoint's traced body (a checkpointed layer's own hook).
    hooks_may_write_while_compiling=_compile.outside_checkpoints,
)


# Settled at import: PyTorch's wrapper checks what it takes from now on (see
# ``_compat.guard_checkpoint_wrapper``); nothing else of recomp's is installed globally.
_compat.guard_checkpoint_wrapper(functools.partial(check_checkpoint_wrapper, checkpoint))
