"""``torch.utils.checkpoint.checkpoint`` replaced by recomp's checkpoint.

Trying recomp on a project that calls PyTorch's checkpoint (its code, or its test suite)
is most simply done by replacing the module attribute: with recomp's own function, or
with a function that sends the non-reentrant calls to it. recomp then calls PyTorch's
checkpoint function as it was when recomp was imported, never the replacement, which
would call recomp again without end. ``checkpoint_sequential``, which looks the name up
in its module at each call, goes through the replacement too.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn

import recomp
import recomp.torch as rt
from torch_models import assert_same_grads, grads_of, stack, twin

TORCH_CHECKPOINT = tuc.checkpoint  # PyTorch's, taken before any test replaces it


class Counted(nn.Module):
    """A block that counts its forward runs (the forward, then each replay)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.block(x)


class CallsCheckpoint(nn.Module):
    """Each block through ``torch.utils.checkpoint.checkpoint``, looked up at each call."""

    def __init__(self, blocks: nn.Sequential) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Counted(b) for b in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return x


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def renamed(grads: dict, prefix: str) -> dict:
    """Gradients keyed as in the plain stack: without ``prefix`` and the ``Counted`` level."""
    return {k.removeprefix(prefix).replace(".block.", ".", 1): v for k, v in grads.items()}


def route_non_reentrant(calls: list[str]):
    original = TORCH_CHECKPOINT

    def route(function, *args, use_reentrant=None, **kwargs):
        if use_reentrant is False:
            calls.append("recomp")
            return rt.checkpoint(function, *args, use_reentrant=False, **kwargs)
        calls.append("torch")
        return original(function, *args, use_reentrant=use_reentrant, **kwargs)

    return route


@pytest.mark.parametrize("replacement", ["recomp", "router"])
def test_replaced_torch_checkpoint_runs_recomp_once_per_call(monkeypatch, replacement):
    ref = stack(3)
    x = torch.randn(4, 8, requires_grad=True)
    _, expected = grads_of(twin(ref), loss_fn, x)

    calls: list[str] = []
    monkeypatch.setattr(
        tuc, "checkpoint", rt.checkpoint if replacement == "recomp" else route_non_reentrant(calls)
    )
    model = CallsCheckpoint(twin(ref))
    _, actual = grads_of(model, loss_fn, x)
    assert_same_grads(expected, renamed(actual, "blocks."))
    # One forward and one replay per block: recomp checkpointed each call, once.
    assert [b.runs for b in model.blocks] == [2, 2, 2]
    if replacement == "router":
        assert calls == ["recomp"] * 3


def test_checkpoint_sequential_goes_through_the_replacement(monkeypatch):
    ref = stack(4)
    x = torch.randn(4, 8, requires_grad=True)
    _, expected = grads_of(twin(ref), loss_fn, x)

    calls: list[str] = []
    monkeypatch.setattr(tuc, "checkpoint", route_non_reentrant(calls))
    model = twin(ref)
    counted = nn.Sequential(*(Counted(b) for b in model))

    class Sequential(nn.Module):
        def forward(self, y: torch.Tensor) -> torch.Tensor:
            return tuc.checkpoint_sequential(counted, 2, y, use_reentrant=False)

    holder = Sequential()
    holder.counted = counted
    _, actual = grads_of(holder, loss_fn, x)
    assert_same_grads(expected, renamed(actual, "counted."))
    # checkpoint_sequential checkpoints every segment but the last: two blocks replay.
    assert [b.runs for b in counted] == [2, 2, 1, 1]
    assert calls == ["recomp"]


def test_a_replacement_made_before_recomp_was_imported_is_named(monkeypatch):
    """recomp bound the replacement as PyTorch's checkpoint (it was imported after it):
    the loop it would make is refused at its first turn, with what to do instead."""
    from recomp.torch import _compile

    calls: list[str] = []
    route = route_non_reentrant(calls)
    monkeypatch.setattr(tuc, "checkpoint", route)
    monkeypatch.setattr(_compile, "torch_checkpoint", route)
    model = CallsCheckpoint(stack(1))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(recomp.RecompError, match=r"Import recomp\.torch before replacing"):
        model(x)
    # The model's call, then recomp's call of the replacement, refused there.
    assert calls == ["recomp", "recomp"]
    assert model.blocks[0].runs == 0
    # Nothing stays open: with PyTorch's checkpoint back, the same model trains.
    monkeypatch.setattr(_compile, "torch_checkpoint", TORCH_CHECKPOINT)
    loss_fn(model(x)).backward()
    assert model.blocks[0].runs == 2


SUITE_FILE = '''
import torch
import recomp
from torch.utils.checkpoint import checkpoint

def phases(run):
    """recomp's state at each run of a body checkpointed by ``run(body, x)``."""
    seen = []

    def body(x):
        seen.append(recomp.is_recomputing())
        return x.sin().cos()

    run(body, torch.randn(3, requires_grad=True)).sum().backward()
    return seen

def test_checkpoint_routed():
    # recomp's state in the replay: recomp's checkpoint ran
    assert phases(lambda f, x: checkpoint(f, x, use_reentrant=False)) == [False, True]

def test_checkpoint_detects_non_determinism():
    assert False  # named as a deliberate difference: an expected failure

def test_checkpoint_wrapper_routed():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Body(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, x):
            return self.f(x)

    # CheckpointImpl.NO_REENTRANT
    assert phases(lambda f, x: checkpoint_wrapper(Body(f))(x)) == [False, True]

def test_checkpoint_bound_before_the_tool():
    import bound_early

    assert phases(bound_early.run) == [False, True]
'''

# A module that binds PyTorch's checkpoint at import, as Hugging Face transformers'
# modeling_utils does, and calls it through that name.
BOUND_EARLY = '''
from torch.utils.checkpoint import checkpoint

def run(function, x):
    return checkpoint(function, x, use_reentrant=False)
'''

# Imported before the tool replaces anything: the wrapper's module has bound PyTorch's
# checkpoint under its own name by then.
CONFTEST = (
    "import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401\n"
    "import bound_early  # noqa: F401\n"
)


@pytest.mark.parametrize("plain", [False, pytest.param(True, marks=pytest.mark.system)])
def test_the_suite_tool_routes_a_test_files_checkpoint_calls(tmp_path, plain):
    """tools/torch_checkpoint_suite.py on a test file written like PyTorch's: its calls
    reach recomp's checkpoint, those PyTorch's ``checkpoint_wrapper`` makes too (its module
    imported by a conftest, before the tool's replacement), and so do those made through a
    name another module bound to PyTorch's function when the conftest imported it; a
    deliberate difference is an expected failure; ``--plain`` leaves PyTorch's checkpoint
    (every test then fails)."""
    import subprocess
    import sys

    from paths import ROOT

    (tmp_path / "test_suite_like.py").write_text(SUITE_FILE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "bound_early.py").write_text(BOUND_EARLY)
    command = [sys.executable, str(ROOT / "tools" / "torch_checkpoint_suite.py"), "test_suite_like.py"]
    command += ["--plain"] if plain else []
    run = subprocess.run(
        [*command, "--", "-q", "-p", "no:randomly"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if plain:
        assert "4 failed" in run.stdout, run.stdout + run.stderr
    else:
        assert "3 passed, 1 xfailed" in run.stdout, run.stdout + run.stderr
        assert (
            "checkpoint calls: 3 to recomp, 0 reentrant ones to PyTorch; "
            "1 of all these through PyTorch's checkpoint_wrapper"
        ) in run.stdout
        assert "rebound: bound_early.checkpoint" in run.stdout


def test_pytorch_s_own_checkpoint_is_told_from_a_replacement_that_copies_its_names():
    """recomp calls PyTorch's own checkpoint without the guard against being called back;
    a replacement bound before recomp was imported keeps the guard, even one that copies
    PyTorch's names (``functools.wraps``). Run in a fresh interpreter, where the
    replacement really comes first."""
    import subprocess
    import sys

    from recomp.torch import _compile

    assert _compile.PYTORCH_CHECKPOINT is TORCH_CHECKPOINT
    code = """
import functools, torch, torch.utils.checkpoint as tuc
original = tuc.checkpoint

@functools.wraps(original)
def route(function, *args, use_reentrant=None, **kwargs):
    import recomp.torch as rt
    return rt.checkpoint(function, *args, use_reentrant=False, **kwargs)

tuc.checkpoint = route
import recomp, recomp.torch as rt
from recomp.torch import _compile
assert _compile.torch_checkpoint is route and _compile.PYTORCH_CHECKPOINT is None
layer = torch.nn.Linear(4, 4)
try:
    rt.checkpoint(layer, torch.randn(2, 4, requires_grad=True))
except recomp.RecompError as exc:
    print("refused:", "Import recomp.torch before replacing" in str(exc))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "refused: True"
