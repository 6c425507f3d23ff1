"""recomp's replay of PyTorch's checkpoint against PyTorch's own (NOTE [ Replaying
PyTorch's checkpoint ] in ``recomp.torch._compat.checkpoint``).

Every case runs twice: replayed by recomp, and with ``_testing.without_own_replay()``,
where PyTorch's unpack hook replays. Both must give the same gradients bit for bit, the
same errors, and leave PyTorch's frame as PyTorch's replay does; recomp's must not build
PyTorch's replay hooks. The cases are those where PyTorch's replay has a rule of its own:
early stop on and off, no determinism check, passes over a retained graph, a backward
inside the forward, nested checkpoints, a grouped backward, and each error it raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import recomp
import recomp.torch as rt
from recomp import _testing

MODES = ["recomp", "pytorch"]


class Block(nn.Module):
    """Linear, GELU, dropout, Linear; ``replay_differs`` changes what a replay does."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.replay_differs: str | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = nn.functional.gelu(self.a(x))
        if self.calls > 1 and self.replay_differs == "fewer":
            return self.b(h)
        h = nn.functional.dropout(h, 0.3, training=True)
        if self.calls > 1 and self.replay_differs == "more":
            h = h.sin()
        if self.calls > 1 and self.replay_differs == "shape":
            h = torch.cat([h, h])[: h.shape[0] + 1]
        return self.b(h)


@pytest.fixture
def replay_hooks_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times PyTorch built the hooks of its replay (counted, not changed)."""
    made: list[int] = [0]
    original = torch.utils.checkpoint._recomputation_hook.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made[0] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint._recomputation_hook, "__init__", counting)
    return made


def _mode(mode: str) -> Any:
    return _testing.without_own_replay() if mode == "pytorch" else _nothing()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: Any) -> None:
        return None


def _run(mode: str, body: Callable[[], Any]) -> Any:
    torch.manual_seed(0)
    with _mode(mode):
        try:
            return body()
        except (RuntimeError, recomp.RecompError) as exc:  # compared between the modes
            return exc


def _same(a: Any, b: Any, fails: bool = False) -> None:
    assert fails == isinstance(b, Exception), b
    if isinstance(a, Exception) or isinstance(b, Exception):
        assert type(a) is type(b), (a, b)
        first = str(b).splitlines()[0]
        # recomp words the one error it raises itself (more tensors) on its own; it
        # keeps PyTorch's opening.
        assert str(a).startswith(first[:60]), (str(a), str(b))
        return
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b):
        assert torch.equal(x, y)


def _flatten(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    out: list[torch.Tensor] = []
    for item in value:
        out += _flatten(item)
    return out


def _grads(block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in block.parameters()]  # type: ignore[list-item]


def _plain(**options: Any) -> Callable[[], Any]:
    def body() -> Any:
        block, x = Block(), torch.randn(3, 6, requires_grad=True)
        rt.checkpoint(block, x, **options).square().sum().backward()
        return _grads(block, x)

    return body


def _unwrapped() -> list[torch.Tensor]:
    torch.manual_seed(0)
    block, x = Block(), torch.randn(3, 6, requires_grad=True)
    block(x).square().sum().backward()
    return _grads(block, x)


def _retained_passes() -> Any:
    """Input gradients, then each layer's weights (a zero-bubble schedule's passes)."""
    block, x = Block(), torch.randn(3, 6, requires_grad=True)
    loss = rt.checkpoint(block, x).square().sum()
    gx = torch.autograd.grad(loss, [x], retain_graph=True)
    gb = torch.autograd.grad(loss, [block.b.weight], retain_graph=True)
    ga = torch.autograd.grad(loss, [block.a.weight])
    return [gx, gb, ga, torch.tensor(block.calls)]


def _backward_twice() -> Any:
    block, x = Block(), torch.randn(3, 6, requires_grad=True)
    loss = rt.checkpoint(block, x).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return [*_grads(block, x), torch.tensor(block.calls)]


def _double_backward() -> Any:
    """A gradient penalty: the first backward builds a graph the second runs."""
    block, x = Block(), torch.randn(3, 6, requires_grad=True)
    loss = rt.checkpoint(block, x).square().sum()
    (gx,) = torch.autograd.grad(loss, [x], create_graph=True)
    (loss + gx.square().sum()).backward()
    return [*_grads(block, x), torch.tensor(block.calls)]


def _grad_inside_forward() -> Any:
    """A backward inside the checkpointed function (PyTorch's replay then saves more
    tensors than the forward had when it ran)."""
    block, x = Block(), torch.randn(3, 6, requires_grad=True)

    def function(x: torch.Tensor) -> torch.Tensor:
        y = block(x)
        (g,) = torch.autograd.grad(y.sum(), [x], create_graph=True)
        return y * g

    rt.checkpoint(function, x, early_stop=False).sum().backward()
    return _grads(block, x)


def _stops_early(**options: Any) -> Callable[[], Any]:
    """A function that does work after the last tensor it saves: an early-stopping
    replay does not reach it."""

    def body() -> Any:
        block, x = Block(), torch.randn(3, 6, requires_grad=True)
        ends: list[int] = []

        def function(x: torch.Tensor) -> torch.Tensor:
            out = block(x)
            ends.append(1)
            return out + 1

        rt.checkpoint(function, x, **options).sum().backward()
        return [*_grads(block, x), torch.tensor(len(ends))]

    return body


def _nested() -> Any:
    inner, outer = Block(), Block()
    x = torch.randn(3, 6, requires_grad=True)

    def function(x: torch.Tensor) -> torch.Tensor:
        return outer(rt.checkpoint(inner, x).tanh())

    rt.checkpoint(function, x).square().sum().backward()
    return [*_grads(inner, x), *_grads(outer, x)]


def _differs(how: str, **options: Any) -> Callable[[], Any]:
    def body() -> Any:
        block, x = Block(), torch.randn(3, 6, requires_grad=True)
        block.replay_differs = how
        rt.checkpoint(block, x, **options).square().sum().backward()
        return _grads(block, x)

    return body


class _ReadsTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        first = ctx.saved_tensors[0]
        second = ctx.saved_tensors[0]
        return grad * 2 + 0 * (first - second)


def _unpacked_twice() -> Any:
    x = torch.randn(3, 6, requires_grad=True)
    rt.checkpoint(lambda t: _ReadsTwice.apply(t.sin()), x).sum().backward()
    return [x.grad]


CASES: dict[str, Callable[[], Any]] = {
    "plain": _plain(),
    "no early stop": _plain(early_stop=False),
    "no determinism check": _plain(determinism_check="none"),
    "passes over a retained graph": _retained_passes,
    "backward twice": _backward_twice,
    "double backward": _double_backward,
    "backward inside the forward": _grad_inside_forward,
    "nested checkpoints": _nested,
    "work after the last saved tensor": _stops_early(),
    "work after the last saved tensor, no early stop": _stops_early(early_stop=False),
    "replay saves fewer tensors": _differs("fewer"),
    "replay saves fewer tensors, no early stop": _differs("fewer", early_stop=False),
    "replay saves more tensors, no early stop": _differs("more", early_stop=False),
    "replay saves other shapes": _differs("shape"),
    "a tensor unpacked twice": _unpacked_twice,
}


FAILING = {
    "replay saves fewer tensors",
    "replay saves fewer tensors, no early stop",
    "replay saves more tensors, no early stop",
    "replay saves other shapes",
    "a tensor unpacked twice",
}


@pytest.mark.parametrize("case", list(CASES))
def test_recomp_replays_as_pytorch_does(case: str, replay_hooks_made: list[int]) -> None:
    own = _run("recomp", CASES[case])
    made_by_recomp = replay_hooks_made[0]
    pytorch = _run("pytorch", CASES[case])
    _same(own, pytorch, fails=case in FAILING)
    if case != "a tensor unpacked twice":  # PyTorch's unpack tells that error
        assert made_by_recomp == 0
    assert replay_hooks_made[0] > made_by_recomp  # the other mode used PyTorch's replay


def test_errors_are_the_checkpoints_own() -> None:
    """The cases that fail above fail as a recomp checkpoint's replay does."""
    for case in ("replay saves fewer tensors", "replay saves other shapes"):
        assert isinstance(_run("recomp", CASES[case]), recomp.ReplayMismatchError), case
    more = _run("recomp", CASES["replay saves more tensors, no early stop"])
    assert isinstance(more, torch.utils.checkpoint.CheckpointError)
    assert "trying to save more tensors during recomputation" in str(more)
    twice = _run("recomp", CASES["a tensor unpacked twice"])
    assert isinstance(twice, torch.utils.checkpoint.CheckpointError)
    assert "unpacked once" in str(twice)


def test_early_stop_is_kept() -> None:
    assert int(_run("recomp", CASES["work after the last saved tensor"])[-1]) == 1
    assert int(_run("recomp", CASES["work after the last saved tensor, no early stop"])[-1]) == 2


def test_gradients_are_those_without_checkpointing() -> None:
    _same(_run("recomp", CASES["plain"]), _unwrapped())


def _frame_after_first_pass() -> Any:
    """PyTorch's frame after a pass that read the input's gradient only: what its
    replay left in the frame, per field (pass ids differ between runs: values only)."""
    from recomp.torch._compat.checkpoint import _checkpoint_frame

    block, x = Block(), torch.randn(3, 6, requires_grad=True)
    with rt.recompute_handle_collector_ctx() as handles:
        loss = rt.checkpoint(block, x).square().sum()
    frame = _checkpoint_frame(handles[0]._checkpoint_pack)
    gx = torch.autograd.grad(loss, [x], retain_graph=True)
    holders = [ref() for ref in frame.weak_holders]
    return [
        gx,
        torch.tensor(list(frame.recomp_counter.values())),
        torch.tensor(list(frame.is_recomputed.values())),
        torch.tensor([frame.ignore_saved_mismatch, frame.forward_completed]),
        torch.tensor([[v is None for v in h.handles.values()] for h in holders if h is not None]),
        torch.tensor([len(v) for v in frame.recomputed.values()]),
        # What the replay recomputed and the pass did not read, kept for the next pass:
        # detached from the replay's graph.
        torch.tensor(
            [kept[0].requires_grad for by in handles[0]._kept.values() for kept in by.values()]
        ),
    ]


def test_the_frame_is_left_as_pytorch_leaves_it() -> None:
    _same(_run("recomp", _frame_after_first_pass), _run("pytorch", _frame_after_first_pass))


@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "GraphExecGroup"), reason="PyTorch 2.14's GraphExecGroup"
)
def test_a_grouped_backward_replays_once() -> None:
    """Two passes over disjoint parts of one checkpoint's graph (the later half, then
    the earlier half) under one group: one replay for both; and passes that overlap
    refused."""

    def body() -> Any:
        block, x = Block(), torch.randn(3, 6, requires_grad=True)

        def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            block.calls += 1
            h = x.sin().cos()
            return h, h.tanh().exp()

        h, out = rt.checkpoint(halves, x)
        with torch.utils.checkpoint.GraphExecGroup():
            (gh,) = torch.autograd.grad(out.sum(), [h])
            (gx,) = torch.autograd.grad(h, [x], grad_outputs=gh)
        return [gh, gx, torch.tensor(block.calls)]

    def overlapping() -> Any:
        x = torch.randn(3, 6, requires_grad=True)
        out = rt.checkpoint(lambda t: t.sin().cos(), x)
        with torch.utils.checkpoint.GraphExecGroup():
            out.sum().backward(retain_graph=True)
            out.sum().backward()
        return [x.grad]

    own, pytorch = _run("recomp", body), _run("pytorch", body)
    _same(own, pytorch)
    assert int(own[-1]) == 2  # the forward and one replay
    refused = _run("recomp", overlapping)
    _same(refused, _run("pytorch", overlapping), fails=True)
    assert "overlap" in str(refused)


class _SavesAtABreak(torch.autograd.Function):
    """Saves a tensor where Dynamo breaks the graph: run eagerly, from a compiled frame."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        ctx.save_for_backward(y)
        torch._dynamo.graph_break()
        return y * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * 2 * torch.cos(torch.asin(y))


class _Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SavesAtABreak.apply(self.linear(x)).tanh()


def test_dynamo_leaves_the_replay_alone_inside_a_module_compiled_on_its_own() -> None:
    """A module compiled with ``nn.Module.compile()`` inside the checkpoint runs its
    frames with Dynamo's callback on, and saves a tensor at a graph break: the replay's
    pack hook is called there. Dynamo compiles no frame of recomp's (no more frames than
    under PyTorch's checkpoint), and the gradients are PyTorch's."""
    import torch._dynamo.utils

    def run(kind: str) -> tuple[int, list[torch.Tensor]]:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), _Compiled())
        block[2].compile(backend="eager")
        for _ in range(3):
            x = torch.randn(3, 6, requires_grad=True)
            if kind == "torch":
                out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                out = rt.checkpoint(block, x)
            out.sum().backward()
        return torch._dynamo.utils.counters["frames"]["total"], _grads(block, x)

    frames, grads = run("recomp")
    pytorch_frames, pytorch_grads = run("torch")
    # PyTorch 2.9's own replay leaves Dynamo the weak dictionary's method: one more there.
    assert frames <= pytorch_frames
    _same(grads, pytorch_grads)
