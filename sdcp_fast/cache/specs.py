"""`open_store` / `open_log`: one string in a config names a backend.

    open_store("embedded:")                 shared memory, default /dev/shm/sdcp-fast-<uid>/store
    open_store("embedded:/dev/shm/x?cap_bytes=1073741824&gpu_cap_bytes=...")
    open_store("redis://127.0.0.1:6379/0?cache_ttl_ms=600000")
    open_log("file:/var/lib/sdcp/log")      local directory (default ~/.local/state/sdcp-fast/log)
    open_log("redis://127.0.0.1:6379/0")    Lua-enforced; "...?fencing=check": read-after-append
    open_log("etcd://127.0.0.1:2379")       etcd v3 JSON gateway (etcds:// for https; a cluster's
                                            members: etcd://HOST:PORT,HOST:PORT,...)
    open_table("file:/var/lib/sdcp/table")  owned records (records.py) in a local directory
    open_table("redis://127.0.0.1:6379/0?prefix=sdcp:table")   Lua-checked, leases are TTL keys
    open_table("etcd://127.0.0.1:2379?prefix=/sdcp/table/")    transactions, etcd leases

Every spec accepts `timeout_s=SECONDS` in its query.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from .api import DEFAULT_TIMEOUT_S, CommitLog, ObjectStore
from .errors import BadSpec
from .records import RecordTable


def _split(spec: str) -> tuple[str, str, dict[str, str]]:
    """(scheme, spec without query, query options)."""
    scheme, _, rest = spec.partition(":")
    if not _ or not scheme:
        raise BadSpec(f"spec {spec!r} has no scheme (embedded:, file:, redis://, etcd://)")
    body, _, query = rest.partition("?")
    return scheme.lower(), f"{scheme}:{body}", dict(parse_qsl(query, strict_parsing=False))


def _int(options: dict[str, str], name: str, default: int) -> int:
    try:
        return int(options.pop(name, default))
    except ValueError as exc:
        raise BadSpec(f"option {name} must be an integer") from exc


def _timeout(options: dict[str, str]) -> float:
    try:
        return float(options.pop("timeout_s", DEFAULT_TIMEOUT_S))
    except ValueError as exc:
        raise BadSpec("option timeout_s must be a number") from exc


def _no_more(spec: str, options: dict[str, str]) -> None:
    if options:
        raise BadSpec(f"{spec}: unknown options {sorted(options)}")


def _strip_query(spec: str) -> str:
    parts = urlsplit(spec)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def _file_path(body: str) -> str:
    """The path of a `file:` spec (file:PATH or file:///abs/path)."""
    path = body[len("file:"):]
    return urlsplit(body).path if path.startswith("//") else path


def _etcd_endpoint(spec: str, scheme: str) -> str:
    """The JSON gateway's base URL of an `etcd://` (http) or `etcds://` (https) spec; for the
    members of a cluster (`etcd://HOST:PORT,HOST:PORT,...`) their URLs, comma-separated."""
    urls = []
    for member in urlsplit(spec).netloc.split(","):
        parts = urlsplit(f"//{member}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or not port:
            raise BadSpec(f"{spec}: etcd needs host and port")
        urls.append(f"{'https' if scheme == 'etcds' else 'http'}://{parts.hostname}:{port}")
    return ",".join(urls)


async def open_store(spec: str = "embedded:") -> ObjectStore:
    scheme, body, options = _split(spec)
    timeout_s = _timeout(options)
    if scheme == "embedded":
        from .embedded_store import DEFAULT_CAP_BYTES, DEFAULT_GPU_CAP_BYTES, EmbeddedStore

        path = body[len("embedded:"):] or None
        store = EmbeddedStore(path, cap_bytes=_int(options, "cap_bytes", DEFAULT_CAP_BYTES),
                              gpu_cap_bytes=_int(options, "gpu_cap_bytes", DEFAULT_GPU_CAP_BYTES),
                              timeout_s=timeout_s)
        _no_more(spec, options)
        return store
    if scheme in ("redis", "rediss"):
        from .redis_store import DEFAULT_CACHE_TTL_MS, RedisStore

        ttl = _int(options, "cache_ttl_ms", DEFAULT_CACHE_TTL_MS)
        _no_more(spec, options)
        return await RedisStore.open(_strip_query(spec), cache_ttl_ms=ttl, timeout_s=timeout_s)
    raise BadSpec(f"no object store for {spec!r} (embedded:PATH or redis://HOST:PORT/DB)")


async def open_log(spec: str) -> CommitLog:
    scheme, body, options = _split(spec)
    timeout_s = _timeout(options)
    if scheme == "file":
        from .file_log import FileCommitLog

        _no_more(spec, options)
        return FileCommitLog(_file_path(body) or default_log_dir(), timeout_s=timeout_s)
    if scheme in ("redis", "rediss"):
        from .redis_log import RedisCommitLog

        fencing = options.pop("fencing", "server")
        if fencing not in ("server", "check"):
            raise BadSpec(f"{spec}: fencing must be 'server' or 'check'")
        _no_more(spec, options)
        return RedisCommitLog(_strip_query(spec), server_fencing=fencing == "server",
                              timeout_s=timeout_s)
    if scheme in ("etcd", "etcds"):
        from .etcd_log import DEFAULT_PREFIX, EtcdCommitLog

        endpoint = _etcd_endpoint(spec, scheme)
        prefix = options.pop("prefix", DEFAULT_PREFIX)
        _no_more(spec, options)
        return EtcdCommitLog(endpoint, prefix=prefix, timeout_s=timeout_s)
    raise BadSpec(f"no commit log for {spec!r} (file:PATH, redis://..., etcd://HOST:PORT)")


async def open_table(spec: str) -> RecordTable:
    scheme, body, options = _split(spec)
    timeout_s = _timeout(options)
    if scheme == "file":
        from .records_file import FileRecordTable

        _no_more(spec, options)
        if not _file_path(body):
            raise BadSpec(f"{spec}: file: needs a directory")
        return FileRecordTable(_file_path(body), timeout_s=timeout_s)
    if scheme in ("redis", "rediss"):
        from .records_redis import DEFAULT_PREFIX, RedisRecordTable

        prefix = options.pop("prefix", DEFAULT_PREFIX)
        _no_more(spec, options)
        return RedisRecordTable(_strip_query(spec), prefix=prefix, timeout_s=timeout_s)
    if scheme in ("etcd", "etcds"):
        from .records_etcd import DEFAULT_PREFIX, EtcdRecordTable

        endpoint = _etcd_endpoint(spec, scheme)
        prefix = options.pop("prefix", DEFAULT_PREFIX)
        _no_more(spec, options)
        return EtcdRecordTable(endpoint, prefix=prefix, timeout_s=timeout_s)
    raise BadSpec(f"no record table for {spec!r} (file:DIR, redis://..., etcd://HOST:PORT)")


def table_beside_log(log_spec: str) -> str:
    """The record table a router uses when its config names none: beside its commit log
    (a `router-table` directory in a file log's directory; the same Redis or etcd, under
    the table's own key prefix)."""
    scheme, body, _ = _split(log_spec)
    if scheme == "file":
        return f"file:{Path(_file_path(body) or default_log_dir()) / 'router-table'}"
    if scheme in ("redis", "rediss", "etcd", "etcds"):
        return _strip_query(log_spec)
    raise BadSpec(f"no record table beside {log_spec!r}")


def default_log_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "sdcp-fast" / "log"
