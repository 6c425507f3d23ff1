"""The property test over random programs (``random_programs``), written once for both
frameworks: ``tests/torch/test_properties.py`` and ``tests/mindspore/test_properties.py``
each supply how to run a program (their ops, checkpoint, regions and gradient call);
the search settings and the comparison are here.

The comparison: gradients of the inputs and of every parameter are bitwise equal
to a plain run (on CPU the same ops run on the same values). The one legitimate
difference is the order of float sums where recomp adds its boundary node to the
graph (``random_programs.BoundaryMirror``): such programs must be bitwise equal to
a plain run with an identity node in the boundary's place, and within 1e-5 of the
plain run. Each region body runs exactly as often as the forward calls it, never
in a replay.

Two searches: ``search(system=False)``, what ``make test`` runs, checks
``DEFAULT_EXAMPLES`` programs, derandomized, so every run and every machine checks
the same ones. ``search(system=True)``, for tests marked ``system`` (``make
test-system``, CI), checks ``RECOMP_PROPERTY_EXAMPLES`` or ``SYSTEM_EXAMPLES``
programs, new ones on each run; a failure prints the ``@reproduce_failure`` blob
that replays it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings

import random_programs as rp

DEFAULT_EXAMPLES = 150
SYSTEM_EXAMPLES = 1000


def search(*, system: bool, system_examples: int = SYSTEM_EXAMPLES) -> settings:
    """Hypothesis settings of the default search (``system=False``) or the longer one,
    of ``system_examples`` programs (a framework whose programs run slowly asks fewer)."""
    common: dict[str, Any] = {
        "deadline": None,
        "database": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    }
    if system:
        count = int(os.environ.get("RECOMP_PROPERTY_EXAMPLES", system_examples))
        return settings(max_examples=count, derandomize=False, print_blob=True, **common)
    return settings(max_examples=DEFAULT_EXAMPLES, derandomize=True, **common)


@dataclass
class Outcome:
    """What one way of running a program gave."""

    grads: list[dict[str, Any]]  # {input or parameter name: numpy array or None}, per result
    executions: list[int]  # region body executions, per region, over all forwards
    regions: list[Any]  # the region callables of the last forward
    forwards: int  # how many forwards ran


def runtime(
    mode: str,
    mirror: rp.BoundaryMirror,
    ops: dict[str, Callable[..., Any]],
    checkpoint: Callable[..., Any],
    exclude: Callable[[rp.Region, Callable[..., Any]], Any],
) -> tuple[rp.Runtime, Any]:
    """(the runtime, a context manager to run it under) for ``mode``: "recomp"
    (``checkpoint`` around the checkpoint blocks, ``exclude(region, body)`` around the
    regions, boundaries recorded in ``mirror``), "plain" (no recomp at all) or
    "mirrored" (plain, with ``mirror``'s identity nodes where recomp put boundaries)."""
    if mode == "recomp":

        def region(r: rp.Region, fn: Callable[..., Any]) -> Any:
            return exclude(r, mirror.recording(fn))

        return rp.Runtime(ops, checkpoint, region), mirror.spying()
    if mode not in ("plain", "mirrored"):
        raise ValueError(mode)
    plain = (lambda r, fn: mirror.mirrored(fn)) if mode == "mirrored" else (lambda r, fn: fn)
    return rp.Runtime(ops, _plain_checkpoint, plain), contextlib.nullcontext()


def _plain_checkpoint(fn: Callable[..., Any], *args: Any, early_stop: bool) -> Any:
    return fn(*args)


def check_gradients_match_unwrapped(
    program: rp.Program,
    run: Callable[[rp.Program, str, rp.BoundaryMirror], Outcome],
    identity: Callable[[list[Any], list[Any]], list[Any]],
) -> None:
    """Run ``program`` with recomp and plainly (``run(program, mode, mirror)``, modes
    as in :func:`runtime`) and compare; ``identity`` is the framework's identity node
    for :class:`random_programs.BoundaryMirror`."""
    mirror = rp.BoundaryMirror(identity)
    actual = run(program, "recomp", mirror)
    expected = run(program, "plain", mirror)
    assert len(actual.grads) == len(expected.grads) >= 1
    # Bitwise equal, unless recomp put a boundary into the graph: then bitwise equal to
    # the reference with identity nodes in its place, and close to the plain one.
    for want, got in zip(expected.grads, actual.grads):
        rp.assert_same_gradients(want, got, exact=not mirror.boundaries)
    if mirror.boundaries:
        mirrored = run(program, "mirrored", mirror)
        for want, got in zip(mirrored.grads, actual.grads):
            rp.assert_same_gradients(want, got, exact=True)
    calls = program.calls_per_region()
    assert actual.forwards == expected.forwards
    assert expected.executions == [c * expected.forwards for c in calls]
    # Each region body ran once per call in the forward, never in a replay.
    assert actual.executions == [c * actual.forwards for c in calls]
    # The last forward's wrappers count their own calls.
    assert [w.region_runs for w in actual.regions] == calls
