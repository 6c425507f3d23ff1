"""``determinism_check="values"`` (and ``debug=True``): a replay that saves other values
than its forward raises ``ReplayMismatchError``; a replay that is right never does."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import recomp
import recomp.errors
import recomp.torch as rt
from recomp.torch import _value_check


class ScaledSin(nn.Module):
    """Reads a Python float from module state: the same ops and shapes with other values
    when ``k`` changes between forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.k = 1.0
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.lin(x) * self.k)


def _changed_between(options: dict, **wrap) -> tuple[ScaledSin, torch.Tensor]:
    torch.manual_seed(0)
    model = ScaledSin()
    x = torch.randn(4, 8, requires_grad=True)
    if wrap:
        rt.checkpoint_wrapper(model, **wrap)
        out = model(x)
    else:
        out = rt.checkpoint(model, x, **options)
    model.k = 2.0
    out.sum().backward()
    return model, x


@pytest.mark.parametrize(
    "options", [{"determinism_check": "values"}, {"debug": True}], ids=["values", "debug"]
)
def test_a_value_changed_between_forward_and_backward_is_named(options: dict) -> None:
    with pytest.raises(recomp.ReplayMismatchError) as info:
        _changed_between(options)
    message = str(info.value)
    assert "ScaledSin" in message
    assert re.search(r"saved tensor \d+ of the checkpoint", message)
    assert "computed by mul (MulBackward0)" in message
    assert "torch.sin(self.lin(x) * self.k)" in message  # the line that saved it
    assert re.search(r"max abs difference at least [0-9.e+-]+", message)
    assert "changed between forward and backward" in message
    assert "excluded region" in message  # one of the fixes
    if options.get("debug"):  # the op log points at the scalar that changed
        assert "aten.mul.Tensor(float32[4, 8], 1.0)" in message
        assert "aten.mul.Tensor(float32[4, 8], 2.0)" in message
        assert "first whose arguments differ" in message


def test_it_is_a_recomp_error() -> None:
    with pytest.raises(recomp.RecompError):
        _changed_between({"determinism_check": "values"})


@pytest.mark.replay_differs
def test_without_the_check_the_gradient_is_silently_wrong() -> None:
    """What the check is for: the default check (PyTorch's) compares metadata only."""
    _, x_changed = _changed_between({})
    torch.manual_seed(0)
    model = ScaledSin()
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    assert not torch.allclose(x.grad, x_changed.grad)


def test_none_turns_the_value_check_off_under_debug() -> None:
    _changed_between({"debug": True, "determinism_check": "none"})  # does not raise


@pytest.mark.parametrize("via", ["checkpoint_wrapper", "apply_activation_checkpointing"])
def test_the_wrappers_take_the_option(via: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ScaledSin(), ScaledSin())
    if via == "checkpoint_wrapper":
        rt.checkpoint_wrapper(model[1], determinism_check="values")
    else:
        rt.apply_activation_checkpointing(
            model, checkpoint_fn=ScaledSin, determinism_check="values"
        )
    out = model(torch.randn(4, 8, requires_grad=True))
    model[1].k = 3.0
    with pytest.raises(recomp.ReplayMismatchError, match=r"ScaledSin\.forward"):
        out.sum().backward()


def test_a_buffer_changed_in_place_between_forward_and_backward() -> None:
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("shift", torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + self.shift).tanh()

    model = Shifted()
    out = rt.checkpoint(model, torch.randn(4, 8, requires_grad=True), determinism_check="values")
    with torch.no_grad():
        model.shift.mul_(2)
    # The version counter tells first, and names the buffer.
    with pytest.raises(recomp.errors.ParameterChangedError, match=r"[Bb]uffer 'shift'"):
        out.sum().backward()
    # A write through ``.data`` leaves no trace in the version counter (autograd does not
    # see it either): the values check still catches it.
    out = rt.checkpoint(model, torch.randn(4, 8, requires_grad=True), determinism_check="values")
    model.shift.data.mul_(2)
    with pytest.raises(recomp.ReplayMismatchError, match=r"computed by tanh"):
        out.sum().backward()


def test_state_read_inside_an_excluded_region_is_read_once() -> None:
    """The fix the message names: the region runs once, so its output is the forward's."""
    torch.manual_seed(0)
    inner = ScaledSin()
    model = nn.Sequential(nn.Linear(8, 8), rt.checkpoint_exclude_wrapper(inner), nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), x)[0]
    out = rt.checkpoint(model, x, determinism_check="values")
    inner.k = 2.0
    (got,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------- no false alarms


class Block(nn.Module):
    """Attention-like excluded region, dropout, a GELU MLP, a LayerNorm."""

    def __init__(self, exclude: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = nn.Linear(8, 8)
        if exclude:
            rt.checkpoint_exclude_wrapper(self.attn, name="attn")
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm(x)).softmax(-1)
        return h + self.mlp(h)


def _grads(model: nn.Module, x: torch.Tensor, run) -> list[torch.Tensor]:
    torch.manual_seed(1)
    out = run(model, x)
    params = [x, *model.parameters()]
    return list(torch.autograd.grad(out.sum(), params))


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("exclude", [True, False])
def test_a_right_replay_passes_bit_for_bit(early_stop: bool, exclude: bool) -> None:
    torch.manual_seed(0)
    model = Block(exclude)
    x = torch.randn(3, 8, requires_grad=True)
    expected = _grads(model, x, lambda m, t: m(t))
    got = _grads(
        model,
        x,
        lambda m, t: rt.checkpoint(m, t, determinism_check="values", early_stop=early_stop),
    )
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_several_backward_passes_and_kept_replays() -> None:
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(3, 8, requires_grad=True)
    out = rt.checkpoint(model, x, determinism_check="values").sum()
    (first,) = torch.autograd.grad(out, x, retain_graph=True)
    (second,) = torch.autograd.grad(out, x, retain_graph=True)
    weights = torch.autograd.grad(out, list(model.parameters()))
    assert torch.equal(first, second) and len(weights) == len(list(model.parameters()))


def test_a_replay_run_ahead_of_backward() -> None:
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(3, 8, requires_grad=True)
    with rt.recompute_handle_collector_ctx() as handles:
        out = rt.checkpoint(model, x, determinism_check="values")
    rt.recompute_handle(handles[0], "step")
    out.sum().backward()
    rt.clear_recompute_session("step")
    assert x.grad is not None


def test_nested_checkpoints() -> None:
    torch.manual_seed(0)
    inner = Block()
    outer = nn.Sequential(nn.Linear(8, 8), inner, nn.Tanh())
    x = torch.randn(3, 8, requires_grad=True)
    expected = _grads(outer, x, lambda m, t: m(t))

    def run(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        def body(u: torch.Tensor) -> torch.Tensor:
            h = m[0](u)
            h = rt.checkpoint(m[1], h, determinism_check="values")
            return m[2](h)

        return rt.checkpoint(body, t, determinism_check="values")

    got = _grads(outer, x, run)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_selective_checkpointing_context_fn() -> None:
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(3, 8, requires_grad=True)
    expected = _grads(model, x, lambda m, t: m(t))

    def policy(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        from torch.utils.checkpoint import CheckpointPolicy

        if op is torch.ops.aten.addmm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def run(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return rt.checkpoint(
            m,
            t,
            determinism_check="values",
            context_fn=lambda: create_selective_checkpoint_contexts(policy),
        )

    got = _grads(model, x, run)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_nan_int_bool_complex_empty_and_strided_saved_tensors() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor([2, 0, 1])
        picked = x[:, idx]  # saves integer indices
        mask = picked > 0  # a bool, used by where
        z = torch.where(mask, picked, picked * float("nan"))
        c = torch.view_as_complex(torch.stack((x, x.t()), -1)).abs()  # complex saved
        empty = x[:, :0].exp()
        return z.nan_to_num().sum() + c.sum() + x.t().sin().sum() + empty.sum()

    x = torch.randn(3, 3, requires_grad=True)
    out = rt.checkpoint(fn, x, determinism_check="values")
    out.backward()
    expected = torch.autograd.grad(fn(x), x)[0]
    assert expected.isnan().any()  # NaN saved and compared equal to itself
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------- other devices


def test_devices_that_would_synchronise_compare_at_the_end_of_the_replay(monkeypatch) -> None:
    """On an accelerator the replay's fingerprints are compared together when it ends
    (one synchronisation), within a tolerance unless deterministic algorithms are on:
    the same logic, run here on CPU."""
    monkeypatch.setattr(_value_check, "_SYNC_FREE", frozenset())
    monkeypatch.setattr(_value_check, "_BIT_EXACT", frozenset())
    with pytest.raises(recomp.ReplayMismatchError, match=r"computed by mul") as info:
        _changed_between({"determinism_check": "values"})
    assert "saved at" not in str(info.value)  # no line: compared after the replay ran

    torch.manual_seed(0)
    model = ScaledSin()
    x = torch.randn(4, 8, requires_grad=True)
    out = rt.checkpoint(model, x, determinism_check="values")
    model.k = 1.0 + 1e-7  # within the tolerance where kernels may vary
    out.sum().backward()
    torch.use_deterministic_algorithms(True)
    try:
        out = rt.checkpoint(model, x, determinism_check="values")
        model.k = 1.0 + 1e-6  # deterministic kernels: exact again
        with pytest.raises(recomp.ReplayMismatchError):
            out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)


def test_fingerprint_changes_with_the_values_and_not_otherwise() -> None:
    a = torch.randn(5, 7)
    assert torch.equal(_value_check._fingerprint(a), _value_check._fingerprint(a.clone()))
    b = a.clone()
    b[2, 3] += 1
    assert not torch.equal(_value_check._fingerprint(a), _value_check._fingerprint(b))
    flipped = a.flip(0).flip(1)  # same values, other order: the sampled elements see it
    assert not torch.equal(_value_check._fingerprint(a), _value_check._fingerprint(flipped))
    assert _value_check._fingerprint(torch.empty(0, 3)).shape == (4,)
    assert _value_check._fingerprint(torch.randn(2, 2, device="meta")) is None


def test_a_replay_whose_random_stream_shifted_is_caught() -> None:
    """The control of the RNG-alignment guarantee (tests/core/test_guarantees.py): with
    alignment off, the skipped region's dropout no longer advances the replay's random
    stream, so the dropout after it draws another mask: same ops, other values."""
    from recomp import _testing

    torch.manual_seed(0)
    region = rt.checkpoint_exclude_wrapper(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)))
    model = nn.Sequential(region, nn.Dropout(0.5), nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    with _testing.without_rng_alignment():
        out = rt.checkpoint(model, x, determinism_check="values")
    with pytest.raises(recomp.ReplayMismatchError, match="saved a different value"):
        out.sum().backward()
    out = rt.checkpoint(model, x, determinism_check="values")  # aligned: right
    out.sum().backward()


def test_under_torch_compile_the_option_is_taken_out_and_nothing_is_made() -> None:
    """Dynamo traces recomp's checkpoint: the option must reach PyTorch as "default"
    and build nothing Dynamo cannot trace."""
    kwargs = {"determinism_check": "values"}
    assert _value_check.value_check_option(kwargs, debug=True, compiled=True) is None
    assert kwargs == {"determinism_check": "default"}
