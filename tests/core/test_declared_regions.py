"""Layers chosen by position and HyperParallel's declarative recompute regions, on both
frameworks (the ``fw`` fixture): ``apply_activation_checkpointing(..., layers=...)`` and
``RecomputePolicy``, ``ActivationCheckpointSelection``, ``apply_recompute_policy``,
``apply_submodule_checkpointing`` of ``recomp.<framework>.hyperparallel``.

What is checked: which modules get wrapped (by path), gradients equal to the same model
unwrapped, excluded regions run once and skipped once by the replay (their counters),
where a model's layers are found (a Hugging Face-style owner with towers and
non-contiguous keys, a container named ``layers``, a model that is a list of blocks),
and every refusal: the error class and what its message says to do, with nothing
wrapped afterwards.
"""

from __future__ import annotations

import importlib
import warnings
from types import SimpleNamespace

import pytest

import recomp
from frameworks import assert_same
from recomp._recompute_policy import ActivationCheckpointSelection, RecomputePolicy
from recomp._wrapping import recomp_wrapper_of


def classes(fw):
    ops = fw.ops

    def block_body(block, x):
        h = x + block.attn(x)
        return h + block.mlp(h)

    def net_body(net, x):
        h = net.embed(x)
        for layer in net.layers:
            h = layer(h)
        return net.head(h)

    def tower_body(tower, x):
        for name in ("2", "7"):
            x = tower.decoder[name](x)
        return x

    tower = fw.layer_class("Tower", tower_body)
    tower.gradient_checkpointing = False  # Hugging Face's mark of a module owning layers
    return SimpleNamespace(
        Net=fw.layer_class("Net", net_body),
        Block=fw.layer_class("Block", block_body),
        Attention=fw.layer_class("Attention", lambda a, x: ops.tanh(a.proj(x))),
        Mlp=fw.layer_class("Mlp", lambda m, x: m.down(ops.relu(m.up(x)))),
        Tower=tower,
        Towers=fw.layer_class("Towers", lambda t, x: t.text(x) + t.image(x)),
    )


def block(fw, c):
    return c.Block(
        attn=c.Attention(proj=fw.dense(8, 8)), mlp=c.Mlp(up=fw.dense(8, 16), down=fw.dense(16, 8))
    )


def decoder(fw, c, n=4):
    return c.Net(
        embed=fw.dense(4, 8), layers=fw.layer_list([block(fw, c) for _ in range(n)]), head=fw.dense(8, 4)
    )


def towers(fw, c):
    mapping = fw.nn.ModuleDict if fw.name == "torch" else fw.nn.CellDict

    def tower():
        return c.Tower(decoder=mapping({"2": block(fw, c), "7": block(fw, c)}))

    return c.Towers(text=tower(), image=tower())


def hp(fw):
    return importlib.import_module(f"recomp.{fw.name}.hyperparallel")


def wrapped(fw, model):
    return [path for path, m in fw.named_layers(model) if recomp_wrapper_of(m) is not None]


def checkpoints(fw, model):
    return [path for path, m in fw.named_layers(model) if isinstance(m, fw.api.CheckpointWrapper)]


def same_gradients(fw, ref, model, *, n_in=4):
    x = fw.tensor(3, n_in)
    _, expected = fw.grads(ref, x)
    _, got = fw.grads(model, x)
    assert_same(expected, got)


def runs_and_skips(regions):
    return [(r.region_runs, r.region_skips) for r in regions]


SAFE = "model_adapter_safe_regions"


# --------------------------------------------------------------------------- layers=


def test_layers_alone_checkpoint_the_chosen_layers_whole(fw):
    c = classes(fw)
    ref, model = fw.twins(lambda: decoder(fw, c))
    fw.api.apply_activation_checkpointing(model, layers=[1, 3])
    assert wrapped(fw, model) == ["layers.1", "layers.3"]
    same_gradients(fw, ref, model)


def test_layers_hold_checkpoint_fn_and_exclusions_to_the_chosen_layers(fw):
    c = classes(fw)
    ref, model = fw.twins(lambda: decoder(fw, c))
    fw.api.apply_activation_checkpointing(
        model, checkpoint_fn=c.Block, exclude_fn="attn", layers=range(0, 4, 2)
    )
    assert wrapped(fw, model) == ["layers.0", "layers.0.attn", "layers.2", "layers.2.attn"]
    same_gradients(fw, ref, model)
    assert runs_and_skips([model.layers[0].attn, model.layers[2].attn]) == [(1, 1), (1, 1)]


def test_layers_hold_a_second_call_to_its_own_layers(fw):
    c = classes(fw)
    model = decoder(fw, c)
    fw.api.apply_activation_checkpointing(model, layers=[0])
    # Exclusions are added in the chosen layer only, not in the earlier checkpoint.
    fw.api.apply_activation_checkpointing(model, layers=[1], exclude_fn="attn")
    assert wrapped(fw, model) == ["layers.0", "layers.1", "layers.1.attn"]


def test_no_layer_chosen_checkpoints_nothing_and_says_nothing(fw):
    c = classes(fw)
    model = decoder(fw, c)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fw.api.apply_activation_checkpointing(model, checkpoint_fn=c.Block, layers=range(0))
    assert wrapped(fw, model) == []


def test_checkpoint_fn_selecting_nothing_in_the_chosen_layers_warns(fw):
    c = classes(fw)
    model = decoder(fw, c)
    with pytest.warns(recomp.IneffectiveSelectionWarning, match=r"in the 1 layer\(s\) chosen by layers= \('layers.3'\)"):
        fw.api.apply_activation_checkpointing(model, checkpoint_fn="head", layers=[3])
    assert wrapped(fw, model) == []


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (2, r"layers=2 is a number.*layers=range\(2\) for the first 2 layers, layers=\[2\]"),
        ([-1], "non-negative integers"),
        ([1.0], "non-negative integers"),
        ([1, 1], "position\\(s\\) 1 more than once"),
        ([0, 4], r"position\(s\) 4, past the last of the 4 layer\(s\) of Net \(positions 0 to 3: 'layers.0' to 'layers.3'\)"),
        ("0", "must be a range, list or tuple"),
    ],
)
def test_bad_layer_positions_are_refused_before_anything_is_wrapped(fw, layers, message):
    c = classes(fw)
    model = decoder(fw, c)
    with pytest.raises(recomp.SelectionError, match=message):
        fw.api.apply_activation_checkpointing(model, exclude_fn="attn", layers=layers)
    assert wrapped(fw, model) == []


def test_without_layers_or_checkpoint_fn_nothing_is_selected(fw):
    model = decoder(fw, classes(fw))
    with pytest.raises(recomp.SelectionError, match=r"checkpoint_fn got None and no layers were given.*or layers \(the layers to checkpoint whole"):
        fw.api.apply_activation_checkpointing(model, exclude_fn="attn")


def test_a_model_without_layers_is_refused_naming_the_way_out(fw):
    c = classes(fw)
    model = block(fw, c)
    with pytest.raises(recomp.SelectionError, match=r"found no layers in Block.*by path instead \(checkpoint_fn=\['blocks.0'") as info:
        fw.api.apply_activation_checkpointing(model, layers=[0])
    assert "'attn.proj'" in str(info.value)  # the model's own paths, to choose from
    assert wrapped(fw, model) == []


def test_layers_below_a_gradient_checkpointing_owner_are_numbered_across_towers(fw):
    """HyperParallel's rule: the towers' blocks one after the other, their own keys kept."""
    c = classes(fw)
    model = towers(fw, c)
    fw.api.apply_activation_checkpointing(model, layers=[1, 3])
    assert wrapped(fw, model) == ["text.decoder.7", "image.decoder.7"]
    model = towers(fw, c)
    fw.api.apply_activation_checkpointing(model, layers=range(2))
    assert wrapped(fw, model) == ["text.decoder.2", "text.decoder.7"]


def test_a_layer_shared_by_two_keys_is_one_layer(fw):
    c = classes(fw)
    model = towers(fw, c)
    model.text.decoder["7"] = model.text.decoder["2"]
    with pytest.raises(recomp.SelectionError, match=r"past the last of the 3 layer\(s\)"):
        fw.api.apply_activation_checkpointing(model, layers=[3])


def test_a_model_that_is_a_list_of_blocks_has_them_as_layers(fw):
    c = classes(fw)
    ref, model = fw.twins(lambda: fw.sequential(block(fw, c), block(fw, c), block(fw, c)))
    fw.api.apply_activation_checkpointing(model, layers=[1], exclude_fn=c.Attention)
    assert wrapped(fw, model) == ["1", "1.attn"]
    same_gradients(fw, ref, model, n_in=8)


# --------------------------------------------------------------------------- HyperParallel


def test_declared_regions_are_checkpointed_and_their_exclusions_run_once(fw):
    c = classes(fw)
    ref, model = fw.twins(lambda: decoder(fw, c))
    seen = []
    policy = hp(fw).RecomputePolicy(
        region_patterns=("layers.*",),
        exclude_patterns=("layers.*.attn",),
        on_applied=lambda m: seen.append((m, wrapped(fw, m))),
    )
    selection = hp(fw).ActivationCheckpointSelection(source=SAFE, layer_count=3)
    assert hp(fw).apply_recompute_policy(model, policy, selection) is model
    expected = ["layers.0", "layers.0.attn", "layers.1", "layers.1.attn", "layers.2", "layers.2.attn"]
    assert wrapped(fw, model) == expected
    assert seen == [(model, expected)]  # once, after everything is in place
    same_gradients(fw, ref, model)
    assert runs_and_skips(layer.attn for layer in list(model.layers)[:3]) == [(1, 1)] * 3


def test_layer_indices_choose_those_layers(fw):
    c = classes(fw)
    ref, model = fw.twins(lambda: decoder(fw, c))
    policy = hp(fw).RecomputePolicy(("layers.*",), ("layers.*.attn",))
    hp(fw).apply_recompute_policy(model, policy, {"layer_indices": [3, 1]})
    assert wrapped(fw, model) == ["layers.1", "layers.1.attn", "layers.3", "layers.3.attn"]
    same_gradients(fw, ref, model)


def test_leaf_patterns_give_one_region_per_part(fw):
    c = classes(fw)
    ref, model = fw.twins(lambda: decoder(fw, c))
    policy = hp(fw).RecomputePolicy(region_patterns=("layers.*.mlp", "layers.*.attn"))
    hp(fw).apply_recompute_policy(model, policy, SimpleNamespace(layer_count=4, layer_indices=None))
    assert checkpoints(fw, model) == [f"layers.{i}.{part}" for i in range(4) for part in ("attn", "mlp")]
    same_gradients(fw, ref, model)


def test_regions_in_towers_follow_hyperparallel_numbering(fw):
    c = classes(fw)
    model = towers(fw, c)
    policy = hp(fw).RecomputePolicy(("*decoder.*",), ("*decoder.*.attn",))
    hp(fw).apply_recompute_policy(model, policy, ActivationCheckpointSelection(SAFE, layer_indices=[1, 3]))
    assert wrapped(fw, model) == [
        "text.decoder.7", "text.decoder.7.attn", "image.decoder.7", "image.decoder.7.attn",
    ]


def test_layer_count_zero_checks_the_policy_and_wraps_nothing(fw):
    c = classes(fw)
    model = decoder(fw, c)
    called = []
    policy = hp(fw).RecomputePolicy(("layers.*",), on_applied=called.append)
    hp(fw).apply_recompute_policy(model, policy, ActivationCheckpointSelection(SAFE, layer_count=0))
    assert (wrapped(fw, model), called) == ([], [])
    with pytest.raises(recomp.SelectionError, match=r"module path\(s\) 'layer\.\*' that match no module"):
        hp(fw).apply_recompute_policy(
            model, hp(fw).RecomputePolicy(("layer.*",)), ActivationCheckpointSelection(SAFE, layer_count=0)
        )


def test_without_a_selection_regions_are_taken_anywhere(fw):
    c = classes(fw)
    model = decoder(fw, c)
    hp(fw).apply_recompute_policy(model, hp(fw).RecomputePolicy(("layers.*", "head")))
    assert wrapped(fw, model) == ["layers.0", "layers.1", "layers.2", "layers.3", "head"]


def test_swap_inputs_reaches_each_region_and_pairs_consecutive_layers(fw):
    c = classes(fw)
    model = decoder(fw, c)
    module = hp(fw)
    policy = module.RecomputePolicy(("layers.*.mlp", "layers.*.attn"))
    module.apply_recompute_policy(model, policy, ActivationCheckpointSelection(SAFE, layer_indices=[0, 1, 3]), swap_inputs=True)
    manager = module.SwapManager()
    try:
        layers = list(model.layers)
        for part in ("attn", "mlp"):
            first, second, third = (getattr(layers[i], part) for i in (0, 1, 3))
            assert manager.pairs[second]() is first
            assert manager.pairs[third]() is second
            assert first not in manager.pairs
            assert first.__dict__["_recomp_checkpoint_kwargs"]["swap_inputs"] is True
    finally:
        for layer in model.layers:
            for part in ("attn", "mlp"):
                manager.unregister_forward_prefetch_layer(getattr(layer, part))


REFUSALS = [
    # (policy, selection, options, error, message)
    (RecomputePolicy(()), None, {}, ValueError, "declares no region"),
    (RecomputePolicy(("layers.*.atn",)), None, {}, recomp.SelectionError, "did you mean 'layers.*.attn'"),
    (RecomputePolicy(("head",)), {"layer_count": 2}, {}, recomp.SelectionError,
     r"select no module in the 2 chosen layer\(s\) of Net"),
    (RecomputePolicy(("layers.*",), ("embed",)), {"layer_count": 2}, {}, recomp.SelectionError,
     r"exclude_patterns 'embed' select no module inside the regions"),
    (RecomputePolicy(("layers.*.attn",), ("layers.*.attn",)), {"layer_count": 1}, {}, ValueError,
     "'layers.0.attn' is both a recompute region and excluded"),
    (RecomputePolicy(("layers.*",)), {"layer_count": 1, "layer_indices": [0]}, {}, ValueError, "exactly one"),
    (RecomputePolicy(("layers.*",)), {"layer_indices": [4]}, {}, ValueError,
     r"selection.layer_indices has position\(s\) 4, past the last of the 4 layer\(s\)"),
    (RecomputePolicy(("layers.*",)), {"layer_count": 5}, {}, ValueError,
     r"layer_count=5 is more than the 4 layer\(s\) of Net"),
    (RecomputePolicy(("layers.*",)), {"layers": [0]}, {}, TypeError, "unknown field"),
    (RecomputePolicy(("layers.*",)), 3, {}, TypeError, "must be an ActivationCheckpointSelection"),
    ("layers.*", None, {}, TypeError, "needs a RecomputePolicy"),
    (RecomputePolicy(("layers.*",)), None, {"swap_inputs": 1}, ValueError, "swap_inputs must be a bool"),
    (RecomputePolicy(("layers.*",)), None, {"early_stp": True}, TypeError, "did you mean 'early_stop'"),
    (RecomputePolicy(("layers.*",)), None, {"early_stop": 1}, ValueError, "early_stop must be a bool"),
]


@pytest.mark.parametrize(("policy", "selection", "options", "error", "message"), REFUSALS)
def test_refusals_leave_the_model_unwrapped(fw, policy, selection, options, error, message):
    c = classes(fw)
    model = decoder(fw, c)
    called = []
    if isinstance(policy, RecomputePolicy):
        policy = RecomputePolicy(policy.region_patterns, policy.exclude_patterns, on_applied=called.append)
    with pytest.raises(error, match=message):
        hp(fw).apply_recompute_policy(model, policy, selection, **options)
    assert (wrapped(fw, model), called) == ([], [])


def test_a_model_without_layers_is_refused_when_layers_are_chosen(fw):
    model = block(fw, classes(fw))
    policy = hp(fw).RecomputePolicy(("mlp",))
    with pytest.raises(ValueError, match="found no layers in Block"):
        hp(fw).apply_recompute_policy(model, policy, ActivationCheckpointSelection(SAFE, layer_count=1))
    assert wrapped(fw, model) == []


def test_submodule_checkpointing_wraps_each_layers_parts(fw):
    def layer():
        part = fw.layer_class("Layer", lambda m, x: x)
        return part(
            mlp=fw.dense(2, 2), self_attn=fw.dense(2, 2), input_layernorm=fw.dense(2, 2),
            post_attention_layernorm=fw.dense(2, 2), ffn=fw.dense(2, 2),
        )

    module = hp(fw)
    layers = [layer(), layer()]
    assert module.apply_submodule_checkpointing(layers, has_kv_sharing=False, swap_inputs=True) == 8
    parts = ("mlp", "self_attn", "input_layernorm", "post_attention_layernorm")
    assert wrapped(fw, layers[0]) == list(parts)  # the MLP once: mlp, not ffn as well
    options = layers[0].mlp.__dict__["_recomp_checkpoint_kwargs"]
    assert options["swap_inputs"] is True
    assert module.apply_submodule_checkpointing(layers, False) == 0  # already wrapped
    shared = [layer()]
    assert module.apply_submodule_checkpointing(shared, True, enable_compile=True, swap_inputs=True) == 3
    assert "self_attn" not in wrapped(fw, shared[0])
    assert "swap_inputs" not in shared[0].mlp.__dict__["_recomp_checkpoint_kwargs"]
    with pytest.raises(TypeError, match="list of layers"):
        module.apply_submodule_checkpointing(layer(), False)
    with pytest.raises(TypeError, match="has_kv_sharing must be a bool"):
        module.apply_submodule_checkpointing([layer()], None)
    fresh = layer()
    with pytest.raises(ValueError, match="swap_inputs must be a bool"):
        module.apply_submodule_checkpointing([fresh], False, swap_inputs="yes")
    assert wrapped(fw, fresh) == []


def test_the_hyperparallel_names_are_recomps_framework_free_objects(fw):
    assert hp(fw).RecomputePolicy is RecomputePolicy
    assert hp(fw).ActivationCheckpointSelection is ActivationCheckpointSelection


# --------------------------------------------------------------------------- the two types


def test_a_selection_takes_exactly_one_valid_layer_choice():
    """HyperParallel's own checks, with its own cases."""
    with pytest.raises(ValueError, match="only valid"):
        ActivationCheckpointSelection(source="default", layer_count=1)
    with pytest.raises(ValueError, match="exactly one"):
        ActivationCheckpointSelection(source=SAFE)
    with pytest.raises(ValueError, match="exactly one"):
        ActivationCheckpointSelection(source=SAFE, layer_count=1, layer_indices=[0])
    with pytest.raises(ValueError, match="non-negative integer"):
        ActivationCheckpointSelection(source=SAFE, layer_count=-1)
    with pytest.raises(ValueError, match="non-negative integer"):
        ActivationCheckpointSelection(source=SAFE, layer_count=True)
    with pytest.raises(ValueError, match="must not contain duplicates"):
        ActivationCheckpointSelection(source=SAFE, layer_indices=[0, 0])
    with pytest.raises(ValueError, match="non-empty list"):
        ActivationCheckpointSelection(source=SAFE, layer_indices=[])
    with pytest.raises(ValueError, match="non-negative integers"):
        ActivationCheckpointSelection(source=SAFE, layer_indices=[0, -2])
    with pytest.raises(ValueError, match="source must be one of"):
        ActivationCheckpointSelection(source="adapter")
    assert ActivationCheckpointSelection(source=SAFE, layer_count=0).layer_count == 0
    assert ActivationCheckpointSelection(source=SAFE, layer_indices=[0, 2]).layer_indices == [0, 2]
    assert ActivationCheckpointSelection().source == "default"


def test_a_policy_holds_tuples_of_patterns():
    policy = RecomputePolicy(["layers.*"], ["layers.*.attn"])
    assert (policy.region_patterns, policy.exclude_patterns, policy.on_applied) == (
        ("layers.*",), ("layers.*.attn",), None,
    )
    hash(policy)  # frozen, as HyperParallel's
    with pytest.raises(TypeError, match=r"tuple of module path patterns, such as \('model.layers.\*',\)"):
        RecomputePolicy("layers.*")
    with pytest.raises(TypeError, match="non-empty string"):
        RecomputePolicy(("layers.*", ""))
    with pytest.raises(TypeError, match="on_applied must be a function"):
        RecomputePolicy(("layers.*",), on_applied=3)
    other = SimpleNamespace(region_patterns=("a",), exclude_patterns=("b",), on_applied=None)
    assert RecomputePolicy.of(other, "api") == RecomputePolicy(("a",), ("b",))
