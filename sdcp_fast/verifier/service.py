"""The verifier service: the resources of Table 1 over the transport, glue over the core's
session state machine, the engine, the model backend, the cache and the commit log.

    POST sessions                     session-open  -> session-state   (routers)
    PUT  sessions/{id}/drafter        assignment    -> session-state   (routers)
    POST proposals                    proposal      -> verdict         (the assigned drafter)
    GET  sessions/{id}/output?from=n  -             -> output          (routers, front doors)
    POST sessions/{id}/policy         policy        -> session-state   (routers)

Objects named by cache references (prompts, committed tokens) hold a CBOR array of token
ids; KV references hold a backend's `export_kv` blob.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..cache import CacheError, NotFound, effective_commits, object_uri
from ..core import cbor
from ..core.messages import (
    ROLE_VERIFIER,
    Action,
    Assignment,
    CommitRecord,
    Event,
    Output,
    Policy,
    Proposal,
    SessionOpen,
    Status,
)
from ..core.problems import Kind, Problem, ProblemError, problem
from ..core.session import Replay, State, VerifierSession, Wait, request_key
from ..models.base import KVCapacityError, ModelError
from ..transport import Authorizer, Request, Response, Router
from .engine import Engine, EngineConfig
from .metrics import Metrics

log = logging.getLogger("sdcp_fast.verifier")
CBOR = "application/sdcp+cbor"


@dataclass(frozen=True)
class VerifierConfig:
    uri: str                          # this verifier's base URI (its certificate's URI SAN)
    routers: frozenset[str]           # identities that may open, assign, read output, set policy
    router_uri: str | None = None     # where events and status reports go
    output_wait_s: float = 5.0        # long-poll wait of GET output
    status_interval_s: float = 1.0    # status reports to the router; below ttl_ms
    ttl_ms: int = 3000
    max_sessions: int = 4096
    closed_keep_s: float = 120.0      # how long a closed session still answers retries
    idle_s: float = 1800.0            # a session nobody has touched for this long is dropped
    publish_kv_every: int = 0         # publish target KV every N rounds (0: never), for failover
    request_timeout_s: float = 5.0


def token_list_bytes(tokens: Sequence[int]) -> bytes:
    """How prompts and committed tokens are stored behind a cache reference."""
    return cbor.dumps(list(tokens))


def decode_session_id(text: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 16 or "=" in text:
        raise problem(Kind.NOT_FOUND, f"{text!r} is not a base64url session id")
    return raw


def encode_session_id(session: bytes) -> str:
    return base64.urlsafe_b64encode(session).rstrip(b"=").decode()


def cbor_response(message, status: int = 200) -> Response:
    return Response(status, message.to_cbor(), CBOR)


class VerifierService:
    def __init__(self, config: VerifierConfig, backend, store, commit_log, *, client=None,
                 engine_config: EngineConfig = EngineConfig(), device: str = "cpu",
                 metrics: Metrics | None = None):
        self.config = config
        self.backend = backend
        self.store = store
        self.commit_log = commit_log
        self.client = client
        self.metrics = metrics or Metrics()
        self.sessions: dict[bytes, VerifierSession] = {}
        self._changed: dict[bytes, asyncio.Event] = {}
        self._self_tasks: dict[bytes, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._refusals: dict[bytes, tuple[tuple | None, Problem]] = {}   # last refused request per session
        self._touched: dict[bytes, float] = {}    # loop time of each session's last activity
        self._open_locks: dict[bytes, list] = {}   # [lock, users]: opens of one id never interleave
        self.engine = Engine(backend, store, commit_log, config=engine_config, device=device,
                             metrics=self.metrics, on_commit=self._on_commit, on_refuse=self._on_refuse,
                             may_propose=self._may_propose)
        routers = set(config.routers)
        self.router = Router(authorizer=Authorizer({
            "sessions": routers, "drafter": routers, "policy": routers, "output": routers,
            "proposals": {"*"},   # the session checks the assigned drafter itself (403 sdcp-not-assigned)
        }))
        self.router.add("POST", "/sessions", self.open_session, resource="sessions")
        self.router.add("PUT", "/sessions/{sid}/drafter", self.put_drafter, resource="drafter")
        self.router.add("POST", "/proposals", self.propose, resource="proposals")
        self.router.add("GET", "/sessions/{sid}/output", self.output, resource="output")
        self.router.add("POST", "/sessions/{sid}/policy", self.set_policy, resource="policy")

    # ------------------------------------------------------------------ lifecycle

    async def handle(self, request: Request) -> Response:
        return await self.router.handle(request)

    async def start(self) -> None:
        self.engine.start()
        self._spawn(self._drop_idle_sessions())
        if self.client is not None and self.config.router_uri:
            self._spawn(self._report_status())

    async def stop(self) -> None:
        for task in [*self._self_tasks.values(), *self._background]:
            task.cancel()
        await self.engine.stop()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ------------------------------------------------------------------ resources

    async def open_session(self, request: Request) -> Response:
        msg = SessionOpen.from_cbor(request.body)
        entry = self._open_locks.setdefault(msg.session, [asyncio.Lock(), 0])   # [lock, users]
        entry[1] += 1
        try:
            async with entry[0]:   # a retried open waits for the first and gets its answer
                return await self._open(msg)
        except CacheError as exc:
            raise problem(Kind.UNAVAILABLE, f"cache or commit log unavailable: {exc}") from None
        finally:
            entry[1] -= 1
            if entry[1] == 0 and self._open_locks.get(msg.session) is entry:
                del self._open_locks[msg.session]   # nobody else uses it: bounded memory

    async def _open(self, msg: SessionOpen) -> Response:
        existing = self.sessions.get(msg.session)
        if existing is not None:
            if msg.epoch < existing.epoch:
                raise problem(Kind.STALE_EPOCH, f"epoch {msg.epoch} is older than {existing.epoch}")
            if msg.epoch == existing.epoch:
                if msg.contract.digest != existing.contract.digest:
                    raise problem(Kind.CONFLICT, "the session exists with another contract")
                return cbor_response(existing.state_message())   # a retried open
        elif len(self.sessions) >= self.config.max_sessions:
            self._evict_closed()
            if len(self.sessions) >= self.config.max_sessions:
                raise problem(Kind.UNAVAILABLE, "session table full")
        entries = await self.commit_log.read(msg.commit_log)
        self._check_log(msg, entries)
        prompt = await self._tokens(msg.prompt, "prompt")
        committed = await self._tokens(msg.resume.committed_tokens, "committed tokens") if msg.resume else ()
        session = VerifierSession.open(msg, model_digest=self.backend.digest, prompt=prompt,
                                       committed_tokens=committed)
        kv_ref = (msg.resume.target_kv if msg.resume else None) or msg.prompt_kv
        await self._prefill(msg.session, [*prompt, *committed], kv_ref, existing is not None)
        if existing is not None:
            self._cancel_self_decoding(existing)
            self._wake(existing)
        self.sessions[msg.session] = session
        self._refusals.pop(msg.session, None)
        self._touch(msg.session)
        self.engine.log_positions[msg.session] = len(entries)
        self._changed[msg.session] = asyncio.Event()
        log.info("session %s opened (epoch %d, round %d, committed %d)", msg.session.hex(),
                 session.epoch, session.round, session.committed)
        if session.closed:
            self._send_events(session)
        return cbor_response(session.state_message())

    async def put_drafter(self, request: Request, sid: str) -> Response:
        session = self._session(sid)
        msg = Assignment.from_cbor(request.body)
        if msg.session != session.id:
            raise problem(Kind.BAD_REQUEST, "body names another session")
        state = session.assign(msg)
        self._wake(session)
        log.info("session %s assigned to %s (m_cap %d)", session.id.hex(), msg.drafter, session.m_cap)
        return cbor_response(state)

    async def propose(self, request: Request) -> Response:
        msg = Proposal.from_cbor(request.body)
        self.metrics.inc("proposals_total")
        session = self.sessions.get(msg.session)
        if session is None:
            raise problem(Kind.NOT_FOUND, "no such session")
        self._touch(session.id)
        try:
            step = session.check(request.caller, msg)
        except ProblemError as exc:
            self.metrics.inc("problems_total", type=exc.problem.kind.suffix)
            raise
        if isinstance(step, Replay):
            return cbor_response(step.verdict)
        if isinstance(step, Wait):
            return cbor_response(await self._wait_for_verdict(session, step.round, request_key(msg)))
        bad = [t for t in step.tokens if t >= self.backend.vocab_size]
        if bad:
            raise session.refuse(step, Problem(Kind.BAD_PROPOSAL, f"tokens {bad[:4]} outside the vocabulary"))
        return cbor_response(await self.engine.submit(session, step))

    async def output(self, request: Request, sid: str) -> Response:
        session = self._session(sid)
        try:
            start = int(request.query.get("from", "0"))
            if start < 0:
                raise ValueError
        except ValueError:
            raise problem(Kind.BAD_REQUEST, "from must be a non-negative integer") from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.output_wait_s
        while True:
            event = self._changed.get(session.id)
            out = session.output(start)
            if out is not None:
                return cbor_response(out)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return cbor_response(Output(session.id, session.epoch, start, (), False))
            if event is None:   # retired meanwhile: answer what there is
                return cbor_response(Output(session.id, session.epoch, start, (), False))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)

    async def set_policy(self, request: Request, sid: str) -> Response:
        session = self._session(sid)
        msg = Policy.from_cbor(request.body)
        if msg.session != session.id:
            raise problem(Kind.BAD_REQUEST, "body names another session")
        return cbor_response(session.policy(msg))

    # ------------------------------------------------------------------ after a commit

    def _on_commit(self, session: VerifierSession) -> None:
        """After every commit-log answer, in the engine (not in the request, which its
        client may have abandoned): wake output readers, tell the router, start
        self-decoding, publish KV, and let go of sessions that can no longer be served."""
        self._wake(session)
        self._touch(session.id)
        self._send_events(session)
        if session.state == State.SELF_DECODING and session.id not in self._self_tasks:
            self._self_tasks[session.id] = self._spawn(self._self_decode(session))
        if session.state == State.FENCED:
            self._spawn(self._forget_later(session))
        elif self.config.publish_kv_every and (session.round % self.config.publish_kv_every == 0 or session.closed):
            self._spawn(self._publish_kv(session))

    def _may_propose(self) -> int:
        """Sessions with no job in flight that could add one now (a drafter proposing, or
        the verifier self-decoding): the engine stops waiting for company at zero."""
        return sum(1 for s in self.sessions.values() if s.state in (State.SERVING, State.SELF_DECODING))

    def _on_refuse(self, session: VerifierSession, job, prob: Problem) -> None:
        """Remember why a request was refused, for identical retries waiting on it."""
        self._refusals[session.id] = (job.request_key, prob)
        self._wake(session)

    async def _self_decode(self, session: VerifierSession) -> None:
        """Decode the session with the target model, one round per token, until the period
        ends (self_max tokens or load above self_load) or the router assigns a drafter."""
        try:
            while True:
                job = session.next_self_job(self.engine.load)
                if job is None:
                    break
                try:
                    await self.engine.submit(session, job)
                except ProblemError as exc:
                    log.warning("session %s: self-decoding stopped: %s", session.id.hex(), exc)
                    session.end_self_decoding()
                    break
                self._send_events(session)
        finally:
            if self._self_tasks.get(session.id) is asyncio.current_task():
                del self._self_tasks[session.id]
            self._send_events(session)
            self._wake(session)

    async def _wait_for_verdict(self, session: VerifierSession, round: int, key: tuple):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s * 4
        while loop.time() < deadline:
            verdict = session.verdicts.get(round)
            if verdict is not None:
                return verdict
            if session.inflight is None or session.inflight.round != round:
                break   # refused or fenced: the retry gets the current answer
            event = self._changed.get(session.id)
            if event is None:
                break   # the session was retired meanwhile
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), 0.5)
        verdict = session.verdicts.get(round)
        if verdict is not None:
            return verdict
        refused = self._refusals.get(session.id)
        if refused is not None and refused[0] == key:
            raise ProblemError(refused[1])
        if session.state == State.FENCED:
            raise problem(Kind.STALE_EPOCH, "the commit log was fenced by a newer epoch")
        raise problem(Kind.UNAVAILABLE, f"round {round} was not committed; retry")

    def _wake(self, session: VerifierSession) -> None:
        event = self._changed.get(session.id)
        if event is not None:
            event.set()
            self._changed[session.id] = asyncio.Event()

    def _send_events(self, session: VerifierSession) -> None:
        for event in session.take_events():
            log.info("session %s: event %s at %d tokens", session.id.hex(), event.kind.name.lower(),
                     event.committed)
            if event.kind in (Action.FINISH, Action.FAIL):
                self._spawn(self._forget_later(session))
            if self.client is not None and self.config.router_uri:
                self._spawn(self._post_event(event))

    async def _post_event(self, event: Event) -> None:
        url = self.config.router_uri.rstrip("/") + "/events"
        for attempt in range(5):
            try:
                response = await self.client.request("POST", url, event.to_cbor(), idempotent=True,
                                                     timeout=self.config.request_timeout_s)
                if response.status < 500:
                    return
            except Exception as exc:
                log.warning("event to router failed (attempt %d): %s", attempt + 1, exc)
            await asyncio.sleep(0.2 * 2 ** attempt)

    async def _report_status(self) -> None:
        url = f"{self.config.router_uri.rstrip('/')}/instances/{encode_uri(self.config.uri)}/status"
        while True:
            status = Status(self.config.uri, ROLE_VERIFIER, self.engine.load, self.engine.queue_depth,
                            self.config.ttl_ms)
            try:
                await self.client.request("PUT", url, status.to_cbor(), idempotent=True,
                                          timeout=self.config.request_timeout_s)
            except Exception as exc:
                log.debug("status report failed: %s", exc)
            await asyncio.sleep(self.config.status_interval_s)

    async def _publish_kv(self, session: VerifierSession) -> None:
        """The target KV of the committed tokens, under `kv_ref`, for a verifier taking over."""
        try:
            async with self.engine.model_lock:
                blob = self.backend.export_kv(session.id)
            await self.store.put(kv_ref(session.id, session.contract.scope), blob)
        except Exception as exc:
            log.debug("publishing target KV failed: %s", exc)

    async def _forget_later(self, session: VerifierSession) -> None:
        await asyncio.sleep(self.config.closed_keep_s)
        if self.sessions.get(session.id) is session:
            self._retire(session)
            del self.sessions[session.id]

    # ------------------------------------------------------------------ helpers

    async def _drop_idle_sessions(self) -> None:
        """Bounded memory when routers and drafters vanish: a session with no request and no
        commit for idle_s is retired (its router, if it comes back, resumes from the log)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(60.0, self.config.idle_s / 4))
            now = loop.time()
            for sid, session in list(self.sessions.items()):
                if session.inflight is None and now - self._touched.get(sid, now) > self.config.idle_s:
                    log.info("session %s idle for %.0f s: dropped", sid.hex(), self.config.idle_s)
                    self._retire(session)
                    del self.sessions[sid]

    def _touch(self, sid: bytes) -> None:
        self._touched[sid] = asyncio.get_running_loop().time()

    def _session(self, sid: str) -> VerifierSession:
        session = self.sessions.get(decode_session_id(sid))
        if session is None:
            raise problem(Kind.NOT_FOUND, "no such session")
        self._touch(session.id)
        return session

    async def _tokens(self, ref_or_tokens, what: str) -> tuple[int, ...]:
        if isinstance(ref_or_tokens, tuple):
            return ref_or_tokens
        try:
            data = await self.store.get(ref_or_tokens)
            tokens = cbor.loads(data, max_size=64 << 20)
        except NotFound:
            raise problem(Kind.CONFLICT, f"{what} {ref_or_tokens!r} is not in the cache") from None
        except cbor.DecodeError as exc:
            raise problem(Kind.BAD_REQUEST, f"{what} object is not a CBOR token list: {exc}") from None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens):
            raise problem(Kind.BAD_REQUEST, f"{what} object is not a list of token ids")
        return tuple(tokens)

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
            last = CommitRecord.from_cbor(commits[-1].record)
        except ProblemError:
            raise problem(Kind.UNAVAILABLE, "the commit log's last record is unreadable") from None
        if (last.round, last.committed, last.digest) != (msg.resume.round, msg.resume.committed, msg.resume.digest):
            raise problem(Kind.CONFLICT, "resume does not match the last commit record")

    async def _prefill(self, sid: bytes, tokens: list[int], kv_ref: str | None, reopen: bool) -> None:
        async with self.engine.model_lock:
            if reopen:
                with contextlib.suppress(ModelError):
                    self.backend.release(sid)
            if kv_ref is not None:
                # target KV from the cache (resume: of the committed tokens; prompt_kv: of the
                # prompt) saves the prefill when it covers a prefix of what is committed
                try:
                    blob = await self.store.get(kv_ref)   # any cache trouble: prefill instead
                    self.backend.import_kv(sid, blob)
                    covered = self.backend.committed(sid)
                    if covered == tokens[:len(covered)]:
                        self.backend.commit(sid, tokens[len(covered):])
                        log.info("session %s: %d of %d tokens from cached KV %s", sid.hex(),
                                 len(covered), len(tokens), kv_ref)
                        return
                    self.backend.release(sid)
                except (CacheError, ModelError) as exc:
                    log.info("target KV %s unusable (%s): prefilling", kv_ref, exc)
                    with contextlib.suppress(ModelError):
                        self.backend.release(sid)
            try:
                await asyncio.to_thread(self.backend.open, sid, tokens)
            except KVCapacityError as exc:
                raise problem(Kind.UNAVAILABLE, f"no room for the session: {exc}") from None
            except ModelError as exc:
                raise problem(Kind.BAD_REQUEST, f"prompt refused by the model: {exc}") from None

    def _cancel_self_decoding(self, session: VerifierSession) -> None:
        task = self._self_tasks.pop(session.id, None)
        if task is not None:
            task.cancel()

    def _retire(self, session: VerifierSession) -> None:
        """Forget a session: its backend state and every per-session entry."""
        self._cancel_self_decoding(session)
        self._wake(session)
        with contextlib.suppress(ModelError):
            self.backend.release(session.id)
        self._changed.pop(session.id, None)
        self._refusals.pop(session.id, None)
        self._touched.pop(session.id, None)
        self.engine.log_positions.pop(session.id, None)

    def _evict_closed(self) -> None:
        for sid, session in list(self.sessions.items()):
            if session.closed:
                self._retire(session)
                del self.sessions[sid]


def encode_uri(uri: str) -> str:
    """Instance ids in router paths: the base64url of the instance's base URI."""
    return base64.urlsafe_b64encode(uri.encode()).rstrip(b"=").decode()


def kv_ref(session: bytes, scope: bytes | None = None) -> str:
    """Where a verifier publishes a session's target KV (placed under the contract's scope)."""
    return object_uri(f"target-kv/{session.hex()}", scope)
