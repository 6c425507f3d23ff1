"""Reading the autograd graph for the saved-tensor report: what each node saved, without
unpacking it, and which checkpoint call a placeholder belongs to (its inputs, arguments,
random states, replayed tensors, selective-checkpoint cache).

Consumer: ``torch/_memory_report.py``. Tested by ``tests/torch/compat/test_saved_tensors.py``.
The reading needs ``SavedTensor.data``, which 2.14 has and 2.9 does not
(``saved_values_readable``: without it the report raises, naming the PyTorch it needs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint

# The class of the handles in ``_raw_saved_*`` attributes of autograd nodes.
_SAVED_TENSOR_TYPE: type | None = getattr(torch._C._autograd, "SavedTensor", None)
# Per autograd node class: the names of its ``_raw_saved_*`` attributes.
_SAVED_ATTRIBUTES: dict[type, tuple[str, ...]] = {}


def saved_values_readable() -> bool:
    """Whether this PyTorch lets a saved tensor's packed value be read without unpacking it.

    Why: the memory report reads what each autograd node holds for backward without
    triggering a checkpoint's replay (which unpacking would). ``SavedTensor.data``
    returns the value a pack hook returned (or the tensor, without hooks; None once
    backward released it). PyTorch 2.14 has it; 2.9 does not (detected by feature).
    If it changes: False, and ``saved_tensors_report`` raises, naming the PyTorch needed.
    Retired by: a public reader of an autograd node's saved values.
    """
    return _SAVED_TENSOR_TYPE is not None and hasattr(_SAVED_TENSOR_TYPE, "data")


def saved_handles(node: Any) -> list[tuple[str, Any]]:
    """``(name, handle)`` for each tensor the autograd ``node`` saved (lists unrolled).

    Private: the ``_raw_saved_<name>`` attributes of generated nodes and
    ``_raw_saved_tensors`` of custom Functions are the only way to reach the
    ``SavedTensor`` handles without unpacking them.
    If it changes: no handles are found; the report then lists nothing for the node.
    """
    names = _SAVED_ATTRIBUTES.get(type(node))
    if names is None:
        names = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
        _SAVED_ATTRIBUTES[type(node)] = names
    found: list[tuple[str, Any]] = []
    for name in names:
        try:
            value = getattr(node, name)
        except (RuntimeError, AttributeError, TypeError):  # released by a backward, or odd
            continue
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if _SAVED_TENSOR_TYPE is not None and isinstance(item, _SAVED_TENSOR_TYPE):
                found.append((name[len("_raw_saved_") :], item))
    return found


def is_compiled_graph_node(node: Any) -> bool:
    """Whether the autograd ``node`` is the backward of a graph compiled by torch.compile.

    Private: AOTAutograd runs each compiled forward as an autograd Function named
    ``CompiledFunction`` (``torch._functorch._aot_autograd.runtime_wrappers``), whose node class is
    ``CompiledFunctionBackward``; its saved tensors are what the partitioner kept.
    If it changes: False; the report then lists them as saved outside checkpoints.
    """
    return type(node).__name__ == "CompiledFunctionBackward"


def packed_value(handle: Any) -> Any:
    """What the pack hook returned for ``handle`` (the tensor itself without hooks), or None
    once a backward released it. See :func:`saved_values_readable`."""
    try:
        return handle.data
    except RuntimeError:
        return None


def checkpoint_frame(handle: Any) -> Any:
    """The non-reentrant checkpoint call that packed ``handle``, or None.

    Private: a checkpoint's placeholder (``torch.utils.checkpoint._Holder``) holds
    nothing; the call it belongs to (``_CheckpointFrame``: the inputs, the replay
    function, the replay's tensors) is reachable only through the closure of the
    unpack hook registered with the handle (``SavedTensor.unpack_hook``).
    Checked on 2.14 (``unpack_hook`` or ``unpack_hook_with_error_cb``, both closing over
    ``frame``). If it changes: None; the report then finds no checkpoint inputs or
    cached outputs of that checkpoint.
    """
    holder_type = getattr(torch.utils.checkpoint, "_Holder", None)
    if holder_type is None or not isinstance(packed_value(handle), holder_type):
        return None
    unpack = getattr(handle, "unpack_hook", None)
    kept = _kept_replays_of(unpack)
    if kept is not None:  # recomp's kept replays took the unpack over: PyTorch's is under it
        unpack = kept.checkpoint_unpack
    frame = _closure_value(unpack, "frame")
    if frame is None:  # unpack_hook_with_error_cb closes over frame too, or over unpack_hook
        frame = _closure_value(_closure_value(unpack, "unpack_hook"), "frame")
    return frame


def _kept_replays_of(unpack: Any) -> Any:
    """The ``recomp.torch._kept.RecomputeHandle`` whose ``unpack`` this is, or None."""
    owner = getattr(unpack, "__self__", None)
    return owner if hasattr(owner, "checkpoint_unpack") and hasattr(owner, "kept_value") else None


def _closure_value(fn: Any, name: str) -> Any:
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or closure is None:
        return None
    for var, cell in zip(code.co_freevars, closure):
        if var == name:
            try:
                return cell.cell_contents
            except ValueError:  # an empty cell
                return None
    return None


def checkpoint_input_handles(frame: Any) -> list[Any]:
    """The saved-tensor handles of a checkpoint call's inputs.

    Private: 2.14 keeps them in ``frame.saved_args`` (``SavedTensor`` or plain values);
    2.9 saved them on a ``_NoopSaveInputs`` node (``frame.input_saver.grad_fn``).
    If it changes: empty; the report then lists no checkpoint inputs.
    """
    saved = getattr(frame, "saved_args", None)
    if isinstance(saved, list) and saved:
        return [
            a for a in saved if _SAVED_TENSOR_TYPE is not None and isinstance(a, _SAVED_TENSOR_TYPE)
        ]
    saver = getattr(frame, "input_saver", None)
    node = getattr(saver, "grad_fn", None)
    return [h for _, h in saved_handles(node)] if node is not None else []


def checkpoint_plain_arguments(frame: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of what a checkpoint call holds of its arguments as they are, not
    as saved tensors: its keyword arguments (``past_key_values``, ``position_embeddings``,
    a layer input passed by keyword) and positional arguments that are not tensors
    (tuples of tensors, cache objects). They stay alive until the replay has run.

    Private: 2.14 keeps positional arguments in ``frame.saved_args`` (tensors as
    ``SavedTensor``, anything else as it is) and the keyword arguments in the closure
    (``kwargs``) of ``frame.recompute_fn``. If it changes: empty; the report then misses
    tensors passed this way (the allocator shows more than its total).
    """
    found: list[tuple[str, Any]] = []
    saved = getattr(frame, "saved_args", None)
    if isinstance(saved, list):
        for i, value in enumerate(saved):
            if value is None or (
                _SAVED_TENSOR_TYPE is not None and isinstance(value, _SAVED_TENSOR_TYPE)
            ):
                continue
            found.append((f"argument {i}", value))
    kwargs = _closure_value(getattr(frame, "recompute_fn", None), "kwargs")
    if isinstance(kwargs, dict):
        found.extend((str(k), v) for k, v in kwargs.items() if v is not None)
    return found


def selective_checkpoint_storage(context: Any) -> list[tuple[str, Any]]:
    """``(op name, entry)`` for each op output a selective activation checkpoint keeps
    for its replay, found in the checkpoint's replay ``context`` (or in contexts composed
    into it). An entry is what the cache holds (tensors inside wrappers), or a marker.

    Private: ``create_selective_checkpoint_contexts`` returns a caching mode and a cached
    mode (``torch.utils.checkpoint._CachingTorchDispatchMode`` /
    ``_CachedTorchDispatchMode``) that share ``storage``: op key (the op, or a tuple
    starting with it) -> list or dict of entries (``_VersionWrapper``s around detached
    outputs); the replay replaces each entry it reads with a marker. These tensors are
    held outside the autograd graph, so no saved-tensor handle shows them.
    If it changes: empty; the report then misses what selective checkpoints keep.
    """
    mode_types = tuple(
        t
        for t in (
            getattr(torch.utils.checkpoint, "_CachedTorchDispatchMode", None),
            getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None),
        )
        if isinstance(t, type)
    )
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    stack = [context]
    while stack and mode_types:
        ctx = stack.pop()
        if ctx is None or id(ctx) in seen:
            continue
        seen.add(id(ctx))
        if isinstance(ctx, mode_types):
            storage = getattr(ctx, "storage", None)
            if not isinstance(storage, dict) or id(storage) in seen:
                continue
            seen.add(id(storage))
            for key, entries in storage.items():
                op = key[0] if isinstance(key, tuple) and key else key
                name = getattr(op, "_opname", None) or getattr(op, "__name__", None) or str(op)
                if isinstance(entries, dict):
                    entries = list(entries.values())
                for entry in entries if isinstance(entries, list) else [entries]:
                    found.append((str(name), entry))
            continue
        inner = getattr(ctx, "contexts", None)  # recomp's ComposedContext
        if isinstance(inner, (list, tuple)):
            stack.extend(reversed(inner))
    return found


def checkpoint_function(frame: Any) -> tuple[Any, Any]:
    """``(function, replay context)`` of a checkpoint call: what it checkpointed (a
    module, a bound method, a function) and the context its replay enters (recomp's
    state lives there).

    Private: both are closure variables (``fn``, ``recompute_context``) of the replay
    function PyTorch builds per call (``frame.recompute_fn``).
    If it changes: ``(None, None)``; the report then names the layer by nothing.
    """
    recompute = getattr(frame, "recompute_fn", None)
    return _closure_value(recompute, "fn"), _closure_value(recompute, "recompute_context")


def checkpoint_rng_states(frame: Any) -> list[torch.Tensor]:
    """The random-generator states a checkpoint call keeps for its replay (CPU tensors).

    Private: closure variables (``fwd_cpu_state``, ``fwd_device_states``) of the replay
    function. If it changes: empty (the report leaves these few KiB out).
    """
    recompute = getattr(frame, "recompute_fn", None)
    found = []
    for name in ("fwd_cpu_state", "fwd_device_states"):
        value = _closure_value(recompute, name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def replay_tensors(frame: Any, handle: Any) -> list[torch.Tensor]:
    """The tensors a running (or interrupted) replay produced for ``handle`` and that the
    checkpoint holds until backward reads them.

    Private: ``_Holder.handles`` (graph task -> key) and ``frame.recomputed`` (graph
    task -> key -> tensor), and what recomp's kept replays hold for a later backward
    pass. If it changes: empty (the report omits replayed tensors).
    """
    holder = packed_value(handle)
    found = []
    kept = _kept_replays_of(getattr(handle, "unpack_hook", None))
    if kept is not None:  # what recomp keeps for a later backward pass
        value = kept.kept_value(holder)
        if isinstance(value, torch.Tensor):
            found.append(value)
    handles = getattr(holder, "handles", None)
    recomputed = getattr(frame, "recomputed", None)
    if not isinstance(handles, dict) or recomputed is None:
        return found
    for gid, key in handles.items():
        if key is None or gid not in recomputed:
            continue
        tensor = recomputed[gid].get(key)
        if isinstance(tensor, torch.Tensor):
            found.append(tensor)
    return found
