"""Private API of transformers and diffusers (Hugging Face), the libraries built on PyTorch
that recomp works with most closely: it is fenced here too.

Consumers: ``torch/_hf.py`` (which layers keep their KV cache; the checkpoint function
HF's own checkpointing calls, which ``hf_activation_checkpointing`` makes recomp's) and
the planner's layer finder (``plan/_layers.py``). Tested by ``tests/torch/compat/test_hf.py``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any


def hf_layer_keeps_cache(layer: Any) -> bool:
    """Whether a transformers ``GradientCheckpointingLayer`` may keep its KV cache
    arguments (``cache``, ``layer_past``) under a checkpoint.

    Why: a layer that only reads its cache (transformers' diffusion decoders) sets
    the class attribute ``_can_checkpoint_with_cache``; HF's own checkpointing then
    keeps the cache, and recomp follows the same rule.
    If it changes: False, and such a layer's cache is dropped under a recomp
    checkpoint with a warning, as for every other layer (an error where the cache
    holds entries): no silent change of results.
    Retired by: a public attribute of ``GradientCheckpointingLayer``.
    Checked on transformers 5.24.0.
    """
    return bool(getattr(layer, "_can_checkpoint_with_cache", False))


def hf_no_split_modules(model: Any) -> frozenset[str]:
    """The class names of a transformers model's layers: its ``_no_split_modules``.

    Why: the planner and the benchmark checkpoint a model's layers; a Hugging Face
    model whose layers are not one ``nn.ModuleList`` named ``layers`` (GPT-2's
    ``transformer.h``) names their classes there, for accelerate's device maps and
    FSDP wrapping, which match ``type(module).__name__`` as recomp then does.
    If it changes: empty, and the planner asks for ``layers=`` as for any other model
    without a ``layers`` list.
    Retired by: a public list of a model's layer classes.
    Checked on transformers 5.24.0.
    """
    names = getattr(model, "_no_split_modules", None)
    if not names or isinstance(names, str):
        return frozenset()
    try:
        return frozenset(str(n) for n in names)
    except TypeError:
        return frozenset()


def hf_checkpoint_function(layer: Any) -> Any:
    """The function a transformers ``GradientCheckpointingLayer`` checkpoints its forward
    with when HF's activation checkpointing is on (None before it was ever turned on).

    Why: ``_set_gradient_checkpointing`` (which ``activation_checkpointing_enable()``,
    ``gradient_checkpointing_enable()`` and ``Trainer`` call) stores it on each layer as
    ``_gradient_checkpointing_func``, PyTorch's ``checkpoint`` with the caller's keyword
    arguments; the layer's forward calls it. recomp reads it to put its own checkpoint,
    with the same arguments, in its place.
    If it changes: None, which ``hf_activation_checkpointing`` takes for a function it
    does not know and refuses with an error (never a silent fall-back to PyTorch's
    checkpoint, which would replay the excluded regions).
    Retired by: a public setter for a model's checkpoint function.
    Checked on transformers 5.24.0.
    """
    return vars(layer).get("_gradient_checkpointing_func")


def set_hf_checkpoint_function(layer: Any, function: Any) -> None:
    """Make ``function`` the one the layer checkpoints its forward with (see
    :func:`hf_checkpoint_function`).

    Why, if it changes, retired by: as there; written as HF's ``_set_gradient_checkpointing``
    writes it, an instance attribute.
    Checked on transformers 5.24.0.
    """
    layer._gradient_checkpointing_func = function


def is_hf_checkpoint_call(layer: Any, function: Any) -> bool:
    """Whether ``function`` is what a ``GradientCheckpointingLayer`` hands its checkpoint
    function: the forward its class wraps, bound to the layer with the keyword arguments
    (``functools.partial(forward, layer, **kwargs)``).

    Why: such a call runs the layer's own forward, below HF's checkpointing switch, so
    it checkpoints the layer once even though HF's switch is on; a call of the layer,
    its ``forward``, or a partial of its class's ``forward`` goes through the switch
    and is checkpointed again inside (recomp's ``DoubleCheckpointError``). The forward
    HF wraps is ``__wrapped__`` of the class's ``forward`` (``functools.wraps``).
    If it changes: False, and recomp as HF's checkpoint function raises
    ``DoubleCheckpointError`` at the first training step (a test fails here first).
    Retired by: HF telling its checkpoint function which layer it checkpoints.
    Checked on transformers 5.24.0.
    """
    if not isinstance(function, functools.partial) or not function.args:
        return False
    if function.args[0] is not layer:
        return False
    wrapped = getattr(type(layer).forward, "__wrapped__", None)
    return wrapped is not None and function.func is wrapped


def is_hf_offload_checkpoint(function: Any) -> bool:
    """Whether ``function`` is the checkpoint function HF builds for
    ``activation_checkpointing_enable(offload=True)``: PyTorch's ``checkpoint`` called
    inside ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, which moves what the
    checkpoint saves itself (its inputs) to pinned host memory until the replay.

    Why: HF defines it as a closure (``checkpoint_func``) local to
    ``PreTrainedModel._activation_checkpointing_enable``, with no attribute saying what it
    is; ``hf_activation_checkpointing`` reads it as recomp's ``swap_inputs=True``.
    If it changes: False, and HF's offload switch is refused with the error for a
    checkpoint function recomp does not know (never PyTorch's checkpoint in recomp's
    place, which would replay the excluded regions).
    Retired by: an option of HF's checkpointing that names the offload.
    Checked on transformers 5.24.0.
    """
    return (
        getattr(function, "__module__", None) == "transformers.modeling_utils"
        and getattr(function, "__qualname__", "")
        == "PreTrainedModel._activation_checkpointing_enable.<locals>.checkpoint_func"
    )


def diffusers_model(model: Any) -> Any:
    """The diffusers model (a ``ModelMixin``) that ``model`` is or holds (PEFT's
    ``PeftModel`` around one), the outermost; None where there is none, or where its class
    says it does not support gradient checkpointing (``_supports_gradient_checkpointing``,
    which ``enable_gradient_checkpointing`` reads).

    Why: ``hf_activation_checkpointing`` turns diffusers' switch on at that model and puts
    recomp's checkpoint where the switch stores its function
    (:func:`diffusers_checkpointing_modules`).
    If it changes: None, and ``hf_activation_checkpointing`` refuses the model with its
    error before wrapping anything.
    Retired by: a public flag of a diffusers model that says it can be checkpointed.
    Checked on diffusers 0.42.1.
    """
    mixin = getattr(sys.modules.get("diffusers.models.modeling_utils"), "ModelMixin", None)
    if mixin is None:
        return None
    for module in model.modules():
        if isinstance(module, mixin):
            return module if getattr(module, "_supports_gradient_checkpointing", False) else None
    return None


def diffusers_checkpointing_modules(model: Any, diffusers: Any) -> list[tuple[str, Any]]:
    """The modules of the diffusers model ``diffusers`` (``model`` itself or held by it:
    :func:`diffusers_model`) that call diffusers' checkpoint function when its gradient
    checkpointing is on, with their paths in ``model``.

    Why: diffusers' switch (``enable_gradient_checkpointing()``, which its training scripts
    call for ``--gradient_checkpointing``) stores the function as
    ``_gradient_checkpointing_func`` on every module that has a ``gradient_checkpointing``
    attribute (``ModelMixin._set_gradient_checkpointing``), and the forward of each such
    module hands it the sub-modules it checkpoints (resnets, transformer blocks) with their
    arguments. ``hf_activation_checkpointing`` puts recomp's checkpoint there.
    If it changes: a model whose modules no longer carry the attribute gives an empty list,
    and ``hf_activation_checkpointing`` refuses it with its error before wrapping anything.
    Retired by: a public list of the modules diffusers checkpoints through.
    Checked on diffusers 0.42.1.
    """
    inside = {id(m) for m in diffusers.modules()}
    return [
        (path, m)
        for path, m in model.named_modules()
        if id(m) in inside and hasattr(m, "gradient_checkpointing")
    ]


def is_diffusers_default_checkpoint(function: Any) -> bool:
    """Whether ``function`` is the checkpoint function diffusers makes when
    ``enable_gradient_checkpointing()`` is given none: PyTorch's non-reentrant
    ``checkpoint`` of the module it is handed (``module.__call__``), with no other option.

    Why: diffusers defines it as a closure (``_gradient_checkpointing_func``) local to
    ``ModelMixin.enable_gradient_checkpointing``, with nothing else saying what it is;
    ``hf_activation_checkpointing`` takes it for PyTorch's checkpoint and puts recomp's in
    its place.
    If it changes: False, and diffusers' switch is refused with the error for a checkpoint
    function recomp does not know (never PyTorch's checkpoint in recomp's place, which
    would replay the excluded regions).
    Retired by: diffusers storing ``torch.utils.checkpoint.checkpoint`` with its options.
    Checked on diffusers 0.42.1.
    """
    return (
        getattr(function, "__module__", None) == "diffusers.models.modeling_utils"
        and getattr(function, "__qualname__", "")
        == "ModelMixin.enable_gradient_checkpointing.<locals>._gradient_checkpointing_func"
    )


def hf_causal_mask_as_on_device() -> Any:
    """A context in which transformers decides whether to build a causal mask for SDPA
    as it does on real tensors, where its inputs are fake (``recomp.plan.simulate``).

    Why: without padding, transformers calls SDPA with ``is_causal=True`` and no mask,
    which lets the GPU take its flash kernel. It first asks whether it is tracing, and
    counts a fake tensor (the query offset) as tracing: on fake tensors it then builds
    a ``(seq, seq)`` mask that a real run does not have, which every layer keeps and
    which sends SDPA to a kernel that saves more. The simulation must count what the
    run on the device keeps.
    It also looks for packed sequences in the position ids, and on a fake tensor keeps
    the packing it cannot rule out, which forbids the skip as well.
    How: for the time of the block ``masking_utils._ignore_causal_mask_sdpa`` answers
    True where a run on real tensors does without reading data: no padding mask, as
    many queries as keys, no sliding window reached, not exporting; else it asks the
    original. ``masking_utils.find_packed_sequence_indices`` answers None (one sequence
    per row, what a training run of unpacked sequences finds) for fake position ids.
    Both restored on leaving. Does nothing where transformers is not imported. Packed
    or padded sequences are therefore not simulated: their data is not there.
    If it changes: the original decides (a mask is built: more bytes than on the GPU,
    as before this shim).
    Retired by: transformers deciding on fake tensors as on real ones.
    Checked on transformers 5.24.0.
    """
    import contextlib
    import sys

    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "_ignore_causal_mask_sdpa", None)
    if original is None:
        return contextlib.nullcontext()

    @functools.wraps(original)
    def decide(
        padding_mask: Any,
        q_length: int,
        kv_length: int,
        q_offset: Any,
        kv_offset: Any,
        local_attention_size: int | None = None,
    ) -> bool:
        exporting = getattr(module, "is_torchdynamo_exporting", lambda: False)
        if (
            padding_mask is None
            and q_length == kv_length
            and (local_attention_size is None or kv_length < local_attention_size)
            and not exporting()
        ):
            return True
        return bool(
            original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)
        )

    packed = getattr(module, "find_packed_sequence_indices", None)

    def unpacked(position_ids: Any) -> Any:
        from .fake import is_fake

        if is_fake(position_ids) or packed is None:
            return None
        return packed(position_ids)

    @contextlib.contextmanager
    def patched() -> Any:
        module._ignore_causal_mask_sdpa = decide  # type: ignore[union-attr]
        if packed is not None:
            module.find_packed_sequence_indices = unpacked  # type: ignore[union-attr]
        try:
            yield
        finally:
            module._ignore_causal_mask_sdpa = original  # type: ignore[union-attr]
            if packed is not None:
                module.find_packed_sequence_indices = packed  # type: ignore[union-attr]

    return patched()


def hf_grouped_mm_as_on_device() -> Any:
    """A context in which transformers' experts decide whether to run ``grouped_mm`` on
    fake CUDA tensors as they decide on a GPU (``recomp.plan.simulate`` without a driver).

    Why: transformers' default experts path (``grouped_mm_experts_forward``) asks
    ``integrations.moe._can_use_grouped_mm``, which on a CUDA weight calls
    ``torch.cuda.get_device_capability``: without a driver that raises "Found no NVIDIA
    driver", so a stock Mixtral (or any model using those experts) cannot be simulated.
    How: for the time of the block ``_can_use_grouped_mm`` answers, for a fake CUDA weight
    where this process has no CUDA device, as on a GPU of compute capability 8.0 or
    later, the simulation's target (its attention runs the flash kernel, which needs the
    same): ``grouped_mm`` is used where PyTorch has it, except under ``torch.compile``
    for a dtype other than bfloat16 (transformers' own rule). Any other tensor: the
    original decides. Restored on leaving; does nothing where transformers' MoE
    integration is not imported.
    If it changes: the original decides (the driver error, as before this shim).
    Retired by: transformers deciding without the driver for fake tensors.
    Checked on transformers 5.24.0.
    """
    import contextlib
    import sys

    import torch

    module = sys.modules.get("transformers.integrations.moe")
    original = getattr(module, "_can_use_grouped_mm", None)
    if original is None or torch.cuda.is_available():
        return contextlib.nullcontext()

    @functools.wraps(original)
    def decide(input: Any, weight: Any, offs: Any) -> bool:
        from .fake import is_fake

        if not (is_fake(weight) and weight.device.type == "cuda"):
            return bool(original(input, weight, offs))
        compiling = getattr(module, "is_torchdynamo_compiling", lambda: False)
        if compiling() and weight.dtype != torch.bfloat16:
            return False
        return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")

    @contextlib.contextmanager
    def patched() -> Any:
        module._can_use_grouped_mm = decide  # type: ignore[union-attr]
        try:
            yield
        finally:
            module._can_use_grouped_mm = original  # type: ignore[union-attr]

    return patched()
