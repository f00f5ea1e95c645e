"""The router: places sessions, assigns drafters, handles events and failures (sections 6.1,
6.5, 6.6, 6.9), and feeds the front door with committed output. Several routers may share a
deployment's sessions: each session is owned by one of them, and another takes it over when
its owner dies (docs/ARCHITECTURE.md, "Routers: ownership").

`RouterService` coordinates the parts, each a module of its own: registry.py (instances and
their status), peers.py (the typed client for verifier and drafter resources),
placement.py (open on a verifier, assign a drafter), failover.py (fence and resume),
relay.py (the output reader), committed.py (the commit log as the source of truth),
ownership.py (the lease and the session records held), stored.py (what a record holds),
follow.py (streaming a session another router owns).

SDCP resources it serves (Table 1), mTLS callers only:

    PUT  instances/{id}/status   status -> 204   ({id}: base64url of the instance's URI;
                                                  the caller must be that instance)
    POST events                  event  -> 204   (verifiers; ignored for sessions owned
                                                  by another router)

What it does for each session, every step under the session's lock, every step that writes
(a fence, a session-open, an assignment, a policy) after writing the session's record in
the session table, which fails once another router owns the session:

- create: the record first, then a verifier by load (registry.py), session-open with epoch
  1, then a drafter;
- assign a drafter: read the commit log for the committed tokens, put them in the cache,
  PUT sessions/{id}/drafter at the verifier first (its session-state answer is the
  authoritative round, committed length and digest), then POST the assignment to the
  drafter; a drafter that refuses is skipped for the next candidate;
- events: switch -> another permitted drafter (the same one only if no other is live);
  end of self-decoding -> a drafter again; finish / fail -> nothing to place (the output
  reader sees the final output);
- monitor (every `monitor_interval_s`): a session whose drafter's status expired is
  reassigned; one whose verifier's status expired fails over: fence the commit log with a
  new epoch (allocated in the record first), read its last effective record, put the
  committed tokens in the cache, open the session at another verifier with `resume`,
  re-send the sampling policy, assign a drafter; a session whose output has not moved for
  `stall_s` is assigned again (the catch-all for lost events and drafters that gave a
  session up). A verifier that answers sdcp-stale-epoch or not-found (PUT drafter, policy,
  output) lost the session: it fails over the same way, to that verifier too if no other
  takes it. A fence whose open failed is kept: the next attempt only opens, even if the old
  verifier reports status again;
- output: one long-poll reader per session, GET output?from=n with n = tokens received so
  far, so a retried or repeated read never duplicates or loses a token; output carrying a
  lower epoch than the session's is discarded;
- admission (admission.py): a generation takes a slot before its record is written and
  gives it back when it ends, however (finish, fail, cancel, a failed open, the session
  lost to another router); past the capacity new generations wait in order, and a full
  queue is answered UNAVAILABLE. A session taken over counts as running, never refused;
- takeover (every `scan_interval_s`, default lease_ttl_s / 8): a record whose owner's lease has ended is taken (one
  router wins; its router epoch + 1), its committed tokens read from the log, and the
  session re-adopted where its verifier still serves it (PUT drafter with the new router
  epoch, no new epoch) or failed over with a fence; a router that loses a session (or its
  lease) stops acting for it and follows it instead (its clients' streams go on).

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

from ..aio import TaskSet, cancel_and_wait
from ..cache import CacheError, Fenced, LeaseExpired, NotOwner, Owned, Record
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
from . import stored
from .admission import Admission, Full, Slot
from .committed import CommittedLog
from .failover import Failover
from .follow import LogTail, follow
from .metrics import Metrics
from .ownership import Ownership
from .peers import Peers, Refused
from .placement import Placement
from .registry import Registry
from .relay import OutputRelay
from .sessions import RouterSession, expired

log = logging.getLogger("sdcp_fast.router")
TAKEOVERS_AT_ONCE = 16        # records taken concurrently by one scan (a dead router's many sessions)

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
    open_timeout_s: float = 30.0                  # bound of one session-open: a prefill under load
    output_timeout_s: float = 10.0                # bound of one output long poll
    committed_lease_ms: int = 120_000
    target_kv: bool = True                        # offer the verifier's published target KV on resume
    session_load: int = 5
    max_sessions: int = 1024
    closed_keep_s: float = 300.0                  # an ended session is kept this long for re-reads,
    closed_keep_max: int = 4096                   # and at most this many of them (the oldest go first)
    lease_ttl_s: float = 5.0                      # the router's lease on the session table
    scan_interval_s: float = 0.0                  # look for orphaned sessions (0: lease_ttl_s / 8)
    follow_interval_s: float = 0.05               # followed sessions: their commit log read this often
    status_grace_s: float = 3.0                   # after start, an instance not heard from yet is not dead
    max_followed: int = 1024                      # sessions of other routers streamed here at once
    max_running: int = 256                        # generations running at once, at most (admission.py)
    max_waiting: int = 1024                       # generations waiting for admission; more: UNAVAILABLE
    itl_target_ms: float = 0.0                    # inter-token latency objective (0: none, run max_running)
    admission_interval_s: float = 1.0             # the admission controller's step
    contract: ContractDefaults = field(default_factory=ContractDefaults)

    def __post_init__(self) -> None:
        """The admission members, checked where a config file's values arrive (ValueError
        naming the member)."""
        if self.max_running < 1:
            raise ValueError(f"max_running must be at least 1, not {self.max_running}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must not be negative, not {self.max_waiting}")
        if self.itl_target_ms < 0:
            raise ValueError(f"itl_target_ms must not be negative (0: no target), not {self.itl_target_ms}")
        if self.admission_interval_s <= 0:
            raise ValueError(f"admission_interval_s must be positive, not {self.admission_interval_s}")


class RouterService(Routed):
    def __init__(self, config: RouterConfig, backend, store, commit_log, *, client, table=None,
                 metrics: Metrics | None = None):
        self.config = config
        self.backend = backend          # the target model's tokenizer and digests
        self.commit_log = commit_log
        self.table = table              # the session table (a cache.RecordTable)
        self.metrics = metrics or Metrics()
        self.admission = Admission(max_running=config.max_running, max_waiting=config.max_waiting,
                                   itl_target_s=config.itl_target_ms / 1000,
                                   interval_s=config.admission_interval_s,
                                   on_wait=self.metrics.admission_wait.observe,
                                   on_reject=self.metrics.admission_rejected.inc)
        self._slots: dict[bytes, Slot] = {}       # session -> its admission slot, until it ends here
        self.metrics.watch(
            running=lambda: sum(1 for s in self.sessions.values() if not s.done and s.verifier is not None),
            waiting=lambda: self.admission.waiting + sum(1 for s in self.sessions.values()
                                                         if not s.done and s.verifier is None),
            followed=lambda: sum(1 for s in self.followed.values() if not s.done),
            queued=lambda: self.admission.waiting, capacity=lambda: self.admission.capacity)
        self.registry = Registry(session_load=config.session_load, grace_s=config.status_grace_s)
        for uri in config.verifiers:
            self.registry.add(uri, ROLE_VERIFIER)
        for uri, digest in config.drafters:
            self.registry.add(uri, ROLE_DRAFTER, digest)
        self.sessions: dict[bytes, RouterSession] = {}     # owned here
        self.followed: dict[bytes, RouterSession] = {}     # owned by another router, streamed here
        self.own = Ownership(table, holder=config.uri, ttl_s=config.lease_ttl_s, on_lost=self._lease_lost)
        self.peers = Peers(client, timeout_s=config.request_timeout_s, open_timeout_s=config.open_timeout_s)
        self.committed = CommittedLog(commit_log, store, lease_ms=config.committed_lease_ms)
        self.placement = Placement(self.registry, self.peers, self.committed, self.own, m_init=config.m_init,
                                   on_verifier_lost=self._verifier_lost)
        self.failover = Failover(self.registry, self.peers, self.committed, commit_log, self.placement,
                                 self.own, target_kv=config.target_kv)
        self.relay = OutputRelay(self.peers, timeout_s=config.output_timeout_s,
                                 on_verifier_lost=self._verifier_lost, on_unasked_fail=self._unasked_fail,
                                 on_output=self._output, on_end=self._ended)
        self.tasks = TaskSet()
        self.stopping = False                      # stop() began: nothing new is started
        self._ops: dict[bytes, int] = {}           # session -> control steps pending
        self._readers: dict[bytes, asyncio.Task] = {}   # session -> its output reader or follower
        self._forgetting: set[bytes] = set()       # expired sessions whose records are being deleted
        instances = {*config.verifiers, *(uri for uri, _ in config.drafters)}
        self.router = Router(authorizer=Authorizer({"status": instances,
                                                    "events": set(config.verifiers)}))
        self.router.add_message("PUT", "/instances/{iid}/status", self.put_status, body=Status,
                                resource="status")
        self.router.add_message("POST", "/events", self.post_event, body=Event, resource="events")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.table is not None:
            await self.own.start()
            self.tasks.spawn(self.own.keep())
            self.tasks.spawn(self._scan_forever())
        self.tasks.spawn(self._monitor())
        self.tasks.spawn(self.admission.run())

    async def stop(self) -> None:
        """Stop acting, and hand the sessions over: the lease is revoked, so another router
        takes them at its next scan (or this one when it comes back)."""
        self.stopping = True
        await self.tasks.cancel_all()
        if self.table is not None:
            await self.own.close()

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
        if s is not None and s.verifier is None and not s.done:
            # an event can overtake its session's open answer (a verifier that commits the first
            # token from the prefill ends that period at once): wait for the open to settle,
            # else the event would be taken for a stranger's and the session left undrafted
            deadline = time.monotonic() + self.config.open_timeout_s
            while s.verifier is None and not s.done and (left := deadline - time.monotonic()) > 0:
                await s.wait_changed(left)
        key = (event.epoch, int(event.kind), event.committed)
        if s is None or event.epoch != s.epoch or call.caller != s.verifier or key in s.seen_events:
            return                   # stale, foreign (another router's session) or a retried event
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

    async def generate(self, prompt: list[int], contract: Contract, *, door: dict | None = None,
                       wait_for_instances_s: float = 10.0) -> RouterSession:
        """Record the session, open it on a verifier chosen by load, assign a drafter, read
        its output. `door`: how the client streams it (stored with it, so that a stream can
        resume at any router). Waits for admission first (UNAVAILABLE when its queue is
        full); the slot is the session's until it ends, and given back if this raises."""
        if not prompt:
            raise problem(Kind.BAD_REQUEST, "empty prompt")
        if len([s for s in self.sessions.values() if not s.done]) >= self.config.max_sessions:
            raise problem(Kind.UNAVAILABLE, "router at max_sessions")
        arrived, arrived_wall = time.monotonic(), time.time()   # its latencies count the wait
        try:
            slot = await self.admission.acquire()
        except Full as exc:
            raise problem(Kind.UNAVAILABLE, f"the router's admission queue is full: {exc}") from None
        sid = os.urandom(16)
        s = RouterSession(sid, contract, tuple(prompt), commit_log_name(sid), door=dict(door or {}),
                          created=arrived, created_wall=arrived_wall)
        self.sessions[sid] = s            # before its record exists: the scan leaves it alone
        self._slots[sid] = slot
        try:
            return await self._start(s, wait_for_instances_s)
        except BaseException:
            self._release(s)
            raise

    async def _start(self, s: RouterSession, wait_for_instances_s: float) -> RouterSession:
        """generate's steps once admitted: the record, the open, a drafter, the reader."""
        sid, prompt = s.id, s.prompt
        try:
            await self.own.create(s)
        except CacheError as exc:        # no table, no lease, or the store is down
            del self.sessions[sid]
            raise problem(Kind.UNAVAILABLE, f"the session table does not take sessions now: {exc}") from None
        except asyncio.CancelledError:   # the client went away: nothing was placed
            del self.sessions[sid]
            if s.owned is not None:
                self._let_go(s)
            raise
        self.metrics.prompt_tokens.inc(len(prompt))
        deadline = time.monotonic() + wait_for_instances_s
        try:
            while True:
                async with s.lock:
                    opened = await self.placement.open(s, exclude=set())
                if opened:
                    break
                if time.monotonic() > deadline:
                    self.sessions.pop(sid, None)
                    self._let_go(s)
                    raise problem(Kind.UNAVAILABLE, "no verifier could open the session")
                await asyncio.sleep(0.2)
        except NotOwner as exc:
            self._lost(s, exc)
            raise problem(Kind.UNAVAILABLE, "this router lost the session while opening it") from None
        except CacheError as exc:        # the session table did not answer in time
            self.cancel(s)
            raise problem(Kind.UNAVAILABLE, f"the session table did not answer: {exc}") from None
        except asyncio.CancelledError:
            # the client went away while the session was being opened: a verifier may have
            # opened it already, so it is fenced like any cancelled session
            self.cancel(s)
            raise
        self._read_output(s)
        if not s.self_decoding:   # else the verifier's event at the end of the period asks
            self._start_op(s, self.assign(s, why="created"), always=True)
        return s

    async def find(self, sid: bytes) -> RouterSession | None:
        """A session this router owns, or one another router owns (followed here: its
        stream resumes at this router); None if the session table has no such session."""
        s = self.sessions.get(sid) or self.followed.get(sid)
        if s is not None or self.table is None:
            return s
        try:
            record = await self.table.read(stored.key_of(sid))
        except (CacheError, ValueError) as exc:
            raise problem(Kind.UNAVAILABLE, f"the session table cannot be read: {exc}") from None
        if record is None:
            return None
        s = self.sessions.get(sid) or self.followed.get(sid)     # found meanwhile
        if s is not None:
            return s
        if len(self.followed) >= self.config.max_followed:
            raise problem(Kind.UNAVAILABLE, "too many sessions of other routers streamed here")
        s = stored.restore(stored.decode(record.value))
        if s.done:                        # ended: its output, up to its end, from the log now
            try:
                tokens = await LogTail(self.commit_log, s.commit_log).read()
            except (CacheError, ValueError) as exc:
                raise problem(Kind.UNAVAILABLE, f"the commit log cannot be read: {exc}") from None
            s.add_output(tokens)
            self.followed[sid] = s
            return s
        self._follow(s)
        return s

    async def update_policy(self, s: RouterSession, sampling: Sampling) -> int:
        """Section 6.6: a new profile from a round after the current one; returns from_round.
        The profile is recorded before the verifier is told, so a router that takes the
        session over re-sends it."""
        async with s.lock:
            if s.done:
                raise problem(Kind.SESSION_CLOSED, "the session has ended")
            if not self.own.holds(s):
                raise problem(Kind.UNAVAILABLE, "another router owns this session now: ask it")
            _, records = await self.committed.read(s)
            next_round = (records[-1].round if records else 0) + 2   # one round may be in flight
            before = (s.sampling, s.policy_from_round)
            try:
                for from_round in range(next_round, next_round + 8):
                    s.sampling, s.policy_from_round = sampling, from_round
                    await self.own.act(s)
                    state = await self.peers.set_policy(s.verifier, Policy(s.id, from_round, sampling,
                                                                           router_epoch=s.router_epoch or None))
                    if not isinstance(state, Refused):
                        break
                    if state.lost:
                        self._verifier_lost(s, s.verifier, s.epoch, "policy")
                    if state.kind != Kind.CONFLICT:      # CONFLICT: the session moved past from_round
                        raise problem(Kind.UNAVAILABLE, "the verifier did not take the policy")
                else:
                    raise problem(Kind.UNAVAILABLE, "the session kept moving ahead of the policy")
            except NotOwner as exc:
                self._lost(s, exc)
                raise problem(Kind.UNAVAILABLE, "another router owns this session now: ask it") from None
            except Exception:
                s.sampling, s.policy_from_round = before
                raise
            s.place("policy", from_round=from_round)
            try:
                await self.own.act(s)
                if s.drafter is not None:
                    await self.placement.resend(s)
            except NotOwner as exc:
                self._lost(s, exc)
            return from_round

    def cancel(self, s: RouterSession, reason: str = "abort") -> None:
        """End a session for its client: "abort" (the client went away) or "stop" (a stop
        string was met). Its commit log is fenced with a new epoch, so the verifier's next
        append is refused: it stops serving the session, its drafter's next proposal is
        answered sdcp-stale-epoch and the drafter stops too. At most the round under way
        at each is wasted. A session this router does not own (followed) is left to its
        owner: it runs to its end."""
        if s.done or not self.own.holds(s):
            return
        s.end(cancelled=reason)
        s.place("cancelled", reason=reason)
        s.notify()
        self._ended(s)
        log.info("session %s: cancelled (%s) at %d tokens", s.id.hex(), reason, len(s.tokens))
        self.tasks.spawn(self._fence_cancelled(s))

    async def _fence_cancelled(self, s: RouterSession) -> None:
        async with s.lock:       # after a control step under way (it sees the session done)
            epoch = max(s.epoch, s.allocated) + 1
            s.allocated = epoch
            try:
                await self.own.act(s)        # the end and the epoch, before the fence
                await self.commit_log.fence(s.commit_log, epoch)
            except NotOwner as exc:
                self._lost(s, exc)
                return
            except Fenced:
                return           # fenced higher already: nobody can commit at this epoch
            except Exception as exc:   # the store is unreachable: the verifier stops at idle_s
                log.warning("session %s: fencing the cancelled session failed: %s", s.id.hex(), exc)
                return
            s.epoch = epoch
            await self._save(s)

    # ------------------------------------------------------------------ metrics hooks

    def _output(self, s: RouterSession, tokens: list[int]) -> None:
        now = time.monotonic()
        first = s.first_token_at is None
        gap = now - (s.last_output_at or s.created)
        s.last_output_at = now
        self.metrics.output(len(tokens), gap, first, now - s.created)
        if not first:
            self.admission.observe_itl(gap, len(tokens))

    def _release(self, s: RouterSession) -> None:
        """Give back `s`'s admission slot, if it still holds one (each end path calls this;
        the first call releases)."""
        slot = self._slots.pop(s.id, None)
        if slot is not None:
            slot.release()

    def _ended(self, s: RouterSession) -> None:
        self._release(s)
        reason = s.finish_reason or "fail"
        self.metrics.finished.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe((s.finished_at or time.monotonic()) - s.created)
        if s.cancelled is None:           # a cancel records its end with its fence
            self.tasks.spawn(self._save(s))

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
                     why: str = "", prefer: str | None = None) -> None:
        """A drafter for the session (none of `exclude` unless no other is live; `prefer`
        first if it is not known to be dead)."""
        async with s.lock:
            if s.done:
                return
            ok = await self.placement.assign(s, exclude, prefer=prefer)
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
        of the session is pending; an event's step (`always`) is never dropped. A step that
        finds the session no longer this router's stops there (NotOwner)."""
        if (s.id in self._ops and not always) or self.stopping:
            coro.close()
            return
        self._ops[s.id] = self._ops.get(s.id, 0) + 1

        async def run():
            try:
                await coro
            except NotOwner as exc:
                self._lost(s, exc)
            except CacheError as exc:        # the store is down, slow, or a writer holds the log
                log.warning("session %s: control step not done, the store did not answer (%s); "
                            "the monitor tries again", s.id.hex(), exc)
            except Exception:
                log.exception("session %s: control step failed", s.id.hex())
            finally:
                self._ops[s.id] -= 1
                if not self._ops[s.id]:
                    del self._ops[s.id]
        self.tasks.spawn(run())

    async def _save(self, s: RouterSession) -> None:
        """Write the session's record (its cursor, its end); a lost session is let go."""
        if self.stopping:
            return
        try:
            await self.own.act(s)
        except NotOwner as exc:
            self._lost(s, exc)
        except CacheError as exc:
            log.info("session %s: record not written now: %s", s.id.hex(), exc)

    def _let_go(self, s: RouterSession) -> None:
        """`s` is out of memory: delete its record. Until the delete is done the takeover
        scan must not adopt the record back as one of this lease's not held in memory."""
        self._forgetting.add(s.id)
        self.tasks.spawn(self._forget(s))

    async def _forget(self, s: RouterSession) -> None:
        """Delete the record of a session that ended long ago (or never opened)."""
        try:
            await self.own.delete(s)
        except NotOwner:
            pass
        except CacheError as exc:
            log.info("session %s: record not deleted now: %s", s.id.hex(), exc)
        finally:
            self._forgetting.discard(s.id)

    # ------------------------------------------------------------------ ownership

    def _read_output(self, s: RouterSession) -> None:
        self._set_reader(s, self.relay.read(s))

    def _follow(self, s: RouterSession) -> None:
        self.followed[s.id] = s
        self._set_reader(s, follow(s, self.commit_log, self.table, interval_s=self.config.follow_interval_s))

    def _set_reader(self, s: RouterSession, coro: Coroutine) -> None:
        if self.stopping:
            coro.close()
            return
        old = self._readers.get(s.id)
        if old is not None:
            old.cancel()
        task = self._readers[s.id] = self.tasks.spawn(coro)
        task.add_done_callback(lambda t, sid=s.id: self._readers.pop(sid, None) if self._readers.get(sid) is t
                               else None)

    def _lost(self, s: RouterSession, why: BaseException | str) -> None:
        """`s` is no longer this router's (taken over, or the lease ended): stop acting for
        it; follow it, so its clients' streams here go on."""
        if isinstance(why, LeaseExpired):
            self.own.lost_lease(str(why))     # every session goes: _lease_lost
            return
        if self.sessions.get(s.id) is not s:
            return
        self._release(s)                      # it runs on, counted by its new owner
        del self.sessions[s.id]
        s.owned = None
        self.metrics.lost.inc()
        log.warning("session %s: no longer this router's (%s); following it", s.id.hex(), why)
        if s.done:
            return
        s.notify()
        self._follow(s)

    def _lease_lost(self) -> None:
        for s in list(self.sessions.values()):
            self._lost(s, "the lease ended")

    async def _scan_forever(self) -> None:
        """Take over sessions whose owner's lease has ended (and adopt any record of this
        router's lease it does not hold in memory: one whose takeover was cut short)."""
        interval = self.config.scan_interval_s or self.config.lease_ttl_s / 8
        while True:
            await asyncio.sleep(interval)
            if not self.own.valid():
                continue
            # The records this router holds under its live lease are not read: nobody can
            # have taken them while the lease lives. Reading them cost every scan (each
            # lease_ttl / 8) O(its sessions, the ended ones kept for re-reads included).
            held = [stored.key_of(sid) for sid, s in self.sessions.items() if self.own.holds(s)]
            held += [stored.key_of(sid) for sid in self._forgetting]
            try:
                records = await self.table.scan(values=False, skip=held)   # a taken record is read again
            except CacheError as exc:
                log.info("session table scan failed: %s", exc)
                continue
            await self._take_all(records)

    async def _take_all(self, records: list[Record]) -> None:
        """Take the orphaned records (and adopt those of this lease not held in memory),
        TAKEOVERS_AT_ONCE at a time."""
        lease = self.own.lease
        if lease is None:
            return
        slots = asyncio.Semaphore(TAKEOVERS_AT_ONCE)

        async def take(record: Record) -> None:
            async with slots:
                if not self.own.valid():
                    return
                if record.orphaned:
                    await self._take_over(record)
                else:
                    await self._take_over(record, Owned(record.key, lease, record.token))

        await asyncio.gather(*(take(r) for r in records if r.orphaned or (
            r.lease == lease.id and bytes.fromhex(r.key) not in self.sessions
            and bytes.fromhex(r.key) not in self._forgetting)))

    async def _take_over(self, record: Record, owned: Owned | None = None) -> None:
        try:
            if owned is None:
                owned = await self.own.take(record)
            # read again: the old owner may have written after the scan read it, before its
            # lease ended (all its writes precede the take; none can follow it)
            now = await self.table.read(record.key)
            if now is None or now.token != owned.token or now.lease != owned.lease.id:
                return
            obj = stored.decode(now.value)
        except NotOwner:
            return                      # another router took it first, or its owner came back
        except (CacheError, ValueError) as exc:
            log.warning("session record %s not taken: %s", record.key, exc)
            return
        sid = bytes.fromhex(obj["id"])
        if sid in self.sessions:
            return
        s = self.followed.pop(sid, None)
        await cancel_and_wait(self._readers.pop(sid, None))
        s = stored.restore(obj, into=s)
        s.owned, s.router_epoch = owned, owned.token
        s.verifier_lost = s.needs_drafter = False
        s.seen_events = set()
        s.place("takeover", previous=record.holder, router_epoch=s.router_epoch)
        self.sessions[sid] = s
        if not s.done:
            self._slots[sid] = self.admission.adopt()
        self.metrics.takeovers.inc()
        log.warning("session %s: taken over from %s (router epoch %d, epoch %d, verifier %s)", sid.hex(),
                    record.holder, owned.token, s.epoch, s.verifier)
        self._start_op(s, self._adopt(s), always=True)

    async def _adopt(self, s: RouterSession) -> None:
        """A session just taken over: its output so far from the commit log, then re-adopted
        where its verifier still serves it (the PUT drafter, with this router's epoch, is the
        question and makes the verifier refuse the previous owner from then on), or failed
        over with a fence when its placement is unknown or was being changed."""
        async with s.lock:
            tokens, _ = await self.committed.read(s)
            if len(tokens) > len(s.tokens):      # up to its end, if it has one (final_tokens)
                s.add_output(tokens[len(s.tokens):])
            await self.own.act(s)
        if s.done:
            if s.cancelled is not None:
                await self._fence_cancelled(s)   # its fence may not have been written
            return
        self._read_output(s)
        if s.resume_pending or s.allocated > s.epoch or s.verifier is None:
            s.verifier_lost = s.verifier is not None
            await self._failover(s)
        else:
            await self.assign(s, prefer=s.drafter, why="takeover")

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.config.monitor_interval_s)
            now = time.monotonic()
            for s in expired(self.followed, now, self.config.closed_keep_s, self.config.closed_keep_max):
                del self.followed[s.id]
            if not self.own.valid() and self.table is not None:
                continue            # no lease (lost, or renewing late): act for nothing
            for s in expired(self.sessions, now, self.config.closed_keep_s, self.config.closed_keep_max):
                del self.sessions[s.id]
                self._let_go(s)
            for s in list(self.sessions.values()):
                if s.done:
                    continue
                if s.id in self._ops or s.verifier is None:
                    continue
                if self.failover.needed(s):
                    self._start_op(s, self._failover(s))
                elif s.drafter is not None and self.registry.silent(s.drafter):
                    log.warning("session %s: drafter %s expired", s.id.hex(), s.drafter)
                    self._start_op(s, self.assign(s, exclude={s.drafter}, why="drafter expired"))
                elif s.needs_drafter:
                    self._start_op(s, self.assign(s, why="retry"))
                elif now - s.last_progress > self.config.stall_s:
                    log.warning("session %s: no output for %.1f s; assigning again", s.id.hex(),
                                now - s.last_progress)
                    s.last_progress = now
                    self._start_op(s, self.assign(s, why="stalled"))
