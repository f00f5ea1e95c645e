"""The verifier's engine: many sessions' jobs, one forward pass, one kernel launch.

Jobs arrive from the service as the core's session state machine hands them out
(`submit(served, job) -> RoundResult`). A rule-2 job's q rows start moving from the cache
as soon as it is queued (`cache.QRowStager.fetch`: pinned host slots on CUDA, a GPU-tier
object through its IPC handle). The engine gathers what arrives within `max_wait_ms` (up
to `max_batch` jobs), then per batch:

1. lands the batch's q rows in one tensor on the device, on a side stream,
2. scores every job in one ragged forward pass of the backend (in a worker thread, so the
   event loop keeps taking requests, unless measured cheaper than the hop: `aio.Offload`),
   concurrently with 1; the logits stay where the model put them (on a GPU: device memory),
3. makes one `kernels.verify` launch that waits on the q rows' event (the device waits,
   not the host) and brings back only the small results (`verify_step`); on the CPU a
   launch measured cheaper than a thread hop runs on the loop (`Offload`),
4. for each job: `session.complete` -> commit-log append -> `session.commit_result`, all
   appends of the batch concurrently; only then are verdicts released and output woken.

The kernel path follows the model's device (Triton on CUDA; on the CPU the native op when
built, else the torch CPU path); SDCP_KERNELS_PATH overrides it; the choice is made at start
and logged once, with the first batch. On the CPU the same code runs, with streams and
events as no-ops (`kernels.device`). Each batch's time split (forward, q staging and how
much of it the kernel waited for, kernel, commit) is kept in `batch_times` and in the
metrics.

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
import functools
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..aio import LoopTask, Offload, within
from ..cache import Fenced
from ..cache.qrows import QFetch, QRowStager
from ..commits import RecordAppend, append_records, landed
from ..core.messages import Action, Verdict
from ..core.problems import Kind, Problem
from ..core.session import Job, State, VerifierSession
from ..kernels.device import Device
from ..kernels.dispatch import ENV_VAR as KERNELS_PATH_VAR
from . import logprobs, verify_step
from .metrics import Metrics
from .sessions import ServedSession, ServedSessions
from .speculation import SpeculationPolicy
from .target import TargetModel
from .verify_step import JobOutcome

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
    session: VerifierSession          # served.machine (read a dozen times per job: a field)
    job: Job
    future: asyncio.Future[RoundResult]
    enqueued: float = field(default_factory=time.perf_counter)
    fetch: QFetch | None = None       # its q rows on their way (rule 2)
    during_pass: bool = False         # queued while a pass ran, or in the turns that read what came meanwhile
    then: Callable[[RoundResult], None] | None = None   # called as the job is settled (Engine.enqueue)

    def settle(self, result: RoundResult) -> None:
        """The job's outcome, once: its future's result, and `then`'s call right away (a
        done-callback of the future would run a loop turn later, and the request it answers
        one turn after that)."""
        if self.future.done():
            return
        self.future.set_result(result)
        if self.then is not None:
            try:
                self.then(result)
            except Exception:   # a bug in the caller's callback: never in the way of the others
                log.exception("settling round %d failed", self.job.round)


TURNAROUND_ALPHA = 0.25   # weight of a session's latest turnaround in its average
PASS_OVER_TURNS = 3       # loop turns after a pass whose arrivals still count as during it (_pass_over)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64           # jobs per forward pass
    max_wait_ms: float = 2.0      # how long the first job of a batch waits for company (it
                                  # stops waiting once no other session could add a job)
    company_share: float = 0.5    # ... and, while a session of the last two batches has not
                                  # sent its next job, up to this share of what a batch costs
                                  # (measured): a late session joins the pass instead of
                                  # costing a pass of its own (0: max_wait_ms alone)
    batching: bool = True         # False: one job per pass (the benchmark's baseline)
    group_commit: bool = True     # False: each commit record appended alone (the benchmark's baseline)
    append_timeout_s: float = 5.0
    q_buffer_bytes: int = 256 << 20   # largest device q-row buffer kept between batches
    q_staging_bytes: int = 512 << 20  # host slots for q rows fetched ahead (pinned on CUDA)
    prefetch_q: bool | None = None    # fetch q rows when a job is queued (None: on CUDA only;
                                      # on the CPU it costs a copy and hides little)
    batch_log: str | None = None      # JSON line per batch: when it formed, whose jobs, its
                                      # time split (the timeline of bench_real --timeline)
    speculation: str = "on"           # auto | on | off: when sessions speculate (speculation.py);
                                      # the engine alone does what section 6.5 says ("on"), a
                                      # deployment's verifier plans by cost ([verifier] speculation)
    first_token: bool = False         # auto: a speculating session's first token from its
                                      # prefill's row, its drafter after it (speculation.py)


@dataclass(frozen=True)
class BatchTimes:
    """Where one batch's time went (milliseconds; device clocks on CUDA)."""

    jobs: int
    q_jobs: int            # jobs with q rows
    prefetched: int        # of those, fetched before the batch began
    forward_ms: float      # batch start -> the forward pass done (compute stream)
    q_read_ms: float       # host reads of the q rows (overlaps counted once)
    q_copy_ms: float       # copies to the device (side stream)
    q_wait_ms: float       # how long after the forward the q rows were ready: what the
                           # kernel waited for them (0 when fully hidden)
    kernel_ms: float       # the verify launch, from its start (after that wait) to its end
    commit_ms: float       # appends, follow-ups and verdicts (host)

    @property
    def q_staging_ms(self) -> float:
        return self.q_read_ms + self.q_copy_ms

    @property
    def q_hidden_share(self) -> float | None:
        """Share of the q staging that did not delay the kernel (None: no q rows)."""
        if not self.q_jobs or self.q_staging_ms <= 0:
            return None
        return max(0.0, 1.0 - self.q_wait_ms / self.q_staging_ms)


class Engine:
    def __init__(self, target: TargetModel, store, commit_log, sessions: ServedSessions, *,
                 config: EngineConfig = EngineConfig(), device: torch.device | str | None = None,
                 metrics: Metrics | None = None):
        self.target = target
        self.store = store
        self.commit_log = commit_log
        self.sessions = sessions
        self.config = config
        self.device = torch.device(device) if device is not None else target.device
        self.metrics = metrics or Metrics()
        self.kernels_path = kernels.choose_path(self.device)   # SDCP_KERNELS_PATH overrides
        self._path_reason = f"{KERNELS_PATH_VAR} set" if os.environ.get(KERNELS_PATH_VAR) else "chosen by the device"
        self._path_logged = False   # logged with the first batch: a start that fails says nothing more
        self._dev = Device(self.device)
        # on the CPU a small batch's launch takes less than the hop to the compute thread and
        # back: measured, and run on the loop when it does (Offload); a CUDA launch waits on
        # the device, so it always leaves the loop
        self._launching = Offload(compute=True) if not self._dev.is_cuda else Offload(inline_below_s=0.0)
        prefetch = config.prefetch_q
        self._prefetch = self._dev.is_cuda if prefetch is None else prefetch
        # q rows land in buffers reused across batches (batches run one at a time)
        self._stager = QRowStager(store, target.vocab_size, self._dev,
                                  host_bytes=config.q_staging_bytes, device_bytes=config.q_buffer_bytes)
        self.batch_times: deque[BatchTimes] = deque(maxlen=1024)
        self._recent: deque[set[bytes]] = deque(maxlen=2)   # sessions of the last two batches
        self._batch_s = 0.0                                 # EWMA of a batch's seconds
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self._busy = 0                                # jobs in the batch being processed
        self._in_pass = False                         # a pass runs, or its arrivals are being read
        self._passes = 0                              # passes begun
        self.load_override: int | None = None         # pins the reported load (tests, drills)
        self._loop = LoopTask(self._run, "verifier-engine")
        self._batch_file = open(config.batch_log, "a") if config.batch_log else None  # noqa: SIM115
        self.policy = SpeculationPolicy(config.speculation, first_token=config.first_token)

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
        self._loop.start()
        self._event_loop = asyncio.get_running_loop()

    # the event loop the engine runs on, kept: asyncio.get_running_loop() costs a getpid()
    # system call on Python 3.11, and the engine's per-job steps took it four times per round
    _event_loop: asyncio.AbstractEventLoop | None = None

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The running event loop (the engine's once started)."""
        return self._event_loop or asyncio.get_running_loop()

    async def stop(self) -> None:
        await self._loop.stop()
        self._event_loop = None
        if self._batch_file is not None:
            self._batch_file.close()
            self._batch_file = None
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item.fetch is not None:
                self._stager.release([item.fetch])
            item.settle(RoundResult(problem=Problem(Kind.UNAVAILABLE, "verifier stopping")))

    async def submit(self, served: ServedSession, job: Job) -> RoundResult:
        """Queue a job; resolves with what became of it."""
        return await self.enqueue(served, job)

    def enqueue(self, served: ServedSession, job: Job,
                then: Callable[[RoundResult], None] | None = None) -> asyncio.Future[RoundResult]:
        """Queue a job; the future resolves with what became of it (it is never cancelled by
        the engine: a job that cannot run gets a problem). `then(result)`, if given, is called
        as the future resolves, from the engine's own step: it must be quick and not raise
        (what it raises is logged)."""
        future: asyncio.Future[RoundResult] = self.event_loop.create_future()
        state = served.speculation
        now = time.perf_counter()
        if not job.self_decoded:
            self.policy.observe_drafted_job(state, now)
        if served.answered_at:   # how long its drafter takes to come back (the company wait's guide)
            gap = now - served.answered_at
            served.turnaround_s = gap if not served.turnaround_s else \
                served.turnaround_s + TURNAROUND_ALPHA * (gap - served.turnaround_s)
            if not job.self_decoded and not state.last_self_decoded:   # a drafter's turnaround
                self.policy.observe_turnaround(job.m, gap)
        state.last_self_decoded = job.self_decoded
        fetch = None
        if job.q_rows is not None:   # rule 2: start moving its q rows now, or at its batch
            fetch = (self._stager.fetch if self._prefetch else self._stager.deferred)(job.q_rows, job.m)
        self._queue.put_nowait(_Queued(served, served.machine, job, future, fetch=fetch,
                                       during_pass=self._in_pass, then=then))
        return future

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            if self.config.batching:
                await self._gather(batch)
            self._recent.append({item.session.id for item in batch})
            self._busy = len(batch)
            self._in_pass = True
            self._passes += 1
            try:
                await self._process(batch)
            except Exception as exc:   # a bug or a backend failure: refuse, never hang callers
                log.exception("verification batch of %d failed", len(batch))
                for item in batch:
                    self._refuse(item, Problem(Kind.UNAVAILABLE, f"verification failed: {exc}"))
            finally:
                self._busy = 0
                self._pass_over(self._passes, PASS_OVER_TURNS)

    def _pass_over(self, pass_number: int, turns: int) -> None:
        """A pass that ran on the loop held it: requests that came meanwhile are read in the
        next turn and reach `enqueue` in the one after (on uvloop and on asyncio's loop
        alike). Jobs queued until then count as having come during the pass (unless the
        next pass has begun: it keeps the mark)."""
        if pass_number != self._passes:
            return
        if turns:
            self.event_loop.call_soon(self._pass_over, pass_number, turns - 1)
        else:
            self._in_pass = False

    async def _gather(self, batch: list[_Queued]) -> None:
        """Add to `batch` the jobs that arrive while it waits for company: until its first
        job has waited `max_wait_ms` since it was queued, and while a session of the last two
        batches is still to send its next job (its drafter is building it: a session whose
        draft was refused drafts afresh while the others' proposals, drafted ahead, are
        already here), up to `company_share` of a batch's measured cost. Waiting less than a
        pass costs beats a pass of its own, and a session that does not come stops counting
        after two batches; nor is a session waited for whose drafter, by the time it has been
        taking from an answer to the next proposal, would come after the wait's end (it
        starts the next pass instead: 32 table-model sessions, answered in two groups, had
        the verifier wait out every company window for the group still drafting).

        The window is the wait of a first job that came to an idle engine, counted from its
        arrival: a job that came while a pass ran (`_Queued.during_pass`) has waited for
        that pass, where the jobs of the next one gathered, and max_wait_ms more on top of it
        only kept the verifier idle."""
        # sessions that could still add a job (those with one queued are not counted):
        # once that many more have arrived, nobody else can come, so go at once
        could_come = self.sessions.could_propose() + self._queue.qsize()
        if len(batch) - 1 >= could_come:
            return   # (one session, say): no wait, no timer
        loop = asyncio.get_running_loop()
        now = time.perf_counter()   # not loop.time(): uvloop's clock counts whole milliseconds
        first = batch[0]
        deadline = now if first.during_pass else first.enqueued + self.config.max_wait_ms / 1000
        company_deadline = now + self.config.company_share * self._batch_s
        # two turns of the loop before the wait's clock starts: requests that arrived while
        # the last batch ran are read (bytes -> request tasks) and queued (the tasks run to
        # `enqueue`); the batch's own awaits used to give them these turns
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        could_come = self.sessions.could_propose() + self._queue.qsize()
        expected = self._expected(arriving_by=company_deadline)
        seen = 0   # jobs of `batch` already taken off `expected`
        timer_for = None   # the `until` the timer was set for
        try:   # one timer for the whole wait, moved when its end changes (not one per arrival)
            async with asyncio.timeout(None) as waiting:
                while len(batch) < self.config.max_batch:
                    while self._queue.qsize() and len(batch) < self.config.max_batch:
                        batch.append(self._queue.get_nowait())
                    for item in batch[seen:]:   # the new arrivals only, not the whole batch again
                        expected.discard(item.session.id)
                    seen = len(batch)
                    if len(batch) >= self.config.max_batch or len(batch) - 1 >= could_come:
                        return   # nobody else can come
                    until = max(deadline, company_deadline) if expected else deadline
                    remaining = until - time.perf_counter()
                    if remaining <= 0:
                        return
                    if until != timer_for:
                        waiting.reschedule(loop.time() + remaining)
                        timer_for = until
                    batch.append(await self._queue.get())
        except TimeoutError:
            return

    def _expected(self, arriving_by: float = math.inf) -> set[bytes]:
        """Sessions of the last two batches that could send a job, and would by `arriving_by`
        (perf_counter) if their drafters take as long as they have been taking."""
        recent = set().union(*self._recent) if self._recent else set()
        serving = (State.SERVING, State.SELF_DECODING)
        return {sid for sid in recent
                if (record := self.sessions.get(sid)) is not None and record.machine.state in serving
                and record.answered_at + record.turnaround_s <= arriving_by}

    async def _process(self, batch: list[_Queued]) -> None:
        started, wall = time.perf_counter(), time.time()
        if not self._path_logged:
            self._path_logged = True
            log.info("verify kernels: %s path on %s (%s)", self.kernels_path, self.device, self._path_reason)
        self.metrics.hold(self.metrics.batch_size, len(batch))
        self.metrics.hold_each(self.metrics.queue_wait, [started - item.enqueued for item in batch])
        dev = self._dev
        fetches = [item.fetch for item in batch if item.fetch is not None]
        prefetched = sum(f.early for f in fetches)
        batch_began = dev.event()
        landing = asyncio.create_task(self._stager.land(fetches)) if fetches else None
        landed = kernel_done = None
        try:
            try:
                scored, logits = await self._score(batch)
                forward_done = dev.event()
            finally:
                # never leave the landing running: it writes into buffers the next batch reuses
                landed = await landing if landing is not None else None
            if not scored:
                return
            q, starts, problems = None, {}, {}
            if landed is not None:
                q = landed.q
                slot = {id(f): i for i, f in enumerate(fetches)}
                for n, (_, item) in enumerate(scored):
                    i = slot.get(id(item.fetch))
                    if i in landed.starts:
                        starts[n] = landed.starts[i]
                    elif i is not None:
                        problems[n] = Problem(Kind.Q_UNAVAILABLE, str(landed.problems[i]))
            items = [item for _, item in scored]
            jobs = [item.job for item in items]
            logits = logits.to(self.device)   # a no-op when the model runs on the engine's device

            def verify():   # in a worker thread unless measured cheaper than the hop (Offload)
                with dev.use():
                    dev.wait(landed.ready if landed is not None else None)
                    kernel_began = dev.event()
                    launched = verify_step.launch(jobs, logits, q, starts, problems, path=self.kernels_path)
                    kernel_done = dev.event()
                    outcomes = verify_step.collect(launched)
                    logprobs.score_batch(items, launched, outcomes)   # sessions that asked only
                    return outcomes, kernel_began, kernel_done

            outcomes, kernel_began, kernel_done = await self._launching.run(verify, units=len(jobs))
        finally:
            # slots and the q tensor are free once the launch that read them (else the
            # copies into them) has finished
            self._stager.release(fetches, after=kernel_done or (landed.ready if landed else None))
        t_commit = time.perf_counter()
        verdicts: list[tuple[_Queued, RoundResult]] = []
        try:
            await self._commit(items, outcomes, verdicts)
            commit_ms = (time.perf_counter() - t_commit) * 1e3
            self._record(BatchTimes(
                jobs=len(items), q_jobs=len(fetches), prefetched=prefetched,
                forward_ms=forward_done.since(batch_began),
                q_read_ms=landed.read_seconds() * 1e3 if landed else 0.0,
                q_copy_ms=landed.ready.since(landed.copies_began) if landed else 0.0,
                q_wait_ms=max(0.0, landed.ready.since(batch_began) - forward_done.since(batch_began))
                if landed else 0.0,
                kernel_ms=kernel_done.since(kernel_began), commit_ms=commit_ms), batch, wall, started)
        finally:
            # the verdicts go out once the batch is on record (a request resumes as soon as
            # its future resolves: whoever reads the batch's times then finds them)
            answered = time.perf_counter()
            for item, result in verdicts:
                item.served.answered_at = answered
                item.settle(result)

    def _record(self, times: BatchTimes, batch: list[_Queued], wall: float, started: float) -> None:
        """Keep the batch's split; the results are back, so every event has completed."""
        self.batch_times.append(times)
        seconds = (times.forward_ms + times.kernel_ms + times.commit_ms) / 1e3
        # the tokens the pass computed: a session's first round, self-decoded, reads the row
        # its prefill kept (no pass over it), and a pass of those alone is no cost point
        computed = sum(0 if item.job.self_decoded and item.job.round == 1 else item.job.m + 1 for item in batch)
        if computed:
            self.policy.observe_pass(computed, time.perf_counter() - started, self.sessions.in_play())
        self._batch_s = seconds if self._batch_s == 0 else self._batch_s + 0.2 * (seconds - self._batch_s)
        if self._batch_file is not None:
            self._batch_file.write(json.dumps({
                "t": round(wall, 4), "end": round(wall + time.perf_counter() - started, 4),
                "sessions": [item.session.id.hex() for item in batch],
                "rounds": [item.job.round for item in batch], "m": [len(item.job.tokens) for item in batch],
                "waited_ms": [round(1e3 * (started - item.enqueued), 2) for item in batch],
                "forward_ms": round(times.forward_ms, 2), "kernel_ms": round(times.kernel_ms, 2),
                "commit_ms": round(times.commit_ms, 2)}, separators=(",", ":")) + "\n")
            self._batch_file.flush()
        self.metrics.hold(self.metrics.forward_seconds, times.forward_ms / 1e3)
        self.metrics.hold(self.metrics.kernel_seconds, times.kernel_ms / 1e3)
        if times.q_jobs:
            self.metrics.hold(self.metrics.q_staging_seconds, times.q_staging_ms / 1e3)
            self.metrics.hold(self.metrics.q_wait_seconds, times.q_wait_ms / 1e3)

    async def _score(self, batch: list[_Queued]) -> tuple[list[tuple[int, _Queued]], torch.Tensor | None]:
        """One forward pass for the batch; the jobs the model cannot score are refused
        (TargetModel.score scores them one by one so that they fail alone). Returns the
        scored jobs with their index in the batch, and their logits."""
        logits, refused = await self.target.score([(item.session.id, item.job.tokens) for item in batch])
        for n, exc in refused.items():
            self._refuse(batch[n], Problem(Kind.UNAVAILABLE, f"the target model cannot score this session: {exc}"))
        return [(n, item) for n, item in enumerate(batch) if n not in refused], logits

    async def _commit(self, batch: list[_Queued], outcomes: list[JobOutcome],
                      verdicts: list[tuple[_Queued, RoundResult]]) -> None:
        """Complete every job, append the batch's records together (group commit: one
        durable write on the file log, one round trip on Redis), then settle each job (a
        committed one's result goes to `verdicts`, released by the caller)."""
        ready: list[tuple[_Queued, object, int, RecordAppend]] = []   # (item, record, accepted, append)
        load = self.load   # the same for every job of the loop (nothing is queued meanwhile)
        for item, outcome in zip(batch, outcomes, strict=True):
            if outcome.problem is not None:
                self._refuse(item, outcome.problem)
                continue
            if item.served.answered_at:   # what the round committed per second, answer to answer
                self.policy.observe_answer(item.job.self_decoded, outcome.accepted + 1,
                                           time.perf_counter() - item.served.answered_at)
            plan = None
            if not item.job.self_decoded:   # the verifier's plan for the session's next rounds
                state = item.served.speculation
                self.policy.observe_round(state, outcome.accepted, item.job.m)
                plan = self.policy.plan(state, item.session.contract.m_max)
            try:
                record = item.session.complete(item.job, outcome.accepted, outcome.extra, load, plan)
            except Exception as exc:   # a bug: that job alone is answered 503
                self._broken(item, exc)
                continue
            ready.append((item, record, outcome.accepted, RecordAppend(item.session.commit_log, record,
                                                                    item.session.epoch, item.served.log_position)))
        if not ready:
            return
        answers = await self._append_all([(item.session, append) for item, _, _, append in ready])
        # settled one by one, then the model follows the batch's rounds under one hold of
        # its lock, and the metrics take the batch at once: no task, lock or Prometheus
        # update per job (each was a sizeable share of a proposal's CPU at 32 sessions)
        on_record: list[tuple[_Queued, object, int, Verdict | None]] = []
        for (item, record, accepted, append), answer in zip(ready, answers, strict=True):
            try:
                if self._settle(item, append.expected, answer):
                    on_record.append((item, record, accepted, item.session.commit_result(True)))
                    item.served.keep_logprobs(record)   # before its output is released
            except Exception as exc:
                self._broken(item, exc)
        if not on_record:
            return
        followed = await self.target.follow_all(
            [(item.session.id, record.emitted, functools.partial(_committed_sequence, item.session))
             for item, record, _, _ in on_record])
        rounds = []
        for (item, _, accepted, verdict), failure in zip(on_record, followed, strict=True):
            if failure is not None:
                self._broken(item, failure)
                continue
            rounds.append((item.job.m, accepted, verdict.action if verdict else None))
            if verdict is not None and verdict.action == Action.SELF_DECODE:
                self.policy.moved_to_self_decoding(item.served.speculation)
            item.served.wake()
            verdicts.append((item, RoundResult(verdict=verdict, settled=True)))
        self.metrics.hold_rounds(rounds)
        self.policy.observe_committed(sum(accepted + 1 for _, accepted, _ in rounds), self.sessions.in_play())

    def _settle(self, item: _Queued, position: int, appended: str) -> bool:
        """What the log said of one job's append: True when the round is on record (the
        caller commits it: `commit_result(True)`, durable whatever follows), else the job
        is answered why not."""
        served, session, job = item.served, item.session, item.job
        if appended is _NOT_APPENDED:
            session.commit_failed()
            prob = Problem(Kind.UNAVAILABLE, "commit log unavailable; the round was not committed")
            served.refused(job, prob)
            self._fail(item, prob)
            return False
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
            return False
        served.log_position = position + 1
        return True

    async def _append_all(self, records: list[tuple]) -> list[str]:
        """Append each (session, RecordAppend) of a batch in one `append_records`:
        per record _APPENDED, _SUPERSEDED (fenced, or another record holds the position) or
        _NOT_APPENDED (store unreachable: nothing landed).

        An append that failed or timed out may still have landed (the store finished the
        write after we stopped waiting), so the answer comes from reading the log back,
        which is also the read-after-append check of section 6.8."""
        timeout = self.config.append_timeout_s
        appends = [append for _, append in records]
        started = time.perf_counter()
        try:   # the bound is set up only if the append suspends (not on a group commit made on the loop)
            answers = await within(append_records(self.commit_log, appends, group=self.config.group_commit),
                                   timeout)
        except Exception as exc:   # the batch as a whole timed out or failed: read each back
            answers = [exc] * len(appends)
        elapsed = time.perf_counter() - started
        outcomes = []
        for (session, append), answer in zip(records, answers, strict=True):
            if not isinstance(answer, Exception):
                outcomes.append(_APPENDED)
            elif isinstance(answer, Fenced):
                outcomes.append(_SUPERSEDED)
            else:   # Conflict, timeout, connection trouble: look at the log
                log.warning("session %s: append at %d failed (%s: %s); reading the log back",
                            session.id.hex(), append.expected, type(answer).__name__, answer)
                outcomes.append(None)
        self.metrics.hold(self.metrics.append_seconds, elapsed, outcomes.count(_APPENDED))   # per round
        missing = [n for n, o in enumerate(outcomes) if o is None]
        if missing:
            read_back = await asyncio.gather(*(self._read_back(*records[n]) for n in missing))
            for n, outcome in zip(missing, read_back, strict=True):
                outcomes[n] = outcome
        return outcomes

    async def _read_back(self, session, append: RecordAppend) -> str:
        try:
            entries = await asyncio.wait_for(self.commit_log.read(append.log, append.expected),
                                             self.config.append_timeout_s)
        except Exception as exc:
            log.error("session %s: commit log unreadable: %s", session.id.hex(), exc)
            return _NOT_APPENDED
        if any(e.kind == "fence" and e.epoch > session.epoch for e in entries):
            return _SUPERSEDED
        if not entries:
            return _NOT_APPENDED
        if landed(entries[0], append):
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
        item.served.answered_at = time.perf_counter()
        item.settle(RoundResult(problem=prob, settled=settled))


def _committed_sequence(session: VerifierSession) -> list[int]:
    """The session's committed tokens, prompt included: what the model is rebuilt from when
    it cannot follow a commit (built only then: it is the whole context)."""
    return [*session.prompt, *session.output_tokens]
