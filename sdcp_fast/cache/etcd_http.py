"""One call to etcd's v3 JSON gateway, as the commit log (etcd_log.py) and the record table
(records_etcd.py) make them: timeouts and transport errors as the cache's errors."""

from __future__ import annotations

import json

import httpx

from .errors import CacheError, StoreTimeout


async def post(http: httpx.AsyncClient, path: str, body: dict, *, missing_ok: bool = False) -> dict | None:
    """The gateway's JSON answer (the first object of a streamed one); None for a 404 when
    `missing_ok` (a lease that no longer exists)."""
    try:
        response = await http.post(path, json=body)
    except httpx.TimeoutException as exc:
        raise StoreTimeout(f"etcd {path} timed out") from exc
    except httpx.HTTPError as exc:
        raise CacheError(f"etcd {path}: {exc}") from exc
    if missing_ok and response.status_code == 404:
        return None
    if response.status_code != 200:
        raise CacheError(f"etcd {path}: HTTP {response.status_code} {response.text[:200]}")
    return json.loads(response.content.split(b"\n", 1)[0])   # lease keepalive streams: one object a line
