"""A fleet of verifiers and drafters as a discrete-event model (SimPy), calibrated from the
costs measured in the namespace runs of bench/bench_hosts.py (issue 36).

    .venv/bin/python bench/fleet_sim.py [--runs bench/hosts_runs.json] [--also OTHER_RUNS.json]
        [--itl-target-ms 25] [--plot bench/fleet_sim.png] [--validate-only]

The model, one verifier at a time, each part the deployment's own mechanism:
- a session's round: its drafter chooses M as sdcp_fast/drafter/session.py does (choose_m
  over its EWMAs of acceptance and of drafting time per token, and its verify cost per M
  learned from the model's own turnarounds, the controllers imported from the package),
  under the m_cap the verifier's verdicts carry (core.control's ladder and load rule, as
  core.session applies them with speculation "on"); it drafts M tokens, the proposal
  crosses the wire (the RTT measured through the relay at that delay, half each way), the
  roles handle it (`handle` + `hr` x R: the HTTP request and the verdict's write-out on
  both sides, slower when the machine is busier; handled beside the passes, as the
  verifier's event loop does; each round's time drawn from the measured spread of the
  handling, as factors of its mean), the next pass verifies it, the verdict crosses back;
- acceptance is the text's: rule 1 drafts greedily, so a proposal of M tokens at position c
  of prompt k's output accepts the run of positions from c where the draft's greedy token
  is the target's (bench_hosts records these matches per prompt and position; every
  measured session's rounds are checked against them), and the verdict emits accepted + 1
  tokens. Session s has prompt s, as bench_hosts gives its sessions prompts[:n];
- R, the other sessions' rounds per second: on the measured machine every role shares the
  cores, so the rest of the deployment's work, which comes per round, stretches a pass, a
  drafting step and the handling; a session's rate is the run's own (the model is run
  again at the rate its last run gave until it settles), times the other sessions active;
- the verifier batches the proposals waiting when a pass starts (up to max_batch), waiting
  for company as the verifier's engine does (its first job's batching wait; sessions of the last
  two batches expected back within half a batch's cost): a pass over n new tokens (M + 1
  for each proposal) costs v0 + v1 * n + vr * R, its commit included (on hosts of their
  own vr would be 0);
- a drafter drafts its sessions' tokens in batched steps (one token for every session that
  wants one): a step costs d0 + d1 * sessions in it + dr * R; before a proposal's steps the
  drafter applies the verdict and builds the proposal, `prep` + `prep_r` x R (a proposal of
  one token costs far more than a step, so a cost per token alone made the hard texts'
  many short proposals too cheap and the easy texts' long ones too dear);
- drafting ahead, as sdcp_fast/drafter/session.py does it: while a proposal is out the
  drafter drafts the next one on the all-accepted verdict when the session's measured odds
  (LookaheadOdds) say it will be used at least half the time; the verdict stops it; it is
  used when all M were accepted and its first token is the verifier's additional one (the
  text's match at position c + M), else thrown away (its steps were spent anyway);
- co-located: drafting and verifying take turns on one device (one resource); split: the
  verifier's device verifies only, drafters have their own;
- every session opens at once, as bench_hosts starts its streams: their opening work
  (placement, commit log, prefills) shares the machine, so each is open after sessions x
  `open_cost`; the assignment crosses to the drafter (one RTT), then `start` until its
  first round; the first proposal meets the verifier still opening the others and takes
  `first` longer than the later ones (which the drafter's verify cost per M remembers).

Calibration, each parameter from its own measurement (printed), at the lowest RTT, the runs
with drafting ahead and without pooled (the roles' costs do not depend on what the drafter
does between verdicts, and the two halves are measured interleaved, so pooling halves the
noise of either): v0, v1, vr by least squares over the verifier's batch log (pass time
against tokens in the pass and the run's R); `prep` and d0 by least squares of a round's
drafting time against its M (rounds that drafted all of their proposal) at 1 session, and
`prep_r` and dr from the same fit at the most sessions; `handle` and
`hr` from a round's turnaround less the measured round trip and its time in the verifier
(batch log, joined by session and round) at 1 session and at the most; `open_cost` and
`start` so that the model's time to first token matches the measured one at 1 session and
at the most sessions; `first`, a first round's turnaround less the later rounds' mean, at 1
session and at the most; `spread`, each round's handling over the mean, at the most
sessions. Nothing is fitted to tokens/s or ITL, and M is not taken from the
runs: it is the controllers' choice in the model. Validation: every measured run (each
RTT, ahead and not, 1 and 16 sessions) simulated and compared, tokens/s, inter-token
latency and mean M (the mean of VALIDATION_SEEDS runs of the model), error in percent
(goal: within 15%), twice: with the costs calibrated
at each RTT from that RTT's runs (on the measured machine the roles'
costs grow with the RTT: drafting per token, handling), and with the lowest RTT's costs for
every RTT. The questions below use the lowest RTT's costs (`--also` validates other runs).

Then, from the model: sessions one verifier sustains at the ITL target, split vs co-located,
next to the bound 1 + gamma * t_d / t_v from the same calibration (gamma: tokens drafted per
round, t_d: drafting cost per token with its share of the proposal's own work, t_v: the
verifier's pass per round); drafters needed per verifier; capacity against RTT with and
without drafting ahead (the lowest RTT's costs at every RTT, as on hosts whose costs do not
change with distance; and, at the RTTs measured, the costs measured there, the view the
validation checks); and fleets of 1 to 10,000
verifiers: the commit log appends and the router's relayed tokens they generate against the
measured capacity of one etcd cluster and one router core (bench_hosts measures appends/s
and every process's CPU seconds per token), i.e. where each saturates.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdcp_fast.core.control import (  # noqa: E402
    AcceptanceEstimate,
    Counters,
    Escalation,
    choose_m,
    clamp_m_init,
    escalate,
    is_low,
    next_m_cap,
)
from sdcp_fast.core.messages import Action  # noqa: E402
from sdcp_fast.drafter.session import LOOKAHEAD_MIN_P, LookaheadOdds, Timing  # noqa: E402

try:
    import simpy
except ImportError:                 # pragma: no cover - an install without the sim extra
    print("fleet_sim needs SimPy: pip install -e '.[sim]'", file=sys.stderr)
    raise SystemExit(2) from None

BATCH_WAIT_S = 0.001                # the verifier's max_wait_ms in the deployment (demo plan)
COMPANY_SHARE = 0.5                 # the verifier's company_share (its default)
TURNAROUND_ALPHA = 0.25             # sdcp_fast/verifier/engine.py's weight of a session's latest gap
M_MAX = 8                           # the demo plan's contract (sdcp_fast/demo/deployment.py): m_max,
ESCALATION = Escalation(low_rounds=4, low_ratio=0, self_load=60,   # its ladder
                        fallback=(Action.REDUCE, Action.SWITCH, Action.SELF_DECODE))
M_INIT = 4                          # the router's m_init (its default)
MAX_BATCH = 64                      # the verifier's max_batch (its default): jobs per pass, and its load's scale
VALIDATION_SEEDS = 5                # runs of the model per validated point (handling's spread is drawn)
RATE_ITERATIONS = 6                 # runs of the model to settle a run's round rate (its own fixed point)
STEADY = 8                          # capacity runs: generations this many times the measured ones


@dataclass
class Params:
    match: list[tuple[bool, ...]]   # per prompt: the draft's greedy token equals the target's, by position
    m_values: list[int]             # M of measured proposals (reported)
    d0: float                       # drafting step: d0 + d1 * sessions in the step
    d1: float                       #   + dr * the other sessions' rounds per second (s)
    dr: float
    v0: float                       # verifier pass: v0 + v1 * tokens in the pass (M + 1 a proposal)
    v1: float                       #   + vr * the other sessions' rounds per second (s)
    vr: float
    handle: float                   # the verifier's process per proposal, besides the pass:
    hr: float                       #   handle + hr * the other sessions' rounds per second (s)
    start: float                    # a session's opening until its first round (s)
    open_cost: float                # the machine's work per session opened, shared by those opening (s)
    rtt: float                      # the wire's round trip (s)
    ahead: bool
    colocated: bool = False
    first: tuple = (0.0, 0.0, 1)    # a first round's extra turnaround alone, with n sessions, n (s, s, n)
    spread: tuple = (1.0,)          # handling's measured spread: each round's over the mean (factors)
    drafters: int = 2
    rtt_of: dict = field(default_factory=dict)   # configured RTT (ms) -> measured round trip (s)
    prep: float = 0.0               # the drafter's work per proposal besides its steps (the verdict
    prep_r: float = 0.0             #   applied, the proposal built): prep + prep_r * R (s)

    @property
    def mean_m(self) -> float:
        return statistics.fmean(self.m_values)

    def at(self, rtt_ms: float) -> Params:
        """These costs at a configured RTT: the round trip measured through the relay there."""
        return replace(self, rtt=self.rtt_of.get(rtt_ms, rtt_ms / 1000))


@dataclass
class Result:
    tokens_per_s: float
    itl_ms: float
    ttft_ms: float
    mean_m: float = 0.0
    trace: dict = field(default_factory=dict)


# ---------------------------------------------------------------------- the model


class Model:
    def __init__(self, p: Params, sessions: int, max_new: int, rate: float = 0.0, seed: int = 0):
        self.p, self.sessions, self.max_new = p, sessions, max_new
        self.env = simpy.Environment()
        self.device = simpy.Resource(self.env, 1)              # the verifier's
        self.draft_devices = [self.device if p.colocated else simpy.Resource(self.env, 1)
                              for _ in range(max(1, p.drafters))]
        self.pending: list[tuple[int, simpy.Event]] = []
        self.wake = self.env.event()
        self.want: list[list[list]] = [[] for _ in self.draft_devices]
        self.draft_wake = [self.env.event() for _ in self.draft_devices]
        self.emitted = [0] * sessions
        self.itl: list[float] = []          # per session, as bench_hosts measures it
        self.ttft: list[float] = []
        self.finished = 0
        self.started = 0
        self.end_time = 0.0
        self.rate = rate                    # a session's rounds per second over the run (R's unit)
        self.rng = random.Random(seed)
        alone, many, n = p.first
        self.first_extra = alone + (many - alone) * (sessions - 1) / max(1, n - 1)
        self.active_s = 0.0                 # sessions' time from open to end, summed
        self.trace: dict[str, list] = {"pass": [], "jobs": [], "turnaround": [], "draft": [], "m": [],
                                       "emitted": [], "ladder": [], "controls": [], "ends": []}
        self.in_pass = False
        self.answered_at: list[float | None] = [None] * sessions   # the verifier's last verdict to each
        self.turnaround: list[float | None] = [None] * sessions    # ... and the EWMA of its way back
        # session s drafts prompt s's text, as bench_hosts gives its sessions prompts[:n]; a
        # generation longer than a measured one goes on with the next prompts' texts
        self.match = []
        for s in range(sessions):
            seq: list[bool] = []
            k = s
            while len(seq) < max_new + M_MAX + 1:
                seq.extend(p.match[k % len(p.match)])
                k += 1
            self.match.append(seq)
        # the verifier's side of M (core.session.complete with speculation "on"): the ladder's
        # counters and the m_cap each verdict carries
        self.counters = [Counters() for _ in range(sessions)]
        self.m_cap = [clamp_m_init(M_INIT, M_MAX) for _ in range(sessions)]

    def run(self) -> Result:
        self.env.process(self.verifier())
        for j in range(len(self.draft_devices)):
            self.env.process(self.drafter(j))
        for s in range(self.sessions):
            self.env.process(self.session(s))
        self.env.run()
        total = sum(self.emitted)
        return Result(total / self.end_time, 1000 * statistics.median(self.itl), 1000 * statistics.median(self.ttft),
                      statistics.fmean(self.trace["m"]))

    def draft(self, j: int, tokens: int) -> list:
        """[tokens left, event, tokens wanted]: the event fires once drafter j drafted them."""
        item = [tokens, self.env.event(), tokens]
        self.want[j].append(item)
        if not self.draft_wake[j].triggered:
            self.draft_wake[j].succeed()
        return item

    def cancel(self, j: int, item: list) -> None:
        if item in self.want[j]:
            self.want[j].remove(item)

    def drafter(self, j: int):
        p = self.p
        while True:
            if not self.want[j]:
                self.draft_wake[j] = self.env.event()
                yield self.draft_wake[j]
            with self.draft_devices[j].request() as turn:
                yield turn
                # co-located: the device drafts every wanted token before a pass may run
                # (a split drafter's device is its own, so the same loop)
                while self.want[j]:
                    batch = list(self.want[j])
                    yield self.env.timeout(p.d0 + p.d1 * len(batch) + p.dr * self.others_rate())
                    for item in batch:
                        if item not in self.want[j]:
                            continue                 # cancelled during the step
                        item[0] -= 1
                        if item[0] <= 0:
                            self.want[j].remove(item)
                            item[1].succeed()

    @property
    def back_at(self) -> list[float]:
        """When each session's next proposal is expected at the verifier."""
        return [math.inf if a is None or t is None else a + t
                for a, t in zip(self.answered_at, self.turnaround, strict=True)]

    def others_rate(self) -> float:
        """Rounds per second of the sessions other than one: what else the shared machine is
        busy with (drafting, the router, etcd, the other processes' messages) grows with it.
        A session's rate is the run's average, as calibrated (R of a measured run: its
        sessions' rounds over the run), not a rate measured as the model goes: at the start
        the machine is as busy as later (every session opening, then drafting), which a
        rate counted over the latest rounds would miss."""
        active = self.started - self.finished
        return self.rate * max(0, active - 1)

    def verifier(self):
        """The engine's loop (sdcp_fast/verifier/engine.py): a batch is every job waiting, and
        those that come while it waits for company: until its first job has waited the
        batching wait (none for a job that came during a pass), and, while a session of the
        last two batches is expected back (its last verdict plus its drafter's usual time to
        the next proposal) within COMPANY_SHARE of a batch's cost, until then."""
        p, env = self.p, self.env
        recent: deque[set[int]] = deque(maxlen=2)
        batch_s = 0.0
        while self.finished < self.sessions:
            if not self.pending:
                self.wake = env.event()
                yield self.wake | env.timeout(1.0)
                continue
            now = env.now
            first = self.pending[0]
            deadline = now if first[4] else first[3] + BATCH_WAIT_S
            company = now + COMPANY_SHARE * batch_s
            while True:
                waiting = {job[2] for job in self.pending}
                active = self.started - self.finished
                if len(waiting) >= active:
                    break                              # nobody else can come
                back = self.back_at
                expected = any(sid not in waiting and back[sid] <= company for sid in set().union(*recent))
                until = max(deadline, company) if expected else deadline
                if env.now >= until:
                    break
                self.wake = env.event()
                yield self.wake | env.timeout(until - env.now)
            batch, self.pending = self.pending[:MAX_BATCH], self.pending[MAX_BATCH:]
            recent.append({job[2] for job in batch})
            self.in_pass = True
            with self.device.request() as turn:
                yield turn
                seconds = p.v0 + p.v1 * sum(job[0] + 1 for job in batch) + p.vr * self.others_rate()
                self.trace["pass"].append(seconds)
                self.trace["jobs"].append(len(batch))
                yield env.timeout(seconds)
            self.in_pass = False
            batch_s = seconds if batch_s == 0 else batch_s + 0.2 * (seconds - batch_s)
            load = min(100, round(100 * (len(self.pending) + len(batch)) / (2 * MAX_BATCH)))   # engine.load
            for m, answered, s, _, _, at in batch:
                self.answered_at[s] = env.now
                a = self.accepted(s, at, m)
                self.counters[s], action, _ = escalate(ESCALATION, self.counters[s], a, m, load)
                self.m_cap[s] = next_m_cap(self.m_cap[s], M_MAX, action, is_low(a, m, ESCALATION.low_ratio), load)
                if action not in (Action.CONTINUE, Action.REDUCE):
                    self.trace["ladder"].append(action)   # (not modelled: the session carries on)
                answered.succeed((a, self.m_cap[s]))

    def accepted(self, s: int, at: int, m: int) -> int:
        """Greedy drafting of a fixed text: the tokens accepted from position `at` are the
        draft's run of matches with the target there, up to M."""
        seq = self.match[s]
        a = 0
        while a < m and seq[at + a]:
            a += 1
        return a

    def session(self, s: int):
        p, env = self.p, self.env
        j = s % len(self.draft_devices)
        began = env.now
        # every session opens at once (bench_hosts starts its streams together): the opening
        # work (placement, commit log, prefills) of all of them shares the machine, so each
        # is open after sessions x open_cost (the verifier's batch log shows the first
        # proposals of all sessions arriving together); the assignment crosses the wire
        yield env.timeout(p.open_cost * self.sessions + p.rtt)
        yield env.timeout(p.start)
        self.started += 1
        opened = env.now
        # the drafter's controllers (sdcp_fast/drafter/session.py), fed what this model times
        odds, alpha, timing = LookaheadOdds(), AcceptanceEstimate(), Timing()
        m_cap = clamp_m_init(M_INIT, M_MAX)

        def choose() -> int:                           # DraftSession.choose
            limit = min(M_MAX, m_cap, self.max_new - self.emitted[s])
            return choose_m(alpha.alpha, timing.draft_per_token, timing.verify_cost.at, max(1, limit))
        ready = 0                                      # tokens of the next proposal drafted ahead
        first = last = None
        while self.emitted[s] < self.max_new:
            m = choose()
            at = self.emitted[s]
            self.trace["controls"].append((s, m, alpha.alpha, timing.draft_per_token, timing.verify_cost.at(m)))
            building = env.now
            yield env.timeout(p.prep + p.prep_r * self.others_rate())   # the verdict applied, the proposal built
            if ready < m:
                yield self.draft(j, m - ready)[1]
            draft_s = env.now - building
            self.trace["draft"].append(draft_s)
            ahead = None
            if p.ahead and odds.hit >= LOOKAHEAD_MIN_P:
                room = self.max_new - self.emitted[s] - m - 1
                want = min(M_MAX, m_cap + 1, choose() + 1, room) + 1   # drafted on top of the proposal
                if want >= 2:
                    ahead = self.draft(j, want)
            sent = env.now
            yield env.timeout(p.rtt / 2)
            spread = p.spread[self.rng.randrange(len(p.spread))]   # as measured, round by round
            yield env.timeout(spread * (p.handle + p.hr * self.others_rate()))   # the request handled, the verdict written
            if first is None:
                yield env.timeout(self.first_extra)    # the first proposal meets the others' opening
            answered = env.event()
            if self.answered_at[s] is not None:        # the verifier's view of this drafter's pace
                gap = env.now - self.answered_at[s]
                self.turnaround[s] = gap if self.turnaround[s] is None else \
                    self.turnaround[s] + TURNAROUND_ALPHA * (gap - self.turnaround[s])
            self.pending.append((m, answered, s, env.now, self.in_pass, at))
            if not self.wake.triggered:
                self.wake.succeed()
            a, verdict_cap = yield answered
            yield env.timeout(p.rtt / 2)
            self.trace["turnaround"].append(env.now - sent)
            timing.observe_verify(env.now - sent, m)
            emitted = min(a + 1, self.max_new - self.emitted[s])
            if first is None:
                first = env.now
                self.ttft.append(first - began)
            last = env.now
            self.trace["m"].append(m)
            self.trace["emitted"].append(emitted)
            self.emitted[s] += emitted
            ready, right = 0, None
            if ahead is not None:
                self.cancel(j, ahead)                  # the verdict stops it
                drafted = ahead[2] - ahead[0]
                if a == m and drafted:
                    right = self.match[s][at + m]      # its first token: the verifier's additional one?
                    ready = drafted - 1 if right else 0
            timing.observe_draft(draft_s, m)
            alpha = alpha.update(a, m)
            odds.observe(a, m, right)
            m_cap = max(1, verdict_cap)
        if last is not None and self.emitted[s] > 1 and last > first:
            self.itl.append((last - first) / (self.emitted[s] - 1))
        elif first is not None:
            self.itl.append(0.0)
        self.finished += 1
        self.trace["ends"].append((s, env.now, self.itl[-1] if self.itl else None))
        self.active_s += env.now - opened
        self.end_time = max(self.end_time, env.now)
        if not self.wake.triggered:
            self.wake.succeed()


def simulate(p: Params, sessions: int, max_new: int, seeds: int = 1) -> Result:
    """The model (acceptance the measured texts', M the controllers' choice over the
    model's own timings, handling's spread drawn as measured) at its own round rate: run
    again with the mean of the rate assumed and the rate the run gave, until it settles;
    then the mean of `seeds` runs at that rate."""
    rate = 0.0
    for n in range(RATE_ITERATIONS):
        model = Model(p, sessions, max_new, rate)
        result = model.run()
        ran = len(model.trace["m"]) / model.active_s if model.active_s else 0.0
        rate = ran if n == 0 else (rate + ran) / 2
    results = [result] + [Model(p, sessions, max_new, rate, seed).run() for seed in range(1, seeds)]
    out = Result(*(statistics.fmean(getattr(r, f) for r in results)
                   for f in ("tokens_per_s", "itl_ms", "ttft_ms", "mean_m")))
    out.trace = model.trace
    return out


# ---------------------------------------------------------------------- calibration


def acceptance(rounds: list[dict], top: int = M_MAX, prior: list[float] | None = None) -> list[float]:
    """P(position k accepted | positions < k accepted), k = 1..top; a position never tried
    takes `prior`'s value (or the last one's)."""
    out = []
    for k in range(1, top + 1):
        tried = sum(1 for r in rounds if r["m"] >= k and r["accepted"] >= k - 1)
        took = sum(1 for r in rounds if r["accepted"] >= k)
        out.append(took / tried if tried else (prior[k - 1] if prior else (out[-1] if out else 0.5)))
    return out


def consistent(match: list[tuple[bool, ...]], runs: list[dict]) -> tuple[int, int]:
    """(sessions measured whose every round accepted exactly the run of draft matches at its
    position in one of the prompts' texts, sessions measured): how far acceptance is a
    property of the text alone, as the model takes it."""
    ok = total = 0
    for run in runs:
        by_session: dict[int, list[dict]] = {}
        for x in run["rounds"]:
            by_session.setdefault(x["session"], []).append(x)
        for rs in by_session.values():
            total += 1
            for seq in match:
                at, fits = 0, True
                for x in rs:
                    a = 0
                    while a < x["m"] and at + a < len(seq) and seq[at + a]:
                        a += 1
                    if a != x["accepted"]:
                        fits = False
                        break
                    at += x["emitted"]
                if fits:
                    ok += 1
                    break
    return ok, total


def least_squares(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Coefficients c >= 0 minimising |rows @ c - ys| (a coefficient that comes out negative,
    a cost that would fall with more work, is dropped and the rest fitted again)."""
    import numpy as np

    a, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
    keep = list(range(a.shape[1]))
    while True:
        c = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if (c >= 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for k, v in zip(keep, c, strict=True):
                out[k] = max(0.0, float(v))
            return out
        keep.pop(int(np.argmin(c)))


def pooled(runs: list[dict]) -> dict:
    """Runs of one size as one: their rounds (session ids kept apart per run) and batches, and
    the mean of their inter-token latencies and times to first token."""
    rounds = [dict(x, session=(k, x["session"])) for k, r in enumerate(runs) for x in r["rounds"]]
    return {"sessions": runs[0]["sessions"], "rounds": rounds, "batches": [b for r in runs for b in r["batches"]],
            "itl_ms": statistics.fmean(r["itl_ms"] for r in runs),
            "ttft_ms": statistics.fmean(r["ttft_ms"] for r in runs)}


def calibrate(record: dict) -> tuple[Params, dict]:
    runs = record["runs"]
    low = min(r["rtt_ms"] for r in runs)
    # the costs are the roles', whatever the drafter does between verdicts: both halves of the
    # lowest RTT's runs (with drafting ahead and without, measured interleaved) are pooled
    base = [r for r in runs if r["rtt_ms"] == low]
    one = pooled([r for r in base if r["sessions"] == 1])
    many = pooled([r for r in base if r["sessions"] == max(x["sessions"] for x in base)])
    rtt_of = {}
    for r in runs:       # the configured RTT's measured round trip (the relay at RTT/2 each way)
        measured = record.get("relay", {}).get(f"relay {r['delay_ms']:g}")
        rtt_of[r["rtt_ms"]] = measured["tcp_ms"] / 1000 if measured else r["rtt_ms"] / 1000
    rounds = [x for r in runs for x in r["rounds"]]
    m_values = [x["m"] for x in rounds]
    if "match" not in record:
        raise SystemExit("fleet_sim: the record has no draft matches per position ('match'): run bench_hosts again")
    match = [tuple(c == "1" for c in text) for text in record["match"]]
    # the verifier's pass: least squares over its batches, pass time against tokens in the
    # pass and the other sessions' round rate in that run (the machine's other work)
    def others(run):
        # streaming, every session completes a round each ITL x tokens per round
        n = run["sessions"]
        per_round = statistics.fmean(x["emitted"] for x in run["rounds"])
        return (n - 1) / (run["itl_ms"] / 1000 * per_round)
    batches = [(b, others(r)) for r in base for b in r["batches"]]
    v0, v1, vr = least_squares([(1.0, b["tokens"], rate) for b, rate in batches],
                               [b["pass_ms"] / 1000 for b, _ in batches])
    # drafting: a round's drafting time against its M (rounds that drafted all of their
    # proposal), a fixed part and one per token, alone and at the most sessions, against the
    # other sessions' round rate: on the shared cores the step waits for the rest of the
    # deployment's work far more than it grows with its batch (drafter CPU stays a fraction
    # of a core), so that term carries the difference
    def per_proposal(rs):
        drafted = [x for x in rs if x["m"] and not x["ahead"]]
        if len({x["m"] for x in drafted}) < 2:
            return 0.0, sum(x["draft_ms"] for x in drafted) / 1000 / sum(x["m"] for x in drafted)
        fixed, each = least_squares([(1.0, x["m"]) for x in drafted], [x["draft_ms"] / 1000 for x in drafted])
        return fixed, each
    (f1, t1), (fn, tn) = per_proposal(one["rounds"]), per_proposal(many["rounds"])
    d0, d1 = t1, 0.0
    dr = max(0.0, (tn - t1) / max(others(many), 1e-9))
    prep, prep_r = f1, max(0.0, (fn - f1) / max(others(many), 1e-9))
    # the verifier's handling of a proposal: a round's turnaround less the wire and its time in
    # the verifier, at one session (nothing else running) and at the most, where the other
    # sessions' work competes for the cores
    def handling(run):
        return max(0.0, statistics.fmean(x["turnaround_ms"] / 1000 - rtt_of[low] - x["verifier_ms"] / 1000
                                          for x in run["rounds"] if x["verifier_ms"] is not None))
    handle = handling(one)
    residuals = [x["turnaround_ms"] / 1000 - rtt_of[low] - x["verifier_ms"] / 1000
                 for x in many["rounds"] if x["verifier_ms"] is not None]
    spread = tuple(max(0.0, r) / handling(many) for r in residuals)
    hr = max(0.0, (handling(many) - handle) / max(others(many), 1e-9))
    # a session's first round: how much longer its turnaround is than its later rounds' (the
    # first proposals meet the verifier still opening the other sessions); the drafter's
    # verify cost keeps it as the point of the first M until that M is proposed again
    def first_extra(run):
        by_session: dict[int, list[float]] = {}
        for x in run["rounds"]:
            by_session.setdefault(x["session"], []).append(x["turnaround_ms"] / 1000)
        later = [t for ts in by_session.values() for t in ts[1:]]
        return max(0.0, statistics.fmean(ts[0] for ts in by_session.values()) - statistics.fmean(later))
    first = (first_extra(one), first_extra(many), many["sessions"])
    p = Params(match, m_values, d0, d1, dr, v0, v1, vr, handle, hr, start=0.0, open_cost=0.0, first=first, spread=spread,
               prep=prep, prep_r=prep_r,
               rtt=rtt_of[low], ahead=False,
               rtt_of=rtt_of)
    # opening: open_cost (shared by the sessions opening) and start, so that the first token comes
    # when it came at 1 session and at the most sessions
    max_new = record["max_new"]
    t_one, t_many = one["ttft_ms"] / 1000, many["ttft_ms"] / 1000
    for _ in range(6):
        s1 = simulate(p, 1, max_new).ttft_ms / 1000
        sn = simulate(p, many["sessions"], max_new).ttft_ms / 1000
        start = max(0.0, p.start + t_one - s1)
        spread_sim, spread = sn - s1, t_many - t_one
        open_cost = max(0.0, p.open_cost + (spread - spread_sim) / max(1.0, many["sessions"] - 1))
        p = replace(p, start=start, open_cost=open_cost)
    return p, {"batches": len(batches), "ttft_ms": (one["ttft_ms"], many["ttft_ms"]),
               "load": (others(many), statistics.fmean(b["jobs"] for b in many["batches"])),
               "consistent": consistent(match, runs)}


# ---------------------------------------------------------------------- questions


def calibrate_each(record: dict) -> dict[float, Params]:
    """Costs measured at each RTT: calibrated from that RTT's runs alone (on the measured
    machine the roles' costs change with the RTT: see validate_both)."""
    return {rtt: calibrate(dict(record, runs=[r for r in record["runs"] if r["rtt_ms"] == rtt]))[0]
            for rtt in sorted({r["rtt_ms"] for r in record["runs"]})}


def validate(p: Params | dict[float, Params], record: dict) -> list[dict]:
    """Every measured run simulated with `p` (or, a dict, the Params of its RTT)."""
    out = []
    for r in record["runs"]:
        costs = p[r["rtt_ms"]] if isinstance(p, dict) else p
        q = replace(costs.at(r["rtt_ms"]), ahead=r["ahead"])
        sim = simulate(q, r["sessions"], record["max_new"], seeds=VALIDATION_SEEDS)
        out.append({"rtt_ms": r["rtt_ms"], "ahead": r["ahead"], "sessions": r["sessions"],
                    "tps": (r["tokens_per_s"], sim.tokens_per_s), "itl": (r["itl_ms"], sim.itl_ms),
                    "m": (statistics.fmean(x["m"] for x in r["rounds"]), sim.mean_m),
                    "tps_err": 100 * (sim.tokens_per_s / r["tokens_per_s"] - 1),
                    "itl_err": 100 * (sim.itl_ms / r["itl_ms"] - 1)})
    return out


def capacity(p: Params, itl_target_ms: float, max_new: int, limit: int = 512) -> int:
    """The most sessions whose median inter-token latency stays within the target, in steady
    state: generations of STEADY x max_new tokens, so that the staggered starts weigh little."""
    max_new *= STEADY
    lo, hi = 0, 1
    while hi <= limit and simulate(p, hi, max_new).itl_ms <= itl_target_ms:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if simulate(p, mid, max_new).itl_ms <= itl_target_ms:
            lo = mid
        else:
            hi = mid
    return lo


def load(path: str) -> dict:
    return rows(json.loads(Path(path).read_text()))


def rows(record: dict) -> dict:
    """A bench_hosts record with its rounds and batches (stored as rows) as dicts, and so the
    records of its independent repeats (`repeats`: whole bench_hosts runs kept with it)."""
    for run in record["runs"]:
        run["rounds"] = [dict(zip(record["round_fields"], row, strict=True)) for row in run["rounds"]]
        run["batches"] = [dict(zip(record["batch_fields"], row, strict=True)) for row in run["batches"]]
    for other in record.get("repeats", []):
        rows(other)
    return record


def calibrated(path: str, record: dict) -> tuple[Params, dict]:
    """Calibrate from a record, printing the calibration."""
    p, fit = calibrate(record)
    overall = acceptance([x for r in record["runs"] for x in r["rounds"]])
    ok, total = fit["consistent"]
    matched = [sum(seq) / len(seq) for seq in p.match]
    print(f"calibrated from {path} ({record['machine']}): measured M mean {p.mean_m:.2f} "
          f"(values {dict(sorted(Counter(p.m_values).items()))}), acceptance by position "
          f"{' '.join(f'{a:.2f}' for a in overall)}; the draft's greedy token is the target's at "
          f"{100 * min(matched):.0f}-{100 * max(matched):.0f}% of positions (per prompt), and {ok}/{total} "
          "sessions measured accepted in every round exactly the run of matches at its position")
    print(f"  verifier pass {1e3 * p.v0:.3f} + {1e3 * p.v1:.3f} x tokens + {1e3 * p.vr:.4f} x R ms (least squares "
          f"over {fit['batches']} batches; R: the other sessions' rounds per second); drafting step {1e3 * p.d0:.3f} "
          f"+ {1e3 * p.dr:.4f} x R ms and a proposal's own {1e3 * p.prep:.3f} + {1e3 * p.prep_r:.4f} x R ms; handling a proposal {1e3 * p.handle:.3f} + {1e3 * p.hr:.4f} x R ms (turnaround "
          "less round trip and time in the verifier); "
          f"session open {1e3 * p.open_cost:.1f} ms of the machine's work each, then {1e3 * p.start:.0f} ms to its "
          f"first round (time to first token {fit['ttft_ms'][0]:.0f} and {fit['ttft_ms'][1]:.0f} ms measured); "
          "round trips " + ", ".join(f"{k:g} ms -> {1e3 * v:.2f} ms" for k, v in sorted(p.rtt_of.items())))
    return p, fit


def report_validation(path: str, p: Params, record: dict) -> None:
    """Two validations: with the costs measured at each RTT (the model's mechanisms, M,
    acceptance, batching and drafting ahead, predicted; the roles' costs, which on the
    measured machine grow with the RTT, taken where they were measured), and with the
    costs of the lowest RTT only (the other RTTs predicted)."""
    each = validate(calibrate_each(record), record)
    lowest = validate(p, record)
    print(f"\nvalidation against the namespace runs of {path} (measured -> simulated; costs at each RTT, "
          "and in the last columns the costs of the lowest RTT only):")
    print("| RTT ms | ahead | sessions | tokens/s | error | ITL ms | error | mean M | tokens/s, ITL error "
          "(lowest RTT's costs) | CPU outside |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, low, r in zip(each, lowest, record["runs"], strict=True):
        outside = r.get("outside_cpu_per_s")
        print(f"| {c['rtt_ms']:g} | {'yes' if c['ahead'] else 'no'} | {c['sessions']} | {c['tps'][0]:.0f} -> "
              f"{c['tps'][1]:.0f} | {c['tps_err']:+.1f}% | {c['itl'][0]:.1f} -> {c['itl'][1]:.1f} | "
              f"{c['itl_err']:+.1f}% | {c['m'][0]:.2f} -> {c['m'][1]:.2f} | {low['tps_err']:+.1f}%, "
              f"{low['itl_err']:+.1f}% | {'' if outside is None else f'{outside:.2f} cores'} |")
    for name, checks in (("costs at each RTT", each), ("costs of the lowest RTT", lowest)):
        worst_tps = max(abs(c["tps_err"]) for c in checks)
        worst_itl = max(abs(c["itl_err"]) for c in checks)
        within = sum(1 for c in checks if abs(c["tps_err"]) <= 15 and abs(c["itl_err"]) <= 15)
        print(f"validation ({path}, {name}): {within}/{len(checks)} runs within 15% on both; worst tokens/s "
              f"error {worst_tps:.1f}%, worst ITL error {worst_itl:.1f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(Path(__file__).with_name("hosts_runs.json")))
    parser.add_argument("--also", action="append", default=[], metavar="RUNS",
                        help="validate against another bench_hosts record too (calibrated from itself)")
    parser.add_argument("--validate-only", action="store_true", help="stop after the validations")
    parser.add_argument("--itl-target-ms", type=float, default=25.0)
    parser.add_argument("--plot", default=None, help="write capacity against RTT and fleet size (PNG)")
    args = parser.parse_args()
    record = load(args.runs)
    others = [(path, load(path)) for path in args.also]
    others += [(f"{args.runs}, repeat {n + 1} ({other.get('when', '')})", other)
               for n, other in enumerate(record.get("repeats", []))]
    for name, other in others:
        report_validation(name, calibrated(name, other)[0], other)
        print()
    max_new = record["max_new"]
    p, fit = calibrated(args.runs, record)
    report_validation(args.runs, p, record)
    if args.validate_only:
        return 0

    # one verifier: split vs co-located at the lowest RTT, drafters plenty
    low = min(r["rtt_ms"] for r in record["runs"]) / 1000
    target = args.itl_target_ms
    split = capacity(replace(p, rtt=low, drafters=8), target, max_new)
    colocated = capacity(replace(p, rtt=0.0, handle=0.0, hr=0.0, colocated=True, drafters=1), target, max_new)
    gamma = p.mean_m
    t_d = p.d0 + p.prep / gamma                     # one session alone: a token drafted (its share of
    t_v = p.v0 + p.v1 * (gamma + 1)                 # the proposal's own work), a pass
    bound = 1 + gamma * t_d / t_v
    rate, jobs = fit["load"]                        # the most sessions measured: R and jobs per pass
    t_d_n = p.d0 + p.dr * rate + (p.prep + p.prep_r * rate) / gamma
    t_v_n = (p.v0 + p.vr * rate) / jobs + p.v1 * (gamma + 1)   # a session's share of a pass
    loaded = 1 + gamma * t_d_n / t_v_n
    print(f"\none verifier at ITL <= {target:g} ms: {split} sessions split (8 drafters, RTT {1e3 * low:g} ms) vs "
          f"{colocated} co-located: {split / max(colocated, 1):.2f}x; bound 1 + gamma * t_d / t_v = 1 + "
          f"{gamma:.2f} x {1e3 * t_d:.3f} / {1e3 * t_v:.3f} = {bound:.2f} (one session alone), "
          f"1 + {gamma:.2f} x {1e3 * t_d_n:.3f} / {1e3 * t_v_n:.3f} = {loaded:.2f} (a session's share of a pass "
          f"at the most sessions measured, {jobs:.1f} proposals a pass)")
    needed = None
    for d in range(1, 9):
        if capacity(replace(p, rtt=low, drafters=d), target, max_new) >= 0.95 * split:
            needed = d
            break
    print(f"drafters per verifier for 95% of that capacity: {needed}")

    print("\ncapacity against RTT (sessions at the ITL target, split, 8 drafters; the lowest RTT's costs, "
          "and the costs measured at each RTT):")
    rtts = [0.1, 2, 10, 30, 50, 100, 200]
    by_rtt = {}
    for ahead in (True, False):
        by_rtt[ahead] = [capacity(replace(p, rtt=r / 1000, drafters=8, ahead=ahead), target, max_new) for r in rtts]
    # the same with the costs measured at each RTT (the validated view: on the measured machine
    # the roles' costs grow with the RTT), at the RTTs measured
    each = calibrate_each(record)
    measured = [r for r in rtts if r in each]
    at_each = {ahead: [capacity(replace(each[r].at(r), drafters=8, ahead=ahead), target, max_new) for r in measured]
               for ahead in (True, False)}
    print("| RTT ms | " + " | ".join(f"{r:g}" for r in rtts) + " |")
    print("|---|" + "---:|" * len(rtts))
    for ahead in (True, False):
        print(f"| {'ahead' if ahead else 'not ahead'} | " + " | ".join(map(str, by_rtt[ahead])) + " |")
    for ahead in (True, False):
        print(f"| {'ahead' if ahead else 'not ahead'}, costs at each RTT | "
              + " | ".join(str(at_each[ahead][measured.index(r)]) if r in measured else "" for r in rtts) + " |")

    fleet(record, p, split, max_new, target, args.plot, rtts, by_rtt, colocated, (measured, at_each))
    return 0


def fleet(record: dict, p: Params, per_verifier: int, max_new: int, target: float, plot: str | None,
          rtts: list[float], by_rtt: dict, colocated: int, at_each: tuple[list[float], dict]) -> None:
    """Fleets of 1..10,000 verifiers at their capacity: commit-log appends (one per session
    round) and relayed tokens, against one etcd cluster's measured appends/s and one router
    core's measured CPU per token."""
    sim = simulate(replace(p, rtt=min(r["rtt_ms"] for r in record["runs"]) / 1000, drafters=8),
                   max(1, per_verifier), max_new * STEADY)
    tokens_per_verifier = sim.tokens_per_s
    rounds_per_token = 1 / statistics.fmean(x["emitted"] for r in record["runs"] for x in r["rounds"])
    appends_per_verifier = tokens_per_verifier * rounds_per_token
    big = [r for r in record["runs"] if r["sessions"] > 1]
    router_cpu = sum(r["cpu_s"].get("router", 0) for r in big) / sum(r["tokens"] for r in big)
    etcd_cpu = sum(sum(v for k, v in r["cpu_s"].items() if k.startswith("etcd")) for r in big) / sum(
        r["tokens"] * rounds_per_token for r in big)
    etcd_capacity = record.get("etcd_appends_per_s") or 1.0
    router_capacity = 1 / router_cpu if router_cpu else math.inf
    print(f"\nfleet: one verifier at capacity makes {tokens_per_verifier:.0f} tokens/s and "
          f"{appends_per_verifier:.0f} commit appends/s; measured: etcd cluster {etcd_capacity:.0f} appends/s "
          f"(its members' CPU {1e3 * etcd_cpu:.2f} ms per append), router {1e3 * router_cpu:.3f} ms CPU per token "
          f"({router_capacity:.0f} tokens/s per core)")
    print("| verifiers | sessions | tokens/s | appends/s | etcd clusters needed | router cores needed |")
    print("|---:|---:|---:|---:|---:|---:|")
    sizes = [1, 10, 100, 1000, 10000]
    for n in sizes:
        print(f"| {n} | {n * per_verifier} | {n * tokens_per_verifier:.0f} | {n * appends_per_verifier:.0f} | "
              f"{math.ceil(n * appends_per_verifier / etcd_capacity)} | "
              f"{math.ceil(n * tokens_per_verifier / router_capacity)} |")
    one_etcd = etcd_capacity / appends_per_verifier
    one_router = router_capacity / tokens_per_verifier
    print(f"one etcd cluster saturates at {one_etcd:.1f} verifiers, one router core at {one_router:.1f} verifiers")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for ahead in (True, False):
            a.plot(rtts, by_rtt[ahead], marker="o", label="drafting ahead" if ahead else "not ahead")
        for ahead, marker in ((True, "^"), (False, "v")):
            a.plot(at_each[0], at_each[1][ahead], marker=marker, linestyle="none",
                   label=f"{'ahead' if ahead else 'not ahead'}, costs measured at each RTT")
        a.axhline(colocated, linestyle="--", color="grey", label="co-located (no RTT)")
        a.set_ylim(0, max(max(by_rtt[True]), max(by_rtt[False]), *at_each[1][True], *at_each[1][False], colocated) + 4)
        a.set_xlabel("RTT drafter-verifier (ms)")
        a.set_ylabel(f"sessions per verifier at ITL <= {target:g} ms")
        a.set_title("one verifier (model)")
        a.legend()
        tokens = [n * tokens_per_verifier for n in sizes]
        one = [min(t, etcd_capacity / rounds_per_token, router_capacity) for t in tokens]
        b.loglog(sizes, tokens, marker="o", label="etcd clusters and routers scaled")
        b.loglog(sizes, one, marker="s", label="one etcd cluster, one router core")
        b.set_xlabel("verifiers")
        b.set_ylabel("fleet tokens/s")
        b.set_title("fleet capacity (model)")
        b.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"plot: {plot}")



if __name__ == "__main__":
    sys.exit(main())
