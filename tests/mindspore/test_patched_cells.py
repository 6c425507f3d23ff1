"""recomp.mindspore where a library has patched MindSpore's Cell, as mindnlp 0.3.1 does.

mindnlp 0.3.1 (the last release whose models are Cells) needs its own environment,
so its patches are reproduced here, as its ``mindnlp/injection.py`` applies them
at import: ``Cell._run_forward_hook`` replaced by a two-argument version (every
Cell with a forward hook then fails), ``Cell.cells_and_names`` by a
``(self, name_prefix='')`` version, and ``nn.Dropout`` rebound to a Cell that
draws its mask with ``ops.rand_like``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import paths

ms = pytest.importorskip("mindspore")  # the PyTorch-only environments skip this file

import recomp  # noqa: E402
import recomp.mindspore as rm  # noqa: E402
from ms_models import assert_same, copy_params, grads, nn, ops, tensor  # noqa: E402


def _run_forward_hook(self, inputs, output):
    for fn in self._forward_hook.values():
        ret = fn(self, inputs, output)
        if ret is not None:
            output = ret
    return output


def _cells_and_names(self, name_prefix=""):
    yield name_prefix, self
    for name, cell in self._cells.items():
        if cell:
            prefix = f"{name_prefix}.{name}" if name_prefix else name
            yield from cell.cells_and_names(prefix)


class RandLikeDropout(nn.Cell):
    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def construct(self, x):
        if not self.training:
            return x
        mask = ops.rand_like(x) > self.p
        return x * mask / (1 - self.p)


@pytest.fixture
def patched_cells(monkeypatch):
    monkeypatch.setattr(nn.Cell, "_run_forward_hook", _run_forward_hook)
    monkeypatch.setattr(nn.Cell, "cells_and_names", _cells_and_names)
    monkeypatch.setattr(nn, "Dropout", RandLikeDropout)


class Layer(nn.Cell):
    """A BERT-style layer as mindnlp writes it (``nn.Dropout`` looked up when built)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Dense(8, 8)
        self.attn_drop = nn.Dropout(p=0.25)
        self.out = nn.Dense(8, 8)
        self.drop = nn.Dropout(p=0.25)

    def construct(self, x):
        h = self.attn_drop(ops.tanh(self.attn(x)))
        return x + self.drop(self.out(h))


class Encoder(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.CellList([Layer(), Layer()])

    def construct(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_patch_breaks_every_forward_hook(patched_cells):
    """Control: with the patch in place a forward hook fails, recomp or not."""
    model = Encoder()
    model.register_forward_hook(lambda cell, inputs, output: None)
    with pytest.raises(TypeError, match="positional argument"):
        model(tensor(2, 8))


def test_apply_activation_checkpointing_works_and_is_exact(patched_cells):
    ms.set_seed(3)
    ref = Encoder()
    ms.set_seed(3)
    model = Encoder()
    copy_params(ref, model)
    for m in (ref, model):
        m.set_train()
    assert isinstance(model.layers[0].drop, RandLikeDropout)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.UnreplayableDropoutWarning)
        rm.apply_activation_checkpointing(
            model, checkpoint_fn=Layer, exclude_fn=lambda c: c is model.layers[0].attn
        )
    x = tensor(4, 8)
    for _ in range(2):  # the reach check runs at the second call here
        ms.set_seed(11)
        expected = grads(ref, ref.trainable_params(), x)
        ms.set_seed(11)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            actual = grads(model, model.trainable_params(), x)
        assert_same(expected, actual)
    # a rand_like dropout replays exactly: neither excluded nor given a kept mask
    assert type(model.layers[0].drop) is RandLikeDropout
    assert (model.layers[0].attn.region_runs, model.layers[0].attn.region_skips) == (2, 2)


def test_reach_check_still_warns_without_forward_hooks(patched_cells):
    class Detour(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.layer = Layer()
            self.construct_of_layer = self.layer.construct  # taken before wrapping

        def construct(self, x):
            return self.construct_of_layer(x)

    model = rm.apply_activation_checkpointing(Detour(), checkpoint_fn=Layer)
    x = tensor(2, 8)
    model(x)
    with pytest.warns(recomp.WrapperNotReachedWarning, match="'layer' in .*Detour"):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recomp.WrapperNotReachedWarning)
        model(x)
    assert np.isfinite(model(x).asnumpy()).all()


def test_dropout_rebound_before_recomp_is_imported_is_not_reported(tmp_path):
    """mindnlp is imported first: ``mindspore.nn.Dropout`` is its rand_like cell by the
    time recomp looks, and recomp must not take it for MindSpore's own."""
    script = tmp_path / "rebound.py"
    script.write_text(
        textwrap.dedent(
            """
            import warnings
            import mindspore as ms
            from mindspore import nn, ops
            from test_patched_cells import Layer, RandLikeDropout
            nn.Dropout = RandLikeDropout
            import recomp, recomp.mindspore as rm
            layer = Layer()
            assert isinstance(layer.drop, RandLikeDropout)
            warnings.simplefilter("error", recomp.UnreplayableDropoutWarning)
            rm.checkpoint_wrapper(layer)
            assert type(layer.drop) is RandLikeDropout
            print("OK")
            """
        )
    )
    here = os.path.dirname(os.path.abspath(__file__))  # this module, imported by name there
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, str(paths.SUPPORT), *sys.path])}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
