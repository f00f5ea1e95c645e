"""The drafter's measured choice of drafting ahead (drafter/ahead.py): blocks of rounds
alternate between the two ways until each has WARMUP blocks, then the way whose rounds take
less time at equal M runs, the other once every RECHECK blocks; a change of costs is
followed; rounds of the other way (a block's stragglers) are not counted; a way whose blocks
fell on harder text (shorter proposals) is not credited with the difference."""

from __future__ import annotations

import random

from sdcp_fast.drafter.ahead import (
    BLOCK,
    RECHECK,
    SAMPLES,
    WARMUP,
    AheadChooser,
    seconds_a_token_of_m,
)


def run_blocks(chooser, seconds_a_token, blocks, m=5):
    ways = []
    for _ in range(blocks):
        way = chooser.ahead
        ways.append(way)
        for _ in range(BLOCK):
            chooser.observe(way, seconds_a_token[way] * m, m)
    return ways


def test_alternates_then_keeps_the_faster_way_and_rechecks():
    chooser = AheadChooser()
    costs = {True: 0.040, False: 0.025}      # drafting ahead loses here (shared cores)
    assert run_blocks(chooser, costs, 2 * WARMUP) == [True, False] * WARMUP
    assert chooser.chosen is False and chooser.ahead is False
    ways = run_blocks(chooser, costs, RECHECK * 2)
    assert ways.count(True) == 2               # one block in RECHECK tries the other way
    # elsewhere (a drafter on its own host) drafting ahead wins
    chooser = AheadChooser()
    run_blocks(chooser, {True: 0.020, False: 0.030}, 2 * WARMUP)
    assert chooser.chosen is True and chooser.ahead is True


def test_follows_a_change_of_costs_and_ignores_stragglers():
    chooser = AheadChooser()
    run_blocks(chooser, {True: 0.040, False: 0.025}, 2 * WARMUP)
    assert chooser.ahead is False
    kept = list(chooser.samples[True])
    chooser.observe(True, 100.0, 1)          # a round of the other way finishing late: not counted
    assert list(chooser.samples[True]) == kept
    run_blocks(chooser, {True: 0.020, False: 0.060}, SAMPLES)
    assert chooser.chosen is True and chooser.ahead is True


def test_time_is_compared_at_equal_m_not_by_the_text_each_way_met():
    """A round costs 30 ms + 12 ms a token of M, plus 15 ms where drafting ahead slows the
    verifier's pass (shared cores). The ahead blocks fall on hard text (M of 1-3, one token
    committed a round), the others on easy text (M of 5-7, all committed): by seconds a
    committed token drafting ahead would look 3x worse for the text alone, and a line over
    M pooled across both ways would all but hide the 15 ms. Within-way slopes find both."""
    rng = random.Random(7)

    def seconds(ahead, m, extra):
        return 0.030 + 0.012 * m + (extra if ahead else 0.0) + rng.uniform(-0.002, 0.002)

    for extra, chosen in ((0.015, False), (-0.015, True)):
        chooser = AheadChooser()
        for _ in range(2 * WARMUP):
            way = chooser.ahead
            for _ in range(BLOCK):
                m = rng.randint(1, 3) if way else rng.randint(5, 7)
                chooser.observe(way, seconds(way, m, extra), m)
        assert chooser.chosen is chosen


def test_the_slope_is_fitted_within_each_way():
    rounds = [(True, m, 0.045 + 0.012 * m) for m in (1, 2, 3)] + [(False, m, 0.030 + 0.012 * m) for m in (5, 6, 7)]
    assert abs(seconds_a_token_of_m(rounds) - 0.012) < 1e-12
    assert seconds_a_token_of_m([(True, 4, 0.1), (False, 4, 0.2)]) == 0.0


def test_the_drafter_reports_its_choice_as_a_gauge():
    """sdcp_drafter_draft_ahead: -1 while both ways are measured, then the way chosen; 0 when
    the configuration turns drafting ahead off (no measuring then)."""
    from sdcp_fast.drafter.service import DrafterConfig, DrafterService

    def drafter(**options):
        return DrafterService(DrafterConfig(uri="https://127.0.0.1:1", routers=frozenset(), **options),
                              backend=None, store=None)

    def gauge(service):
        return service.metrics.value("drafter_draft_ahead")

    for seconds_a_token, chosen in (({True: 0.040, False: 0.025}, 0), ({True: 0.020, False: 0.030}, 1)):
        service = drafter()
        assert gauge(service) == -1
        run_blocks(service.ahead, seconds_a_token, 2 * WARMUP)
        assert gauge(service) == chosen
    assert gauge(drafter(draft_ahead=False)) == 0
