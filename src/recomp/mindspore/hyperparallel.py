"""HyperParallel's activation-memory API, under its own names, on recomp (MindSpore
PyNative).

The same names as ``recomp.torch.hyperparallel``: code written against HyperParallel's
API (mindformers' PyNative trainer imports ``CheckpointPolicy``,
``checkpoint_exclude_wrapper``, ``checkpoint_wrapper``, ``swap_wrapper`` and
``SwapManager``) runs with one import changed::

    from recomp.mindspore.hyperparallel import (
        CheckpointPolicy, SwapManager, checkpoint_exclude_wrapper, checkpoint_wrapper,
        swap_wrapper,
    )

What MindSpore 2.10 PyNative allows runs (NOTE [ Swap on MindSpore ] in
``recomp.mindspore._swap``): checkpoints with per-op policies (``MUST_SWAP``
included) and ``swap_inputs``, per-tensor swaps, ``SwapManager`` pairs, exclusion. The
rest is here under its name and raises :class:`recomp.errors.SwapNotSupportedError`
when called, saying what MindSpore lacks: ``group_swap=True``, ``cpu_pool`` and
:class:`PinnedMemoryPool` (no pinned host pool), ``swap_tensor_wrapper`` inside a
swapped layer (no in-place storage resize), the recompute sessions (no public session
API, and PyNative's ``mindspore.grad`` runs the whole backward in one call),
:func:`create_native_selective_checkpoint_contexts` (PyTorch's, for compiled code) and
:class:`OffloadSession` (no storage-level moves or pinned pool; :class:`OffloadConfig`
and :func:`skip_offload` are there, so that code naming them imports).
HyperParallel's declarative recompute regions run too: :class:`RecomputePolicy`,
:class:`ActivationCheckpointSelection`, :func:`apply_recompute_policy` and
:func:`apply_submodule_checkpointing` (``recomp._recompute_policy``: NOTE [ Declared
recompute regions ]), on recomp's checkpoints and excluded regions of MindSpore. What
differs, name by name: docs/guides/hyperparallel.md.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NoReturn

import mindspore

from .. import _recompute_policy
from .._hyperparallel import check_early_stop, noop_context_fn, without_noop, wrapper_options
from .._offload_session import OffloadConfig, skip_offload
from .._recompute_policy import ActivationCheckpointSelection, RecomputePolicy, check_swap_inputs
from .._wrapping import WrapperMixin
from . import _api
from ._api import checkpoint_exclude_wrapper
from ._selective import create_selective_checkpoint_contexts, ignore_sac_ops
from ._swap import (
    AsyncSaveOnCpu,
    CheckpointPolicy,
    SwapManager,
    async_save_on_cpu,
    refuse,
    swap,
    swap_tensor_wrapper,
    swap_wrapper,
)

# The 18 names of hyper_parallel.core.activation_memory.api.__all__, SwapManager,
# PinnedMemoryPool and AsyncSaveOnCpu of its swap module, HyperParallel's declarative
# regions (RecomputePolicy, ActivationCheckpointSelection and what applies them), and
# hyper_parallel.auto_parallel.hyper_offload's three.
__all__ = [
    "ActivationCheckpointSelection",
    "AsyncSaveOnCpu",
    "CheckpointPolicy",
    "OffloadConfig",
    "OffloadSession",
    "PinnedMemoryPool",
    "RecomputePolicy",
    "SwapManager",
    "apply_recompute_policy",
    "apply_submodule_checkpointing",
    "async_save_on_cpu",
    "checkpoint",
    "checkpoint_exclude_wrapper",
    "checkpoint_wrapper",
    "clear_recompute_session",
    "create_native_selective_checkpoint_contexts",
    "create_selective_checkpoint_contexts",
    "get_class_activation_wrapper",
    "ignore_sac_ops",
    "is_compiling",
    "noop_context_fn",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
    "skip_offload",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
]


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    swap_inputs: bool = False,
    policy_fn: Callable[..., Any] | list[str] | None = None,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    group_swap: bool = False,
    cpu_pool: Any = None,
    early_stop: bool = False,
    **kwargs: Any,
) -> Any:
    """HyperParallel's ``checkpoint`` on MindSpore: :func:`recomp.mindspore.checkpoint`
    with HyperParallel's signature.

    ``policy_fn(ctx, op, *args, **kwargs)`` (``op.name``: ``"MatMul"``, ...; or a list of
    op names to save) chooses per op, through MindSpore's ``MsDispatchMode``: a
    ``CheckpointPolicy.MUST_SWAP`` output is kept on the host until the replay reads it
    and never recomputed. ``swap_inputs=True`` moves the inputs the checkpoint saves to
    the host until its replay. ``group_swap=True`` and ``cpu_pool`` raise
    :class:`recomp.errors.SwapNotSupportedError`. ``context_fn`` is entered inside
    recomp's and the policy's contexts.

    ``early_stop`` must be a bool (``ValueError``), as in HyperParallel, but defaults to
    False here (HyperParallel's PyTorch API: True): MindSpore 2.10's early stop fails
    when a block's last saved tensor comes from a dropout or a LayerNorm, and recomp
    raises a :class:`recomp.errors.RecompError` naming the op then. ``use_reentrant`` is
    not followed (the checkpoint is non-reentrant), as in HyperParallel. Other keyword
    arguments go to :func:`recomp.mindspore.checkpoint` (``exclude_collectives``,
    ``save_rng_state``, ``output_recompute``) and the rest to ``function``."""
    check_early_stop(early_stop)
    kwargs.pop("use_reentrant", None)
    return _api.checkpoint(
        function,
        *args,
        context_fn=without_noop(context_fn),
        policy_fn=policy_fn,
        swap_inputs=swap_inputs,
        group_swap=group_swap,
        cpu_pool=cpu_pool,
        early_stop=early_stop,
        **kwargs,
    )


def checkpoint_wrapper(module: Any, **checkpoint_kwargs: Any) -> Any:
    """HyperParallel's ``checkpoint_wrapper`` on MindSpore: every call of ``module`` is a
    :func:`checkpoint` with these options (``context_fn``, ``early_stop``,
    ``policy_fn``, ``swap_inputs``, ``output_recompute``, ...). ``early_stop`` must be a
    bool (False unless given), and ``use_reentrant`` is not followed. The Cell is
    wrapped in place, as by :func:`recomp.mindspore.checkpoint_wrapper` (parameter
    names and ``isinstance`` unchanged; ``recomp.mindspore.unwrap`` undoes it)."""
    options = wrapper_options(checkpoint_kwargs, early_stop=None)
    return _api.checkpoint_wrapper(module, **options)


def get_class_activation_wrapper() -> type:
    """The class every Cell wrapped by ``checkpoint_wrapper`` or
    ``checkpoint_exclude_wrapper`` is an instance of (``swap_wrapper`` adds hooks and
    keeps the Cell's class)."""
    return WrapperMixin


def is_compiling() -> bool:
    """Whether MindSpore compiles the model instead of running it: True in GRAPH_MODE
    (where recomp's wrappers refuse to run), False in PyNative mode. (Code under
    ``@mindspore.jit`` is parsed, not run, so it does not reach this call.)"""
    return bool(mindspore.get_context("mode") == mindspore.GRAPH_MODE)


_NO_SESSIONS = (
    "MindSpore 2.10 has recompute sessions only as private API "
    "(mindspore.common.recompute), which recomp does not re-export, and PyNative's "
    "mindspore.grad runs the forward and the whole backward in one call, so there is no "
    "split backward to replay a checkpoint ahead of"
)
_WITHOUT_SESSIONS = (
    "Leave the session calls out: each checkpoint replays during backward, once (on "
    "PyTorch, recomp.torch.hyperparallel has them)."
)


def recompute_handle_collector_ctx() -> NoReturn:
    """Not on MindSpore: raises :class:`recomp.errors.SwapNotSupportedError` (see the
    module's docstring)."""
    raise refuse("recompute_handle_collector_ctx()", _NO_SESSIONS, _WITHOUT_SESSIONS)


def recompute_handle(handle: Any, session_id: Hashable) -> NoReturn:
    """Not on MindSpore: raises :class:`recomp.errors.SwapNotSupportedError`."""
    raise refuse("recompute_handle(handle, session_id)", _NO_SESSIONS, _WITHOUT_SESSIONS)


def recompute_session_ctx(session_id: Hashable, retain_on_unpack: bool = False) -> NoReturn:
    """Not on MindSpore: raises :class:`recomp.errors.SwapNotSupportedError`."""
    raise refuse("recompute_session_ctx(session_id)", _NO_SESSIONS, _WITHOUT_SESSIONS)


def clear_recompute_session(session_id: Hashable) -> NoReturn:
    """Not on MindSpore: raises :class:`recomp.errors.SwapNotSupportedError`."""
    raise refuse("clear_recompute_session(session_id)", _NO_SESSIONS, _WITHOUT_SESSIONS)


def create_native_selective_checkpoint_contexts(policy_fn: Callable[..., Any]) -> NoReturn:
    """Not on MindSpore: raises :class:`recomp.errors.SwapNotSupportedError`."""
    raise refuse(
        "create_native_selective_checkpoint_contexts(policy_fn)",
        "it is PyTorch's own selective checkpointing, for torch.compile; MindSpore has no "
        "counterpart for compiled graphs, and recomp.mindspore runs in PyNative mode only",
        "Use create_selective_checkpoint_contexts(policy_fn), or pass policy_fn= to "
        "checkpoint or checkpoint_wrapper.",
    )


class PinnedMemoryPool:
    """Not on MindSpore: making one raises :class:`recomp.errors.SwapNotSupportedError`
    (recomp has no pinned host pool on MindSpore, and ``cpu_pool=`` is refused)."""

    def __init__(self, max_host_bytes: int, align_limit: int = 2 * 1024**3) -> None:
        raise refuse(
            "PinnedMemoryPool(max_host_bytes)",
            "recomp has no pinned host memory pool on MindSpore (Tensor.move_to allocates "
            "each host copy)",
            "Drop the pool and the cpu_pool= arguments: each swapped tensor is then copied "
            "on its own.",
        )


def apply_recompute_policy(
    model: Any,
    policy: RecomputePolicy,
    selection: ActivationCheckpointSelection | None = None,
    *,
    swap_inputs: bool = False,
    **checkpoint_kwargs: Any,
) -> Any:
    """Checkpoint the recompute regions ``policy`` declares, in the layers ``selection``
    chooses, and keep its excluded cells out of the replay, as
    :func:`recomp.torch.hyperparallel.apply_recompute_policy` does on PyTorch: each
    outermost cell ``region_patterns`` selects in a chosen layer becomes a
    :func:`checkpoint_wrapper` (``early_stop`` False unless given, ``swap_inputs`` and
    the other options passed on), each outermost cell ``exclude_patterns`` selects inside
    the regions a :func:`checkpoint_exclude_wrapper`; MindSpore's own exclusions (the
    sub-cells that issue collectives, dropouts it cannot replay) are added as in
    :func:`recomp.mindspore.apply_activation_checkpointing`. The layers are those of a
    ``CellList`` or ``SequentialCell`` named ``layers`` (or below a cell with
    ``gradient_checkpointing``), else the children of a model that is one. Everything is
    checked before anything is wrapped, with the same refusals as on PyTorch. Pairs the
    regions of consecutive layers with :class:`SwapManager` when ``swap_inputs=True``,
    calls ``policy.on_applied(model)`` and returns the model."""
    api = "apply_recompute_policy"
    check_swap_inputs(swap_inputs, api)
    options = wrapper_options({**checkpoint_kwargs, "swap_inputs": swap_inputs}, early_stop=None)
    also_exclude = _api.model_options(api, options)
    return _recompute_policy.apply_recompute_policy(
        _api.MODEL_OPS,
        model,
        policy,
        selection,
        api=api,
        wrap_checkpoint=lambda c: _api.checkpoint_wrapper(c, **options),
        wrap_exclude=lambda c, path: checkpoint_exclude_wrapper(c, name=path),
        pair=SwapManager().set_forward_prefetch_layer if swap_inputs else None,
        also_exclude=also_exclude,
    )


def apply_submodule_checkpointing(
    layers: list[Any],
    has_kv_sharing: bool,
    enable_compile: bool = False,
    swap_inputs: bool = False,
) -> int:
    """HyperParallel's ``apply_submodule_checkpointing`` on MindSpore: in each of
    ``layers``, checkpoint the MLP, the attention (not with ``has_kv_sharing``), the two
    norms and any ``*_moe_gen`` parts, by HyperParallel's names for them (see
    :func:`recomp.torch.hyperparallel.apply_submodule_checkpointing`), with
    :func:`checkpoint_wrapper`. ``enable_compile=True`` drops ``swap_inputs`` as there
    (recomp's wrappers run in PyNative only). Returns how many parts it wrapped."""
    api = "apply_submodule_checkpointing"
    check_swap_inputs(swap_inputs, api)
    options = {} if enable_compile else {"swap_inputs": swap_inputs}
    return _recompute_policy.apply_submodule_checkpointing(
        _api.MODEL_OPS,
        layers,
        has_kv_sharing,
        api=api,
        wrap_checkpoint=lambda c: checkpoint_wrapper(c, **options),
    )


class OffloadSession:
    """Not on MindSpore: making one raises :class:`recomp.errors.SwapNotSupportedError`.
    :class:`OffloadConfig` is the same class as on PyTorch, and :func:`skip_offload`
    runs the function it decorates as it is (no session is ever active here)."""

    def __init__(self, config: OffloadConfig | None = None) -> None:
        raise refuse(
            "OffloadSession(config)",
            "an offload session moves each storage saved for backward once, with every view "
            "saved of it rebuilt on the bytes brought back, into a bounded pinned host pool "
            "(max_offload_activation_mb); recomp's MindSpore backend copies whole tensors "
            "with Tensor.move_to and has no pinned host pool (as for cpu_pool)",
            "Choose what moves per layer instead: swap_wrapper(layer, policy_fn=...) or "
            "checkpoint_wrapper(layer, swap_inputs=True); on PyTorch, "
            "recomp.torch.hyperparallel.OffloadSession runs.",
        )

    @staticmethod
    def get_active() -> None:
        """Always None on MindSpore."""
        return None
