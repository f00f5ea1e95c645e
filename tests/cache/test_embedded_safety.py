"""The embedded store trusts only a private directory, never unpickles, and never writes
into a caller's buffer after a read has returned: the q-row loader reuses its buffers."""

from __future__ import annotations

import asyncio
import os
import pickle
import stat
import time
from asyncio import run

import pytest
import torch
from cache_workers import q_rows

from sdcp_fast.cache import (
    QRowsUnavailable,
    StoreTimeout,
    UnsafeDirectory,
    embedded_store,
    load_q_rows,
)
from sdcp_fast.cache.cuda_ipc import CudaIpcHandle
from sdcp_fast.cache.embedded_store import EmbeddedStore

OTHER_UID = 4242
VOCAB = 64
SLOW_S = 0.3  # a read that stalls this long, against a store timeout of a third of it


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _open_and_close(directory) -> None:
    async def body():
        store = EmbeddedStore(directory)
        await store.close()

    run(body())


def test_store_directories_are_created_private(shm_dir):
    _open_and_close(shm_dir / "store")
    assert _mode(shm_dir / "store") == 0o700 and _mode(shm_dir / "store" / "objects") == 0o700


@pytest.mark.parametrize("setup", ["other owner", "group writable", "symlink", "file"])
def test_a_directory_others_control_is_refused(shm_dir, tmp_path, setup):
    target = shm_dir / "store"
    shm_dir.mkdir(mode=0o700)
    if setup == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        target.symlink_to(tmp_path / "elsewhere")
    elif setup == "file":
        target.write_bytes(b"")
    else:
        target.mkdir(mode=0o700)
        if setup == "other owner":
            os.chown(target, OTHER_UID, OTHER_UID)
        else:
            os.chmod(target, 0o770)
    with pytest.raises(UnsafeDirectory):
        EmbeddedStore(target)
    assert not (tmp_path / "elsewhere" / "index.sqlite").exists()  # nothing written through


def test_default_parent_planted_by_another_user_is_refused(shm_dir, monkeypatch):
    shm_dir.mkdir(mode=0o755)  # as another local user would, before us
    os.chown(shm_dir, OTHER_UID, OTHER_UID)
    monkeypatch.setattr(embedded_store, "default_store_dir", lambda: shm_dir / "store")
    with pytest.raises(UnsafeDirectory):
        EmbeddedStore()
    assert not (shm_dir / "store").exists()


def test_own_directory_readable_by_others_is_tightened(shm_dir):
    shm_dir.mkdir(mode=0o700)
    os.chmod(shm_dir, 0o755)  # what earlier versions left behind: nobody else could write
    _open_and_close(shm_dir)
    assert _mode(shm_dir) == 0o700


class _Planted:
    """Unpickling this runs os.mkdir(path): what a planted index row could make a reader do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_pickled_gpu_handle_in_the_index_is_not_unpickled(shm_dir, tmp_path):
    marker = tmp_path / "pwned"

    async def body():
        store = EmbeddedStore(shm_dir)
        try:
            await asyncio.to_thread(store._put_gpu, "mlc:/g/x", torch.zeros(4),
                                    pickle.dumps(_Planted(str(marker))), 60_000)
            with store._locked():  # as if another live process had exported it
                store._db.execute("UPDATE objects SET owner = ?", (os.getppid(),))
            store._held.clear()
            with pytest.raises(Exception) as refused:
                await store.get_tensor("mlc:/g/x")
            return refused.value
        finally:
            await store.close()

    refused = run(body())
    assert not marker.exists()
    assert "malformed GPU handle" in str(refused)


def test_cuda_ipc_handle_fields_roundtrip_and_garbage_is_refused():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = (torch.Tensor, torch.Size([3, 5]), (5, 1), 7, torch.storage.TypedStorage,
            torch.float32, 0, b"\x01" * 64, 4096, 512, False, b"ref", 24, b"\x02" * 64, True)
    handle = CudaIpcHandle.from_reduction((rebuild_cuda_tensor, args))
    decoded = CudaIpcHandle.decode(handle.encode())
    assert decoded == handle
    assert (decoded.size, decoded.stride, decoded.offset, decoded.dtype, decoded.storage_kind,
            decoded.handle, decoded.event_handle) == ((3, 5), (5, 1), 7, "float32", "typed",
                                                      b"\x01" * 64, b"\x02" * 64)
    with pytest.raises(ValueError):
        CudaIpcHandle.from_reduction((pickle.loads, args))
    for garbage in (pickle.dumps(_Planted("/nonexistent/x")), b"", b"\xa0",
                    handle.encode().replace(b"float32", b"float;2")):
        with pytest.raises(ValueError):
            CudaIpcHandle.decode(garbage)


class _StallingStore(EmbeddedStore):
    """Reads of `stalled` stall in their worker thread, after the lookup, before any byte."""

    stalled = "mlc:/q/slow"

    def _open(self, uri, *args):
        opened = super()._open(uri, *args)
        if uri == self.stalled:
            time.sleep(SLOW_S)
        return opened


def test_timed_out_get_into_never_writes_afterwards(shm_dir):
    async def body():
        store = _StallingStore(shm_dir, timeout_s=SLOW_S / 3)
        try:
            await store.put(store.stalled, b"\x07" * 64)
            out = bytearray(64)
            with pytest.raises(StoreTimeout):
                await store.get_into(store.stalled, memoryview(out))
            await asyncio.sleep(2 * SLOW_S)  # a straggler thread would have written by now
            return bytes(out)
        finally:
            await store.close()

    assert run(body()) == bytes(64)


def test_failed_load_never_overwrites_a_reused_buffer_later(shm_dir):
    async def body():
        store = _StallingStore(shm_dir, timeout_s=SLOW_S / 3)
        try:
            await store.put(store.stalled, q_rows(5, 0, 2, VOCAB).numpy().tobytes())
            await store.put("mlc:/q/fast", q_rows(5, 1, 2, VOCAB).numpy().tobytes())
            buffer = torch.zeros(2, VOCAB)
            with pytest.raises(QRowsUnavailable) as failed:
                await load_q_rows(store, [(store.stalled, 2)], VOCAB, out=buffer)
            await load_q_rows(store, [("mlc:/q/fast", 2)], VOCAB, out=buffer)
            await asyncio.sleep(2 * SLOW_S)  # a straggler thread would have written by now
            return failed.value, buffer
        finally:
            await store.close()

    failed, buffer = run(body())
    assert failed.uri == "mlc:/q/slow" and failed.problem == "sdcp-q-unavailable"
    assert torch.equal(buffer, q_rows(5, 1, 2, VOCAB))


@pytest.mark.gpu
def test_failed_cuda_load_drops_the_pinned_staging_buffer(shm_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sdcp_fast.cache import qrows

    async def body():
        store = EmbeddedStore(shm_dir)
        try:
            await store.put("mlc:/q/0", q_rows(5, 0, 2, VOCAB).numpy().tobytes())
            await load_q_rows(store, [("mlc:/q/0", 2)], VOCAB, "cuda")
            used = qrows._staging
            with pytest.raises(QRowsUnavailable):
                await load_q_rows(store, [("mlc:/q/0", 2), ("mlc:/q/gone", 2)], VOCAB, "cuda")
            dropped = qrows._staging is not used
            rows = await load_q_rows(store, [("mlc:/q/0", 2)], VOCAB, "cuda")
            return used, dropped, rows.cpu()
        finally:
            await store.close()

    used, dropped, rows = run(body())
    assert used is not None and dropped
    assert torch.equal(rows, q_rows(5, 0, 2, VOCAB))
