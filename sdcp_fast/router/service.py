"""The router: places sessions, assigns drafters, handles events and failures (sections 6.1,
6.5, 6.6, 6.9), and feeds the front door with committed output.

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
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

from ..cache import Fenced, effective_commits, object_uri
from ..core import cbor
from ..core.digest import prefix_digest
from ..core.messages import (
    ROLE_DRAFTER,
    ROLE_VERIFIER,
    Action,
    Assignment,
    CommitRecord,
    Contract,
    Event,
    Output,
    Policy,
    Resume,
    Sampling,
    SessionOpen,
    SessionState,
    Status,
)
from ..core.problems import Kind, problem
from ..transport import Authorizer, ClientResponse, Request, Response, Router, TransportError
from ..verifier.service import kv_ref as target_kv_ref  # where verifiers publish target KV
from .registry import Registry
from .sessions import RouterSession

log = logging.getLogger("sdcp_fast.router")

LADDER_NAMES = {"reduce": Action.REDUCE, "switch": Action.SWITCH,
                "self_decode": Action.SELF_DECODE, "fail": Action.FAIL}


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
    self_max: int | None = 16
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


def decode_uri(text: str) -> str:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise problem(Kind.NOT_FOUND, f"{text!r} is not a base64url instance id") from None


def encode_session_id(session: bytes) -> str:
    return base64.urlsafe_b64encode(session).rstrip(b"=").decode()


def url(base: str, path: str) -> str:
    """A resource under an instance's base URI."""
    return base.rstrip("/") + "/" + path.lstrip("/")


def commit_log_name(session: bytes) -> str:
    return f"log/{session.hex()}"


class RouterService:
    def __init__(self, config: RouterConfig, backend, store, commit_log, *, client):
        self.config = config
        self.backend = backend          # the target model's tokenizer and digests
        self.store = store
        self.commit_log = commit_log
        self.client = client
        self.registry = Registry(session_load=config.session_load)
        for uri in config.verifiers:
            self.registry.add(uri, ROLE_VERIFIER)
        for uri, digest in config.drafters:
            self.registry.add(uri, ROLE_DRAFTER, digest)
        self.sessions: dict[bytes, RouterSession] = {}
        self._ops: dict[bytes, int] = {}           # session -> control steps pending
        self._background: set[asyncio.Task] = set()
        instances = {*config.verifiers, *(uri for uri, _ in config.drafters)}
        self.router = Router(authorizer=Authorizer({"status": instances,
                                                    "events": set(config.verifiers)}))
        self.router.add("PUT", "/instances/{iid}/status", self.put_status, resource="status")
        self.router.add("POST", "/events", self.post_event, resource="events")

    # ------------------------------------------------------------------ lifecycle

    async def handle(self, request: Request) -> Response:
        return await self.router.handle(request)

    async def start(self) -> None:
        self._spawn(self._monitor())

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=2)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ------------------------------------------------------------------ SDCP resources

    async def put_status(self, request: Request, iid: str) -> Response:
        uri = decode_uri(iid)
        status = Status.from_cbor(request.body)
        if request.caller != uri or status.instance != uri:
            raise problem(Kind.FORBIDDEN, "an instance reports only its own status")
        inst = self.registry.get(uri)
        expected = ROLE_DRAFTER if inst is not None and inst.role == ROLE_DRAFTER else ROLE_VERIFIER
        if inst is None or status.role != expected:
            raise problem(Kind.FORBIDDEN, f"{uri} is not a configured instance of role {status.role}")
        self.registry.report(status)
        return Response(204, content_type=None)

    async def post_event(self, request: Request) -> Response:
        event = Event.from_cbor(request.body)
        s = self.sessions.get(event.session)
        key = (event.epoch, int(event.kind), event.committed)
        if s is None or event.epoch != s.epoch or request.caller != s.verifier or key in s.seen_events:
            return Response(204, content_type=None)     # stale, foreign or a retried event
        s.seen_events.add(key)
        log.info("session %s: event %s at %d tokens", s.id.hex(), event.kind.name.lower(), event.committed)
        s.place(f"event-{event.kind.name.lower()}")
        if event.kind == Action.SWITCH:
            self._start_op(s, self._assign(s, exclude={s.drafter} if s.drafter else set(), why="switch"),
                           always=True)
        elif event.kind == Action.SELF_DECODE:
            self._start_op(s, self._assign(s, why="self-decoding ended"), always=True)
        return Response(204, content_type=None)

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
        deadline = time.monotonic() + wait_for_instances_s
        while True:
            async with s.lock:
                opened = await self._open(s, exclude=set())
            if opened:
                break
            if time.monotonic() > deadline:
                del self.sessions[sid]
                raise problem(Kind.UNAVAILABLE, "no verifier could open the session")
            await asyncio.sleep(0.2)
        self._spawn(self._read_output(s))
        self._start_op(s, self._assign(s, why="created"), always=True)
        return s

    async def update_policy(self, s: RouterSession, sampling: Sampling) -> int:
        """Section 6.6: a new profile from a round after the current one; returns from_round."""
        async with s.lock:
            if s.done:
                raise problem(Kind.SESSION_CLOSED, "the session has ended")
            _, records = await self._read_log(s)
            next_round = (records[-1].round if records else 0) + 2   # one round may be in flight
            for from_round in range(next_round, next_round + 8):
                response = await self._call("POST", url(s.verifier, f"sessions/{encode_session_id(s.id)}/policy"),
                                            Policy(s.id, from_round, sampling).to_cbor())
                if response is not None and response.status == 200:
                    break
                kind = _problem_kind(response)
                if kind == Kind.STALE_EPOCH:
                    self._verifier_lost(s, s.verifier, s.epoch, "policy")
                if kind != Kind.CONFLICT:      # CONFLICT: the session moved past from_round
                    raise problem(Kind.UNAVAILABLE, "the verifier did not take the policy")
            else:
                raise problem(Kind.UNAVAILABLE, "the session kept moving ahead of the policy")
            s.sampling, s.policy_from_round = sampling, from_round
            s.place("policy", from_round=from_round)
            if s.drafter is not None:
                # same placement: the drafter takes the new profile (the verifier already has
                # it); should that drafter refuse, any other one is placed the full way
                await self._assign_locked(s, exclude=set(), prefer=s.drafter, inform_verifier=False)
            return from_round

    # ------------------------------------------------------------------ placement steps

    def _start_op(self, s: RouterSession, coro, *, always: bool = False) -> None:
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
        self._spawn(run())

    async def _open(self, s: RouterSession, exclude: set[str], resume: Resume | None = None) -> bool:
        """session-open at a verifier chosen by load; True once one accepted it."""
        while True:
            inst = self.registry.pick_verifier(exclude)
            if inst is None:
                return False
            msg = SessionOpen(s.id, s.epoch, s.contract, s.prompt, s.commit_log, resume=resume)
            response = await self._call("POST", url(inst.uri, "sessions"), msg.to_cbor())
            if response is not None and response.status == 200:
                state = SessionState.from_cbor(response.body)
                s.verifier = inst.uri
                s.place("opened" if resume is None else "resumed", state_round=state.round)
                s.notify()
                log.info("session %s opened on %s (epoch %d, round %d)", s.id.hex(), s.verifier,
                         s.epoch, state.round)
                return True
            detail = response.problem() if response is not None else "no answer"
            log.warning("session %s: %s refused session-open: %s", s.id.hex(), inst.uri, detail)
            exclude = {*exclude, inst.uri}

    async def _assign(self, s: RouterSession, exclude: set[str] | frozenset = frozenset(),
                      why: str = "") -> None:
        async with s.lock:
            if s.done:
                return
            ok = await self._assign_locked(s, set(exclude))
            if not ok and exclude:
                # no other drafter: the same one is better than none (logged: a real fleet
                # would scale out here)
                log.warning("session %s: no other drafter for %s; keeping %s", s.id.hex(), why, exclude)
                ok = await self._assign_locked(s, set())
            s.needs_drafter = not ok and not s.done

    async def _assign_locked(self, s: RouterSession, exclude: set[str], *, prefer: str | None = None,
                             inform_verifier: bool = True) -> bool:
        """Assign a drafter (`prefer` first, then by load). `inform_verifier=False` skips
        the PUT drafter for `prefer` only, the drafter the verifier already knows; any other
        candidate is named to the verifier before it gets the assignment (6.1)."""
        for _attempt in range(4):
            if prefer is not None:
                drafter, prefer, tell_verifier = prefer, None, inform_verifier
            else:
                inst = self.registry.pick_drafter(s.contract.drafters, exclude)
                if inst is None:
                    return False
                drafter, tell_verifier = inst.uri, True
            tokens, records = await self._read_log(s)
            last = records[-1] if records else None
            digest = last.digest if last else prefix_digest(s.contract.digest, s.prompt)
            assignment = Assignment(
                s.id, s.epoch, s.contract, s.verifier, drafter, s.prompt,
                last.round if last else 0, len(tokens), digest, self.config.m_init,
                sampling=s.sampling)
            if tell_verifier:
                verifier = s.verifier
                response = await self._call(
                    "PUT", url(verifier, f"sessions/{encode_session_id(s.id)}/drafter"), assignment.to_cbor())
                if response is None or response.status != 200:
                    kind = _problem_kind(response)
                    log.warning("session %s: verifier refused the drafter (%s)", s.id.hex(),
                                kind.suffix if kind else "no answer")
                    if kind == Kind.STALE_EPOCH:
                        self._verifier_lost(s, verifier, assignment.epoch, "drafter")
                    return False   # closed, fenced, or the verifier is failing: the monitor decides
                state = SessionState.from_cbor(response.body)
                tokens, records = await self._tokens_at(s, state.committed, tokens, records)
                assignment = assignment.replace(round=state.round, committed=state.committed,
                                                digest=state.digest)
            if assignment.committed:
                assignment = assignment.replace(committed_tokens=await self._put_committed(s, tokens))
            response = await self._call("POST", url(drafter, "assignments"), assignment.to_cbor())
            if response is not None and response.status == 204:
                changed = s.drafter != drafter
                s.drafter = drafter
                s.last_progress = time.monotonic()
                if changed or tell_verifier:
                    s.place("assigned", round=assignment.round)
                log.info("session %s: drafter %s (epoch %d, round %d, committed %d)", s.id.hex(),
                         drafter, s.epoch, assignment.round, assignment.committed)
                return True
            log.warning("session %s: drafter %s refused the assignment (%s)", s.id.hex(), drafter,
                        response.problem() if response is not None else "no answer")
            exclude = {*exclude, drafter}
        return False

    def _verifier_lost(self, s: RouterSession, verifier: str | None, epoch: int, where: str) -> None:
        """The verifier answered sdcp-stale-epoch to a request of the current placement: it
        no longer serves the session (its log was fenced, or it stopped). The monitor then
        resumes the session, at that verifier too if no other takes it (6.9)."""
        if (verifier, epoch) == (s.verifier, s.epoch) and not s.resume_pending:
            log.warning("session %s: %s answered stale-epoch to %s; resuming", s.id.hex(), verifier, where)
            s.verifier_lost = True

    def needs_failover(self, s: RouterSession) -> bool:
        """Fence and resume elsewhere: the verifier's status expired, it said it lost the
        session, or an earlier failover fenced the log but could not open it anywhere yet."""
        return s.resume_pending or s.verifier_lost or not self.registry.is_live(s.verifier)

    async def _failover(self, s: RouterSession) -> None:
        """Section 6.9, verifier failure: fence, read the last record, resume elsewhere.

        The fence and the open are two steps: if no verifier opens the session, the fenced
        epoch is kept (`resume_pending`) and the next attempt only opens, even if the old
        verifier reports status again (it can no longer commit)."""
        async with s.lock:
            old = s.verifier
            if s.done or not self.needs_failover(s):
                return
            if not self.registry.live(ROLE_VERIFIER):
                return     # nowhere to go yet; the monitor tries again
            if not s.resume_pending:
                epoch = s.epoch + 1
                try:
                    await self.commit_log.fence(s.commit_log, epoch)
                except Fenced as exc:
                    log.error("session %s: log already fenced above epoch %d (%s)", s.id.hex(), epoch, exc)
                    return
                s.epoch = epoch          # from here on, output of older epochs is discarded
                s.resume_pending, s.verifier_lost = True, False
                s.notify()
            tokens, records = await self._read_log(s)
            resume = None
            if records:
                last = records[-1]
                ref = await self._put_committed(s, tokens)
                kv = target_kv_ref(s.id, s.contract.scope) if self.config.target_kv else None
                resume = Resume(last.round, last.committed, last.digest, ref, target_kv=kv)
            log.warning("session %s: verifier %s lost; epoch %d fenced, resuming at %d tokens",
                        s.id.hex(), old, s.epoch, len(tokens))
            # another verifier first; the old one (live again, or one that only lost the
            # session) when no other takes it
            others = {i.uri for i in self.registry.live(ROLE_VERIFIER)} - {old}
            if not await self._open(s, exclude={old}, resume=resume) and \
                    not await self._open(s, exclude=others, resume=resume):
                await asyncio.sleep(0.5)    # every live verifier refused: retry, not at once
                return
            s.resume_pending = False
            s.place("failover", old_verifier=old, resumed_at=len(tokens))
            if s.sampling is not None and s.policy_from_round is not None:
                from_round = max(s.policy_from_round, (records[-1].round if records else 0) + 1)
                await self._call("POST", url(s.verifier, f"sessions/{encode_session_id(s.id)}/policy"),
                                 Policy(s.id, from_round, s.sampling).to_cbor())
            if not await self._assign_locked(s, set()):
                s.needs_drafter = True

    # ------------------------------------------------------------------ the monitor

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
                if self.needs_failover(s):
                    self._start_op(s, self._failover(s))
                elif s.drafter is not None and not self.registry.is_live(s.drafter):
                    log.warning("session %s: drafter %s expired", s.id.hex(), s.drafter)
                    self._start_op(s, self._assign(s, exclude={s.drafter}, why="drafter expired"))
                elif s.needs_drafter:
                    self._start_op(s, self._assign(s, why="retry"))
                elif now - s.last_progress > self.config.stall_s:
                    log.warning("session %s: no output for %.1f s; assigning again", s.id.hex(),
                                now - s.last_progress)
                    s.last_progress = now
                    self._start_op(s, self._assign(s, why="stalled"))

    # ------------------------------------------------------------------ output

    async def _read_output(self, s: RouterSession) -> None:
        """GET output?from=n until the final output; n = tokens received, so every token is
        taken exactly once whatever fails; lower-epoch output is discarded."""
        while not s.done:
            verifier, epoch, changed = s.verifier, s.epoch, s.changed_event()
            target = url(verifier, f"sessions/{encode_session_id(s.id)}/output?from={len(s.tokens)}")
            fetch = asyncio.ensure_future(self._call("GET", target, timeout=self.config.output_timeout_s))
            woken = asyncio.ensure_future(changed.wait())
            done, _ = await asyncio.wait({fetch, woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if fetch not in done:       # placement changed (failover): ask the new verifier
                fetch.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await fetch
                continue
            response = fetch.result()
            if response is None or response.status != 200:
                if _problem_kind(response) == Kind.STALE_EPOCH:
                    self._verifier_lost(s, verifier, epoch, "output")
                await s.wait_changed(0.25)
                continue
            try:
                out = Output.from_cbor(response.body)
            except Exception as exc:
                log.warning("session %s: bad output message: %s", s.id.hex(), exc)
                await s.wait_changed(0.25)
                continue
            n = len(s.tokens)
            if out.epoch < s.epoch or out.session != s.id or out.start > n:
                # an older epoch's verifier (discarded), or nothing we can use: ask again
                # after the placement changes or a short wait, not at once
                await s.wait_changed(0.25)
                continue
            s.add_output(list(out.tokens[n - out.start:]))
            if out.final:
                s.finish = out.finish if out.finish in (Action.FINISH, Action.FAIL) else Action.FAIL
                s.finished_at = time.monotonic()
                s.place(f"final-{s.finish.name.lower()}")
                s.notify()
                log.info("session %s: %s with %d tokens", s.id.hex(), s.finish.name.lower(), len(s.tokens))

    # ------------------------------------------------------------------ helpers

    async def _call(self, method: str, url: str, body: bytes | None = None,
                    timeout: float | None = None) -> ClientResponse | None:
        try:
            return await self.client.request(method, url, body, idempotent=True,
                                             timeout=timeout or self.config.request_timeout_s)
        except TransportError as exc:
            log.info("%s %s: %s", method, url, exc)
            return None

    async def _read_log(self, s: RouterSession) -> tuple[list[int], list[CommitRecord]]:
        entries = await self.commit_log.read(s.commit_log)
        records = [CommitRecord.from_cbor(e.record) for e in effective_commits(entries)]
        return [t for r in records for t in r.emitted], records

    async def _tokens_at(self, s: RouterSession, committed: int, tokens: list[int],
                         records: list[CommitRecord]) -> tuple[list[int], list[CommitRecord]]:
        """The committed tokens up to `committed` (the verifier's answer); the log holds them
        before the verifier's state shows them, at most a read later."""
        for _ in range(50):
            if len(tokens) >= committed:
                return tokens[:committed], records
            await asyncio.sleep(0.02)
            tokens, records = await self._read_log(s)
        raise problem(Kind.CONFLICT, f"commit log holds {len(tokens)} tokens, verifier says {committed}")

    async def _put_committed(self, s: RouterSession, tokens: list[int]) -> str:
        ref = object_uri(f"committed/{s.id.hex()}/{s.epoch}/{len(tokens)}", s.contract.scope)
        await self.store.put(ref, cbor.dumps(list(tokens)), lease_ms=self.config.committed_lease_ms)
        return ref


def _problem_kind(response: ClientResponse | None) -> Kind | None:
    problem_doc = response.problem() if response is not None else None
    return problem_doc.kind if problem_doc is not None else None
