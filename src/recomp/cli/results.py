"""Typed results of ``recomp bench`` and the JSON file they make (no framework imports).

A :class:`Result` is one row: one strategy of one framework measured in one child
process, with the step times of the interleaved timing run and, for ``plan@B`` rows, a
:class:`PlanCheck` of the plan's predictions. :class:`WrapperOverhead` is the cost of an
exclude wrapper on a tiny op. A :class:`Report` is the JSON file: measurements only; how
they compare with the project's own targets is judged by ``benchmarks/targets.py``.

The JSON keeps the flat layout of the first files (``results[i]["replay_flops"]``):

* version 1 (files without ``"version"``): rows carried only the keys their measurement
  filled in, targets had no ``id``, and three different targets were labelled 4;
* version 2: every row of a measurement carries every key, ``null`` where the quantity
  was not measured (FLOPs of compiled or MindSpore runs, step times of the scenario),
  except ``plan`` and ``timing_error``, present when set; error rows still carry only
  ``framework``, ``strategy`` and ``error``; each target has a unique ``id``;
* version 3: as version 2, without ``targets``: the command reports what it measured
  and judges nothing.

``load_report`` reads all three (the verdicts of versions 1 and 2 are not read: they
follow from the rows, see ``benchmarks/targets.py``). Strategies are read under their
names now (``exclude-attn`` of earlier files is ``exclude:attn``: ``strategies.canonical``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from .config import BenchConfig
from .strategies import canonical
from .timing import summarize_times

REPORT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


class ReportFormatError(ValueError):
    """A benchmark JSON file that this version of recomp cannot read."""


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class Offload:
    """What ``offload=True`` moved in the measured step."""

    host_bytes: int
    restored_bytes: int
    prefetched_bytes: int
    copy_s: float


_PLAN_REQUIRED = (
    "budget",
    "predicted_activation_bytes",
    "predicted_replay_flops",
)


@dataclass
class PlanCheck:
    """A ``plan@B`` row's plan: its budget and options, the profile's predictions and,
    once the timing run is in, the slowdown over no checkpointing predicted and measured
    in that run."""

    budget: str | None
    budget_bytes: int
    options: dict[str, str]
    predicted_activation_bytes: int | None
    predicted_replay_flops: int | None
    predicted_step_time_s: float
    profiled_baseline_step_s: float
    predicted_replay_s: float
    clock: str
    predicted_ratio_to_none: float | None = None
    measured_ratio_to_none: float | None = None
    predicted_step_time_same_run_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        # The same-run figures exist only once a timing run of ``none`` is in.
        return {k: v for k, v in asdict(self).items() if v is not None or k in _PLAN_REQUIRED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanCheck:
        return cls(**_known(cls, data))


@dataclass
class Result:
    """One strategy of one framework. ``framework`` is the row label: ``torch``,
    ``torch+BACKEND`` for a compiled run, or ``mindspore``. A field left ``None`` was not
    measured (FLOPs and region calls of compiled models, FLOPs of MindSpore); a row with
    ``error`` set failed and holds nothing else."""

    framework: str
    strategy: str
    device: str | None = None
    memory_source: str | None = None
    activation_bytes: int | None = None
    peak_bytes: int | None = None
    retained_after_step_bytes: int | None = None
    offload: Offload | None = None
    max_grad_diff: float | None = None
    loss: float | None = None
    num_layers: int | None = None
    config: BenchConfig | None = None
    # FLOPs of one step by phase (see ``measure.SplitFlopCounter``).
    forward_flops: int | None = None
    replay_flops: int | None = None
    replay_flops_recomp_state: int | None = None
    backward_flops: int | None = None
    excluded_flops: int | None = None
    layer_forward_flops: int | None = None
    total_flops: int | None = None
    flops_by_op: dict[str, dict[str, int]] | None = None
    # Excluded regions by name: executions, skips in the replay, calls, bytes kept.
    region_runs: dict[str, int] | None = None
    region_skips: dict[str, int] | None = None
    region_calls: dict[str, int] | None = None
    region_saved_bytes: dict[str, int] | None = None
    # Step times of the timing run (medians, spread, the samples), wall and CPU.
    step_time_s: float | None = None
    step_time_spread_s: float | None = None
    step_times_s: list[float] | None = None
    step_cpu_time_s: float | None = None
    step_cpu_times_s: list[float] | None = None
    timing_error: str | None = None
    plan: PlanCheck | None = None
    error: str | None = None

    def set_step_times(self, wall: list[float], cpu: list[float]) -> None:
        """The step times of the timing run: medians, spread, the samples."""
        self.step_time_s, self.step_time_spread_s = summarize_times(wall)
        self.step_times_s = wall
        self.step_cpu_time_s = summarize_times(cpu)[0]
        self.step_cpu_times_s = cpu

    def to_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"framework": self.framework, "strategy": self.strategy, "error": self.error}
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("error", "timing_error", "plan") and value is None:
                continue
            if isinstance(value, (Offload, BenchConfig)):
                value = asdict(value)
            elif isinstance(value, PlanCheck):
                value = value.to_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        values = _known(cls, data)
        if values.get("offload") is not None:
            values["offload"] = Offload(**values["offload"])
        if values.get("config") is not None:
            values["config"] = BenchConfig.from_dict(_known(BenchConfig, values["config"]))
        if values.get("plan") is not None:
            values["plan"] = PlanCheck.from_dict(values["plan"])
        return cls(**values)


def find_result(results: list[Result], framework: str, strategy: str) -> Result | None:
    """The row of ``strategy`` (named in any version's spelling) under the row label
    ``framework`` that did not fail."""
    name = canonical(strategy)
    for r in results:
        if r.framework == framework and canonical(r.strategy) == name and r.error is None:
            return r
    return None


@dataclass
class WrapperOverhead:
    """Cost of ``checkpoint_exclude_wrapper`` on a tiny op, in microseconds per call
    (``recomp.cli.torch.overhead``): inside a checkpointed step and outside any
    checkpoint, wall and CPU time, and the op itself."""

    op: str
    calls_per_checkpoint: int
    outside_us: float
    in_checkpoint_us: float
    outside_cpu_us: float
    in_checkpoint_cpu_us: float
    plain_op_us: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WrapperOverhead:
        return cls(**_known(cls, data))


@dataclass
class Report:
    """A ``recomp bench --json`` file."""

    command: str
    environment: dict[str, Any]
    elapsed_s: float
    results: list[Result]
    scenario: list[Result]
    overhead: WrapperOverhead | None
    notes: list[str]
    version: int = REPORT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "command": self.command,
            "environment": self.environment,
            "elapsed_s": self.elapsed_s,
            "results": [r.to_dict() for r in self.results],
            "scenario": [r.to_dict() for r in self.scenario],
            "overhead": None if self.overhead is None else self.overhead.to_dict(),
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        version = data.get("version", 1)
        if version not in READABLE_VERSIONS:
            readable = ", ".join(str(v) for v in READABLE_VERSIONS)
            raise ReportFormatError(
                f"benchmark report version {version!r} is not supported: this recomp reads "
                f"versions {readable}"
            )
        overhead = data.get("overhead")
        return cls(
            command=data.get("command", ""),
            environment=dict(data.get("environment") or {}),
            elapsed_s=float(data.get("elapsed_s") or 0.0),
            results=[_renamed(Result.from_dict(r)) for r in data["results"]],
            scenario=[_renamed(Result.from_dict(r)) for r in data.get("scenario") or []],
            overhead=None if overhead is None else WrapperOverhead.from_dict(overhead),
            notes=list(data.get("notes") or []),
            version=REPORT_VERSION,
        )


def _renamed(row: Result) -> Result:
    """``row`` with its strategy under its name now (files of earlier versions)."""
    row.strategy = canonical(row.strategy)
    return row


def write_report(path: str | os.PathLike[str], report: Report) -> None:
    write_json(path, report.to_dict())


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")


def load_report(path: str | os.PathLike[str]) -> Report:
    """A report written by ``recomp bench --json``, of any version this recomp reads."""
    with open(path) as f:
        return Report.from_dict(json.load(f))
