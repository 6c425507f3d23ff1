"""Outside a gradient computation nothing is checkpointed: MindSpore's recompute calls the
block as it is, and recomp builds none of a checkpoint call's parts either. Asserted by
what runs (the Python functions a forward calls, counted with ``sys.setprofile``)."""

from __future__ import annotations

from collections import Counter

import pytest

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file

import recomp.mindspore as rm  # noqa: E402
from call_counts import calls_of  # noqa: E402
from ms_models import assert_same, exclude_attention, grads, tensor, twin_stack  # noqa: E402

LAYERS = 2


def ran(calls: Counter[tuple[str, str]], path_end: str, name: str | None = None) -> int:
    return sum(
        n
        for (path, qualname), n in calls.items()
        if path.endswith(path_end) and (name is None or qualname == name)
    )


def test_a_wrapped_forward_outside_a_gradient_computation_builds_no_checkpoint():
    ref, model = twin_stack(LAYERS)
    exclude_attention(model)
    x = tensor(4, 8)
    model(x)  # the first call prepares the Cells (dropout, collectives), once
    out = []
    calls = calls_of(lambda: out.append(model(x)))
    assert_same([ref(x).asnumpy()], [out[0].asnumpy()])
    assert ran(calls, "mindspore/common/recompute.py") == 0
    assert ran(calls, "recomp/_engine.py", "begin") == 0
    assert ran(calls, "recomp/_record.py") == 0
    assert [layer.attn.region_runs for layer in model.layers] == [2] * LAYERS
    # With gradients, the same model checkpoints: the same gradients as without recomp.
    grad_calls = calls_of(
        lambda: assert_same(
            grads(ref, ref.trainable_params(), x), grads(model, model.trainable_params(), x)
        )
    )
    assert ran(grad_calls, "recomp/_engine.py", "begin") == LAYERS
    assert [layer.attn.region_skips for layer in model.layers] == [1] * LAYERS


def test_checkpoint_outside_a_gradient_computation_passes_only_the_function_arguments():
    seen = []

    def fn(x, *, scale):
        seen.append(scale)
        return x * scale

    x = tensor(3)
    out = rm.checkpoint(fn, x, scale=2.0, early_stop=True, save_rng_state=False)
    assert_same([(x * 2.0).asnumpy()], [out.asnumpy()])
    assert seen == [2.0]
