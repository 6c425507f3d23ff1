"""The registry of RNG trackers (``recomp.register_rng_tracker``), without a framework:
what it holds, for how long, and which trackers it finds by itself. Checkpoints restoring
the trackers' states are tested in ``tests/torch/test_rng_trackers.py``."""

from __future__ import annotations

import gc
import sys
import types

import pytest

import recomp
from recomp import _rng_trackers


class Tracker:
    def __init__(self, value: int = 0) -> None:
        self.states_ = {"tp": value}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states


def live() -> list:
    return _rng_trackers.known_trackers()


def test_an_object_is_held_weakly():
    tracker = Tracker()
    registration = recomp.register_rng_tracker(tracker)
    assert live() == [tracker]
    del tracker
    gc.collect()
    assert registration.tracker() is None
    assert live() == []
    registration.remove()


def test_remove_unregister_and_context_manager():
    a, b = Tracker(), Tracker()
    registration = recomp.register_rng_tracker(a)
    assert recomp.register_rng_tracker(a) is registration  # once per object
    with recomp.register_rng_tracker(b):
        assert live() == [a, b]
    assert live() == [a]
    recomp.unregister_rng_tracker(a)
    assert live() == []
    registration.remove()  # twice is harmless
    recomp.unregister_rng_tracker(a)


def test_functions_are_held_until_removed():
    box = {"state": 1}

    def set_state(value):
        box["state"] = value

    registration = recomp.register_rng_tracker(
        get_states=lambda: box["state"], set_states=set_state
    )
    gc.collect()
    saved = _rng_trackers.capture_tracker_states()
    assert saved is not None
    box["state"] = 5
    saved.restore()
    assert box["state"] == 1
    registration.remove()
    assert _rng_trackers.capture_tracker_states() is None


def test_restore_hands_the_tracker_a_copy_it_may_change():
    tracker = Tracker(3)
    with recomp.register_rng_tracker(tracker):
        saved = _rng_trackers.capture_tracker_states()
        assert saved is not None
        for _ in range(2):
            saved.restore()
            tracker.states_["tp"] += 1  # a draw replaces the entry of the adopted dict
        saved.restore()
    assert tracker.states_ == {"tp": 3}


def test_refuses_what_is_not_a_tracker():
    with pytest.raises(TypeError, match="get_states"):
        recomp.register_rng_tracker(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="get_states"):
        recomp.register_rng_tracker(get_states=lambda: None)
    with pytest.raises(TypeError, match="not both"):
        recomp.register_rng_tracker(Tracker(), get_states=lambda: None)


@pytest.mark.parametrize("module_name, attribute", _rng_trackers.AUTOMATIC_TRACKERS)
def test_known_packages_are_found_once_imported(monkeypatch, module_name, attribute):
    assert live() == []
    module = types.ModuleType(module_name)
    monkeypatch.setitem(sys.modules, module_name, module)
    assert live() == []  # imported, tracker not created yet
    tracker = Tracker()
    setattr(module, attribute, tracker)
    assert live() == [tracker]
    with recomp.register_rng_tracker(tracker):
        assert live() == [tracker]  # each object once


def test_recomp_imports_neither_package():
    source = (_rng_trackers.__file__ or "").replace(".pyc", ".py")
    with open(source) as f:
        text = f.read()
    assert "import megatron" not in text and "import deepspeed" not in text
