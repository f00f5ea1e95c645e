"""Object store (the draft's MLC) and fenced commit log (section 6.8) on real stores.

Exact interface (all store and log methods are coroutines, each bounded by a timeout,
default 5 s, `timeout_s=` in any spec's query):

    store = await open_store("embedded:" | "embedded:PATH?cap_bytes=N&gpu_cap_bytes=N"
                             | "redis://HOST:PORT/DB?cache_ttl_ms=N")
    await store.put(uri: str, data: bytes | memoryview, lease_ms: int | None = None) -> None
    await store.get(uri: str) -> bytes                       # NotFound
    await store.get_many(uris: Sequence[str]) -> list[bytes] # concurrent; NotFound
    await store.renew(uri: str, lease_ms: int) -> None       # NotFound if already gone
    await store.release(uri: str) -> None                    # lease ends: object is gone
    await store.delete(uri: str) -> None
    await store.close() -> None
    # embedded only: get_into(uri, out: memoryview) (SizeMismatch; never writes into `out`
    # after it returns or raises), put_tensor(uri, tensor, lease_ms=None),
    # get_tensor(uri) -> CUDA tensor of a GPU-tier object | None
    # A timed-out put or append (StoreTimeout) may still land: re-read to know.

    log = await open_log("file:PATH" | "redis://HOST:PORT/DB[?fencing=check]"
                         | "etcd://HOST:PORT[?prefix=/sdcp/log/]")
    await log.append(log: str, record: bytes, *, epoch: int, expected: int) -> int
        # new length (the record sits at position `expected`); Fenced(fence_epoch) if a fence
        # with epoch > `epoch` exists (checked first), Conflict(current_length) otherwise
        # if the log is not `expected` long
    await log.fence(log: str, epoch: int) -> int
        # unconditional on position, monotone: appends a fence record unless one with this
        # epoch exists (retry: returns current length); Fenced if a higher one exists
    await log.read(log: str, start: int = 0) -> list[LogEntry]
    await log.close() -> None
    await append_batch(log, [Append(log, record, epoch, expected), ...]) -> [int | Exception]
        # a batch's appends (distinct logs): group commit on the file log, one pipelined
        # round trip on Redis, concurrent appends elsewhere; each answer as `append`'s
    LogEntry(position: int, kind: "commit" | "fence", epoch: int, record: bytes)

    effective_commits(entries) -> list[LogEntry]  # skips commits refused by a later-epoch fence
    EffectiveCommits().of(entries)          # the same over a log read piece by piece
    await check_after_append(log_store, log, position, epoch) -> None  # section 6.8's check
    object_uri(name: str, scope: bytes | None = None) -> str  # "mlc:/scope/<hex>/name"
    await load_q_rows(store, refs: Sequence[tuple[str, int]], vocab: int,
                      device="cpu", *, out: Tensor | None = None) -> Tensor
        # [sum M, V] fp32 on device (rows of `out` if given, a reusable [>= sum M, V]
        # buffer); QRowsUnavailable(uri, reason), .problem == "sdcp-q-unavailable"

    table = await open_table("file:DIR" | "redis://HOST:PORT/DB" | "etcd://HOST:PORT")
        # owned records with leases and fencing tokens (records.py): the router's sessions

Errors (errors.py): CacheError > NotFound, StoreFull, StoreTimeout, BadSpec, Conflict,
Fenced, SizeMismatch, CorruptLog, UnsafeDirectory (embedded store directory not private), Exists,
NotOwner > LeaseExpired (records.py);
qrows.QRowsUnavailable.
Test servers: `testing.redis_server()`, `testing.etcd_server()` (context managers);
`testing.EtcdProcess`, `testing.RedisProcess` (servers that can be killed and started again
on their data; the Redis one durable: appendfsync always).
"""

from .api import (
    Append,
    CommitLog,
    EffectiveCommits,
    LogEntry,
    ObjectStore,
    append_batch,
    append_each,
    effective_commits,
    object_uri,
)
from .errors import (
    BadSpec,
    CacheError,
    Conflict,
    CorruptLog,
    Fenced,
    NotFound,
    SizeMismatch,
    StoreFull,
    StoreTimeout,
    UnsafeDirectory,
)
from .fencing import check_after_append
from .records import Exists, Lease, LeaseExpired, NotOwner, Owned, Record, RecordTable
from .specs import open_log, open_store, open_table, table_beside_log

__all__ = [
    "Append", "BadSpec", "CacheError", "CommitLog", "Conflict", "CorruptLog", "EffectiveCommits", "Exists", "Fenced", "Lease",
    "LeaseExpired", "LogEntry", "NotFound", "NotOwner", "ObjectStore", "Owned", "Record",
    "RecordTable", "SizeMismatch", "StoreFull", "StoreTimeout", "UnsafeDirectory",
    "append_batch", "append_each", "check_after_append", "effective_commits", "load_q_rows", "object_uri", "open_log",
    "open_store", "open_table", "table_beside_log",
]


def __getattr__(name: str):
    if name in ("load_q_rows", "QRowsUnavailable"):  # imports torch: only when asked for
        from . import qrows

        return getattr(qrows, name)
    raise AttributeError(name)
