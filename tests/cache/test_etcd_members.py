"""The members of an etcd cluster in one spec (issue 36): `etcd://HOST:PORT,HOST:PORT,...`.
A member that cannot be reached (here: a port where nothing listens) sends the call to the
next; the commit log and the record table work as with one member. The 3-member cluster with
members killed and partitioned: tests/hosts/test_host_faults.py."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from sdcp_fast.cache import open_log, open_table
from sdcp_fast.cache.specs import BadSpec
from sdcp_fast.ports import free_port


def members(etcd_url: str) -> str:
    """A dead member first, then the live one."""
    live = etcd_url.removeprefix("etcd://")
    return f"etcd://127.0.0.1:{free_port()},{live}?prefix=/{uuid.uuid4().hex}/"


def test_log_through_members_with_one_dead(etcd_url):
    async def go():
        log = await open_log(members(etcd_url))
        try:
            assert await log.append("log/a", b"one", epoch=1, expected=0) == 1
            assert await log.append("log/a", b"two", epoch=1, expected=1) == 2
            assert [e.record for e in await log.read("log/a")] == [b"one", b"two"]
        finally:
            await log.close()
    asyncio.run(go())


def test_table_through_members_with_one_dead(etcd_url):
    async def go():
        table = await open_table(members(etcd_url))
        try:
            lease = await table.grant("https://r.test/", 5.0)
            assert await table.keepalive(lease) is not None
            await table.revoke(lease)
        finally:
            await table.close()
    asyncio.run(go())


@pytest.mark.parametrize("spec", ["etcd://a:1,b", "etcd://a:1,:2", "etcd://a:1,b:x"])
def test_every_member_needs_host_and_port(spec):
    with pytest.raises(BadSpec):
        asyncio.run(open_log(spec))
