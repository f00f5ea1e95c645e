"""The drafter's measured choice of drafting ahead (drafter/ahead.py): blocks of rounds
alternate between the two ways until each has WARMUP blocks, then the way with fewer seconds
a committed token runs, the other once every RECHECK blocks; a change of costs is followed;
rounds of the other way (a block's stragglers) are not counted."""

from __future__ import annotations

from sdcp_fast.drafter.ahead import BLOCK, RECHECK, SAMPLES, WARMUP, AheadChooser


def run_blocks(chooser, seconds_a_token, blocks):
    ways = []
    for _ in range(blocks):
        way = chooser.ahead
        ways.append(way)
        for _ in range(BLOCK):
            chooser.observe(way, seconds_a_token[way] * 5, 5)
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
    chooser.observe(True, 100.0, 1)          # a round of the other way finishing late: not counted
    assert chooser.samples[True][-1] == 0.040
    run_blocks(chooser, {True: 0.020, False: 0.060}, SAMPLES)
    assert chooser.chosen is True and chooser.ahead is True


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
