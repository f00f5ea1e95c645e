"""The drafter service: POST assignments (Table 1), the sessions it drafts for, status reports.

    POST assignments   assignment -> 204    (routers only)

An assignment names the session's verifier, contract, prompt and committed prefix; the
drafter checks that its model is permitted and that the committed tokens it was given
(a cache reference) digest to the assignment's d[n], then runs the session's round loop
(session.py). A newer assignment for the same session (another epoch or verifier, or the
session back after a switch) replaces the old loop; one for the same placement while the
loop runs only updates the sampling profile and m_cap. Assignments for one session are
handled one at a time, so concurrent or retried ones never leave two loops.

Load figure (status.load, percent): the larger of the share of `max_sessions` in use and
the share of the last report interval the draft model was busy. queue: draft requests
waiting for the next batched step. accept_milli: EWMA of a/M over every verdict received.
cache_mbps: EWMA of the bandwidth (megabits/s) seen writing q rows and draft KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..aio import KeyedLock, TaskSet
from ..core.digest import chain, message_fingerprint, prefix_digest
from ..core.messages import ROLE_DRAFTER, Assignment, Status, Verdict
from ..core.problems import Kind, problem
from ..models.base import ModelError
from ..refs import draft_kv_ref, read_token_list
from ..reports import RouterLink, router_targets
from ..transport import Authorizer, Call, Routed, Router
from .ahead import AheadChooser
from .drafting import DraftBatcher
from .metrics import Metrics
from .session import Built, DraftSession, round_record

log = logging.getLogger("sdcp_fast.drafter")
SESSION_STATE_BYTES = 16 << 10   # a round loop's own state beyond the draft model's (q rows are leased in the cache)


@dataclass(frozen=True)
class DrafterConfig:
    uri: str                            # this drafter's base URI (its certificate's URI SAN)
    routers: frozenset[str]             # identities that may send assignments
    router_uri: str | None = None       # where status reports go
    router_uris: tuple[str, ...] = ()   # every router (several share the sessions): status
                                        # reports go to each; empty: router_uri alone
    ttl_ms: int = 2000
    status_interval_s: float = 0.5      # below ttl_ms
    max_sessions: int = 64
    memory_budget_bytes: int = 1 << 30  # session state (draft KV included) of all sessions
    max_context_tokens: int = 32768     # the longest session a reservation counts with
    max_batch: int = 32                 # sessions per draft step
    request_timeout_s: float = 5.0
    give_up_after_s: float = 10.0       # no verdict for this long (transport errors, 5xx): stop
    max_q_republish: int = 3            # sdcp-q-unavailable answers per proposal before stopping
    lease_ms: int = 30_000              # q rows: released at the verdict, or lapse
    publish_draft_kv: bool = True       # draft KV of the committed prefix, for a successor
    draft_kv_every: int = 8             # ... every this many rounds
    draft_kv_lease_ms: int = 20_000
    draft_ahead: bool = True            # prepare the next proposal during verification
    rounds_log: str | None = None       # JSON line per verdict (demo statistics, tests)
    drop_verdicts: int = 0              # test hook: discard the first N verdicts received


class DrafterService(Routed):
    def __init__(self, config: DrafterConfig, backend, store, *, client=None,
                 metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        self.backend = backend
        self.store = store
        self.client = client
        self.batcher = DraftBatcher(backend, max_batch=config.max_batch)
        self.sessions: dict[bytes, DraftSession] = {}
        self.accept = 0.7                       # EWMA of a/M, all sessions
        self.cache_mbps = 0.0                   # EWMA of observed write bandwidth
        self.lookahead_hits = 0
        self.ahead = AheadChooser()          # whether drafting ahead pays here, measured
        self._drops_left = config.drop_verdicts
        self._assignment_locks = KeyedLock()     # one assignment handler per session at a time
        self._rounds_file = open(config.rounds_log, "a") if config.rounds_log else None  # noqa: SIM115
        self.tasks = TaskSet()
        self._busy_mark = (time.perf_counter(), 0.0)
        self._load = 0
        self.metrics.watch(sessions=lambda: sum(1 for s in self.sessions.values() if s.running()),
                           load=lambda: self._load, draft_ahead=self._draft_ahead_gauge)
        self.router = Router(authorizer=Authorizer({"assignments": set(config.routers)}))
        self.router.add_message("POST", "/assignments", self.post_assignment, body=Assignment,
                                resource="assignments")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.batcher.start()
        routers = router_targets(self.config.router_uris, self.config.router_uri)
        if self.client is not None and routers:
            link = RouterLink(self.client, routers, self.config.uri,
                              timeout_s=min(self.config.request_timeout_s, self.config.ttl_ms / 1000))
            self.tasks.spawn(link.report_status_forever(self._next_status, self.config.status_interval_s))

    async def stop(self) -> None:
        await self.tasks.cancel_all()      # the session loops and the status reports
        await self.batcher.stop()
        if self._rounds_file is not None:
            self._rounds_file.close()

    # ------------------------------------------------------------------ POST assignments

    def _draft_ahead_gauge(self) -> float:
        if not self.config.draft_ahead:
            return 0.0
        chosen = self.ahead.chosen
        return -1.0 if chosen is None else float(chosen)

    async def post_assignment(self, call: Call, a: Assignment) -> None:
        if a.drafter.rstrip("/") != self.config.uri.rstrip("/"):
            raise problem(Kind.BAD_REQUEST, f"assignment names drafter {a.drafter}, not this one")
        if a.contract.drafters is not None and self.backend.digest not in a.contract.drafters:
            raise problem(Kind.BAD_CONTRACT, "the contract does not permit this drafter's model")
        if a.contract.tokenizer != self.backend.tokenizer_digest:
            raise problem(Kind.BAD_CONTRACT, "the contract's tokenizer is not this drafter's")
        # One handler per session at a time: between reading the current loop and starting
        # the new one there are awaits, and two concurrent (or retried) assignments would
        # otherwise both replace the old loop, leaving two proposals outstanding (6.2).
        async with self._assignment_locks.hold(a.session):
            await self._take_assignment(call, a)

    async def _take_assignment(self, call: Call, a: Assignment) -> None:
        prompt = await read_token_list(self.store, a.prompt, "prompt")
        output = list(await read_token_list(self.store, a.committed_tokens, "committed tokens")) \
            if a.committed else []
        if len(output) != a.committed:
            raise problem(Kind.CONFLICT, f"committed_tokens holds {len(output)} tokens, not {a.committed}")
        if chain(prefix_digest(a.contract.digest, prompt), output)[-1] != a.digest:
            raise problem(Kind.CONFLICT, "committed tokens do not digest to the assignment's digest")

        existing = self.sessions.get(a.session)
        placed_by = (a.epoch, a.router_epoch or 0)
        if existing is not None and placed_by < existing.placed_by:
            # a late assignment from an older placement (an older epoch, or a router that
            # has lost the session to another since): the newer one stands
            raise problem(Kind.STALE_EPOCH, f"the session runs at epoch {existing.epoch} under router "
                                            f"epoch {existing.placed_by[1]}")
        if existing is not None and existing.running() and existing.epoch == a.epoch \
                and existing.verifier == a.verifier.rstrip("/") and a.committed <= existing.committed:
            # same placement (a policy update, or the router re-sending): the new profile, and
            # a cap that is within the verifier's whether or not it was told again (m_init)
            existing.sampling = a.sampling or a.contract.sampling
            existing.m_cap = max(1, min(existing.m_cap, a.m_init, a.contract.m_max))
            existing.placed_by = placed_by
            return
        reserve = self.reservation(a, len(prompt))
        if existing is not None:
            await self._end(existing)
        else:
            await self._forget_stopped()
        self._check_room(reserve, replacing=existing)
        session = DraftSession(self, a, prompt, output)
        session.reserved = reserve
        self.sessions[a.session] = session
        session.task = self.tasks.spawn(session.run())
        log.info("session %s assigned by %s (epoch %d, router epoch %d, verifier %s, committed %d)",
                 a.session.hex(), call.caller, a.epoch, placed_by[1], a.verifier, a.committed)

    def reservation(self, a: Assignment, prompt: int) -> int:
        """Bytes a session holds at its longest: the draft model's state for the prompt and
        all the output the contract allows (up to max_context_tokens), and the loop's own."""
        tokens = min(self.config.max_context_tokens, prompt + a.contract.max_new + a.contract.m_max + 1)
        return SESSION_STATE_BYTES + self.backend.bytes_for(tokens)

    def _check_room(self, need: int, *, replacing: DraftSession | None) -> None:
        """A new session must fit max_sessions and the memory budget; a full drafter answers
        `capacity`, and the router assigns another drafter."""
        others = [s for s in self.sessions.values() if s is not replacing]
        if replacing is None and len(others) >= self.config.max_sessions:
            raise problem(Kind.CAPACITY, f"drafter at max_sessions={self.config.max_sessions}")
        held = sum(s.reserved for s in others)
        if held + need > self.config.memory_budget_bytes:
            raise problem(Kind.CAPACITY, f"{len(others)} sessions hold {held} of "
                                         f"{self.config.memory_budget_bytes} bytes; {need} more needed")

    async def _end(self, session: DraftSession) -> None:
        if session.task is not None and not session.task.done():
            session.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await session.task

    async def _forget_stopped(self) -> None:
        """Drop sessions whose loop ended (their KV too): bounded memory at max_sessions.

        Every stopped session leaves the table before the first await: two assignments
        arriving together both run this, and one that deleted after awaiting the other's
        release found the entry gone (KeyError, a 500 to the router)."""
        stopped = [sid for sid, session in self.sessions.items() if not session.running()]
        for sid in stopped:
            del self.sessions[sid]
        for sid in stopped:
            async with self.batcher.model_lock:
                if sid in self.sessions:
                    continue        # assigned again while we waited: the KV is the new loop's
                with contextlib.suppress(ModelError):
                    self.backend.release(sid)

    async def release_kv(self, sid: bytes) -> None:
        async with self.batcher.model_lock:
            with contextlib.suppress(ModelError):
                self.backend.release(sid)

    # ------------------------------------------------------------------ the cache

    async def put_leased(self, ref: str, data: bytes, lease_ms: int | None = None) -> None:
        started = time.perf_counter()
        await self.store.put(ref, data, lease_ms=lease_ms or self.config.lease_ms)
        seconds = max(time.perf_counter() - started, 1e-6)
        mbps = len(data) * 8 / 1e6 / seconds
        self.cache_mbps = mbps if self.cache_mbps == 0 else self.cache_mbps + 0.2 * (mbps - self.cache_mbps)

    async def publish_draft_kv(self, session: DraftSession) -> str | None:
        """The draft KV of the committed prefix, every `draft_kv_every` rounds (a successor
        drafter with the same model imports it instead of prefilling)."""
        ref = draft_kv_ref(session.id, session.contract.scope)
        if (session.round + 1) % max(1, self.config.draft_kv_every):
            return None
        async with self.batcher.model_lock:
            blob = self.backend.export_kv(session.id)
        await self.put_leased(ref, blob, self.config.draft_kv_lease_ms)
        return ref

    # ------------------------------------------------------------------ verdict bookkeeping

    def drop_verdict(self, session: DraftSession, verdict: Verdict) -> bool:
        """Test hook: drop the first `drop_verdicts` verdicts as if lost in transit."""
        if self._drops_left <= 0:
            return False
        self._drops_left -= 1
        self._write_line(f'{{"dropped":true,"session":"{session.id.hex()}","epoch":{verdict.epoch},'
                         f'"round":{verdict.round},"verdict":"{message_fingerprint(verdict)}"}}')
        log.warning("test hook: verdict of round %d dropped", verdict.round)
        return True

    def record_round(self, session: DraftSession, built: Built, verdict: Verdict) -> None:
        m = built.proposal.m
        self.accept += 0.1 * (verdict.accepted / m - self.accept)
        self._write_line(round_record(session, built, verdict, built.retries,
                                      message_fingerprint(verdict)))

    def _write_line(self, line: str) -> None:
        if self._rounds_file is not None:
            self._rounds_file.write(line + "\n")
            self._rounds_file.flush()

    # ------------------------------------------------------------------ status

    def status(self) -> Status:
        return Status(self.config.uri, ROLE_DRAFTER, self._load, self.batcher.queue_depth,
                      self.config.ttl_ms, accept_milli=max(0, min(1000, round(1000 * self.accept))),
                      cache_mbps=round(self.cache_mbps))

    def _update_load(self) -> None:
        now = time.perf_counter()
        then, busy_then = self._busy_mark
        self._busy_mark = (now, self.batcher.busy_seconds)
        busy = 100 * (self.batcher.busy_seconds - busy_then) / max(now - then, 1e-3)
        running = sum(1 for s in self.sessions.values() if s.running())
        occupancy = 100 * running / max(1, self.config.max_sessions)
        self._load = max(0, min(100, round(max(busy, occupancy))))

    def _next_status(self) -> Status:
        """The status of the next report (the load over the interval since the last one)."""
        self._update_load()
        return self.status()


def rounds_from_file(path: str | Path) -> list[dict]:
    """The JSON lines a drafter's `rounds_log` holds (for the demo and the tests)."""
    import json
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
