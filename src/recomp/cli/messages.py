"""The messages between ``recomp bench`` / ``recomp plan`` and their child processes
(``python -m recomp.cli.worker TASK.json RESULT.json``), typed, and their JSON, written and
read here only (no framework imports).

* parent to child: a :class:`Task`, in TASK.json;
* child to parent while it runs: :class:`ProgressMessage` lines on its stdout (other
  lines there, a library's output, are not messages and are passed over);
* child to parent at the end: the result of its task's kind, in RESULT.json:
  :class:`MeasureResult` (``measure``), :class:`TimingResult` (``time``) or
  :class:`PlanResult` (``plan``).

Whatever is read is checked against the message it should be: a file or line that does
not fit raises :class:`MessageError`, which says which message, which field, and what
was found instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from .config import BenchConfig
from .results import Result, WrapperOverhead
from .timing import StepTimes

TaskKind = Literal["measure", "time", "plan"]
Framework = Literal["torch", "mindspore"]
TASK_KINDS: tuple[str, ...] = get_args(TaskKind)
FRAMEWORKS: tuple[str, ...] = get_args(Framework)


class MessageError(ValueError):
    """A message between the command and a child process that does not read as the
    message it should be."""


# --------------------------------------------------------------------------- reading


def _decode(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MessageError(f"{what}: not JSON ({exc})") from None
    return _mapping(data, what)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MessageError(f"{what}: expected a JSON object, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value) if _is_json(value) else repr(value)
    return f"{type(value).__name__} {text[:80]}"


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _get(data: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``data[name]``, which must be present and of type ``kind`` (a bool is no int)."""
    if name not in data:
        raise MessageError(f"{what}: missing field {name!r}")
    value = data[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise MessageError(f"{what}: field {name!r} must be {_names(kinds)}, got {_shown(value)}")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _choice(data: dict[str, Any], name: str, choices: tuple[str, ...], what: str) -> Any:
    value = _get(data, name, str, what)
    if value not in choices:
        raise MessageError(
            f"{what}: field {name!r} must be one of {', '.join(choices)}, got {value!r}"
        )
    return value


def _no_other_fields(data: dict[str, Any], known: set[str], what: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise MessageError(f"{what}: unknown fields {', '.join(map(repr, unknown))}")


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MessageError(f"{what}: expected a list of strings, got {_shown(value)}")
    return list(value)


def _samples(value: Any, what: str) -> dict[str, list[float]]:
    """Step times by strategy: ``{strategy: [seconds, ...]}``."""
    out: dict[str, list[float]] = {}
    for strategy, times in _mapping(value, what).items():
        if not isinstance(times, list) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) for t in times
        ):
            raise MessageError(f"{what}[{strategy!r}]: expected a list of seconds")
        out[strategy] = [float(t) for t in times]
    return out


def _config(value: Any, what: str) -> BenchConfig:
    """A :class:`BenchConfig` from its dict: every field known, each of its default's type."""
    data = _mapping(value, what)
    defaults = BenchConfig()
    _no_other_fields(data, {f.name for f in fields(BenchConfig)}, what)
    for f in fields(BenchConfig):
        if f.name not in data:
            continue
        default = getattr(defaults, f.name)
        if f.name == "compile":
            expected: tuple[type, ...] = (str, type(None))
        else:
            expected = (type(default),)
        _get(data, f.name, expected, what)
    return BenchConfig.from_dict(data)


# --------------------------------------------------------------------------- task


@dataclass(frozen=True)
class Task:
    """What one child process does: ``measure`` each strategy (memory, FLOPs, gradients;
    one child per strategy gives clean allocator readings), ``time`` all of them
    interleaved in one process (and, with ``overhead``, the exclude wrapper's own cost:
    PyTorch only), or ``plan``: profile the model once and make the plan of each
    ``plan@B`` strategy (PyTorch only)."""

    kind: TaskKind
    framework: Framework
    config: BenchConfig
    strategies: tuple[str, ...]
    overhead: bool = False

    def __post_init__(self) -> None:
        what = "task"
        if self.kind not in TASK_KINDS:
            raise MessageError(f"{what}: kind must be one of {', '.join(TASK_KINDS)}")
        if self.framework not in FRAMEWORKS:
            raise MessageError(f"{what}: framework must be one of {', '.join(FRAMEWORKS)}")
        if self.kind == "plan" and self.framework != "torch":
            raise MessageError(f"{what}: plans are made for PyTorch models only")
        if self.overhead and (self.kind != "time" or self.framework != "torch"):
            raise MessageError(f"{what}: the overhead is timed by a PyTorch time task only")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "framework": self.framework,
            "config": self.config.to_dict(),
            "strategies": list(self.strategies),
            "overhead": self.overhead,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        what = "task"
        data = _mapping(data, what)
        _no_other_fields(data, {f.name for f in fields(cls)}, what)
        return cls(
            kind=_choice(data, "kind", TASK_KINDS, what),
            framework=_choice(data, "framework", FRAMEWORKS, what),
            config=_config(_get(data, "config", dict, what), "task config"),
            strategies=tuple(_strings(_get(data, "strategies", list, what), "task strategies")),
            overhead=_get(data, "overhead", bool, what) if "overhead" in data else False,
        )

    @classmethod
    def from_json(cls, text: str) -> Task:
        return cls.from_dict(_decode(text, "task"))


# --------------------------------------------------------------------------- progress


@dataclass(frozen=True)
class ProgressMessage:
    """``done`` of ``total`` steps of a task, one line on the child's stdout."""

    done: int
    total: int

    PREFIX = "recomp-progress "

    def to_line(self) -> str:
        return self.PREFIX + json.dumps({"done": self.done, "total": self.total})

    @classmethod
    def from_line(cls, line: str) -> ProgressMessage | None:
        """The message on ``line``, or None for a line that is not one (anything a
        library prints); a line that starts like a message but does not read as one
        raises :class:`MessageError`."""
        if not line.startswith(cls.PREFIX):
            return None
        what = "progress message"
        data = _decode(line[len(cls.PREFIX) :], what)
        _no_other_fields(data, {"done", "total"}, what)
        done, total = _get(data, "done", int, what), _get(data, "total", int, what)
        if not 0 <= done <= total:
            raise MessageError(f"{what}: done ({done}) must lie between 0 and total ({total})")
        return cls(done, total)

    @property
    def fraction(self) -> float:
        return self.done / max(1, self.total)


# --------------------------------------------------------------------------- results


@dataclass
class MeasureResult:
    """The rows of a ``measure`` task, one per strategy (a failed strategy's row holds
    its error)."""

    results: list[Result]

    def to_dict(self) -> dict[str, Any]:
        return {"results": [r.to_dict() for r in self.results]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasureResult:
        what = "measure result"
        rows = _get(data, "results", list, what)
        results = []
        for i, row in enumerate(rows):
            where = f"{what} row {i}"
            row = _mapping(row, where)
            _get(row, "framework", str, where)
            _get(row, "strategy", str, where)
            try:
                results.append(Result.from_dict(row))
            except (TypeError, ValueError) as exc:
                raise MessageError(f"{where}: {exc}") from None
        return cls(results)


@dataclass
class TimingResult:
    """The step times of a ``time`` task, and the wrapper overhead if it was asked for."""

    times: StepTimes
    overhead: WrapperOverhead | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall": self.times.wall,
            "cpu": self.times.cpu,
            "overhead": None if self.overhead is None else self.overhead.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TimingResult:
        what = "timing result"
        wall = _samples(_get(data, "wall", dict, what), f"{what} wall")
        cpu = _samples(_get(data, "cpu", dict, what), f"{what} cpu")
        if set(wall) != set(cpu):
            raise MessageError(f"{what}: wall and cpu times name different strategies")
        overhead = data.get("overhead")
        if overhead is not None:
            try:
                overhead = WrapperOverhead.from_dict(_mapping(overhead, f"{what} overhead"))
            except TypeError as exc:
                raise MessageError(f"{what} overhead: {exc}") from None
        return cls(StepTimes(wall, cpu), overhead)


@dataclass
class PlanResult:
    """What a ``plan`` task made: the plan of each ``plan@B`` strategy that got one (a
    ``recomp.plan`` plan file as a dict), why the others got none, the profile (as a
    dict) and the clock it was timed with (``wall`` or ``cpu``)."""

    plans: dict[str, dict[str, Any]]
    profile: dict[str, Any]
    clock: str
    errors: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plans": self.plans,
            "errors": self.errors,
            "profile": self.profile,
            "clock": self.clock,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanResult:
        what = "plan result"
        plans = _get(data, "plans", dict, what)
        for strategy, plan in plans.items():
            _mapping(plan, f"{what} plan {strategy!r}")
        errors = _get(data, "errors", dict, what)
        for strategy, error in errors.items():
            if not isinstance(error, str):
                raise MessageError(f"{what}: error of {strategy!r} must be a string")
        return cls(
            plans=plans,
            profile=_get(data, "profile", dict, what),
            clock=_choice(data, "clock", ("wall", "cpu"), what),
            errors=errors,
        )


TaskResult = MeasureResult | TimingResult | PlanResult

_RESULTS: dict[str, type[MeasureResult] | type[TimingResult] | type[PlanResult]] = {
    "measure": MeasureResult,
    "time": TimingResult,
    "plan": PlanResult,
}


def result_to_json(kind: TaskKind, result: TaskResult) -> str:
    """RESULT.json of a task of ``kind``: the result, tagged with the kind."""
    expected = _RESULTS[kind]
    if not isinstance(result, expected):
        raise MessageError(f"a {kind} task returns a {expected.__name__}, not {type(result)}")
    return json.dumps({"kind": kind, **result.to_dict()})


def result_from_json(kind: TaskKind, text: str) -> TaskResult:
    """The result of a task of ``kind`` from its RESULT.json, checked."""
    data = _decode(text, f"{kind} result")
    found = _choice(data, "kind", TASK_KINDS, f"{kind} result")
    if found != kind:
        raise MessageError(f"expected the result of a {kind} task, got one of a {found} task")
    body = {k: v for k, v in data.items() if k != "kind"}
    return _RESULTS[kind].from_dict(body)
