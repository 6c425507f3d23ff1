"""``recomp.torch.hyperparallel`` behaves as HyperParallel's
``hyper_parallel.core.activation_memory.api`` where that defines a behaviour: the
checkpoint's ``early_stop`` (a bool, True unless given), ``use_reentrant`` not followed in
eager mode, the options refused under ``torch.compile``, ``group_swap`` alone adding no
selective checkpointing, ``recompute_session_ctx(None)`` refused, and a no-op
``context_fn`` that is one however it is passed."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import recomp.torch as rt  # noqa: E402
from recomp.torch.hyperparallel import (  # noqa: E402
    CheckpointPolicy,
    checkpoint,
    checkpoint_wrapper,
    noop_context_fn,
    recompute_session_ctx,
)

ADD = torch.ops.aten.add.Tensor
CLONE = torch.ops.aten.clone.default


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[object, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def block(x: torch.Tensor) -> torch.Tensor:
    # cos saves its input, the last tensor saved; the clone after it saves nothing (and
    # its backward runs no clone), so a replay that stops early never runs it.
    return torch.cos(torch.sin(x)).clone()


def grad_of(run, x: torch.Tensor) -> tuple[torch.Tensor, OpCounter]:  # type: ignore[no-untyped-def]
    x = x.detach().requires_grad_(True)
    out = run(x)
    counter = OpCounter()
    with counter:
        out.sum().backward()
    return x.grad, counter  # type: ignore[return-value]


X = torch.randn(4, 8)
WANT, _ = grad_of(block, X)


def test_early_stop_is_on_unless_given_and_passed_every_call():
    got, counter = grad_of(lambda x: checkpoint(block, x), X)
    assert torch.equal(got, WANT)
    assert counter.counts.get(CLONE, 0) == 0  # the replay stopped before the clone
    got, counter = grad_of(lambda x: checkpoint(block, x, early_stop=False), X)
    assert torch.equal(got, WANT)
    assert counter.counts.get(CLONE, 0) == 1  # the whole block replayed


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_early_stop_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="early_stop must be a bool"):
        checkpoint(block, X.requires_grad_(True), early_stop=bad)
    with pytest.raises(ValueError, match="early_stop must be a bool"):
        checkpoint_wrapper(nn.Linear(2, 2), early_stop=bad)


def test_use_reentrant_true_is_not_followed_in_eager_mode():
    got, _ = grad_of(lambda x: checkpoint(block, x, use_reentrant=True), X)
    assert torch.equal(got, WANT)
    layer = checkpoint_wrapper(nn.Linear(8, 8), use_reentrant=True)
    assert "use_reentrant" not in layer.checkpoint_kwargs
    assert layer.checkpoint_kwargs["early_stop"] is True
    layer(X.requires_grad_(True)).sum().backward()
    # recomp.torch's own checkpoint refuses it instead.
    with pytest.raises(ValueError, match="non-reentrant"):
        rt.checkpoint(block, X, use_reentrant=True)


def test_the_wrapper_checkpoints_with_hyperparallel_s_options():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    wrapped = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    wrapped.load_state_dict(plain.state_dict())

    def keep_mm(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        save = op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    checkpoint_wrapper(wrapped, policy_fn=keep_mm)
    assert isinstance(wrapped, rt.CheckpointWrapper)
    x = torch.randn(3, 8)
    plain(x).pow(2).sum().backward()
    wrapped(x).pow(2).sum().backward()
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(a.grad, b.grad)
    rt.unwrap(wrapped)
    assert not isinstance(wrapped, rt.CheckpointWrapper)


def test_group_swap_without_a_policy_adds_no_selective_checkpointing(monkeypatch):
    import recomp.torch._swap.checkpoint as swap  # where checkpoint() makes its contexts

    made = []
    real = swap.create_selective_checkpoint_contexts
    monkeypatch.setattr(swap, "create_selective_checkpoint_contexts",
                        lambda *a, **k: made.append(a) or real(*a, **k))
    got, _ = grad_of(lambda x: checkpoint(block, x, group_swap=True), X)
    assert torch.equal(got, WANT)
    assert made == []
    got, _ = grad_of(lambda x: checkpoint(block, x, group_swap=True, policy_fn=[ADD]), X)
    assert torch.equal(got, WANT)
    assert len(made) == 1  # with a policy: one selective checkpoint per call


def test_recompute_session_refuses_none():
    with pytest.raises(ValueError, match="session_id must not be None"), recompute_session_ctx(None):
        pass


# --------------------------------------------------------------------------- noop_context_fn


class Recorder:
    """A ``context_fn`` of the user's, recording when its contexts are entered."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def __call__(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:  # type: ignore[type-arg]
        @contextlib.contextmanager
        def phase(name: str):  # type: ignore[no-untyped-def]
            self.log.append(name)
            yield

        return phase("forward"), phase("replay")


@pytest.mark.parametrize("given", ["call", "function"])
@pytest.mark.parametrize("api", ["hyperparallel", "recomp"])
def test_noop_context_fn_passed_as_context_fn(api, given):
    run = checkpoint if api == "hyperparallel" else rt.checkpoint
    context_fn = noop_context_fn() if given == "call" else noop_context_fn
    got, _ = grad_of(lambda x: run(block, x, context_fn=context_fn), X)
    assert torch.equal(got, WANT)
    layer = nn.Linear(8, 8)
    reference = nn.Linear(8, 8)
    reference.load_state_dict(layer.state_dict())
    wrap = checkpoint_wrapper if api == "hyperparallel" else rt.checkpoint_wrapper
    wrap(layer, context_fn=context_fn)
    x = torch.randn(2, 8)
    layer(x).sum().backward()
    reference(x).sum().backward()
    assert torch.equal(layer.weight.grad, reference.weight.grad)


def test_noop_context_fn_gives_two_null_contexts_either_way():
    for fn in (noop_context_fn(), noop_context_fn):
        forward, replay = fn()
        for ctx in (forward, replay):
            with ctx as entered:
                assert entered is None
    assert noop_context_fn()() == noop_context_fn()
    assert repr(noop_context_fn()) == "noop_context_fn()"


def test_a_real_context_fn_still_runs():
    recorder = Recorder()
    got, _ = grad_of(lambda x: checkpoint(block, x, context_fn=recorder), X)
    assert torch.equal(got, WANT)
    assert recorder.log == ["forward", "replay"]


# --------------------------------------------------------------------------- torch.compile


def test_compile_refuses_what_hyperparallel_refuses():
    w = torch.randn(8, 8, requires_grad=True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ w)

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(layer, x, swap_inputs=True, context_fn=Recorder(), use_reentrant=True)

    with pytest.raises(Exception, match=(
        "compile mode does not support: swap_inputs, custom context_fn, use_reentrant=True"
    )):
        torch.compile(step, backend="aot_eager", fullgraph=True)(torch.randn(4, 8))


@pytest.mark.parametrize("given", ["call", "function"])
def test_compile_takes_the_noop_context_fn(given):
    w = torch.randn(8, 8, requires_grad=True)
    context_fn = noop_context_fn() if given == "call" else noop_context_fn

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: torch.sin(t @ w), x, context_fn=context_fn)

    x = torch.randn(4, 8)
    torch.compile(step, backend="aot_eager", fullgraph=True)(x).sum().backward()
    want = torch.autograd.grad(torch.sin(x @ w).sum(), w)[0]
    assert torch.allclose(w.grad, want)
