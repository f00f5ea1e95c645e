"""When the verifier lets a session speculate, and how far: its side of section 6.2's rule.

Speculation pays only while a round (the drafters' turnaround plus one pass over M + 1
tokens a session) commits more per second than the verifier decoding the session itself
(one pass over one token a session, no drafter). Which one wins depends on the hardware and
the load: on a GPU a pass over 6 tokens costs about what a pass over 1 does, so speculation
wins at any load; on a CPU the pass cost grows with every token, so at a high enough load
the same tokens cost more verified than decoded. So nothing here is a constant tuned to a
machine: the policy measures

- the pass cost t(n) over n new tokens in a pass, from every pass the engine runs (the
  whole pass: forward, verify, commit, answers), read from the passes measured near n
  (`PassCurve`);
- the drafters' turnaround g(x), from a verdict's answer to the session's next proposal,
  against x = the draft tokens all active sessions ask for in a round;
- each session's acceptance (`control.AcceptanceEstimate`, as the drafter keeps it); a
  session with no drafted round of its own yet (one just opened, or self-decoding since its
  open) is planned with the acceptance of all sessions' rounds lately (`pooled`), not a
  fixed prior, which kept sessions opened under load self-decoding where their drafters,
  accepted far more often than the prior said, would have paid; its own estimate starts
  from that one at its first round, for the same reason;

and `control.plan_speculation` turns them into a plan per drafted round: an M (the next
m_cap) or self-decoding. That plan models a round as the drafters' turnaround plus one pass;
under load the sessions' rounds interleave and a round spans more than that. So the plan is
also checked against what rounds really commit: the tokens a session commits per second
from one answer to the next, drafted and self-decoded (`MeasuredRate`, all sessions,
kept per band of the load they were measured at). Where drafted rounds measured at about this
load commit less than self-decoding would (measured, else one token per modelled pass),
the session self-decodes whatever the model says (bench/RESULTS.md, issue 38, has the
loads where the model alone got it wrong). Both read costs in the conditions of the way
being run (a pass timed while drafters share its cores costs more than with them idle,
and a way never run at a load is never measured there), so above them the verifier runs
blocks of both ways at each band of load, the plan's and every session self-decoding, and
keeps the one that commits more (`WayAtLoad`). A self-decoding session goes back to a drafter
once a plan with its acceptance says speculating pays again (after at least
`min_self_tokens`: each move back costs the drafter a catch-up prefill), and only with more
tokens left than repay that move (`control.move_repaid_by`, the move's cost measured: the
last tokens of a generation are never worth a catch-up). Self-decoding stays subject to the contract
(self_load, the ladder's own use of it); where the contract does not permit it the plan's
M still applies.

Modes (`[verifier] speculation`): "auto" (the above), "on" (no plan: the drafters' own
M-choice under section 6.5's load rule, as before) and "off" (every session self-decoded
from its first token: the target alone behind the same door, for comparisons).

A session starts self-decoding at its open when the plan says so then (`self_decode_from_open`):
its first token comes from the prefill's row, with no drafter's prefill and first round to
wait for, which under a burst of opens is most of the time to first token. The prefill
passes are cost points like any pass (a pass over the prompts' tokens).

A session the plan lets speculate gets its first token the same way where `first_token` is
on (`first_token_from_prefill`): the prefill has already scored that token's row, so one
self-decoded round commits it at no pass's cost, and the session goes to a drafter right
after it (`resume_drafting`, whatever `min_self_tokens` says) unless the plan, made again
with the sessions in play by then, says drafting loses: under a burst the open's plan saw
only the opens before it. Without it the first token
waits for the drafter's prefill of the prompt, its first draft and that draft's verify pass,
each after the one before, where the target alone needs its prefill only. The drafter then
starts one token later, from the assignment's committed tokens, as after any self-decoding
period.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

from ..core.choice import TwoWayChooser
from ..core.control import (
    SELF_DECODE,
    AcceptanceEstimate,
    VerifyCost,
    move_repaid_by,
    plan_speculation,
    size_band,
)

log = logging.getLogger("sdcp_fast.verifier.speculation")
MODES = ("auto", "on", "off")
LOG_EVERY_S = 10.0        # the plan's inputs and decisions, logged at most this often
POINT_WEIGHT_CAP = 16     # a cost point's weight in its line: recent conditions count as much as old
MIN_SELF_TOKENS = 8       # self-decoded tokens before a session may go back to a drafter
MOVE_WEIGHT = 0.2         # a move's weight in the measured cost of a move back to a drafter
POOLED_WEIGHT = 0.05      # a round's weight in the acceptance of all sessions
RATE_WEIGHT = 0.1         # a round's weight in a measured rate (after a running mean)
MIN_RATE_ROUNDS = 8       # rounds before a measured rate counts
STALE_ROUNDS = 4 * MIN_RATE_ROUNDS   # rounds of the other way, a session in play, that leave a rate stale
EXACT_TOKENS = 16         # passes of up to this many tokens are bands of t(n) of their own
LOAD_FACTOR = 1.5         # the width of a measured rate's band of load (a factor)
SELF, PLAN = 0, 1         # the ways at a load: every session self-decoding / as the plan says
WAY_BLOCK_TOKENS = 8      # committed tokens a session in play: one block of one way
WAY_SETTLE_TOKENS = 4     # ... and, after a change of way or of load, before a block's clock starts
WAY_WARMUP, WAY_SAMPLES, WAY_RECHECK = 3, 7, 20   # core.choice.TwoWayChooser's, per band of load
WAY_MIN_SESSIONS = 2      # fewer in play: the plan and its per-session rates decide alone


@dataclass
class RateAtLoad:
    rate: float = 0.0
    rounds: int = 0
    since: int = 0        # rounds of the other way in this band since this rate's last round


class MeasuredRate:
    """Tokens a session commits per second, answer to answer, for one way of decoding: an
    EWMA over all sessions' rounds for each band of load (the sessions in play, in bands
    LOAD_FACTOR wide), so that a rate measured at one load is there again when that load
    comes back (a single EWMA follows whichever load came last, and a verifier whose load
    moves between levels would find neither rate measured at the load it is at). At most one
    band per factor of LOAD_FACTOR up to the largest load seen.

    A rate goes stale once the other way has run STALE_ROUNDS rounds a session in play in its
    band without a round of its own: the way not taken is otherwise never measured again, so
    a rate taken in passing conditions (the first rounds of a deployment, whose passes are
    still being tuned; a burst of other work) would keep the sessions from it for good. A
    stale rate does not count (the plan's model decides alone), and its next round starts it
    afresh."""

    def __init__(self) -> None:
        self.bands: dict[int, RateAtLoad] = {}

    @staticmethod
    def band(active: float) -> int:
        return round(math.log(max(1.0, active)) / math.log(LOAD_FACTOR))

    @staticmethod
    def _stale(measured: RateAtLoad, active: int) -> bool:
        return measured.since >= STALE_ROUNDS * max(1, active)

    def observe(self, tokens: int, seconds: float, active: int) -> None:
        measured = self.bands.setdefault(self.band(active), RateAtLoad())
        if self._stale(measured, active):
            measured.rounds = 0
        measured.since = 0
        measured.rounds += 1
        weight = max(RATE_WEIGHT, 1 / measured.rounds)
        measured.rate += weight * (tokens / seconds - measured.rate)

    def passed_over(self, active: int) -> None:
        """A round of the other way at this load."""
        measured = self.bands.get(self.band(active))
        if measured is not None:
            measured.since += 1

    def at(self, active: int) -> float | None:
        """The rate if measured on enough rounds at a load in `active`'s band and not stale,
        else None."""
        measured = self.bands.get(self.band(active))
        if measured is None or measured.rounds < MIN_RATE_ROUNDS or self._stale(measured, active):
            return None
        return measured.rate


class WayAtLoad:
    """Whether speculating, as the plan has it, commits more than every session decoding by
    itself, measured for each band of load (`MeasuredRate.band`) by running both.

    The plan's model and the per-session rates each read costs in the conditions of the way
    being run: a pass timed while drafters share its cores costs more than the same pass
    with the drafters idle, and a way that is never run at a load is never measured there.
    So the verifier runs blocks of each way in turn (`core.choice.TwoWayChooser` per band):
    a block is `WAY_BLOCK_TOKENS` committed tokens a session in play, timed from the end of
    a pass to the end of the pass that completes it, as seconds a committed token of the
    whole verifier (every cost counts: drafting, catch-up prefills, the slower passes),
    after `WAY_SETTLE_TOKENS` a session that let the sessions move to the new way. A change
    of band starts afresh (settle, then a block); blocks of one band keep their samples
    while other loads come and go.

    With one session in play nothing is run but the plan's way: a self-decoding pass then
    shares its cores with no drafting, so the pass cost and the two per-session rates are
    measured in their own conditions already, and a block of the other way would cost
    that session a drafter's catch-up prefill at each change for nothing the rates lack."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.choices: dict[int, TwoWayChooser] = {}
        self.band: int | None = None
        self.way = PLAN
        self._settle = 0.0          # tokens to commit before the block's clock starts
        self._started: float | None = None
        self._tokens = 0

    def observe(self, tokens: int, active: int) -> None:
        """A pass committed `tokens` with `active` sessions in play."""
        now = self.clock()
        band = MeasuredRate.band(active)
        if active < WAY_MIN_SESSIONS:
            self.band, self.way, self._started = band, PLAN, None
            return
        choice = self.choices.get(band)
        if choice is None:
            choice = self.choices[band] = TwoWayChooser(PLAN, warmup=WAY_WARMUP, samples=WAY_SAMPLES,
                                                        recheck=WAY_RECHECK)
        if band != self.band or choice.way != self.way:
            self._begin(band, choice.way, active)
        if self._started is None:
            self._settle -= tokens
            if self._settle <= 0:
                self._started, self._tokens = now, 0
            return
        self._tokens += tokens
        if self._tokens >= WAY_BLOCK_TOKENS * max(1, active):
            choice.observe(self.way, (now - self._started) / self._tokens)
            if choice.way != self.way:
                self._begin(band, choice.way, active)
            else:
                self._started, self._tokens = now, 0

    def _begin(self, band: int, way: int, active: int) -> None:
        self.band, self.way = band, way
        self._settle, self._started = WAY_SETTLE_TOKENS * max(1, active), None

    def chosen(self) -> dict[int, str]:
        """{band of load: way} for the bands that have chosen (logs, tests)."""
        return {band: ("plan", "self")[c.chosen == SELF] for band, c in self.choices.items()
                if c.chosen is not None}


@dataclass
class SessionSpeculation:
    """What the policy keeps per session."""

    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    rounds: int = 0                 # drafted rounds of its own observed (0: plan with `pooled`)
    self_decoding: bool = False     # the plan moved it to self-decoding (its drafted rounds stopped)
    first_token_only: bool = False  # self-decoding its first token only, a drafter right after
    last_self_decoded: bool = True  # its last job was self-decoded (or none yet): no turnaround to take
    moved_at: float | None = None   # perf_counter of its move back to a drafter, until its first drafted job


class PassCurve:
    """The pass cost t(n) over n new tokens, read from what was measured near n: an EWMA of
    the seconds of the passes in each band of n (exact up to EXACT_TOKENS, above it bands
    an eighth wide), each band at the mean n of its passes, and t(n) by linear
    interpolation between the two bands around n; beyond the measured ends, along the
    nearest two bands' line (never falling; below the smallest band no steeper than the
    prior), and with one band, `prior_slope` of its time a token (of the time of a pass
    over n = 0 tokens, as control.VerifyCost's prior).

    Why not one line through every point: a pass's cost is not linear in n. On a CPU a few
    tokens cost about what one does (the weights are read once either way, and the BLAS's
    form is chosen per n: models/linear_forms.py) while hundreds cost in proportion. A line
    through both regions misreads each, and which way depends on the passes other loads
    left behind: the plan's cost of self-decoding 64 sessions came from passes of 1, 8 and
    2,700 tokens as much as from passes of 64."""

    def __init__(self, initial: float = 0.010, prior_slope: float = 0.15) -> None:
        self.initial, self.prior_slope = initial, prior_slope
        self.bands: dict[int, list[float]] = {}   # band -> [mean n, EWMA seconds, passes]
        self._points: list[tuple[float, float]] = []   # (n, seconds) by n

    @staticmethod
    def band(n: int) -> int:
        return size_band(n, EXACT_TOKENS)

    def observe(self, n: int, seconds: float) -> None:
        entry = self.bands.setdefault(self.band(n), [float(n), seconds, 0.0])
        entry[2] = min(POINT_WEIGHT_CAP, entry[2] + 1)
        weight = 1 / entry[2]
        entry[0] += weight * (n - entry[0])
        entry[1] += weight * (seconds - entry[1])
        self._points = sorted((x, t) for x, t, _ in self.bands.values())

    @property
    def seen(self) -> bool:
        return bool(self._points)

    def at(self, n: int) -> float:
        points = self._points
        if not points:
            return self.initial
        x0, t0 = points[0]
        prior = self.prior_slope * t0 / (1 + self.prior_slope * x0)   # the prior's slope at the smallest
        if len(points) == 1:
            return max(1e-6, t0 + prior * (n - x0))
        i = bisect.bisect_left(points, (n, -math.inf))
        i = min(max(i, 1), len(points) - 1)          # the segment around n, or the end one
        (x0, t0), (x1, t1) = points[i - 1], points[i]
        slope = (t1 - t0) / (x1 - x0) if x1 > x0 else 0.0
        if n > x1:
            slope = max(0.0, slope)                  # beyond the largest: never falling
        elif n < x0:                                 # below the smallest: never falling, and no
            slope = min(max(0.0, slope), prior)      # steeper than the prior (two close, noisy
        return max(1e-6, t0 + slope * (n - x0))      # points would put a small pass near zero)


class MeasuredCosts:
    """The pass cost t(n) (`PassCurve`) and the drafters' turnaround g(x) as a line through
    what was measured (control.VerifyCost), refreshed per observation: a plan reads them
    per verdict."""

    def __init__(self) -> None:
        # prior slopes: with one point seen, a pass's cost grows by 15% of itself a token
        # (a CPU's; a GPU's measured curve soon replaces it), the turnaround is all drafting
        self.passes = PassCurve(initial=0.010, prior_slope=0.15)
        self.turnarounds = VerifyCost(initial=0.010, prior_slope=1.0, max_rounds=POINT_WEIGHT_CAP)
        self._turnaround = self.turnarounds.line()

    def observe_pass(self, tokens: int, seconds: float) -> None:
        self.passes.observe(max(1, tokens), seconds)

    def observe_turnaround(self, draft_tokens: int, seconds: float) -> None:
        self.turnarounds.observe(max(1, draft_tokens), seconds)
        self._turnaround = self.turnarounds.line()

    @property
    def turnaround_measured(self) -> bool:
        return bool(self.turnarounds.seen)

    def pass_cost(self, tokens: int) -> float:
        return self.passes.at(tokens)

    def turnaround(self, draft_tokens: int) -> float:
        base, slope = self._turnaround
        return max(0.0, base + slope * draft_tokens)


class SpeculationPolicy:
    """`costs`: where t(n) and g(x) come from (default `MeasuredCosts`; tests give a model)."""

    def __init__(self, mode: str = "auto", *, costs=None, margin: float = 0.1,
                 min_self_tokens: int = MIN_SELF_TOKENS, first_token: bool = False):
        if mode not in MODES:
            raise ValueError(f"speculation: one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.first_token = first_token   # auto: a speculating session's first token from its prefill
        self.costs = costs if costs is not None else MeasuredCosts()
        self.margin = margin
        self.min_self_tokens = min_self_tokens
        self.active = 1                 # sessions open at the last pass
        self.plans: dict[str, int] = {"self": 0, "speculate": 0, "resume": 0, "open-self": 0,
                                      "first-token": 0}   # decisions taken
        self.pooled = AcceptanceEstimate(weight=POOLED_WEIGHT)   # every session's rounds
        self.pooled_rounds = 0
        self.drafted_rate, self.self_rate = MeasuredRate(), MeasuredRate()
        self.ways = WayAtLoad()
        self.move_s: float | None = None   # measured: a move back to a drafter -> its first drafted job
        self.moves_timed = 0
        self._logged = time.monotonic()

    # ------------------------------------------------------------------ measurements

    def observe_pass(self, tokens: int, seconds: float, active: int) -> None:
        """A pass over `tokens` new tokens took `seconds`; `active` sessions are in play."""
        self.active = max(1, active)
        if self.mode == "auto":
            self.costs.observe_pass(tokens, seconds)
            now = time.monotonic()
            if now - self._logged >= LOG_EVERY_S:
                self._logged = now
                t, g, s = self.costs.pass_cost, self.costs.turnaround, self.active
                log.info("speculation plan: %d sessions; a pass over 1 token a session %.0f ms, over 5 "
                         "%.0f ms; drafters' turnaround for 4 a session %.0f ms; plans so far %s; "
                         "way now %s, chosen by band of load %s", s, 1e3 * t(s), 1e3 * t(5 * s),
                         1e3 * g(4 * s), self.plans, ("self", "plan")[self.ways.way], self.ways.chosen())

    def observe_committed(self, tokens: int, active: int) -> None:
        """A pass committed `tokens` (every session's), `active` sessions in play."""
        if self.mode == "auto":
            self.ways.observe(tokens, active)

    @property
    def all_self_decode(self) -> bool:
        """In auto, the measured way at this load is every session decoding by itself."""
        return self.mode == "auto" and self.ways.way == SELF

    def observe_turnaround(self, m: int, seconds: float) -> None:
        """A session's drafter came back with M tokens `seconds` after the last verdict:
        one point of g at x = M x the active sessions (the drafters draft for all of them)."""
        if self.mode == "auto":
            self.costs.observe_turnaround(m * self.active, seconds)

    def observe_drafted_job(self, state: SessionSpeculation, now: float) -> None:
        """A drafted job of the session arrived (perf_counter `now`): the first after its move
        back to a drafter times that move."""
        if state.moved_at is not None:
            self.moves_timed += 1
            weight = max(MOVE_WEIGHT, 1 / self.moves_timed)
            seconds = now - state.moved_at
            self.move_s = seconds if self.move_s is None else self.move_s + weight * (seconds - self.move_s)
            state.moved_at = None

    def observe_round(self, state: SessionSpeculation, accepted: int, m: int) -> None:
        if not state.rounds:      # its first round updates what it was planned with
            state.acceptance = dataclasses.replace(self.pooled, weight=state.acceptance.weight)
        state.acceptance = state.acceptance.update(accepted, m)
        state.rounds += 1
        # a running mean over the first rounds, then an EWMA: the 0.7 prior goes at once
        self.pooled_rounds += 1
        weight = max(POOLED_WEIGHT, 1 / self.pooled_rounds)
        self.pooled = dataclasses.replace(self.pooled, weight=weight).update(accepted, m)

    def observe_answer(self, self_decoded: bool, tokens: int, seconds: float) -> None:
        """A session committed `tokens` in a round `seconds` after its last answer."""
        if self.mode == "auto" and seconds > 0:
            way, other = ((self.self_rate, self.drafted_rate) if self_decoded
                          else (self.drafted_rate, self.self_rate))
            way.observe(tokens, seconds, self.active)
            other.passed_over(self.active)

    def drafting_measured_to_lose(self, active: int | None = None) -> bool:
        """Drafted rounds measured at about this load commit less than self-decoding would
        (measured likewise, else one token a session per modelled pass)."""
        active = active or self.active
        drafted = self.drafted_rate.at(active)
        if drafted is None:
            return False
        itself = self.self_rate.at(active)
        if itself is None:
            itself = 1 / self.costs.pass_cost(active)
        return itself > drafted * (1 + self.margin)

    def acceptance(self, state: SessionSpeculation) -> float:
        """The session's own estimate once it has rounds of its own, else all sessions'."""
        return state.acceptance.alpha if state.rounds else self.pooled.alpha

    # ------------------------------------------------------------------ decisions

    def _plan(self, state: SessionSpeculation, m_max: int, *, speculating: bool,
              active: int | None = None) -> int:
        return plan_speculation(self.acceptance(state), m_max, active or self.active, self.costs.pass_cost,
                                self.costs.turnaround, speculating=speculating, margin=self.margin)

    def plan(self, state: SessionSpeculation, m_max: int) -> int | None:
        """The plan for a drafted round's verdict: an M for m_cap, SELF_DECODE, or None
        (mode "on")."""
        if self.mode == "on":
            return None
        if self.mode == "off" or self.all_self_decode:
            if self.mode == "auto":
                self.plans["self"] += 1
            return SELF_DECODE
        m = self._plan(state, m_max, speculating=True)
        if m != SELF_DECODE and self.drafting_measured_to_lose():
            m = SELF_DECODE
        self.plans["self" if m == SELF_DECODE else "speculate"] += 1
        return m

    def self_decode_from_open(self, state: SessionSpeculation, m_max: int, active: int) -> bool:
        """Whether a session just opened should start self-decoding instead of waiting for
        a drafter's first proposal: always with speculation off, never with it on, and in
        auto when the plan says a drafter would not pay, with what is measured now (the
        prefill passes included), the acceptance of all sessions' rounds and `active` sessions in
        play (those opening with it included: a burst is planned for as the load it is).
        A verifier that has not timed a drafter's turnaround yet lets the session draft (the
        protocol's usual start) rather than weigh drafting by a guess. The caller marks the
        move (`started_self_decoding`)."""
        if self.mode != "auto":
            return self.mode == "off"
        if self.all_self_decode:
            return True
        if not self.costs.turnaround_measured:   # no drafter timed yet: nothing to weigh it by
            return False
        return self._drafting_loses(state, m_max, max(active, self.active))

    def first_token_from_prefill(self) -> bool:
        """Whether a session opened to speculate (`self_decode_from_open` said no) gets its
        first token from the prefill's row before its drafter's turn: in auto, with
        `first_token` on. The caller marks the move (`started_first_token`)."""
        return self.mode == "auto" and self.first_token

    def started_first_token(self, state: SessionSpeculation) -> None:
        state.self_decoding = state.first_token_only = True
        self.plans["first-token"] += 1

    @staticmethod
    def moved_to_self_decoding(state: SessionSpeculation) -> None:
        state.self_decoding = True

    def started_self_decoding(self, state: SessionSpeculation) -> None:
        """A session opened self-decoding (`self_decode_from_open` said so and the contract
        permitted it): counted with the plan's other moves."""
        state.self_decoding = True
        self.plans["open-self"] += 1

    def resume_drafting(self, state: SessionSpeculation, self_tokens: int, m_max: int,
                        active: int | None = None, *, remaining: float = math.inf) -> bool:
        """Whether a session the plan moved to self-decoding should go back to a drafter, with
        `remaining` tokens at most still to commit (its contract's max_new less its committed
        output).

        One that self-decodes its first token only is planned again once that token is
        committed, with `active` sessions in play then: the open's plan saw the load of the
        opens before it, and where a burst of opens has since made drafting lose, the session
        stays self-decoding (a self-decoding period like any other) instead of costing a
        drafter its catch-up prefill only to be moved back at its first verdict.

        Either goes back only with more tokens left than repay the move (`move_repaid_by`,
        with the moves measured so far: `observe_drafted_job`): a generation near its end
        finishes self-decoding, instead of waiting its last tokens out behind a drafter's
        catch-up prefill."""
        if state.first_token_only:
            if self_tokens < 1:
                return False
            state.first_token_only = False
            if self.all_self_decode or (self.costs.turnaround_measured
                                        and (self._drafting_loses(state, m_max, active)
                                             or not self._move_repaid(state, m_max, active, remaining))):
                self.plans["self"] += 1
                return False
            state.self_decoding = False
            state.moved_at = time.perf_counter()
            return True
        if self.mode != "auto" or not state.self_decoding or self_tokens < self.min_self_tokens:
            return False
        if self.all_self_decode or self._drafting_loses(state, m_max) \
                or not self._move_repaid(state, m_max, None, remaining):
            return False
        state.self_decoding = False
        state.moved_at = time.perf_counter()
        self.plans["resume"] += 1
        return True

    def move_cost(self, active: int | None = None) -> float:
        """Seconds from a move back to a drafter to the session's first drafted job: as
        measured, else the least it can be, the drafters' turnaround for one token a session
        (their catch-up prefill comes on top)."""
        if self.move_s is not None:
            return self.move_s
        return self.costs.turnaround(active or self.active)

    def _move_repaid(self, state: SessionSpeculation, m_max: int, active: int | None, remaining: float) -> bool:
        if remaining == math.inf:
            return True
        sessions = active or self.active
        return remaining >= move_repaid_by(self.acceptance(state), m_max, sessions, self.costs.pass_cost,
                                           self.costs.turnaround, self.move_cost(sessions))

    def _drafting_loses(self, state: SessionSpeculation, m_max: int, active: int | None = None) -> bool:
        """The plan (modelled costs) or the rates measured near this load say drafting loses."""
        return (self._plan(state, m_max, speculating=False, active=active) == SELF_DECODE
                or self.drafting_measured_to_lose(active))
