"""``saved_tensors_report`` on a model compiled with ``torch.compile``: what the compiled
graphs save is billed as such, with a note on what the report cannot see inside them."""

from __future__ import annotations

import pytest
import torch

import recomp.torch as rt
import recomp.torch.report as rr
from recomp._report import COMPILED, OUTSIDE
from recomp.cli.torch.models import norm_matmul_silu
from recomp.torch import _compat

pytestmark = pytest.mark.skipif(
    not _compat.saved_values_readable(),
    reason="this PyTorch does not expose saved values without unpacking them",
)

B, T, D = 2, 16, 32


def test_a_compiled_model_is_billed_to_its_graphs():
    torch.manual_seed(0)
    model = norm_matmul_silu(2, D)
    layers = set(model.layers)
    rt.apply_activation_checkpointing(model, checkpoint_fn=lambda m: m in layers)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(B, T, D, requires_grad=True)
    eager = rr.saved_tensors_report(model(x).pow(2).mean(), model=model, inputs=x)
    loss = compiled(x).pow(2).mean()
    report = rr.saved_tensors_report(loss, model=model, inputs=x)
    kinds = report.by_kind()
    # what the graph keeps (at least each layer's output, which the next reads) is
    # the graph's; the output, saved by pow after the graph, is outside
    assert set(kinds) == {COMPILED, OUTSIDE}
    assert kinds[OUTSIDE] == B * T * D * 4
    assert kinds[COMPILED] >= B * T * D * 4
    assert all(r.layer is None and r.region is None for r in report.rows)
    assert "Saved by a compiled graph" in str(report)
    assert "Saved by a compiled graph" not in str(eager)
    loss.backward()
    assert rr.saved_tensors_report(loss).rows == []
