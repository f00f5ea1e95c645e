"""The RecordTable contract (cache/records.py), run against every backend: file (a local
directory), redis (Lua scripts, TTL keys), etcd (transactions, etcd leases).

Leases are short so that expiry is seen in the test: etcd grants at least 2 s.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from asyncio import run

import pytest

from sdcp_fast.cache import (
    Exists,
    LeaseExpired,
    NotOwner,
    RecordTable,
    open_table,
)
from sdcp_fast.cache.records import parse_stamp, stamp

pytestmark = pytest.mark.timeout(60)
TABLE_BACKENDS = ["file", "redis", "etcd"]


@pytest.fixture(params=TABLE_BACKENDS)
def table_spec(request, tmp_path):
    if request.param == "file":
        return f"file:{tmp_path / 'table'}"
    if request.param == "redis":
        request.getfixturevalue("clean_redis")
        return request.getfixturevalue("redis_url") + f"?prefix=t{uuid.uuid4().hex[:8]}"
    return request.getfixturevalue("etcd_url") + f"?prefix=/test/{uuid.uuid4().hex}/"


async def wait_expired(table, lease, key: str, timeout: float = 10.0):
    """Until the store sees `lease` ended (the record under it orphaned)."""
    deadline = time.monotonic() + timeout
    while True:
        record = await table.read(key)
        if record is not None and record.orphaned:
            return record
        assert time.monotonic() < deadline, "lease did not end"
        await asyncio.sleep(0.05)


def test_stamp_round_trip():
    assert parse_stamp(stamp(7, "abc", "https://r/")) == (7, "abc", "https://r/")
    assert stamp(9, "a", "h") < stamp(10, "a", "h")       # bytewise order is numeric order


def test_create_write_read_scan_delete(table_spec):
    async def body():
        table = await open_table(table_spec)
        try:
            assert isinstance(table, RecordTable)
            lease = await table.grant("https://r1/", 10)
            assert lease.valid() and lease.ttl_s >= 10
            assert await table.read("s1") is None
            owned = await table.create(lease, "s1", b"one")
            assert owned.token == 1
            with pytest.raises(Exists):
                await table.create(lease, "s1", b"again")
            await table.write(owned, b"two" * 1000)
            record = await table.read("s1")
            assert (record.value, record.token, record.lease, record.holder, record.orphaned) == \
                   (b"two" * 1000, 1, lease.id, "https://r1/", False)
            other = await table.create(lease, "s2", b"")
            assert [(r.key, r.value) for r in await table.scan()] == [("s1", b"two" * 1000), ("s2", b"")]
            stamps = await table.scan(values=False)           # what the router's scan reads
            assert [(r.key, r.value, r.token, r.lease, r.orphaned) for r in stamps] == \
                   [("s1", b"", 1, lease.id, False), ("s2", b"", 1, lease.id, False)]
            await table.delete(other)
            assert await table.read("s2") is None
            assert [r.key for r in await table.scan()] == ["s1"]
            with pytest.raises(NotOwner):
                await table.write(other, b"after delete")
            await table.revoke(lease)
        finally:
            await table.close()

    run(body())


def test_take_needs_the_owner_lease_ended_and_bumps_the_token(table_spec):
    async def body():
        table = await open_table(table_spec)
        try:
            a = await table.grant("https://a/", 2)
            b = await table.grant("https://b/", 10)
            owned = await table.create(a, "s", b"v1")
            record = await table.read("s")
            with pytest.raises(NotOwner):            # a is alive
                await table.take(b, record)
            record = await wait_expired(table, a, "s", timeout=a.ttl_s + 5)
            # a's lease ended: a can write nothing any more, and stays ended
            with pytest.raises(NotOwner):
                await table.write(owned, b"late")
            assert await table.keepalive(a) is None
            taken = await table.take(b, record)
            assert taken.token == 2
            with pytest.raises(NotOwner):            # the record moved on: a second take loses
                await table.take(b, record)
            await table.write(taken, b"v2")
            now = await table.read("s")
            assert (now.value, now.token, now.holder, now.orphaned) == (b"v2", 2, "https://b/", False)
            with pytest.raises(NotOwner):            # the old owner, even with a new lease
                await table.write(owned, b"zombie")
        finally:
            await table.close()

    run(body())


def test_revoke_hands_records_over_at_once(table_spec):
    async def body():
        table = await open_table(table_spec)
        try:
            a = await table.grant("https://a/", 30)
            b = await table.grant("https://b/", 30)
            owned = await table.create(a, "s", b"x")
            await table.revoke(a)
            record = await table.read("s")
            assert record.orphaned
            assert (await table.take(b, record)).token == 2
            with pytest.raises(NotOwner):            # taken, and its lease ended
                await table.write(owned, b"y")
            with pytest.raises(LeaseExpired):
                await table.create(a, "t", b"")
        finally:
            await table.close()

    run(body())


def test_keepalive_extends_the_lease(table_spec):
    async def body():
        table = await open_table(table_spec)
        try:
            lease = await table.grant("https://a/", 2)
            await table.create(lease, "s", b"x")
            end = time.monotonic() + lease.ttl_s * 2
            while time.monotonic() < end:
                renewed = await table.keepalive(lease)
                assert renewed is not None and renewed.deadline > lease.deadline - 1e-9
                lease = renewed
                assert not (await table.read("s")).orphaned
                await asyncio.sleep(lease.ttl_s / 4)
        finally:
            await table.close()

    run(body())


def test_concurrent_takes_one_winner(table_spec):
    """Several holders race to take one orphaned record: exactly one gets it."""
    async def body():
        table = await open_table(table_spec)
        try:
            dead = await table.grant("https://dead/", 30)
            await table.create(dead, "s", b"x")
            await table.revoke(dead)
            record = await table.read("s")
            takers = [await table.grant(f"https://t{n}/", 30) for n in range(6)]
            results = await asyncio.gather(*(table.take(t, record) for t in takers), return_exceptions=True)
            won = [r for r in results if not isinstance(r, Exception)]
            assert len(won) == 1 and all(isinstance(r, NotOwner) for r in results if r not in won)
            assert (await table.read("s")).token == 2
        finally:
            await table.close()

    run(body())


def _take_in_process(spec: str, key: str, n: int, out) -> None:
    async def body():
        table = await open_table(spec)
        try:
            lease = await table.grant(f"https://p{n}/", 30)
            record = await table.read(key)
            try:
                await table.take(lease, record)
                out.put(n)
            except NotOwner:
                out.put(-1)
        finally:
            await table.close()
    asyncio.run(body())


def test_file_takes_across_processes_one_winner(tmp_path):
    spec = f"file:{tmp_path / 'table'}"

    async def setup():
        table = await open_table(spec)
        dead = await table.grant("https://dead/", 30)
        await table.create(dead, "s", b"x")
        await table.revoke(dead)
    run(setup())
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_take_in_process, args=(spec, "s", n, out)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    results = [out.get(timeout=5) for _ in procs]
    assert sorted(results)[:-1] == [-1, -1, -1] and results.count(-1) == 3


def test_scan_reads_every_page(table_spec, monkeypatch):
    """A table larger than one read page scans whole (etcd pages by key, Redis by chunk)."""
    import sdcp_fast.cache.records_etcd as records_etcd
    import sdcp_fast.cache.records_redis as records_redis
    monkeypatch.setattr(records_etcd, "_PAGE", 2)
    monkeypatch.setattr(records_redis, "_CHUNK", 2)

    async def body():
        table = await open_table(table_spec)
        try:
            lease = await table.grant("https://r1/", 30)
            keys = [f"s{n}" for n in range(7)]
            for n, key in enumerate(keys):
                await table.create(lease, key, b"v%d" % n)
            assert [(r.key, r.value) for r in await table.scan()] == [(k, b"v%d" % n) for n, k in enumerate(keys)]
            assert [(r.key, r.value, r.token) for r in await table.scan(values=False)] == [(k, b"", 1) for k in keys]
            # the router skips the records it holds under its live lease: left out, unread
            held = {"s1", "s4", "s5"}
            assert [r.key for r in await table.scan(values=False, skip=held)] == [k for k in keys if k not in held]
            assert [(r.key, r.value) for r in await table.scan(skip=["s0"])] == \
                   [(k, b"v%d" % n) for n, k in enumerate(keys) if k != "s0"]
        finally:
            await table.close()

    run(body())


def test_file_lease_is_renewed_while_every_worker_thread_is_busy(tmp_path):
    """The file table's keepalive has a thread of its own: with the loop's default pool
    taken by blocked work (a router's record writes on a loaded disk), it still renews."""
    import threading

    async def body():
        table = await open_table(f"file:{tmp_path / 'table'}")
        release = threading.Event()
        blockers = [asyncio.ensure_future(asyncio.to_thread(release.wait, 30)) for _ in range(64)]
        try:
            lease = await table.grant("https://r1/", 10)
            async with asyncio.timeout(5):
                renewed = await table.keepalive(lease)
            assert renewed is not None and renewed.deadline >= lease.deadline
            assert not any(b.done() for b in blockers)      # the default pool was busy throughout
        finally:
            release.set()
            await asyncio.gather(*blockers)
            await table.close()

    run(body())
