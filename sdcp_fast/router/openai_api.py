"""The OpenAI-compatible routes of the router's front door (what vLLM serves, so the
official `openai` client and the tools built on it work unchanged):

    GET  /v1/models
    POST /v1/completions          prompt (text, or token ids), streaming or not
    POST /v1/chat/completions     messages, rendered with the tokenizer's chat template
                                  (router/chat.py), streaming or not

Besides, as vLLM has them: `POST /tokenize` ({"prompt"} or {"messages"} -> {"count",
"max_model_len", "tokens"}) and `POST /detokenize` ({"tokens"} -> {"prompt"}); `GET
/v1/models` gives the served name and `max_model_len`.

Members: `model` (the served model name), `max_tokens` (chat also `max_completion_tokens`),
`temperature`, `top_p`, `top_k`, `seed`, `stop` (a string or a list: matched on the text;
the text before the stop string is returned), `n`, `stream`, `stream_options`
(`include_usage`), `logprobs` (completions: the number of alternatives, 0-20; chat: true,
with `top_logprobs` 0-20), `echo` (completions: the prompt's text before the completion's),
and vLLM's `return_tokens_as_token_ids` and `logprobs_mode` ("raw_logprobs", the default
unless the router's config says otherwise, or "processed_logprobs"). Each choice is one SDCP
session under the router's default contract:

- temperature 0 -> rule 1 (greedy: the output is the target's argmax decoding);
  temperature > 0 -> rule 2 (speculative sampling: the output follows the target's
  distribution under temperature, top_k, top_p, seed); temperature absent -> the
  deployment's default contract (rule and sampling profile), top_k / top_p / seed applied
  on top of its profile;
- the model's end-of-sequence tokens are stop tokens of the contract (they end the
  generation at the verifier) and are left out of the text;
- a stop string ends the session at once (router.cancel: the verifier and drafter stop),
  and so does a client that disconnects.

Log-probabilities are the target's own, as the verifier scored each committed token
(logprob_format.py): "raw_logprobs" is the log-softmax of the target's logits (vLLM V1's
default), "processed_logprobs" the log of p after the request's temperature, top-k and
top-p (the distribution the acceptance rule samples; -9999.0 for excluded tokens). Only a
session that asks pays for them. `n` > 1 makes n sessions with the same prompt, whose
verifier prefills it once; with a seed, choice i samples with seed + i. `echo` together
with `logprobs` (the prompt's log-probabilities) is refused, as are `best_of` > 1,
`suffix`, penalties, `logit_bias`, tools and response formats other than text: an unused
member is never silently ignored.

finish_reason is "stop" (an end-of-sequence token or a stop string) or "length"
(max_tokens). Streams are server-sent events of chunk objects ending with `data: [DONE]`;
each event carries an SSE `id:`, the number of completion tokens its text covers. A stream
cut off (its router died, say) resumes at ANY router of the deployment:

    GET /v1/completions/{id}/stream?from=n         (or the header Last-Event-ID: n)
    GET /v1/chat/completions/{id}/stream?from=n

with the completion's id (`cmpl-...`, `chatcmpl-...`: the session id) and the last event id
received: the text from there on, as the first stream would have sent it (the text stream
fed the first n tokens again, so held-back text and stop strings come out the same), then
the finish chunk, usage and `data: [DONE]`. A non-streaming request cannot be resumed (its
id comes with the answer), nor a stream of n > 1 choices (its events carry no id). A
resumed stream at a router that only follows the session (not its owner) has null
log-probabilities: they travel with the verifier's output, not in the commit log.
errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with a 4xx
status for bad input (404 for an unknown model), 503 when no verifier can take the
request. A generation the contract ends with "fail" (only when the operator's contract
asks for it) is a 500 error, or an error chunk in a stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..core.messages import Sampling
from ..core.problems import ProblemError
from ..transport.asgi import StreamingResponse, WebRequest, WebResponse
from . import chat
from .bodies import is_int, json_object, resume_index
from .frontdoor import error_response
from .logprob_format import LogprobFormat
from .service import RouterService
from .sessions import RECHECK_S, RouterSession
from .textstream import TextStream

RESUME = re.compile(r"^/v1/(?P<chat>chat/)?completions/(?P<id>[^/]+)/stream$")
MAX_STOP_STRINGS = 16
MAX_N = 16                 # choices per request
MAX_TOP_LOGPROBS = 20
RULE_GREEDY, RULE_SAMPLING = 1, 2
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
UNSUPPORTED = {   # member -> the value that means "not used" (anything else is refused)
    "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
}
CHAT_UNSUPPORTED = {"echo": (None, False)}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> WebResponse:
        return error_response(self.status, self.body())


@dataclass
class Request:
    """One parsed completion request."""

    chat: bool
    prompt: list[int]
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool
    rule: int
    sampling: Sampling | None
    n: int = 1
    echo: bool = False
    logprobs: dict | None = None     # {"top": k, "processed": bool}: the door's ask
    token_ids: bool = False          # return_tokens_as_token_ids


class OpenAIRoutes:
    def __init__(self, router: RouterService, model_name: str, *, logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: one of {', '.join(LOGPROBS_MODES)}, not {logprobs_mode!r}")
        self.router = router
        self.model_name = model_name
        self.logprobs_mode = logprobs_mode
        self.eos = chat.eos_ids(router.backend)
        self.created = int(time.time())
        backend = router.backend
        self.context = getattr(backend, "max_seq_len", None) or getattr(getattr(backend, "cfg", None),
                                                                         "max_seq_len", None)

    async def answer(self, request: WebRequest) -> WebResponse | StreamingResponse | None:
        """The answer to an OpenAI route, or None for another path."""
        routes = {"/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST",
                  "/tokenize": "POST", "/detokenize": "POST"}
        path = request.path.rstrip("/")
        resume = RESUME.match(path)
        if path not in routes and resume is None:
            return None
        try:
            if resume is not None:
                if request.method != "GET":
                    raise APIError(405, f"{request.method} is not allowed on {path}")
                return await self.resume(resume.group("chat") is not None, resume.group("id"), request)
            if request.method != routes[path]:
                raise APIError(405, f"{request.method} is not allowed on {path}")
            if path == "/v1/models":
                return WebResponse.json(200, {"object": "list", "data": [self.model_card()]})
            if path == "/tokenize":
                return WebResponse.json(200, self.tokenize(json_object(request.body, APIError)))
            if path == "/detokenize":
                return WebResponse.json(200, self.detokenize(json_object(request.body, APIError)))
            return await self.complete(self.parse(json_object(request.body, APIError), chat=path.endswith("chat/completions")))
        except APIError as exc:
            return exc.response()
        except ProblemError as exc:
            p = exc.problem
            return APIError(p.status, p.detail or p.kind.title, code=p.kind.suffix).response()

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "sdcp-fast",
                "root": self.model_name, "max_model_len": self.context}

    def tokenize(self, body: dict[str, Any]) -> dict:
        """vLLM's POST /tokenize: a prompt's token ids ("prompt"; "add_special_tokens" is
        the tokenizer's default), or a chat's ("messages", with the generation prompt)."""
        self.check_model(body, required=False)
        for name in ("add_generation_prompt", "add_special_tokens"):   # only the way prompts are made here
            if body.get(name) not in (None, True):
                raise APIError(400, f"{name} other than true is not supported", param=name)
        if "messages" in body:
            tokens = self.chat_prompt(body["messages"])
        elif isinstance(body.get("prompt"), str):
            tokens = self.completion_prompt(body["prompt"])
        else:
            raise APIError(400, "give prompt (text) or messages", param="prompt")
        return {"count": len(tokens), "max_model_len": self.context, "tokens": tokens, "token_strs": None}

    def detokenize(self, body: dict[str, Any]) -> dict:
        """vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        self.check_model(body, required=False)
        tokens = body.get("tokens")
        vocab = self.router.backend.vocab_size
        if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": self.router.backend.decode(tokens)}

    def check_model(self, body: dict[str, Any], *, required: bool = True) -> None:
        model = body.get("model")
        if model is None and not required:
            return
        if not isinstance(model, str):
            raise APIError(400, "model is required (a string)", param="model")
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", type="NotFoundError")

    # ------------------------------------------------------------------ requests

    def parse(self, body: dict[str, Any], *, chat: bool) -> Request:
        self.check_model(body)
        for name, unused in {**UNSUPPORTED, **(CHAT_UNSUPPORTED if chat else {})}.items():
            if body.get(name) not in unused:
                raise APIError(400, f"{name} is not supported", param=name)
        n = body.get("n")
        if n is None:
            n = 1
        if not is_int(n) or not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be an integer in [1, {MAX_N}]", param="n")
        echo = False if chat else _bool(body.get("echo"), "echo", False)
        logprobs = self.logprobs_ask(body, chat)
        if echo and logprobs is not None:
            raise APIError(400, "echo together with logprobs (the prompt's log-probabilities) is not supported",
                           param="echo")
        token_ids = _bool(body.get("return_tokens_as_token_ids"), "return_tokens_as_token_ids", False)
        response_format = body.get("response_format")
        if response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format other than text is not supported", param="response_format")
        prompt = self.chat_prompt(body.get("messages")) if chat else self.completion_prompt(body.get("prompt"))
        if not prompt:
            raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
        stream = _bool(body.get("stream"), "stream", False)
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream):
            raise APIError(400, "stream_options needs stream = true and must be an object", param="stream_options")
        include_usage = _bool((options or {}).get("include_usage"), "stream_options.include_usage", False)
        rule, sampling = self.sampling(body)
        return Request(chat, prompt, self.max_tokens(body, len(prompt), chat), self.stop_strings(body.get("stop")),
                       stream, include_usage, rule, sampling, n, echo, logprobs, token_ids)

    def logprobs_ask(self, body: dict[str, Any], chat: bool) -> dict | None:
        """What the door asks of the verifier: {"top": alternatives, "processed": bool}, or None."""
        value, top_value = body.get("logprobs"), body.get("top_logprobs")
        if chat:
            asked = _bool(value, "logprobs", False)
            if top_value is not None and (not is_int(top_value) or not 0 <= top_value <= MAX_TOP_LOGPROBS):
                raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
            if top_value and not asked:
                raise APIError(400, "top_logprobs needs logprobs = true", param="top_logprobs")
            top = top_value or 0
        else:
            if top_value is not None:
                raise APIError(400, "top_logprobs is a chat member; completions take logprobs = N",
                               param="top_logprobs")
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise APIError(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
            asked, top = value is not None, value or 0
        mode = body.get("logprobs_mode", self.logprobs_mode)
        if mode not in LOGPROBS_MODES:
            raise APIError(400, f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}", param="logprobs_mode")
        if not asked:
            return None
        return {"top": top, "processed": mode == "processed_logprobs"}

    def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]          # a batch of one
        if isinstance(prompt, str):
            try:
                return list(self.router.backend.encode(prompt))
            except Exception as exc:
                raise APIError(400, f"the prompt cannot be encoded: {exc}", param="prompt") from None
        if isinstance(prompt, list) and all(is_int(t) for t in prompt):
            vocab = self.router.backend.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        raise APIError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                       param="prompt")

    def chat_prompt(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        plain = []
        for n, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{n}] must be an object with a role", param="messages")
            content = m.get("content")
            if isinstance(content, list):    # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"messages[{n}]: only text content parts are supported",
                                   param="messages")
                content = "".join(p["text"] for p in content)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise APIError(400, f"messages[{n}].content must be text", param="messages")
            plain.append({"role": m["role"], "content": content})
        try:
            return chat.chat_prompt(self.router.backend, plain)
        except Exception as exc:   # a template that refuses the roles given, or bad text
            raise APIError(400, f"the messages cannot be rendered: {exc}", param="messages") from None

    def max_tokens(self, body: dict, prompt_len: int, is_chat: bool) -> int:
        name = "max_completion_tokens" if is_chat and body.get("max_completion_tokens") is not None \
            else "max_tokens"
        value = body.get(name)
        room = None if self.context is None else self.context - prompt_len
        if room is not None and room < 1:
            raise APIError(400, f"this model's maximum context length is {self.context} tokens; "
                                f"the prompt has {prompt_len}", param="messages" if is_chat else "prompt")
        if value is None:
            default = self.router.config.contract.max_new
            return default if room is None else min(default, room)
        if not is_int(value) or value < 1:
            raise APIError(400, f"{name} must be a positive integer", param=name)
        if room is not None and value > room:
            raise APIError(400, f"this model's maximum context length is {self.context} tokens; the prompt "
                                f"has {prompt_len} and {name} asks for {value}", param=name)
        return value

    def stop_strings(self, stop) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise APIError(400, "stop must be a string or a list of strings", param="stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        return [s for s in stops if s]

    def sampling(self, body: dict) -> tuple[int, Sampling | None]:
        """(rule, profile) of the request (see the module's docstring)."""
        default = self.router.config.contract
        profile = {} if default.sampling is None else dict(default.sampling.to_obj())
        rule = default.rule
        temperature = _number(body.get("temperature"), "temperature", 0.0, 2.0)
        if temperature is not None:
            rule = RULE_GREEDY if temperature == 0 else RULE_SAMPLING
            profile = {"temperature_milli": round(temperature * 1000)}
        top_p = _number(body.get("top_p"), "top_p", 0.0, 1.0)
        if top_p is not None:
            if top_p <= 0:
                raise APIError(400, "top_p must be in (0, 1]", param="top_p")
            profile.pop("top_p_milli", None)
            if top_p < 1:
                profile["top_p_milli"] = max(1, round(top_p * 1000))
        top_k = body.get("top_k")
        if top_k is not None:
            if not is_int(top_k) or top_k < -1:
                raise APIError(400, "top_k must be an integer >= -1 (-1 or 0: all tokens)", param="top_k")
            profile.pop("top_k", None)
            if top_k > 0:
                profile["top_k"] = top_k
        seed = body.get("seed")
        if seed is not None:
            if not is_int(seed) or not 0 <= seed < 1 << 64:
                raise APIError(400, "seed must be an integer in [0, 2^64)", param="seed")
            profile["seed"] = seed
        return rule, Sampling.from_obj(profile) if profile else None

    # ------------------------------------------------------------------ generation

    async def complete(self, req: Request) -> WebResponse | StreamingResponse:
        stop = tuple(sorted({*self.router.config.contract.stop, *self.eos}))
        created = int(time.time())
        sessions = await self.open_choices(req, stop, created)
        replies = [Reply.of(sessions[0])] * len(sessions)   # one completion: its first session's id
        if req.stream:
            return StreamingResponse(200, self.stream(sessions, replies, 0))
        try:
            choices = await asyncio.gather(*(self.whole_choice(s) for s in sessions))
        finally:
            for s in sessions:
                self.router.cancel(s)      # a client gone before the end: no-op once it ended
        for choice, used in choices:
            if choice["finish_reason"] == "fail":
                raise APIError(500, f"the generation failed after {used} tokens (the contract's escalation "
                                    "ladder ended in fail)", code="sdcp_fail")
        usage = _usage(len(req.prompt), sum(used for _, used in choices))
        return WebResponse.json(200, replies[0].whole([choice for choice, _ in choices], usage))

    async def open_choices(self, req: Request, stop: tuple[int, ...], created: int) -> list[RouterSession]:
        """One session per choice (n > 1: the verifier prefills the shared prompt once, and
        with a seed choice i samples with seed + i); if one cannot be opened, the others are
        cancelled and the error is the request's."""
        door = {"kind": "chat" if req.chat else "completions", "created": created, "model": self.model_name,
                "stop": req.stop, "include_usage": req.include_usage, "n": req.n, "echo": req.echo,
                "token_ids": req.token_ids}
        if req.logprobs is not None:
            door["logprobs"] = req.logprobs

        def sampling(i: int) -> Sampling | None:
            if req.sampling is None or req.sampling.seed is None or i == 0:
                return req.sampling
            return dataclasses.replace(req.sampling, seed=(req.sampling.seed + i) % (1 << 64))

        opened = await asyncio.gather(*(
            self.router.generate(req.prompt, self.router.make_contract(
                max_new=req.max_tokens, rule=req.rule, sampling=sampling(i), stop=stop),
                door={**door, "index": i})
            for i in range(req.n)), return_exceptions=True)
        failed = [x for x in opened if isinstance(x, BaseException)]
        if failed:
            for x in opened:
                if isinstance(x, RouterSession):
                    self.router.cancel(x)
            raise failed[0]
        return list(opened)

    async def whole_choice(self, s: RouterSession) -> tuple[dict, int]:
        """A non-streamed choice and its completion tokens."""
        text, last = "", Piece("", None, 0)
        async for last in self.follow(s, 0):
            text += last.delta
        if s.door.get("echo"):
            text = self.router.backend.decode(list(s.prompt)) + text
        logprobs = self.logprobs_of(s, 0, last.used, 0)
        return Reply.of(s).choice(text, last.finish, logprobs), last.used

    def logprobs_of(self, s: RouterSession, first: int, stop: int, offset: int) -> dict | None:
        """The choice's `logprobs` member for its tokens first..stop-1 (None: not asked)."""
        ask = s.door.get("logprobs")
        if ask is None:
            return None
        fmt = LogprobFormat(self.router.backend.decode, self.eos, ask.get("top", 0), bool(s.door.get("token_ids")))
        if s.door.get("kind") == "chat":
            return fmt.chat(s.tokens, s.logprobs, first, stop)
        return fmt.completion(s.tokens, s.logprobs, first, stop, offset)

    async def resume(self, chat: bool, cid: str, request: WebRequest) -> StreamingResponse:
        """A stream again from completion token n (`from`, or Last-Event-ID), at this router
        whichever router owns the session."""
        kind = "chat" if chat else "completions"
        prefix = "chatcmpl-" if chat else "cmpl-"
        hex_id = cid[len(prefix):] if cid.startswith(prefix) else ""
        s = None
        if len(hex_id) == 32 and all(c in "0123456789abcdef" for c in hex_id):
            s = await self.router.find(bytes.fromhex(hex_id))
        if s is None or s.door.get("kind") != kind:
            raise APIError(404, f"no streamed {kind} completion {cid!r}", param="id", code="not_found",
                           type="NotFoundError")
        start = resume_index(request, lambda status, message: APIError(status, message, param="from"))
        return StreamingResponse(200, self.stream([s], [Reply.of(s)], start))

    async def stream(self, sessions: list[RouterSession], replies: list[Reply], start: int) -> AsyncIterator[bytes]:
        """The chunks of every choice (each event with an SSE id, the completion tokens it
        covers, when there is one choice), the usage chunk if asked, `data: [DONE]`."""
        used = [start] * len(sessions)
        single = len(sessions) == 1
        try:
            if single:
                async for obj, count in self.choice_chunks(sessions[0], replies[0], start, used, 0):
                    yield _sse(obj, count)
            else:
                queue: asyncio.Queue = asyncio.Queue()

                async def pump(n: int) -> None:
                    try:
                        async for item in self.choice_chunks(sessions[n], replies[n], start, used, n):
                            queue.put_nowait(item)
                    finally:
                        queue.put_nowait(None)

                pumps = [asyncio.ensure_future(pump(n)) for n in range(len(sessions))]
                try:
                    running = len(pumps)
                    while running:
                        item = await queue.get()
                        if item is None:
                            running -= 1
                            continue
                        yield _sse(item[0], None)
                    for task in pumps:
                        task.result()   # a pump's failure is the stream's
                finally:
                    for task in pumps:
                        task.cancel()
            if sessions[0].door.get("include_usage"):
                yield _sse(replies[0].usage_chunk(_usage(len(sessions[0].prompt), sum(used))),
                           used[0] if single else None)
            yield b"data: [DONE]\n\n"
        finally:
            for s in sessions:
                self.router.cancel(s)      # the client went away (or it ended: then a no-op)

    async def choice_chunks(self, s: RouterSession, reply: Reply, start: int, used: list[int],
                            n: int) -> AsyncIterator[tuple[dict, int]]:
        """(chunk, tokens covered) of one choice; `used[n]` follows its completion tokens."""
        index = s.door.get("index", 0)
        if start == 0:
            if reply.chat:
                yield reply.chunk({"role": "assistant", "content": ""}, index=index), 0
            elif s.door.get("echo"):
                yield reply.chunk(self.router.backend.decode(list(s.prompt)), index=index), 0
        last = Piece("", None, start)
        offset = None
        async for last in self.follow(s, start):
            used[n] = last.used
            logprobs = None
            if s.door.get("logprobs") is not None and last.used > last.first:
                if offset is None:   # characters of the text before this chunk (completions' text_offset)
                    offset = len(self.router.backend.decode(s.tokens[:last.first])) if last.first else 0
                logprobs = self.logprobs_of(s, last.first, last.used, offset)
                offset += len(last.delta)
            if last.delta or logprobs:
                yield reply.chunk(last.delta, index=index, logprobs=logprobs), last.used
        if last.finish == "fail":
            yield APIError(500, f"the generation failed after {last.used} tokens", code="sdcp_fail").body(), last.used
        else:
            yield reply.chunk(None, last.finish, index=index), last.used

    async def follow(self, s: RouterSession, start: int) -> AsyncIterator[Piece]:
        """Text deltas as the session's output comes, from completion token `start` (the
        text of the tokens before it taken as sent); the last piece carries the finish
        reason; each piece says the tokens it covers (first..used-1). A stop string ends
        the session here."""
        text = TextStream(self.router.backend.decode, stop=s.door.get("stop", []), hidden=self.eos)
        while len(s.tokens) < start and not s.done:       # a follower catching up with the client
            await s.wait_changed(RECHECK_S)
        seen = min(start, len(s.tokens))
        if seen:
            text.feed(s.tokens[:seen])
        first = seen
        while True:
            changed, done, tokens = s.changed_event(), s.done, list(s.tokens)
            if len(tokens) > seen or done:
                seen = len(tokens)
                delta = text.feed(tokens, final=done)
                if text.stopped is not None:
                    self.router.cancel(s, "stop")
                    yield Piece(delta, "stop", text.tokens_used or len(tokens), first)
                    return
                if done:
                    yield Piece(delta, s.finish_reason, len(tokens), first)
                    return
                if delta:
                    yield Piece(delta, None, len(tokens), first)
                    first = len(tokens)
            await s.wait_changed(RECHECK_S, changed)


@dataclass(frozen=True)
class Piece:
    delta: str              # text to send
    finish: str | None      # the finish reason, on the last piece
    used: int               # completion tokens so far (up to the stop string's end once stopped)
    first: int = 0          # the first completion token this piece covers (its tokens: first..used-1)


@dataclass(frozen=True)
class Reply:
    """The shapes of one completion's answers."""

    id: str
    object: str
    created: int
    model: str
    chat: bool

    @classmethod
    def of(cls, s: RouterSession) -> Reply:
        """The completion's id is its session's (so a stream can resume anywhere; with n > 1
        choices, the first choice's)."""
        chat = s.door.get("kind") == "chat"
        return cls(f"{'chatcmpl' if chat else 'cmpl'}-{s.id.hex()}", "chat.completion" if chat else "text_completion",
                   s.door.get("created", int(s.created_wall)), s.door.get("model", ""), chat)

    def _base(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def choice(self, text: str, finish: str | None, logprobs: dict | None) -> dict:
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return {**self._base(self.object), "choices": [{**c, "index": n} for n, c in enumerate(choices)],
                "usage": usage}

    def chunk(self, delta: str | dict | None, finish: str | None = None, *, index: int = 0,
              logprobs: dict | None = None) -> dict:
        """A stream chunk: text (or, for chat, a delta object) and the finish reason at the end."""
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice["text"] = delta or ""
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(kind), "choices": [], "usage": usage}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict, event_id: int | None) -> bytes:
    """One server-sent event; its id is the number of completion tokens it covers (none
    in a stream of several choices)."""
    head = b"" if event_id is None else b"id: %d\n" % event_id
    return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _bool(value, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false", param=name)
    return value


def _number(value, name: str, low: float, high: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise APIError(400, f"{name} must be a number in [{low:g}, {high:g}]", param=name)
    return float(value)
