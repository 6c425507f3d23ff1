"""What a report of the memory held for backward looks like, for both frameworks, and
how one is recorded where the graph cannot be read afterwards.

A report is a list of rows, one per storage held for backward, each billed once
(see ``recomp.torch.report.saved_tensors_report`` for PyTorch, which reads the autograd
graph after the forward). :class:`SavedTensorsRecorder` builds the same report while
the forward runs instead, from saved-tensor hooks and recomp's own observers: the
way for a framework whose gradient graph cannot be walked without running backward
(MindSpore PyNative). Both bill a storage to the first kind in ``HELD_KINDS`` that
holds it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._backend import Backend
from ._hooks import RegionCallView, RegionObserver, observing
from ._record import invocation_of
from ._region import ExcludedRegion
from ._state import get_recompute_state
from ._wrapping import REGION, walk_named

KEPT = "kept by region"
CACHED = "cached output"
SELECTIVE = "kept by selective checkpoint"
OFFLOADED = "offloaded (host)"
CHECKPOINT_INPUT = "checkpoint input"
REPLAYED = "replayed, awaiting backward"
OUTSIDE = "saved outside checkpoints"
COMPILED = "saved by a compiled graph"
OTHER_HOOK = "other saved-tensor hook"
RNG = "random state (host)"
DEFERRED = "deferred (not held)"

#: Beyond this many rows, a table ends with a pointer to the shorter forms.
LONG_TABLE = 100

#: The kinds of held rows, in billing order: a storage held by several is billed to the first.
HELD_KINDS = (
    KEPT,
    OFFLOADED,
    CACHED,
    SELECTIVE,
    CHECKPOINT_INPUT,
    REPLAYED,
    OUTSIDE,
    COMPILED,
    OTHER_HOOK,
    RNG,
)


@dataclass(frozen=True)
class ReportRow:
    """One storage held for backward (or, for ``kind == DEFERRED``, one that is not).

    ``layer`` and ``region`` are module paths (``layers.0``, ``layers.0.attn``) when the
    report was given the model, else the region's name and the layer's class; None
    outside checkpointed layers and excluded regions. ``shape`` and ``dtype`` are those
    of the saved tensor (a view may be smaller than its storage); ``bytes`` is the whole
    storage's size.
    """

    layer: str | None
    region: str | None
    op: str
    kind: str
    bytes: int
    shape: tuple[int, ...]
    dtype: str
    device: str


@dataclass
class SavedTensorsReport:
    """What the autograd graph holds for backward; ``str()`` is a table."""

    rows: list[ReportRow]
    deferred: list[ReportRow] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes held, each storage once (offloaded host copies included)."""
        return sum(r.bytes for r in self.rows)

    @property
    def host_bytes(self) -> int:
        """Bytes kept in host memory: offloaded copies and random states (on a GPU these
        are not device memory)."""
        return sum(r.bytes for r in self.rows if r.kind in (OFFLOADED, RNG))

    @property
    def deferred_bytes(self) -> int:
        """Bytes the deferred inputs would have cost had their regions kept them."""
        return sum(r.bytes for r in self.deferred)

    def by_kind(self) -> dict[str, int]:
        return _sum_by(self.rows, lambda r: r.kind)

    def by_layer(self) -> dict[str | None, int]:
        return _sum_by(self.rows, lambda r: r.layer)

    def by_region(self) -> dict[str | None, int]:
        return _sum_by(self.rows, lambda r: r.region)

    def largest(self, n: int | None = None) -> list[ReportRow]:
        rows = sorted(self.rows, key=lambda r: -r.bytes)
        return rows if n is None else rows[:n]

    def format(self, largest_first: bool = False, max_rows: int | None = None) -> str:
        """The table: rows in forward order (or largest first), the deferred inputs, then
        totals per kind."""
        rows = self.largest() if largest_first else list(self.rows)
        shown = rows if max_rows is None else rows[:max_rows]
        header = ("layer", "region", "op", "kind", "shape", "dtype", "bytes")
        cells = [_cells(r) for r in shown]
        if len(shown) < len(rows):
            rest = rows[len(shown) :]
            more = f"... {len(rest)} more rows"
            cells.append(("...", "", more, "", "", "", str(sum(r.bytes for r in rest))))
        cells += [_cells(r) for r in self.deferred]
        text = _table(header, cells) + "\n\n" + self._totals()
        if len(shown) > LONG_TABLE:
            text += (
                f"\n({len(shown)} rows: summary() gives one line per layer, region and kind, "
                "format(largest_first=True, max_rows=N) the N largest storages)"
            )
        return text

    def summary(self) -> str:
        """One line per layer, region and kind: how many storages, how many bytes."""
        groups: dict[tuple[str | None, str | None, str], list[int]] = {}
        for row in self.rows + self.deferred:
            group = groups.setdefault((row.layer, row.region, row.kind), [0, 0])
            group[0] += 1
            group[1] += row.bytes
        header = ("layer", "region", "kind", "storages", "bytes")
        cells = [
            (layer or "-", region or "-", kind, str(n), str(nbytes))
            for (layer, region, kind), (n, nbytes) in groups.items()
        ]
        return _table(header, cells) + "\n\n" + self._totals()

    def _totals(self) -> str:
        lines = [f"{kind:>28}  {_size(nbytes)}" for kind, nbytes in self.by_kind().items()]
        lines.append(f"{'total held for backward':>28}  {_size(self.total_bytes)}")
        if self.deferred:
            lines.append(
                f"{'deferred, not held':>28}  {_size(self.deferred_bytes)} (rebuilt by the replay)"
            )
        if any(r.kind == COMPILED for r in self.rows):
            lines.append(
                "\nSaved by a compiled graph: torch.compile's partitioner chose what its graphs "
                "keep (checkpoints and excluded regions inside them included); the layers and "
                "regions inside compiled code are not visible here. For them, take the report "
                "of the model run eagerly with the same strategy."
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


class SavedTensorsRecord:
    """What :func:`record_saved_tensors` saw; ``report`` is complete once the block ends."""

    def __init__(self) -> None:
        self.report = SavedTensorsReport([])

    def __str__(self) -> str:
        return str(self.report)


class SavedTensorsRecorder(RegionObserver):
    """Records, while a forward runs, every storage it saves for backward.

    Three sources, none of which holds a tensor: a saved-tensor hook outermost
    around the step (tensors saved outside checkpoints), recomp's region observers
    (what each excluded region keeps, caches and defers), and each checkpoint's start
    (its layer and its inputs, every tensor in its arguments, lists, tuples, dicts
    and keyword arguments included: the framework's checkpoint holds them all,
    though only the tensors passed as arguments themselves reach a saved-tensor hook). Inside a checkpoint, the
    checkpoint's own hook is innermost, so its recomputed tensors are not seen:
    they are not held. Saves made during backward (a replay) are ignored.
    """

    def __init__(
        self, backend: Backend, model: Any, inputs: Any, layers: Iterable[str] = ()
    ) -> None:
        self.backend = backend
        self.layer_paths = set(layers)
        # (storage key, row) in the order seen; billed once per key in report()
        self.seen: list[tuple[Hashable, ReportRow]] = []
        self.deferred: list[tuple[Hashable, ReportRow]] = []
        self.excluded: set[Hashable] = set()
        self.input_layers: dict[Hashable, str] = {}
        self.layers: dict[int, str] = {}  # id(invocation) -> layer
        self.calls: dict[int, str | None] = {}  # id(region call) -> layer
        self.paths: dict[int, str] = {}  # id(module) -> path
        self.region_paths: dict[int, str] = {}
        self.unnamed: dict[str, int] = {}
        # Unnamed checkpointed callables, kept so that their ids stay theirs. Invocations
        # and region calls are not kept (that would hold cached outputs past backward):
        # each is labelled when it starts, before any lookup by its id.
        self.keep_alive: list[Any] = []
        if model is not None:
            for path, module in walk_named(backend.named_children, model):
                self.paths.setdefault(id(module), path)
                region = getattr(module, REGION, None)
                if isinstance(region, ExcludedRegion):
                    self.region_paths.setdefault(id(region), path)
            for t in backend.parameters_of(model):
                self._exclude(t)
        leaves, _ = backend.flatten(inputs)
        for leaf in leaves:
            if backend.is_tensor(leaf):
                self._exclude(leaf)

    def _exclude(self, t: Any) -> None:
        key = self.backend.storage_key(t)
        if key is not None:
            self.excluded.add(key)

    # -- sources ---------------------------------------------------------------------

    def pack(self, t: Any) -> Any:
        if self._recording():
            key = self.backend.storage_key(t)
            layer = self.input_layers.get(key) if key is not None else None
            if layer is not None:
                self._add(self.seen, t, CHECKPOINT_INPUT, layer, None, "input")
            else:
                op, path = self._running_op()
                self._add(self.seen, t, OUTSIDE, self._layer_of(path), None, op)
        return t

    @staticmethod
    def unpack(t: Any) -> Any:
        return t

    def checkpoint_started(self, invocation: Any, function: Any) -> None:
        if not self._recording():
            return
        module = self.backend.module_of(function)
        layer = self._name_of(function if module is None else module)
        self.layers[id(invocation)] = layer
        for key in invocation.checkpoint_inputs:
            self.input_layers.setdefault(key, layer)
        if get_recompute_state() is not None:
            return  # a checkpoint inside another's forward: its inputs are recomputed
        # The framework's checkpoint holds every input until backward, but only the
        # tensors passed as arguments themselves pass through a saved-tensor hook
        # (MindSpore keeps lists, tuples, dicts and keyword arguments in Python): bill
        # each input here, in the order given.
        for key, tensor in invocation.checkpoint_inputs.items():
            if key not in self.excluded:
                self._add(self.seen, tensor, CHECKPOINT_INPUT, layer, None, "input")

    def region_started(self, call: RegionCallView) -> None:
        state = get_recompute_state()
        if state is None or state.is_recomputing:
            owner = call.region
            self.calls[id(call)] = self._layer_of(self.region_paths.get(id(owner)))
            return
        self.calls[id(call)] = self.layers.get(id(invocation_of(state)))

    def tensor_kept(self, call: RegionCallView, original: Any, kept: Any) -> None:
        self._add(self.seen, original, KEPT, self.calls.get(id(call)), call, self._running())

    def output_cached(self, call: RegionCallView, output: Any, nbytes: int) -> None:
        self._add(self.seen, output, CACHED, self.calls.get(id(call)), call, "output")

    def tensor_deferred(self, call: RegionCallView, original: Any, is_view: bool) -> None:
        self._add(
            self.deferred,
            original,
            DEFERRED,
            self.calls.get(id(call)),
            call,
            self._running(),
            is_view,
        )

    # -- the report ------------------------------------------------------------------

    def report(self) -> SavedTensorsReport:
        order = {kind: i for i, kind in enumerate(HELD_KINDS)}
        billed = set(self.excluded)
        rows: list[tuple[int, ReportRow]] = []
        for position, (key, row) in sorted(enumerate(self.seen), key=lambda p: order[p[1][1].kind]):
            if key in billed or row.bytes == 0:
                continue
            billed.add(key)
            rows.append((position, row))
        return SavedTensorsReport(
            [row for _, row in sorted(rows, key=lambda p: p[0])],
            [row for _, row in self.deferred],
        )

    # -- helpers ---------------------------------------------------------------------

    def _recording(self) -> bool:
        state = get_recompute_state()
        return not self.backend.in_backward() and not (state is not None and state.is_recomputing)

    def _add(
        self,
        into: list[tuple[Hashable, ReportRow]],
        t: Any,
        kind: str,
        layer: str | None,
        call: RegionCallView | None,
        op: str,
        is_view: bool = False,
    ) -> None:
        if not self.backend.is_tensor(t) or self.backend.is_parameter(t):
            return
        key = self.backend.storage_key(t)
        if key is None:
            return
        shape = tuple(int(n) for n in t.shape)
        nbytes = int(t.nbytes) if is_view else self.backend.storage_nbytes(t)
        region = None
        if call is not None:
            owner = call.region
            region = self.region_paths.get(id(owner), call.region_name)
        into.append((key, ReportRow(layer, region, op, kind, nbytes, shape, _dtype(t), "-")))

    def _name_of(self, owner: Any) -> str:
        path = self.paths.get(id(owner))
        if path is not None:
            return path or "(model)"
        base = (
            type(owner).__name__
            if self.backend.module_of(owner) is owner
            else getattr(owner, "__qualname__", "checkpoint")
        )
        n = self.unnamed.get(base, 0)
        self.unnamed[base] = n + 1
        self.paths[id(owner)] = f"{base}#{n}"  # the same name for its next call
        self.keep_alive.append(owner)
        return self.paths[id(owner)]

    def _running(self) -> str:
        return self._running_op()[0]

    def _layer_of(self, path: str | None) -> str | None:
        """The layer (of ``layers``) that the module at ``path`` belongs to."""
        while path is not None:
            if path in self.layer_paths:
                return path
            path = path.rpartition(".")[0] if "." in path else None
        return None

    def _running_op(self) -> tuple[str, str | None]:
        """What is saving, from the Python stack: the framework's operation, if it shows
        there, in the innermost module whose forward runs (``MatMul in layers.0.fc
        (Dense)``), and that module's path (None if unknown)."""
        frame = inspect.currentframe()
        try:
            op = _operation(self.backend, frame)
            module = self.backend.running_module(frame)
        finally:
            del frame  # a frame kept in a local would make a reference cycle
        if module is None:
            return op or "-", None
        path = self.paths.get(id(module))
        where = f"{path} ({type(module).__name__})" if path else type(module).__name__
        return (f"{op} in {where}" if op else where), path


def _operation(backend: Backend, frame: Any) -> str | None:
    """The framework operation being called nearest to ``frame`` (a MindSpore primitive's
    ``__call__``), looking no further than the innermost module's forward."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("forward", "construct"):
            return None
        if code.co_name == "__call__" and code.co_argcount:
            name = backend.operation_name(frame.f_locals.get(code.co_varnames[0]))
            if name is not None:
                return name
        frame = frame.f_back
    return None


def _dtype(t: Any) -> str:
    name = str(t.dtype)
    return name.rpartition(".")[2].lower()


@contextlib.contextmanager
def record_saved_tensors(
    backend: Backend, model: Any = None, inputs: Any = None, layers: Iterable[str] = ()
) -> Iterator[SavedTensorsRecord]:
    """Record what the forward inside the block saves for backward; see the
    framework's ``record_saved_tensors``."""
    layers = list(layers)
    if layers and model is None:
        raise ValueError(
            "record_saved_tensors: layers= names module paths of model=; pass the model too"
        )
    recorder = SavedTensorsRecorder(backend, model, inputs, layers)
    unknown = sorted(set(layers) - set(recorder.paths.values()))
    if unknown:
        raise ValueError(
            f"record_saved_tensors: no module of the model at {', '.join(map(repr, unknown[:3]))}; "
            "layers= takes module paths as the model names them (for example 'layers.0')"
        )
    record = SavedTensorsRecord()
    try:
        with backend.saved_tensors_hooks(recorder.pack, recorder.unpack), observing(recorder):
            yield record
    finally:
        record.report = recorder.report()
        recorder.keep_alive.clear()


def _sum_by(rows: list[ReportRow], key: Any) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for row in rows:
        k = key(row)
        out[k] = out.get(k, 0) + row.bytes
    return out


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} B)"
    return f"{n} B"


def _cells(r: ReportRow) -> tuple[str, ...]:
    return (
        r.layer or "-",
        r.region or "-",
        r.op,
        r.kind,
        "x".join(map(str, r.shape)) or "scalar",
        r.dtype,
        str(r.bytes),
    )


def _table(header: tuple[str, ...], cells: Sequence[tuple[str, ...]]) -> str:
    """Columns padded to their widths; the last (bytes) right-aligned."""
    table = [header, *cells]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    last = len(header) - 1
    lines = [
        "  ".join(
            c.rjust(w) if i == last else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))
        )
        for line in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
