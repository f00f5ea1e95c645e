"""open_store / open_log specs."""

from __future__ import annotations

from asyncio import run

import pytest

from sdcp_fast.cache import BadSpec, open_log, open_store
from sdcp_fast.cache.embedded_store import EmbeddedStore, default_store_dir
from sdcp_fast.cache.etcd_log import EtcdCommitLog
from sdcp_fast.cache.file_log import FileCommitLog


@pytest.mark.parametrize("spec", ["nothing", "s3://bucket", "embedded:/x?cap_bytes=ten",
                                  "embedded:/x?color=red", "redis://h:1/0?bogus=1"])
def test_bad_store_specs(spec):
    with pytest.raises(BadSpec):
        run(open_store(spec))


@pytest.mark.parametrize("spec", ["embedded:/x", "file:/x?timeout_s=abc", "etcd://host",
                                  "redis://h:1/0?fencing=maybe"])
def test_bad_log_specs(spec):
    with pytest.raises(BadSpec):
        run(open_log(spec))


def test_spec_options_reach_the_backends(shm_dir, tmp_path):
    async def body():
        store = await open_store(f"embedded:{shm_dir}?cap_bytes=1234&timeout_s=2.5")
        assert isinstance(store, EmbeddedStore)
        assert (store.directory, store.caps["host"], store.timeout_s) == (shm_dir, 1234, 2.5)
        await store.close()
        log = await open_log(f"file://{tmp_path}/log")
        assert isinstance(log, FileCommitLog) and log.directory == tmp_path / "log"
        etcd = await open_log("etcd://127.0.0.1:2379?prefix=/p/")
        assert isinstance(etcd, EtcdCommitLog) and etcd.prefix == b"/p/"
        await etcd.close()

    run(body())
    assert str(default_store_dir()).startswith("/dev/shm/sdcp-fast-")
