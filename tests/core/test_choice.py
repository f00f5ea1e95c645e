"""core.choice.TwoWayChooser: alternation during the warm-up, the choice by medians, the
recheck of the way not chosen, following a change (confirmed side by side with `confirm`),
and runs of a way no longer current."""

from __future__ import annotations

import pytest

from sdcp_fast.core.choice import TwoWayChooser


def run(chooser: TwoWayChooser, costs: dict[int, float], n: int) -> list[int]:
    ways = []
    for _ in range(n):
        way = chooser.way
        ways.append(way)
        chooser.observe(way, costs[way])
    return ways


def test_alternates_from_the_first_way_then_keeps_the_cheaper_and_rechecks_the_other():
    chooser = TwoWayChooser(1, warmup=2, samples=5, recheck=10)
    assert run(chooser, {0: 2.0, 1: 1.0}, 4) == [1, 0, 1, 0] and chooser.chosen == 1
    steady = run(chooser, {0: 2.0, 1: 1.0}, 20)
    assert steady.count(0) == 2                 # runs 10 and 20 were followed by the other way
    assert steady[6] == 0 and steady[16] == 0   # the 11th and the 21st run


def test_follows_a_change_and_a_disturbed_run_does_not_decide():
    chooser = TwoWayChooser(0, warmup=3, samples=5, recheck=4)
    run(chooser, {0: 1.0, 1: 2.0}, 6)
    assert chooser.chosen == 0
    chooser.observe(chooser.way, 50.0)           # one run disturbed: the median holds
    assert chooser.chosen == 0
    run(chooser, {0: 3.0, 1: 2.0}, 12)           # the chosen way got dearer
    assert chooser.chosen == 1


def test_with_confirm_a_change_is_measured_side_by_side_before_it_is_made():
    chooser = TwoWayChooser(0, warmup=2, samples=5, recheck=50, confirm=True)
    run(chooser, {0: 1.0, 1: 2.0}, 4)
    assert chooser.chosen == 0
    # two runs of the chosen way slowed by something else: its median passes the other's
    run(chooser, {0: 9.0, 1: 2.0}, 2)
    assert chooser.confirming and chooser.chosen == 0 and not any(chooser.samples)
    # both alternate afresh, in the conditions of now: the old choice stands
    assert run(chooser, {0: 1.0, 1: 2.0}, 4) == [1, 0, 1, 0]
    assert chooser.chosen == 0 and not chooser.confirming
    # a real change is made once confirmed
    run(chooser, {0: 3.0, 1: 2.0}, 3)
    assert chooser.confirming and chooser.chosen == 0
    run(chooser, {0: 3.0, 1: 2.0}, 4)
    assert chooser.chosen == 1 and not chooser.confirming


def test_a_run_of_a_way_no_longer_current_is_not_counted():
    chooser = TwoWayChooser(0, warmup=1, samples=3, recheck=5)
    chooser.observe(1, 0.5)                      # began before the change to 0 ... not counted
    assert chooser.runs == 0 and chooser.way == 0 and not chooser.samples[1]


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        TwoWayChooser(warmup=4, samples=3)
    with pytest.raises(ValueError):
        TwoWayChooser(recheck=1)
