"""The exact choice of one option per layer under a memory budget (no framework imports).

Each layer offers options (no checkpoint, full checkpoint, checkpoint with some regions
excluded, ...), each with the bytes it keeps for backward and the replay work it costs.
The plan keeps at most the budget,

    shared + sum_i kept(i, o_i) + sum_i pair(i, o_{i-1}, o_i) <= budget

where ``pair`` holds the bytes of storages that two adjacent layers may both keep (a
layer's output that the next layer keeps as its input, say): counted once when either
keeps them. Among the plans that fit it takes, in this order:

1. a replay time within ``tolerance_s`` of the fastest plan that fits (the times are
   measured, so plans closer than the measurement noise are ties);
2. the fewest replay FLOPs (exact, the same in every run);
3. the fewest bytes;
4. the least replay time (only plans equal in FLOPs and bytes get here);
5. the first in option order, layer by layer (options in the order given).

So the same profile gives the same plan, and profiles of the same model that differ
only within the tolerance give the same plan too. Times are summed as integer
nanoseconds, so that the order of addition cannot break a tie.

The solver is exact: dynamic programs over layers whose state is the option of the
previous layer. A backward pass keeps, per layer and option, the Pareto frontier of
(bytes, time) of the layers from there on; it gives the fastest time that fits and,
for every partial plan, the fastest way to complete it. The forward pass keeps partial
plans that can still be completed within the budget and the time limit, Pareto-optimal
in (bytes, FLOPs) for their time; no discretization of bytes is involved.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import BudgetTooSmallError

__all__ = [
    "Choice",
    "LayerOptions",
    "NearTie",
    "Option",
    "Solution",
    "evaluate",
    "minimum_bytes",
    "solve",
    "solve_with_ties",
]


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
    """What :func:`solve` returns: ``choice[i]``, the index of the option chosen for
    layer ``i``, and the plan's total kept bytes, replay seconds and replay FLOPs."""

    choice: tuple[int, ...]
    kept_bytes: int
    replay_s: float
    replay_flops: int


@dataclass(frozen=True)
class NearTie:
    """Layer ``layer`` could take option ``option`` instead: the fastest plan that fits
    with it replays ``extra_s`` more than the chosen plan (negative: less, but the chosen
    plan won on FLOPs, bytes or order within the tolerance)."""

    layer: int
    option: int
    extra_s: float


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


# A 2-D Pareto frontier: (bytes, ns) pairs by ascending bytes and strictly descending ns.
_Frontier = list[tuple[int, int]]


def _pareto(points: list[tuple[int, int]]) -> _Frontier:
    points.sort()
    kept: _Frontier = []
    for nbytes, ns in points:
        if not kept or ns < kept[-1][1]:
            kept.append((nbytes, ns))
    return kept


def _fastest(frontier: _Frontier, max_bytes: int) -> int | None:
    """Least time on ``frontier`` with at most ``max_bytes`` (None if nothing fits)."""
    index = bisect.bisect_right(frontier, (max_bytes, float("inf"))) - 1
    return None if index < 0 else frontier[index][1]


class _Tables:
    """Per layer and option, the frontiers of the layers up to it (the option included)
    and of the layers after it, under a byte cap."""

    def __init__(self, layers: Sequence[LayerOptions], shared_bytes: int, cap: int | None):
        self.layers = layers
        self.ns = [[_ns(o.replay_s) for o in layer.options] for layer in layers]
        n = len(layers)

        def fits(nbytes: int) -> bool:
            return cap is None or nbytes <= cap

        # after[i][o]: the layers after i, given option o at layer i (the pair bytes
        # between i and i + 1 included). Options with the same pair bytes share one.
        self.after: list[list[_Frontier]] = [[] for _ in range(n)]
        self.after[-1] = [[(0, 0)] for _ in layers[-1].options]
        for i in range(n - 2, -1, -1):
            nxt = layers[i + 1]
            suffix = [
                [(option.kept_bytes + nbytes, self.ns[i + 1][k2] + ns) for nbytes, ns in rest]
                for k2, (option, rest) in enumerate(zip(nxt.options, self.after[i + 1]))
            ]
            shared_rows: dict[tuple[int, ...], _Frontier] = {}
            row = []
            for k in range(len(layers[i].options)):
                pairs = tuple(nxt.pair(k, k2) for k2 in range(len(nxt.options)))
                if pairs not in shared_rows:
                    shared_rows[pairs] = _pareto(
                        [
                            (extra + nbytes, ns)
                            for extra, frontier in zip(pairs, suffix)
                            for nbytes, ns in frontier
                            if fits(shared_bytes + extra + nbytes)
                        ]
                    )
                row.append(shared_rows[pairs])
            self.after[i] = row
        self.prefix: list[list[_Frontier]] = [[] for _ in range(n)]
        self.prefix[0] = [
            [(shared_bytes + o.kept_bytes, self.ns[0][k])]
            if fits(shared_bytes + o.kept_bytes)
            else []
            for k, o in enumerate(layers[0].options)
        ]
        for i in range(1, n):
            layer = layers[i]
            before = self.prefix[i - 1]
            shared_rows = {}
            row = []
            for k, option in enumerate(layer.options):
                pairs = tuple(layer.pair(k1, k) for k1 in range(len(before)))
                if pairs not in shared_rows:
                    shared_rows[pairs] = _pareto(
                        [
                            (extra + nbytes, ns)
                            for extra, frontier in zip(pairs, before)
                            for nbytes, ns in frontier
                        ]
                    )
                row.append(
                    [
                        (nbytes + option.kept_bytes, ns + self.ns[i][k])
                        for nbytes, ns in shared_rows[pairs]
                        if fits(nbytes + option.kept_bytes)
                    ]
                )
            self.prefix[i] = row

    def completion(self, i: int, option: int, nbytes: int, budget: int) -> int | None:
        """Least time of the layers after ``i`` for a partial plan that ends with
        ``option`` at layer ``i`` and keeps ``nbytes``."""
        return _fastest(self.after[i][option], budget - nbytes)

    def fastest_with(self, i: int, option: int, budget: int) -> int | None:
        """Least time of a plan that fits and runs ``option`` at layer ``i``."""
        best: int | None = None
        for nbytes, ns in self.prefix[i][option]:
            rest = self.completion(i, option, nbytes, budget)
            if rest is not None and (best is None or ns + rest < best):
                best = ns + rest
        return best


class _Point:
    __slots__ = ("_path", "flops", "nbytes", "ns", "option", "parent")

    def __init__(self, nbytes: int, ns: int, flops: int, option: int, parent: _Point | None):
        self.nbytes = nbytes
        self.ns = ns
        self.flops = flops
        self.option = option
        self.parent = parent
        self._path: tuple[int, ...] | None = None

    def choice(self) -> tuple[int, ...]:
        if self._path is None:
            head = () if self.parent is None else self.parent.choice()
            self._path = (*head, self.option)
        return self._path


def evaluate(
    layers: Sequence[LayerOptions], choice: Sequence[int], shared_bytes: int = 0
) -> Solution:
    """Bytes and replay cost of one assignment of options to layers."""
    if len(choice) != len(layers):
        raise ValueError(f"{len(choice)} options given for {len(layers)} layers")
    nbytes, ns, flops = shared_bytes, 0, 0
    previous: int | None = None
    for layer, index in zip(layers, choice):
        option = layer.options[index]
        nbytes += option.kept_bytes + layer.pair(previous, index)
        ns += _ns(option.replay_s)
        flops += option.replay_flops
        previous = index
    return Solution(tuple(choice), nbytes, ns / 1e9, flops)


def minimum_bytes(layers: Sequence[LayerOptions], shared_bytes: int = 0) -> Solution:
    """The assignment that keeps the fewest bytes (ties broken as by :func:`solve`)."""
    _check(layers)
    least = [shared_bytes + o.kept_bytes for o in layers[0].options]
    for layer in layers[1:]:
        least = [
            option.kept_bytes + min(b + layer.pair(k1, k) for k1, b in enumerate(least))
            for k, option in enumerate(layer.options)
        ]
    return solve(layers, min(least), shared_bytes)


@dataclass(frozen=True)
class Choice:
    """What :func:`solve_with_ties` found: the plan, the replay time of the fastest plan
    that fits (the chosen one is within the tolerance of it), and the near ties."""

    solution: Solution
    fastest_s: float
    near_ties: tuple[NearTie, ...]


def solve(
    layers: Sequence[LayerOptions],
    budget_bytes: int,
    shared_bytes: int = 0,
    tolerance_s: float = 0.0,
) -> Solution:
    """The plan that keeps at most ``budget_bytes``, replays within ``tolerance_s`` of
    the fastest such plan, and of those the fewest FLOPs, then bytes, then the least
    time, then the first in option order. Raises :class:`BudgetTooSmallError` when
    nothing fits."""
    return _solve(layers, budget_bytes, shared_bytes, tolerance_s, False).solution


def solve_with_ties(
    layers: Sequence[LayerOptions],
    budget_bytes: int,
    shared_bytes: int = 0,
    tolerance_s: float = 0.0,
) -> Choice:
    """:func:`solve`, and the near ties: per layer, the options it could take instead in
    a plan that fits and replays within ``tolerance_s`` of the fastest plan that fits,
    the choices that the tie-break, not the time, decided (options that another option
    of their layer beats in every respect are not listed)."""
    return _solve(layers, budget_bytes, shared_bytes, tolerance_s, True)


def _solve(
    layers: Sequence[LayerOptions],
    budget_bytes: int,
    shared_bytes: int,
    tolerance_s: float,
    with_ties: bool,
) -> Choice:
    _check(layers)
    given = layers
    layers, kept = _useful(given)
    tables = _Tables(layers, shared_bytes, budget_bytes)
    fastest = _fastest_total(tables, budget_bytes)
    if fastest is None:
        least = minimum_bytes(given, shared_bytes)
        raise BudgetTooSmallError(budget_bytes, least.kept_bytes, _describe_minimum(given, least))
    limit = fastest + max(0, _ns(tolerance_s))

    def room(i: int, k: int) -> tuple[list[int], list[int]]:
        """The frontier of the layers after ``i`` given option ``k``, as bytes and times."""
        frontier = tables.after[i][k]
        return [b for b, _ in frontier], [t for _, t in frontier]

    def viable(after: tuple[list[int], list[int]], nbytes: int, ns: int) -> bool:
        j = bisect.bisect_right(after[0], budget_bytes - nbytes) - 1
        return j >= 0 and ns + after[1][j] <= limit

    states: list[list[_Point]] = []
    for k, option in enumerate(layers[0].options):
        nbytes, ns = shared_bytes + option.kept_bytes, tables.ns[0][k]
        fits = viable(room(0, k), nbytes, ns)
        states.append([_Point(nbytes, ns, option.replay_flops, k, None)] if fits else [])
    for i in range(1, len(layers)):
        layer = layers[i]
        nxt: list[list[_Point]] = []
        for k, option in enumerate(layer.options):
            after = room(i, k)
            option_ns = tables.ns[i][k]
            candidates = []
            for k1, frontier in enumerate(states):
                extra = layer.pair(k1, k) + option.kept_bytes
                for p in frontier:
                    nbytes, ns = p.nbytes + extra, p.ns + option_ns
                    if viable(after, nbytes, ns):
                        candidates.append(
                            _Point(nbytes, ns, p.flops + option.replay_flops, k, p)
                        )
            nxt.append(_keep(candidates))
        states = nxt
    finals = [p for frontier in states for p in frontier]
    assert finals, "the fastest plan that fits is always viable"
    key = min((p.flops, p.nbytes, p.ns) for p in finals)
    best = min(p.choice() for p in finals if (p.flops, p.nbytes, p.ns) == key)
    solution = evaluate(given, [kept[i][k] for i, k in enumerate(best)], shared_bytes)
    ties: list[NearTie] = []
    if with_ties:
        chosen_ns = _ns(solution.replay_s)
        for i in range(len(layers)):
            for k in range(len(layers[i].options)):
                if kept[i][k] == solution.choice[i]:
                    continue
                got = tables.fastest_with(i, k, budget_bytes)
                if got is not None and got <= limit:
                    ties.append(NearTie(i, kept[i][k], (got - chosen_ns) / 1e9))
    return Choice(solution, fastest / 1e9, tuple(ties))


def _fastest_total(tables: _Tables, budget: int) -> int | None:
    best: int | None = None
    for k in range(len(tables.layers[0].options)):
        for nbytes, ns in tables.prefix[0][k]:
            rest = tables.completion(0, k, nbytes, budget)
            if rest is not None and (best is None or ns + rest < best):
                best = ns + rest
    return best


def _keep(points: list[_Point]) -> list[_Point]:
    """Drop partial plans that another one beats: no more bytes, FLOPs and time (equal
    in all three: the later in option order is dropped)."""
    points.sort(key=lambda p: (p.nbytes, p.flops, p.ns))
    unique: list[_Point] = []
    for p in points:
        last = unique[-1] if unique else None
        if last is not None and (last.nbytes, last.flops, last.ns) == (p.nbytes, p.flops, p.ns):
            if p.choice() < last.choice():
                unique[-1] = p
        else:
            unique.append(p)
    # The kept points seen so far (all with no more bytes), as a staircase in (FLOPs,
    # time): ascending FLOPs, descending time.
    stair_flops: list[int] = []
    stair_ns: list[int] = []
    kept: list[_Point] = []
    for p in unique:
        j = bisect.bisect_right(stair_flops, p.flops)
        if j > 0 and stair_ns[j - 1] <= p.ns:
            continue
        kept.append(p)
        end = j
        while end < len(stair_flops) and stair_ns[end] >= p.ns:
            end += 1
        stair_flops[j:end] = [p.flops]
        stair_ns[j:end] = [p.ns]
    return kept


def _useful(layers: Sequence[LayerOptions]) -> tuple[list[LayerOptions], list[list[int]]]:
    """The layers without their options that another option of the same layer beats
    whatever the other layers run (no more bytes, pair bytes included, FLOPs and time;
    equal in all: the later is dropped), and per layer the original index of each
    option kept."""
    n = len(layers)

    def profile(i: int, k: int) -> tuple[int, ...]:
        before = len(layers[i - 1].options) if i > 0 else 0
        after = len(layers[i + 1].options) if i + 1 < n else 0
        return (
            layers[i].options[k].kept_bytes,
            *(layers[i].pair(p, k) for p in range(before)),
            *(layers[i + 1].pair(k, q) for q in range(after)),
        )

    kept: list[list[int]] = []
    for i, layer in enumerate(layers):
        rows = [(profile(i, k), o.replay_flops, _ns(o.replay_s)) for k, o in enumerate(layer.options)]

        kept.append(
            [b for b in range(len(rows)) if not any(_beats(rows, a, b) for a in range(len(rows)))]
        )
    reduced = []
    for i, layer in enumerate(layers):
        index = {k: j for j, k in enumerate(kept[i])}
        previous = {k: j for j, k in enumerate(kept[i - 1])} if i > 0 else {}
        reduced.append(
            LayerOptions(
                layer.path,
                [layer.options[k] for k in kept[i]],
                {
                    (previous[a], index[b]): nbytes
                    for (a, b), nbytes in layer.pair_bytes.items()
                    if a in previous and b in index
                },
            )
        )
    return reduced, kept


def _beats(rows: list[tuple[tuple[int, ...], int, int]], a: int, b: int) -> bool:
    """Whether option ``a`` beats option ``b`` of the same layer (rows: bytes, FLOPs, ns)."""
    if a == b:
        return False
    (bytes_a, flops_a, ns_a), (bytes_b, flops_b, ns_b) = rows[a], rows[b]
    if flops_a > flops_b or ns_a > ns_b or any(x > y for x, y in zip(bytes_a, bytes_b)):
        return False
    return rows[a] != rows[b] or a < b


def _check(layers: Sequence[LayerOptions]) -> None:
    if not layers:
        raise ValueError("nothing to plan: no layers")
    for layer in layers:
        if not layer.options:
            raise ValueError(f"layer {layer.path!r} has no options")


def _describe_minimum(layers: Sequence[LayerOptions], least: Solution) -> str:
    names = {layers[i].options[o].name for i, o in enumerate(least.choice)}
    if len(names) == 1:
        return f" (option {names.pop()!r} for every layer)"
    return ""
