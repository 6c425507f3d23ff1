"""Saved-tensor reports of a strategy, for ``recomp report`` and ``recomp bench --report``:
which framework's runner makes them, and the files ``--report DIR`` writes (no framework
imports here; the runners import theirs when called)."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from .config import BenchConfig
from .plots import write_report_png

MINDSPORE_MODEL = "MindSpore decoder of recomp bench"

#: What the pictures mark as references: no checkpoint and full checkpointing.
REFERENCES = ("none", "full")


def reporter(framework: str, config: BenchConfig) -> tuple[Callable[[BenchConfig, str], Any], str]:
    """The report function of ``framework`` (``config, strategy -> report``) and the name
    of the model it reports on."""
    if framework == "torch":
        from .torch.runner import report_strategy

        return report_strategy, config.model
    from .mindspore.runner import report_strategy as report_mindspore

    return report_mindspore, MINDSPORE_MODEL


@contextlib.contextmanager
def temporary_compile_cache() -> Iterator[None]:
    """PyTorch makes its compile cache directory (``torchinductor_USER`` in the temporary
    directory) when ``torch._dynamo`` is first imported, which checkpointing does. A
    report compiles nothing: unless ``TORCHINDUCTOR_CACHE_DIR`` names one, the cache of
    this process goes into a temporary directory removed when the report is done."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="recomp-report-") as scratch:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, "torchinductor")
        try:
            yield
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def file_stem(strategy: str) -> str:
    """A strategy's name in a file name: ``exclude:attn+mlp`` -> ``exclude-attn-mlp``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", re.sub(r"[:+]", "-", strategy))


def write_strategy_reports(
    directory: str, config: BenchConfig, strategies: list[str], framework: str = "torch"
) -> list[str]:
    """For ``recomp bench --report``: ``report-<strategy>.txt`` and ``.png`` per strategy in
    ``directory`` (``report-mindspore-<strategy>`` for MindSpore); returns the paths
    written (no pictures without matplotlib)."""
    os.makedirs(directory, exist_ok=True)
    report_of, model = reporter(framework, config)
    prefix = "report-" if framework == "torch" else "report-mindspore-"
    written = []
    with temporary_compile_cache():
        references = {s: report_of(config, s) for s in REFERENCES}
        for strategy in strategies:
            known = references.get(strategy)
            report = known if known is not None else report_of(config, strategy)
            stem = os.path.join(directory, prefix + file_stem(strategy))
            with open(stem + ".txt", "w") as f:
                f.write(f"strategy {strategy}, model {model}\n{report.format()}\n")
            written.append(stem + ".txt")
            if write_report_png(stem + ".png", report, strategy, references):
                written.append(stem + ".png")
    return written
