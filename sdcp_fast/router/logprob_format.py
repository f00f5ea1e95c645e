"""The target's log-probabilities in the OpenAI API's two shapes.

The numbers come from the verifier (verifier/logprobs.py): per committed token, the
target's log p of the token and its top alternatives, as the verifier scored them (raw
log-softmax of the logits, or, with `processed`, of p after temperature, top-k and top-p),
carried to the router in output messages and kept with the session's tokens
(`RouterSession.logprobs`). The end-of-sequence tokens the text leaves out are left out
here too. A token for which no value reached this router (its verifier failed before the
router relayed it, or this router follows the session from the commit log) has a logprob
of null.

- chat completions: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}`;
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}` (offsets in characters of the choice's text, from `offset`).

Token strings are each token decoded alone (a token that is part of a character decodes
as U+FFFD), or `token_id:N` when the request set vLLM's `return_tokens_as_token_ids`.
-inf (a token the processed distribution excludes) is written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def json_value(lp: float | None) -> float | None:
    if lp is None:
        return None
    return lp if math.isfinite(lp) else -9999.0


@dataclass(frozen=True)
class LogprobFormat:
    decode: Callable[[list[int]], str]
    hidden: frozenset[int]      # end-of-sequence tokens: not in the text, not here
    top: int                    # alternatives asked for
    token_ids: bool = False     # `token_id:N` instead of the token's text

    def name(self, token: int) -> str:
        return f"token_id:{token}" if self.token_ids else self.decode([token])

    def _rows(self, tokens: Sequence[int], logprobs: Sequence | None, first: int, stop: int):
        for k in range(first, stop):
            if tokens[k] in self.hidden:
                continue
            entry = logprobs[k] if logprobs is not None and k < len(logprobs) else None
            yield tokens[k], entry

    def chat(self, tokens: Sequence[int], logprobs: Sequence | None, first: int, stop: int) -> dict:
        content = []
        for token, entry in self._rows(tokens, logprobs, first, stop):
            text = self.name(token)
            alternatives = [] if entry is None else entry[1][:self.top]
            content.append({
                "token": text, "logprob": json_value(None if entry is None else entry[0]),
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self.name(i)), "logprob": json_value(v), "bytes": list(t.encode())}
                                 for i, v in alternatives]})
        return {"content": content}

    def completion(self, tokens: Sequence[int], logprobs: Sequence | None, first: int, stop: int,
                   offset: int) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in self._rows(tokens, logprobs, first, stop):
            text = self.name(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(json_value(None if entry is None else entry[0]))
            alternatives = [] if entry is None else entry[1][:self.top]
            out["top_logprobs"].append({self.name(i): json_value(v) for i, v in alternatives} if self.top else None)
            out["text_offset"].append(offset)
            offset += len(self.decode([token]))
        return out
