"""The target model as the verifier uses it: every backend call behind one lock (backends
are not thread-safe), long calls in a worker thread so the event loop keeps serving.

The engine scores and follows commits through it; the service prefills, publishes and
releases through it; neither reaches into the other for the backend or its lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from ..aio import Offload
from ..core.problems import Kind, problem
from ..models.base import KVCapacityError, ModelError

log = logging.getLogger("sdcp_fast.verifier")


class TargetModel:
    def __init__(self, backend):
        self.backend = backend
        self.lock = asyncio.Lock()
        self.scoring = Offload()   # a pass measured cheaper than a thread hop runs on the loop

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def device(self) -> torch.device:
        """Where the backend puts its logits (its `device`; the CPU if it has none)."""
        return torch.device(getattr(self.backend, "device", "cpu"))

    @property
    def digest(self) -> bytes:
        return self.backend.digest

    def bytes_for(self, tokens: int) -> int:
        """The most a session of `tokens` positions holds in the model (a pure function of
        the model's shape: no lock needed)."""
        return self.backend.bytes_for(tokens)

    async def score(self, items: list[tuple[bytes, tuple[int, ...]]]
                    ) -> tuple[torch.Tensor | None, dict[int, ModelError]]:
        """One ragged forward pass for (session, proposed tokens) items: logits
        [sum(M_b + 1), V] and {}. If the backend refuses the batch (a session over its KV
        or length cap, say), each item is scored alone, so that one session's trouble never
        fails the others: the logits of the items it took, and {index: error} of the rest."""
        async with self.lock:
            try:
                return await self.scoring.run(self.backend.score, items, units=_rows(items)), {}
            except ModelError as exc:
                log.warning("batch of %d refused by the model (%s): scoring one by one", len(items), exc)
            rows, refused = [], {}
            for n, item in enumerate(items):
                try:
                    rows.append(await self.scoring.run(self.backend.score, [item], units=_rows([item])))
                except ModelError as exc:
                    refused[n] = exc
        return (torch.cat(rows) if rows else None), refused

    async def prefill(self, sid: bytes, tokens: list[int], kv_blob: bytes | None, *,
                      reopen: bool) -> None:
        """Make the backend's session hold `tokens`: from `kv_blob` (target KV of a prefix,
        published by a verifier) when it covers one, else by a prefill. 503 when the model
        has no room, 400 when it refuses the tokens."""
        async with self.lock:
            if reopen:
                with contextlib.suppress(ModelError):
                    self.backend.release(sid)
            if kv_blob is not None:
                try:
                    self.backend.import_kv(sid, kv_blob)
                    covered = self.backend.committed(sid)
                    if covered == tokens[:len(covered)]:
                        self.backend.commit(sid, tokens[len(covered):])
                        log.info("session %s: %d of %d tokens from cached KV", sid.hex(), len(covered),
                                 len(tokens))
                        return
                    self.backend.release(sid)
                except ModelError as exc:
                    log.info("session %s: target KV unusable (%s): prefilling", sid.hex(), exc)
                    with contextlib.suppress(ModelError):
                        self.backend.release(sid)
            try:
                await asyncio.to_thread(self.backend.open, sid, tokens)
            except KVCapacityError as exc:
                raise problem(Kind.CAPACITY, f"no room for the session in the model: {exc}") from None
            except ModelError as exc:
                raise problem(Kind.BAD_REQUEST, f"prompt refused by the model: {exc}") from None

    async def follow(self, sid: bytes, emitted: Sequence[int], sequence: Sequence[int]) -> None:
        """Bring the session up to a committed round (`follow_all` for one)."""
        (failure,) = await self.follow_all([(sid, emitted, lambda: sequence)])
        if failure is not None:
            raise failure

    async def follow_all(self, rounds: Sequence[tuple[bytes, Sequence[int], Callable[[], Sequence[int]]]]
                         ) -> list[Exception | None]:
        """Bring each (session, emitted tokens, its committed sequence) up to its committed
        round, under one hold of the lock (a batch's commits: one acquisition, not one per
        session). If the model cannot take the tokens (its length or KV cap), the session
        is rebuilt from the committed sequence (asked for only then: it is the whole
        context); if even that fails, later rounds of the session are refused alone (the
        engine scores job by job) while the committed round stands. Per round: None, or
        the exception something other than the model raised."""
        failures: list[Exception | None] = []
        async with self.lock:
            for sid, emitted, sequence in rounds:
                try:
                    self.backend.commit(sid, list(emitted))
                    failures.append(None)
                    continue
                except ModelError as exc:
                    log.warning("session %s: model could not follow the commit (%s): rebuilding", sid.hex(), exc)
                except Exception as exc:
                    failures.append(exc)
                    continue
                try:
                    with contextlib.suppress(ModelError):
                        self.backend.release(sid)
                    await asyncio.to_thread(self.backend.open, sid, list(sequence()))
                except ModelError as exc:
                    log.error("session %s: the model cannot hold the committed sequence: %s", sid.hex(), exc)
                except Exception as exc:
                    failures.append(exc)
                    continue
                failures.append(None)
        return failures

    async def export_kv(self, sid: bytes) -> bytes:
        async with self.lock:
            return self.backend.export_kv(sid)

    async def release(self, sid: bytes) -> None:
        async with self.lock:
            with contextlib.suppress(ModelError):
                self.backend.release(sid)


def _rows(items: list[tuple[bytes, tuple[int, ...]]]) -> int:
    """Logits rows a score call computes: M + 1 per item."""
    return sum(len(tokens) + 1 for _, tokens in items)
