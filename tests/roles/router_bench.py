"""A router in process against scripted verifiers and drafters (no processes, no sockets):
`Network` answers the router's calls from routes the test sets; `Bench` is a router over a
real embedded store, file commit log and file session table in a temporary directory. Two
benches over the same directory share the log and the session table (two routers)."""

from __future__ import annotations

import asyncio
import os
from urllib.parse import urlsplit

from sdcp_fast.cache import open_log, open_store, open_table
from sdcp_fast.core.digest import prefix_digest
from sdcp_fast.core.messages import (
    ROLE_DRAFTER,
    ROLE_VERIFIER,
    Action,
    Contract,
    SessionState,
    Status,
)
from sdcp_fast.core.problems import PROBLEM_MEDIA_TYPE, Kind, Problem
from sdcp_fast.refs import commit_log_name
from sdcp_fast.router import RouterConfig, RouterService, RouterSession
from sdcp_fast.transport import ClientResponse, TransportError

ROUTER = "https://router.test/"
V1, V2, D1, D2 = (f"https://{n}.test/" for n in ("v1", "v2", "d1", "d2"))
MODEL = b"m" * 32
PROMPT = (1, 2, 3)


class Network:
    """`transport.Client`'s interface: records every call; `routes[(method, base, path
    suffix)]` answers it (a function of the body, or a coroutine function: a slow peer,
    given up on after the call's timeout as the real client does); a call with no route
    gets no answer."""

    def __init__(self):
        self.calls: list[tuple[str, str, str, bytes | None]] = []
        self.routes: dict[tuple[str, str, str], object] = {}

    async def request(self, method, url, body=None, content_type=None, *, idempotent=False,
                      timeout=None) -> ClientResponse:
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}/"
        self.calls.append((method, base, parts.path, body))
        for (m, b, suffix), answer in self.routes.items():
            if (m, b) == (method, base) and parts.path.endswith(suffix):
                reply = answer(body)
                if not asyncio.iscoroutine(reply):
                    return reply
                try:
                    return await asyncio.wait_for(reply, timeout)
                except TimeoutError:
                    raise TransportError(f"no answer from {url} in {timeout} s", sent=True) from None
        raise TransportError(f"cannot connect to {url}", sent=False)

    def sent(self, method: str, base: str, suffix: str) -> list[bytes]:
        return [body for m, b, p, body in self.calls if (m, b) == (method, base) and p.endswith(suffix)]

    def order(self) -> list[tuple[str, str, str]]:
        return [(m, b, p.rsplit("/", 1)[-1]) for m, b, p, _ in self.calls]


def cbor_answer(message) -> ClientResponse:
    return ClientResponse(200, {"content-type": "application/sdcp+cbor"}, message.to_cbor())


def problem_answer(kind: Kind) -> ClientResponse:
    return ClientResponse(kind.status, {"content-type": PROBLEM_MEDIA_TYPE}, Problem(kind).to_json())


class Bench:
    def __init__(self, tmp, uri: str = ROUTER, lease_ttl_s: float = 30, **config):
        self.tmp = tmp
        self.uri = uri
        self.lease_ttl_s = lease_ttl_s
        self.config = config          # more RouterConfig fields
        self.net = Network()

    async def __aenter__(self):
        self.store = await open_store(f"embedded:{self.tmp / 'mlc'}")
        self.log = await open_log(f"file:{self.tmp / 'log'}")
        self.table = await open_table(f"file:{self.tmp / 'table'}")
        config = RouterConfig(self.uri, (V1, V2), ((D1, MODEL), (D2, MODEL)), lease_ttl_s=self.lease_ttl_s,
                              status_grace_s=0, **self.config)
        self.router = RouterService(config, None, self.store, self.log, client=self.net, table=self.table)
        await self.router.own.start()
        self.contract = Contract(target=bytes(32), tokenizer=bytes(32), rule=1, m_max=4, max_new=50,
                                 stop=(), low_rounds=3, fallback=(Action.REDUCE,), drafters=(MODEL,))
        return self

    async def __aexit__(self, *exc):
        await self.router.stop()
        await self.store.close()
        await self.log.close()
        await self.table.close()

    def live(self, *uris: str) -> None:
        for uri in uris:
            role = ROLE_VERIFIER if uri in (V1, V2) else ROLE_DRAFTER
            self.router.registry.report(Status(uri, role, 0, 0, 60_000))

    async def session(self, verifier: str, drafter: str | None = None, epoch: int = 1) -> RouterSession:
        sid = os.urandom(16)
        s = RouterSession(sid, self.contract, PROMPT, commit_log_name(sid), epoch=epoch, allocated=epoch,
                          verifier=verifier, drafter=drafter)
        await self.router.own.create(s)
        self.router.sessions[sid] = s
        return s

    def state(self, s: RouterSession, epoch: int | None = None) -> SessionState:
        return SessionState(s.id, epoch or s.epoch, 0, 0, prefix_digest(self.contract.digest, PROMPT))

    async def fences(self, s: RouterSession) -> list[int]:
        return [e.epoch for e in await self.log.read(s.commit_log) if e.kind == "fence"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 25))


