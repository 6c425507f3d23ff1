"""The exact choice of one option per layer under a memory budget (no framework imports).

Each layer offers options (no checkpoint, full checkpoint, checkpoint with some regions
excluded), each with the bytes it keeps for backward and the replay work it costs. The
plan minimizes the replay cost, ``(seconds, FLOPs)`` compared in that order, subject to

    shared + sum_i kept(i, o_i) + sum_i pair(i, o_{i-1}, o_i) <= budget

where ``pair`` holds the bytes of storages that two adjacent layers may both keep (a
layer's output that the next layer keeps as its input, say): counted once when either
keeps them.

The solver is a dynamic program over layers whose state is the option of the previous
layer; for each state it keeps the Pareto frontier of (bytes, cost) over all prefixes.
A point is dropped only when another has no more bytes and no higher cost, or when it
cannot fit the budget even with the smallest options for the remaining layers, so the
result is optimal, not an approximation: no discretization of bytes is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .budget import BudgetTooSmallError


@dataclass(frozen=True)
class Option:
    """One way to run one layer: ``kept_bytes`` it keeps, the replay it costs."""

    name: str
    kept_bytes: int
    replay_s: float = 0.0
    replay_flops: int = 0


@dataclass
class LayerOptions:
    """The options of one layer. ``pair_bytes[(a, b)]``: bytes kept in addition when the
    previous layer runs its option ``a`` and this layer its option ``b`` (omitted: 0)."""

    path: str
    options: Sequence[Option]
    pair_bytes: dict[tuple[int, int], int] = field(default_factory=dict)

    def pair(self, previous: int | None, option: int) -> int:
        if previous is None or not self.pair_bytes:
            return 0
        return self.pair_bytes.get((previous, option), 0)


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    kept_bytes: int
    replay_s: float
    replay_flops: int


class _Point:
    __slots__ = ("flops", "nbytes", "option", "parent", "seconds")

    def __init__(
        self, nbytes: int, seconds: float, flops: int, option: int, parent: _Point | None
    ) -> None:
        self.nbytes = nbytes
        self.seconds = seconds
        self.flops = flops
        self.option = option
        self.parent = parent

    def choice(self) -> tuple[int, ...]:
        out: list[int] = []
        point: _Point | None = self
        while point is not None:
            out.append(point.option)
            point = point.parent
        return tuple(reversed(out))


def evaluate(
    layers: Sequence[LayerOptions], choice: Sequence[int], shared_bytes: int = 0
) -> Solution:
    """Bytes and replay cost of one assignment of options to layers."""
    if len(choice) != len(layers):
        raise ValueError(f"{len(choice)} options given for {len(layers)} layers")
    nbytes, seconds, flops = shared_bytes, 0.0, 0
    previous: int | None = None
    for layer, index in zip(layers, choice):
        option = layer.options[index]
        nbytes += option.kept_bytes + layer.pair(previous, index)
        seconds += option.replay_s
        flops += option.replay_flops
        previous = index
    return Solution(tuple(choice), nbytes, seconds, flops)


def minimum_bytes(layers: Sequence[LayerOptions], shared_bytes: int = 0) -> Solution:
    """The assignment that keeps the fewest bytes (ties: the cheapest)."""
    return _solve(layers, None, shared_bytes)


def solve(layers: Sequence[LayerOptions], budget_bytes: int, shared_bytes: int = 0) -> Solution:
    """The cheapest assignment (replay seconds, then FLOPs) that keeps at most
    ``budget_bytes``. Raises :class:`BudgetTooSmallError` when none fits."""
    return _solve(layers, budget_bytes, shared_bytes)


def _frontier(points: list[_Point]) -> list[_Point]:
    """Pareto-optimal points in (bytes, (seconds, flops)), by ascending bytes."""
    points.sort(key=lambda p: (p.nbytes, p.seconds, p.flops))
    kept: list[_Point] = []
    for p in points:
        if not kept or (p.seconds, p.flops) < (kept[-1].seconds, kept[-1].flops):
            kept.append(p)
    return kept


def _solve(layers: Sequence[LayerOptions], budget: int | None, shared_bytes: int) -> Solution:
    if not layers:
        raise ValueError("nothing to plan: no layers")
    for layer in layers:
        if not layer.options:
            raise ValueError(f"layer {layer.path!r} has no options")
    # Least bytes the layers from i on can still add (pair bytes are >= 0): a bound for pruning.
    suffix_min = [0] * (len(layers) + 1)
    for i in range(len(layers) - 1, -1, -1):
        suffix_min[i] = suffix_min[i + 1] + min(o.kept_bytes for o in layers[i].options)

    def fits(nbytes: int, i: int) -> bool:
        return budget is None or nbytes + suffix_min[i + 1] <= budget

    # states[o]: frontier of prefixes ending with option o of the current layer.
    states: dict[int, list[_Point]] = {}
    first = layers[0]
    for o, option in enumerate(first.options):
        p = _Point(shared_bytes + option.kept_bytes, option.replay_s, option.replay_flops, o, None)
        if fits(p.nbytes, 0):
            states[o] = [p]
    for i in range(1, len(layers)):
        layer = layers[i]
        nxt: dict[int, list[_Point]] = {}
        for o, option in enumerate(layer.options):
            candidates: list[_Point] = []
            for previous, frontier in states.items():
                extra = option.kept_bytes + layer.pair(previous, o)
                for p in frontier:
                    nbytes = p.nbytes + extra
                    if fits(nbytes, i):
                        candidates.append(
                            _Point(
                                nbytes,
                                p.seconds + option.replay_s,
                                p.flops + option.replay_flops,
                                o,
                                p,
                            )
                        )
            if candidates:
                nxt[o] = _frontier(candidates)
        states = nxt
        if not states:
            break
    finals = [p for frontier in states.values() for p in frontier]
    if not finals:
        assert budget is not None
        least = _solve(layers, None, shared_bytes)
        raise BudgetTooSmallError(budget, least.kept_bytes, _describe_minimum(layers, least))
    if budget is None:
        best = min(finals, key=lambda p: (p.nbytes, p.seconds, p.flops))
    else:
        best = min(finals, key=lambda p: (p.seconds, p.flops, p.nbytes))
    return Solution(best.choice(), best.nbytes, best.seconds, best.flops)


def _describe_minimum(layers: Sequence[LayerOptions], least: Solution) -> str:
    names = {layers[i].options[o].name for i, o in enumerate(least.choice)}
    if len(names) == 1:
        return f" (option {names.pop()!r} for every layer)"
    return ""
