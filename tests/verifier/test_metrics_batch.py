"""A batch's metrics in one update each read the same as the rounds counted one by one, and
updates held by the verifier's Metrics are there for whoever reads the registry."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sdcp_fast.core.messages import Action
from sdcp_fast.metrics import observe_many
from sdcp_fast.verifier.metrics import HOLD_UPDATES, Metrics


def _samples(metrics: Metrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() if family.name.startswith("sdcp_")
            for s in family.samples}


def test_committed_many_equals_committed_one_by_one():
    rng = random.Random(7)
    actions = [Action.CONTINUE, Action.REDUCE, Action.SWITCH, Action.SELF_DECODE, Action.FINISH, None]
    for _ in range(20):
        rounds = []
        for _ in range(rng.randrange(0, 40)):
            m = rng.randrange(1, 65)
            rounds.append((m, rng.randrange(0, m + 1), rng.choice(actions)))
        one_by_one, batched = Metrics(), Metrics()
        for r in rounds:
            one_by_one.committed(*r)
        batched.committed_many(rounds)
        assert _samples(batched) == _samples(one_by_one)


def test_observe_many_of_one_value_equals_repeated_observe():
    buckets = (0.001, 0.01, 0.1, 1.0)
    for amount in (0.0, 0.0005, 0.001, 0.05, 0.7, 3.0, float("inf"), float("nan")):
        for times in (0, 1, 5):
            registry = CollectorRegistry()
            repeated = Histogram("repeated", "", registry=registry, buckets=buckets)
            at_once = Histogram("at_once", "", registry=registry, buckets=buckets)
            for _ in range(times):
                repeated.observe(amount)
            observe_many(at_once, [(amount, times)])
            values = {}
            for family in registry.collect():
                for s in family.samples:
                    if not s.name.endswith("_created"):   # when the histogram was made: differs
                        values.setdefault(family.name, []).append((s.name.removeprefix(family.name), s.labels, s.value))
            assert str(values["repeated"]) == str(values["at_once"])   # (nan != nan)


def test_observe_many_equals_observe_one_by_one():
    """A batch's queue waits in one update read as one observe per job (buckets exactly;
    the sum to float rounding), edges of every bucket included."""
    rng = random.Random(11)
    for _ in range(30):
        one_by_one, batched = Metrics(), Metrics()
        bounds = one_by_one.queue_wait._upper_bounds
        values = [rng.choice([*bounds[:-1], 0.0, rng.random() * 2, rng.random() / 1e3, 1e6])
                  for _ in range(rng.randrange(0, 50))]
        for v in values:
            one_by_one.queue_wait.observe(v)
        observe_many(batched.queue_wait, [(v, 1) for v in values])
        a, b = _samples(one_by_one), _samples(batched)
        assert a.keys() == b.keys()
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-9 * max(1.0, abs(a[key])), key


def test_held_updates_are_written_for_every_reader_and_bounded():
    """The engine's held updates (batch sizes, waits, step times, rounds, proposals) read as
    the same updates made at once: on a scrape (generate_latest), on get_sample_value and on
    collect, without anything else written first; and they are written by themselves once
    HOLD_UPDATES are held (memory stays bounded with nobody scraping)."""
    rng = random.Random(3)
    actions = [Action.CONTINUE, Action.REDUCE, Action.FINISH, None]
    batches = []
    for _ in range(40):
        waits = [rng.random() / 100 for _ in range(rng.randrange(1, 9))]
        rounds = [(m, rng.randrange(0, m + 1), rng.choice(actions))
                  for m in (rng.randrange(1, 9) for _ in waits)]
        batches.append((waits, rng.random() / 50, rng.random() / 500, rounds))

    def run(metrics: Metrics, held: bool) -> None:
        for waits, forward_s, append_s, rounds in batches:
            for _ in waits:
                metrics.proposal() if held else metrics.proposals.inc()
            if held:
                metrics.hold(metrics.batch_size, len(waits))
                metrics.hold_each(metrics.queue_wait, waits)
                metrics.hold(metrics.forward_seconds, forward_s)
                metrics.hold(metrics.append_seconds, append_s, len(rounds))
                metrics.hold_rounds(rounds)
            else:
                metrics.batch_size.observe(len(waits))
                for w in waits:
                    metrics.queue_wait.observe(w)
                metrics.forward_seconds.observe(forward_s)
                for _ in rounds:
                    metrics.append_seconds.observe(append_s)
                metrics.committed_many(rounds)

    at_once = Metrics()
    run(at_once, held=False)
    want = _samples(at_once)

    def scraped(m: Metrics) -> dict:
        text = generate_latest(m.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) if family.name.startswith("sdcp_")
                for s in family.samples}

    def sampled(m: Metrics) -> dict:
        return {key: m.registry.get_sample_value(key[0], dict(key[1])) for key in want}

    readers = [_samples, scraped, sampled]
    for read in readers:
        held = Metrics()
        run(held, held=True)
        got = read(held)
        assert got.keys() == want.keys()
        for key in want:
            assert abs(got[key] - want[key]) <= 1e-9 * max(1.0, abs(want[key])), key
    held = Metrics()
    assert held.count("proposals") == 0
    held.proposal()
    assert held.count("proposals") == 1   # a read writes what is held first
    for _ in range(3 * HOLD_UPDATES):
        held.hold(held.batch_size, 1)
        assert len(held._held) < HOLD_UPDATES
    assert held.value("batch_size_count") == 3 * HOLD_UPDATES
