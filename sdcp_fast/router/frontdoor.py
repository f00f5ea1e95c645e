"""The router's front door for clients: JSON in, server-sent events out, served as a plain
HTTP handler by `transport.asgi.serve_web` (HTTP/1.1; TLS with client certificates as an
option). SDCP leaves client-facing APIs open (section 1.4); this one is

    POST /v1/generate                      {"prompt": "text"} or {"tokens": [ids]}, optional
                                           "max_new", "stop", "rule", "m_max", "sampling"
                                           {"temperature_milli", "top_k", "top_p_milli", "seed"},
                                           "stream" (default true)
        -> text/event-stream:  event: start   data: {"id", "epoch", "verifier", "drafter"}
                               event: tokens  data: {"index", "tokens", "text"}   (as committed)
                               event: end     data: {"finish", "tokens", "text", "seconds"}
                               (tokens and end carry the SSE id: tokens sent so far)
        -> with "stream": false, one JSON object when the generation ends
    GET  /v1/generations                   every generation the router owns or streams (JSON
                                           summaries)
    GET  /v1/generations/{id}[/stream?from=n]  session info (JSON), or its stream from index n
                                           (or from the header Last-Event-ID),
                                           at ANY router of the deployment (the owner's, or
                                           another's that follows the session's commit log)
    POST /v1/generations/{id}/policy       {"sampling": {...}} -> {"from_round": r}
    GET  /v1/instances                     the router's registry (JSON)
    GET  /v1/models, POST /v1/completions, POST /v1/chat/completions
                                           the OpenAI-compatible API (openai_api.py)
    GET  /health, GET /metrics             readiness and the router's Prometheus series

Errors are JSON `{"error": ...}` with a 4xx status (a problem's suffix and detail for
problems the router raises); a 503 (no verifier could take the session now, the admission queue full, the router at
max_sessions) or 429 carries `Retry-After`. Tokens are streamed exactly once each, in order: the stream
reads the router's session output (which takes every committed token once, section 6.7)
from an index, so a client that reconnects with from=n resumes without a gap or a repeat, here or at another router (router/follow.py).
Text comes from router/textstream.py (the OpenAI routes' too): decoded on the whole
sequence and sent as the difference, holding back a trailing incomplete character.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ..core.messages import Sampling
from ..core.problems import ProblemError
from ..transport.asgi import StreamingResponse, WebRequest, WebResponse
from .bodies import is_int, json_object, resume_index
from .service import RouterService
from .sessions import RECHECK_S, RouterSession
from .textstream import TextStream

log = logging.getLogger("sdcp_fast.router.frontdoor")
RETRY_AFTER_S = 1     # what a 503 / 429 tells the client to wait before it asks again


def error_response(status: int, body: dict) -> WebResponse:
    """A JSON error; one that says "busy now" (429, 503) says when to ask again."""
    headers = (("retry-after", str(RETRY_AFTER_S)),) if status in (429, 503) else ()
    return WebResponse(status, json.dumps(body, separators=(",", ":")).encode(), headers=headers)


class HTTPError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


class FrontDoor:
    """The WebHandler of the front door: `serve_web(FrontDoor(router, ...), host=..., port=...)`.
    `openai` serves the OpenAI routes and `status` /health and /metrics, when given."""

    def __init__(self, router: RouterService, *, openai=None, status=None):
        self.router = router
        self.pages = [page for page in (status, openai) if page is not None]

    async def handle(self, request: WebRequest) -> WebResponse | StreamingResponse:
        for page in self.pages:
            answer = await page.answer(request)
            if answer is not None:
                return answer
        try:
            return await self._route(request)
        except HTTPError as exc:
            return error_response(exc.status, {"error": exc.detail})
        except ProblemError as exc:
            return error_response(exc.problem.status, {"error": exc.problem.kind.suffix,
                                                       "detail": exc.problem.detail})

    async def _route(self, request: WebRequest) -> WebResponse | StreamingResponse:
        method, path, body = request.method, request.path, request.body
        parts = [p for p in path.split("/") if p]
        if method == "POST" and parts == ["v1", "generate"]:
            return await self._generate(json_object(body, HTTPError))
        if method == "GET" and parts == ["v1", "generations"]:
            sessions = [*self.router.sessions.values(), *self.router.followed.values()]
            summaries = [{k: v for k, v in s.info().items() if k not in ("tokens", "history")}
                         for s in sessions]
            return WebResponse.json(200, {"generations": summaries})
        if method == "GET" and parts == ["v1", "instances"]:
            return WebResponse.json(200, {"instances": self.router.registry.snapshot()})
        if len(parts) >= 3 and parts[:2] == ["v1", "generations"]:
            s = await self._session(parts[2])
            if method == "GET" and len(parts) == 3:
                return WebResponse.json(200, s.info())
            if method == "GET" and parts[3:] == ["stream"]:
                return self._stream(s, resume_index(request, HTTPError))
            if method == "POST" and parts[3:] == ["policy"]:
                sampling = _sampling(json_object(body, HTTPError).get("sampling"))
                from_round = await self.router.update_policy(s, sampling)
                return WebResponse.json(200, {"from_round": from_round})
        raise HTTPError(404, f"no resource {method} {path}")

    # ------------------------------------------------------------------ resources

    async def _generate(self, req: dict[str, Any]) -> WebResponse | StreamingResponse:
        backend = self.router.backend
        if "tokens" in req:
            tokens = req["tokens"]
            if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < backend.vocab_size
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
        s = await self.router.generate(list(tokens), contract, door={"kind": "generate"})
        if req.get("stream", True):
            return self._stream(s, 0, announce=True)
        while not s.done:
            await s.wait_changed(1.0)
        return WebResponse.json(200, self._end(s, backend.decode(s.tokens)))

    def _stream(self, s: RouterSession, from_index: int, *, announce: bool = False) -> StreamingResponse:
        return StreamingResponse(200, self._events(s, from_index, announce))

    async def _events(self, s: RouterSession, from_index: int, announce: bool) -> AsyncIterator[bytes]:
        decode = self.router.backend.decode
        if announce:
            yield _event("start", {"id": s.id.hex(), "epoch": s.epoch, "verifier": s.verifier,
                                   "drafter": s.drafter, "prompt_tokens": len(s.prompt)})
        index = min(from_index, len(s.tokens)) if s.done else from_index
        text = TextStream(decode)
        text.feed(s.tokens[:index])        # the text of the tokens before `from` counts as sent
        while True:
            changed = s.changed_event()
            if len(s.tokens) > index:
                new = s.tokens[index:]
                delta = text.feed(s.tokens)
                index += len(new)
                yield _event("tokens", {"index": index - len(new), "tokens": new, "text": delta}, index)
            if s.done and index >= len(s.tokens):
                yield _event("end", self._end(s, decode(s.tokens)), index)
                return
            await s.wait_changed(RECHECK_S, changed)

    def _end(self, s: RouterSession, text: str) -> dict:
        return {"id": s.id.hex(), "finish": s.finish.name.lower() if s.finish else None,
                "tokens": len(s.tokens), "text": text, "epoch": s.epoch,
                "seconds": None if s.finished_at is None else round(s.finished_at - s.created, 4),
                "first_token_s": None if s.first_token_at is None else round(s.first_token_at - s.created, 4)}

    async def _session(self, hex_id: str) -> RouterSession:
        try:
            sid = bytes.fromhex(hex_id)
        except ValueError:
            sid = b""
        s = await self.router.find(sid) if len(sid) == 16 else None
        if s is None:
            raise HTTPError(404, "no such generation")
        return s


def _event(name: str, data: dict, event_id: int | None = None) -> bytes:
    """One server-sent event; the id of a tokens or end event is the number of tokens sent
    so far (what `from`, or an SSE client's Last-Event-ID, resumes from)."""
    head = "" if event_id is None else f"id: {event_id}\n"
    return f"{head}event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _int(value, what: str) -> int:
    """A JSON member that must be a non-negative integer: 1.5, "1" and true are refused."""
    if not is_int(value):
        raise HTTPError(400, f"{what} must be an integer")
    if value < 0:
        raise HTTPError(400, f"{what} must not be negative")
    return value


def _sampling(obj) -> Sampling:
    if not isinstance(obj, dict):
        raise HTTPError(400, "sampling must be an object")
    return Sampling.from_obj(obj)   # unknown keys: sdcp-bad-contract (422)
