"""The verifier service: the resources of Table 1 over the transport, glue over the core's
session state machine, the engine, the target model, the cache and the commit log.

    POST sessions                     session-open  -> session-state   (routers)
    PUT  sessions/{id}/drafter        assignment    -> session-state   (routers)
    POST proposals                    proposal      -> verdict         (the assigned drafter)
    GET  sessions/{id}/output?from=n  -             -> output          (routers, front doors)
    POST sessions/{id}/policy         policy        -> session-state   (routers)

The transport's typed routes decode each body into its message and encode the answer; the
service sees messages only. Every session is one `ServedSession` record in the table it
shares with the engine (sessions.py); retiring a session drops its record.

A proposal's path: `propose` -> `VerifierSession.check` (a problem, a stored verdict, a wait
for an identical request in flight, or a Job) -> `Engine.submit` -> RoundResult. The round
and its after-commit work (events to the router, self-decoding, KV publication, forgetting
fenced or finished sessions) run in a task of the service, not in the request, whose client
may have gone away.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass

from ..aio import Arrival, TaskSet
from ..cache import CacheError, effective_commits
from ..commits import record_of
from ..core.messages import (
    ROLE_VERIFIER,
    Action,
    Assignment,
    LogprobsAsk,
    Output,
    Policy,
    Proposal,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
)
from ..core.problems import Kind, Problem, ProblemError, problem
from ..core.session import Job, Replay, State, VerifierSession, Wait, request_key
from ..refs import decode_session_id, read_token_list, target_kv_ref
from ..reports import RouterLink, router_targets
from ..transport import Authorizer, Call, Routed, Router
from .engine import Engine, EngineConfig
from .logprobs import Committed
from .metrics import Metrics
from .sessions import ServedSession, ServedSessions
from .target import TargetModel

log = logging.getLogger("sdcp_fast.verifier")
# The verifier's own state per session beyond the model's (bench/bench_session_memory.py
# measures both): the records, the replay window of verdicts, and per committed token its
# digest d[n] (a 32-byte bytes object) and its entry in the output list.
SESSION_STATE_BYTES = 16 << 10
STATE_BYTES_PER_TOKEN = 120


@dataclass(frozen=True)
class VerifierConfig:
    uri: str                          # this verifier's base URI (its certificate's URI SAN)
    routers: frozenset[str]           # identities that may open, assign, read output, set policy
    router_uri: str | None = None     # where events and status reports go
    router_uris: tuple[str, ...] = () # every router (several share the sessions): reports and
                                      # events go to each; empty: router_uri alone
    output_wait_s: float = 5.0        # long-poll wait of GET output
    status_interval_s: float = 1.0    # status reports to the router; below ttl_ms
    ttl_ms: int = 3000
    max_sessions: int = 4096
    memory_budget_bytes: int = 2 << 30   # session state (model KV included) of all sessions
    retire_idle_s: float = 30.0       # under memory pressure, sessions idle this long may go
    max_context_tokens: int = 32768   # the longest session a reservation counts with
    closed_keep_s: float = 120.0      # how long a closed session still answers retries
    idle_s: float = 1800.0            # a session nobody has touched for this long is dropped
    publish_kv_every: int = 0         # publish target KV every N rounds (0: never), for failover
    request_timeout_s: float = 5.0


class VerifierService(Routed):
    def __init__(self, config: VerifierConfig, backend, store, commit_log, *, client=None,
                 engine_config: EngineConfig = EngineConfig(), device: str | None = None,
                 metrics: Metrics | None = None):
        self.config = config
        self.target = TargetModel(backend)
        self.store = store
        self.commit_log = commit_log
        self.metrics = metrics or Metrics()
        self.sessions = ServedSessions()
        self.engine = Engine(self.target, store, commit_log, self.sessions, config=engine_config,
                             device=device, metrics=self.metrics)
        self.metrics.watch(sessions=lambda: sum(1 for s in self.sessions if not s.machine.closed),
                           load=lambda: self.engine.load, queue=lambda: self.engine.queue_depth)
        self.tasks = TaskSet()
        self._opening = 0
        self.target.observe_pass = lambda tokens, seconds: self.engine.policy.observe_pass(
            tokens, seconds, self.sessions.in_play() + self._opening)
        self.client = client
        self.link: RouterLink | None = None     # to the router, once started with a router_uri
        routers = set(config.routers)
        self.router = Router(authorizer=Authorizer({
            "sessions": routers, "drafter": routers, "policy": routers, "output": routers,
            "proposals": {"*"},   # the session checks the assigned drafter itself (403 sdcp-not-assigned)
        }))
        add = self.router.add_message
        add("POST", "/sessions", self.open_session, body=SessionOpen, resource="sessions")
        add("PUT", "/sessions/{sid}/drafter", self.put_drafter, body=Assignment, resource="drafter")
        add("POST", "/proposals", self.propose, body=Proposal, resource="proposals")
        add("GET", "/sessions/{sid}/output", self.output, resource="output")
        add("POST", "/sessions/{sid}/policy", self.set_policy, body=Policy, resource="policy")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.engine.start()
        self.tasks.spawn(self._drop_idle_sessions())
        routers = router_targets(self.config.router_uris, self.config.router_uri)
        if self.client is not None and routers:
            self.link = RouterLink(self.client, routers, self.config.uri,
                                   timeout_s=self.config.request_timeout_s)
            self.tasks.spawn(self.link.report_status_forever(self.status, self.config.status_interval_s))

    async def stop(self) -> None:
        for served in self.sessions:
            served.cancel_self_decoding()
        await self.engine.stop()        # queued jobs are answered 503
        await self.tasks.cancel_all()

    def status(self) -> Status:
        return Status(self.config.uri, ROLE_VERIFIER, self.engine.load, self.engine.queue_depth,
                      self.config.ttl_ms)

    # ------------------------------------------------------------------ resources

    async def open_session(self, call: Call, msg: SessionOpen) -> SessionState:
        self._opening += 1   # opens under way: the speculation plan counts them as load
        arrival = self.target.expect_prefill()   # a burst's opens share one prefill pass
        try:
            async with self.sessions.open_locks.hold(msg.session):   # a retried open waits for the first
                return await self._open(msg, arrival)
        except CacheError as exc:
            raise problem(Kind.UNAVAILABLE, f"cache or commit log unavailable: {exc}") from None
        finally:
            arrival.done()
            self._opening -= 1

    async def _open(self, msg: SessionOpen, arrival: Arrival) -> SessionState:
        existing = self.sessions.get(msg.session)
        if existing is not None:
            old = existing.machine
            if msg.epoch < old.epoch:
                raise problem(Kind.STALE_EPOCH, f"epoch {msg.epoch} is older than {old.epoch}")
            if msg.epoch == old.epoch:
                if msg.contract.digest != old.contract.digest:
                    raise problem(Kind.CONFLICT, "the session exists with another contract")
                old.check_router(msg.router_epoch)
                return old.state_message()   # a retried open, or a router taking the session over
        entries = await self.commit_log.read(msg.commit_log)
        self._check_log(msg, entries)
        prompt = await read_token_list(self.store, msg.prompt, "prompt")
        committed = await read_token_list(self.store, msg.resume.committed_tokens, "committed tokens") \
            if msg.resume else ()
        session = VerifierSession.open(msg, model_digest=self.target.digest, prompt=prompt,
                                       committed_tokens=committed)
        reserve = self.reservation(msg.contract, len(prompt), msg.logprobs)
        held = reserve - (existing.reserved if existing is not None else 0)
        await self._make_room(held, opening=msg.session)
        self.sessions.reserved_bytes += held   # held from here (no await in between): the budget
        try:                                   # cannot be promised twice by concurrent opens
            kv_ref = (msg.resume.target_kv if msg.resume else None) or msg.prompt_kv
            await self.target.prefill(msg.session, [*prompt, *committed], await self._kv_blob(kv_ref),
                                      reopen=existing is not None, share=msg.prefill_share or 1,
                                      arrival=arrival)
        finally:
            self.sessions.reserved_bytes -= held   # put() counts the record's own reservation
        served = ServedSession(session, log_position=len(entries), reserved=reserve)
        served.ask_logprobs(msg.logprobs)
        served.touch()
        self.sessions.put(served)   # retires the record of an older epoch
        log.info("session %s opened (epoch %d, round %d, committed %d)", msg.session.hex(),
                 session.epoch, session.round, session.committed)
        if session.closed:
            self._send_events(served)
        elif (self.engine.policy.self_decode_from_open(served.speculation, session.contract.m_max,
                                                       self.sessions.in_play() + self._opening - 1)
              and session.start_self_decoding(self.engine.load)):
            # the first token straight from the prefill's row, no drafter's round to wait for
            self.engine.policy.started_self_decoding(served.speculation)
            log.info("session %s self-decodes from its first token", msg.session.hex())
            served.self_task = self.tasks.spawn(self._self_decode(served))
        elif self.engine.policy.first_token_from_prefill() and session.start_self_decoding(self.engine.load):
            # the first token from the prefill's row while the drafter is still to come
            self.engine.policy.started_first_token(served.speculation)
            served.self_task = self.tasks.spawn(self._self_decode(served))
        return session.state_message()

    async def put_drafter(self, call: Call, msg: Assignment, sid: str) -> SessionState:
        served = self._served(sid)
        session = served.machine
        if msg.session != session.id:
            raise problem(Kind.BAD_REQUEST, "body names another session")
        state = session.assign(msg)
        served.wake()
        log.info("session %s assigned to %s (m_cap %d)", session.id.hex(), msg.drafter, session.m_cap)
        return state

    async def propose(self, call: Call, msg: Proposal) -> Verdict:
        self.metrics.proposal()
        served = self._served_by_id(msg.session)
        session = served.machine
        try:
            step = session.check(call.caller, msg)
        except ProblemError as exc:
            self.metrics.problem(exc.problem.kind)
            raise
        if isinstance(step, Replay):
            return step.verdict
        if isinstance(step, Wait):
            return await served.wait_for_verdict(step.round, request_key(msg),
                                                 self.config.request_timeout_s * 4)
        vocab = self.target.vocab_size
        if step.tokens and max(step.tokens) >= vocab:   # one C pass; the list only to say which
            bad = [t for t in step.tokens if t >= vocab]
            raise session.refuse(step, Problem(Kind.BAD_PROPOSAL, f"tokens {bad[:4]} outside the vocabulary"))
        # the round runs to its end in the engine even if this request goes away: the request
        # awaits its own future, which the engine's settling of the round settles (asyncio.shield's
        # rule, without its layers, nor the loop turn of a done-callback); what follows the
        # commit runs from there too (no task per round)
        answer = self.engine.event_loop.create_future()
        self.engine.enqueue(served, step, then=functools.partial(self._round_settled, served, answer))
        result = await answer
        if result.problem is not None:
            raise ProblemError(result.problem)
        return result.verdict

    async def output(self, call: Call, sid: str) -> Output:
        served = self._served(sid)
        session = served.machine
        try:
            start = int(call.query.get("from", "0"))
            if start < 0:
                raise ValueError
        except ValueError:
            raise problem(Kind.BAD_REQUEST, "from must be a non-negative integer") from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.output_wait_s
        while True:
            out = session.output(start)
            if out is not None:
                return served.with_logprobs(out)
            remaining = deadline - loop.time()
            if remaining <= 0 or served.retired:   # retired meanwhile: answer what there is
                return Output(session.id, session.epoch, start, (), False)
            await served.changed(remaining)

    async def set_policy(self, call: Call, msg: Policy, sid: str) -> SessionState:
        session = self._served(sid).machine
        if msg.session != session.id:
            raise problem(Kind.BAD_REQUEST, "body names another session")
        return session.policy(msg)

    # ------------------------------------------------------------------ rounds

    async def _verify(self, served: ServedSession, job: Job) -> Verdict | None:
        """One job through the engine; once the commit log has settled it, the after-commit
        work. Returns the verdict (None for a self-decoded round) or raises its problem."""
        result = await self.engine.submit(served, job)
        if result.settled:
            self._after_commit(served)
        if result.problem is not None:
            raise ProblemError(result.problem)
        return result.verdict

    def _round_settled(self, served: ServedSession, answer: asyncio.Future, result) -> None:
        if not answer.done():   # not cancelled with its request
            answer.set_result(result)
        if result.settled:
            self._after_commit(served)

    def _after_commit(self, served: ServedSession) -> None:
        """Tell the router, start self-decoding, publish KV, and let go of sessions that can
        no longer be served."""
        session = served.machine
        served.touch(self.engine.event_loop)
        self._send_events(served)
        if session.state == State.SELF_DECODING and served.self_task is None:
            served.self_task = self.tasks.spawn(self._self_decode(served))
        if session.state == State.FENCED:
            self.tasks.spawn(self._forget_later(served))
        elif self.config.publish_kv_every and (session.round % self.config.publish_kv_every == 0 or session.closed):
            self.tasks.spawn(self._publish_kv(served))

    async def _self_decode(self, served: ServedSession) -> None:
        """Decode the session with the target model, one round per token, until the period
        ends (self_max tokens or load above self_load) or the router assigns a drafter."""
        session = served.machine
        policy = self.engine.policy
        try:
            while True:
                # the load now, for a session whose first token only was self-decoded
                active = (self.sessions.in_play() + self._opening
                          if served.speculation.first_token_only else None)
                if policy.resume_drafting(served.speculation, session.self_tokens, session.contract.m_max, active,
                                          remaining=session.contract.max_new - session.committed):
                    session.end_self_decoding()   # speculation pays again: the router assigns a drafter
                    break
                job = session.next_self_job(self.engine.load)
                if job is None:
                    break
                try:
                    await self._verify(served, job)
                except ProblemError as exc:
                    log.warning("session %s: self-decoding stopped: %s", session.id.hex(), exc)
                    session.end_self_decoding()
                    break
        finally:
            if served.self_task is asyncio.current_task():
                served.self_task = None
            self._send_events(served)
            served.wake()

    def _send_events(self, served: ServedSession) -> None:
        session = served.machine
        for event in session.take_events():
            log.info("session %s: event %s at %d tokens", session.id.hex(), event.kind.name.lower(),
                     event.committed)
            if event.kind in (Action.FINISH, Action.FAIL):
                self.tasks.spawn(self._forget_later(served))
            if self.link is not None:
                self.tasks.spawn(self.link.post_event(event))

    async def _publish_kv(self, served: ServedSession) -> None:
        """The target KV of the committed tokens, under `target_kv_ref`, for a verifier taking over."""
        session = served.machine
        try:
            blob = await self.target.export_kv(session.id)
            await self.store.put(target_kv_ref(session.id, session.contract.scope), blob)
        except Exception as exc:
            log.debug("publishing target KV failed: %s", exc)

    # ------------------------------------------------------------------ retiring sessions

    async def _retire(self, served: ServedSession, *, resumable: bool = False) -> None:
        """Drop the session's record and its backend state (if it is still the one served).
        Under the id's open lock: an open of the same id waits, so the release can never hit
        the model state of the session that open creates. `resumable`: it could have gone
        on; later requests for it are answered session-retired."""
        async with self.sessions.open_locks.hold(served.id):
            if self.sessions.drop(served, resumable=resumable and not served.machine.closed):
                await self.target.release(served.id)

    async def _forget_later(self, served: ServedSession) -> None:
        await asyncio.sleep(self.config.closed_keep_s)
        await self._retire(served)

    async def _drop_idle_sessions(self) -> None:
        """Bounded memory when routers and drafters vanish: a session with no request and no
        commit for idle_s is retired (its router, if it comes back, resumes from the log)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(60.0, self.config.idle_s / 4))
            now = loop.time()
            for served in self.sessions:
                if served.machine.inflight is None and now - served.touched > self.config.idle_s:
                    log.info("session %s idle for %.0f s: dropped", served.id.hex(), self.config.idle_s)
                    self.metrics.retired.labels(reason="idle").inc()
                    await self._retire(served, resumable=True)

    # ------------------------------------------------------------------ memory and count budgets

    def reservation(self, contract, prompt: int, logprobs: LogprobsAsk | None = None) -> int:
        """Bytes a session holds at its longest: the model's state for its prompt and all
        the output its contract allows (max_new, plus the positions of one proposal; up to
        max_context_tokens), and the verifier's own state (with the log-probabilities of
        every output token when it asked for them)."""
        tokens = min(self.config.max_context_tokens, prompt + contract.max_new + contract.m_max + 1)
        per_token = STATE_BYTES_PER_TOKEN + (0 if logprobs is None else Committed.bytes_per_token(logprobs.top))
        return SESSION_STATE_BYTES + per_token * tokens + self.target.bytes_for(tokens)

    async def _make_room(self, need: int, *, opening: bytes) -> None:
        """Room for `need` more bytes (and one more session if `opening` is new): closed
        sessions go first, then the least recently used idle ones (their commit logs stay: a
        router resumes them); with no room left the open is refused as `capacity`, and the
        router places the session elsewhere. Called under the lock of `opening`, which is
        never retired here."""
        counted = opening not in self.sessions

        def fits() -> bool:
            return (self.sessions.reserved_bytes + need <= self.config.memory_budget_bytes
                    and (not counted or len(self.sessions) < self.config.max_sessions))

        if fits():
            return
        for served in self.sessions:
            if served.machine.closed and served.id != opening:
                await self._retire(served)
        now = asyncio.get_running_loop().time()
        for served in self.sessions.idle_first(now, self.config.retire_idle_s):
            if served.id == opening:
                continue
            if fits():
                return
            log.info("session %s idle for %.0f s: retired to make room", served.id.hex(), now - served.touched)
            self.metrics.retired.labels(reason="room").inc()
            await self._retire(served, resumable=True)
        if not fits():
            self.metrics.problem(Kind.CAPACITY)
            raise problem(Kind.CAPACITY, f"{len(self.sessions)} sessions hold {self.sessions.reserved_bytes} of "
                                         f"{self.config.memory_budget_bytes} bytes; {need} more needed")

    # ------------------------------------------------------------------ helpers

    def _served(self, sid: str) -> ServedSession:
        return self._served_by_id(decode_session_id(sid))

    def _served_by_id(self, sid: bytes) -> ServedSession:
        served = self.sessions.get(sid)
        if served is None:
            if self.sessions.was_retired(sid):
                raise problem(Kind.SESSION_RETIRED, "retired here while idle; resume it from its commit log")
            raise problem(Kind.NOT_FOUND, "no such session")
        served.touch(self.engine.event_loop)
        return served

    async def _kv_blob(self, kv_ref: str | None) -> bytes | None:
        """Target KV from the cache (resume: of the committed tokens; prompt_kv: of the
        prompt); any cache trouble means a prefill instead."""
        if kv_ref is None:
            return None
        try:
            return await self.store.get(kv_ref)
        except CacheError as exc:
            log.info("target KV %s unusable (%s): prefilling", kv_ref, exc)
            return None

    def _check_log(self, msg: SessionOpen, entries) -> None:
        """The commit log must agree with the open: no fence above its epoch; empty of
        commits for a fresh session; ending at the resume's round, length and digest."""
        fences = [e.epoch for e in entries if e.kind == "fence"]
        if fences and max(fences) > msg.epoch:
            raise problem(Kind.STALE_EPOCH, f"the commit log is fenced at epoch {max(fences)}")
        commits = effective_commits(entries)
        if msg.resume is None:
            if commits:
                raise problem(Kind.CONFLICT, "the commit log already holds commits: open with resume")
            return
        if not commits:
            if msg.resume.committed or msg.resume.round:
                raise problem(Kind.CONFLICT, "resume names a round the commit log does not hold")
            return
        try:
            last = record_of(commits[-1])
        except ProblemError:
            raise problem(Kind.UNAVAILABLE, "the commit log's last record is unreadable") from None
        if (last.round, last.committed, last.digest) != (msg.resume.round, msg.resume.committed, msg.resume.digest):
            raise problem(Kind.CONFLICT, "resume does not match the last commit record")
