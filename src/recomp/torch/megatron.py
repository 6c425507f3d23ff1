"""recomp inside Megatron-Core: Megatron decides what to recompute, recomp does it.

Megatron-Core's recompute settings (``recompute_granularity="full"`` with
``recompute_method="uniform"`` or ``"block"``, ``"selective"`` with ``recompute_modules``
such as ``"core_attn"``, ``"mlp"``, ``"moe"``, ``"shared_experts"``) all end in one
function, ``megatron.core.tensor_parallel.checkpoint(function, distribute_saved_activations,
*args)``. :func:`install` puts a recomp checkpoint in its place::

    import recomp.torch.megatron

    recomp.torch.megatron.install(exclude=["self_attention"])   # before training starts
    # ... build the model and train as usual; Megatron's config chooses what to recompute

While installed, every piece Megatron checkpoints is a recomp checkpoint:

* no collective runs again in the replay: the forward keeps the results of the
  piece's collectives (the tensor-parallel all-reduces, the MoE all-to-alls and
  all-gathers) and the replay reads them (``exclude_collectives=False`` communicates
  again, as Megatron's own checkpoint does, and keeps nothing);
* the modules named by ``exclude`` (classes, module paths, predicates) inside each
  checkpointed piece run once and are not replayed;
* random state is restored as Megatron's own checkpoint restores it: the CPU and CUDA
  generators and Megatron's RNG tracker (``get_cuda_rng_tracker()``), which recomp
  knows by itself (``recomp._rng_trackers``), so tensor-parallel dropout draws the same
  masks in the replay;
* the replay runs the whole checkpointed function (``early_stop=False``), as Megatron's
  own checkpoint does, so that the state Megatron's layers keep on themselves between
  their halves is cleared at the end of the replay as at the end of the forward.

Left as they are: ``CheckpointWithoutOutput`` (selective ``"layernorm"`` and ``"moe_act"``,
whose outputs Megatron frees and recomputes by itself; none communicates), and
TransformerEngine's ``te_checkpoint``, which Megatron calls instead under FP8/FP4
(``config.fp8``/``config.fp4``): its recompute is tied to TransformerEngine's FP8 state
and stays Megatron's, collectives replayed. ``distribute_saved_activations=True``
splits each checkpoint's first input over the tensor-parallel group, as Megatron's own
checkpoint does (``recomp.torch._partition``): its data is this rank's 1-D slice until
the replay gathers it.

Nothing of Megatron is imported when recomp is: :func:`install` imports Megatron-Core's
modules when it is called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from .. import _engine
from . import _partition
from ._api import checkpoint
from ._trainer_patch import Exclusions, Installation, replace_attributes

__all__ = ["TARGETS", "install"]

#: The module attributes that hold Megatron-Core's checkpoint function. Megatron's own
#: code calls it as ``tensor_parallel.checkpoint`` (full recompute in
#: ``megatron/core/recompute.py``, selective recompute in ``transformer_layer.py``,
#: ``attention.py``, ``moe/moe_layer.py``, ``multi_token_prediction.py``); code that
#: imported the function by name before :func:`install` (``from
#: megatron.core.tensor_parallel import checkpoint``) holds it too, and is rebound.
TARGETS: tuple[tuple[str, str], ...] = (
    ("megatron.core.tensor_parallel", "checkpoint"),
    ("megatron.core.tensor_parallel.random", "checkpoint"),
)

_API = "recomp.torch.megatron.install"


def install(exclude: Any = (), *, exclude_collectives: bool = True) -> Installation:
    """Make Megatron-Core's checkpoint function a recomp checkpoint until ``remove()``.

    Megatron's own recompute settings keep deciding what is checkpointed; recomp runs
    each checkpoint. ``exclude``: modules to keep out of every replay, as classes
    (``TopKRouter``: ``isinstance``), module paths matched against the end of a
    module's dotted name below the checkpointed piece (``"self_attention"``,
    ``"router"``, ``"layers.*.mlp.linear_fc2"``; with ``fnmatch`` wildcards) or
    functions of a module returning True, or a list of these (the selection every
    recomp argument that chooses modules takes; anything else raises
    :class:`~recomp.errors.SelectionError` here, before anything is installed). A path
    that matches nothing excludes nothing: the modules are not known yet. A path is relative to the module the piece
    runs: the ``TransformerBlock`` under full recompute (``"layers.0.self_attention"``),
    the ``MoELayer`` under selective ``"moe"`` (``"router"``); the last name of a path
    (``"router"``) matches under both. ``exclude_collectives=False`` lets the replay
    communicate again, as Megatron's own checkpoint does, and keeps no results.

    Returns an :class:`~recomp.torch._trainer_patch.Installation`: call its
    ``remove()`` (or use it as a context manager) to put Megatron's function back.
    Installing again before that raises :class:`~recomp.errors.RecompError`.
    ``TransformerConfig.distribute_saved_activations`` is honoured: the checkpoint's
    first input is kept split over the tensor-parallel group until the replay. Call it before the first training step; modules already wrapped by recomp are
    left as they are.
    """
    exclusions = Exclusions(exclude, _API)
    _engine.check_flag("exclude_collectives", exclude_collectives)
    _import_megatron()
    graph_phase = _graph_phase_check()

    def recomp_checkpoint(
        function: Callable[..., Any], distribute_saved_activations: bool, *args: Any
    ) -> Any:
        if graph_phase is not None and graph_phase():
            # What Megatron's checkpoint does while a CUDA graph is warmed up or
            # captured: the graph records every op, nothing is recomputed.
            return function(*args)
        exclusions.apply_within(function)
        # The replay runs the whole function, as Megatron's own checkpoint does: Megatron's
        # layers keep state on themselves between their halves and clear it at the end
        # (TransformerLayer's pre-MLP norm manager, which holds the hidden states); a
        # replay stopped early would leave its tensors, and the graph behind them, there
        # until the layer's next forward.
        partition = None
        if distribute_saved_activations and args and isinstance(args[0], torch.Tensor):
            # Megatron's: the first input split over the tensor-parallel group, in place
            partition = _partition.PartitionedInputs(tensor_parallel_group(), first=args[0])
        return checkpoint(
            function,
            *args,
            exclude_collectives=exclude_collectives,
            early_stop=False,
            partition_inputs=partition,
        )

    recomp_checkpoint.__qualname__ = recomp_checkpoint.__name__ = "checkpoint"
    recomp_checkpoint.__doc__ = (
        "recomp's checkpoint in place of Megatron-Core's (recomp.torch.megatron.install)."
    )
    return replace_attributes(
        "megatron", TARGETS, recomp_checkpoint, rebind_imports=True, exclusions=exclusions
    )


def tensor_parallel_group() -> Any:
    """Megatron-Core's tensor-parallel process group (what ``distribute_saved_activations``
    splits a checkpoint's input over)."""
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    return parallel_state.get_tensor_model_parallel_group()


def _import_megatron() -> None:
    try:
        importlib.import_module("megatron.core.tensor_parallel")
    except ImportError as exc:
        raise ImportError(
            f"{_API}() needs Megatron-Core (the megatron.core package), which could not be "
            f"imported: {exc}. Install it with `pip install megatron-core`."
        ) from exc


def _graph_phase_check() -> Callable[[], bool] | None:
    """Whether Megatron warms up or captures a CUDA graph now (Megatron's own checkpoint
    then calls the function directly); None where this Megatron has no such functions."""
    try:
        graphs = importlib.import_module("megatron.core.transformer.cuda_graphs")
    except ImportError:
        return None
    warmup = getattr(graphs, "is_graph_warmup", None)
    capturing = getattr(graphs, "is_graph_capturing", None)
    if not callable(warmup) or not callable(capturing):
        return None

    def in_graph_phase() -> bool:
        return bool(warmup() or capturing())

    return in_graph_phase
