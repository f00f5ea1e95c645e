"""The CommitLog contract (section 6.8), run against every log backend.

Backends: file (embedded), redis (Lua-enforced), redis-check (conditional append plus the
draft's read-after-append check), etcd (transactions).
"""

from __future__ import annotations

import asyncio
from asyncio import run

import pytest

from sdcp_fast.cache import (
    Append,
    CommitLog,
    Conflict,
    Fenced,
    LogEntry,
    append_batch,
    effective_commits,
    open_log,
)

LOG = "mlc:/sessions/abc/commit_log"


def enforces_fencing(spec: str) -> bool:
    return "fencing=check" not in spec


def test_append_read_positions_and_records(log_spec):
    async def body():
        log = await open_log(log_spec)
        try:
            assert isinstance(log, CommitLog)
            assert await log.read(LOG) == []
            records = [b"rec-%d" % i for i in range(5)] + [b"", bytes(range(256))]
            for i, record in enumerate(records):
                assert await log.append(LOG, record, epoch=1, expected=i) == i + 1
            entries = await log.read(LOG)
            assert entries == [LogEntry(i, "commit", 1, r) for i, r in enumerate(records)]
            assert await log.read(LOG, 5) == entries[5:]
            assert await log.read(LOG, 99) == []
            assert await log.read("mlc:/sessions/other/commit_log") == []
        finally:
            await log.close()

    run(body())


def test_conflict_reports_current_length(log_spec):
    async def body():
        log = await open_log(log_spec)
        try:
            await log.append(LOG, b"a", epoch=1, expected=0)
            await log.append(LOG, b"b", epoch=1, expected=1)
            for stale in (0, 1, 3):
                with pytest.raises(Conflict) as err:
                    await log.append(LOG, b"x", epoch=1, expected=stale)
                assert err.value.current_length == 2
            assert [e.record for e in await log.read(LOG)] == [b"a", b"b"]
            with pytest.raises(ValueError):
                await log.append(LOG, b"x", epoch=-1, expected=2)
        finally:
            await log.close()

    run(body())


def test_fence_stops_older_epoch_even_after_a_fresh_read(log_spec):
    async def body():
        old_verifier, router = await open_log(log_spec), await open_log(log_spec)
        try:
            await old_verifier.append(LOG, b"r1", epoch=1, expected=0)
            seen = len(await old_verifier.read(LOG))  # the old verifier read before the fence
            assert await router.fence(LOG, 2) == 2
            # Writer that read before the fence.
            expected_error = Fenced if enforces_fencing(log_spec) else Conflict
            with pytest.raises(expected_error) as err:
                await old_verifier.append(LOG, b"r2-old", epoch=1, expected=seen)
            if expected_error is Fenced:
                assert err.value.fence_epoch == 2
            # Writer that re-read after the fence, so its expected position is right.
            fresh = len(await old_verifier.read(LOG))
            with pytest.raises(Fenced) as err:
                await old_verifier.append(LOG, b"r2-old", epoch=1, expected=fresh)
            assert err.value.fence_epoch == 2
            entries = await router.read(LOG)
            assert [(e.kind, e.epoch, e.record) for e in effective_commits(entries)] == [
                ("commit", 1, b"r1")]
            assert entries[1] == LogEntry(1, "fence", 2, b"")
            # The new verifier (epoch 2) continues after whatever the log holds.
            new_length = await router.append(LOG, b"r2-new", epoch=2, expected=len(entries))
            assert new_length == len(entries) + 1
            commits = effective_commits(await router.read(LOG))
            assert [(c.epoch, c.record) for c in commits] == [(1, b"r1"), (2, b"r2-new")]
        finally:
            await old_verifier.close()
            await router.close()

    run(body())


def test_fence_is_idempotent_and_monotone(log_spec):
    async def body():
        log = await open_log(log_spec)
        try:
            assert await log.fence(LOG, 3) == 1
            assert await log.fence(LOG, 3) == 1  # retried fence: nothing appended
            with pytest.raises(Fenced) as err:
                await log.fence(LOG, 2)
            assert err.value.fence_epoch == 3
            await log.append(LOG, b"c", epoch=3, expected=1)
            assert await log.fence(LOG, 4) == 3  # unconditional on position
            assert [(e.kind, e.epoch) for e in await log.read(LOG)] == [
                ("fence", 3), ("commit", 3), ("fence", 4)]
            with pytest.raises(ValueError):
                await log.fence(LOG, 0)
        finally:
            await log.close()

    run(body())


def test_racing_appenders_exactly_one_wins_each_position(log_spec):
    rounds = 12

    async def writer(log: CommitLog, name: bytes) -> list[int]:
        won = []
        for position in range(rounds):
            try:
                await log.append(LOG, name + b"-%d" % position, epoch=1, expected=position)
                won.append(position)
            except Conflict as err:
                assert err.current_length > position
        return won

    async def body():
        a, b = await open_log(log_spec), await open_log(log_spec)
        try:
            # Both try every position; the loser of a position moves on to the next.
            won_a, won_b = await asyncio.gather(writer(a, b"A"), writer(b, b"B"))
            assert sorted(won_a + won_b) == list(range(rounds))
            entries = await a.read(LOG)
            assert len(entries) == rounds
            for entry in entries:
                owner = b"A" if entry.position in won_a else b"B"
                assert entry.record == owner + b"-%d" % entry.position
        finally:
            await a.close()
            await b.close()

    run(body())


def test_fence_racing_a_stale_writer(log_spec):
    """Whatever the interleaving, no epoch-1 record counts after the epoch-2 fence."""

    async def stale_writer(log: CommitLog) -> int:
        wins = 0
        for _ in range(20):
            expected = len(await log.read(LOG))
            try:
                await log.append(LOG, b"old", epoch=1, expected=expected)
                wins += 1
            except Conflict:
                continue
            except Fenced:
                return wins
        return wins

    async def body():
        writer, router = await open_log(log_spec), await open_log(log_spec)
        try:
            task = asyncio.create_task(stale_writer(writer))
            await asyncio.sleep(0)
            await router.fence(LOG, 2)
            wins = await task
            entries = await router.read(LOG)
            fence_at = next(e.position for e in entries if e.kind == "fence")
            counted = effective_commits(entries)
            assert all(c.position < fence_at for c in counted)
            assert len(counted) == wins
            with pytest.raises(Fenced):
                await writer.append(LOG, b"old", epoch=1, expected=len(entries))
        finally:
            await writer.close()
            await router.close()

    run(body())


def test_append_batch_answers_each_append_as_append_would(log_spec):
    """Group commit (`append_batch`): a batch's appends answered one by one, exactly as
    `append` answers them: the new length, or Conflict / Fenced for that log alone; a log
    named twice in a batch takes both, in order."""
    logs = [f"mlc:/sessions/batch-{n}/commit_log" for n in range(4)]

    async def body():
        log = await open_log(log_spec)
        try:
            await log.append(logs[1], b"old", epoch=1, expected=0)     # logs[1] is one long
            await log.fence(logs[2], 3)                                # logs[2] fenced at 3
            answers = await append_batch(log, [
                Append(logs[0], b"a0", 1, 0),
                Append(logs[1], b"a1", 1, 0),      # stale position
                Append(logs[2], b"a2", 1, 1),      # below the fence
                Append(logs[3], b"a3", 1, 0),
                Append(logs[0], b"b0", 1, 1),      # the same log again, after a0
            ])
            assert answers[0] == 1 and answers[3] == 1 and answers[4] == 2
            assert isinstance(answers[1], Conflict) and answers[1].current_length == 1
            if enforces_fencing(log_spec):
                assert isinstance(answers[2], Fenced) and answers[2].fence_epoch == 3
            else:   # check mode: the record may land; readers skip it, the writer was told
                assert isinstance(answers[2], Exception)
                assert effective_commits(await log.read(logs[2])) == []
            assert [e.record for e in await log.read(logs[0])] == [b"a0", b"b0"]
            assert [e.record for e in await log.read(logs[1])] == [b"old"]
            assert [e.record for e in await log.read(logs[3])] == [b"a3"]
            assert await append_batch(log, []) == []
        finally:
            await log.close()

    run(body())


class Wrapper:
    """A log wrapper that delegates by __getattr__ (as the fault tests' logs do), with an
    `append` of its own: it notes each call's (log, expected), waits `delay(expected)`
    seconds, then appends."""

    def __init__(self, inner, delay=lambda expected: 0.0):
        self.inner, self.delay, self.calls = inner, delay, []

    async def append(self, log, record, *, epoch, expected):
        self.calls.append((log, expected))
        if self.delay(expected):
            await asyncio.sleep(self.delay(expected))
        return await self.inner.append(log, record, epoch=epoch, expected=expected)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_append_batch_of_a_wrapper_goes_through_its_own_append(tmp_path):
    """A wrapper that delegates by __getattr__ (the fault tests' logs) keeps its `append`."""

    async def body():
        log = await open_log(f"file:{tmp_path}")
        try:
            wrapper = Wrapper(log)
            answers = await append_batch(wrapper, [Append("x", b"1", 1, 0), Append("y", b"2", 1, 0)])
        finally:
            await log.close()
        return answers, wrapper.calls

    answers, calls = run(body())
    assert answers == [1, 1]
    assert sorted(name for name, _ in calls) == ["x", "y"]


def test_append_batch_without_a_batched_path_keeps_a_logs_appends_in_order(tmp_path):
    """A log named twice in a batch, on a log with no batched path of its own (etcd, or a
    wrapper): the second append waits for the first, even when the store answers the first
    slowly. Run concurrently, the second reached the store first and was answered
    Conflict(0) (an intermittent failure of the etcd contract test under load)."""
    async def body():
        log = await open_log(f"file:{tmp_path}")
        try:
            slow_first = Wrapper(log, delay=lambda expected: 0.05 if expected == 0 else 0.0)   # the store is slow with it
            answers = await append_batch(slow_first, [
                Append("x", b"x0", 1, 0), Append("y", b"y0", 1, 0), Append("x", b"x1", 1, 1)])
            return answers, [e.record for e in await log.read("x")], slow_first.calls
        finally:
            await log.close()

    answers, records, started = run(body())
    assert answers == [1, 1, 2]
    assert records == [b"x0", b"x1"]
    assert started[:2] == [("x", 0), ("y", 0)]   # distinct logs still run concurrently


def test_read_spans_pages(log_spec, monkeypatch):
    """A log longer than one read page reads whole and in order, from any start (etcd pages)."""
    import sdcp_fast.cache.etcd_log as etcd_log
    monkeypatch.setattr(etcd_log, "_RANGE_PAGE", 2)

    async def body():
        log = await open_log(log_spec)
        try:
            for i in range(7):
                await log.append(LOG, b"r%d" % i, epoch=1, expected=i)
            entries = await log.read(LOG)
            assert entries == [LogEntry(i, "commit", 1, b"r%d" % i) for i in range(7)]
            assert await log.read(LOG, 3) == entries[3:]
        finally:
            await log.close()

    run(body())


def test_effective_commits_read_in_pieces_match_the_whole():
    """A follower's incremental filter (EffectiveCommits) keeps what effective_commits keeps,
    however the log is cut: a fence seen in one piece still refuses older commits after it."""
    from sdcp_fast.cache import EffectiveCommits

    log = [LogEntry(0, "commit", 1, b"a"), LogEntry(1, "fence", 2, b""), LogEntry(2, "commit", 1, b"late"),
           LogEntry(3, "commit", 2, b"b"), LogEntry(4, "fence", 3, b""), LogEntry(5, "commit", 2, b"late2"),
           LogEntry(6, "commit", 3, b"c")]
    whole = effective_commits(log)
    assert [e.record for e in whole] == [b"a", b"b", b"c"]
    for cut in range(len(log) + 1):
        for second in range(cut, len(log) + 1):
            filt = EffectiveCommits()
            pieces = filt.of(log[:cut]) + filt.of(log[cut:second]) + filt.of(log[second:])
            assert pieces == whole


@pytest.mark.parametrize("kind", ["etcd", "redis"])
def test_store_killed_and_started_again_keeps_the_log(tmp_path, kind):
    """cache.testing.EtcdProcess and RedisProcess (the fault tests' stores): SIGKILL, then a
    start on the same ports and data; an acknowledged append is still there (Redis: the
    append-only file with appendfsync always). While the store is down, a call raises
    CacheError."""
    from sdcp_fast.cache import CacheError
    from sdcp_fast.cache.testing import EtcdProcess, RedisProcess

    server = EtcdProcess(tmp_path) if kind == "etcd" else RedisProcess(tmp_path)
    server.start()
    try:
        async def append():
            log = await open_log(server.url)
            try:
                await log.append(LOG, b"kept", epoch=1, expected=0)
            finally:
                await log.close()

        async def read():
            log = await open_log(f"{server.url}?timeout_s=2")
            try:
                return await log.read(LOG)
            finally:
                await log.close()

        run(append())
        server.kill()
        with pytest.raises(CacheError):
            run(read())
        server.start()
        assert run(read()) == [LogEntry(0, "commit", 1, b"kept")]
    finally:
        server.stop()


def test_file_group_commit_on_the_loop_never_waits_for_a_lock(shm_dir):
    """A group commit on tmpfs (or measured cheap) runs on the event loop (`FileCommitLog.append_batch`);
    there a held lock is only tried: the locked log's append goes to a worker thread and
    lands once the lock is free, the others land at once, and every answer is as `append`
    would give it (a batch that runs inline answers the same as the thread's)."""
    import fcntl
    import os

    from sdcp_fast.aio import Offload
    from sdcp_fast.cache.file_log import FileCommitLog

    async def body():
        log = FileCommitLog(shm_dir)
        assert log._in_memory                              # /dev/shm: recognised, not measured
        log._in_memory = False
        log._group_cost = Offload(inline_below_s=60.0)   # whatever this machine's load: inline once measured
        try:
            assert await append_batch(log, [Append("w", b"0", 1, 0)]) == [1]   # first: in a thread, measured
            assert log._group_cost.inline(4)
            answers = await append_batch(log, [Append("x", b"x0", 1, 0), Append("y", b"y0", 1, 0),
                                               Append("x", b"x1", 1, 1), Append("y", b"stale", 1, 0)])
            assert answers[:3] == [1, 1, 2] and isinstance(answers[3], Conflict)
            fd = os.open(log.path_of("x"), os.O_RDWR)   # another holder of x's lock (a router's fence)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                batch = asyncio.ensure_future(append_batch(log, [
                    Append("x", b"x2", 1, 2), Append("y", b"y1", 1, 1), Append("x", b"x3", 1, 3)]))
                await asyncio.sleep(0.1)
                assert not batch.done()                     # x waits for its lock, not the loop:
                assert [e.record for e in await log.read("y")] == [b"y0", b"y1"]   # y landed already
                assert [e.record for e in await log.read("x")] == [b"x0", b"x1"]
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            assert await batch == [3, 2, 4]
            assert [e.record for e in await log.read("x")] == [b"x0", b"x1", b"x2", b"x3"]
        finally:
            await log.close()

    run(body())
