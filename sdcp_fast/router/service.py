"""The router: places sessions, assigns drafters, handles events and failures (sections 6.1,
6.5, 6.6, 6.9), and feeds the front door with committed output.

`RouterService` coordinates the parts, each a module of its own: registry.py (instances and
their status), peers.py (the typed client for verifier and drafter resources),
placement.py (open on a verifier, assign a drafter), failover.py (fence and resume),
relay.py (the output reader), committed.py (the commit log as the source of truth).

SDCP resources it serves (Table 1), mTLS callers only:

    PUT  instances/{id}/status   status -> 204   ({id}: base64url of the instance's URI;
                                                  the caller must be that instance)
    POST events                  event  -> 204   (verifiers)

What it does for each session, every step under the session's lock:

- create: a verifier by load (registry.py), session-open with epoch 1, then a drafter;
- assign a drafter: read the commit log for the committed tokens, put them in the cache,
  PUT sessions/{id}/drafter at the verifier first (its session-state answer is the
  authoritative round, committed length and digest), then POST the assignment to the
  drafter; a drafter that refuses is skipped for the next candidate;
- events: switch -> another permitted drafter (the same one only if no other is live);
  end of self-decoding -> a drafter again; finish / fail -> nothing to place (the output
  reader sees the final output);
- monitor (every `monitor_interval_s`): a session whose drafter's status expired is
  reassigned; one whose verifier's status expired fails over: fence the commit log with
  epoch + 1, read its last effective record, put the committed tokens in the cache, open
  the session at another verifier with `resume`, re-send the sampling policy, assign a
  drafter; a session whose output has not moved for `stall_s` is assigned again (the
  catch-all for lost events and drafters that gave a session up). A verifier that answers
  sdcp-stale-epoch (PUT drafter, policy, output) lost the session: it fails over the same
  way, to that verifier too if no other takes it. A fence whose open failed is kept: the
  next attempt only opens, even if the old verifier reports status again;
- output: one long-poll reader per session, GET output?from=n with n = tokens received so
  far, so a retried or repeated read never duplicates or loses a token; output carrying a
  lower epoch than the session's is discarded.

Control steps of a session (placement, failover) run in the background one at a time under
its lock; the monitor's steps are dropped while another is pending, an event's never.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field

from ..aio import TaskSet
from ..cache import Fenced
from ..core.messages import (
    ROLE_DRAFTER,
    ROLE_VERIFIER,
    Action,
    Contract,
    Event,
    Policy,
    Sampling,
    Status,
)
from ..core.problems import Kind, problem
from ..refs import commit_log_name, decode_instance_id
from ..transport import Authorizer, Call, Routed, Router
from .committed import CommittedLog
from .failover import Failover
from .metrics import Metrics
from .peers import Peers, Refused
from .placement import Placement
from .registry import Registry
from .relay import OutputRelay
from .sessions import RouterSession

log = logging.getLogger("sdcp_fast.router")

@dataclass(frozen=True)
class ContractDefaults:
    """Contract members a generation request may leave out."""

    rule: int = 1
    m_max: int = 8
    max_new: int = 128
    stop: tuple[int, ...] = ()
    low_rounds: int = 4
    low_ratio: int | None = None
    fallback: tuple[Action, ...] = (Action.REDUCE, Action.SWITCH, Action.SELF_DECODE)
    self_load: int | None = 60
    self_max: int | None = None           # absent: once reached, self-decoding lasts while load allows
    sampling: Sampling | None = None


@dataclass(frozen=True)
class RouterConfig:
    uri: str                                      # this router's base URI
    verifiers: tuple[str, ...]                    # verifier base URIs
    drafters: tuple[tuple[str, bytes], ...]       # (drafter base URI, its model's digest)
    m_init: int = 4
    monitor_interval_s: float = 0.1
    stall_s: float = 5.0
    request_timeout_s: float = 5.0
    output_timeout_s: float = 10.0                # bound of one output long poll
    committed_lease_ms: int = 120_000
    target_kv: bool = True                        # offer the verifier's published target KV on resume
    session_load: int = 5
    max_sessions: int = 1024
    closed_keep_s: float = 300.0
    contract: ContractDefaults = field(default_factory=ContractDefaults)


class RouterService(Routed):
    def __init__(self, config: RouterConfig, backend, store, commit_log, *, client,
                 metrics: Metrics | None = None):
        self.config = config
        self.backend = backend          # the target model's tokenizer and digests
        self.commit_log = commit_log
        self.metrics = metrics or Metrics()
        self.metrics.watch(
            running=lambda: sum(1 for s in self.sessions.values() if not s.done and s.verifier is not None),
            waiting=lambda: sum(1 for s in self.sessions.values() if not s.done and s.verifier is None))
        self.registry = Registry(session_load=config.session_load)
        for uri in config.verifiers:
            self.registry.add(uri, ROLE_VERIFIER)
        for uri, digest in config.drafters:
            self.registry.add(uri, ROLE_DRAFTER, digest)
        self.sessions: dict[bytes, RouterSession] = {}
        self.peers = Peers(client, timeout_s=config.request_timeout_s)
        self.committed = CommittedLog(commit_log, store, lease_ms=config.committed_lease_ms)
        self.placement = Placement(self.registry, self.peers, self.committed, m_init=config.m_init,
                                   on_verifier_lost=self._verifier_lost)
        self.failover = Failover(self.registry, self.peers, self.committed, commit_log, self.placement,
                                 target_kv=config.target_kv)
        self.relay = OutputRelay(self.peers, timeout_s=config.output_timeout_s,
                                 on_verifier_lost=self._verifier_lost, on_unasked_fail=self._unasked_fail,
                                 on_output=self._output, on_end=self._ended)
        self.tasks = TaskSet()
        self._ops: dict[bytes, int] = {}           # session -> control steps pending
        instances = {*config.verifiers, *(uri for uri, _ in config.drafters)}
        self.router = Router(authorizer=Authorizer({"status": instances,
                                                    "events": set(config.verifiers)}))
        self.router.add_message("PUT", "/instances/{iid}/status", self.put_status, body=Status,
                                resource="status")
        self.router.add_message("POST", "/events", self.post_event, body=Event, resource="events")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.tasks.spawn(self._monitor())

    async def stop(self) -> None:
        await self.tasks.cancel_all()

    # ------------------------------------------------------------------ SDCP resources

    async def put_status(self, call: Call, status: Status, iid: str) -> None:
        uri = decode_instance_id(iid)
        if call.caller != uri or status.instance != uri:
            raise problem(Kind.FORBIDDEN, "an instance reports only its own status")
        inst = self.registry.get(uri)
        expected = ROLE_DRAFTER if inst is not None and inst.role == ROLE_DRAFTER else ROLE_VERIFIER
        if inst is None or status.role != expected:
            raise problem(Kind.FORBIDDEN, f"{uri} is not a configured instance of role {status.role}")
        self.registry.report(status)

    async def post_event(self, call: Call, event: Event) -> None:
        s = self.sessions.get(event.session)
        key = (event.epoch, int(event.kind), event.committed)
        if s is None or event.epoch != s.epoch or call.caller != s.verifier or key in s.seen_events:
            return                   # stale, foreign or a retried event
        s.seen_events.add(key)
        log.info("session %s: event %s at %d tokens", s.id.hex(), event.kind.name.lower(), event.committed)
        s.place(f"event-{event.kind.name.lower()}")
        if event.kind == Action.SWITCH:
            self._start_op(s, self.assign(s, exclude={s.drafter} if s.drafter else set(), why="switch"),
                           always=True)
        elif event.kind == Action.SELF_DECODE:
            self._start_op(s, self.assign(s, why="self-decoding ended"), always=True)

    # ------------------------------------------------------------------ generations

    def make_contract(self, **overrides) -> Contract:
        d = self.config.contract
        fields = dict(target=self.backend.digest, tokenizer=self.backend.tokenizer_digest, rule=d.rule,
                      m_max=d.m_max, max_new=d.max_new, stop=d.stop, low_rounds=d.low_rounds,
                      low_ratio=d.low_ratio, fallback=d.fallback, self_load=d.self_load,
                      self_max=d.self_max, sampling=d.sampling,
                      drafters=tuple(sorted({digest for _, digest in self.config.drafters})) or None)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return Contract(**fields)

    async def generate(self, prompt: list[int], contract: Contract, *,
                       wait_for_instances_s: float = 10.0) -> RouterSession:
        """Open a session on a verifier chosen by load, assign a drafter, read its output."""
        if not prompt:
            raise problem(Kind.BAD_REQUEST, "empty prompt")
        if len([s for s in self.sessions.values() if not s.done]) >= self.config.max_sessions:
            raise problem(Kind.UNAVAILABLE, "router at max_sessions")
        sid = os.urandom(16)
        s = RouterSession(sid, contract, tuple(prompt), commit_log_name(sid))
        self.sessions[sid] = s
        self.metrics.prompt_tokens.inc(len(prompt))
        deadline = time.monotonic() + wait_for_instances_s
        try:
            while True:
                async with s.lock:
                    opened = await self.placement.open(s, exclude=set())
                if opened:
                    break
                if time.monotonic() > deadline:
                    del self.sessions[sid]
                    raise problem(Kind.UNAVAILABLE, "no verifier could open the session")
                await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            # the client went away while the session was being opened: a verifier may have
            # opened it already, so it is fenced like any cancelled session
            self.cancel(s)
            raise
        self.tasks.spawn(self.relay.read(s))
        self._start_op(s, self.assign(s, why="created"), always=True)
        return s

    async def update_policy(self, s: RouterSession, sampling: Sampling) -> int:
        """Section 6.6: a new profile from a round after the current one; returns from_round."""
        async with s.lock:
            if s.done:
                raise problem(Kind.SESSION_CLOSED, "the session has ended")
            _, records = await self.committed.read(s)
            next_round = (records[-1].round if records else 0) + 2   # one round may be in flight
            for from_round in range(next_round, next_round + 8):
                state = await self.peers.set_policy(s.verifier, Policy(s.id, from_round, sampling))
                if not isinstance(state, Refused):
                    break
                if state.lost:
                    self._verifier_lost(s, s.verifier, s.epoch, "policy")
                if state.kind != Kind.CONFLICT:      # CONFLICT: the session moved past from_round
                    raise problem(Kind.UNAVAILABLE, "the verifier did not take the policy")
            else:
                raise problem(Kind.UNAVAILABLE, "the session kept moving ahead of the policy")
            s.sampling, s.policy_from_round = sampling, from_round
            s.place("policy", from_round=from_round)
            if s.drafter is not None:
                await self.placement.resend(s)
            return from_round

    def cancel(self, s: RouterSession, reason: str = "abort") -> None:
        """End a session for its client: "abort" (the client went away) or "stop" (a stop
        string was met). Its commit log is fenced with epoch + 1, so the verifier's next
        append is refused: it stops serving the session, its drafter's next proposal is
        answered sdcp-stale-epoch and the drafter stops too. At most the round under way
        at each is wasted."""
        if s.done:
            return
        s.cancelled = reason
        s.finished_at = time.monotonic()
        s.place("cancelled", reason=reason)
        s.notify()
        self._ended(s)
        log.info("session %s: cancelled (%s) at %d tokens", s.id.hex(), reason, len(s.tokens))
        self.tasks.spawn(self._fence_cancelled(s))

    async def _fence_cancelled(self, s: RouterSession) -> None:
        async with s.lock:       # after a control step under way (it sees the session done)
            epoch = s.epoch + 1
            try:
                await self.commit_log.fence(s.commit_log, epoch)
            except Fenced:
                return           # fenced higher already: nobody can commit at this epoch
            except Exception as exc:   # the store is unreachable: the verifier stops at idle_s
                log.warning("session %s: fencing the cancelled session failed: %s", s.id.hex(), exc)
                return
            s.epoch = epoch

    # ------------------------------------------------------------------ metrics hooks

    def _output(self, s: RouterSession, tokens: list[int]) -> None:
        now = time.monotonic()
        first = s.first_token_at is None
        gap = now - (s.last_output_at or s.created)
        s.last_output_at = now
        self.metrics.output(len(tokens), gap, first, now - s.created)

    def _ended(self, s: RouterSession) -> None:
        reason = s.finish_reason or "fail"
        self.metrics.finished.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe((s.finished_at or time.monotonic()) - s.created)

    def _unasked_fail(self, s: RouterSession, verifier: str | None, epoch: int) -> bool:
        """The verifier ended the session with fail. Under a contract whose ladder has no
        fail, that only means the ladder ran out while the verifier was too loaded to
        decode the session itself: the session is placed again (fenced, resumed from its
        commit log on the least-loaded verifier, a fresh ladder there) rather than failed.
        Every round commits at least one token, so this ends at max_new at the latest."""
        if Action.FAIL in s.contract.fallback:
            return False
        if (verifier, epoch) == (s.verifier, s.epoch) and not s.resume_pending and not s.verifier_lost:
            log.warning("session %s: %s ended it with fail, which the contract did not ask for; "
                        "placing it again", s.id.hex(), verifier)
            s.verifier_lost = True
            s.replace_why = "unasked_fail"
            s.place("unasked-fail")
        return True

    async def _failover(self, s: RouterSession) -> None:
        epoch, pending = s.epoch, s.resume_pending
        await self.failover.run(s)
        if not s.resume_pending and (s.epoch != epoch or pending):   # resumed somewhere
            self.metrics.replacements.labels(why=s.replace_why or "failover").inc()
            s.replace_why = None

    # ------------------------------------------------------------------ control steps

    async def assign(self, s: RouterSession, exclude: set[str] | frozenset[str] = frozenset(),
                     why: str = "") -> None:
        """A drafter for the session (none of `exclude` unless no other is live)."""
        async with s.lock:
            if s.done:
                return
            ok = await self.placement.assign(s, exclude)
            if not ok and exclude:
                # no other drafter: the same one is better than none (logged: a real fleet
                # would scale out here)
                log.warning("session %s: no other drafter for %s; keeping %s", s.id.hex(), why, exclude)
                ok = await self.placement.assign(s)
            s.needs_drafter = not ok and not s.done

    def _verifier_lost(self, s: RouterSession, verifier: str | None, epoch: int, where: str) -> None:
        self.failover.verifier_lost(s, verifier, epoch, where)

    def _start_op(self, s: RouterSession, coro: Coroutine, *, always: bool = False) -> None:
        """Run one control step for `s` in the background (steps of a session take its lock,
        so they run one after the other). The monitor's steps are dropped while another step
        of the session is pending; an event's step (`always`) is never dropped."""
        if s.id in self._ops and not always:
            coro.close()
            return
        self._ops[s.id] = self._ops.get(s.id, 0) + 1

        async def run():
            try:
                await coro
            except Exception:
                log.exception("session %s: control step failed", s.id.hex())
            finally:
                self._ops[s.id] -= 1
                if not self._ops[s.id]:
                    del self._ops[s.id]
        self.tasks.spawn(run())

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.config.monitor_interval_s)
            now = time.monotonic()
            for s in list(self.sessions.values()):
                if s.done:
                    if s.finished_at is not None and now - s.finished_at > self.config.closed_keep_s:
                        del self.sessions[s.id]
                    continue
                if s.id in self._ops or s.verifier is None:
                    continue
                if self.failover.needed(s):
                    self._start_op(s, self._failover(s))
                elif s.drafter is not None and not self.registry.is_live(s.drafter):
                    log.warning("session %s: drafter %s expired", s.id.hex(), s.drafter)
                    self._start_op(s, self.assign(s, exclude={s.drafter}, why="drafter expired"))
                elif s.needs_drafter:
                    self._start_op(s, self.assign(s, why="retry"))
                elif now - s.last_progress > self.config.stall_s:
                    log.warning("session %s: no output for %.1f s; assigning again", s.id.hex(),
                                now - s.last_progress)
                    s.last_progress = now
                    self._start_op(s, self.assign(s, why="stalled"))
