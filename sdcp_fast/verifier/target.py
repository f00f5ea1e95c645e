"""The target model as the verifier uses it: every backend call behind one lock (backends
are not thread-safe), long calls in a worker thread so the event loop keeps serving.

The engine scores and follows commits through it; the service prefills, publishes and
releases through it; neither reaches into the other for the backend or its lock.

Sessions that open with the same prompt together (session-open's `prefill_share`, the
OpenAI door's n > 1) share one prefill: the first one's K/V is exported once it is
computed and kept (`SharedPrefills`: at most `SHARED_MAX` prompts and `SHARED_MAX_BYTES`,
each for `SHARED_KEEP_S` or until as many sessions as announced took it), and the others
import it instead of running the prompt through the model again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from ..aio import Arrival, Gather, Offload, compute
from ..core.problems import Kind, problem
from ..models.base import KVCapacityError, ModelError, open_many

log = logging.getLogger("sdcp_fast.verifier")
SHARED_MAX = 8                    # prompts whose prefill is kept for sessions still to open
SHARED_MAX_BYTES = 256 << 20      # ... and their K/V bytes at most
SHARED_KEEP_S = 30.0              # ... each for at most this long


class SharedPrefills:
    """Exported prefills of prompts that more sessions announced (`prefill_share`), bounded
    by count, bytes and age; an entry goes once as many sessions as announced took it."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[int, ...], list] = OrderedDict()   # prompt -> [blob, left, expiry]

    def offer(self, tokens: Sequence[int], blob: bytes, sessions: int) -> None:
        self._expire()
        if sessions < 1 or len(blob) > SHARED_MAX_BYTES:
            return
        self._kept[tuple(tokens)] = [blob, sessions, time.monotonic() + SHARED_KEEP_S]
        while len(self._kept) > SHARED_MAX or self.bytes > SHARED_MAX_BYTES:
            self._kept.popitem(last=False)

    def take(self, tokens: Sequence[int]) -> bytes | None:
        self._expire()
        key = tuple(tokens)
        entry = self._kept.get(key)
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] <= 0:
            del self._kept[key]
        return entry[0]

    @property
    def bytes(self) -> int:
        return sum(len(entry[0]) for entry in self._kept.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, entry in self._kept.items() if entry[2] < now]:
            del self._kept[key]


class TargetModel:
    def __init__(self, backend):
        self.backend = backend
        self.lock = asyncio.Lock()
        self.scoring = Offload(compute=True)   # on the free cores; a pass cheaper than a thread hop on the loop
        self.shared = SharedPrefills()
        self.prefills = 0          # prompts run through the model by `prefill` (shared ones not counted)
        self.observe_pass: Callable[[int, float], None] | None = None   # (tokens, seconds) of a prefill pass
        self.opening = Gather(self._open_batch, hold=self.lock, cost=lambda item: len(item[1]),
                              max_cost=getattr(backend, "max_batch_tokens", None))

    def expect_prefill(self) -> Arrival:
        """Announce a session open that will reach `prefill` after its own reads: a packed
        prefill about to run waits for it (`aio.Gather`), so that the opens of one burst share
        one pass. The caller calls `done()` on it when the open ends, whatever happened."""
        return self.opening.announce()

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
                      reopen: bool, share: int = 1, arrival: Arrival | None = None) -> None:
        """Make the backend's session hold `tokens`: from `kv_blob` (target KV of a prefix,
        published by a verifier) when it covers one, else from the prefill of another
        session that opened with the same tokens and announced `share` > 1 sessions, else by
        a prefill (exported for the share - 1 others when `share` > 1). Prefills of sessions
        that open at the same time run as one packed pass (`aio.Gather`: the time to first
        token of a burst of sessions is one batched prefill, not one prefill after another);
        a prefill that others will share runs alone under the lock, so that they find it.
        503 when the model has no room, 400 when it refuses the tokens. `arrival`: this
        open's announcement to `opening` (`expect_prefill`), done here."""
        if arrival is not None and (kv_blob is not None or share > 1):
            arrival.done()   # built from K/V or a shared prefill, most likely: not waited for
        async with self.lock:
            if reopen:
                with contextlib.suppress(ModelError):
                    self.backend.release(sid)
            if self._import(sid, tokens, kv_blob, share):
                return
            if share > 1:
                with _refusals():
                    await compute(self.backend.open, sid, tokens)
                self.prefills += 1
                with contextlib.suppress(ModelError):   # a backend without export: each prefills
                    self.shared.offer(tokens, self.backend.export_kv(sid), share - 1)
                return
        with _refusals():
            await self.opening.submit((sid, tokens), arrival)

    def _import(self, sid: bytes, tokens: list[int], kv_blob: bytes | None, share: int) -> bool:
        """The session built from `kv_blob` or a shared prefill, when one covers a prefix of
        `tokens` (the rest committed on top); False when a prefill is needed."""
        source = "cached KV"
        if kv_blob is None and share > 1:
            kv_blob, source = self.shared.take(tokens), "a shared prefill"
        if kv_blob is None:
            return False
        try:
            self.backend.import_kv(sid, kv_blob)
            covered = self.backend.committed(sid)
            if covered == tokens[:len(covered)]:
                self.backend.commit(sid, tokens[len(covered):])
                log.info("session %s: %d of %d tokens from %s", sid.hex(), len(covered),
                         len(tokens), source)
                return True
            self.backend.release(sid)
        except ModelError as exc:
            log.info("session %s: target KV unusable (%s): prefilling", sid.hex(), exc)
            with contextlib.suppress(ModelError):
                self.backend.release(sid)
        return False

    async def _open_batch(self, items: list[tuple[bytes, list[int]]]) -> list[ModelError | None]:
        """The prefills `opening` gathered (the lock held): one packed pass. The pass's cost
        is observed over the tokens it computed: positions a session copied from another
        (prefix_cache.py) are left out."""
        started = time.perf_counter()
        copied = getattr(self.backend, "prefix_tokens_copied", 0)
        errors = await compute(open_many, self.backend, items)
        copied = getattr(self.backend, "prefix_tokens_copied", 0) - copied
        if self.observe_pass is not None:
            self.observe_pass(sum(len(tokens) for _, tokens in items) - copied, time.perf_counter() - started)
        self.prefills += sum(error is None for error in errors)
        if len(items) > 1:
            log.info("%d sessions prefilled in one pass (%d tokens)", len(items),
                     sum(len(tokens) for _, tokens in items))
        return errors

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
                    await compute(self.backend.open, sid, list(sequence()))
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


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The model's refusal of a prompt as the problem the client gets."""
    try:
        yield
    except KVCapacityError as exc:
        raise problem(Kind.CAPACITY, f"no room for the session in the model: {exc}") from None
    except ModelError as exc:
        raise problem(Kind.BAD_REQUEST, f"prompt refused by the model: {exc}") from None


def _rows(items: list[tuple[bytes, tuple[int, ...]]]) -> int:
    """Logits rows a score call computes: M + 1 per item."""
    return sum(len(tokens) + 1 for _, tokens in items)
