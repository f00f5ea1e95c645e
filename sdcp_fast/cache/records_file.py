"""Owned records in a local directory (`file:DIR`): one machine, nothing to install.

No lock is ever held across a step, so a process killed or stopped (SIGSTOP) at any point
blocks nobody:

- A record is a directory `records/<key>/` of numbered versions. Every change (write,
  take, delete) creates version v + 1 after reading version v, with `link(2)` of a
  complete, fsynced temporary file: the link fails if v + 1 exists, so of two writers that
  read v exactly one wins (compare-and-set). The loser reads again and, if the stamp is no
  longer its own, gets `NotOwner`. Old versions are removed behind the newest two.
- A lease is a file `leases/<id>` holding its holder, the machine's boot id and its expiry
  on CLOCK_MONOTONIC (system-wide on Linux, so every process agrees; the boot id makes a
  lease from before a reboot dead). Only its holder rewrites it (`keepalive`), and only
  while it has not expired: an expired lease stays dead.
- The checks of a step (the stamp is the caller's, the caller's lease is alive, the old
  owner's lease has ended) come before the link; a writer stopped between its checks and
  its link either loses the link (someone moved the record meanwhile) or wins it, which
  orders its write before the other's: the same history as had it written at its check.
  Who may act after that is decided by the tokens, not by the clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .api import DEFAULT_TIMEOUT_S
from .errors import StoreTimeout
from .local_files import fsync_dir, in_thread
from .records import Exists, Lease, LeaseExpired, NotOwner, Owned, Record, check_key

_VERSION_DIGITS = 20
_RETRIES = 100


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return "unknown"


class FileRecordTable:
    def __init__(self, directory: str | os.PathLike, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.directory = Path(directory)
        self.leases = self.directory / "leases"
        self.records = self.directory / "records"
        for d in (self.directory, self.leases, self.records):
            d.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.boot = _boot_id()
        # The lease is kept alive on a thread of its own: in the default pool its keepalive
        # queued behind the record writes (each synced), and under load a router lost its
        # lease with hundreds of writes ahead of the renewal (bench_soak at load average 10).
        self._lease_thread = ThreadPoolExecutor(1, thread_name_prefix="sdcp-lease")

    async def _run(self, fn, *args):
        return await in_thread(fn, *args, timeout_s=self.timeout_s, what="record table operation")

    async def _run_lease(self, fn, *args):
        return await in_thread(fn, *args, timeout_s=self.timeout_s, what="lease operation",
                               executor=self._lease_thread)

    # ------------------------------------------------------------------ leases

    async def grant(self, holder: str, ttl_s: float) -> Lease:
        sent = time.monotonic()
        lease = Lease(secrets.token_hex(8), holder, float(ttl_s), sent + ttl_s)
        await self._run_lease(self._write_lease, lease.id, holder, ttl_s)
        return lease

    async def keepalive(self, lease: Lease) -> Lease | None:
        sent = time.monotonic()
        if not await self._run_lease(self._renew, lease):
            return None
        return lease.renewed(sent)

    async def revoke(self, lease: Lease) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.leases / lease.id).unlink()

    def _write_lease(self, lease_id: str, holder: str, ttl_s: float) -> None:
        data = json.dumps({"holder": holder, "boot": self.boot, "expires": time.monotonic() + ttl_s})
        tmp = self.leases / f".{lease_id}.{secrets.token_hex(4)}"
        tmp.write_text(data)
        os.replace(tmp, self.leases / lease_id)

    def _renew(self, lease: Lease) -> bool:
        if not self._alive(lease.id):
            return False          # ended: it stays ended (others may have taken its records)
        self._write_lease(lease.id, lease.holder, lease.ttl_s)
        return True

    def _alive(self, lease_id: str) -> bool:
        try:
            info = json.loads((self.leases / lease_id).read_text())
        except (FileNotFoundError, ValueError):
            return False
        return info.get("boot") == self.boot and info.get("expires", 0) > time.monotonic()

    # ------------------------------------------------------------------ records

    async def create(self, lease: Lease, key: str, value: bytes) -> Owned:
        check_key(key)
        return await self._run(self._create, lease, key, bytes(value))

    async def write(self, owned: Owned, value: bytes) -> None:
        await self._run(self._change, owned, bytes(value), False)

    async def delete(self, owned: Owned) -> None:
        await self._run(self._change, owned, b"", True)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.records / owned.key)

    async def take(self, lease: Lease, record: Record) -> Owned:
        return await self._run(self._take, lease, record)

    async def read(self, key: str) -> Record | None:
        check_key(key)
        return await self._run(self._read, key)

    async def scan(self, *, values: bool = True, skip: Collection[str] = ()) -> list[Record]:
        return await self._run(self._scan, values, frozenset(skip))

    async def close(self) -> None:
        self._lease_thread.shutdown(wait=False)

    def _create(self, lease: Lease, key: str, value: bytes) -> Owned:
        if not self._alive(lease.id):
            raise LeaseExpired(f"lease {lease.id} has ended")
        directory = self.records / key
        try:
            directory.mkdir()
        except FileExistsError:
            raise Exists(key) from None
        if not self._link_version(directory, 1, 1, lease, value, deleted=False):
            raise Exists(key)
        fsync_dir(self.records, missing_ok=True)
        return Owned(key, lease, 1)

    def _change(self, owned: Owned, value: bytes, deleted: bool) -> None:
        directory = self.records / owned.key
        for _ in range(_RETRIES):
            latest = self._latest(directory)
            if latest is None or latest[1].get("deleted") or \
                    (latest[1]["token"], latest[1]["lease"]) != (owned.token, owned.lease.id):
                raise NotOwner(f"record {owned.key} is no longer held by lease {owned.lease.id}")
            if not self._alive(owned.lease.id):
                raise LeaseExpired(f"lease {owned.lease.id} has ended")
            if self._link_version(directory, latest[0] + 1, owned.token, owned.lease, value, deleted):
                return
        raise StoreTimeout(f"record {owned.key}: too many concurrent writes")

    def _take(self, lease: Lease, record: Record) -> Owned:
        directory = self.records / record.key
        for _ in range(_RETRIES):
            latest = self._latest(directory)
            if latest is None or latest[1].get("deleted") or \
                    (latest[1]["token"], latest[1]["lease"]) != (record.token, record.lease):
                raise NotOwner(f"record {record.key} moved on")
            if self._alive(record.lease):
                raise NotOwner(f"record {record.key}: its owner's lease is alive")
            if not self._alive(lease.id):
                raise LeaseExpired(f"lease {lease.id} has ended")
            if self._link_version(directory, latest[0] + 1, record.token + 1, lease, latest[2], False):
                return Owned(record.key, lease, record.token + 1)
        raise StoreTimeout(f"record {record.key}: too many concurrent writes")

    def _read(self, key: str) -> Record | None:
        latest = self._latest(self.records / key)
        if latest is None or latest[1].get("deleted"):
            return None
        _, head, value = latest
        return Record(key, value, head["token"], head["lease"], head["holder"], not self._alive(head["lease"]))

    def _scan(self, values: bool, skip: frozenset[str]) -> list[Record]:
        out = []
        alive: dict[str, bool] = {}
        for name in sorted(os.listdir(self.records)):   # names, not Paths: Path ordering is slow
            if name in skip:
                continue
            directory = self.records / name
            latest = self._latest(directory)
            if latest is None or latest[1].get("deleted"):
                continue
            _, head, value = latest
            if head["lease"] not in alive:
                alive[head["lease"]] = self._alive(head["lease"])
            out.append(Record(name, value if values else b"", head["token"], head["lease"],
                              head["holder"], not alive[head["lease"]]))
        return out

    # ------------------------------------------------------------------ versions

    def _latest(self, directory: Path) -> tuple[int, dict, bytes] | None:
        """(version, header, value) of the newest version, None for no record."""
        for _ in range(_RETRIES):
            try:
                names = [n for n in os.listdir(directory) if n.isdigit()]
            except FileNotFoundError:
                return None
            if not names:
                return None
            version = max(map(int, names))
            try:
                data = (directory / f"{version:0{_VERSION_DIGITS}d}").read_bytes()
            except FileNotFoundError:
                continue      # removed behind a newer one: list again
            head, _, value = data.partition(b"\n")
            return version, json.loads(head), value
        raise StoreTimeout(f"{directory}: versions kept changing")

    def _link_version(self, directory: Path, version: int, token: int, lease: Lease, value: bytes,
                      deleted: bool) -> bool:
        """Create `version` with this content unless it exists (False then)."""
        head = json.dumps({"token": token, "lease": lease.id, "holder": lease.holder, "deleted": deleted})
        tmp = directory / f".tmp-{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:
            return False if directory.exists() else _gone(directory)
        try:
            os.write(fd, head.encode() + b"\n" + value)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, directory / f"{version:0{_VERSION_DIGITS}d}")
        except FileExistsError:
            return False
        except FileNotFoundError:
            _gone(directory)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        fsync_dir(directory, missing_ok=True)
        with contextlib.suppress(OSError):
            (directory / f"{version - 2:0{_VERSION_DIGITS}d}").unlink()
        return True


def _gone(directory: Path):
    raise NotOwner(f"record {directory.name} was deleted")
