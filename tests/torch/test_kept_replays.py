"""Kept replays and recompute sessions (PyTorch), in one process.

A backward split into passes over one retained graph (an input-gradient pass, then
weight-gradient passes, as zero-bubble pipeline schedules run it) replays a recomp
checkpoint once; PyTorch's checkpoint, and recomp with the mechanism switched off,
replay it once per pass. A true double backward still replays, and nothing is kept
once the graph is gone. The session API runs a replay ahead of backward.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import recomp
import recomp.torch as rt
from recomp import _testing
from recomp.torch import _kept


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.attn = nn.Linear(8, 8)
        self.calls = 0
        self.attn_runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.a(x))
        return self.b(torch.dropout(h, 0.3, True) + self.attn(h))


def _setup(kind: str) -> tuple[Block, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    if kind == "torch":
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    elif kind == "none":
        y = block(x)
    else:
        rt.checkpoint_exclude_wrapper(block.attn)
        y = rt.checkpoint(block, x)
    return block, x, y.square().sum()


def _split_backward(block: Block, x: torch.Tensor, loss: torch.Tensor) -> list[torch.Tensor]:
    """Two autograd.grad calls over different parameter groups of the block."""
    gb = torch.autograd.grad(loss, [block.b.weight, block.b.bias], retain_graph=True)
    ga = torch.autograd.grad(loss, [block.a.weight, block.a.bias, block.attn.weight, x])
    return [*gb, *ga]


def test_split_backward_replays_once_with_the_same_gradients():
    reference = _split_backward(*_setup("none"))
    block, x, loss = _setup("recomp")
    grads = _split_backward(block, x, loss)
    assert block.calls - 1 == 1
    assert block.attn.region_runs == 1
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))


def test_controls_replay_once_per_pass():
    block, x, loss = _setup("torch")
    _split_backward(block, x, loss)
    assert block.calls - 1 == 2
    with _testing.without_kept_replays():
        block, x, loss = _setup("recomp")
        _split_backward(block, x, loss)
    assert block.calls - 1 == 2


def test_double_backward_still_replays():
    block, x, loss = _setup("recomp")
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert block.calls - 1 == 2
    assert torch.equal(x.grad, 2 * first)
    assert block.attn.region_runs == 1


def _disjoint_passes(checkpoint, group: bool) -> tuple[int, list[torch.Tensor]]:
    """Two passes that free the graph as they go over disjoint parts of one checkpoint's
    graph (the later outputs' gradient, then the earlier ones'), as PyTorch's suite runs
    them; the body's runs and the gradients."""
    runs = [0]

    def body(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        runs[0] += 1
        y = x.sin().cos()
        return y, y.sin().cos()

    x = torch.linspace(-1.0, 1.0, 9, requires_grad=True)
    y, z = checkpoint(body, x)
    with torch.utils.checkpoint.GraphExecGroup() if group else contextlib.nullcontext():
        (gy,) = torch.autograd.grad(z, [y], grad_outputs=torch.ones_like(z))
        (gx,) = torch.autograd.grad(y, [x], grad_outputs=gy)
    return runs[0], [gy, gx]


@pytest.mark.parametrize("group", [False, True], ids=["passes", "graph_exec_group"])
def test_disjoint_passes_that_free_the_graph_replay_as_pytorch_does(group):
    # A pass that frees the graph keeps nothing for a later one (no node runs twice), so
    # each pass replays, as with PyTorch's checkpoint; under PyTorch's GraphExecGroup both
    # passes share one replay, as with PyTorch's.
    if not hasattr(torch.utils.checkpoint, "GraphExecGroup"):
        pytest.skip("torch.utils.checkpoint.GraphExecGroup is new in this PyTorch")
    ours = _disjoint_passes(rt.checkpoint, group)
    theirs = _disjoint_passes(
        lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False), group
    )
    assert ours[0] == theirs[0] == (2 if group else 3)
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))


def test_input_gradient_pass_keeps_only_what_a_later_pass_reads():
    with rt.recompute_handle_collector_ctx() as handles:
        block, x, loss = _setup("recomp")
    (handle,) = handles
    torch.autograd.grad(loss, [x], retain_graph=True)
    kept_after_input_pass = handle.kept_count()
    # The linears' saved inputs and weights wait for their weight gradients; the tanh's
    # output and everything else read in this pass is gone.
    assert 0 < kept_after_input_pass < 8
    # A last pass that frees the graph as it goes leaves nothing kept.
    torch.autograd.grad(loss, [block.a.weight, block.b.weight, block.attn.weight])
    assert handle.kept_count() == 0


def test_nothing_is_kept_once_the_graph_is_gone():
    with rt.recompute_handle_collector_ctx() as handles:
        _block, _x, loss = _setup("recomp")
    handle = handles[0]
    rt.recompute_handle(handle, "step")  # replay ahead: everything kept
    assert handle.kept_count() > 0
    del loss
    gc.collect()
    assert handle.kept_count() == 0
    rt.clear_recompute_session("step")
    assert _kept.session_count() == 0
    with pytest.raises(recomp.RecompError, match="nothing left to recompute"):
        rt.recompute_handle(handle, "again")
    assert _kept.session_count() == 0


class Stashing(nn.Module):
    """Keeps a tensor of its forward on itself between two halves and clears it at the
    end (Megatron-Core's TransformerLayer keeps its pre-MLP norm manager so): a replay
    that stops early, after ``b`` saved its input, leaves the replay's tensor there."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.stash: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stash = torch.tanh(self.a(x))
        out = self.b(self.stash)
        self.stash = None
        return out * 2


@pytest.mark.parametrize("kind", ["torch", "recomp"])
def test_replay_state_left_on_a_module_does_not_hold_the_checkpoint(kind):
    # The replay's tensor on the module leads, through the replay's graph and the pack
    # hook its saved tensors keep, to the checkpoint: a strong reference from there to
    # the checkpoint's frame (which holds the module) is a cycle the garbage collector
    # cannot see, and the module, its graph and what recomp kept would never be freed.
    model = Stashing()
    x = torch.randn(4, 8, requires_grad=True)
    if kind == "torch":
        y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    else:
        y = rt.checkpoint(model, x)
    y.sum().backward()
    assert model.stash is not None  # the early-stopped replay left its tensor there
    freed = weakref.ref(model)
    del model, y
    gc.collect()
    assert freed() is None


def test_replay_ahead_of_backward_in_a_retaining_session():
    reference = _split_backward(*_setup("none"))
    with rt.recompute_handle_collector_ctx() as handles:
        block, x, loss = _setup("recomp")
    rt.recompute_handle(handles[0], "mb0")
    assert block.calls - 1 == 1
    with rt.recompute_session_ctx("mb0", retain_on_unpack=True):
        grads = _split_backward(block, x, loss)
    rt.clear_recompute_session("mb0")
    rt.clear_recompute_session("mb0")  # safe to repeat
    assert block.calls - 1 == 1  # backward read the replay that ran ahead
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))
    assert _kept.session_count() == 0


def test_retaining_session_keeps_what_a_pass_from_the_loss_reads_again():
    # Input gradients first, then weights from the loss again: the second pass re-runs
    # nodes the first finished; only a retaining session keeps their tensors for it.
    def passes(session: bool) -> int:
        with rt.recompute_handle_collector_ctx() as handles:
            block, x, loss = _setup("recomp")
        if session:
            rt.recompute_handle(handles[0], "s")
            with rt.recompute_session_ctx("s", retain_on_unpack=True):
                torch.autograd.grad(loss, [x], retain_graph=True)
                torch.autograd.grad(loss, [block.a.weight])
            rt.clear_recompute_session("s")
        else:
            torch.autograd.grad(loss, [x], retain_graph=True)
            torch.autograd.grad(loss, [block.a.weight])
        return block.calls - 1

    assert passes(session=False) == 2
    assert passes(session=True) == 1


def test_unpack_on_another_thread_finds_its_session():
    with rt.recompute_handle_collector_ctx() as handles:
        block, x, loss = _setup("recomp")
    rt.recompute_handle(handles[0], "t")
    errors: list[BaseException] = []

    def backward() -> None:
        try:
            torch.autograd.grad(loss, [x], retain_graph=True)
            torch.autograd.grad(loss, [block.a.weight])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with rt.recompute_session_ctx("t", retain_on_unpack=True):
        worker = threading.Thread(target=backward)  # the context variable is not there
        worker.start()
        worker.join()
    rt.clear_recompute_session("t")
    assert not errors
    assert block.calls - 1 == 1


def test_session_errors_are_clear_and_leave_nothing_behind():
    with rt.recompute_handle_collector_ctx() as handles:
        _block, _x, _loss = _setup("recomp")  # the graph stays while loss lives
    handle = handles[0]
    with pytest.raises(ValueError, match="must not be None"), rt.recompute_session_ctx(None):
        pass
    with pytest.raises(ValueError, match="must not be None"):
        rt.recompute_handle(handle, None)
    with pytest.raises(ValueError, match="hashable"):
        rt.clear_recompute_session(["a"])
    with pytest.raises(ValueError, match="recompute_handle_collector_ctx"):
        rt.recompute_handle(object(), "a")
    with (
        pytest.raises(ValueError, match="True or False"),
        rt.recompute_session_ctx("a", retain_on_unpack=1),
    ):
        pass
    with rt.recompute_session_ctx("a"):
        with (
            pytest.raises(recomp.RecompError, match="do not nest"),
            rt.recompute_session_ctx("b"),
        ):
            pass
        with pytest.raises(recomp.RecompError, match="inside recompute_session_ctx"):
            rt.recompute_handle(handle, "b")
    rt.recompute_handle(handle, "a")
    with pytest.raises(recomp.RecompError, match="already belongs to session 'a'"):
        rt.recompute_handle(handle, "b")
    rt.clear_recompute_session("a")
    rt.recompute_handle(handle, "b")  # free again after the clear
    rt.clear_recompute_session("b")
    assert _kept.session_count() == 0


def test_collector_takes_top_level_checkpoints_in_call_order():
    layers = [Block() for _ in range(3)]
    x = torch.randn(2, 8, requires_grad=True)
    with rt.recompute_handle_collector_ctx() as handles:
        h = x
        for layer in layers:
            h = rt.checkpoint(layer, h)
        with torch.no_grad():
            rt.checkpoint(layers[0], x)
    assert len(handles) == 3
    for handle in handles:
        rt.recompute_handle(handle, "order")
    h.sum().backward()
    rt.clear_recompute_session("order")
    assert [layer.calls for layer in layers] == [3, 2, 2]  # forward (+ no_grad one) + replay




def test_debug_log_composes_with_kept_replays():
    reference = _split_backward(*_setup("none"))
    torch.manual_seed(0)
    block = Block()
    rt.checkpoint_exclude_wrapper(block.attn)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    loss = rt.checkpoint(block, x, debug=True).square().sum()
    grads = _split_backward(block, x, loss)
    assert block.calls - 1 == 1
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))


def test_nested_checkpoints_with_kept_replays():
    def build(checkpointed: bool) -> tuple[Block, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        block = Block()
        x = torch.randn(4, 8, requires_grad=True)
        torch.manual_seed(1)
        if not checkpointed:
            return block, x, torch.tanh(block(x)).square().sum()
        rt.checkpoint_exclude_wrapper(block.attn)

        def outer(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(rt.checkpoint(block, t))

        return block, x, rt.checkpoint(outer, x).square().sum()

    block, x, loss = build(checkpointed=False)
    loss.backward()
    reference = [x.grad, *(p.grad for p in block.parameters())]
    block, x, loss = build(checkpointed=True)
    loss.backward()
    # The outer replay re-runs the inner checkpoint once; the inner replays once.
    assert block.calls - 1 == 2
    assert block.attn.region_runs == 1
    grads = [x.grad, *(p.grad for p in block.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(reference, grads, strict=True))


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("nested", ["grad", "backward"])
def test_a_backward_run_from_a_hook_over_the_same_checkpoint(early_stop, nested):
    # A hook of the checkpoint's last node runs another backward over the same graph (a
    # nested graph task) while the outer pass is still reading what its replay kept.
    # Each pass reads its own replay's tensors, as with PyTorch's checkpoint.
    def run(checkpoint):
        a = torch.tensor([0.3, 1.1], requires_grad=True)
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            out = checkpoint(lambda x: x.sin().exp().sin(), a)
        inner = []

        def hook(*_unused):
            if inner:  # the nested pass runs this node and its hook again
                return
            inner.append(None)
            with torch.enable_grad():
                if nested == "grad":
                    inner[0] = torch.autograd.grad(out.sum(), a, retain_graph=True)[0]
                else:
                    out.sum().backward(retain_graph=True)

        out.grad_fn.register_hook(hook)
        out.sum().backward(retain_graph=True)
        return a.grad, inner[0]

    def torch_checkpoint(fn, x):
        return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)

    expected, got = run(torch_checkpoint), run(rt.checkpoint)
    assert torch.equal(expected[0], got[0])
    if nested == "grad":
        assert torch.equal(expected[1], got[1])


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_backward_from_a_hook_reads_part_of_what_the_outer_pass_kept(early_stop):
    # The hook runs a backward from an intermediate output of the checkpoint: the nested
    # pass needs only the first saved tensors, which the outer pass, still running, reads
    # after it. The nested pass replays for itself and leaves the outer pass its own.
    def run(checkpoint):
        a = torch.tensor([0.3, 1.1], requires_grad=True)

        def fn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = t.sin().cos()
            return h, h.sin()

        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            h, out = checkpoint(fn, a)
        seen = []

        def hook(*_unused):
            seen.append(a.grad)
            h.backward(torch.ones_like(h), retain_graph=True)

        out.grad_fn.register_hook(hook)
        out.sum().backward(retain_graph=True)
        assert seen == [None]
        return a.grad

    def torch_checkpoint(fn, x):
        return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)

    assert torch.equal(run(torch_checkpoint), run(rt.checkpoint))


def test_a_gradient_taken_inside_the_checkpointed_function():
    # The replay runs a backward of its own (autograd.grad with create_graph): what the
    # replay saves during that inner pass belongs to the pass that asked for the replay.
    def grad_of(fn):
        def taken(t: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                return torch.autograd.grad(fn(t).sum(), t, create_graph=True)[0]

        return taken

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.sin().exp().sin()

    def checkpointed(f):
        return lambda t: rt.checkpoint(f, t)

    x = torch.tensor([0.3, 1.1, -0.7], requires_grad=True)
    expected = grad_of(grad_of(fn))(x)
    assert torch.equal(grad_of(checkpointed(grad_of(fn)))(x), expected)
    assert torch.equal(grad_of(checkpointed(grad_of(checkpointed(fn))))(x), expected)
