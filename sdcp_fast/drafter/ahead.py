"""Whether drafting ahead pays on this drafter, measured on its own rounds.

Drafting ahead (session.py: the next proposal drafted on the likely verdict while this one
is out) saves the next round its drafting when the guess holds. What it costs depends on
where the drafter runs: on a host of its own it costs nothing the verifier feels, but on
cores it shares with the verifier, the steps it runs during the verifier's pass take cores
from that pass, and the verdict then waits for the step under way (`settle`). Which one wins
is a property of the deployment, so it is measured, not assumed: the drafter's rounds run
in blocks of `BLOCK` rounds with drafting ahead allowed or not, each round timed answer to
answer (so the saved drafting, the slower pass and the settle all count), and
`core.choice.TwoWayChooser` picks the way of the next block (`WARMUP` blocks of each, then
the lower median of the last `SAMPLES`, the other every `RECHECK`-th) so that a change of
load or of placement is followed.

What a block is scored by: the median of its rounds' seconds brought to one M, by the
seconds a token of M costs on this drafter (the slope of seconds on M within each way, over
the last `FIT_ROUNDS` rounds of both). The way does not change what a round of a given M
commits (the proposals are the same tokens either way; acceptance is the text's), only how
long it takes, so the comparison is of time at equal M. Seconds a committed token would
also compare the two ways' texts: at one request a block of 4 rounds is one stretch of
text, whose acceptance moves the figure by more than the way does. The slope is fitted
within each way so that a way whose blocks happened on harder text (shorter M) is not
credited with the difference. The median, of a block's rounds and of the blocks kept: a
round that waited for something else on the machine (a collection, another process) must
not decide; and `WARMUP` blocks of each way before choosing, because where the drafter
shares the verifier's cores the two ways differ by less than one round's noise.

A round is counted only when the round before it, in the same session, ran the same way: a
round's drafting is saved or not by the way its predecessor ran.
"""

from __future__ import annotations

import statistics
from collections import deque

from ..core.choice import TwoWayChooser

BLOCK = 4          # rounds a block
WARMUP = 5         # blocks of each way before the drafter chooses
SAMPLES = 7        # recent blocks of each way kept
RECHECK = 25       # every RECHECK-th block runs the way not chosen
FIT_ROUNDS = 64    # recent rounds (both ways) the seconds-by-M line is fitted to


class AheadChooser:
    """Per drafter (all its sessions): `ahead` says whether rounds now draft ahead;
    `observe` takes each counted round's answer-to-answer seconds and its M."""

    def __init__(self) -> None:
        # the first block drafts ahead (the protocol's usual way)
        self.choice = TwoWayChooser(True, warmup=WARMUP, samples=SAMPLES, recheck=RECHECK)
        self._recent: deque[tuple[bool, int, float]] = deque(maxlen=FIT_ROUNDS)
        self._block: list[tuple[int, float]] = []

    @property
    def ahead(self) -> bool:
        return bool(self.choice.way)

    @property
    def chosen(self) -> bool | None:
        return None if self.choice.chosen is None else bool(self.choice.chosen)

    @property
    def samples(self):
        return self.choice.samples

    def observe(self, ahead: bool, seconds: float, m: int) -> None:
        if ahead != self.ahead or m <= 0 or seconds <= 0:
            return                        # a round of the block before, finishing late
        self._recent.append((ahead, m, seconds))
        self._block.append((m, seconds))
        if len(self._block) < BLOCK:
            return
        slope = seconds_a_token_of_m(self._recent)
        self.choice.observe(ahead, statistics.median(s - slope * m for m, s in self._block))
        self._block = []


def seconds_a_token_of_m(rounds) -> float:
    """The least-squares slope of seconds on M within each way, pooled over `rounds`
    ((way, m, seconds)); 0 where no way's rounds differ in M."""
    by_way: dict[bool, list[tuple[int, float]]] = {}
    for way, m, seconds in rounds:
        by_way.setdefault(way, []).append((m, seconds))
    covariance = spread = 0.0
    for points in by_way.values():
        mean_m = sum(m for m, _ in points) / len(points)
        mean_s = sum(s for _, s in points) / len(points)
        covariance += sum((m - mean_m) * (s - mean_s) for m, s in points)
        spread += sum((m - mean_m) ** 2 for m, _ in points)
    return covariance / spread if spread > 0 else 0.0
