"""Where activation memory goes on MindSpore: ``record_saved_tensors``.

MindSpore PyNative gives no way to walk its gradient graph and read what each node
saved without running backward (PyTorch's report does that after the forward), so
the MindSpore report is recorded while the forward runs: see
``recomp._report.SavedTensorsRecorder``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from .._report import SavedTensorsRecord
from .._report import record_saved_tensors as _record
from ._backend import BACKEND


@contextlib.contextmanager
def record_saved_tensors(
    model: Any = None, inputs: Any = None, layers: Iterable[str] = ()
) -> Iterator[SavedTensorsRecord]:
    """Record what the forward run inside the block saves for backward.

    Wrap one training step (the call of the function ``mindspore.grad`` or
    ``value_and_grad`` made, or a ``TrainOneStepCell``)::

        with record_saved_tensors(net, inputs=x) as record:
            loss, grads = grad_fn(x, y)
        print(record.report)

    ``record.report`` is the same report as ``recomp.torch.report.saved_tensors_report``
    gives (every storage held for backward when the forward ended, billed once, by
    checkpointed layer, excluded region and the Cell that saved it), ready when the
    block ends. ``model`` names layers and regions by their Cell paths and keeps its
    parameters out of the bill; ``inputs``: tensors made before the forward (data,
    labels), saved but not activations. ``layers``: Cell paths (``["layers.0",
    "layers.1"]``) under which tensors saved outside checkpoints are listed, by the
    Cell that saved them (checkpointed layers are named without it). Record one step: a second forward in the
    block adds its rows. The ``op`` column names the innermost Cell running when the
    tensor was saved (MindSpore's hook does not say which operation saved it).
    """
    with _record(BACKEND, model, inputs, layers) as record:
        yield record
