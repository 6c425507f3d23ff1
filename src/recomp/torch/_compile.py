"""recomp under ``torch.compile``: exclusions as save decisions of the partitioner.

NOTE [ Excluded regions in a compiled program ]

Eagerly, recomp steers a second Python execution of the checkpointed code (the
replay) and skips excluded regions there. A compiled program has no such second
execution: Dynamo captures the checkpoint as the ``tag_activation_checkpoint``
higher-order op, AOTAutograd traces forward and backward once into a joint graph,
and the min-cut partitioner chooses which forward values the backward gets as
saved tensors and which it computes again. The partitioner reads one tag per
node, ``node.meta["recompute"]`` (a ``CheckpointPolicy``); the checkpoint tags
every node of its body ``PREFER_RECOMPUTE`` (or with the policy of a selective
checkpointing ``context_fn``).

So, under compilation:
  * ``checkpoint`` calls ``torch.utils.checkpoint.checkpoint`` with the user's
    ``context_fn`` (or none): no recompute state, no Python replay. A module
    global counts the compiled checkpoints being traced, so that a region knows
    at Dynamo trace time whether it sits inside one.
  * An excluded region inside such a checkpoint is called through the
    ``dynamo_bypassing_wrapper`` higher-order op. Dynamo traces the region's body
    into a subgraph as usual (Inductor still fuses it), but the wrapper function
    given to the op is not traced: it runs when AOTAutograd traces the graph,
    the one moment when the region's ATen nodes exist. ``_keep_region_nodes``
    then marks every node the body added ``MUST_SAVE``. It runs after the
    checkpoint's dispatch mode has tagged those nodes, so the region's mark is
    the one the partitioner sees, whatever the ``context_fn`` policy said.
  * ``MUST_SAVE`` forbids the partitioner to recompute the node: every op of the
    region runs once per step, in the forward, and the backward gets the
    region's values that it needs as saved tensors. Recomputed code before the
    region is recomputed, region inputs included (what deferred inputs do
    eagerly); code after it reads the saved region output.
  * Outside a compiled checkpoint a region is a plain call, as in eager mode.
  * On a PyTorch without ``dynamo_bypassing_wrapper`` (none from 2.9 to 2.14; see
    ``_compat``) a region inside a compiled checkpoint is a plain call too: the
    partitioner then recomputes it as any checkpointed code, so the program is the one
    PyTorch's checkpoint gives, and recomp warns once (``ForeignCheckpointWarning``).

What eager recomp does with Python state has no meaning in a compiled program
and is not done there: the region counters (``region_runs``, ...) count eager
calls only, ``save_output=False`` has no effect (the partitioner keeps each value
once), and ``preserve_rng_state`` is the compiler's business (Inductor seeds
each random op so that a recomputed dropout draws the same mask).
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import ForeignCheckpointWarning
from . import _compat

# Whether a recomp checkpoint encloses the code Dynamo is tracing (1 inside the outermost
# one, whose call alone writes it; 0 outside). A module global:
# Dynamo tracks writes to module globals as side effects and reads the written value
# back later in the same trace, which is how a region learns that it is inside one.
_checkpoint_depth = 0


#: PyTorch's checkpoint function as it was when recomp was imported. recomp calls this one,
#: never the module attribute: a project tried with recomp may have replaced
#: ``torch.utils.checkpoint.checkpoint`` by recomp's checkpoint (or by a function that
#: routes to it), which would then call itself without end.
torch_checkpoint: Callable[..., Any] = torch.utils.checkpoint.checkpoint


def _defined_in_pytorch(function: Any) -> bool:
    """Whether ``function``'s code lives in PyTorch's package (its checkpoint, as
    ``torch._disable_dynamo`` wraps it or bare), not in a project that replaced it."""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH_DIRECTORY)


_TORCH_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "")

#: ``torch_checkpoint`` where it is PyTorch's own function, None where recomp was
#: imported after a project had replaced it. PyTorch's own enters the call's contexts
#: before it runs anything that could call recomp's checkpoint again, so only a
#: replacement needs the guard against calling it back (``recomp.torch._api``).
PYTORCH_CHECKPOINT: Callable[..., Any] | None = (
    torch_checkpoint if _defined_in_pytorch(torch_checkpoint) else None
)


#: True while Dynamo traces the code (recomp then takes the compiled path). PyTorch's own
#: function, not a wrapper around it: it is asked on every region call.
is_compiling: Callable[[], bool] = torch.compiler.is_compiling


def checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context_fn: Callable[[], tuple[Any, Any]] | None,
) -> Any:
    """``recomp.torch.checkpoint`` in a compiled program: PyTorch's checkpoint, with
    excluded regions inside it saved instead of recomputed (see the NOTE above)."""
    global _checkpoint_depth
    if context_fn is not None:
        kwargs = {**kwargs, "context_fn": context_fn}
    if _checkpoint_depth:
        # Nested in another recomp checkpoint: the count is already non-zero, and the
        # write would happen inside the outer checkpoint's traced body, which Dynamo
        # of PyTorch 2.9 refuses (a graph break; 2.13 allows it).
        return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
    _checkpoint_depth += 1
    try:
        return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
    finally:
        _checkpoint_depth -= 1


def outside_checkpoints() -> bool:
    """Whether the code Dynamo traces now lies outside every recomp checkpoint."""
    return _checkpoint_depth == 0


def excluded_call(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """An excluded region's call in a compiled program. It takes nothing of the region's
    (its name, its counters): what the trace reads becomes a guard, and regions of the
    same code in every layer share one graph (per-layer compile, as torchtitan does)."""
    if _checkpoint_depth == 0:
        return function(*args, **kwargs)
    if _BYPASS is None:
        _warn_recomputed_once()
        return function(*args, **kwargs)
    return _BYPASS(_keep_region_nodes, function, *args, **kwargs)


# The op that lets a region mark its nodes; None on a PyTorch without it (see
# ``_compat.dynamo_bypassing_wrapper``). There a compiled recomp checkpoint is a compiled
# PyTorch checkpoint: its regions are traced as ordinary code and recomputed.
_BYPASS = _compat.dynamo_bypassing_wrapper()
_warned = {"recomputed": False}


def _warn_recomputed_once() -> bool:
    if not _warned["recomputed"]:
        _warned["recomputed"] = True
        warnings.warn(
            f"recomp's excluded regions are recomputed under torch.compile on this PyTorch "
            f"({torch.__version__}): it lacks "
            f"torch._higher_order_ops.wrap.dynamo_bypassing_wrapper, through which a "
            f"compiled checkpoint keeps a region's values. Compiled, a recomp checkpoint "
            f"here behaves as PyTorch's checkpoint (same gradients, regions run again in "
            f"backward); run the checkpointed layers eagerly to keep the exclusions.",
            ForeignCheckpointWarning,
            stacklevel=2,
        )
    return True


if _BYPASS is None:  # only then: marking it imports Dynamo
    _warn_recomputed_once = _compat.run_at_trace_time(_warn_recomputed_once)


def _keep_region_nodes(body: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper ``dynamo_bypassing_wrapper`` applies to the region's traced body.

    While AOTAutograd traces (a proxy mode is active), the nodes the body appends
    to the graph are the region's ops: mark them ``MUST_SAVE``. In any other
    execution of the op (fake-tensor propagation, running the graph) there is
    nothing to mark.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            return body(*args, **kwargs)
        nodes = mode.tracer.graph.nodes
        before = len(nodes)
        out = body(*args, **kwargs)
        for node in itertools.islice(reversed(nodes), len(nodes) - before):
            if node.op == "call_function":
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                node.meta["recomp_region"] = True
        return out

    return run
