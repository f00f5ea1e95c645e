"""Commit logs: what a timed-out append leaves behind, and bounded per-log caches."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from asyncio import run

import pytest

from sdcp_fast.cache import Conflict, StoreTimeout
from sdcp_fast.cache.etcd_log import EtcdCommitLog
from sdcp_fast.cache.file_log import FileCommitLog
from sdcp_fast.cache.lru import LruCache
from sdcp_fast.cache.redis_log import RedisCommitLog

SLOW_S = 0.3  # how long the patched step stalls, against a timeout of a third of it


def _track_append_threads(monkeypatch) -> threading.Event:
    """An event set when the (possibly abandoned) worker thread of an append returns."""
    finished = threading.Event()
    original = FileCommitLog._append_sync

    def tracked(self, *args):
        try:
            return original(self, *args)
        finally:
            finished.set()

    monkeypatch.setattr(FileCommitLog, "_append_sync", tracked)
    return finished


def test_timed_out_append_that_lands_is_read_and_blocks_the_old_position(tmp_path, monkeypatch):
    real_fdatasync = os.fdatasync

    def slow_fdatasync(fd):
        time.sleep(SLOW_S)  # the frame is written; its sync outlives the caller's patience
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    finished = _track_append_threads(monkeypatch)

    async def body():
        log = FileCommitLog(tmp_path, timeout_s=SLOW_S / 3)
        with pytest.raises(StoreTimeout):
            await log.append("L", b"first", epoch=1, expected=0)
        log.timeout_s = 10.0  # the retry below waits for the lock the straggler holds
        with pytest.raises(Conflict) as lost:
            await log.append("L", b"retry", epoch=1, expected=0)
        assert await asyncio.to_thread(finished.wait, 10.0)
        entries = await log.read("L")
        assert await log.append("L", b"second", epoch=1, expected=1) == 2
        return lost.value, entries, await log.read("L")

    lost, entries, after = run(body())
    assert lost.current_length == 1
    assert [(e.position, e.kind, e.epoch, e.record) for e in entries] == [
        (0, "commit", 1, b"first")]
    assert [e.record for e in after] == [b"first", b"second"]  # the file is intact


def test_worker_whose_caller_gave_up_before_the_write_writes_nothing(tmp_path, monkeypatch):
    original_catch_up = FileCommitLog._catch_up

    def slow_catch_up(self, log, fd):
        time.sleep(SLOW_S)  # e.g. a long queue for a worker thread, or a slow scan
        return original_catch_up(self, log, fd)

    monkeypatch.setattr(FileCommitLog, "_catch_up", slow_catch_up)
    finished = _track_append_threads(monkeypatch)

    async def body():
        log = FileCommitLog(tmp_path, timeout_s=SLOW_S / 3)
        with pytest.raises(StoreTimeout):
            await log.append("L", b"abandoned", epoch=1, expected=0)
        assert await asyncio.to_thread(finished.wait, 10.0)
        log.timeout_s = 10.0
        entries = await log.read("L")
        position = await log.append("L", b"next", epoch=1, expected=0)
        return entries, position, await log.read("L")

    entries, position, after = run(body())
    assert entries == []
    assert position == 1 and [e.record for e in after] == [b"next"]


def test_lru_cache_keeps_the_most_recently_used():
    cache: LruCache[str, int] = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent
    cache.put("c", 3)
    assert len(cache) == 2 and "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3
    assert cache.get("b", 7) == 7
    with pytest.raises(ValueError):
        LruCache(0)


CAP = 2


@pytest.fixture(params=["file", "redis-check", "etcd"])
def capped_log(request, tmp_path):
    """(log, its per-log cache) with room for CAP logs."""
    if request.param == "file":
        log = FileCommitLog(tmp_path, max_cached_logs=CAP)
        return log, log._scans
    if request.param == "redis-check":
        request.getfixturevalue("clean_redis")
        log = RedisCommitLog(request.getfixturevalue("redis_url"), server_fencing=False,
                             max_cached_logs=CAP)
        return log, log._checked
    url = request.getfixturevalue("etcd_url")
    log = EtcdCommitLog(url.replace("etcd://", "http://"), prefix=f"/test/{uuid.uuid4().hex}/",
                        max_cached_logs=CAP)
    return log, log._known


def test_per_log_cache_is_capped_and_forgotten_logs_stay_correct(capped_log):
    log, cache = capped_log
    names = [f"mlc:/session/{i}/log" for i in range(5)]

    async def body():
        try:
            for name in names:
                await log.fence(name, 1)
                assert await log.append(name, b"r0", epoch=1, expected=1) == 2
            sizes = len(cache)
            # names[0] was forgotten long ago: its state comes back from the log itself
            with pytest.raises(Conflict) as stale:
                await log.append(names[0], b"late", epoch=1, expected=1)
            await log.fence(names[0], 2)
            position = await log.append(names[0], b"r1", epoch=2, expected=3)
            return sizes, stale.value, position, await log.read(names[0])
        finally:
            await log.close()

    sizes, stale, position, entries = run(body())
    assert sizes == CAP
    assert stale.current_length == 2 and position == 4
    assert [(e.kind, e.epoch, e.record) for e in entries] == [
        ("fence", 1, b""), ("commit", 1, b"r0"), ("fence", 2, b""), ("commit", 2, b"r1")]
