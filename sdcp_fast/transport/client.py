"""The one HTTP client every role uses: HTTP/2 (jh2) or HTTP/3 (aioquic), with mutual TLS 1.3.

Connections are kept per origin and reused (client_h2.py, client_h3.py); requests on one
connection run as concurrent streams. Every attempt, connection set-up and whole response
included, ends within `timeout` seconds (one `aio.Deadlines` per client and loop), so a
server trickling a byte at a time cannot hold a request. A failed attempt is retried (up to
`retries` times, short exponential backoff) only when that is safe: when the request
certainly never reached the server (connect failure, stream refused by a closing server),
or when the caller says it is idempotent (`idempotent=True`: proposals are idempotent per
round, section 6.9; GETs are safe).

`call(client, method, url, message, AnswerType)` is the typed form for role code: a message
in, the answer's message (or its problem document) out as a `Reply`; a retried call sends
the same bytes (deterministic encoding).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar
from urllib.parse import urlsplit

from sdcp_fast.aio import Deadlines
from sdcp_fast.core.problems import PROBLEM_MEDIA_TYPE, Problem, ProblemError

from .http import SDCP_MEDIA_TYPE, Message, media_type
from .tlsconfig import TLSConfig

log = logging.getLogger("sdcp_fast.transport")
DEFAULT_MAX_RESPONSE = 16 << 20
# A request body at least this long announces its length (content-length), so that a server
# can refuse one over its limit before the upload; a shorter one (every SDCP round) does not:
# HTTP/2 and HTTP/3 frame the content, and the field costs header compression at both ends
ANNOUNCE_LENGTH_FROM = 16 << 10


@functools.lru_cache(maxsize=1024)
def split_https_url(url: str) -> tuple[tuple[str, int], str, str]:
    """((host, port) of the origin, :authority, :path) of an https URL; ValueError otherwise.
    Cached: a drafter posts to the same few URLs every round."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"not an https URL: {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.hostname, parts.port or 443), parts.netloc.rpartition("@")[2], path


def request_headers(method: str, authority: str, path: str, body: bytes | None,
                    content_type: str | None) -> list[tuple[bytes, bytes]]:
    """A request's header block, the same fields in the same order for every request to one
    URL (the header compression of either protocol can then index them)."""
    headers = [(b":method", method.encode()), (b":scheme", b"https"),
               (b":authority", authority.encode()), (b":path", path.encode())]
    if body is not None:
        if content_type:
            headers.append((b"content-type", content_type.encode()))
        if len(body) >= ANNOUNCE_LENGTH_FROM:
            headers.append((b"content-length", str(len(body)).encode()))
    return headers


class TransportError(Exception):
    """No HTTP response. `sent` is False when the server certainly did not process the request."""

    def __init__(self, message: str, *, sent: bool):
        super().__init__(message)
        self.sent = sent


class RequestTimeout(TransportError):
    pass


@dataclass(frozen=True)
class ClientResponse:
    status: int
    headers: dict[str, str]  # lower-case names; the last value of a repeated header
    body: bytes

    @property
    def content_type(self) -> str | None:
        return media_type(self.headers.get("content-type"))

    def problem(self) -> Problem | None:
        """The RFC 9457 document of an error answer, or None."""
        if self.status < 400 or self.content_type != PROBLEM_MEDIA_TYPE:
            return None
        try:
            return Problem.from_json(self.body)
        except ValueError:
            return None


class Exchange:
    """One request's stream: its answer as it arrives, settled once into `future`."""

    __slots__ = ("future", "max_response", "status", "headers", "body", "sent_all", "ended")

    def __init__(self, future: asyncio.Future[ClientResponse], max_response: int):
        self.future = future
        self.max_response = max_response
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.sent_all = False   # our end of the stream went out
        self.ended = False      # the server's end of the stream (or its reset) came

    def head(self, headers) -> None:
        """The answer's header fields (names lowercased, the last value of a repeated one);
        a :status that is not three digits leaves `status` 0 (a malformed answer)."""
        for name, value in headers:
            if name == b":status":
                self.status = int(value) if len(value) == 3 and value.isdigit() else 0
            elif name[:1] != b":":
                self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def add(self, data: bytes) -> bool:
        """More of the answer's content; False (the exchange failed) once it passes `max_response`."""
        self.body += data
        if len(self.body) <= self.max_response:
            return True
        self.fail(TransportError(f"response over {self.max_response} bytes", sent=True))
        return False

    def finish(self) -> None:
        """The answer is whole."""
        self.ended = True
        if self.future.done():
            return
        if not self.status:
            self.future.set_exception(TransportError("answer without a valid :status", sent=True))
        else:
            self.future.set_result(ClientResponse(self.status, self.headers, bytes(self.body)))

    def fail(self, error: TransportError) -> None:
        """No answer will come (one error object per request: a shared one would gather every
        raiser's frames in its traceback)."""
        self.ended = True
        if not self.future.done():
            self.future.set_exception(TransportError(str(error), sent=error.sent))


class Origins:
    """The connections of one client, per origin: one while its streams fit the server's
    limit, past that another (up to `max_connections`), then a request waits for a free
    stream. One connect at a time per origin. A connection idle for 0.9 x `idle_timeout` is
    retired, not reused (a server with the same idle_timeout may be closing it). A subclass
    opens connections (`_open`), which offer usable, has_room, busy, last_used, retire, close."""

    def __init__(self, *, connect_timeout: float, idle_timeout: float, max_connections: int):
        self._connect_timeout = connect_timeout
        self._expiry = 0.9 * idle_timeout
        self._max_connections = max_connections
        self._pools: dict[tuple[str, int], list] = {}
        self._freed: dict[tuple[str, int], asyncio.Event] = {}   # set when a stream or a connect ends
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}

    async def open(self, url: str):
        """(a connection to the URL's origin with room for a stream, :authority, :path)."""
        origin, authority, path = split_https_url(url)
        return await self._connection(origin), authority, path

    async def send(self, target, method: str, body: bytes | None, content_type: str | None,
                   limit: float) -> ClientResponse:
        """One exchange on `open`'s target (the caller bounds it by `limit`)."""
        connection, authority, path = target
        return await connection.request(method, authority, path, body, content_type)

    async def _open(self, origin: tuple[str, int], freed: asyncio.Event):
        """A new connection to `origin`, within `connect_timeout` seconds."""
        raise NotImplementedError

    async def _connection(self, origin: tuple[str, int]):
        pool = self._pools.setdefault(origin, [])
        freed = self._freed.setdefault(origin, asyncio.Event())
        while True:
            now = asyncio.get_running_loop().time()
            for connection in list(pool):
                if not connection.usable or (not connection.busy and now - connection.last_used > self._expiry):
                    pool.remove(connection)
                    connection.retire()
            for connection in pool:
                if connection.has_room:
                    return connection
            if len(pool) < self._max_connections:
                lock = self._connecting.setdefault(origin, asyncio.Lock())
                if not lock.locked():   # others wait for this connect
                    async with lock:
                        try:
                            connection = await self._open(origin, freed)
                        except OSError as exc:   # TLS, timeouts and refusals too: nothing was sent
                            raise _connect_error(exc, origin, self._connect_timeout) from exc
                        finally:
                            freed.set()   # the waiters look again (and connect themselves on failure)
                        pool.append(connection)
                        return connection
            freed.clear()
            await freed.wait()

    async def aclose(self) -> None:
        for pool in self._pools.values():
            for connection in pool:
                connection.close()
        self._pools.clear()


def _connect_error(exc: OSError, origin: tuple[str, int], timeout: float) -> TransportError:
    if isinstance(exc, TimeoutError):
        return RequestTimeout(f"connect to {origin[0]}:{origin[1]} not done within {timeout}s", sent=False)
    return TransportError(f"cannot connect to {origin[0]}:{origin[1]}: {exc}", sent=False)


class Client:
    _limits: Deadlines | None = None   # the attempts' time limits, on the loop of the latest one

    def __init__(
        self,
        tls: TLSConfig,
        protocol: Literal["h2", "h3"] = "h2",
        *,
        timeout: float = 10.0,
        connect_timeout: float = 5.0,
        retries: int = 2,
        idle_timeout: float = 600.0,
        max_response: int = DEFAULT_MAX_RESPONSE,
    ):
        if protocol not in ("h2", "h3"):
            raise ValueError(f"protocol must be 'h2' or 'h3', not {protocol!r}")
        self.protocol = protocol
        self.timeout = timeout
        self.retries = retries
        options = dict(connect_timeout=connect_timeout, idle_timeout=idle_timeout, max_response=max_response)
        if protocol == "h2":
            from .client_h2 import H2Origins

            self._origins = H2Origins(tls, **options)
        else:
            from .client_h3 import H3Origins  # aioquic is the optional h3 extra

            self._origins = H3Origins(tls, **options)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        content_type: str | None = SDCP_MEDIA_TYPE,
        *,
        idempotent: bool = False,
        timeout: float | None = None,
    ) -> ClientResponse:
        """One HTTP exchange; raises TransportError (or RequestTimeout) when no response came."""
        method = method.upper()
        idempotent = idempotent or method in ("GET", "HEAD")
        limit = self.timeout if timeout is None else timeout
        for attempt in range(self.retries + 1):
            try:
                return await self._attempt(method, url, body, content_type, limit)
            except TransportError as exc:
                _drop_causes_tracebacks(exc)
                if attempt == self.retries or not (idempotent or not exc.sent):
                    raise
                log.info("retrying %s %s after: %s", method, url, exc)
                await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self._origins.aclose()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _attempt(self, method: str, url: str, body: bytes | None,
                       content_type: str | None, limit: float) -> ClientResponse:
        """One try, all of it within `limit` seconds. The request may have reached the server
        once its connection exists (`send` says sent=False itself where it certainly did not)."""
        sent = False
        task = asyncio.current_task()
        assert task is not None, "Client requests run in a task"
        limits = self._limits
        if limits is None or limits.loop is not task.get_loop():
            limits = self._limits = Deadlines(task.get_loop())
        try:
            with limits.timeout(task, limit):
                target = await self._origins.open(url)
                sent = True
                return await self._origins.send(target, method, body, content_type, limit)
        except TimeoutError as exc:
            raise RequestTimeout(f"no complete answer to {method} {url} within {limit}s",
                                 sent=sent) from exc


def _drop_causes_tracebacks(exc: BaseException) -> None:
    """Bounded memory: the tracebacks of what caused a transport error are dropped once it
    has been caught (an exception object raised again for each request on a broken
    connection would otherwise grow a traceback per raise); its message stays."""
    seen: set[int] = set()
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        cause.__traceback__ = None
        cause = cause.__cause__ or cause.__context__


M = TypeVar("M")


@dataclass(frozen=True)
class Reply(Generic[M]):
    status: int
    ok: bool = False                  # the expected answer: 200 with a message, or 204
    message: M | None = None          # the decoded answer (ok with an answer type)
    problem: Problem | None = None    # the RFC 9457 document of an error answer
    detail: str = ""                  # why it is not ok, for logs

    @property
    def kind(self):
        """The problem kind of an error answer, or None."""
        return self.problem.kind if self.problem is not None else None


async def call(client, method: str, url: str, message: Message | None = None,
               answer: type[M] | None = None, *, idempotent: bool = True,
               timeout: float | None = None) -> Reply[M]:
    """One exchange: 200 + `answer` decoded when an answer type is given, else 204."""
    body = message.to_cbor() if message is not None else None
    response = await client.request(method, url, body, idempotent=idempotent, timeout=timeout)
    expected = 200 if answer is not None else 204
    if response.status != expected:
        problem = response.problem()
        detail = f"HTTP {response.status}" if problem is None else \
            (f"{problem.kind.suffix}: {problem.detail}" if problem.detail else problem.kind.suffix)
        return Reply(response.status, problem=problem, detail=detail)
    if answer is None:
        return Reply(response.status, ok=True)
    try:
        return Reply(response.status, ok=True, message=answer.from_cbor(response.body))  # type: ignore[attr-defined]
    except ProblemError as exc:   # a peer that answers garbage is as good as none
        return Reply(response.status, detail=f"bad {answer.__name__}: {exc}")
