"""The target's log-probabilities of committed tokens, for the sessions that asked for them
(session-open's `logprobs` extension member: the OpenAI door's `logprobs`).

Two steps, so that sessions which did not ask pay nothing (no softmax, no copy):

- `score_batch(items, launched, outcomes)`, in the engine's verify step, right after the
  launch's results came back: for each job of a session that asked and was not refused,
  the rows of the tokens it may commit (the a accepted proposals and the extra token: rows
  0..a of its logits) go through one log-softmax in float64 (or, when the session asked for
  processed scores, `kernels.target_probs` under the round's sampling profile on its
  float64 reference path, then the log), the committed candidates' values are gathered and the `top` alternatives taken with
  `torch.topk`. The result waits on the session's record (`ServedSession.scored`) with its
  round number.
- `ServedSession.keep_logprobs(record)`, in the engine's commit step, once the round's
  commit record is on the log: the first len(emitted) entries (the rule may cut the
  candidates at a stop token or max_new) are appended to the session's committed
  log-probabilities (`Committed`), indexed like its output tokens. A round that was not
  committed leaves nothing behind (the next round's scores replace it).

Self-decoded tokens are jobs with M = 0 and take the same path (their single row). Each
entry is (log p of the token, [(id, log p)] of the top alternatives, most probable first).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..core.messages import LogprobsAsk, TokenLogprobs, transform_of

Entry = tuple[float, list[tuple[int, float]]]


def score_batch(items: Sequence, launched, outcomes: Sequence) -> None:
    """Compute and park (`served.scored`) the log-probabilities of every job whose session
    asked. `items`: the engine's queued jobs (`.served`, `.job`), `launched.rows[n]`: job n's
    first logits row in `launched.logits`, `outcomes[n]`: its (accepted, extra, problem)."""
    for n, item in enumerate(items):
        ask = item.served.logprobs
        if ask is None:
            continue
        outcome = outcomes[n]
        if outcome.problem is not None:
            continue
        job = item.job
        candidates = [*job.tokens[:outcome.accepted], outcome.extra]
        start = launched.rows[n]
        rows = launched.logits[start:start + len(candidates)]
        item.served.scored = (job.round, score_rows(rows, candidates, ask, transform_of(job.sampling)))


def score_rows(rows: torch.Tensor, tokens: Sequence[int], ask: LogprobsAsk,
               transform: dict[str, int]) -> list[Entry]:
    """Entries for `tokens[k]` scored by logits row k (float64 on the rows' device)."""
    rows = rows.double()
    if ask.processed:
        # the float64 reference: the semantics every kernel path is checked against, and
        # float64 where the fast paths give float32 (a few rows per round: its cost is small)
        logp = torch.log(kernels.target_probs(rows, **transform, path="reference"))
    else:
        logp = torch.log_softmax(rows, dim=-1)
    index = torch.tensor(list(tokens), device=logp.device).unsqueeze(1)
    chosen = logp.gather(1, index).squeeze(1).tolist()
    if ask.top:
        values, ids = torch.topk(logp, ask.top, dim=-1)
        alternatives = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        alternatives = [[] for _ in tokens]
    return list(zip(chosen, alternatives, strict=True))


@dataclass
class Committed:
    """Log-probabilities of a session's committed tokens from output index `base` on (a
    session resumed on this verifier has none for the tokens committed before it came
    here). Flat arrays: about 8 + 12 x top bytes a token, released with the session."""

    top: int
    base: int
    token: array = field(default_factory=lambda: array("d"))
    ids: array = field(default_factory=lambda: array("I"))
    values: array = field(default_factory=lambda: array("d"))

    @property
    def end(self) -> int:
        return self.base + len(self.token)

    def extend(self, entries: Sequence[Entry]) -> None:
        for lp, alternatives in entries:
            self.token.append(lp)
            for i, v in alternatives:
                self.ids.append(i)
                self.values.append(v)

    def slice(self, start: int, stop: int) -> TokenLogprobs:
        """The output message member for output indices start..stop-1 (within base..end)."""
        a, b, k = start - self.base, stop - self.base, self.top
        return TokenLogprobs(k, _le(self.token[a:b]), _le(self.ids[a * k:b * k]), _le(self.values[a * k:b * k]))

    @staticmethod
    def bytes_per_token(top: int) -> int:
        return 8 + 12 * top


def _le(values: array) -> bytes:
    """An array's bytes in little-endian order."""
    import sys

    if sys.byteorder == "little":
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()

