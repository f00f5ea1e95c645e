"""The router's front door for clients: HTTP/1.1 (optionally TLS with client certificates),
JSON in, server-sent events out. SDCP leaves client-facing APIs open (section 1.4); this one is

    POST /v1/generate                      {"prompt": "text"} or {"tokens": [ids]}, optional
                                           "max_new", "stop", "rule", "m_max", "sampling"
                                           {"temperature_milli", "top_k", "top_p_milli", "seed"},
                                           "stream" (default true)
        -> text/event-stream:  event: start   data: {"id", "epoch", "verifier", "drafter"}
                               event: tokens  data: {"index", "tokens", "text"}   (as committed)
                               event: end     data: {"finish", "tokens", "text", "seconds"}
        -> with "stream": false, one JSON object when the generation ends
    GET  /v1/generations                   every generation the router holds (JSON summaries)
    GET  /v1/generations/{id}[/stream?from=n]  session info (JSON), or its stream from index n
    POST /v1/generations/{id}/policy       {"sampling": {...}} -> {"from_round": r}
    GET  /v1/instances                     the router's registry (JSON)

Tokens are streamed exactly once each, in order: the stream reads the router's session
output (which takes every committed token once, section 6.7) from an index, so a client
that reconnects with from=n resumes without a gap or a repeat. Text is decoded on the whole
sequence and sent as the difference, holding back a trailing incomplete character.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from typing import Any

import h11

from ..core.messages import Sampling
from ..core.problems import ProblemError
from .service import RouterService
from .sessions import RouterSession

log = logging.getLogger("sdcp_fast.router.frontdoor")
MAX_BODY = 1 << 20
READ_TIMEOUT_S = 10.0


class HTTPError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


class FrontDoor:
    def __init__(self, router: RouterService, *, host: str, port: int,
                 ssl_context: ssl.SSLContext | None = None):
        self.router = router
        self.host, self.port = host, port
        self.ssl_context = ssl_context
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._connection, self.host, self.port,
                                                  ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    # ------------------------------------------------------------------ HTTP/1.1

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 << 10)
        try:
            request, body = await asyncio.wait_for(self._read_request(conn, reader), READ_TIMEOUT_S)
            await self._route(conn, writer, request, body)
        except HTTPError as exc:
            await self._send_json(conn, writer, exc.status, {"error": exc.detail})
        except ProblemError as exc:
            await self._send_json(conn, writer, exc.problem.status,
                                  {"error": exc.problem.kind.suffix, "detail": exc.problem.detail})
        except (TimeoutError, h11.RemoteProtocolError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.exception("front door request failed")
            with contextlib.suppress(Exception):
                await self._send_json(conn, writer, 500, {"error": "internal error"})
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _read_request(self, conn: h11.Connection, reader) -> tuple[h11.Request, bytes]:
        request, body = None, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    raise HTTPError(413, "body too large")
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed")

    async def _route(self, conn, writer, request: h11.Request, body: bytes) -> None:
        method = request.method.decode()
        target = request.target.decode()
        path, _, query = target.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        parts = [p for p in path.split("/") if p]
        if method == "POST" and parts == ["v1", "generate"]:
            return await self._generate(conn, writer, _json(body))
        if method == "GET" and parts == ["v1", "generations"]:
            summaries = [{k: v for k, v in s.info().items() if k not in ("tokens", "history")}
                         for s in list(self.router.sessions.values())]
            return await self._send_json(conn, writer, 200, {"generations": summaries})
        if method == "GET" and parts == ["v1", "instances"]:
            return await self._send_json(conn, writer, 200, {"instances": self.router.registry.snapshot()})
        if len(parts) >= 3 and parts[:2] == ["v1", "generations"]:
            s = self._session(parts[2])
            if method == "GET" and len(parts) == 3:
                return await self._send_json(conn, writer, 200, s.info())
            if method == "GET" and parts[3:] == ["stream"]:
                return await self._stream(conn, writer, s, _query_int(params.get("from", "0"), "from"))
            if method == "POST" and parts[3:] == ["policy"]:
                sampling = _sampling(_json(body).get("sampling"))
                from_round = await self.router.update_policy(s, sampling)
                return await self._send_json(conn, writer, 200, {"from_round": from_round})
        raise HTTPError(404, f"no resource {method} {path}")

    # ------------------------------------------------------------------ resources

    async def _generate(self, conn, writer, req: dict[str, Any]) -> None:
        backend = self.router.backend
        if "tokens" in req:
            tokens = req["tokens"]
            if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < backend.vocab_size
                                                       for t in tokens):
                raise HTTPError(400, "tokens must be a list of token ids in the vocabulary")
        elif isinstance(req.get("prompt"), str):
            try:
                tokens = backend.encode(req["prompt"])
            except Exception as exc:
                raise HTTPError(400, f"prompt cannot be encoded: {exc}") from None
        else:
            raise HTTPError(400, 'give "prompt" (text) or "tokens" (ids)')
        overrides = {}
        for key in ("max_new", "rule", "m_max", "low_rounds", "low_ratio", "self_load", "self_max"):
            if key in req:
                overrides[key] = _int(req[key], key)
        if "stop" in req:
            if not isinstance(req["stop"], list):
                raise HTTPError(400, "stop must be a list of token ids")
            overrides["stop"] = tuple(_int(t, "stop") for t in req["stop"])
        if "sampling" in req:
            overrides["sampling"] = _sampling(req["sampling"])
        contract = self.router.make_contract(**overrides)
        s = await self.router.generate(list(tokens), contract)
        if req.get("stream", True):
            await self._stream(conn, writer, s, 0, announce=True)
            return
        while not s.done:
            await s.wait_changed(1.0)
        await self._send_json(conn, writer, 200, self._end(s, backend.decode(s.tokens)))

    async def _stream(self, conn, writer, s: RouterSession, from_index: int, *,
                      announce: bool = False) -> None:
        decode = self.router.backend.decode
        writer.write(conn.send(h11.Response(status_code=200, headers=[
            ("content-type", "text/event-stream"), ("cache-control", "no-store"),
            ("connection", "close")])))
        if announce:
            await self._event(conn, writer, "start", {"id": s.id.hex(), "epoch": s.epoch,
                                                      "verifier": s.verifier, "drafter": s.drafter,
                                                      "prompt_tokens": len(s.prompt)})
        index = min(from_index, len(s.tokens)) if s.done else from_index
        sent_text = decode(s.tokens[:index])
        while True:
            changed = s.changed_event()
            if len(s.tokens) > index:
                new = s.tokens[index:]
                text = decode(s.tokens)
                settled = text[:-1] if text.endswith("\ufffd") else text
                delta = settled[len(sent_text):] if settled.startswith(sent_text) else ""
                await self._event(conn, writer, "tokens", {"index": index, "tokens": new, "text": delta})
                index += len(new)
                if settled.startswith(sent_text):
                    sent_text = settled
            if s.done and index >= len(s.tokens):
                await self._event(conn, writer, "end", self._end(s, decode(s.tokens)))
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 15.0)
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    def _end(self, s: RouterSession, text: str) -> dict:
        return {"id": s.id.hex(), "finish": s.finish.name.lower() if s.finish else None,
                "tokens": len(s.tokens), "text": text, "epoch": s.epoch,
                "seconds": None if s.finished_at is None else round(s.finished_at - s.created, 4),
                "first_token_s": None if s.first_token_at is None else round(s.first_token_at - s.created, 4)}

    async def _event(self, conn, writer, name: str, data: dict) -> None:
        payload = f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
        writer.write(conn.send(h11.Data(data=payload)))
        await writer.drain()

    async def _send_json(self, conn, writer, status: int, obj: dict) -> None:
        body = json.dumps(obj, separators=(",", ":")).encode()
        with contextlib.suppress(h11.LocalProtocolError):
            writer.write(conn.send(h11.Response(status_code=status, headers=[
                ("content-type", "application/json"), ("content-length", str(len(body))),
                ("connection", "close")])))
            writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()

    def _session(self, hex_id: str) -> RouterSession:
        try:
            s = self.router.sessions.get(bytes.fromhex(hex_id))
        except ValueError:
            s = None
        if s is None:
            raise HTTPError(404, "no such generation")
        return s


def _json(body: bytes) -> dict:
    try:
        obj = json.loads(body or b"{}")
    except ValueError:
        raise HTTPError(400, "body is not JSON") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, "body must be a JSON object")
    return obj


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)   # JSON true is not 1


def _int(value, what: str) -> int:
    """A JSON member that must be a non-negative integer: 1.5, "1" and true are refused."""
    if not _is_int(value):
        raise HTTPError(400, f"{what} must be an integer")
    if value < 0:
        raise HTTPError(400, f"{what} must not be negative")
    return value


def _query_int(text: str, what: str) -> int:
    """A non-negative decimal integer in the query string."""
    if not text.isascii() or not text.isdecimal():
        raise HTTPError(400, f"{what} must be a non-negative integer")
    return int(text)


def _sampling(obj) -> Sampling:
    if not isinstance(obj, dict):
        raise HTTPError(400, "sampling must be an object")
    return Sampling.from_obj(obj)   # unknown keys: sdcp-bad-contract (422)


def frontdoor_ssl_context(tls) -> ssl.SSLContext:
    """TLS 1.3 with a client certificate from the deployment's CA, ALPN http/1.1."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(tls.cert, tls.key)
    context.load_verify_locations(cafile=tls.ca)
    context.set_alpn_protocols(["http/1.1"])
    return context
