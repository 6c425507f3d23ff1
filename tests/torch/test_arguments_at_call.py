"""A replay sees a checkpoint's list and dict arguments as they were when the call started
(NOTE [ Arguments a replay sees ] in ``recomp._engine``).

The framework's checkpoint keeps such an argument as the object itself: a caller that
appends to a list of hidden states after each layer would make a replay read a later
layer's output (gradients wrong without an error where the shapes agree), and a block that
appends to a list it is given would append again during backward.
"""

from __future__ import annotations

import copy
import re

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import recomp  # noqa: E402
import recomp.torch as rt  # noqa: E402


class Reader(nn.Module):
    """A layer that reads the latest entry of the history it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, history: list[torch.Tensor]) -> torch.Tensor:
        return torch.tanh(history[-1] * self.scale)


class History(nn.Module):
    """Each layer gets the list of all hidden states so far; the list grows after it."""

    def __init__(self, layers: int = 3, how: str = "none") -> None:
        super().__init__()
        self.layers = nn.ModuleList(Reader() for _ in range(layers))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        history = [x]
        for layer in self.layers:
            if self.how == "checkpoint":
                out = rt.checkpoint(layer, history)
            elif self.how == "tuple":  # the list inside a tuple, passed by keyword
                out = rt.checkpoint(lambda held, layer=layer: layer(held[0]), held=(history,))
            else:
                out = layer(history)
            history.append(out)
        return history[-1]


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def assert_equal(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert torch.equal(e, g), f"gradient {i}: max diff {(e - g).abs().max()}"


@pytest.mark.parametrize("how", ["wrapper", "checkpoint", "tuple"])
def test_a_list_appended_to_after_the_call_is_read_as_it_was(how: str) -> None:
    torch.manual_seed(0)
    reference = History()
    x = torch.randn(2, 4, requires_grad=True)
    expected = grads(reference, x)
    model = copy.deepcopy(reference)
    if how == "wrapper":
        rt.apply_activation_checkpointing(model, checkpoint_fn=Reader)
    else:
        model.how = how
    # Every replay would read the last output (same shape): wrong without an error.
    assert_equal(expected, grads(model, x))


class Appender(nn.Module):
    """A block that appends an auxiliary loss to the list it is given (MoE routers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        h = self.linear(x)
        aux.append(h.pow(2).mean())  # before the last op a replay must run
        return torch.tanh(h)


def test_what_the_forward_appends_to_an_argument_is_appended_once() -> None:
    torch.manual_seed(0)
    reference = nn.ModuleList(Appender() for _ in range(2))
    model = copy.deepcopy(reference)
    rt.apply_activation_checkpointing(model, checkpoint_fn=Appender)
    x = torch.randn(2, 4)

    def step(blocks: nn.ModuleList) -> list[torch.Tensor]:
        aux: list[torch.Tensor] = []
        h = x
        for block in blocks:
            h = block(h, aux)
        (h.sum() + sum(aux)).backward(retain_graph=True)
        (h.sum() * 2).backward()  # a second pass over the graph: a second replay
        return aux

    expected_aux, aux = step(reference), step(model)
    assert len(aux) == len(expected_aux) == 2  # not once more per replay
    assert all(torch.equal(a, b) for a, b in zip(expected_aux, aux))
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, options: dict[str, object]) -> torch.Tensor:
        seen.append(options["config"])
        return self.linear(x) * options["scale"]


seen: list[object] = []


def test_a_dict_changed_after_the_call_is_read_as_it_was_and_other_objects_stay() -> None:
    torch.manual_seed(0)
    layer = Scaled()
    x = torch.randn(2, 4, requires_grad=True)
    scale = torch.randn(4, requires_grad=True)
    config = object()
    seen.clear()
    options = {"scale": scale, "config": config}
    out = rt.checkpoint(layer, x, options)
    options["scale"] = torch.zeros(4)  # the caller reuses its dict
    out.sum().backward()
    expected = torch.autograd.grad(
        (layer.linear(x) * scale).sum(), [x, scale, layer.linear.weight]
    )
    assert torch.equal(x.grad, expected[0]) and torch.equal(scale.grad, expected[1])
    assert torch.equal(layer.linear.weight.grad, expected[2])
    # The replay got the objects the dict held, not copies of them.
    assert seen == [config, config]


def test_densenet_layers_checkpointed_one_by_one() -> None:
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.densenet import _DenseLayer

    torch.manual_seed(0)
    reference = torchvision.models.DenseNet(
        growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=3
    )
    model = copy.deepcopy(reference)
    # Each _DenseBlock hands its layers the list of the features so far, and appends the
    # layer's output to it after the call: a replay concatenated one more feature map.
    rt.apply_activation_checkpointing(model, checkpoint_fn=_DenseLayer)
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    for _ in range(2):
        assert_equal(grads(reference, x), grads(model, x))
    for (name, a), (_, b) in zip(reference.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), name


def test_nested_checkpoints_re_run_in_an_enclosing_replay_read_their_lists_as_they_were() -> None:
    torch.manual_seed(0)
    reference = History()
    x = torch.randn(2, 4, requires_grad=True)
    expected = grads(reference, x)
    model = copy.deepcopy(reference)
    model.how = "checkpoint"  # each layer a checkpoint, inside one around the whole net
    outer = nn.Module()
    outer.forward = lambda t: rt.checkpoint(model, t)  # type: ignore[method-assign]
    model.zero_grad(set_to_none=True)
    x.grad = None
    outer(x).pow(2).sum().backward()
    assert_equal(expected, [p.grad for p in model.parameters()] + [x.grad])


# --------------------------------------------------------------------------- tensors written before the replay


def scaled_tanh(x: torch.Tensor, *, bias: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * bias * weight)


@pytest.mark.parametrize("where", ["keyword", "list", "tuple", "dict"])
def test_a_tensor_argument_written_before_the_replay_is_refused_naming_it(where: str) -> None:
    weight = torch.randn(4, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    bias = torch.randn(4)  # a buffer the caller reuses
    if where == "keyword":
        out, name = rt.checkpoint(scaled_tanh, x, bias=bias, weight=weight), "bias"
    elif where == "list":
        out = rt.checkpoint(lambda t, held: scaled_tanh(t, bias=held[1], weight=weight), x, [x, bias])
        name = "argument 1[1]"
    elif where == "tuple":
        out = rt.checkpoint(lambda t, held: scaled_tanh(t, bias=held[0], weight=weight), x, (bias,))
        name = "argument 1[0]"
    else:
        out = rt.checkpoint(lambda t, held: scaled_tanh(t, bias=held["b"], weight=weight), x, {"b": bias})
        name = "argument 1['b']"
    bias.mul_(3)  # before the backward: the replay would read the new values
    with pytest.raises(recomp.ParameterChangedError, match=re.escape(repr(name))):
        out.sum().backward()


def test_a_tensor_argument_written_by_the_forward_itself_or_after_the_backward_is_fine() -> None:
    weight = torch.randn(4, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    counter = torch.zeros(1)

    def counting(t: torch.Tensor, *, seen: torch.Tensor) -> torch.Tensor:
        if not recomp.is_recomputing():
            seen.add_(1)  # the forward's own write: the replay reads what the forward left
        return torch.tanh(t * weight)

    out = rt.checkpoint(counting, x, seen=counter)
    out.sum().backward()
    expected = torch.autograd.grad(torch.tanh(x * weight).sum(), weight)[0]
    assert torch.equal(weight.grad, expected) and counter.item() == 1
    counter.add_(1)  # after the backward: nothing reads it any more
