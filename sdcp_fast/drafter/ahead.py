"""Whether drafting ahead pays on this drafter, measured on its own rounds.

Drafting ahead (session.py: the next proposal drafted on the likely verdict while this one
is out) saves the next round its drafting when the guess holds. What it costs depends on
where the drafter runs: on a host of its own it costs nothing the verifier feels, but on
cores it shares with the verifier, the steps it runs during the verifier's pass take cores
from that pass, and the verdict then waits for the step under way (`settle`). Which one wins
is a property of the deployment, so it is measured, not assumed: the drafter's rounds run
in blocks of `BLOCK` rounds with drafting ahead allowed or not, each block timed as seconds
a committed token, answer to answer (so the saved drafting, the slower pass and the settle
all count), and `core.choice.TwoWayChooser` picks the way of the next block (`WARMUP`
blocks of each, then the lower median of the last `SAMPLES`, the other every `RECHECK`-th)
so that a change of load or of placement is followed.

A round is counted only when the round before it, in the same session, ran the same way: a
round's drafting is saved or not by the way its predecessor ran.
"""

from __future__ import annotations

from ..core.choice import TwoWayChooser

BLOCK = 4          # rounds a block
WARMUP = 3         # blocks of each way before the drafter chooses
SAMPLES = 7        # recent blocks of each way kept
RECHECK = 25       # every RECHECK-th block runs the way not chosen


class AheadChooser:
    """Per drafter (all its sessions): `ahead` says whether rounds now draft ahead;
    `observe` takes each counted round's answer-to-answer seconds and committed tokens."""

    def __init__(self) -> None:
        # the first block drafts ahead (the protocol's usual way)
        self.choice = TwoWayChooser(True, warmup=WARMUP, samples=SAMPLES, recheck=RECHECK)
        self._rounds = 0
        self._seconds = 0.0
        self._tokens = 0

    @property
    def ahead(self) -> bool:
        return bool(self.choice.way)

    @property
    def chosen(self) -> bool | None:
        return None if self.choice.chosen is None else bool(self.choice.chosen)

    @property
    def samples(self):
        return self.choice.samples

    def observe(self, ahead: bool, seconds: float, tokens: int) -> None:
        if ahead != self.ahead or tokens <= 0 or seconds <= 0:
            return                        # a round of the block before, finishing late
        self._rounds += 1
        self._seconds += seconds
        self._tokens += tokens
        if self._rounds < BLOCK:
            return
        self.choice.observe(ahead, self._seconds / self._tokens)
        self._rounds, self._seconds, self._tokens = 0, 0.0, 0
