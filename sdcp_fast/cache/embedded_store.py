"""The embedded object store: shared memory on one machine, nothing to install.

Every process that opens the same directory (default `/dev/shm/sdcp-fast-<uid>/store`)
sees the same objects:

- Host tier: each object is one file under `objects/` on tmpfs. A put writes a private
  temp file first and renames it into place under the index lock, so a reader never sees a
  half-written object; a reader opens the file under the lock and reads it after releasing
  it (an unlinked file stays readable through an open descriptor).
- GPU tier (`put_tensor` of a CUDA tensor, CUDA present): the object stays in the writer's
  device memory and the index holds its CUDA IPC handle, so a co-located verifier maps it
  without a trip through the host (`get_tensor`). The writing process keeps the allocation
  alive (CUDA IPC requires it) and drops it once the index no longer lists it.
- Index: one small SQLite table (uri, tier, size, file or IPC handle, owner pid,
  last access, lease end) whose every transaction runs under an exclusive `flock` on
  `index.lock`, so eviction, rename and index update are one atomic step across processes.
  Both tiers share this bookkeeping (LRU, leases, expiry); only where bytes live differs.
- Leases: a leased object is never evicted; when its lease ends (expiry or `release`) it is
  gone. Unleased objects are evicted least-recently-used first when a put would exceed the
  tier's byte cap; if leased objects alone fill it, the put raises `StoreFull`.
- Trust: the index decides which files a reader opens and which device memory it maps, so
  the store directory (and, by default, its parent `/dev/shm/sdcp-fast-<uid>`) must be a real
  directory owned by this user that no one else can write to: it is created 0700, a
  symlink, another owner or group/other write access is refused (`UnsafeDirectory`), and
  an own directory that others can only read is tightened to 0700. IPC handles are stored as
  plain CBOR fields (`cuda_ipc.py`), never pickled.
- `get_into(uri, out)` never writes into `out` after it returns or raises: a read that
  times out stops before its next chunk and the call waits for it, so the caller may reuse
  `out` at once. A timed-out `put` may still land (the file is renamed under the lock).
- Clock: `time.monotonic()` (CLOCK_MONOTONIC is system-wide on Linux, so every process
  agrees, and wall-clock jumps do not end leases).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .api import DEFAULT_TIMEOUT_S, check_lease
from .cuda_ipc import CudaIpcHandle
from .errors import CacheError, NotFound, SizeMismatch, StoreFull, StoreTimeout, UnsafeDirectory

DEFAULT_CAP_BYTES = 2 << 30
DEFAULT_GPU_CAP_BYTES = 4 << 30
READ_CHUNK_BYTES = 4 << 20  # get_into checks for an abandoned read between chunks
HOST, GPU = "host", "gpu"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    uri TEXT PRIMARY KEY,
    tier TEXT NOT NULL,          -- 'host' (file on tmpfs) or 'gpu' (CUDA IPC handle)
    size INTEGER NOT NULL,       -- bytes
    file TEXT,                   -- host tier: file name under objects/
    handle BLOB,                 -- gpu tier: CUDA IPC handle fields (CBOR, cuda_ipc.py)
    owner INTEGER NOT NULL,      -- pid of the writer (gpu tier: keeps the memory alive)
    last_access REAL NOT NULL,   -- monotonic seconds, for LRU
    lease_until REAL             -- monotonic seconds; NULL: not leased (evictable)
);
CREATE INDEX IF NOT EXISTS objects_lru ON objects (tier, lease_until, last_access);
"""


def default_store_dir() -> Path:
    return Path(f"/dev/shm/sdcp-fast-{os.getuid()}/store")


class EmbeddedStore:
    """`ObjectStore` in shared memory; see the module docstring for the guarantees."""

    def __init__(self, directory: str | os.PathLike | None = None, *,
                 cap_bytes: int = DEFAULT_CAP_BYTES, gpu_cap_bytes: int = DEFAULT_GPU_CAP_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if directory:
            self.directory = Path(directory)
            self.directory.parent.mkdir(parents=True, exist_ok=True)  # the operator's choice
        else:
            self.directory = default_store_dir()
            private_directory(self.directory.parent)  # predictable name in a shared /dev/shm
        self.objects_dir = self.directory / "objects"
        # Private to this user: q rows and KV are session data, and the index is trusted.
        private_directory(self.directory)
        private_directory(self.objects_dir)
        self.caps = {HOST: cap_bytes, GPU: gpu_cap_bytes}
        self.timeout_s = timeout_s
        self._thread_lock = threading.Lock()  # flock does not exclude threads of one process
        self._closed = False
        self._lock_fd = os.open(self.directory / "index.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._db = sqlite3.connect(self.directory / "index.sqlite", timeout=timeout_s,
                                   isolation_level=None, check_same_thread=False)
        self._held: dict[str, object] = {}  # gpu tier: uri -> tensor this process exports
        self._db.execute("PRAGMA synchronous=OFF")  # tmpfs: nothing to sync to
        with _IndexLock(self._thread_lock, self._lock_fd, None, timeout_s):
            self._db.executescript(_SCHEMA)
        with self._locked():
            self._remove_leftovers()

    # -- ObjectStore ----------------------------------------------------------------------

    async def put(self, uri: str, data: bytes | memoryview, lease_ms: int | None = None) -> None:
        check_lease(lease_ms)
        await self._run(self._put_host, uri, memoryview(data).cast("B"), lease_ms)

    async def get(self, uri: str) -> bytes:
        return await self._run(self._get_bytes, uri)

    async def get_many(self, uris: Sequence[str]) -> list[bytes]:
        return await self._bounded(asyncio.gather(*(asyncio.to_thread(self._get_bytes, u)
                                                    for u in uris)))

    async def get_into(self, uri: str, out: memoryview) -> None:
        """Read the object straight into `out` (no intermediate bytes); sizes must match.

        Never writes into `out` after returning or raising: on timeout (or cancellation) the
        worker thread is told to stop before its next chunk and this waits for it, so the
        caller may reuse `out` at once (load_q_rows relies on it).
        """
        handoff = _Handoff()
        deadline = time.monotonic() + self.timeout_s
        worker = asyncio.ensure_future(
            asyncio.to_thread(self._get_into, uri, out, handoff, deadline))
        try:
            await asyncio.wait_for(asyncio.shield(worker), self.timeout_s)
        except TimeoutError as exc:
            raise StoreTimeout(f"embedded store read exceeded {self.timeout_s}s") from exc
        finally:
            if not worker.done() and handoff.abandon():
                # Running: it stops before its next chunk (at most READ_CHUNK_BYTES away).
                # Queued: it will return without touching `out`; no need to wait.
                await asyncio.wait([worker])
            if worker.done() and not worker.cancelled():
                worker.exception()  # retrieved: an abandoned read's error is not news

    async def renew(self, uri: str, lease_ms: int) -> None:
        check_lease(lease_ms)
        await self._run(self._renew, uri, lease_ms)

    async def release(self, uri: str) -> None:
        await self._run(self._drop, uri)

    async def delete(self, uri: str) -> None:
        await self._run(self._drop, uri)

    async def close(self) -> None:
        # Operations still running in worker threads (a caller that gave up on them, say)
        # hold the index lock; closing the SQLite handle or the lock fd under them crashes
        # the interpreter, so wait for them first.
        if self._closed:
            return
        acquired = await asyncio.to_thread(self._thread_lock.acquire, True, self.timeout_s)
        try:
            self._closed = True
            self._held.clear()
            self._db.close()
            os.close(self._lock_fd)
        finally:
            if acquired:
                self._thread_lock.release()

    # -- GPU tier -------------------------------------------------------------------------

    async def put_tensor(self, uri: str, tensor, lease_ms: int | None = None) -> None:
        """Store a tensor's bytes; a CUDA tensor stays in device memory (GPU tier)."""
        check_lease(lease_ms)
        tensor = tensor.contiguous()
        if not tensor.is_cuda:
            raw = memoryview(_byte_view(tensor).numpy())
            await self.put(uri, raw, lease_ms)
            return
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        # Readers in other processes see only what the device has finished writing.
        torch.cuda.current_stream(tensor.device).synchronize()
        handle = CudaIpcHandle.from_reduction(reduce_tensor(tensor)).encode()
        await self._run(self._put_gpu, uri, tensor, handle, lease_ms)

    async def get_tensor(self, uri: str):
        """A GPU-tier object as the exporter's CUDA tensor (mapped by IPC), else None."""
        return await self._run(self._get_gpu, uri)

    # -- worker-thread parts --------------------------------------------------------------

    async def _run(self, fn, *args):
        return await self._bounded(asyncio.to_thread(fn, *args))

    async def _bounded(self, awaitable):
        try:
            return await asyncio.wait_for(awaitable, self.timeout_s)
        except TimeoutError as exc:
            raise StoreTimeout(f"embedded store operation exceeded {self.timeout_s}s") from exc

    def _locked(self, deadline: float | None = None):
        if self._closed:
            raise CacheError("embedded store is closed")
        timeout_s = self.timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        return _IndexLock(self._thread_lock, self._lock_fd, self._db, timeout_s)

    def _put_host(self, uri: str, data: memoryview, lease_ms: int | None) -> None:
        if data.nbytes > self.caps[HOST]:
            raise StoreFull(f"{data.nbytes} bytes exceed the host cap of {self.caps[HOST]}")
        name = f"{hashlib.sha256(uri.encode()).hexdigest()[:32]}-{secrets.token_hex(4)}"
        tmp = self.objects_dir / f".tmp-{os.getpid()}-{name}"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            with self._locked():
                self._admit(HOST, uri, data.nbytes)
                os.rename(tmp, self.objects_dir / name)
                self._upsert(uri, HOST, data.nbytes, name, None, lease_ms)
                self._forget_dropped_gpu_objects()  # expiry may have ended GPU objects
        finally:
            tmp.unlink(missing_ok=True)

    def _put_gpu(self, uri: str, tensor, handle: bytes, lease_ms: int | None) -> None:
        size = tensor.numel() * tensor.element_size()
        if size > self.caps[GPU]:
            raise StoreFull(f"{size} bytes exceed the GPU cap of {self.caps[GPU]}")
        with self._locked():
            self._admit(GPU, uri, size)
            self._upsert(uri, GPU, size, None, handle, lease_ms)
            self._held[uri] = tensor
            self._forget_dropped_gpu_objects()  # eviction or expiry ended some

    def _admit(self, tier: str, uri: str, size: int) -> None:
        """Make room for `size` bytes in `tier` (under the lock): expire, then evict LRU."""
        now = time.monotonic()
        self._purge("lease_until IS NOT NULL AND lease_until <= ?", (now,))
        used = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM objects "
                                "WHERE tier = ? AND uri != ?", (tier, uri)).fetchone()[0]
        excess = used + size - self.caps[tier]
        if excess <= 0:
            return
        victims, freed = [], 0
        for victim, victim_size in self._db.execute(
                "SELECT uri, size FROM objects WHERE tier = ? AND uri != ? AND "
                "lease_until IS NULL ORDER BY last_access", (tier, uri)):
            victims.append(victim)
            freed += victim_size
            if freed >= excess:
                break
        if freed < excess:
            raise StoreFull(f"{tier} tier: leased objects leave no room for {size} bytes")
        for victim in victims:
            self._purge("uri = ?", (victim,))

    def _upsert(self, uri, tier, size, file, handle, lease_ms) -> None:
        now = time.monotonic()
        lease_until = now + lease_ms / 1000 if lease_ms is not None else None
        self._purge("uri = ?", (uri,))
        self._db.execute("INSERT INTO objects VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (uri, tier, size, file, handle, os.getpid(), now, lease_until))

    def _purge(self, where: str, args: tuple) -> None:
        """Delete matching rows and their host files (under the lock)."""
        rows = self._db.execute(f"SELECT file FROM objects WHERE {where}", args).fetchall()
        if not rows:
            return
        self._db.execute(f"DELETE FROM objects WHERE {where}", args)
        for (file,) in rows:
            if file:
                (self.objects_dir / file).unlink(missing_ok=True)

    def _remove_leftovers(self) -> None:
        """Files a crashed writer left: temp files of dead pids, files the index lost."""
        listed = {f for (f,) in self._db.execute("SELECT file FROM objects WHERE file "
                                                 "IS NOT NULL")}
        for path in self.objects_dir.iterdir():
            if path.name.startswith(".tmp-"):
                pid = path.name.split("-")[1]
                if pid.isdigit() and not _alive(int(pid)):
                    path.unlink(missing_ok=True)
            elif path.name not in listed:
                path.unlink(missing_ok=True)

    def _lookup(self, uri: str) -> tuple:
        """(tier, size, file, handle, owner) of a live object, touching its LRU time."""
        now = time.monotonic()
        row = self._db.execute("SELECT tier, size, file, handle, owner, lease_until "
                               "FROM objects WHERE uri = ?", (uri,)).fetchone()
        if row is None:
            raise NotFound(uri)
        if row[5] is not None and row[5] <= now:
            self._purge("uri = ?", (uri,))
            raise NotFound(uri)
        self._db.execute("UPDATE objects SET last_access = ? WHERE uri = ?", (now, uri))
        return row[:5]

    def _open(self, uri: str, deadline: float | None = None):
        """Open a live object for reading; returns (tier, size, file object or handle)."""
        with self._locked(deadline):
            tier, size, file, handle, owner = self._lookup(uri)
            if tier == HOST:
                return tier, size, open(self.objects_dir / file, "rb", buffering=0)
            return tier, size, (handle, owner)

    def _get_bytes(self, uri: str) -> bytes:
        tier, size, source = self._open(uri)
        if tier == GPU:
            tensor = self._map_gpu(uri, *source)
            return bytes(_byte_view(tensor).cpu().numpy())
        with source as f:
            data = f.read()
        if len(data) != size:
            raise SizeMismatch(uri, len(data), size)
        return data

    def _get_into(self, uri: str, out: memoryview, handoff: _Handoff, deadline: float) -> None:
        if not handoff.begin():
            return  # the caller gave up before this thread started: `out` is not ours
        out = memoryview(out).cast("B")
        tier, size, source = self._open(uri, deadline)
        if size != out.nbytes:
            if tier == HOST:
                source.close()
            raise SizeMismatch(uri, size, out.nbytes)
        if tier == GPU:
            data = _byte_view(self._map_gpu(uri, *source)).cpu().numpy().data
            handoff.check()
            out[:] = data
            return
        with source as f:
            done = 0
            while done < size:
                handoff.check()
                n = f.readinto(out[done:min(size, done + READ_CHUNK_BYTES)])
                if not n:
                    raise SizeMismatch(uri, done, size)
                done += n

    def _get_gpu(self, uri: str):
        tier, _, source = self._open(uri)
        if tier != GPU:
            if tier == HOST:
                source.close()
            return None
        return self._map_gpu(uri, *source)

    def _map_gpu(self, uri: str, handle: bytes, owner: int):
        if owner == os.getpid() and uri in self._held:
            return self._held[uri]
        if not _alive(owner):
            with self._locked():
                self._purge("uri = ? AND owner = ?", (uri, owner))
            raise NotFound(uri)
        try:
            return CudaIpcHandle.decode(handle).rebuild()
        except ValueError as exc:
            raise CacheError(f"{uri}: malformed GPU handle in the index ({exc})") from exc

    def _renew(self, uri: str, lease_ms: int) -> None:
        with self._locked():
            self._lookup(uri)
            self._db.execute("UPDATE objects SET lease_until = ? WHERE uri = ?",
                             (time.monotonic() + lease_ms / 1000, uri))

    def _drop(self, uri: str) -> None:
        with self._locked():
            self._purge("uri = ?", (uri,))
            self._forget_dropped_gpu_objects()

    def _forget_dropped_gpu_objects(self) -> None:
        """Free device memory this process exported once the index no longer lists it."""
        if not self._held:
            return
        listed = {uri for (uri,) in self._db.execute(
            "SELECT uri FROM objects WHERE tier = ? AND owner = ?", (GPU, os.getpid()))}
        for uri in [uri for uri in self._held if uri not in listed]:
            del self._held[uri]


class _Handoff:
    """Who may write into a `get_into` buffer: its worker thread, until the caller gives up."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state = "queued"  # -> "running" (worker started) | "abandoned" (caller left)

    def begin(self) -> bool:
        """Worker: claim the buffer; False if the caller has already given up."""
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "running"
            return True

    def check(self) -> None:
        """Worker, before each write: stop if the caller has given up."""
        if self._state == "abandoned":
            raise StoreTimeout("read abandoned by its caller")

    def abandon(self) -> bool:
        """Caller: give up; True if the worker is running (the caller must wait for it)."""
        with self._lock:
            running = self._state == "running"
            self._state = "abandoned"
            return running


def private_directory(path: Path) -> None:
    """Create `path` 0700, or check that it is a directory only this user can write to."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)  # not stat: a symlink could point anywhere
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a symlink or a file)")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{path} belongs to uid {info.st_uid}, not to {os.geteuid()}")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise UnsafeDirectory(f"{path} has mode {mode:o}: others may have written into it; "
                              "remove it or make it 0700 after checking its contents")
    if mode & 0o077:
        os.chmod(path, 0o700)  # readable by others, but nobody else could write: close it


class _IndexLock:
    """Thread lock + exclusive flock + one SQLite transaction, bounded by a timeout.

    The transaction commits even when the body raises a typed outcome (NotFound, StoreFull):
    files it already unlinked (expired objects) must not come back in the index.
    """

    def __init__(self, thread_lock: threading.Lock, fd: int, db: sqlite3.Connection | None,
                 timeout_s: float):
        self.thread_lock, self.fd, self.db, self.timeout_s = thread_lock, fd, db, timeout_s

    def __enter__(self):
        deadline = time.monotonic() + self.timeout_s
        if not self.thread_lock.acquire(timeout=self.timeout_s):
            raise StoreTimeout("embedded store index busy")
        try:
            while True:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreTimeout("embedded store index lock not acquired") from None
                    time.sleep(0.0005)
            if self.db is not None:
                self.db.execute("BEGIN IMMEDIATE")
            return self
        except BaseException:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.thread_lock.release()
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            if self.db is not None:
                if isinstance(exc, sqlite3.Error):
                    self.db.execute("ROLLBACK")
                else:
                    self.db.execute("COMMIT")
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.thread_lock.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _byte_view(tensor):
    import torch

    return tensor.reshape(-1).view(torch.uint8)
