"""What ``apply_activation_checkpointing`` is asked to select, on both frameworks (the
``fw`` fixture, ``tests/support/frameworks.py``).

Selections that take no effect warn (``IneffectiveSelectionWarning``) naming what
and why; a class or a tuple of classes selects by ``isinstance``, a string by module
path, a list by any of its entries; other values, and paths that match nothing, are
refused (``SelectionError``) before anything is wrapped. A second call adds its
exclusions to the first's and says so (``EarlierExclusionsWarning``). The model is a
small decoder: an embedding, blocks of attention and MLP, a head.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest

import recomp
from frameworks import assert_same
from recomp._wrapping import recomp_wrapper_of


def decoder_classes(fw, attention_call=None):
    """The classes of the model: Net (embed, layers, head), Block (attn, mlp), Attention,
    Mlp. ``attention_call`` names the method through which a block calls its attention
    (``fw.method`` bypasses the layer call); None calls the layer."""
    ops = fw.ops

    def block_body(block, x):
        attend = block.attn if attention_call is None else getattr(block.attn, attention_call)
        h = x + attend(x)
        return h + block.mlp(h)

    def net_body(net, x):
        h = net.embed(x)
        for layer in net.layers:
            h = layer(h)
        return net.head(h)

    return SimpleNamespace(
        Net=fw.layer_class("Net", net_body),
        Block=fw.layer_class("Block", block_body),
        Attention=fw.layer_class("Attention", lambda a, x: ops.tanh(a.proj(x))),
        Mlp=fw.layer_class("Mlp", lambda m, x: m.down(ops.relu(m.up(x)))),
    )


def decoder(fw, n_blocks=2, classes=None):
    c = decoder_classes(fw) if classes is None else classes
    blocks = [
        c.Block(
            attn=c.Attention(proj=fw.dense(8, 8)),
            mlp=c.Mlp(up=fw.dense(8, 16), down=fw.dense(16, 8)),
        )
        for _ in range(n_blocks)
    ]
    return c.Net(embed=fw.dense(4, 8), layers=fw.layer_list(blocks), head=fw.dense(8, 4))


def apply(fw, model, **kwargs):
    """The IneffectiveSelectionWarning messages of applying ``kwargs`` to ``model``."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fw.api.apply_activation_checkpointing(model, **kwargs)
    return selection_warnings(record)


def selection_warnings(record):
    return [str(w.message) for w in record if w.category is recomp.IneffectiveSelectionWarning]


def wrapped(fw, model):
    return [name for name, layer in fw.named_layers(model) if recomp_wrapper_of(layer) is not None]


def test_a_selection_that_takes_effect_does_not_warn(fw):
    c = decoder_classes(fw)
    model = decoder(fw, classes=c)
    selection = {
        "checkpoint_fn": lambda m: isinstance(m, c.Block),
        "exclude_fn": lambda m: isinstance(m, c.Attention),
    }
    assert apply(fw, model, **selection) == []
    # Applying it again finds everything already in place: still silent.
    assert apply(fw, model, **selection) == []
    assert wrapped(fw, model) == ["layers.0", "layers.0.attn", "layers.1", "layers.1.attn"]


def test_checkpoint_fn_of_a_class_from_another_model_warns(fw):
    """A class of the same name and the same code, but another class."""
    c = decoder_classes(fw)
    other = decoder_classes(fw)
    assert other.Block is not c.Block and other.Block.__name__ == "Block"
    model = decoder(fw, classes=c)
    (message,) = apply(fw, model, checkpoint_fn=lambda m: isinstance(m, other.Block))
    assert "checkpoint_fn matched no module of Net" in message
    # the classes the model does have, its own first
    assert "include Net, Block, Attention, Mlp, " in message
    assert "a class of the same name imported from another module is another class" in message
    assert wrapped(fw, model) == []


def test_exclude_fn_matching_only_modules_outside_checkpoints_warns(fw):
    c = decoder_classes(fw)
    model = decoder(fw, classes=c)
    (message,) = apply(
        fw,
        model,
        checkpoint_fn=lambda m: isinstance(m, c.Block),
        exclude_fn=lambda m: m is model.embed,
    )
    assert "exclude_fn excluded no module inside a checkpoint" in message
    assert "outside every checkpoint ('embed')" in message
    assert wrapped(fw, model) == ["layers.0", "layers.1"]


@pytest.mark.parametrize(
    ("n_blocks", "shown"),
    [
        (2, "'layers.0', 'layers.1'"),
        (4, "'layers.0', 'layers.1', 'layers.2' and 1 more"),
    ],
)
def test_exclude_fn_matching_the_checkpointed_module_warns(fw, n_blocks, shown):
    c = decoder_classes(fw)
    model = decoder(fw, n_blocks, classes=c)
    (message,) = apply(
        fw,
        model,
        checkpoint_fn=lambda m: isinstance(m, c.Block),
        exclude_fn=lambda m: isinstance(m, c.Block),
    )
    assert "exclude_fn excluded no module inside a checkpoint" in message
    assert f"checkpointed modules themselves ({shown})" in message
    # Part of it working, part of it not: the part that does nothing is named.
    model = decoder(fw, n_blocks, classes=c)
    (message,) = apply(
        fw,
        model,
        checkpoint_fn=lambda m: isinstance(m, c.Block),
        exclude_fn=lambda m: isinstance(m, (c.Block, c.Attention)),
    )
    assert (
        f"exclude_fn excluded {n_blocks} module(s), but it matches checkpointed modules" in message
    )


def test_exclude_fn_matching_nothing_warns(fw):
    c, other = decoder_classes(fw), decoder_classes(fw)
    model = decoder(fw, classes=c)
    (message,) = apply(
        fw,
        model,
        checkpoint_fn=lambda m: isinstance(m, c.Block),
        exclude_fn=lambda m: isinstance(m, other.Attention),
    )
    assert "it matches no module inside a checkpoint" in message


def test_excluded_module_called_through_its_method_warns_once(fw):
    """A block that calls its attention as ``attn.forward(x)`` (``attn.construct(x)``)."""
    c = decoder_classes(fw, attention_call=fw.method)
    model = decoder(fw, classes=c)
    apply(
        fw,
        model,
        checkpoint_fn=lambda m: isinstance(m, c.Block),
        exclude_fn=lambda m: isinstance(m, c.Attention),
    )
    x = fw.tensor(2, 4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            fw.grads(model, x)
    messages = selection_warnings(record)
    assert len(messages) == 2  # once per excluded module, not per call
    assert f"'layers.0.attn' was called as .{fw.method}(...)" in messages[0]
    assert f"'layers.1.attn' was called as .{fw.method}(...)" in messages[1]
    assert [layer.attn.region_runs for layer in model.layers] == [0, 0]
    # Outside a checkpoint (no gradient) the method call is fine and silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fw.no_grad():
            model(x)


def test_a_class_or_a_tuple_of_classes_selects_by_isinstance(fw):
    c = decoder_classes(fw)
    by_lambda, by_class = fw.twins(lambda: decoder(fw, classes=c))
    apply(
        fw,
        by_lambda,
        checkpoint_fn=lambda m: isinstance(m, c.Block),
        exclude_fn=lambda m: isinstance(m, (c.Attention, c.Mlp)),
    )
    assert apply(fw, by_class, checkpoint_fn=c.Block, exclude_fn=(c.Attention, c.Mlp)) == []
    assert wrapped(fw, by_class) == wrapped(fw, by_lambda)
    assert len(wrapped(fw, by_class)) == 6  # 2 blocks, their attention and MLP
    # One class in a tuple is a class too.
    one = decoder(fw, classes=c)
    assert apply(fw, one, checkpoint_fn=(c.Block,), exclude_fn=(c.Attention,)) == []
    assert wrapped(fw, one) == ["layers.0", "layers.0.attn", "layers.1", "layers.1.attn"]
    x = fw.tensor(2, 4)
    _, expected = fw.grads(by_lambda, x)
    _, got = fw.grads(by_class, x)
    assert_same(expected, got)


def test_a_class_is_never_called_as_a_predicate(fw):
    model = decoder(fw)
    # Identity(module) would build an Identity, which is truthy: the root was checkpointed.
    (message,) = apply(fw, model, checkpoint_fn=fw.nn.Identity)
    assert "checkpoint_fn matched no module" in message
    assert wrapped(fw, model) == []


def model_state(fw, model):
    """What wrapping would change, for every module: its class, its instance attributes
    and the number of entries of each dictionary among them (hooks)."""
    return [
        (
            path,
            type(layer),
            sorted(
                (key, len(value) if isinstance(value, dict) else None)
                for key, value in vars(layer).items()
            ),
        )
        for path, layer in fw.named_layers(model)
    ]


def test_module_paths_select_as_classes_do(fw):
    c = decoder_classes(fw)
    by_class, by_path = fw.twins(lambda: decoder(fw, classes=c))
    apply(fw, by_class, checkpoint_fn=c.Block, exclude_fn=c.Attention)
    # "attn" is the end of each block's attention path; "layers.*" every block (a match
    # is not looked inside for further checkpoints).
    assert apply(fw, by_path, checkpoint_fn="layers.*", exclude_fn="attn") == []
    assert wrapped(fw, by_path) == wrapped(fw, by_class)
    assert wrapped(fw, by_path) == ["layers.0", "layers.0.attn", "layers.1", "layers.1.attn"]
    x = fw.tensor(2, 4)
    _, expected = fw.grads(by_class, x)
    _, got = fw.grads(by_path, x)
    assert_same(expected, got)


def test_a_list_mixes_classes_paths_and_functions(fw):
    c = decoder_classes(fw)
    model = decoder(fw, classes=c)
    messages = apply(
        fw,
        model,
        checkpoint_fn=[c.Block],
        exclude_fn=["layers.0.attn", lambda m: isinstance(m, c.Mlp), (c.Attention,)],
    )
    assert messages == []
    assert wrapped(fw, model) == [
        "layers.0", "layers.0.attn", "layers.0.mlp", "layers.1", "layers.1.attn", "layers.1.mlp"
    ]


@pytest.mark.parametrize(
    ("kwargs", "argument", "hint"),
    [
        (
            lambda c, m: {"checkpoint_fn": "Block"},
            "checkpoint_fn",
            "'Block' is the name of a module class of the model, and a string is a module path: "
            "pass the class itself (checkpoint_fn=Block)",
        ),
        (lambda c, m: {"checkpoint_fn": None}, "checkpoint_fn", "got None and no layers were given"),
        (lambda c, m: {"checkpoint_fn": []}, "checkpoint_fn", "selects nothing (got [])"),
        (lambda c, m: {"checkpoint_fn": 3}, "checkpoint_fn", "got int (3)"),
        (
            lambda c, m: {"checkpoint_fn": c.Block, "exclude_fn": m.layers[0].attn},
            "exclude_fn",
            "got an instance of Attention, where a class or a module path was meant",
        ),
        (
            lambda c, m: {"checkpoint_fn": c.Block, "exclude_fn": [c.Attention, 2.5]},
            "exclude_fn",
            "got float (2.5) in the list",
        ),
        (
            lambda c, m: {"checkpoint_fn": c.Block, "exclude_fn": "layers.*.atn"},
            "exclude_fn",
            "For 'layers.*.atn', did you mean 'layers.*.attn'",
        ),
        (
            lambda c, m: {"checkpoint_fn": "layers.*", "exclude_fn": ["attn", "mlp.upp"]},
            "exclude_fn",
            "path(s) 'mlp.upp' that match no module of Net",
        ),
        (
            lambda c, m: {"checkpoint_fn": c.Block, "exclude_fn": c.Attention, "copy_output_fn": 1},
            "copy_output_fn",
            "int",
        ),
        (
            lambda c, m: {"checkpoint_fn": c.Block, "exclude_fn": "", "copy_output_fn": 1},
            "exclude_fn",
            "an empty module path",
        ),
    ],
    ids=[
        "class name",
        "None",
        "empty",
        "int",
        "instance",
        "float in a list",
        "path typo",
        "one path of two",
        "copy_output int",
        "empty path",
    ],
)
def test_a_bad_selection_raises_naming_what_to_pass_and_changes_nothing(
    fw, kwargs, argument, hint
):
    c = decoder_classes(fw)
    model = decoder(fw, classes=c)
    before = model_state(fw, model)
    with pytest.raises(recomp.SelectionError, match=rf"apply_activation_checkpointing: {argument} ") as info:
        fw.api.apply_activation_checkpointing(model, **kwargs(c, model))
    assert hint in str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert wrapped(fw, model) == []
    assert model_state(fw, model) == before  # no wrapper, attribute or hook left behind
    # The model still takes a good selection afterwards.
    assert apply(fw, model, checkpoint_fn=c.Block, exclude_fn=c.Attention) == []


def test_an_instance_names_its_path(fw):
    c = decoder_classes(fw)
    model = decoder(fw, classes=c)
    with pytest.raises(recomp.SelectionError) as info:
        fw.api.apply_activation_checkpointing(model, checkpoint_fn=model.layers[1])
    message = str(info.value)
    assert "Pass its class (checkpoint_fn=Block), its path (checkpoint_fn='layers.1')" in message
    assert wrapped(fw, model) == []


def test_the_model_must_be_an_instance(fw):
    c = decoder_classes(fw)
    with pytest.raises(recomp.InstanceRequiredError, match=r"got the class Net itself") as info:
        fw.api.apply_activation_checkpointing(c.Net, checkpoint_fn=c.Block)
    assert "Pass an instance, e.g. apply_activation_checkpointing(Net(...))" in str(info.value)


def counting_classes(fw, calls):
    """decoder_classes whose attention and MLP count their forwards in ``calls``."""
    ops = fw.ops

    def attention(a, x):
        calls["attn"] += 1
        return ops.tanh(a.proj(x))

    def mlp(m, x):
        calls["mlp"] += 1
        return m.down(ops.relu(m.up(x)))

    c = decoder_classes(fw)
    c.Attention = fw.layer_class("Attention", attention)
    c.Mlp = fw.layer_class("Mlp", mlp)
    return c


def earlier_warnings(record):
    return [str(w.message) for w in record if w.category is recomp.EarlierExclusionsWarning]


def test_a_second_call_adds_its_exclusions_and_says_which_earlier_ones_stay(fw):
    calls = {"attn": 0, "mlp": 0}
    c = counting_classes(fw, calls)
    ref, model = fw.twins(lambda: decoder(fw, classes=c))
    x = fw.tensor(2, 4)
    _, expected = fw.grads(ref, x)

    apply(fw, model, checkpoint_fn=c.Block, exclude_fn=c.Attention)
    calls.update(attn=0, mlp=0)
    _, got = fw.grads(model, x)
    assert_same(expected, got)
    assert calls == {"attn": 2, "mlp": 4}  # attention once per block, the MLP replayed

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fw.api.apply_activation_checkpointing(model, checkpoint_fn=c.Block, exclude_fn=c.Mlp)
    (message,) = earlier_warnings(record)
    assert (
        "checkpoints wrapped before this call hold excluded regions that this exclude_fn does "
        "not select: 'layers.0.attn', 'layers.1.attn'. They stay excluded" in message
    )
    assert f"recomp.{fw.name}.unwrap(model) first" in message
    assert wrapped(fw, model) == [
        "layers.0", "layers.0.attn", "layers.0.mlp", "layers.1", "layers.1.attn", "layers.1.mlp"
    ]
    calls.update(attn=0, mlp=0)
    _, got = fw.grads(model, x)
    assert_same(expected, got)
    assert calls == {"attn": 2, "mlp": 2}  # both excluded: neither is replayed
    assert [(b.attn.region_runs, b.mlp.region_runs) for b in model.layers] == [(2, 1), (2, 1)]

    # A call that selects every earlier region again, or says nothing about exclusions
    # (exclude_fn=None), changes nothing and does not warn.
    for again in ({"exclude_fn": (c.Attention, c.Mlp)}, {}):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fw.api.apply_activation_checkpointing(model, checkpoint_fn=c.Block, **again)
        assert earlier_warnings(record) == []

    # Starting over: unwrap, then the second selection alone.
    fw.api.unwrap(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fw.api.apply_activation_checkpointing(model, checkpoint_fn=c.Block, exclude_fn=c.Mlp)
    assert earlier_warnings(record) == []
    assert wrapped(fw, model) == ["layers.0", "layers.0.mlp", "layers.1", "layers.1.mlp"]
    calls.update(attn=0, mlp=0)
    _, got = fw.grads(model, x)
    assert_same(expected, got)
    assert calls == {"attn": 4, "mlp": 2}


def test_nested_exclusions_are_named_by_their_paths(fw):
    c = decoder_classes(fw)
    model = decoder(fw, classes=c)
    fw.api.checkpoint_exclude_wrapper(model.layers[0].mlp)
    fw.api.checkpoint_exclude_wrapper(model.layers[0])
    fw.api.checkpoint_wrapper(model)
    # A copy of the wrapped model names them the same way.
    for each in (model, copy.deepcopy(model)):
        with pytest.raises(recomp.NestedExclusionError) as info:
            fw.grads(each, fw.tensor(2, 4))
        message = str(info.value)
        assert (
            "Excluded region 'layers.0.mlp' (Mlp) was called inside excluded region 'layers.0' "
            "(Block), both in the checkpointed Net." in message
        )
        assert "remove the inner checkpoint_exclude_wrapper (around 'layers.0.mlp' (Mlp))" in message


def test_nested_exclusions_in_a_function_are_named_by_the_path_inside_the_outer_one(fw):
    c = decoder_classes(fw)
    block = c.Block(attn=c.Attention(proj=fw.dense(8, 8)), mlp=c.Mlp(up=fw.dense(8, 16), down=fw.dense(16, 8)))
    fw.api.checkpoint_exclude_wrapper(block.mlp, name="ffn")
    fw.api.checkpoint_exclude_wrapper(block)

    def run(x):
        return fw.api.checkpoint(lambda t: block(t), x)

    with pytest.raises(recomp.NestedExclusionError) as info:
        fw.grads(run, fw.tensor(2, 8), params=[])
    assert (
        "Excluded region 'ffn' (Mlp) was called inside excluded region 'Block', as its "
        "sub-module 'mlp'." in str(info.value)
    )
