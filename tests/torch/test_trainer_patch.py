"""The core that recomp's trainer integrations (``recomp.torch.deepspeed``, Megatron-Core)
share, without any trainer: which modules ``Exclusions`` matches and wraps, which modules
``modules_reached`` finds behind the function a trainer checkpoints, and what
``replace_attributes`` replaces and puts back, on a throwaway module object."""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
from torch import nn

import recomp.torch as rt
from recomp.errors import RecompError
from recomp.torch._trainer_patch import Exclusions, modules_reached, replace_attributes

API = "recomp.torch.trainer.install"


# --------------------------------------------------------------------------- Exclusions


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


class FlashAttention(Attention):
    pass


class Router(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize(
    ("entry", "path", "module", "matched"),
    [
        (Attention, "layers.0.attn", Attention(), True),
        (Attention, "layers.0.attn", FlashAttention(), True),  # isinstance
        (Attention, "layers.0.attn", Router(), False),
        ((nn.Linear, Router), "x", Router(), True),
        ("self_attention", "self_attention", Router(), True),
        ("self_attention", "layers.3.self_attention", Router(), True),
        ("self_attention", "layers.3.cross_self_attention", Router(), False),
        ("self_attention", "layers.3.self_attention.proj", Router(), False),
        ("mlp.router", "decoder.layers.1.mlp.router", Router(), True),
        ("mlp.router", "decoder.layers.1.mlp.router2", Router(), False),
        ("mlp.router", "decoder.layers.1.xmlp.router", Router(), False),
        ("layers.*.mlp", "decoder.layers.7.mlp", Router(), True),
        ("layers.*.mlp", "layers.7.mlp.up", Router(), False),
        ("*router", "mlp.moe_router", Router(), True),
        (lambda m: isinstance(m, Router), "anything", Router(), True),
        (lambda m: isinstance(m, Router), "anything", Attention(), False),
    ],
)
def test_exclusions_match(entry, path, module, matched):
    assert Exclusions(entry, API).matches(path, module) is matched


def test_exclusions_sort_their_entries_and_an_empty_one_is_false():
    def predicate(module):
        return False

    exclusions = Exclusions([Attention, "mlp", predicate], API)
    assert exclusions.classes == (Attention,)
    assert exclusions.patterns == ("mlp",)
    assert exclusions.predicates == (predicate,)
    assert exclusions
    assert not Exclusions((), API)


@pytest.mark.parametrize(
    ("exclude", "shown"),
    [
        (3, "int (3)"),
        ([Attention, 2.5], "float (2.5)"),
        (None, "NoneType (None)"),
        ([b"mlp"], "bytes"),
    ],
)
def test_bad_exclusions_name_the_argument(exclude, shown):
    with pytest.raises(TypeError, match=rf"{API}: exclude must be a module class, a module path") as info:
        Exclusions(exclude, API)
    assert shown in str(info.value)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(4, 4), Router())

    def forward(self, x):
        return self.mlp(self.attn(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def excluded_paths(root):
    return sorted(path for path, m in root.named_modules() if isinstance(m, rt.ExcludeWrapper))


def test_apply_within_wraps_matches_below_each_root_once():
    model = Model()
    exclusions = Exclusions(["attn", "mlp.1"], API)
    exclusions.apply_within(model.layers[0].forward)
    assert excluded_paths(model) == ["layers.0.attn", "layers.0.mlp.1"]
    assert model.layers[0].attn.region.name == "attn"  # the path below the root
    exclusions.apply_within(model.layers[0].forward)  # seen: nothing changes
    exclusions.apply_within(model.forward)  # the whole model: the other layer too
    assert excluded_paths(model) == [
        "layers.0.attn",
        "layers.0.mlp.1",
        "layers.1.attn",
        "layers.1.mlp.1",
    ]


def test_apply_within_skips_what_is_below_a_match_or_wrapped_already():
    model = Model()
    rt.checkpoint_exclude_wrapper(model.layers[1].attn, name="mine")
    exclusions = Exclusions([Attention, nn.Linear], API)
    exclusions.apply_within(model)
    # Inside a matched attention its Linear stays as it is; the user's region is kept.
    assert excluded_paths(model) == [
        "layers.0.attn",
        "layers.0.mlp.0",
        "layers.1.attn",
        "layers.1.mlp.0",
    ]
    assert model.layers[1].attn.region.name == "mine"
    assert not isinstance(model.layers[0].attn.proj, rt.ExcludeWrapper)


def test_apply_within_never_wraps_the_root_and_empty_exclusions_do_nothing():
    attention = Attention()
    Exclusions(Attention, API).apply_within(attention)
    assert not isinstance(attention, rt.ExcludeWrapper)
    model = Model()
    Exclusions((), API).apply_within(model)
    assert excluded_paths(model) == []


def test_a_wrapped_module_is_excluded_inside_a_recomp_checkpoint():
    model = Model()
    Exclusions(Attention, API).apply_within(model)
    x = torch.randn(2, 4, requires_grad=True)
    rt.checkpoint(model, x).sum().backward()
    assert model.layers[0].attn.region_runs == 1
    assert model.layers[0].attn.region_skips == 1


# --------------------------------------------------------------------------- modules_reached


def reached(function):
    return {id(m) for m in modules_reached(function)}


def test_modules_reached_by_a_module_and_a_bound_method():
    model = Model()
    assert reached(model) == {id(model)}
    assert reached(model.forward) == {id(model)}
    assert reached(model.layers[1].forward) == {id(model.layers[1])}


def test_modules_reached_through_partials():
    a, b = Attention(), Router()

    def run(first, x, *, second):
        return second(first(x))

    assert reached(functools.partial(run, a, second=b)) == {id(a), id(b)}
    assert reached(functools.partial(a.forward)) == {id(a)}
    assert reached(functools.partial(functools.partial(run, a), second=b)) == {id(a), id(b)}


def test_modules_reached_through_closures():
    model = Model()

    def custom(start, end):  # Megatron's way: a closure over the model, built per call
        def custom_forward(x):
            for layer in model.layers[start:end]:
                x = layer(x)
            return x

        return custom_forward

    assert reached(custom(0, 1)) == {id(model)}


def test_modules_reached_through_one_nested_closure_and_no_deeper():
    attention = Attention()

    def helper(x):
        return attention(x)

    def outer(x):
        return helper(x)

    assert reached(outer) == {id(attention)}  # closure -> closure -> module

    def deepest(x):
        return outer(x)

    assert reached(deepest) == set()  # a third level is not followed


def test_modules_reached_tolerates_empty_cells_recursion_and_other_values():
    router = Router()

    def recursive(x, n=1):
        return recursive(router(x), n - 1) if n else x

    assert reached(recursive) == {id(router)}

    def early(x):
        return later(x)  # bound below, after the closure is made

    assert reached(early) == set()
    later = router
    assert reached(lambda x: x) == set()
    assert reached(len) == set()


# --------------------------------------------------------------------------- replace_attributes


@pytest.fixture
def trainer():
    """A throwaway module standing for a trainer's checkpointing module."""
    name = "recomp_test_throwaway_trainer"
    module = types.ModuleType(name)

    def checkpoint(function, *args):
        return ("trainer", function(*args))

    def non_reentrant_checkpoint(function, *args):
        return ("trainer-nr", function(*args))

    module.checkpoint = checkpoint
    module.non_reentrant_checkpoint = non_reentrant_checkpoint
    sys.modules[name] = module
    yield module
    del sys.modules[name]


def ours(function, *args):
    return ("recomp", function(*args))


TARGETS = [
    ("recomp_test_throwaway_trainer", "checkpoint"),
    ("recomp_test_throwaway_trainer", "non_reentrant_checkpoint"),
    ("recomp_test_throwaway_trainer", "absent_in_this_version"),
]


def test_replace_attributes_and_remove(trainer):
    originals = (trainer.checkpoint, trainer.non_reentrant_checkpoint)
    installation = replace_attributes("throwaway", TARGETS, ours)
    try:
        assert trainer.checkpoint is ours and trainer.non_reentrant_checkpoint is ours
        assert not hasattr(trainer, "absent_in_this_version")  # skipped, not created
        assert trainer.checkpoint(lambda: 1) == ("recomp", 1)
        assert installation.installed
        assert repr(installation) == "<recomp.torch.throwaway installation, installed>"
    finally:
        installation.remove()
    assert (trainer.checkpoint, trainer.non_reentrant_checkpoint) == originals
    assert not installation.installed
    assert repr(installation) == "<recomp.torch.throwaway installation, removed>"
    installation.remove()  # a second remove is a no-op
    assert (trainer.checkpoint, trainer.non_reentrant_checkpoint) == originals


def test_a_second_install_is_refused_until_remove(trainer):
    with replace_attributes("throwaway", TARGETS, ours):
        with pytest.raises(RecompError, match=r"throwaway\.install\(\) is in effect already"):
            replace_attributes("throwaway", TARGETS, lambda f, *a: None)
        assert trainer.checkpoint is ours  # the refused one changed nothing
    assert trainer.checkpoint is not ours
    with replace_attributes("throwaway", TARGETS, ours):  # installable again
        assert trainer.checkpoint is ours


def test_another_name_installs_independently(trainer):
    with replace_attributes("throwaway", TARGETS[:1], ours):
        with replace_attributes("throwaway-two", TARGETS[1:2], ours):
            assert trainer.non_reentrant_checkpoint is ours
        assert trainer.checkpoint is ours


def test_remove_leaves_an_attribute_someone_else_replaced_since(trainer):
    installation = replace_attributes("throwaway", TARGETS, ours)

    def theirs(function, *args):
        return None

    trainer.checkpoint = theirs
    installation.remove()
    assert trainer.checkpoint is theirs
    assert trainer.non_reentrant_checkpoint is not ours


def test_missing_targets_are_an_error_naming_them(trainer):
    missing = [("recomp_test_throwaway_trainer", "gone"), ("recomp_test_throwaway_trainer", "x")]
    with pytest.raises(RecompError, match=r"none of recomp_test_throwaway_trainer\.gone, "):
        replace_attributes("throwaway", missing, ours)
    with replace_attributes("throwaway", TARGETS, ours):  # the failure left nothing behind
        pass
    with pytest.raises(ModuleNotFoundError):
        replace_attributes("throwaway", [("recomp_test_no_such_module", "checkpoint")], ours)


def test_installation_replace_puts_back_what_it_set(trainer):
    def with_default(function=trainer.checkpoint):
        return function

    before = with_default.__defaults__
    with replace_attributes("throwaway", TARGETS, ours) as installation:
        installation.replace(with_default, "__defaults__", (ours,))
        assert with_default() is ours
    assert with_default.__defaults__ is before
    with pytest.raises(RecompError, match="was removed"):
        installation.replace(with_default, "__defaults__", (ours,))


def test_remove_unwraps_what_the_exclusions_wrapped_and_leaves_the_users_regions(trainer):
    model = Model()
    rt.checkpoint_exclude_wrapper(model.layers[1].attn, name="mine")
    exclusions = Exclusions([Attention], API)
    installation = replace_attributes("throwaway", TARGETS, ours, exclusions=exclusions)
    exclusions.apply_within(model)
    assert excluded_paths(model) == ["layers.0.attn", "layers.1.attn"]
    names = [name for name, _ in model.named_parameters()]
    installation.remove()
    # The user's own region stays; the one the exclusions made is a plain module again.
    assert excluded_paths(model) == ["layers.1.attn"]
    assert type(model.layers[0].attn) is Attention
    assert [name for name, _ in model.named_parameters()] == names
    # Installed again, the same exclusions wrap the module again (it is looked at anew).
    with replace_attributes("throwaway", TARGETS, ours, exclusions=exclusions):
        exclusions.apply_within(model)
        assert excluded_paths(model) == ["layers.0.attn", "layers.1.attn"]
    assert excluded_paths(model) == ["layers.1.attn"]
