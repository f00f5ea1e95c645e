"""What both HTTP client adapters share, below them: the response, the errors that say no
response came (and whether the server may have processed the request), a request's header
block, one exchange's answer as it arrives, and the origin pool."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from urllib.parse import urlsplit

from sdcp_fast.core.problems import PROBLEM_MEDIA_TYPE, Problem

from .http import media_type
from .tlsconfig import TLSConfig

DEFAULT_MAX_RESPONSE = 16 << 20
# A request body at least this long announces its length (content-length), so that a server
# can refuse one over its limit before the upload; a shorter one (every SDCP round) does not:
# HTTP/2 and HTTP/3 frame the content, and the field costs header compression at both ends
ANNOUNCE_LENGTH_FROM = 16 << 10


def split_https_url(url: str) -> tuple[tuple[str, int], str, str]:
    """((host, port) of the origin, :authority, :path) of an https URL; ValueError otherwise.
    The origin's part is parsed once (`_split_origin`, cached): a peer's URLs differ in their
    paths (a session's output from each index, say), rarely in their origins."""
    end = url.find("/", 8)
    if end > 8 and url.startswith("https://") and url.isprintable() and " " not in url and "#" not in url \
            and not url.endswith("?"):
        origin, authority, _ = _split_origin(url[:end])
        return origin, authority, url[end:]
    return _split_whole(url)


@functools.lru_cache(maxsize=256)
def _split_origin(url: str) -> tuple[tuple[str, int], str, str]:
    return _split_whole(url)


def _split_whole(url: str) -> tuple[tuple[str, int], str, str]:
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


class ClientConnection:
    """What the origin pool reads of a connection (`usable`, `busy`, `last_used`; a subclass
    adds `has_room`, `retire` and `close`) and its requests' exchanges by stream id. `_ready`:
    what a new connection is awaited on before its first request."""

    def __init__(self, max_response: int):
        self._loop = asyncio.get_running_loop()
        self._max_response = max_response
        self._exchanges: dict[int, Exchange] = {}
        self._closed: TransportError | None = None   # set once no new stream may start
        self._ready = self._loop.create_future()
        self.last_used = self._loop.time()

    @property
    def usable(self) -> bool:
        return self._closed is None

    @property
    def busy(self) -> bool:
        return bool(self._exchanges)

    def _exchange(self, stream_id: int) -> Exchange:
        """A new request's exchange, kept by its stream id."""
        exchange = self._exchanges[stream_id] = Exchange(self._loop.create_future(), self._max_response)
        return exchange

    def _fail_all(self, error: TransportError, not_ready: Exception) -> None:
        """No new stream may start and no exchange will be answered; `not_ready`: what
        awaiting `_ready` raises if it was not ready yet."""
        if self._closed is None:
            self._closed = error
        for exchange in self._exchanges.values():
            exchange.fail(error)
        if not self._ready.done():
            self._ready.set_exception(not_ready)
            self._ready.exception()   # retrieved: nobody may be waiting


class Origins:
    """The connections of one client, per origin: one while its streams fit the server's
    limit, past that another (up to `max_connections`), then a request waits for a free
    stream. One connect at a time per origin. A connection idle for 0.9 x `idle_timeout` is
    retired, not reused (a server with the same idle_timeout may be closing it). A subclass
    opens `ClientConnection`s (`_open`)."""

    def __init__(self, tls: TLSConfig, *, connect_timeout: float, idle_timeout: float, max_response: int,
                 max_connections: int = 1):
        self._tls = tls
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._expiry = 0.9 * idle_timeout
        self._max_response = max_response
        self._max_connections = max_connections
        self._pools: dict[tuple[str, int], list] = {}
        self._freed: dict[tuple[str, int], asyncio.Event] = {}   # set when a stream or a connect ends
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}

    async def open(self, url: str):
        """(a connection to the URL's origin with room for a stream, :authority, :path)."""
        origin, authority, path = split_https_url(url)
        return await self._connection(origin), authority, path

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
