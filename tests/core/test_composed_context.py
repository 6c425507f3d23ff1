"""``recomp._engine.ComposedContext`` enters its contexts as nested ``with`` blocks would:
in order, left in reverse, errors passed outwards, suppression and errors raised on the
way out seen by the contexts outside, and one entry per replay (re-entrant). The same of
its unrolled form for two contexts (a plain call's forward and replay)."""

from __future__ import annotations

from typing import Any

import pytest

from recomp._engine import ComposedContext, _ComposedPair


@pytest.fixture(params=["loop", "unrolled"])
def compose(request: Any) -> Any:
    """Compose contexts as the engine does: unrolled for two, when asked."""

    def make(*contexts: Any) -> ComposedContext:
        if request.param == "unrolled" and len(contexts) == 2:
            composed = _ComposedPair(None, *contexts)
            assert isinstance(composed, ComposedContext)
            return composed
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
    composed = compose(
        Logged("a", log), Logged("b", log, fail_enter=True), Logged("c", log)
    )
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
