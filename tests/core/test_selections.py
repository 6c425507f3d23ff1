"""What ``apply_activation_checkpointing`` is asked to select, on both frameworks (the
``fw`` fixture, ``tests/support/frameworks.py``).

Selections that take no effect warn (``IneffectiveSelectionWarning``) naming what
and why; a class or a tuple of classes selects by ``isinstance``; other values are
refused before anything is wrapped. The model is a small decoder: an embedding, blocks
of attention and MLP, a head.
"""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("kwargs", "argument", "hint"),
    [
        (lambda c: {"checkpoint_fn": "Block"}, "checkpoint_fn", "pass the class itself"),
        (
            lambda c: {"checkpoint_fn": [c.Block]},
            "checkpoint_fn",
            "as a tuple: checkpoint_fn=(Block,)",
        ),
        (lambda c: {"checkpoint_fn": None}, "checkpoint_fn", "got NoneType"),
        (
            lambda c: {"checkpoint_fn": c.Block, "exclude_fn": "Attention"},
            "exclude_fn",
            "type(m).__name__",
        ),
        (
            lambda c: {"checkpoint_fn": c.Block, "exclude_fn": ["Attention"]},
            "exclude_fn",
            "got list",
        ),
        (
            lambda c: {"checkpoint_fn": c.Block, "exclude_fn": c.Attention, "copy_output_fn": 1},
            "copy_output_fn",
            "int",
        ),
    ],
    ids=["string", "list of classes", "None", "exclude string", "exclude list", "copy_output int"],
)
def test_a_selection_that_is_no_predicate_raises_and_changes_nothing(fw, kwargs, argument, hint):
    c = decoder_classes(fw)
    model = decoder(fw, classes=c)
    with pytest.raises(
        TypeError,
        match=rf"apply_activation_checkpointing: {argument} must be a class, a tuple of classes or a",
    ) as info:
        fw.api.apply_activation_checkpointing(model, **kwargs(c))
    assert hint in str(info.value)
    assert wrapped(fw, model) == []
