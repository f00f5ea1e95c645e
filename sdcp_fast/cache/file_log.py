"""The embedded commit log: one file per log in a local directory (`file:PATH`).

Frame of one entry on disk:

    length (4 octets BE) || crc32 of payload (4 octets BE) || payload
    payload = kind (1) || epoch (8, BE) || record            (entries.py)

- Conditional append across processes: the writer takes an exclusive `flock` on the log
  file, scans what it has not seen yet (the length and the highest fence epoch are cached
  per process and only the new tail is read), checks `expected` and the fence, writes the
  frame and `fdatasync`s before returning. A returned position is therefore durable.
- Crash safety: a writer killed mid-write leaves a torn tail (short frame or bad checksum).
  Readers stop at it; the next writer truncates it under the lock before appending, so an
  acknowledged record is never followed by garbage.
- Blocking file work runs in a worker thread; each call is bounded by `timeout_s`. The
  worker works to the caller's deadline: it gives up waiting for the lock at that deadline,
  and once it holds the lock it writes only if the deadline has not passed yet. A thread
  cannot be stopped mid-write, though: an append whose caller already got `StoreTimeout`
  may still land if the deadline passed during its write or `fdatasync`. It never races a
  later append (that one waits for the lock, sees the landed record and answers
  `Conflict`), and a caller learns the outcome by reading position `expected`.
- Group commit (`append_batch`): a batch's appends (one per session's log) run in one
  worker-thread call: every log is locked, its frame written and its lock dropped, then every
  written file is `fdatasync`ed, and only then are the lengths returned, so an acknowledged
  position is exactly as durable as with `append`. One lock is held at a time (no two
  writers' batches can deadlock); a log named twice in a batch is appended to in a later
  pass.
- The lock covers the scan, the checks and the write, not the sync: a process that stops
  (SIGSTOP, a debugger) while holding a log's lock holds up every other writer of that log,
  a router's fence included, until it continues, so the window is kept to microseconds. (A
  sync after the unlock loses nothing: a reader may see the frame before it is durable, but
  nobody was told of it yet, and a later writer's sync of the same file makes it durable.)
- A group commit on a memory file system (tmpfs, ramfs: `fdatasync` has nothing to do), or
  measured cheaper than a thread hop (a fast device; `aio.Offload`, the same measure as the
  verifier's forward passes), runs on the event loop: the hop to a worker and back cost more
  than the work, and on a loaded machine milliseconds (where a measured thread call also
  counts its wait for the GIL, so tmpfs is recognised rather than measured). Nothing is acknowledged earlier: the sync still comes
  before the return. On the loop a lock is only tried, never waited for (a held lock, e.g.
  a router fencing that log, would stall the loop): an append whose log is locked goes to a
  worker thread as before, after the others.
- Per-log scan state is an LRU of `max_cached_logs` entries; a forgotten log is rescanned.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..aio import Offload
from .api import DEFAULT_TIMEOUT_S, Append, LogEntry, check_epoch, check_position
from .entries import pack_entry, unpack_entry
from .errors import Conflict, Fenced, StoreTimeout
from .local_files import fsync_dir, in_memory, in_thread
from .lru import DEFAULT_MAX_LOGS, LruCache

_FRAME = struct.Struct(">II")
MAX_RECORD_BYTES = 16 << 20  # a commit record is ~100 bytes; bigger lengths mean a torn frame
_LOCK_POLL_S = 0.001


class _Busy(Exception):
    """The log's lock is held elsewhere and this pass does not wait for it."""


@dataclass
class _Scan:
    """What one process knows of a log file's valid prefix."""

    inode: int
    offset: int  # end of the last valid frame
    length: int  # number of valid entries
    fence_epoch: int  # highest fence epoch among them (0: none)


def _scan_frames(data: bytes, start: int = 0):
    """Yield (end_offset, payload) for each valid frame from `start`; stop at a torn tail."""
    offset = start
    while offset + _FRAME.size <= len(data):
        size, crc = _FRAME.unpack_from(data, offset)
        end = offset + _FRAME.size + size
        if size > MAX_RECORD_BYTES or end > len(data):
            return
        payload = data[offset + _FRAME.size:end]
        if zlib.crc32(payload) != crc:
            return
        yield end, payload
        offset = end


class FileCommitLog:
    """`CommitLog` over a local directory; safe across processes and crash-safe."""

    def __init__(self, directory: str | os.PathLike, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_cached_logs: int = DEFAULT_MAX_LOGS):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self._scans: LruCache[str, _Scan] = LruCache(max_cached_logs)
        self._files: LruCache[str, str] = LruCache(max_cached_logs)   # log -> its file (path_of)
        self._group_cost = Offload()   # a group commit's measured duration per record
        self._in_memory = in_memory(self.directory)

    def path_of(self, log: str) -> Path:
        return Path(self._file_of(log))

    def _file_of(self, log: str) -> str:
        """The log's file, as a string (what os.open takes; kept: a hash and a Path per
        append were a measurable share of a group commit's CPU)."""
        path = self._files.get(log)
        if path is None:
            # Log names are URIs; hash them into a flat, fixed-length file name.
            path = os.path.join(self.directory, hashlib.sha256(log.encode()).hexdigest()[:40] + ".log")
            self._files.put(log, path)
        return path

    async def append(self, log: str, record: bytes, *, epoch: int, expected: int) -> int:
        """See `CommitLog.append`. On `StoreTimeout` the record may still have landed."""
        check_epoch(epoch)
        check_position(expected)
        return await self._run(self._append_sync, log, "commit", epoch, bytes(record), expected)

    async def append_batch(self, appends: Sequence[Append]) -> list[int | Exception]:
        """See `api.append_batch`: every append in one worker call and one durable pass."""
        for a in appends:
            check_epoch(a.epoch)
            check_position(a.expected)
        items = [(a.log, "commit", a.epoch, bytes(a.record), a.expected) for a in appends]
        deadline = time.monotonic() + self.timeout_s
        cost = self._group_cost
        if not (self._in_memory or cost.inline(len(items))):
            return await in_thread(cost.timed, len(items), self._append_passes, deadline, items,
                                   timeout_s=self.timeout_s, what="commit log operation")
        results = cost.timed(len(items), self._append_passes, deadline, items, False)
        busy = [n for n, result in enumerate(results) if isinstance(result, _Busy)]
        if busy:   # their logs are locked elsewhere: wait for the locks in a worker thread
            rest = await in_thread(self._append_passes, deadline, [items[n] for n in busy],
                                   timeout_s=max(deadline - time.monotonic(), 0.0), what="commit log operation")
            for n, result in zip(busy, rest, strict=True):
                results[n] = result
        return results

    async def fence(self, log: str, epoch: int) -> int:
        check_epoch(epoch, minimum=1)  # 0 means "no fence"; session epochs start at 1
        return await self._run(self._append_sync, log, "fence", epoch, b"", None)

    async def read(self, log: str, start: int = 0) -> list[LogEntry]:
        check_position(start)
        return await self._run(lambda _deadline: self._read_sync(log, start))

    async def close(self) -> None:
        self._scans.clear()

    async def _run(self, fn, *args):
        """Run `fn(deadline, *args)` in a worker thread, bounded by `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        return await in_thread(fn, deadline, *args, timeout_s=self.timeout_s, what="commit log operation")

    # -- blocking parts (worker thread) ---------------------------------------------------

    def _read_sync(self, log: str, start: int) -> list[LogEntry]:
        try:
            data = self.path_of(log).read_bytes()
        except FileNotFoundError:
            return []
        entries = []
        for position, (_, payload) in enumerate(_scan_frames(data)):
            if position >= start:
                entries.append(unpack_entry(position, payload))
        return entries

    def _append_sync(self, deadline: float, log: str, kind: str, epoch: int, record: bytes,
                     expected: int | None) -> int:
        (result,) = self._append_group(deadline, [(log, kind, epoch, record, expected)])
        if isinstance(result, Exception):
            raise result
        return result

    def _append_passes(self, deadline: float, items: list[tuple], wait: bool = True) -> list[int | Exception]:
        """Group commits of `items`; a log already in a pass waits for the next one (a second
        flock on the same file from this process would wait for the first). With `wait`
        False, an item whose log is locked elsewhere answers `_Busy`, and so does every later
        item of that log (their order is kept)."""
        results: list[int | Exception | None] = [None] * len(items)
        pending = list(range(len(items)))
        busy: set[str] = set()
        while pending:
            seen: set[str] = set()
            group, later = [], []
            for n in pending:
                log = items[n][0]
                if log in busy:
                    results[n] = _Busy(log)
                    continue
                (later if log in seen else group).append(n)
                seen.add(log)
            for n, result in zip(group, self._append_group(deadline, [items[n] for n in group], wait),
                                 strict=True):
                results[n] = result
                if isinstance(result, _Busy):
                    busy.add(items[n][0])
            pending = later
        return results  # type: ignore[return-value]

    def _append_group(self, deadline: float, items: list[tuple], wait: bool = True) -> list[int | Exception]:
        """Append each (log, kind, epoch, record, expected) of distinct logs: lock, write and
        unlock each one, then sync every written file. Each item's answer is its new length
        or the exception it raised; nothing is acknowledged before its sync."""
        results: list[int | Exception] = [OSError(errno.EIO, "not attempted")] * len(items)
        written: list[tuple[int, int, int]] = []  # (item, fd, its new length)
        fds: list[int] = []
        try:
            for n in sorted(range(len(items)), key=lambda n: self._file_of(items[n][0])):
                log, kind, epoch, record, expected = items[n]
                try:
                    fd = self._open(log)
                    fds.append(fd)
                    try:
                        done = self._write_locked(deadline, fd, log, kind, epoch, record, expected, wait)
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)   # the sync below runs without it
                except Exception as exc:
                    results[n] = exc
                    continue
                if isinstance(done, int):
                    results[n] = done          # a retried fence already in place
                else:
                    written.append((n, fd, done[0]))
            for n, fd, length in written:
                try:
                    os.fdatasync(fd)
                except OSError as exc:
                    results[n] = exc
                    continue
                results[n] = length
        finally:
            for fd in fds:
                os.close(fd)  # also drops the flock
        return results

    def _open(self, log: str) -> int:
        path = self._file_of(log)
        try:
            return os.open(path, os.O_RDWR)   # the log exists: no stat first (one syscall)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fsync_dir(self.directory)  # the new file's name must survive a crash too
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write_locked(self, deadline: float, fd: int, log: str, kind: str, epoch: int, record: bytes,
                      expected: int | None, wait: bool = True) -> tuple[int] | int:
        """Lock, check and write one frame (not yet synced); the scan takes it in at once, as
        the file holds it now: (the new length,), or the length when a retried fence is
        already in place."""
        self._lock(fd, deadline, wait)
        scan, size = self._catch_up(log, fd)
        if time.monotonic() > deadline:
            # The caller has given up (or is about to): a write now would land behind
            # its back. Past this point only a write already under way can.
            raise StoreTimeout("commit log deadline passed before the write")
        if kind == "commit":
            if scan.fence_epoch > epoch:
                raise Fenced(scan.fence_epoch)
            if scan.length != expected:
                raise Conflict(scan.length)
        else:
            if scan.fence_epoch > epoch:
                raise Fenced(scan.fence_epoch)
            if scan.fence_epoch == epoch:
                return scan.length  # a retried fence: already in place
        payload = pack_entry(kind, epoch, record)
        frame = _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
        if size != scan.offset:   # the file's size under this lock
            os.ftruncate(fd, scan.offset)  # drop a torn tail left by a crashed writer
        written = os.pwrite(fd, frame, scan.offset)
        if written != len(frame):
            raise OSError(errno.EIO, f"short write to {self.path_of(log)}")
        scan.offset += len(frame)
        scan.length += 1
        if kind == "fence":
            scan.fence_epoch = epoch
        return (scan.length,)

    def _lock(self, fd: int, deadline: float, wait: bool = True) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if not wait:
                    raise _Busy() from None
                if time.monotonic() > deadline:
                    raise StoreTimeout("commit log lock not acquired in time") from None
                time.sleep(_LOCK_POLL_S)

    def _catch_up(self, log: str, fd: int) -> tuple[_Scan, int]:
        """Bring the cached scan of `log` up to date with the file (under the lock); with
        the file's size."""
        stat = os.fstat(fd)
        scan = self._scans.get(log)
        if scan is None or scan.inode != stat.st_ino or stat.st_size < scan.offset:
            scan = _Scan(stat.st_ino, 0, 0, 0)  # unknown or forgotten (LRU): scan it all
        if stat.st_size > scan.offset:
            base = scan.offset
            tail = os.pread(fd, stat.st_size - base, base)
            for end, payload in _scan_frames(tail):
                entry = unpack_entry(scan.length, payload)
                scan.offset = base + end
                scan.length += 1
                if entry.kind == "fence":
                    scan.fence_epoch = max(scan.fence_epoch, entry.epoch)
        self._scans.put(log, scan)
        return scan, stat.st_size
