"""The verifier's Prometheus series (prometheus-client; the page is `metrics.StatusPage`).

The speculative-decoding set, named as vLLM's under `sdcp_` so the same charts work:

    sdcp_spec_decode_num_drafts_total              rounds with a proposal, committed
    sdcp_spec_decode_num_draft_tokens_total        draft tokens verified (sum of M)
    sdcp_spec_decode_num_accepted_tokens_total     draft tokens accepted (sum of a)
    sdcp_spec_decode_num_accepted_tokens_per_pos_total{position="0".."63"}
    sdcp_escalations_total{action}                 reduce | switch | self_decode | fail
    sdcp_verdicts_total{action}                    every committed proposal round, by action
    sdcp_self_decoded_tokens_total                 tokens the verifier decoded itself
    sdcp_proposals_total                           proposals received (retries included)
    sdcp_problems_total{type}                      refusals, by problem type (every type listed)
    sdcp_fenced_appends_total                      appends refused because a newer epoch fenced the log
    sdcp_sessions_retired_total{reason}            sessions let go while resumable: idle | room
    sdcp_refusals_total{kind}                      the transport's refusals (metrics.refusal_counter)
    sdcp_batch_size, sdcp_queue_wait_seconds, sdcp_forward_seconds, sdcp_kernel_seconds,
    sdcp_q_staging_seconds, sdcp_q_wait_seconds (what the kernel waited for q rows after the
    forward), sdcp_commit_log_append_seconds, sdcp_accepted_tokens (per round)   histograms
    sdcp_sessions, sdcp_load_percent, sdcp_queue_depth                       gauges

Acceptance rate = accepted_tokens / draft_tokens; mean accepted length per round
= 1 + accepted_tokens / drafts (README).

The engine's per-batch updates (batch size, queue waits, step times, committed rounds) and
the proposals count are held (`hold`, `hold_rounds`, `proposal`) and written to the series
once HOLD_UPDATES are held, or first thing whenever the registry is read (a scrape,
`get_sample_value`: `_WriteHeld` is registered ahead of every series), so every reader sees
every update. At one session the ~60 Prometheus calls of a batch's updates were a sizeable
share of a round's CPU; held, they are a few list appends per batch and one aggregated
update per series every few dozen batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry

from ..core.messages import Action
from ..core.problems import Kind
from ..metrics import PREFIX, STEP_BUCKETS, counter, gauge, histogram, new_registry, observe_many

MAX_POSITIONS = 64          # m_max <= 64 (draft section 4.1): every position is known up front
VERDICT_ACTIONS = ("continue", "reduce", "switch", "self_decode", "finish", "fail")
ESCALATIONS = ("reduce", "switch", "self_decode", "fail")
HOLD_UPDATES = 512          # held observations and rounds before they are written


class _WriteHeld:
    """A collector of no series, registered ahead of the verifier's: the registry collects
    in registration order, so whatever reads it has the held updates written first."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self._metrics.write_held()
        return []


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else new_registry()
        self._held: list[tuple[object, float, int]] = []   # (histogram, amount, times)
        self._held_rounds: list[tuple[int, int, Action | None]] = []
        self._held_proposals = 0
        r.register(_WriteHeld(self))   # before any series of ours
        self._children: dict[int, dict] = {}   # metric id -> label value -> child (see _child)
        self.proposals = counter(r, "proposals", "Proposals received (retries included)")
        self.drafts = counter(r, "spec_decode_num_drafts", "Rounds with a proposal, committed")
        self.draft_tokens = counter(r, "spec_decode_num_draft_tokens", "Draft tokens verified (sum of M)")
        self.accepted_tokens = counter(r, "spec_decode_num_accepted_tokens", "Draft tokens accepted (sum of a)")
        self.accepted_per_pos = counter(
            r, "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position (0-based)",
            labels={"position": [str(n) for n in range(MAX_POSITIONS)]})
        self.escalations = counter(r, "escalations", "Escalations applied, by action", labels={"action": ESCALATIONS})
        self.verdicts = counter(r, "verdicts", "Committed proposal rounds, by verdict action",
                                labels={"action": VERDICT_ACTIONS})
        self.self_decoded = counter(r, "self_decoded_tokens", "Tokens the verifier decoded itself")
        self.problems = counter(r, "problems", "Requests and rounds refused, by problem type",
                                labels={"type": [k.suffix for k in Kind]})
        self.fenced = counter(r, "fenced_appends", "Commit-log appends refused by a newer epoch")
        self.retired = counter(r, "sessions_retired", "Sessions let go while they could go on (resumable "
                               "from their logs), by reason", labels={"reason": ("idle", "room")})
        self.batch_size = histogram(r, "batch_size", "Jobs per forward pass", (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.accepted_per_round = histogram(r, "accepted_tokens", "Accepted draft tokens per round",
                                            (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        self.forward_seconds = histogram(r, "forward_seconds", "Target forward pass time per batch", STEP_BUCKETS)
        self.kernel_seconds = histogram(r, "kernel_seconds", "Verify kernel time per batch", STEP_BUCKETS)
        self.queue_wait = histogram(r, "queue_wait_seconds", "Time a job waited for its batch", STEP_BUCKETS)
        self.append_seconds = histogram(r, "commit_log_append_seconds", "Commit-log append time per round",
                                        STEP_BUCKETS)
        self.q_staging_seconds = histogram(r, "q_staging_seconds", "q rows read and copied to the device per batch",
                                           STEP_BUCKETS)
        self.q_wait_seconds = histogram(r, "q_wait_seconds",
                                        "Time the verify kernel waited for q rows after the forward pass", STEP_BUCKETS)

    def watch(self, *, sessions: Callable[[], float], load: Callable[[], float],
              queue: Callable[[], float]) -> None:
        """Gauges read from the service at scrape time."""
        gauge(self.registry, "sessions", "Sessions served (open, not yet finished, failed or fenced)", sessions)
        gauge(self.registry, "load_percent", "Verifier load as reported to the router", load)
        gauge(self.registry, "queue_depth", "Jobs waiting for a batch", queue)

    # ------------------------------------------------------------------ events

    def problem(self, kind: Kind) -> None:
        self.problems.labels(type=kind.suffix).inc()

    def committed(self, m: int, accepted: int, action: Action | None) -> None:
        """One committed round: a proposal of M tokens with a accepted and its verdict's
        action, or (action None) a self-decoded token."""
        self.committed_many([(m, accepted, action)])

    def committed_many(self, rounds: Iterable[tuple[int, int, Action | None]]) -> None:
        """`committed` for each (M, a, action) of a batch, every series updated once per
        batch (a Prometheus update takes a lock and several calls; ~10 per round were a
        few percent of a proposal's CPU)."""
        drafts = draft_tokens = accepted_tokens = self_decoded = 0
        by_accepted: dict[int, int] = {}
        by_action: dict[Action, int] = {}
        for m, accepted, action in rounds:
            if action is None:
                self_decoded += 1
                continue
            drafts += 1
            draft_tokens += m
            accepted_tokens += accepted
            by_accepted[accepted] = by_accepted.get(accepted, 0) + 1
            by_action[action] = by_action.get(action, 0) + 1
        if self_decoded:
            self.self_decoded.inc(self_decoded)
        if not drafts:
            return
        self.drafts.inc(drafts)
        self.draft_tokens.inc(draft_tokens)
        self.accepted_tokens.inc(accepted_tokens)
        reaching = drafts   # rounds that accepted a token at this position: a > position
        for position in range(min(max(by_accepted), MAX_POSITIONS)):
            reaching -= by_accepted.get(position, 0)
            self._child(self.accepted_per_pos, position).inc(reaching)
        observe_many(self.accepted_per_round, by_accepted.items())
        for action, times in by_action.items():
            self._child(self.verdicts, action).inc(times)
            if action.name.lower() in ESCALATIONS:
                self._child(self.escalations, action).inc(times)

    # ------------------------------------------------------------------ held updates

    def proposal(self) -> None:
        """A proposal received (sdcp_proposals_total, held)."""
        self._held_proposals += 1

    def hold(self, series, amount: float, times: int = 1) -> None:
        """`times` observations of `amount` in the histogram `series`, written with the held
        updates."""
        self._held.append((series, amount, times))
        self._bound_held()

    def hold_each(self, series, amounts: Iterable[float]) -> None:
        """One observation of each amount in the histogram `series`, written with the held
        updates."""
        self._held.extend((series, amount, 1) for amount in amounts)
        self._bound_held()

    def hold_rounds(self, rounds: Iterable[tuple[int, int, Action | None]]) -> None:
        """A batch's committed rounds (`committed_many`), written with the held updates."""
        self._held_rounds.extend(rounds)
        self._bound_held()

    def _bound_held(self) -> None:
        if len(self._held) + len(self._held_rounds) >= HOLD_UPDATES:
            self.write_held()

    def write_held(self) -> None:
        """Write every held update to its series (each series once)."""
        held, self._held = self._held, []
        rounds, self._held_rounds = self._held_rounds, []
        proposals, self._held_proposals = self._held_proposals, 0
        if proposals:
            self.proposals.inc(proposals)
        by_histogram: dict[int, tuple[object, list[tuple[float, int]]]] = {}
        for series, amount, times in held:
            by_histogram.setdefault(id(series), (series, []))[1].append((amount, times))
        for series, observations in by_histogram.values():
            observe_many(series, observations)
        if rounds:
            self.committed_many(rounds)

    def _child(self, metric, value):
        """`metric.labels(...)` for its one label, looked up once per value (labels() takes a
        lock and builds the key on every call; several run per round)."""
        children = self._children.setdefault(id(metric), {})
        child = children.get(value)
        if child is None:
            label = value.name.lower() if isinstance(value, Action) else str(value)
            child = children[value] = metric.labels(label)
        return child

    # ------------------------------------------------------------------ reading (tests, benchmarks)

    def count(self, name: str, **labels: str) -> float:
        """The value of `sdcp_<name>_total` (a trailing `_total` in `name` is allowed)."""
        return self.value(name.removesuffix("_total") + "_total", **labels)

    def value(self, sample: str, **labels: str) -> float:
        return self.registry.get_sample_value(PREFIX + sample, labels) or 0.0
