"""Random small programs, as data, for the property tests of both frameworks.

A :class:`Program` is a straight-line program over tensors: elementwise ops,
binary ops, matmuls with parameters, norms, views, reductions, argmax/gather,
calls of *regions* (sub-programs that the tests wrap with
``checkpoint_exclude_wrapper``) and *checkpoints* (blocks that the tests run
under ``recomp.<framework>.checkpoint``, possibly nested). Region and
checkpoint inputs and outputs are random pytrees (tuple, list, dict,
namedtuple) that mix tensors with ints, strings and None.

:func:`programs` is the Hypothesis strategy; :func:`run_program` interprets a
program with a framework's op table, once plainly (the reference) and once with
recomp, so the generator and the interpreter are written once for both
frameworks. ``repr(program)`` prints it as readable pseudo-code, which is what
Hypothesis shows for a failing example. :class:`BoundaryMirror` builds the
reference that recomp must match bitwise where recomp adds a node to the graph.

Validity rules the generator keeps (what recomp documents as allowed):
  * no excluded region is called inside another (region bodies are ops only);
  * a region with ``save_output=False`` has every call "chained": its tensor
    outputs are used by nothing but later region calls of the same block (the
    same checkpoint invocation), and the first of those follows it directly;
  * no in-place ops, no data-dependent control flow.
"""

from __future__ import annotations

import dataclasses
import math
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

Pair = namedtuple("Pair", ["first", "second"])
Triple = namedtuple("Triple", ["a", "b", "c"])

# Value dtypes: FLOAT, or "i<n>" for int64 indices below n (argmax over a last dim of n).
FLOAT = "f"

UNARY = ("sin", "tanh", "exp_tanh", "relu", "silu")
BINARY = ("add", "mul", "sub")
INPUT_SHAPES = ((4, 6), (6, 4), (3, 4), (4, 4), (2, 3, 4), (2, 4, 3))
MATMUL_OUT = (2, 3, 4, 6)
NORM_MIN = 3  # the fewest elements a norm normalises over (see _Builder.op)
CONSTANTS = (0, 1, 7, -3, "mean", "x", "", None)
DICT_KEYS = ("a", "b", "key", "z")


# --------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class Slot:
    """A tensor position in a template; ``index`` numbers the slots of one template."""

    index: int

    def __repr__(self) -> str:
        return f"${self.index}"


def map_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """``tree`` rebuilt with every leaf ``x`` replaced by ``fn(x)``, leaves in order.

    The one walker of the containers programs use (named tuples, tuples, lists,
    dicts); everything else is a leaf.
    """
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        return type(tree)(*(map_leaves(v, fn) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_leaves(v, fn) for v in tree)
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn) for k, v in tree.items()}
    return fn(tree)


def fill(tmpl: Any, values: list[Any]) -> Any:
    """The template with every ``Slot(k)`` replaced by ``values[k]``."""
    return map_leaves(tmpl, lambda x: values[x.index] if isinstance(x, Slot) else x)


def bind(tmpl: Any, actual: Any, n_slots: int) -> list[Any]:
    """Inverse of :func:`fill`: the values at the slots of ``actual``.

    Raises AssertionError if ``actual`` does not have the template's structure
    (container types, dict keys, lengths) or its constants.
    """
    out: list[Any] = [None] * n_slots
    _bind(tmpl, actual, out, "")
    return out


def _bind(tmpl: Any, actual: Any, out: list[Any], path: str) -> None:
    if isinstance(tmpl, Slot):
        out[tmpl.index] = actual
        return
    if isinstance(tmpl, (tuple, list, dict)):
        assert type(actual) is type(tmpl), f"{path}: {type(actual)} instead of {type(tmpl)}"
        assert len(actual) == len(tmpl), f"{path}: length {len(actual)} instead of {len(tmpl)}"
        if isinstance(tmpl, dict):
            assert list(actual) == list(tmpl), (
                f"{path}: keys {list(actual)} instead of {list(tmpl)}"
            )
            for k in tmpl:
                _bind(tmpl[k], actual[k], out, f"{path}[{k!r}]")
        else:
            for i, (t, a) in enumerate(zip(tmpl, actual)):
                _bind(t, a, out, f"{path}[{i}]")
        return
    assert type(actual) is type(tmpl) and actual == tmpl, f"{path}: {actual!r} instead of {tmpl!r}"


def _tmpl_str(tmpl: Any, names: list[str]) -> str:
    if isinstance(tmpl, Slot):
        return names[tmpl.index]
    if isinstance(tmpl, tuple) and hasattr(type(tmpl), "_fields"):
        return f"{type(tmpl).__name__}({', '.join(_tmpl_str(v, names) for v in tmpl)})"
    if isinstance(tmpl, tuple):
        inner = ", ".join(_tmpl_str(v, names) for v in tmpl)
        return f"({inner},)" if len(tmpl) == 1 else f"({inner})"
    if isinstance(tmpl, list):
        return f"[{', '.join(_tmpl_str(v, names) for v in tmpl)}]"
    if isinstance(tmpl, dict):
        return "{" + ", ".join(f"{k!r}: {_tmpl_str(v, names)}" for k, v in tmpl.items()) + "}"
    return repr(tmpl)


# --------------------------------------------------------------------------- the program


@dataclass(frozen=True)
class Op:
    """``out = kind(args..., params...)``; ``attrs`` holds dims or the target shape."""

    out: int
    kind: str
    args: tuple[int, ...]
    params: tuple[str, ...] = ()
    attrs: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Call:
    """Call region ``region`` with the values ``args`` in its input slots; bind ``outs``."""

    region: int
    args: tuple[int, ...]
    outs: tuple[int, ...]
    chained: bool  # its outputs go only into later region calls of the same block


@dataclass(frozen=True)
class Checkpoint:
    """Run ``body`` as a checkpointed function of ``fill(args_tmpl, args)`` (as positional
    arguments); it returns ``fill(out_tmpl, outs)``. Other visible values are captured."""

    args_tmpl: tuple[Any, ...]
    args: tuple[int, ...]
    body: tuple[Any, ...]
    out_tmpl: Any
    outs: tuple[int, ...]
    early_stop: bool


@dataclass
class Region:
    """A sub-program called as ``fn(*in_tmpl[0], **in_tmpl[1])`` that returns ``out_tmpl``."""

    index: int
    in_tmpl: tuple[tuple[Any, ...], dict[str, Any]]
    in_ids: tuple[int, ...]  # local value ids of the input slots
    body: tuple[Any, ...]
    out_tmpl: Any
    out_ids: tuple[int, ...]  # local value ids returned in the output slots
    as_module: bool
    save_output: bool = True

    @property
    def name(self) -> str:
        return f"r{self.index}"


@dataclass
class Program:
    inputs: tuple[tuple[int, tuple[int, ...]], ...]  # (value id, shape), all float, need grad
    params: dict[str, tuple[int, ...]]
    regions: tuple[Region, ...]
    body: tuple[Any, ...]
    loss: tuple[int, ...]  # float values whose squares are summed into the loss
    seed: int
    backward_twice: bool
    types: dict[int, tuple[tuple[int, ...], str]] = field(repr=False)  # id -> (shape, dtype)

    def calls_per_region(self) -> list[int]:
        counts = [0] * len(self.regions)
        _count_calls(self.body, counts)
        return counts

    def __repr__(self) -> str:
        return describe(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis's pretty printer
        printer.text(describe(self))


def _count_calls(body: tuple[Any, ...], counts: list[int]) -> None:
    for stmt in body:
        if isinstance(stmt, Call):
            counts[stmt.region] += 1
        elif isinstance(stmt, Checkpoint):
            _count_calls(stmt.body, counts)


def _used(body: tuple[Any, ...] | list[Any]) -> set[int]:
    """Every value id read by the statements (nested checkpoint bodies included)."""
    used: set[int] = set()
    for stmt in body:
        if isinstance(stmt, Checkpoint):
            used.update(stmt.args)
            used |= _used(stmt.body)
        else:
            used.update(stmt.args)
    return used


def _sinks(body: list[Any], defined: list[int]) -> list[int]:
    used = _used(body)
    return [i for i in defined if i not in used]


def map_checkpoints(
    body: tuple[Any, ...], fn: Callable[[Checkpoint, int], Checkpoint], depth: int = 1
):
    """``body`` with every Checkpoint ``c`` (at nesting ``depth``, 1 = outermost) replaced by
    ``fn(c, depth)``, inner ones first."""
    out = []
    for stmt in body:
        if isinstance(stmt, Checkpoint):
            inner = dataclasses.replace(stmt, body=map_checkpoints(stmt.body, fn, depth + 1))
            stmt = fn(inner, depth)
        out.append(stmt)
    return tuple(out)


def _walk(body: tuple[Any, ...]):
    for stmt in body:
        yield stmt
        if isinstance(stmt, Checkpoint):
            yield from _walk(stmt.body)


def describe(p: Program) -> str:
    """The program as pseudo-code (what Hypothesis prints for a failing example)."""

    def v(i: int) -> str:
        return f"v{i}" if p.types[i][1] == FLOAT else f"i{i}"

    def block(body: tuple[Any, ...], indent: str, lines: list[str]) -> None:
        for s in body:
            if isinstance(s, Op):
                args = [v(a) for a in s.args] + list(s.params) + [repr(a) for a in s.attrs]
                shape = p.types[s.out][0]
                lines.append(f"{indent}{v(s.out)} = {s.kind}({', '.join(args)})  # {shape}")
            elif isinstance(s, Call):
                r = p.regions[s.region]
                args_str = _tmpl_str(r.in_tmpl[0], [v(a) for a in s.args])
                kwargs = ", ".join(
                    f"{k}={_tmpl_str(t, [v(a) for a in s.args])}" for k, t in r.in_tmpl[1].items()
                )
                call = f"{r.name}(*{args_str}{', ' if kwargs else ''}{kwargs})"
                note = "  # chained" if s.chained else ""
                lines.append(
                    f"{indent}{_tmpl_str(r.out_tmpl, [v(o) for o in s.outs])} = {call}{note}"
                )
            else:
                args_str = _tmpl_str(s.args_tmpl, [v(a) for a in s.args])
                lines.append(f"{indent}with checkpoint(*{args_str}, early_stop={s.early_stop}):")
                block(s.body, indent + "    ", lines)
                lines.append(f"{indent}    return {_tmpl_str(s.out_tmpl, [v(o) for o in s.outs])}")

    lines = [f"Program(seed={p.seed}, backward_twice={p.backward_twice})"]
    lines.append("  params: " + ", ".join(f"{n}{s}" for n, s in p.params.items()))
    for r in p.regions:
        names = [v(i) for i in r.in_ids]
        args_str = _tmpl_str(r.in_tmpl[0], names)
        kwargs = ", ".join(f"{k}={_tmpl_str(t, names)}" for k, t in r.in_tmpl[1].items())
        kind = "module" if r.as_module else "function"
        lines.append(
            f"  region {r.name}(*{args_str}{', ' if kwargs else ''}{kwargs})"
            f"  # save_output={r.save_output}, {kind}"
        )
        block(r.body, "      ", lines)
        lines.append(f"      return {_tmpl_str(r.out_tmpl, [v(o) for o in r.out_ids])}")
    lines.append("  main(" + ", ".join(f"v{i}: {s}" for i, s in p.inputs) + "):")
    block(p.body, "      ", lines)
    lines.append("      loss = " + " + ".join(f"sum({v(i)}**2)" for i in p.loss))
    return "\n".join(lines)


# --------------------------------------------------------------------------- generator


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    n = max(len(a), len(b))
    a2, b2 = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a2, b2):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def _factorizations(n: int) -> list[tuple[int, ...]]:
    shapes = [(n,)]
    for a in range(1, n + 1):
        if n % a:
            continue
        shapes.append((a, n // a))
        for b in range(1, n // a + 1):
            if (n // a) % b == 0:
                shapes.append((a, b, n // a // b))
    return sorted(set(shapes), key=lambda s: (len(s), s))


class _Builder:
    def __init__(self, draw: Callable[..., Any], budget: int) -> None:
        self.draw = draw
        self.budget = budget
        self.next_id = 0
        self.types: dict[int, tuple[tuple[int, ...], str]] = {}
        self.params: dict[str, tuple[int, ...]] = {}
        self.regions: list[Region] = []
        self.region_only: set[int] = set()  # outputs of chained calls

    # -- values ---------------------------------------------------------------

    def new(self, shape: tuple[int, ...], dtype: str = FLOAT) -> int:
        i = self.next_id
        self.next_id += 1
        self.types[i] = (tuple(shape), dtype)
        return i

    def shape(self, i: int) -> tuple[int, ...]:
        return self.types[i][0]

    def is_float(self, i: int) -> bool:
        return self.types[i][1] == FLOAT

    def pick(self, candidates: list[int]) -> int:
        """One of ``candidates`` (value ids in definition order), shrinking to the newest."""
        return self.draw(st.sampled_from(candidates[::-1]))

    def param(self, shape: tuple[int, ...], prefix: str) -> str:
        same = [n for n, s in self.params.items() if s == shape and n.startswith(prefix)]
        if same and self.draw(st.booleans()):
            return self.draw(st.sampled_from(same))
        name = f"{prefix}{len(self.params)}"
        self.params[name] = shape
        return name

    # -- templates ------------------------------------------------------------

    def tree(self, n_slots: int, *, max_consts: int = 2) -> list[Any]:
        """A random list of items holding every slot once, some grouped into containers."""
        items: list[Any] = [Slot(k) for k in range(n_slots)]
        for _ in range(self.draw(st.integers(0, max_consts))):
            items.insert(
                self.draw(st.integers(0, len(items))), self.draw(st.sampled_from(CONSTANTS))
            )
        # Group a run of items into a container, once or twice.
        for _ in range(self.draw(st.integers(0, 2))):
            if not items:
                break
            start = self.draw(st.integers(0, len(items) - 1))
            stop = self.draw(st.integers(start + 1, len(items)))
            items[start:stop] = [self.container(items[start:stop])]
        return items

    def container(self, items: list[Any]) -> Any:
        kinds = ["tuple", "list", "dict"]
        if len(items) in (2, 3):
            kinds.append("namedtuple")
        kind = self.draw(st.sampled_from(kinds))
        if kind == "tuple":
            return tuple(items)
        if kind == "list":
            return list(items)
        if kind == "namedtuple":
            return (Pair if len(items) == 2 else Triple)(*items)
        pool = list(DICT_KEYS) + [f"k{j}" for j in range(len(items))]
        keys = self.draw(st.permutations(pool))[: len(items)]
        return dict(zip(keys, items))

    def out_tmpl(self, n_slots: int) -> Any:
        items = self.tree(n_slots)
        if len(items) == 1 and isinstance(items[0], Slot) and self.draw(st.booleans()):
            return items[0]  # a bare tensor
        return self.container(items)

    # -- statements -----------------------------------------------------------

    def op(self, visible: list[int]) -> Op | None:
        floats = [i for i in visible if self.is_float(i) and i not in self.region_only]
        ints = [i for i in visible if not self.is_float(i) and i not in self.region_only]
        if not floats:
            return None
        # Repeated kinds are drawn more often.
        kinds = ["unary", "binary", "matmul", "unary", "reshape", "binary", "sum"]
        kinds += ["matmul", "argmax"]
        # A norm over fewer than NORM_MIN elements is left out: its output hardly depends
        # on its input (over two elements a layer norm gives +-1 whatever the values), so
        # the gradient through it is what is left of two nearly equal terms, rounding
        # noise that a change of summation order (recomp's boundary) moves by 0.1 %.
        normable = [i for i in floats if self.shape(i)[-1] >= NORM_MIN]
        if normable:
            kinds.insert(4, "norm")
        if any(len(self.shape(i)) >= 2 for i in floats):
            kinds.append("transpose")
        mm_pairs = [
            (a, b)
            for a in floats
            for b in floats
            if len(self.shape(a)) == 2
            and len(self.shape(b)) == 2
            and self.shape(a)[1] == self.shape(b)[0]
        ]
        if mm_pairs:
            kinds.append("matmul_act")
        gathers = [
            (a, j)
            for a in floats
            for j in ints
            if len(self.shape(a)) == len(self.shape(j))
            and self.shape(a)[:-1] == self.shape(j)[:-1]
            and self.shape(a)[-1] >= int(self.types[j][1][1:])  # indices in range
        ]
        if gathers:
            kinds.append("gather")
        kind = self.draw(st.sampled_from(kinds))
        draw = self.draw

        if kind == "matmul_act":
            a, b = draw(st.sampled_from(mm_pairs))
            return Op(self.new((self.shape(a)[0], self.shape(b)[1])), kind, (a, b))
        if kind == "gather":
            a, j = draw(st.sampled_from(gathers))
            return Op(self.new(self.shape(j)), kind, (a, j))
        if kind == "transpose":
            a = self.pick([i for i in floats if len(self.shape(i)) >= 2])
        elif kind == "norm":
            a = self.pick(normable)
        else:
            a = self.pick(floats)
        shape = self.shape(a)
        if kind == "unary":
            return Op(self.new(shape), draw(st.sampled_from(UNARY)), (a,))
        if kind == "binary":
            partners = [b for b in floats if _broadcast(shape, self.shape(b)) is not None]
            b = self.pick(partners)
            out = _broadcast(shape, self.shape(b))
            assert out is not None
            return Op(self.new(out), draw(st.sampled_from(BINARY)), (a, b))
        if kind == "matmul":
            n = draw(st.sampled_from(MATMUL_OUT))
            w = self.param((shape[-1], n), "w")
            return Op(self.new((*shape[:-1], n)), kind, (a,), (w,))
        if kind == "norm":
            if draw(st.booleans()):
                g, b = self.param((shape[-1],), "g"), self.param((shape[-1],), "b")
                return Op(self.new(shape), "layernorm", (a,), (g, b))
            return Op(self.new(shape), "rmsnorm", (a,), (self.param((shape[-1],), "g"),))
        if kind == "reshape":
            target = draw(st.sampled_from(_factorizations(math.prod(shape))))
            return Op(self.new(target), kind, (a,), attrs=(target,))
        if kind == "transpose":
            d0, d1 = draw(
                st.lists(st.integers(0, len(shape) - 1), min_size=2, max_size=2, unique=True)
            )
            out = list(shape)
            out[d0], out[d1] = out[d1], out[d0]
            return Op(self.new(tuple(out)), kind, (a,), attrs=(d0, d1))
        if kind == "sum":
            d = draw(st.integers(0, len(shape) - 1))
            out = list(shape)
            out[d] = 1
            return Op(self.new(tuple(out)), kind, (a,), attrs=(d,))
        assert kind == "argmax"
        return Op(self.new((*shape[:-1], 1), f"i{shape[-1]}"), kind, (a,))

    def block(self, visible: list[int], where: str, depth: int, size: int) -> list[Any]:
        """``where``: "top", "checkpoint" or "region". Returns the statements; ``visible``
        is extended in place with the values they define."""
        stmts: list[Any] = []
        for _ in range(size):
            if self.budget <= 0:
                break
            # Repeated choices are drawn more often.
            if where == "region":
                choices = ["op"]
            elif where == "top":
                choices = ["op", "op", "call", "checkpoint", "checkpoint"]
            else:
                choices = ["op", "op", "op", "call", "call"] + ["checkpoint"] * (depth < 2)
            choice = self.draw(st.sampled_from(choices))
            self.budget -= 1
            if choice == "op":
                op = self.op(visible)
                if op is not None:
                    stmts.append(op)
                    visible.append(op.out)
            elif choice == "call":
                self.call(visible, stmts, chain_depth=0)
            else:
                stmts.append(self.checkpoint(visible, depth + 1))
        return stmts

    def usable_args(self, visible: list[int]) -> list[int]:
        # region-only values of this block are usable as region arguments
        return list(visible)

    def call(
        self,
        visible: list[int],
        stmts: list[Any],
        chain_depth: int,
        required: list[int] | None = None,
    ) -> None:
        """Append a region call (and, if chained, the calls consuming its outputs)."""
        draw = self.draw
        args: list[int] | None = None
        region: Region | None = None
        if required is not None:
            signature = [self.types[i] for i in required]
            fits = [r for r in self.regions if [self.types[i] for i in r.in_ids] == signature]
            if fits and draw(st.booleans()):
                region, args = draw(st.sampled_from(fits)), list(required)
        else:
            fillable = []
            for r in self.regions:
                options = [
                    [i for i in visible if self.types[i] == self.types[slot]] for slot in r.in_ids
                ]
                if all(options):
                    fillable.append((r, options))
            if fillable and draw(st.booleans()):
                region, options = draw(st.sampled_from(fillable))
                args = [draw(st.sampled_from(o[::-1])) for o in options]
        if region is None:
            if required is not None:
                extra = draw(st.lists(st.sampled_from(visible[::-1]), max_size=1))
                args = list(required) + extra
                order = draw(st.permutations(range(len(args))))
                args = [args[k] for k in order]
            else:
                args = draw(st.lists(st.sampled_from(visible[::-1]), min_size=1, max_size=3))
            region = self.define_region(args)
        assert args is not None
        outs = tuple(self.new(*self.types[o]) for o in region.out_ids)
        chained = chain_depth < 2 and draw(st.booleans())
        stmts.append(Call(region.index, tuple(args), outs, chained))
        visible.extend(outs)
        if chained:
            self.region_only.update(outs)
            self.call(visible, stmts, chain_depth + 1, required=list(outs))

    def define_region(self, args: list[int]) -> Region:
        index = len(self.regions)
        in_ids = tuple(self.new(*self.types[a]) for a in args)
        items = self.tree(len(args))
        n_kw = self.draw(st.integers(0, len(items)))
        keys = [f"k{j}" for j in range(n_kw)]
        in_tmpl = (tuple(items[: len(items) - n_kw]), dict(zip(keys, items[len(items) - n_kw :])))
        local = list(in_ids)
        body = self.block(local, "region", depth=0, size=self.draw(st.integers(1, 4)))
        # Return every value the body computed and did not use (so none is dead code),
        # plus any others, possibly twice, possibly an input passed through.
        sinks = _sinks(body, local[len(in_ids) :])
        if not sinks:
            sinks = [self.pick(local)]
        others = [self.pick(local)] if self.draw(st.integers(0, 5)) == 0 else []
        out_ids = (*sinks, *others)
        region = Region(
            index,
            in_tmpl,
            in_ids,
            tuple(body),
            self.out_tmpl(len(out_ids)),
            out_ids,
            as_module=self.draw(st.booleans()),
        )
        self.regions.append(region)
        return region

    def checkpoint(self, visible: list[int], depth: int) -> Checkpoint:
        draw = self.draw
        usable = [i for i in visible if i not in self.region_only]
        args = draw(st.lists(st.sampled_from(usable[::-1]), max_size=3, unique=True))
        items = self.tree(len(args), max_consts=1)
        inner = list(usable)
        body = self.block(inner, "checkpoint", depth, size=draw(st.integers(1, 5)))
        defined = [i for i in inner[len(usable) :] if i not in self.region_only]
        if not defined:
            op = self.op(inner)
            assert op is not None
            body.append(op)
            defined = [op.out]
        # Return every value computed and not used inside (none is dead code), and maybe others.
        sinks = [i for i in _sinks(body, defined)]
        others = draw(st.lists(st.sampled_from(defined[::-1]), max_size=2, unique=True))
        outs = tuple(dict.fromkeys((*sinks, *others)))
        out_tmpl = self.out_tmpl(len(outs))
        visible.extend(outs)
        return Checkpoint(
            tuple(items), tuple(args), tuple(body), out_tmpl, outs, draw(st.booleans())
        )


@st.composite
def programs(draw: Callable[..., Any], budget: int = 18) -> Program:
    b = _Builder(draw, budget)
    n_inputs = draw(st.integers(1, 2))
    inputs = tuple(
        (b.new(s), s) for s in (draw(st.sampled_from(INPUT_SHAPES)) for _ in range(n_inputs))
    )
    visible = [i for i, _ in inputs]
    body: list[Any] = []
    # Most programs start with a checkpoint, so that most of them exercise one.
    if draw(st.integers(0, 3)) > 0:
        b.budget -= 1
        body.append(b.checkpoint(visible, depth=1))
    body += b.block(visible, "top", depth=0, size=draw(st.integers(1, 4)))
    # save_output=False is valid for a region every call of which is chained.
    calls: dict[int, list[Call]] = {}
    for stmt in _walk(tuple(body)):
        if isinstance(stmt, Call):
            calls.setdefault(stmt.region, []).append(stmt)
    for r in b.regions:
        if all(c.chained for c in calls.get(r.index, [])) and draw(st.booleans()):
            r.save_output = False
    # The loss reads every value that nothing else reads (none is dead code).
    used = _used(tuple(body))
    floats = [i for i in visible if b.is_float(i) and i not in b.region_only]
    loss = tuple(i for i in floats if i not in used) or (floats[-1],)
    return Program(
        inputs=inputs,
        params=dict(b.params),
        regions=tuple(b.regions),
        body=tuple(body),
        loss=loss,
        seed=draw(st.integers(0, 2**16)),
        backward_twice=draw(st.booleans()),
        types=dict(b.types),
    )


# --------------------------------------------------------------------------- values and running


def initial_values(p: Program) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Inputs and parameter values (float32) drawn from the program's seed."""
    rng = np.random.RandomState(p.seed)
    inputs = [rng.standard_normal(shape).astype(np.float32) for _, shape in p.inputs]
    params = {}
    for name, shape in p.params.items():
        if name.startswith("w"):
            value = rng.standard_normal(shape) / math.sqrt(shape[0])
        elif name.startswith("g"):
            value = 1 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.1 * rng.standard_normal(shape)
        params[name] = value.astype(np.float32)
    return inputs, params


@dataclass
class Runtime:
    """What a framework supplies to :func:`run_program`.

    ``ops[kind](args, params, attrs)`` computes one Op. ``checkpoint(fn, *args,
    early_stop=...)`` runs a checkpoint block (the reference passes one that just
    calls ``fn``). ``region(region, fn)`` returns the callable for a region
    (the reference returns ``fn`` itself).
    """

    ops: dict[str, Callable[..., Any]]
    checkpoint: Callable[..., Any]
    region: Callable[[Region, Callable[..., Any]], Callable[..., Any]]


def run_program(
    p: Program, rt: Runtime, inputs: list[Any], params: dict[str, Any]
) -> tuple[Any, list[int], list[Any]]:
    """Run the forward of ``p``; return (loss, region body executions, region callables)."""
    executions = [0] * len(p.regions)

    def block(body: tuple[Any, ...], env: dict[int, Any], callables: list[Any]) -> None:
        for s in body:
            if isinstance(s, Op):
                env[s.out] = rt.ops[s.kind](
                    [env[a] for a in s.args], [params[n] for n in s.params], s.attrs
                )
            elif isinstance(s, Call):
                r = p.regions[s.region]
                values = [env[a] for a in s.args]
                result = callables[s.region](
                    *fill(r.in_tmpl[0], values), **fill(r.in_tmpl[1], values)
                )
                for i, v in zip(s.outs, bind(r.out_tmpl, result, len(s.outs))):
                    env[i] = v
            else:
                result = rt.checkpoint(
                    checkpoint_fn(s, dict(env), callables),
                    *fill(s.args_tmpl, [env[a] for a in s.args]),
                    early_stop=s.early_stop,
                )
                for i, v in zip(s.outs, bind(s.out_tmpl, result, len(s.outs))):
                    env[i] = v

    def checkpoint_fn(s: Checkpoint, env: dict[int, Any], callables: list[Any]):
        def fn(*args: Any) -> Any:
            inner = dict(env)
            for i, v in zip(s.args, bind(s.args_tmpl, args, len(s.args))):
                inner[i] = v
            block(s.body, inner, callables)
            return fill(s.out_tmpl, [inner[o] for o in s.outs])

        return fn

    def region_fn(r: Region, callables: list[Any]):
        def fn(*args: Any, **kwargs: Any) -> Any:
            executions[r.index] += 1
            local: dict[int, Any] = {}
            for i, v in zip(r.in_ids, bind(r.in_tmpl, (args, kwargs), len(r.in_ids))):
                local[i] = v
            block(r.body, local, callables)
            return fill(r.out_tmpl, [local[o] for o in r.out_ids])

        return fn

    callables: list[Any] = []
    for r in p.regions:
        callables.append(rt.region(r, region_fn(r, callables)))
    env = {i: x for (i, _), x in zip(p.inputs, inputs)}
    block(p.body, env, callables)
    terms = [rt.ops["square_sum"]([env[i]], [], ()) for i in p.loss]
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    return loss, executions, callables


class BoundaryMirror:
    """Puts an identity autograd function into the reference run wherever recomp put
    its boundary, so that the reference's autograd graph has the same shape.

    Why: the boundary (NOTE [ Deferred inputs ] in recomp._engine) is one more
    autograd node after a region whose inputs the replay reproduces. It changes no
    value, but it changes when the region's nodes, and every node before them, run
    in backward (only once the uses of all the region's outputs have run), and it
    sums the gradients of each output alias's uses before they meet the region's
    other terms. A tensor whose gradient is the sum of three or more terms can then
    get them in another order, and float addition is not associative: the last bits
    may differ from plain autograd. With an identity node in the same place the
    reference is bitwise equal again, so the tests compare exactly against that
    mirrored reference, and within a tight tolerance against the plain one.

    Use: wrap each region body with :meth:`recording` and run the recomp program
    under :meth:`spying` (which watches where recomp applies its boundary); then build the
    reference's regions with :meth:`mirrored`.
    """

    def __init__(self, identity: Callable[[list[Any], list[Any]], list[Any]]) -> None:
        self.identity = identity  # (saved inputs, outputs) -> aliases of the outputs
        self.calls = 0
        self.leaves: list[Any] = []
        self.out_leaves: list[Any] = []
        # forward region execution number -> (input leaf indices, output leaf indices)
        self.boundaries: dict[int, tuple[list[int], list[int]]] = {}
        self.reference_calls = 0

    def recording(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.leaves = tree_leaves((args, kwargs))
            out = fn(*args, **kwargs)
            self.out_leaves = tree_leaves(out)
            return out

        return call

    def spying(self) -> Any:
        """Context manager: record where recomp applies its boundary in forwards."""
        from recomp import _testing

        def seen(saved: list[Any], outputs: list[Any]) -> None:
            self.boundaries[self.calls] = (
                _positions(saved, self.leaves),
                _positions(outputs, self.out_leaves),
            )

        return _testing.observe(boundary=seen)

    def mirrored(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.reference_calls += 1
            out = fn(*args, **kwargs)
            found = self.boundaries.get(self.reference_calls)
            if found is None:
                return out
            saved_at, out_at = found
            leaves, out_leaves = tree_leaves((args, kwargs)), tree_leaves(out)
            aliases = self.identity([leaves[i] for i in saved_at], [out_leaves[k] for k in out_at])
            for k, alias in zip(out_at, aliases):
                out_leaves[k] = alias
            return tree_unflatten(out, out_leaves)

        return call


def _positions(items: list[Any], leaves: list[Any]) -> list[int]:
    """Indices of ``items`` (in increasing order) among ``leaves``, by identity."""
    positions, start = [], 0
    for item in items:
        start = next(i for i in range(start, len(leaves)) if leaves[i] is item)
        positions.append(start)
        start += 1
    return positions


def tree_leaves(tree: Any) -> list[Any]:
    leaves: list[Any] = []
    map_leaves(tree, leaves.append)
    return leaves


def tree_unflatten(tree: Any, leaves: list[Any]) -> Any:
    """``tree`` with its leaves replaced, in order, by ``leaves``."""
    it = iter(leaves)
    return map_leaves(tree, lambda _: next(it))


def assert_same_gradients(expected: dict[str, Any], actual: dict[str, Any], *, exact: bool) -> None:
    """Gradients (numpy arrays, or None where the framework gives none) must be bitwise
    equal, or, with ``exact=False``, equal within rtol=atol=1e-5."""
    assert expected.keys() == actual.keys()
    for name, want in expected.items():
        got = actual[name]
        assert (want is None) == (got is None), f"{name}: {want} vs {got}"
        if want is None:
            continue
        if exact:
            assert np.array_equal(want, got, equal_nan=True), (
                f"{name}: not bitwise equal, max diff {np.nanmax(np.abs(want - got))}"
                f"\nexpected\n{want}\nactual\n{got}"
            )
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
