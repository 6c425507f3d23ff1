"""The names of checkpointing strategies, for ``recomp bench`` and ``recomp report`` (no
framework imports): their grammar, which runs take which, the spellings of earlier
versions, and the check of a command line's strategies before anything runs.

A strategy is what every layer gets. Where a plan file has a layer option for it, the
strategy is named by that option (``recomp.plan.planfile``): ``none``, ``full``,
``exclude:R[+R...]``, ``selective``, ``selective+exclude:R[+R...]``,
``full+swap-inputs``, ``swap``, ``offload``, ``exclude-offload:R[+R...]``,
``full+partition-inputs``, ``full+replay-collectives``. The benchmark's other points of
comparison are written
the same way, ``KIND:R[+R...]`` where they name regions and ``KIND@VALUE`` where they
take a number (``KINDS`` below says what each is). A region ``R`` is a child of every
layer, by name; ``attn`` also finds ``self_attn`` and ``attention``, ``mlp`` also
``feed_forward`` and ``ffn`` (``REGION_ALIASES``).

Earlier versions of ``recomp bench`` wrote ``exclude-attn``, ``sac-attn``,
``exclude-attn-offload``, ``full-swap-inputs``, ``swap-mm``, ``full:no-keep``: those
spellings are still accepted, and :func:`renamed` gives their names now (benchmark files
of versions 1 to 3 are read with it).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Literal

from ..plan.budget import parse_budget
from .args import close_matches

#: The names a region of a layer is found under (the first child that exists).
REGION_ALIASES: dict[str, tuple[str, ...]] = {
    "attn": ("attn", "self_attn", "attention"),
    "mlp": ("mlp", "feed_forward", "ffn"),
}

#: Where a strategy runs: PyTorch eager, PyTorch under torch.compile (``--compile``),
#: MindSpore, the tensor-parallel comparison (``--tp``).
Run = Literal["eager", "compiled", "mindspore", "tp"]
_TORCH: frozenset[Run] = frozenset({"eager", "compiled"})
_EVERYWHERE: frozenset[Run] = frozenset({"eager", "compiled", "mindspore", "tp"})


@dataclass(frozen=True)
class Kind:
    """A kind of strategy: how it is written (``plain``: its name alone; ``regions``:
    ``NAME:R[+R...]``; ``value``: ``NAME@VALUE``), where it runs, what it is."""

    name: str
    form: Literal["plain", "regions", "value"]
    what: str
    runs: frozenset[Run] = _TORCH
    # A kind that names regions and may be written without them: the region it means.
    default_region: str | None = None
    example: str = ""

    @property
    def spelling(self) -> str:
        """How the kind is written, for lists of what there is: ``exclude:R[+R...]``,
        ``every@K`` (the letter its description uses)."""
        if self.form == "regions":
            return f"{self.name}:R[+R...]"
        if self.form == "value":
            return f"{self.name}@{_VALUE_LETTERS[self.name]}"
        return self.name


_VALUE_LETTERS = {"every": "K", "plan": "B", "budget": "F"}


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("none", "plain", "no checkpointing", _EVERYWHERE),
        Kind("full", "plain", "a full checkpoint around every layer", _EVERYWHERE),
        Kind(
            "exclude",
            "regions",
            "recomp: every layer checkpointed, its regions R excluded from the replay",
            _EVERYWHERE,
            example="exclude:attn",
        ),
        Kind(
            "selective",
            "plain",
            "recomp's checkpoint keeping the outputs of each layer's expensive ops "
            "(recomp.plan.policy)",
        ),
        Kind(
            "selective+exclude",
            "regions",
            "selective, with the regions R excluded",
            example="selective+exclude:attn",
        ),
        Kind(
            "full+swap-inputs",
            "plain",
            "recomp's full checkpoint, its saved inputs on the host until the replay",
        ),
        Kind("swap", "plain", "no checkpoint, what each layer saves on the host until backward"),
        Kind(
            "offload",
            "plain",
            "no checkpoint, what each layer saves of at least 1 MiB per storage on the host "
            "until backward (the size offload sessions move from)",
        ),
        Kind(
            "full+partition-inputs",
            "plain",
            "a plan option: recomp's full checkpoint, its saved inputs split over the "
            "tensor-parallel group until the replay gathers them (recomp simulate, apply_plan)",
            frozenset(),
        ),
        Kind(
            "full+swap-matmuls",
            "plain",
            "recomp's full checkpoint, its matmuls' outputs on the host instead of recomputed",
        ),
        Kind(
            "sac",
            "regions",
            "PyTorch selective checkpointing saving the outputs of R's ops (sac: sac:attn)",
            default_region="attn",
            example="sac:attn",
        ),
        Kind(
            "torch-remat",
            "regions",
            "torch-remat, R kept (torch-remat: torch-remat:attn)",
            default_region="attn",
            example="torch-remat:attn",
        ),
        Kind(
            "keep",
            "regions",
            "a reference exclusion without deferred inputs: R keeps all it saves",
            example="keep:attn",
        ),
        Kind(
            "exclude-offload",
            "regions",
            "exclude:R, what R keeps offloaded to host memory",
            example="exclude-offload:attn",
        ),
        Kind(
            "every",
            "value",
            "a full checkpoint around every K-th layer only",
            example="every@2",
        ),
        Kind(
            "plan",
            "value",
            "recomp.plan's fastest plan within budget B (50%, 6GiB)",
            example="plan@50%",
        ),
        Kind(
            "budget",
            "value",
            "PyTorch's compiled activation_memory_budget = F alone (with --compile)",
            frozenset({"compiled"}),
            example="budget@0.5",
        ),
        Kind(
            "full+replay-collectives",
            "plain",
            "full, its replay running the collectives again (exclude_collectives=False)",
            frozenset({"tp"}),
        ),
        Kind(
            "full+replay-collectives+exclude",
            "regions",
            "exclude:R, its replay running the collectives again",
            frozenset({"tp"}),
            example="full+replay-collectives+exclude:attn",
        ),
    )
}


class StrategyError(ValueError):
    """A strategy name that does not parse, or that the run cannot take: the message
    says what to write instead."""


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy: its kind, the regions it names or the value it takes, and
    the text it was read from (``given``: ``sac`` for ``sac:attn``, an earlier
    spelling)."""

    kind: str
    regions: tuple[str, ...] = ()
    value: str = ""
    given: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        """The strategy's name, as the tables and files write it."""
        if self.value:
            return f"{self.kind}@{self.value}"
        if self.regions:
            return f"{self.kind}:{'+'.join(self.regions)}"
        return self.kind

    @property
    def renamed(self) -> bool:
        """Whether it was given in an earlier version's spelling."""
        return renamed(self.given) is not None

    def __str__(self) -> str:
        return self.name


# --------------------------------------------------------------------------- earlier spellings


def renamed(text: str) -> str | None:
    """The name now of a strategy written in an earlier version's spelling
    (``exclude-attn`` -> ``exclude:attn``), or None if ``text`` is not one."""
    fixed = {
        "full-swap-inputs": "full+swap-inputs",
        "swap-mm": "full+swap-matmuls",
        "full:no-keep": "full+replay-collectives",
    }
    if text in fixed:
        return fixed[text]
    if text.endswith(":no-keep"):
        inner = renamed(text[: -len(":no-keep")])
        if inner and inner.startswith("exclude:"):
            return "full+replay-collectives+" + inner
        return None
    if text.startswith("exclude-") and text.endswith("-offload") and len(text) > 16:
        return "exclude-offload:" + text[len("exclude-") : -len("-offload")]
    for kind in ("torch-remat", "exclude", "sac", "keep"):
        region = text[len(kind) + 1 :] if text.startswith(kind + "-") else ""
        if region and not region.startswith("offload"):
            return f"{kind}:{region}"
    return None


def canonical(text: str) -> str:
    """The name now of ``text``, a strategy of any version; what does not parse is
    returned as it is (for reading files, which judge nothing)."""
    try:
        return parse(text).name
    except StrategyError:
        return text


# --------------------------------------------------------------------------- parsing


def parse(text: str) -> Strategy:
    """The strategy ``text`` names (an earlier spelling too); :class:`StrategyError`,
    with the closest names, if it names none."""
    given = text.strip()
    name = renamed(given) or given
    if "@" in name:
        kind_name, _, value = name.partition("@")
        regions: tuple[str, ...] = ()
    else:
        kind_name, sep, listed = name.partition(":")
        regions = tuple(listed.split("+")) if sep else ()
        value = ""
    kind = KINDS.get(kind_name)
    if kind is None:
        raise StrategyError(f"unknown strategy {given!r}{_suggest(given, kind_name, name)}")
    if kind.form == "plain" and (regions or value):
        raise StrategyError(f"strategy {kind.name} takes no {'value' if value else 'regions'}")
    if kind.form == "value":
        if not value:
            raise StrategyError(f"{kind.name} takes a value: {kind.example} ({kind.what})")
        _check_value(kind, value)
        return Strategy(kind.name, value=value, given=given)
    if kind.form == "regions":
        if not regions and kind.default_region is not None and name == kind.name:
            regions = (kind.default_region,)
        if not regions or not all(regions):
            raise StrategyError(
                f"{given!r}: {kind.name} names the regions, children of each layer: "
                f"{kind.example} or {kind.name}:attn+mlp"
            )
        if value:
            raise StrategyError(f"strategy {kind.name} takes regions, not a value")
    return Strategy(kind.name, regions, given=given)


def _check_value(kind: Kind, value: str) -> None:
    if kind.name == "every":
        if not value.isdigit() or int(value) < 1:
            raise StrategyError(
                f"every@K takes a whole number K >= 1 (a checkpoint around every K-th "
                f"layer), got {value!r}"
            )
    elif kind.name == "plan":
        try:
            parse_budget(value)
        except ValueError as exc:
            raise StrategyError(f"plan@{value}: {exc}") from None
    elif kind.name == "budget":
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not 0.0 <= number <= 1.0:
            raise StrategyError(
                "budget@F takes PyTorch's activation_memory_budget, a number in [0, 1], "
                f"got {value!r}"
            )


def _suggest(given: str, kind_name: str, name: str) -> str:
    """`` (did you mean ...?)`` from the examples and kinds ``given`` is closest to,
    else the list of every strategy."""
    examples = [k.example or k.name for k in KINDS.values()]
    found = close_matches(given, examples)
    rest = name[len(kind_name) :]
    for match in close_matches(kind_name, list(KINDS)):
        kind = KINDS[match]
        respelled = match + rest if kind.form != "plain" else match
        if kind.form != "plain" and not rest and kind.default_region is None:
            respelled = kind.example
        if respelled not in found:
            found.append(respelled)
    if found:
        return f" (did you mean {' or '.join(found[:3])}?)"
    listed = [k.spelling for k in KINDS.values() if k.runs - {"tp"}]
    return f"; the strategies: {', '.join(listed)} (recomp bench --help says what each is)"


def strategy_list(text: str) -> list[Strategy]:
    """``--strategies A,B,...`` as argparse reads it: each strategy parsed (a name that
    does not parse is a usage error naming the closest ones); a strategy named twice
    is refused."""
    try:
        parsed = [parse(part) for part in text.split(",") if part.strip()]
    except StrategyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not parsed:
        raise argparse.ArgumentTypeError("give at least one strategy (none,full,exclude:attn)")
    names = [s.name for s in parsed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"strategy {', '.join(twice)} named twice")
    return parsed


def report_strategy(text: str) -> str:
    """``recomp report --strategy``: a strategy's name, or a plan file (``.json``)."""
    if text.endswith(".json"):
        if not os.path.exists(text):
            raise argparse.ArgumentTypeError(
                f"plan file {text!r} not found (write one with recomp plan --json {text})"
            )
        return text
    try:
        return parse(text).name
    except StrategyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def refused(strategy: Strategy, run: Run) -> str | None:
    """Why ``run`` cannot take ``strategy`` (what to change), or None if it can."""
    kind = KINDS[strategy.kind]
    if run in kind.runs:
        return None
    if not kind.runs:
        return (
            f"{strategy} is a layer option of plans (it needs the tensor-parallel process "
            "group: recomp.plan.apply_plan(..., partition_inputs=group)); recomp bench does "
            "not run it"
        )
    if kind.runs == {"compiled"}:
        return f"{strategy} is PyTorch's compiled memory budget: add --compile"
    if kind.runs == {"tp"}:
        return f"{strategy} compares kept and replayed collectives: it runs with --tp N only"
    takes = [k.spelling for k in KINDS.values() if run in k.runs]
    where = {"mindspore": "MindSpore", "tp": "--tp", "eager": "PyTorch", "compiled": "--compile"}
    return f"{where[run]} runs {', '.join(takes)}; not {strategy}"


def renamed_note(strategies: list[Strategy]) -> str | None:
    """The note for strategies given in an earlier spelling, or None."""
    old = [s for s in strategies if s.renamed]
    if not old:
        return None
    pairs = ", ".join(f"{s.given} is {s.name}" for s in old)
    return f"strategies are named as plan files name layer options now: {pairs}"


def help_text() -> str:
    """The list of strategies, for ``--help``."""
    return "; ".join(f"{k.spelling}: {k.what}" for k in KINDS.values())
