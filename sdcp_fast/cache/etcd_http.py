"""Calls to etcd's v3 JSON gateway, as the commit log (etcd_log.py) and the record table
(records_etcd.py) make them: timeouts and transport errors as the cache's errors, keys and
values in base64, and a range read page by page; `client` for one member or for the members
of a cluster (`Members`)."""

from __future__ import annotations

import base64
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


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a range read every key starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


async def read_range(http: httpx.AsyncClient, key: bytes, range_end: bytes, *, page: int,
                     revision: str | None = None, keys_only: bool = False) -> tuple[list[tuple[bytes, bytes]], str]:
    """Every (key, value) in [key, range_end) in key order, read `page` keys a call, all at one
    revision (the first call's unless given), and that revision (values b"" with `keys_only`)."""
    out: list[tuple[bytes, bytes]] = []
    while True:
        body = {"key": b64(key), "range_end": b64(range_end), "limit": str(page), "keys_only": keys_only}
        if revision is not None:
            body["revision"] = revision
        reply = await post(http, "/v3/kv/range", body)
        revision = revision or reply["header"]["revision"]
        kvs = reply.get("kvs", [])
        out += [(unb64(kv["key"]), unb64(kv.get("value"))) for kv in kvs]
        if not reply.get("more") or not kvs:
            return out, revision
        key = out[-1][0] + b"\x00"


def client(endpoints: str, timeout_s: float) -> httpx.AsyncClient | Members:
    """The HTTP client of a gateway URL, or `Members` for several (comma-separated)."""
    urls = endpoints.split(",")
    if len(urls) == 1:
        return httpx.AsyncClient(base_url=urls[0], timeout=timeout_s)
    return Members(urls, timeout_s)


class Members:
    """The members of one etcd cluster (issue 36: `etcd://HOST:PORT,HOST:PORT,...`). Calls go to
    one member at a time. A call whose connection could not be made (nothing was sent) is made
    at the next member at once; a call that timed out or broke after sending, or that the
    member answered with a 5xx (no quorum on its side), returns or raises as with one member
    (a request that may have been applied is never sent twice), and the next call goes to the
    next member."""

    def __init__(self, urls: list[str], timeout_s: float):
        self.clients = [httpx.AsyncClient(base_url=url, timeout=timeout_s) for url in urls]
        self.current = 0

    def _next(self) -> None:
        self.current = (self.current + 1) % len(self.clients)

    async def post(self, path: str, *, json: dict) -> httpx.Response:
        for attempt in range(len(self.clients)):
            try:
                response = await self.clients[self.current].post(path, json=json)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                self._next()
                if attempt == len(self.clients) - 1:
                    raise
                continue
            except httpx.HTTPError:
                self._next()
                raise
            if response.status_code >= 500:
                self._next()
            return response
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()
