"""The q rows of a verification batch, fetched from the cache into one device tensor
(sections 5.2, 6.3), as early as the caller likes.

Each proposal's `q_rows` object is M rows of V little-endian binary32 values. The draft
lets the verifier fetch them concurrently with scoring; `QRowStager` does it in two steps:

- `fetch(uri, M)`, when the proposal is queued: the object's bytes start moving at once
  into a host slot of its own ([M, V] fp32, pinned on CUDA, from a pool reused across
  rounds and bounded by `host_bytes`). A GPU-tier object of the embedded store (written by
  a drafter on the same host) is instead mapped through its CUDA IPC handle: no host copy.
  When the pool has no room the fetch is deferred to `land` (nothing is lost, only the head
  start). `deferred(uri, M)` asks for exactly that: the plain, un-overlapped fetch.
- `land(fetches)`, when the batch is scored: waits for the fetches, then copies every
  fetch's rows, in order, into one [sum M, V] fp32 tensor on the device (reused across
  batches while under `device_bytes`) on the device's side stream, and returns an event
  recorded after the copies. The verify launch waits on that event (the device waits, not
  the host), so the copies overlap the forward pass running on the compute stream. On the
  CPU streams and events are no-ops (`kernels.device`), and deferred fetches read straight
  into the batch tensor (no slot, no extra copy).

Every size is checked against M x V x 4 before any byte lands; a missing, mis-sized or
timed-out object is a `QRowsUnavailable` for that fetch alone (the verifier answers
sdcp-q-unavailable for its proposal and verifies the others). `land` reports a failure
only after every read of the batch has finished, and a store's `get_into` never writes
into its buffer after it returns or raises (the embedded store stops and waits for a
timed-out read's thread), so no byte lands in a buffer its owner has moved on from. Slots
of failed or cancelled fetches are dropped, never reused.

`load_q_rows(store, refs, V, device, out=)` is the one-shot form: every fetch deferred,
landed, and the first failure raised.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..kernels.device import Device, Event
from .errors import CacheError, NotFound, SizeMismatch

FP32_BYTES = 4


class QRowsUnavailable(CacheError):
    """The q rows of a proposal cannot be used; maps to problem type sdcp-q-unavailable."""

    problem = "sdcp-q-unavailable"

    def __init__(self, uri: str, reason: str):
        super().__init__(uri, reason)
        self.uri, self.reason = uri, reason

    def __str__(self) -> str:
        return f"q rows {self.uri!r} unavailable: {self.reason}"


@dataclass(eq=False)
class QFetch:
    """One proposal's q rows on their way to the device."""

    uri: str
    m: int
    slot: torch.Tensor | None = None       # [m, V] host rows (pinned on CUDA), pool-owned
    mapped: torch.Tensor | None = None     # a GPU-tier object's device memory (IPC)
    task: asyncio.Task | None = None       # the read; None until started
    started: float = 0.0                   # perf_counter when the read began / ended
    finished: float = 0.0
    pooled: bool = False                   # `slot` goes back to the pool when released

    @property
    def early(self) -> bool:
        """Started before `land` (overlapped with queueing and earlier batches)."""
        return self.task is not None


@dataclass(frozen=True)
class Landed:
    """A batch's q rows on the device, and what became of each fetch."""

    q: torch.Tensor                        # [sum M, V] fp32, rows in fetch order
    starts: dict[int, int]                 # fetch index -> its first row in q (landed ones)
    problems: dict[int, QRowsUnavailable]  # fetch index -> why it has no rows
    copies_began: Event                    # side stream, before the copies
    ready: Event                           # side stream, after the copies: launch waits on it
    reads: list[tuple[float, float]] = field(default_factory=list)  # host read intervals

    def read_seconds(self) -> float:
        """Host time spent reading (overlapping intervals counted once)."""
        busy, end = 0.0, float("-inf")
        for start, stop in sorted(self.reads):
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        return busy


class QRowStager:
    """Fetches q rows ahead of their batch into bounded, reused buffers (module doc)."""

    def __init__(self, store, vocab: int, device: Device | torch.device | str = "cpu", *,
                 host_bytes: int = 512 << 20, device_bytes: int = 256 << 20) -> None:
        if vocab <= 0:
            raise ValueError("vocab must be positive")
        if sys.byteorder != "little":
            raise NotImplementedError("q rows are little-endian; big-endian hosts unsupported")
        self.store = store
        self.vocab = vocab
        self.device = Device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"q rows load to cpu or cuda, not {self.device.torch}")
        self.host_bytes = host_bytes
        self.device_bytes = device_bytes
        self._idle: dict[int, list[tuple[torch.Tensor, Event | None]]] = {}  # m -> slots
        self._slot_bytes = 0           # all pooled slots, idle or in use
        self._out: torch.Tensor | None = None
        self._out_free_after: Event | None = None   # the last launch that read `_out`
        # reads from shared memory are CPU copies: more at once than cores only thrashes
        self._reads = asyncio.Semaphore(max(1, min(16, os.cpu_count() or 1)))

    # ------------------------------------------------------------------ fetches

    def fetch(self, uri: str, m: int) -> QFetch:
        """Start moving one object's rows now; deferred to `land` when the pool is full."""
        f = self.deferred(uri, m)
        f.slot = self._take_slot(m)
        if f.slot is not None:
            f.pooled = True
            f.task = asyncio.ensure_future(self._read(f))
        return f

    def deferred(self, uri: str, m: int) -> QFetch:
        """A fetch that starts only when its batch lands (the plain path)."""
        if m <= 0:
            raise ValueError("every M must be positive")
        return QFetch(uri, m)

    def release(self, fetches: Sequence[QFetch], after: Event | None = None) -> None:
        """The batch is done with these rows. `after` is an event recorded once their last
        reader (the verify launch) was queued: slots of good fetches go back to the pool,
        and neither they nor the batch tensor are written again before it completes."""
        for f in fetches:
            if f.task is not None and not f.task.done():
                f.task.cancel()
                self._drop(f)
            elif f.pooled and f.slot is not None:
                if f.task is None or f.task.cancelled() or f.task.exception() is not None:
                    self._drop(f)
                else:
                    self._idle.setdefault(f.m, []).append((f.slot, after))
            f.slot, f.mapped, f.pooled = None, None, False
        if after is not None:
            self._out_free_after = after

    # ------------------------------------------------------------------ landing

    async def land(self, fetches: Sequence[QFetch], *, out: torch.Tensor | None = None) -> Landed:
        """Every fetch's rows in one device tensor (fetch order), and an event to wait on."""
        total = sum(f.m for f in fetches)
        dest = self._destination(out, total)
        offsets, row = [], 0
        for f in fetches:
            offsets.append(row)
            row += f.m
        for f, start in zip(fetches, offsets, strict=True):
            if f.task is None:
                # the plain path; on the CPU straight into the batch tensor
                rows = None if self.device.is_cuda else dest[start:start + f.m]
                f.task = asyncio.ensure_future(self._read(f, into=rows))
        results = await asyncio.gather(*(f.task for f in fetches), return_exceptions=True)
        problems: dict[int, QRowsUnavailable] = {}
        for i, result in enumerate(results):
            if isinstance(result, QRowsUnavailable):
                problems[i] = result
            elif isinstance(result, BaseException):
                raise result
        starts = {i: offsets[i] for i in range(len(fetches)) if i not in problems}
        with self.device.side():
            # the previous batch's launch read this tensor; a caller's `out` may still be
            # in use on the compute stream
            self.device.wait(self._out_free_after)
            if out is not None:
                self.device.side_waits_for_current()
            began = self.device.event()
            for i, start in starts.items():
                f = fetches[i]
                source = f.mapped if f.mapped is not None else f.slot
                if source is not None:   # else it was read straight into its rows (CPU)
                    dest[start:start + f.m].copy_(source, non_blocking=True)
            ready = self.device.event()
        reads = [(f.started, f.finished) for f in fetches if f.finished]
        return Landed(dest[:total], starts, problems, began, ready, reads)

    def _destination(self, out: torch.Tensor | None, total: int) -> torch.Tensor:
        vocab, device = self.vocab, self.device.torch
        if out is not None:
            if (out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] < total
                    or out.shape[1] != vocab or not out.is_contiguous() or out.device != device):
                raise ValueError(f"out must be contiguous fp32 [>= {total}, {vocab}] on {device}, "
                                 f"got {out.dtype} {tuple(out.shape)} on {out.device}")
            return out
        buf = self._out
        if buf is None or buf.shape[0] < total:
            # allocated on the side stream, which writes it; kept while of a bounded size
            # (a fresh allocation per batch pays first-touch page faults, 5x slower on CPU)
            with self.device.side():
                buf = self.device.empty(max(total, 64), vocab)
            self._out = buf if buf.numel() * FP32_BYTES <= self.device_bytes else None
        return buf

    # ------------------------------------------------------------------ reading

    async def _read(self, f: QFetch, into: torch.Tensor | None = None) -> None:
        f.started = time.perf_counter()
        try:
            if self.device.is_cuda and hasattr(self.store, "get_tensor"):
                f.mapped = await self._mapped(f)
                if f.mapped is not None:
                    return
            if into is None:
                if f.slot is None:   # deferred on CUDA: a slot from the pool, else its own
                    f.slot = self._take_slot(f.m)
                    f.pooled = f.slot is not None
                    if f.slot is None:
                        f.slot = self.device.host_empty(f.m, self.vocab)
                into = f.slot
            await self._read_rows(f.uri, f.m, into)
        finally:
            f.finished = time.perf_counter()

    async def _mapped(self, f: QFetch) -> torch.Tensor | None:
        """A GPU-tier object as device memory (None: it lives in the host tier)."""
        try:
            tensor = await self.store.get_tensor(f.uri)
        except NotFound as exc:
            raise QRowsUnavailable(f.uri, "not found") from exc
        except CacheError as exc:
            raise QRowsUnavailable(f.uri, str(exc)) from exc
        if tensor is None:
            return None
        size = tensor.numel() * tensor.element_size()
        if size != f.m * self.vocab * FP32_BYTES:
            raise QRowsUnavailable(f.uri, _size_reason(size, f.m, self.vocab))
        return tensor.reshape(-1).view(torch.float32).view(f.m, self.vocab)

    async def _read_rows(self, uri: str, m: int, rows: torch.Tensor) -> None:
        try:
            if hasattr(self.store, "get_into"):
                async with self._reads:
                    await self.store.get_into(uri, memoryview(rows.numpy()).cast("B"))
                return
            data = await self.store.get(uri)
        except SizeMismatch as exc:
            raise QRowsUnavailable(uri, _size_reason(exc.actual, m, self.vocab)) from exc
        except NotFound as exc:
            raise QRowsUnavailable(uri, "not found") from exc
        except CacheError as exc:
            raise QRowsUnavailable(uri, str(exc)) from exc
        if len(data) != m * self.vocab * FP32_BYTES:
            raise QRowsUnavailable(uri, _size_reason(len(data), m, self.vocab))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": only read
            rows.copy_(torch.frombuffer(data, dtype=torch.float32).view(m, self.vocab))

    # ------------------------------------------------------------------ the slot pool

    def _take_slot(self, m: int) -> torch.Tensor | None:
        """An idle [m, V] slot, or a new one while the pool stays under `host_bytes`."""
        idle = self._idle.get(m)
        if idle:
            slot, copied = idle.pop()
            if copied is not None:
                copied.synchronize()   # its last copy to the device has finished (normally long ago)
            return slot
        need = m * self.vocab * FP32_BYTES
        while self._slot_bytes + need > self.host_bytes and self._evict_idle():
            pass
        if self._slot_bytes + need > self.host_bytes:
            return None
        self._slot_bytes += need
        return self.device.host_empty(m, self.vocab)

    def _evict_idle(self) -> bool:
        for m, idle in self._idle.items():
            if idle:
                idle.pop()
                self._slot_bytes -= m * self.vocab * FP32_BYTES
                return True
        return False

    def _drop(self, f: QFetch) -> None:
        if f.pooled and f.slot is not None:
            self._slot_bytes -= f.m * self.vocab * FP32_BYTES
        f.slot, f.pooled = None, False

    @property
    def pooled_bytes(self) -> int:
        """Bytes of host slots held by the pool (idle or in use); at most `host_bytes`."""
        return self._slot_bytes


async def load_q_rows(store, refs: Sequence[tuple[str, int]], vocab: int,
                      device: torch.device | str = "cpu", *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """[sum M, V] fp32 on `device`: the q rows of every (uri, M) in `refs`, in order.

    `out`, if given, is a reusable contiguous fp32 buffer [>= sum M, V] on `device`; the
    result is its first sum M rows. Reusing it spares the page faults of a fresh
    allocation, which on a CPU cost as much as reading the rows themselves. On CUDA the
    current stream waits for the copies (the host does not).
    """
    if vocab <= 0 or any(m <= 0 for _, m in refs):
        raise ValueError("vocab and every M must be positive")
    stager = QRowStager(store, vocab, device, host_bytes=0)
    fetches = [stager.deferred(uri, m) for uri, m in refs]
    landed = await stager.land(fetches, out=out)
    if landed.problems:
        raise landed.problems[min(landed.problems)]
    stager.device.wait(landed.ready)
    return landed.q


def _size_reason(actual: int, m: int, vocab: int) -> str:
    return f"{actual} bytes, expected {m * vocab * FP32_BYTES} (M={m} x V={vocab} x 4)"
