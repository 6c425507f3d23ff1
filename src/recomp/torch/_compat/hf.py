"""Private API of transformers (Hugging Face), the library built on PyTorch that recomp
works with most closely: it is fenced here too.

Consumers: ``torch/_hf.py`` (which layers keep their KV cache) and the planner's layer
finder (``plan/_layers.py``). Tested by ``tests/torch/compat/test_hf.py``.
"""

from __future__ import annotations

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
