"""Real servers and one fixture per backend for the cache contract tests.

Redis and etcd are started once per session on free loopback ports (sdcp_fast.cache.testing);
a missing binary makes these fixtures error out, never skip. Tests are plain functions that
drive coroutines with `asyncio.run`, so every client lives and dies inside one event loop.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import redis

from sdcp_fast.cache.testing import etcd_server, redis_server

STORE_BACKENDS = ["embedded", "redis"]
LOG_BACKENDS = ["file", "redis", "redis-check", "etcd"]


@pytest.fixture(scope="session")
def redis_url():
    with redis_server() as server:
        yield server.url


@pytest.fixture(scope="session")
def etcd_url():
    with etcd_server() as server:
        yield server.url


@pytest.fixture
def shm_dir():
    """A private store directory on tmpfs, removed afterwards."""
    path = Path(f"/dev/shm/sdcp-fast-test-{uuid.uuid4().hex[:12]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def clean_redis(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory-policy", "noeviction")
    client.flushdb()
    client.close()


@pytest.fixture(params=STORE_BACKENDS)
def store_spec(request, shm_dir):
    if request.param == "embedded":
        return f"embedded:{shm_dir}"
    request.getfixturevalue("clean_redis")
    return request.getfixturevalue("redis_url")


@pytest.fixture(params=LOG_BACKENDS)
def log_spec(request, tmp_path):
    name = request.param
    if name == "file":
        return f"file:{tmp_path / 'log'}"
    if name.startswith("redis"):
        request.getfixturevalue("clean_redis")
        url = request.getfixturevalue("redis_url")
        return url + ("?fencing=check" if name == "redis-check" else "")
    url = request.getfixturevalue("etcd_url")
    return f"{url}?prefix=/test/{uuid.uuid4().hex}/"
