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


def test_the_drafter_reports_its_choice_as_a_gauge(tmp_path):
    """sdcp_drafter_draft_ahead: -1 while both ways are measured, then the way chosen; 0 when
    the configuration turns drafting ahead off (no measuring then)."""
    from sdcp_fast.drafter.metrics import Metrics
    from sdcp_fast.drafter.service import DrafterConfig, DrafterService

    def gauge(service):
        return service.metrics.value("drafter_draft_ahead")

    service = DrafterService(DrafterConfig(uri="https://127.0.0.1:1", routers=()), backend=None, store=None)
    assert gauge(service) == -1
    for _ in range(2 * WARMUP):
        way = service.ahead.ahead
        for _ in range(BLOCK):
            service.ahead.observe(way, (0.040 if way else 0.025) * 5, 5)
    assert gauge(service) == 0
    service = DrafterService(DrafterConfig(uri="https://127.0.0.1:1", routers=()), backend=None, store=None, metrics=Metrics())
    for _ in range(2 * WARMUP):
        way = service.ahead.ahead
        for _ in range(BLOCK):
            service.ahead.observe(way, (0.020 if way else 0.030) * 5, 5)
    assert gauge(service) == 1
    off = DrafterService(DrafterConfig(uri="https://127.0.0.1:1", routers=(), draft_ahead=False), backend=None, store=None)
    assert gauge(off) == 0
