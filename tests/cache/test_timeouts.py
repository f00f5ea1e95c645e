"""Every network call is bounded: a server that accepts but never answers times out; one that
is not there (refused, restarting) raises a CacheError, never the client library's own."""

from __future__ import annotations

import socket
from asyncio import run

import pytest

from sdcp_fast.cache import CacheError, StoreTimeout, open_log, open_table
from sdcp_fast.cache.redis_store import RedisStore
from sdcp_fast.ports import free_port


@pytest.fixture
def silent_port():
    """A listening socket that is never accepted from: connects succeed, replies never come."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


def test_redis_store_and_log_time_out(silent_port):
    async def body():
        store = RedisStore(f"redis://127.0.0.1:{silent_port}/0", timeout_s=0.3)
        with pytest.raises(StoreTimeout):
            await store.get("mlc:/x")
        await store.close()
        log = await open_log(f"redis://127.0.0.1:{silent_port}/0?timeout_s=0.3")
        with pytest.raises(StoreTimeout):
            await log.append("L", b"r", epoch=1, expected=0)
        await log.close()

    run(body())


def test_etcd_log_times_out_and_reports_refused_connections(silent_port):
    async def body():
        log = await open_log(f"etcd://127.0.0.1:{silent_port}?timeout_s=0.3")
        with pytest.raises(StoreTimeout):
            await log.read("L")
        await log.close()
        closed = await open_log(f"etcd://127.0.0.1:{free_port()}?timeout_s=0.3")
        with pytest.raises(CacheError):
            await closed.fence("L", 1)
        await closed.close()

    run(body())


def test_redis_store_log_and_table_report_refused_connections():
    """A Redis that is down (killed, restarting): every client raises CacheError, which the
    router's lease keepalive and table scans and the verifier's appends retry on (a raw
    redis.ConnectionError ended those loops: tests/roles/test_faults.py, Redis restarted)."""
    url = f"redis://127.0.0.1:{free_port()}/0"

    async def body():
        store = RedisStore(url, timeout_s=0.3)
        with pytest.raises(CacheError):
            await store.get("mlc:/x")
        await store.close()
        log = await open_log(f"{url}?timeout_s=0.3")
        for call in (log.append("L", b"r", epoch=1, expected=0), log.read("L"), log.fence("L", 1)):
            with pytest.raises(CacheError):
                await call
        await log.close()
        table = await open_table(url)
        with pytest.raises(CacheError):
            await table.grant("router", 2.0)
        with pytest.raises(CacheError):
            await table.scan(values=False)
        await table.close()

    run(body())
