"""Whether drafting ahead pays on this drafter, measured on its own rounds.

Drafting ahead (session.py: the next proposal drafted on the likely verdict while this one
is out) saves the next round its drafting when the guess holds. What it costs depends on
where the drafter runs: on a host of its own it costs nothing the verifier feels, but on
cores it shares with the verifier, the steps it runs during the verifier's pass take cores
from that pass, and the verdict then waits for the step under way (`settle`). Which one wins
is a property of the deployment, so it is measured, not assumed: the drafter's rounds run in
blocks of `BLOCK` rounds with drafting ahead allowed or not, each block timed as seconds a
committed token, answer to answer (so the saved drafting, the slower pass and the settle
all count); the two ways alternate until each has `WARMUP` blocks, then the one with the
lower median of its last `SAMPLES` runs, and the other once every `RECHECK` blocks so that a
change of load or of placement is followed.

A round is counted only when the round before it, in the same session, ran the same way: a
round's drafting is saved or not by the way its predecessor ran.
"""

from __future__ import annotations

import statistics
from collections import deque

BLOCK = 4          # rounds a block
WARMUP = 3         # blocks of each way before the drafter chooses
SAMPLES = 7        # recent blocks of each way kept
RECHECK = 25       # every RECHECK-th block runs the way not chosen


class AheadChooser:
    """Per drafter (all its sessions): `ahead` says whether rounds now draft ahead;
    `observe` takes each counted round's answer-to-answer seconds and committed tokens."""

    def __init__(self) -> None:
        self.ahead = True                 # the first block drafts ahead (the protocol's usual way)
        self.blocks = 0                   # blocks completed
        self.chosen: bool | None = None
        self.samples: dict[bool, deque[float]] = {True: deque(maxlen=SAMPLES), False: deque(maxlen=SAMPLES)}
        self._rounds = 0
        self._seconds = 0.0
        self._tokens = 0

    def observe(self, ahead: bool, seconds: float, tokens: int) -> None:
        if ahead != self.ahead or tokens <= 0 or seconds <= 0:
            return                        # a round of the block before, finishing late
        self._rounds += 1
        self._seconds += seconds
        self._tokens += tokens
        if self._rounds < BLOCK:
            return
        self.samples[self.ahead].append(self._seconds / self._tokens)
        self._rounds, self._seconds, self._tokens = 0, 0.0, 0
        self.blocks += 1
        if min(len(s) for s in self.samples.values()) >= WARMUP:
            self.chosen = statistics.median(self.samples[True]) <= statistics.median(self.samples[False])
        if self.chosen is None:
            self.ahead = not self.ahead
        else:
            self.ahead = (not self.chosen) if self.blocks % RECHECK == 0 else self.chosen
