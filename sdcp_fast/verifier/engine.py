"""The verifier's engine: many sessions' jobs, one forward pass, one kernel launch.

Jobs arrive from the service as the core's session state machine hands them out
(`submit(served, job) -> RoundResult`). The engine gathers what arrives within `max_wait_ms`
(up to `max_batch` jobs), then per batch:

1. starts fetching the q rows of its rule-2 jobs into one tensor on the logits' device,
2. scores every job in one ragged forward pass of the backend (in a worker thread, so the
   event loop keeps taking requests), concurrently with 1,
3. runs one `kernels.verify` over the batch,
4. for each job: `session.complete` -> commit-log append -> `session.commit_result`, all
   appends of the batch concurrently; only then are verdicts released and output woken.

A job whose q rows cannot be fetched, or whose q(x) is not positive, or whose logits hold
NaN, is refused without consuming its round; the rest of the batch goes on.

The engine reports results and nothing else: each job's `RoundResult` says whether the
round committed (its verdict), why not (a problem), and whether the commit log settled it
(appended, or refused it for good), after which the service does its after-commit work. It
shares the session table with the service (log positions, refusals, wake-ups, and how many
sessions could still add a job) and reaches the model only through `TargetModel`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from ..aio import Offload, cancel_and_wait
from ..cache import Append, Fenced, append_batch, append_each
from ..core.messages import Verdict
from ..core.problems import Kind, Problem
from ..core.session import Job
from .metrics import Metrics
from .sessions import ServedSession, ServedSessions
from .target import TargetModel
from .verify_step import JobOutcome, verify_jobs

log = logging.getLogger("sdcp_fast.verifier.engine")

# what reading the log back says of an append
_APPENDED, _SUPERSEDED, _NOT_APPENDED = "appended", "superseded", "not-appended"


@dataclass(frozen=True)
class RoundResult:
    """What became of one job."""

    verdict: Verdict | None = None    # the committed round's verdict (None: self-decoded, or not committed)
    problem: Problem | None = None    # why nothing was committed (the request's answer)
    settled: bool = False             # the commit log appended the round or refused it for good:
                                      # the service's after-commit work is due

    @property
    def committed(self) -> bool:
        return self.settled and self.problem is None


@dataclass
class _Queued:
    served: ServedSession
    job: Job
    future: asyncio.Future[RoundResult]
    enqueued: float = field(default_factory=time.perf_counter)
    index: int = 0                    # position in its batch (q-row bookkeeping)

    @property
    def session(self):
        return self.served.machine


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64           # jobs per forward pass
    max_wait_ms: float = 2.0      # how long the first job of a batch waits for company (it
                                  # stops waiting once no other session could add a job)
    batching: bool = True         # False: one job per pass (the benchmark's baseline)
    group_commit: bool = True     # False: each commit record appended alone (the benchmark's baseline)
    append_timeout_s: float = 5.0
    q_buffer_bytes: int = 256 << 20   # largest q-row buffer kept between batches


class Engine:
    def __init__(self, target: TargetModel, store, commit_log, sessions: ServedSessions, *,
                 config: EngineConfig = EngineConfig(), device: torch.device | str = "cpu",
                 metrics: Metrics | None = None):
        self.target = target
        self.store = store
        self.commit_log = commit_log
        self.sessions = sessions
        self.config = config
        self.device = torch.device(device)
        self.metrics = metrics or Metrics()
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self._busy = 0                                # jobs in the batch being processed
        self.load_override: int | None = None         # pins the reported load (tests, drills)
        # q rows land in one buffer reused across batches (batches run one at a time): a
        # fresh allocation per batch pays first-touch page faults, 5x slower on CPU
        self._q_buffer: torch.Tensor | None = None
        self._task: asyncio.Task | None = None
        self._verifying = Offload()

    # ------------------------------------------------------------------ load

    @property
    def load(self) -> int:
        """Verifier load in percent: jobs waiting plus jobs in the pass under way, relative
        to one full batch (so 100 means a full batch is already waiting behind this one)."""
        if self.load_override is not None:
            return self.load_override
        waiting = self._queue.qsize() + self._busy
        return min(100, round(100 * waiting / (2 * self.config.max_batch)))

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="verifier-engine")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if not item.future.done():
                item.future.set_result(RoundResult(problem=Problem(Kind.UNAVAILABLE, "verifier stopping")))

    async def submit(self, served: ServedSession, job: Job) -> RoundResult:
        """Queue a job; resolves with what became of it."""
        future: asyncio.Future[RoundResult] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Queued(served, job, future))
        return await future

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            if self.config.batching:
                deadline = time.perf_counter() + self.config.max_wait_ms / 1000
                # sessions that could still add a job (those with one queued are not counted):
                # once that many more have arrived, nobody else can come, so go at once
                could_come = self.sessions.could_propose() + self._queue.qsize()
                while len(batch) < self.config.max_batch:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0 and self._queue.empty():
                        break
                    if self._queue.empty() and len(batch) - 1 >= could_come:
                        break
                    try:
                        batch.append(self._queue.get_nowait() if self._queue.qsize()
                                     else await asyncio.wait_for(self._queue.get(), max(remaining, 0)))
                    except TimeoutError:
                        break
            self._busy = len(batch)
            try:
                await self._process(batch)
            except Exception as exc:   # a bug or a backend failure: refuse, never hang callers
                log.exception("verification batch of %d failed", len(batch))
                for item in batch:
                    self._refuse(item, Problem(Kind.UNAVAILABLE, f"verification failed: {exc}"))
            finally:
                self._busy = 0

    async def _process(self, batch: list[_Queued]) -> None:
        started = time.perf_counter()
        self.metrics.batch_size.observe(len(batch))
        for item in batch:
            self.metrics.queue_wait.observe(started - item.enqueued)
        vocab = self.target.vocab_size
        q_task = asyncio.create_task(self._fetch_q_rows(batch, vocab))
        try:
            t0 = time.perf_counter()
            batch, logits = await self._score(batch)
            self.metrics.forward_seconds.observe(time.perf_counter() - t0)
        finally:
            # never leave the fetch running: it writes into the buffer the next batch reuses
            q, q_starts, q_problems = await q_task
        if not batch:
            return
        t1 = time.perf_counter()
        # q rows were fetched for the batch as it came; renumber for the jobs still in it
        starts = {n: q_starts[item.index] for n, item in enumerate(batch) if item.index in q_starts}
        problems = {n: q_problems[item.index] for n, item in enumerate(batch) if item.index in q_problems}
        outcomes = await self._verifying.run(   # in a thread unless measured cheaper than the hop
            verify_jobs, [item.job for item in batch], logits.to(self.device), q, starts, problems,
            units=len(batch))
        self.metrics.kernel_seconds.observe(time.perf_counter() - t1)
        await self._commit(batch, outcomes)

    async def _score(self, batch: list[_Queued]) -> tuple[list[_Queued], torch.Tensor | None]:
        """One forward pass for the batch; the jobs the model cannot score are refused
        (TargetModel.score scores them one by one so that they fail alone)."""
        for n, item in enumerate(batch):
            item.index = n
        logits, refused = await self.target.score([(item.session.id, item.job.tokens) for item in batch])
        for n, exc in refused.items():
            self._refuse(batch[n], Problem(Kind.UNAVAILABLE, f"the target model cannot score this session: {exc}"))
        return [item for n, item in enumerate(batch) if n not in refused], logits

    async def _fetch_q_rows(self, batch: list[_Queued], vocab: int):
        """One [sum M, V] tensor for the rule-2 jobs; a job whose rows fail is refused alone."""
        from ..cache.qrows import QRowsUnavailable, load_q_rows

        wanted = [(n, item.job) for n, item in enumerate(batch) if item.job.q_rows is not None]
        problems: dict[int, Problem] = {}
        while wanted:
            refs = [(job.q_rows, job.m) for _, job in wanted]
            try:
                q = await load_q_rows(self.store, refs, vocab, self.device,
                                      out=self._q_rows_buffer(sum(m for _, m in refs), vocab))
            except QRowsUnavailable as exc:
                # reads that timed out may still land in the buffer later: never reuse it
                self._q_buffer = None
                failed = [n for n, job in wanted if job.q_rows == exc.uri]
                for n in failed:
                    problems[n] = Problem(Kind.Q_UNAVAILABLE, str(exc))
                wanted = [(n, job) for n, job in wanted if n not in failed]
                if not failed:   # cannot tell which: refuse them all
                    for n, _ in wanted:
                        problems[n] = Problem(Kind.Q_UNAVAILABLE, str(exc))
                    wanted = []
                continue
            starts, offset = {}, 0
            for n, job in wanted:
                starts[n] = offset
                offset += job.m
            return q, starts, problems
        return None, {}, problems

    def _q_rows_buffer(self, rows: int, vocab: int) -> torch.Tensor:
        buf = self._q_buffer
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab:
            buf = torch.empty(max(rows, 64), vocab, dtype=torch.float32, device=self.device)
            # keep it for the next batch only while it is of a bounded size
            self._q_buffer = buf if buf.numel() * 4 <= self.config.q_buffer_bytes else None
        return buf

    async def _commit(self, batch: list[_Queued], outcomes: list[JobOutcome]) -> None:
        """Complete every job, append the batch's records together (group commit: one
        durable write on the file log, one round trip on Redis), then settle each job."""
        ready: list[tuple[_Queued, object, int, bytes, int]] = []   # (item, record, accepted, data, position)
        for item, outcome in zip(batch, outcomes, strict=True):
            if outcome.problem is not None:
                self._refuse(item, outcome.problem)
                continue
            try:
                record = item.session.complete(item.job, outcome.accepted, outcome.extra, self.load)
            except Exception as exc:   # a bug: that job alone is answered 503
                self._broken(item, exc)
                continue
            ready.append((item, record, outcome.accepted, record.to_cbor(), item.served.log_position))
        if not ready:
            return
        answers = await self._append_all([(item.session, data, position) for item, _, _, data, position in ready])
        results = await asyncio.gather(*(self._settle(item, record, accepted, position, answer)
                                         for (item, record, accepted, _, position), answer in zip(ready, answers,
                                                                                                  strict=True)),
                                       return_exceptions=True)
        for (item, *_), result in zip(ready, results, strict=True):
            if isinstance(result, Exception):
                self._broken(item, result)

    async def _settle(self, item: _Queued, record, accepted: int, position: int, appended: str) -> None:
        """What the log said of one job's append: its verdict, or why there is none."""
        served, session, job = item.served, item.session, item.job
        if appended is _NOT_APPENDED:
            session.commit_failed()
            prob = Problem(Kind.UNAVAILABLE, "commit log unavailable; the round was not committed")
            served.refused(job, prob)
            self._fail(item, prob)
            return
        if appended is _SUPERSEDED:
            # a newer epoch fenced the log, or it holds a record this verifier did not
            # write at this position (possibly its own from an attempt whose ack was lost):
            # it may never again commit or release output here. The router notices (output
            # and assignments answer sdcp-stale-epoch) and resumes the session from the log,
            # which is the one source of truth, whichever record it holds.
            log.warning("session %s: commit of round %d refused by the log; no longer served",
                        session.id.hex(), job.round)
            session.commit_result(False)
            self.metrics.fenced.inc()
            served.wake()
            self._fail(item, Problem(Kind.STALE_EPOCH, "the commit log was fenced by a newer epoch"),
                       settled=True)
            return
        served.log_position = position + 1
        verdict = session.commit_result(True)   # durable: the round stands whatever follows
        await self.target.follow(session.id, record.emitted, [*session.prompt, *session.output_tokens])
        self.metrics.committed(job.m, accepted, verdict.action if verdict else None)
        served.wake()
        if not item.future.done():
            item.future.set_result(RoundResult(verdict=verdict, settled=True))

    async def _append_all(self, records: list[tuple]) -> list[str]:
        """Append each (session, record bytes, position) of a batch in one `append_batch`:
        per record _APPENDED, _SUPERSEDED (fenced, or another record holds the position) or
        _NOT_APPENDED (store unreachable: nothing landed).

        An append that failed or timed out may still have landed (the store finished the
        write after we stopped waiting), so the answer comes from reading the log back,
        which is also the read-after-append check of section 6.8."""
        timeout = self.config.append_timeout_s
        appends = [Append(session.commit_log, data, session.epoch, position) for session, data, position in records]
        started = time.perf_counter()
        try:
            batched = append_batch if self.config.group_commit else append_each
            answers = await asyncio.wait_for(batched(self.commit_log, appends), timeout)
        except Exception as exc:   # the batch as a whole timed out or failed: read each back
            answers = [exc] * len(appends)
        elapsed = time.perf_counter() - started
        outcomes = []
        for (session, _data, position), answer in zip(records, answers, strict=True):
            if not isinstance(answer, Exception):
                self.metrics.append_seconds.observe(elapsed)
                outcomes.append(_APPENDED)
            elif isinstance(answer, Fenced):
                outcomes.append(_SUPERSEDED)
            else:   # Conflict, timeout, connection trouble: look at the log
                log.warning("session %s: append at %d failed (%s: %s); reading the log back",
                            session.id.hex(), position, type(answer).__name__, answer)
                outcomes.append(None)
        missing = [n for n, o in enumerate(outcomes) if o is None]
        read_back = await asyncio.gather(*(self._read_back(*records[n]) for n in missing))
        for n, outcome in zip(missing, read_back, strict=True):
            outcomes[n] = outcome
        return outcomes

    async def _read_back(self, session, data: bytes, position: int) -> str:
        try:
            entries = await asyncio.wait_for(self.commit_log.read(session.commit_log, position),
                                             self.config.append_timeout_s)
        except Exception as exc:
            log.error("session %s: commit log unreadable: %s", session.id.hex(), exc)
            return _NOT_APPENDED
        if any(e.kind == "fence" and e.epoch > session.epoch for e in entries):
            return _SUPERSEDED
        if not entries:
            return _NOT_APPENDED
        first = entries[0]
        if first.kind == "commit" and first.epoch == session.epoch and first.record == data:
            return _APPENDED
        return _SUPERSEDED

    def _broken(self, item: _Queued, exc: BaseException) -> None:
        """A bug in one job's commit: that job alone is answered 503."""
        log.error("commit of round %d failed", item.job.round, exc_info=exc)
        self._fail(item, Problem(Kind.UNAVAILABLE, f"commit failed: {exc}"))

    def _refuse(self, item: _Queued, prob: Problem) -> None:
        if item.session.inflight is item.job:
            try:
                item.session.refuse(item.job, prob)
            except Exception:   # the job already left VERIFYING (a failure mid-commit)
                log.exception("could not roll back round %d", item.job.round)
        item.served.refused(item.job, prob)
        self._fail(item, prob)

    def _fail(self, item: _Queued, prob: Problem, *, settled: bool = False) -> None:
        self.metrics.problem(prob.kind)
        if not item.future.done():
            item.future.set_result(RoundResult(problem=prob, settled=settled))
