"""Without gradients nothing is checkpointed: a wrapped model's forward is the model's own
forward, with none of the checkpoint machinery around it (``benchmarks/no_grad_cost.py``
times it). Asserted by what runs, not by time: the Python functions a forward calls,
counted with ``sys.setprofile``."""

from __future__ import annotations

import contextlib
import pathlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

import recomp
import recomp.torch as rt
from call_counts import calls_of
from torch_models import exclude_attention, stack, twin

LAYERS = 3

# The wrappers' own entry points: what a forward without gradients may still run of recomp.
WRAPPER_FRAMES = {"CheckpointWrapper.forward", "ExcludeWrapper.__call__", "ExcludeWrapper.forward"}


_RECOMP_SOURCE = str(pathlib.Path(recomp.__file__).parent).replace("\\", "/") + "/"


def recomp_frames(calls: Counter[tuple[str, str]]) -> Counter[str]:
    """The calls into recomp's own source (a checkout may itself sit in a folder named
    ``recomp``, with the environment's packages below it: the package's path decides)."""
    return Counter({name: n for (path, name), n in calls.items() if path.startswith(_RECOMP_SOURCE)})


def checkpoint_frames(calls: Counter[tuple[str, str]]) -> int:
    return sum(n for (path, _), n in calls.items() if path.endswith("utils/checkpoint.py"))


@contextlib.contextmanager
def eval_no_grad(*models: torch.nn.Module) -> Iterator[None]:
    for m in models:
        m.eval()
    with torch.no_grad():
        yield


MODES = {
    "no_grad": lambda *models: torch.no_grad(),
    "inference_mode": lambda *models: torch.inference_mode(),
    "eval_no_grad": eval_no_grad,
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_wrapped_forward_without_gradients_runs_no_checkpoint_machinery(mode):
    plain = stack(LAYERS)
    model = exclude_attention(twin(plain))
    seen: dict[str, list[str]] = {"plain": [], "wrapped": []}
    for name, m in (("plain", plain), ("wrapped", model)):
        m[0].register_forward_pre_hook(lambda m, a, name=name: seen[name].append("layer pre"))
        m[0].register_forward_hook(lambda m, a, o, name=name: seen[name].append("layer"))
        m[0].attn.register_forward_hook(lambda m, a, o, name=name: seen[name].append("region"))
    x = torch.randn(2, 8)
    with MODES[mode](plain, model):
        expected = plain(x)
        model(x)  # first calls fill caches
        out: list[torch.Tensor] = []
        calls = calls_of(lambda: out.append(model(x)))
        plain_calls = calls_of(lambda: plain(x))
    assert torch.equal(out[0], expected)
    assert seen["wrapped"] == ["layer pre", "region", "layer"] * 2  # hooks as without recomp
    assert [blk.attn.region_runs for blk in model] == [2] * LAYERS
    assert [blk.attn.region_skips for blk in model] == [0] * LAYERS
    # Only the wrappers' own methods, once per wrapped module, each wrapper asking once
    # whether a checkpoint runs: no engine, no checkpoint.
    assert checkpoint_frames(calls) == 0
    expected = Counter({name: LAYERS for name in WRAPPER_FRAMES})
    expected["get_recompute_state"] = 2 * LAYERS
    assert recomp_frames(calls) == expected
    # and around them the model's own calls, and the compile check (torch.compiler's
    # is_compiling, 2 calls) in two wrappers: 9 calls per layer (about 330 before)
    extra = sum(calls.values()) - sum(plain_calls.values())
    assert extra <= LAYERS * (len(WRAPPER_FRAMES) + 2 + 2 * 2)


def test_checkpoint_without_gradients_calls_the_function_with_its_own_arguments():
    seen = []

    def fn(x, *, scale):
        seen.append(scale)
        return x * scale

    x = torch.randn(3)
    with torch.no_grad():
        calls = calls_of(
            lambda: rt.checkpoint(fn, x, scale=2.0, preserve_rng_state=False, early_stop=True)
        )
        out = rt.checkpoint(fn, x, scale=3.0, debug=True, determinism_check="none")
    assert torch.equal(out, x * 3.0) and seen == [2.0, 3.0]
    assert checkpoint_frames(calls) == 0
    ours = recomp_frames(calls)
    assert "begin" not in ours and sum(ours.values()) <= 8, ours  # the option checks
    with torch.no_grad(), pytest.raises(ValueError, match="non-reentrant"):
        rt.checkpoint(fn, x, scale=1.0, use_reentrant=True)


def test_the_same_model_with_gradients_still_checkpoints():
    plain = stack(LAYERS)
    model = exclude_attention(twin(plain))
    x = torch.randn(2, 8, requires_grad=True)
    calls = calls_of(lambda: model(x).sum().backward())
    assert checkpoint_frames(calls) > 0
    assert [blk.attn.region_skips for blk in model] == [1] * LAYERS


def test_a_checkpoint_without_gradients_inside_another_still_goes_through_the_engine():
    """Inside a recomp checkpoint a nested call is recorded as before (its own recompute
    state), so that the replay of the enclosing checkpoint finds the calls its forward
    made."""
    import recomp

    seen = []

    def inner(x):
        state = recomp.get_recompute_state()
        seen.append((state.invocation_id, state.is_recomputing))
        return x.cos()

    def outer(x):
        with torch.no_grad():
            side = rt.checkpoint(inner, x)
        return (x * 2).sin() + side

    x = torch.randn(2, 8, requires_grad=True)
    rt.checkpoint(outer, x).sum().backward()
    (forward_id, forward_replaying), (replay_id, replaying) = seen
    assert (forward_replaying, replaying) == (False, True) and forward_id == replay_id
