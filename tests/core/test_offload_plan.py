"""The offload session's planner on traces written by hand (framework-free).

Adapted from HyperParallel's greedy residency planner tests (``tests/ut/auto_parallel/
hyper_offload/planning/test_greedy_planner.py``) where the subject is the same (what
moves under a budget; the copy out after the last save; the longest reuse distance
first among equals; nothing once the budget holds; everything at a budget of 0), plus
what a planner that is not only greedy must do: move fewer bytes than a
longest-gap-first pass where one exists, prefer copies the host link can hide, start a
copy back late where starting it early would pass the budget, and say why.
HyperParallel's ``retained_sids`` and release actions have no counterpart: a storage
here is released by the graph that holds it.
"""

from __future__ import annotations

import pytest

from recomp._offload_plan import BudgetPlanner, OffloadTrace, TraceRecorder

K = 1024


def trace(sizes, order, budget, *, movable=None, seconds=None, bandwidth=None, host_limit=None):
    """A trace from ``order``: ("s", i) saves storage i, ("r", i) reads it."""
    rec = TraceRecorder()
    for i, size in enumerate(sizes):
        ok = True if movable is None else movable[i]
        rec.new_storage(size, f"t{i}", ok, None if ok else "pinned by the test")
    for kind, i in order:
        if kind == "s":
            rec.save(i, ((sizes[i],), "float32", "cuda"))
        else:
            rec.read(i)
    tr = rec.trace
    tr.budget_bytes = budget
    tr.seconds = seconds
    tr.host_bandwidth = bandwidth
    tr.host_limit_bytes = host_limit
    return tr


def lifo(n):
    """Save 0..n-1, then read n-1..0 (a forward, then its backward)."""
    return [("s", i) for i in range(n)] + [("r", i) for i in reversed(range(n))]


def moved(plan):
    return sorted(plan.decisions)


def test_an_empty_trace_moves_nothing():
    plan = BudgetPlanner().build(OffloadTrace(budget_bytes=0))
    assert plan.decisions == {} and plan.moved_bytes == 0
    assert "saved nothing" in plan.summary()


def test_within_the_budget_nothing_moves():
    plan = BudgetPlanner().build(trace([K, K], lifo(2), budget=2 * K))
    assert moved(plan) == []
    assert plan.traced_peak_bytes == plan.planned_peak_bytes == 2 * K
    assert plan.kept == {0: "the budget holds without moving anything", 1: plan.kept[1]}


def test_no_gap_no_move_and_the_plan_says_it_does_not_fit():
    # Saved and read at once: nothing to gain from moving it.
    plan = BudgetPlanner().build(trace([2 * K], [("s", 0), ("r", 0)], budget=K))
    assert moved(plan) == [] and not plan.fits
    assert "read right after its last save" in plan.kept[0]
    assert "the budget cannot be met" in plan.summary()


def test_a_storage_with_a_gap_moves_after_its_last_save():
    # 0 is saved twice (two ops save it); only after the second save may it move.
    order = [("s", 0), ("s", 1), ("s", 0), ("s", 2), ("r", 2), ("r", 1), ("r", 0)]
    plan = BudgetPlanner().build(trace([2 * K, 2 * K, K], order, budget=4 * K))
    assert plan.traced_peak_bytes == 5 * K
    assert moved(plan) == [0] and plan.fits
    assert plan.decisions[0].offload_after == 2
    assert plan.evictions() == {2: 0}  # after the third save or region
    assert plan.decisions[0].prefetch_at == 5  # one event ahead of its read (untimed)


def test_among_equals_the_longer_reuse_distance_moves():
    order = [("s", 0), ("s", 1), ("r", 1), ("r", 0)]
    plan = BudgetPlanner().build(trace([K, K], order, budget=K))
    assert moved(plan) == [0]


def test_it_stops_once_the_budget_holds():
    plan = BudgetPlanner().build(trace([K, K, K], lifo(3), budget=2 * K))
    assert len(plan.decisions) == 1 and plan.fits


def test_a_zero_budget_moves_everything_with_a_gap():
    plan = BudgetPlanner().build(trace([K] * 4, lifo(4), budget=0))
    # The last one saved is read right after: it cannot move.
    assert moved(plan) == [0, 1, 2]
    assert plan.kept[3].startswith("read right after")


def test_what_cannot_move_stays_and_is_named():
    plan = BudgetPlanner().build(
        trace([4 * K, 4 * K, K], lifo(3), budget=4 * K, movable=[False, True, True])
    )
    assert 0 not in plan.decisions and plan.kept[0] == "pinned by the test"


def longest_gap_first(tr):
    """HyperParallel's greedy: gaps sorted by length, then size; each taken while an event
    it covers is over the budget (no second look)."""
    res = tr.resident()
    chosen = []
    for s in sorted(tr.storages, key=lambda s: (s.reads[0] - s.saves[-1], s.nbytes), reverse=True):
        span = range(s.saves[-1] + 1, s.reads[0])
        if max(res) <= tr.budget_bytes:
            break
        if any(res[e] > tr.budget_bytes for e in span):
            chosen.append(s.index)
            for e in span:
                res[e] -= s.nbytes
    return chosen, max(res)


def test_fewer_bytes_than_longest_gap_first():
    # A small tensor with the longest reuse distance, a large one just inside it: taking
    # the small one first does not suffice, and once the large one moves the small one
    # is not needed. The greedy pass keeps both; the planner moves the large one only.
    sizes = [K, 8 * K, 8 * K]
    order = [("s", 0), ("s", 1), ("s", 2), ("r", 2), ("r", 1), ("r", 0)]
    tr = trace(sizes, order, budget=10 * K)
    greedy, greedy_peak = longest_gap_first(tr)
    plan = BudgetPlanner().build(tr)
    assert sorted(greedy) == [0, 1] and greedy_peak <= 10 * K
    assert moved(plan) == [1] and plan.fits
    assert plan.moved_bytes == 8 * K < sum(sizes[i] for i in greedy)
    assert plan.kept[0] == "chosen, then not needed once the others moved"


def test_a_copy_back_starts_late_where_early_would_pass_the_budget():
    # Untimed, a copy back starts one event before its read; where that event is the
    # read of a large tensor, it starts at its own read instead (backward waits).
    plan = BudgetPlanner().build(trace([4 * K, K, 2 * K, 8 * K, K], lifo(5), budget=8 * K))
    assert moved(plan) == [0, 1, 2, 3] and plan.fits
    assert plan.planned_peak_bytes == 8 * K
    ahead = {i: d.prefetch_at for i, d in plan.decisions.items()}
    assert ahead[0] is not None and ahead[1] is not None
    assert ahead[2] is None and ahead[3] is None  # copied back when read
    assert "copied back when read" in plan.decisions[3].reason


def test_the_host_link_decides_between_equal_byte_counts():
    # Over the budget by 8 KiB at events 4-5: one 8 KiB tensor (0, saved first, read
    # last) or two 4 KiB ones (1, 2) free it. Their reuse windows are about 5 ms; at
    # this bandwidth an 8 KiB copy takes 3 ms each way (6 ms out and back: more than its
    # window), a 4 KiB one 1.5 ms. Counting bytes only they tie and the longer reuse
    # distance wins; with the host link counted, the two that hide do.
    sizes = [8 * K, 4 * K, 4 * K, 8 * K, K]
    order = [("s", 0), ("s", 1), ("s", 2), ("s", 4), ("s", 3),
             ("r", 3), ("r", 4), ("r", 2), ("r", 1), ("r", 0)]  # fmt: skip
    ms = 1e-3
    seconds = [t * ms for t in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 5.2, 5.3, 5.4)]
    tr = trace(sizes, order, budget=17 * K, seconds=seconds, bandwidth=8 * K / (3 * ms))
    plan = BudgetPlanner().build(tr)
    assert moved(plan) == [1, 2] and plan.fits
    assert all(d.hidden for d in plan.decisions.values())
    assert {d.prefetch_at for d in plan.decisions.values()} == {6}  # once 3 is read
    assert plan.exposed_seconds == 0.0
    assert "hidden" in plan.decisions[1].reason and "GB/s" in plan.summary()
    by_bytes = BudgetPlanner(exposure_weight=0).build(tr)
    assert moved(by_bytes) == [0] and by_bytes.moved_bytes == plan.moved_bytes
    assert by_bytes.decisions[0].hidden is False


def test_a_copy_that_cannot_hide_is_predicted_as_a_wait():
    ms = 1e-3
    tr = trace(
        [8 * K, K], lifo(2), budget=K,
        seconds=[0.0, 1 * ms, 2 * ms, 3 * ms], bandwidth=8 * K / (5 * ms),
    )
    plan = BudgetPlanner().build(tr)
    assert moved(plan) == [0]
    assert plan.decisions[0].hidden is False
    assert plan.exposed_seconds is not None and plan.exposed_seconds > 0
    assert "not all hidden" in plan.decisions[0].reason


def test_the_host_limit_stops_offloads():
    tr = trace([4 * K, 4 * K, K], lifo(3), budget=K, host_limit=5 * K)
    plan = BudgetPlanner().build(tr)
    assert plan.moved_bytes <= 5 * K and not plan.fits
    assert "host memory limit" in plan.summary()


def test_the_summary_names_each_tensor_and_why():
    plan = BudgetPlanner().build(trace([4 * K, K, 2 * K, 8 * K, K], lifo(5), budget=8 * K))
    text = str(plan)
    assert text.startswith("Offload plan: budget")
    assert "Offloads 4 of them" in text
    for i in (0, 1, 2, 3):
        assert f"offload #{i}: t{i} " in text
    assert "keep #4 t4" in text and "events later" in text


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="exposure_weight"):
        BudgetPlanner(exposure_weight=-1)
