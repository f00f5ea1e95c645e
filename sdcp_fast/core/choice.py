"""A choice between two ways of doing the same work, made by running both and measuring.

Used where which way is faster depends on the machine, the deployment and the load, so
that no constant or model can be trusted to say it: the linear layers' form on the CPU
(models/linear_forms.py), a drafter's drafting ahead (drafter/ahead.py) and the verifier's
speculating or decoding by itself at a load (verifier/speculation.py). The caller runs
`way`, measures a cost of the run (lower is better: seconds a pass, seconds a committed
token) and reports it with `observe`. The two ways alternate until each has `warmup`
runs, then the one with the lower median of its last `samples` runs, and every
`recheck`-th run the other, so that a change of conditions is followed at a bounded cost.
The median, not the mean: a run disturbed by something else on the machine must not decide.

With `confirm` on, a change of choice is confirmed side by side: when the way not chosen
comes out cheaper, both ways' samples are dropped and the two alternate again for `warmup`
runs each, and the choice stands or changes on those (the old one is kept meanwhile). The
chosen way's window holds its latest runs and the other's its runs of long ago, so a
disturbance that slows several runs in a row (work of another process, a burst of page
faults) otherwise moves the choice to the dearer way, where it stays until enough of its
rechecks, one every `recheck` runs, come out cheap again: runs alternated pass by pass see
the same conditions.
"""

from __future__ import annotations

import statistics
from collections import deque


class TwoWayChooser:
    """Ways are 0 and 1 (a bool works as either). Not thread-safe."""

    def __init__(self, first: int = 0, *, warmup: int = 3, samples: int = 7, recheck: int = 25,
                 confirm: bool = False) -> None:
        if not 1 <= warmup <= samples or recheck < 2:
            raise ValueError("need 1 <= warmup <= samples and recheck >= 2")
        self.way = int(first)               # the way the next run takes
        self.chosen: int | None = None      # the faster way, once both have `warmup` runs
        self.runs = 0                       # runs observed
        self.warmup, self.recheck, self.confirm = warmup, recheck, confirm
        self.confirming = False             # a change of choice being confirmed side by side
        self.samples: tuple[deque[float], deque[float]] = (deque(maxlen=samples), deque(maxlen=samples))

    def observe(self, way: int, cost: float) -> None:
        """A run of `way` cost `cost`. A run of a way that is no longer `way` (one that began
        before the last change and ended after it) is not counted."""
        way = int(way)
        if way != self.way:
            return
        self.samples[way].append(cost)
        self.runs += 1
        if min(len(s) for s in self.samples) >= self.warmup:
            medians = [statistics.median(s) for s in self.samples]
            cheaper = 0 if medians[0] <= medians[1] else 1
            if self.confirm and self.chosen is not None and cheaper != self.chosen and not self.confirming:
                self.confirming = True
                for window in self.samples:
                    window.clear()
            else:
                self.chosen, self.confirming = cheaper, False
        if self.chosen is None or self.confirming:
            self.way = 1 - way
        else:
            self.way = 1 - self.chosen if self.runs % self.recheck == 0 else self.chosen
