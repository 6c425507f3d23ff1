"""``recomp._engine.ComposedContext`` enters its contexts as nested ``with`` blocks would:
in order, left in reverse, errors passed outwards, suppression and errors raised on the
way out seen by the contexts outside, and one entry per replay (re-entrant). The same of
a phase's context composed with one part's (``_PhaseAndPart``: a plain call's forward and
replay), the phase outside or inside the part, where its listener stands for the other
context (a phase raises where its listener does, and suppresses nothing)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from recomp._engine import ComposedContext, _PhaseAndPart
from recomp._state import CallIdentity, get_recompute_state


class _AsListener:
    """A phase's listener that logs and fails as the ``Logged`` context it stands for."""

    def __init__(self, logged: Logged) -> None:
        self.logged = logged

    def on_forward_start(self) -> None:
        self.logged.__enter__()

    def on_replay_start(self) -> None:
        raise AssertionError("a forward phase")

    def on_forward_end(self, ok: bool) -> None:
        logged = self.logged
        # The error the phase leaves with is the one being handled.
        kind = None if ok else sys.exc_info()[0]
        logged.log.append(f"exit {logged.name} {kind.__name__ if kind else None}")
        if logged.fail_exit:
            raise OSError(logged.name)


@pytest.fixture(params=["loop", "phase-outside", "phase-inside"])
def compose(request: Any) -> Any:
    """Compose contexts as the engine does: for two, one of them may be a phase's."""

    def make(*contexts: Any) -> Any:
        if request.param != "loop" and len(contexts) == 2:
            inner = request.param == "phase-outside"
            phase, other = contexts if inner else contexts[::-1]
            if not phase.suppress:  # a phase suppresses nothing
                identity = CallIdentity()
                return _PhaseAndPart(identity, identity, False, _AsListener(phase), other, inner)
        return ComposedContext(None, *contexts)

    return make


class Logged:
    def __init__(
        self,
        name: str,
        log: list[str],
        *,
        fail_enter: bool = False,
        suppress: bool = False,
        fail_exit: bool = False,
    ) -> None:
        self.name, self.log = name, log
        self.fail_enter, self.suppress, self.fail_exit = fail_enter, suppress, fail_exit

    def __enter__(self) -> None:
        if self.fail_enter:
            raise KeyError(self.name)
        self.log.append(f"enter {self.name}")

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        self.log.append(f"exit {self.name} {kind.__name__ if kind else None}")
        if self.fail_exit:
            raise OSError(self.name)
        return self.suppress


def test_order_and_reentry(compose: Any) -> None:
    log: list[str] = []
    composed = compose(Logged("a", log), Logged("b", log))
    with composed, composed:
        log.append("body")
    assert log == [
        "enter a",
        "enter b",
        "enter a",
        "enter b",
        "body",
        "exit b None",
        "exit a None",
        "exit b None",
        "exit a None",
    ]


def test_an_error_passes_outwards_and_suppression_hides_it_from_the_outside(compose: Any) -> None:
    log: list[str] = []
    with pytest.raises(ValueError), compose(Logged("a", log), Logged("b", log)):
        raise ValueError
    assert log[-2:] == ["exit b ValueError", "exit a ValueError"]
    log.clear()
    with compose(Logged("a", log), Logged("b", log, suppress=True)):
        raise ValueError
    assert log[-2:] == ["exit b ValueError", "exit a None"]


def test_an_error_raised_on_the_way_out_is_what_the_outside_sees(compose: Any) -> None:
    log: list[str] = []
    composed = compose(Logged("a", log), Logged("b", log, fail_exit=True))
    with pytest.raises(OSError) as info, composed:
        raise ValueError
    assert log[-1] == "exit a OSError"
    assert isinstance(info.value.__context__, ValueError)


def test_a_failed_enter_leaves_the_contexts_entered_so_far(compose: Any) -> None:
    log: list[str] = []
    composed = compose(Logged("a", log), Logged("b", log, fail_enter=True), Logged("c", log))
    with pytest.raises(KeyError), composed:
        log.append("body")
    assert log == ["enter a", "exit a KeyError"]
    # Nothing of the failed entry is left: the next one enters and leaves in full.
    composed.contexts[1].fail_enter = False
    log.clear()
    with composed:
        log.append("body")
    assert log == [
        "enter a",
        "enter b",
        "enter c",
        "body",
        "exit c None",
        "exit b None",
        "exit a None",
    ]


def test_a_context_re_entered_inside_its_own_entry_leaves_each_entry_in_full(compose: Any) -> None:
    # A replay context entered again inside its own entry: each exit leaves all of its
    # contexts, the inner entry first, and an error in the inner one reaches the outer.
    log: list[str] = []
    composed = compose(Logged("a", log), Logged("b", log))
    with pytest.raises(ValueError), composed, composed:
        raise ValueError
    assert log == [
        "enter a",
        "enter b",
        "enter a",
        "enter b",
        "exit b ValueError",
        "exit a ValueError",
        "exit b ValueError",
        "exit a ValueError",
    ]


def test_a_failed_second_enter_leaves_the_first(compose: Any) -> None:
    log: list[str] = []
    composed = compose(Logged("a", log), Logged("b", log, fail_enter=True))
    with pytest.raises(KeyError), composed:
        log.append("body")
    assert log == ["enter a", "exit a KeyError"]


@pytest.mark.parametrize("failing", ["a", "b"])
def test_an_exit_that_raises_without_an_error_reaches_the_outside(
    compose: Any, failing: str
) -> None:
    # No error in the body: the inner context raising on its way out is what the outer
    # one and the outside see; the outer one raising is what the outside sees.
    log: list[str] = []
    composed = compose(
        Logged("a", log, fail_exit=failing == "a"), Logged("b", log, fail_exit=failing == "b")
    )
    with pytest.raises(OSError, match=failing), composed:
        log.append("body")
    assert log[-2:] == ["exit b None", f"exit a {'OSError' if failing == 'b' else None}"]


def test_the_outer_context_suppressing_what_the_inner_one_raised_ends_the_block(
    compose: Any,
) -> None:
    # As nested with blocks: the inner exit raises, the outer one suppresses that error,
    # and the block ends without one, the error of the body included.
    log: list[str] = []
    with compose(Logged("a", log, suppress=True), Logged("b", log, fail_exit=True)):
        raise ValueError
    assert log == ["enter a", "enter b", "exit b ValueError", "exit a OSError"]
    log.clear()
    with compose(Logged("a", log, suppress=True), Logged("b", log, fail_exit=True)):
        log.append("body")
    assert log[-2:] == ["exit b None", "exit a OSError"]


@pytest.mark.parametrize("inner", [True, False])
def test_a_phase_with_a_part_installs_itself_as_the_state_where_the_part_is_inside_it(
    inner: bool,
) -> None:
    # The part's context sees the phase's state where it is entered inside the phase (a
    # replay's module state), none where outside (the forward's kept-replay handle).
    seen: list[Any] = []

    class Part:
        def __enter__(self) -> None:
            seen.append(get_recompute_state())

        def __exit__(self, *exc_info: Any) -> None:
            seen.append(get_recompute_state())

    log: list[str] = []
    identity = CallIdentity()
    phase = _PhaseAndPart(identity, identity, False, _AsListener(Logged("p", log)), Part(), inner)
    assert phase.contexts == (phase.other,)
    with phase as state:
        assert state is phase and get_recompute_state() is phase
        assert state.invocation_id == identity.id and not state.is_recomputing
    assert get_recompute_state() is None
    assert seen == ([phase, phase] if inner else [None, None])
    assert log == ["enter p", "exit p None"]
