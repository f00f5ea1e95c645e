"""A batch's metrics in one update each read the same as the rounds counted one by one."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram

from sdcp_fast.core.messages import Action
from sdcp_fast.metrics import observe_times
from sdcp_fast.verifier.metrics import Metrics


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


def test_observe_times_equals_repeated_observe():
    buckets = (0.001, 0.01, 0.1, 1.0)
    for amount in (0.0, 0.0005, 0.001, 0.05, 0.7, 3.0):
        for times in (0, 1, 5):
            registry = CollectorRegistry()
            repeated = Histogram("repeated", "", registry=registry, buckets=buckets)
            at_once = Histogram("at_once", "", registry=registry, buckets=buckets)
            for _ in range(times):
                repeated.observe(amount)
            observe_times(at_once, amount, times)
            values = {}
            for family in registry.collect():
                for s in family.samples:
                    if not s.name.endswith("_created"):   # when the histogram was made: differs
                        values.setdefault(family.name, []).append((s.name.removeprefix(family.name), s.labels, s.value))
            assert values["repeated"] == values["at_once"]


def test_observe_each_equals_observe_one_by_one():
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
        batched.observe_each(batched.queue_wait, values)
        a, b = _samples(one_by_one), _samples(batched)
        assert a.keys() == b.keys()
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-9 * max(1.0, abs(a[key])), key
