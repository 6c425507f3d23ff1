"""Misuse of the wrappers is refused at the call that makes it, with the fix named and
nothing changed (the ``fw`` fixture, ``tests/support/frameworks.py``): unknown checkpoint
options (a typo would reach the module's forward/construct as a keyword argument), a
layer class instead of an instance, and ``checkpoint(None, x)``."""

from __future__ import annotations

import pytest

import recomp
from recomp._wrapping import recomp_wrapper_of

ACCEPTED = {
    "torch": "context_fn, cpu_pool, debug, determinism_check, early_stop, exclude_collectives, "
    "group_swap, partition_inputs, policy_fn, preserve_rng_state, saved_tensors_hooks, swap_inputs, use_reentrant",
    "mindspore": "context_fn, cpu_pool, early_stop, exclude_collectives, group_swap, "
    "output_recompute, policy_fn, save_rng_state, swap_inputs, use_reentrant",
}


def test_unknown_checkpoint_options_are_a_type_error_naming_the_accepted_ones(fw):
    layer = fw.dense(4, 4)
    with pytest.raises(TypeError) as info:
        fw.api.checkpoint_wrapper(layer, jitter=1, early_stopp=True)
    message = str(info.value)
    assert "unknown option(s) 'jitter', 'early_stopp' (did you mean 'early_stop'?)" in message
    assert f"It accepts {ACCEPTED[fw.name]};" in message
    assert recomp_wrapper_of(layer) is None  # nothing wrapped
    fw.api.checkpoint_wrapper(layer, early_stop=False)  # a known one is taken
    assert layer.checkpoint_kwargs == {"early_stop": False}


def test_apply_activation_checkpointing_refuses_unknown_options_before_wrapping(fw):
    model = fw.stack(2)
    block_class = type(fw.blocks(model)[0])
    with pytest.raises(TypeError, match=r"apply_activation_checkpointing got unknown option"):
        fw.api.apply_activation_checkpointing(
            model, checkpoint_fn=block_class, exclude_fn=lambda m: False, early_stopp=True
        )
    assert all(recomp_wrapper_of(m) is None for _, m in fw.named_layers(model))


# Every entry point that takes a module (or function) to wrap, run or unwrap, with the
# call that passes the class instead.
CLASS_CALLS = {
    "checkpoint_wrapper": lambda api, cls, fw: api.checkpoint_wrapper(cls),
    "checkpoint_exclude_wrapper": lambda api, cls, fw: api.checkpoint_exclude_wrapper(cls),
    "checkpoint": lambda api, cls, fw: api.checkpoint(cls, fw.tensor(2, 2)),
    "apply_activation_checkpointing": lambda api, cls, fw: api.apply_activation_checkpointing(
        cls, checkpoint_fn=cls
    ),
    "unwrap": lambda api, cls, fw: api.unwrap(cls),
    "swap_wrapper": lambda api, cls, fw: api.swap_wrapper(cls),
}


@pytest.mark.parametrize("api", sorted(CLASS_CALLS))
def test_a_layer_class_instead_of_an_instance_is_refused(fw, api):
    cls = type(fw.dense(2, 2))
    with pytest.raises(recomp.InstanceRequiredError) as info:
        CLASS_CALLS[api](fw.api, cls, fw)
    message = str(info.value)
    assert f"{api} needs a " in message
    assert f"got the class {cls.__name__} itself" in message
    assert f"Pass an instance, e.g. {api}({cls.__name__}(...))" in message
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert recomp_wrapper_of(cls) is None and not hasattr(cls, "_recomp_base")
    assert not any("_recomp" in key for key in vars(cls))


def test_hf_activation_checkpointing_refuses_a_model_class(fw):
    if fw.name != "torch":
        pytest.skip("hf_activation_checkpointing is PyTorch's")
    cls = type(fw.dense(2, 2))
    with pytest.raises(recomp.InstanceRequiredError, match=r"Pass an instance, e.g. hf_activation_checkpointing\(Linear\(\.\.\.\)\)"):
        fw.api.hf_activation_checkpointing(cls)


@pytest.mark.parametrize("bad", ["none", "class"])
def test_checkpoint_of_none_or_a_class_is_refused(fw, bad):
    function = None if bad == "none" else type(fw.dense(2, 2))
    expected = "got NoneType" if bad == "none" else "got the class"
    error = recomp.InstanceRequiredError if bad == "class" else ValueError
    with pytest.raises(error, match=rf"checkpoint needs a {fw.layer} or a callable, {expected}"):
        fw.api.checkpoint(function, fw.tensor(2, 2))
