"""Load the q rows of a verification batch into one device tensor (sections 5.2, 6.3).

Each proposal's `q_rows` object is M rows of V little-endian binary32 values. For a batch,
`load_q_rows` fetches every object concurrently and lands them, in order, in one
preallocated fp32 tensor [sum M, V] on the logits' device:

- CPU target: each object is read straight into its slice of the result (`get_into` on the
  embedded store) or, from a network store, copied once from the received bytes through
  `torch.frombuffer`; nothing else is copied.
- CUDA target: the same into one pinned host staging buffer, then one `non_blocking` copy
  on a side stream, which the current stream waits on (an event), so the copy overlaps
  whatever the caller runs meanwhile (scoring). GPU-tier objects of the embedded store are
  copied device to device.

Every size is checked against M x V x 4 before any byte lands; a missing, mis-sized or
timed-out object raises `QRowsUnavailable` (the verifier answers sdcp-q-unavailable and
commits nothing).

No byte lands in a buffer after `load_q_rows` has returned or raised, so the caller may
reuse `out` at once: every read is awaited before a failure is reported, and a store's
`get_into` must not write into its buffer after it returns or raises (the embedded store
stops and waits for a timed-out read's thread). The pinned staging buffer of the CUDA path
is dropped after any failure, never reused, so that even a read or copy still in flight
can only write into memory nobody reads again.
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings
from collections.abc import Sequence

import torch

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


async def load_q_rows(store, refs: Sequence[tuple[str, int]], vocab: int,
                      device: torch.device | str = "cpu", *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """[sum M, V] fp32 on `device`: the q rows of every (uri, M) in `refs`, in order.

    `out`, if given, is a reusable contiguous fp32 buffer [>= sum M, V] on `device`; the
    result is its first sum M rows. Reusing it spares the page faults of a fresh
    allocation, which on a CPU cost as much as reading the rows themselves.
    """
    if vocab <= 0 or any(m <= 0 for _, m in refs):
        raise ValueError("vocab and every M must be positive")
    if sys.byteorder != "little":
        raise NotImplementedError("q rows are little-endian; big-endian hosts unsupported")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"q rows load to cpu or cuda, not {device}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    total = sum(m for _, m in refs)
    out = _destination(out, total, vocab, device)
    if device.type != "cuda":
        await _fill_host(store, refs, vocab, out)
        return out

    on_device = await _fill_from_gpu_tier(store, refs, out)
    async with _staging_lock():  # one pinned buffer per process, one batch at a time
        pinned = _pinned_staging(total * vocab)
        try:
            staging = pinned[: total * vocab].view(total, vocab)
            await _fill_host(store, refs, vocab, staging, skip=on_device)
            copied = _copy_on_side_stream(refs, on_device, staging, out, device)
            # The staging buffer is reused by the next batch: it must not change under this
            # copy. Wait off the event loop; the caller's stream already waits on the copy.
            await asyncio.to_thread(copied.synchronize)
        except BaseException:
            # A failed, timed-out or cancelled batch may leave a read or the copy still
            # using the buffer: the next batch gets a fresh one (this one lives on for as
            # long as whatever still holds it).
            _drop_staging(pinned)
            raise
    return out


def _copy_on_side_stream(refs, on_device, staging, out, device) -> torch.cuda.Event:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))  # `out` was allocated on current
    with torch.cuda.stream(side):
        for start, stop in _host_spans(refs, on_device):
            out[start:stop].copy_(staging[start:stop], non_blocking=True)
    torch.cuda.current_stream(device).wait_stream(side)
    out.record_stream(side)
    copied = torch.cuda.Event()
    copied.record(side)
    return copied


def _destination(out, total: int, vocab: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(total, vocab, dtype=torch.float32, device=device)
    if (out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] < total
            or out.shape[1] != vocab or not out.is_contiguous() or out.device != device):
        raise ValueError(f"out must be contiguous fp32 [>= {total}, {vocab}] on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out[:total]


def _size_reason(actual: int, m: int, vocab: int) -> str:
    return f"{actual} bytes, expected {m * vocab * FP32_BYTES} (M={m} x V={vocab} x 4)"


def _offsets(refs: Sequence[tuple[str, int]]) -> list[int]:
    offsets, row = [], 0
    for _, m in refs:
        offsets.append(row)
        row += m
    return offsets


async def _fill_host(store, refs, vocab: int, out: torch.Tensor, skip: frozenset = frozenset()):
    """Land each object's bytes in its rows of the CPU tensor `out` [sum M, V]."""
    offsets = _offsets(refs)
    wanted = [i for i in range(len(refs)) if i not in skip]
    if hasattr(store, "get_into"):
        # Reads from shared memory are CPU copies: more of them at once than cores only
        # thrashes, so the fan-out is bounded by the core count.
        limit = asyncio.Semaphore(max(1, min(16, os.cpu_count() or 1)))

        async def read(i: int) -> None:
            async with limit:
                await _read_into(store, refs[i], out[offsets[i]:offsets[i] + refs[i][1]])

        # wait for every read before reporting a failure: a read still running would go on
        # writing into `out` after the caller has moved on (and maybe reused the buffer)
        results = await asyncio.gather(*(read(i) for i in wanted), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return
    uris = [refs[i][0] for i in wanted]
    try:
        blobs = await store.get_many(uris)
    except NotFound as exc:
        raise QRowsUnavailable(exc.uri, "not found") from exc
    except CacheError as exc:
        raise QRowsUnavailable(",".join(uris), str(exc)) from exc
    for i, data in zip(wanted, blobs, strict=True):
        uri, m = refs[i]
        if len(data) != m * vocab * FP32_BYTES:
            raise QRowsUnavailable(uri, _size_reason(len(data), m, vocab))
        out[offsets[i]:offsets[i] + m].copy_(_rows_of(data, m, vocab))


async def _read_into(store, ref: tuple[str, int], rows: torch.Tensor) -> None:
    uri, m = ref
    try:
        await store.get_into(uri, memoryview(rows.numpy()).cast("B"))
    except SizeMismatch as exc:
        raise QRowsUnavailable(uri, _size_reason(exc.actual, m, rows.shape[1])) from exc
    except NotFound as exc:
        raise QRowsUnavailable(uri, "not found") from exc
    except CacheError as exc:
        raise QRowsUnavailable(uri, str(exc)) from exc


async def _fill_from_gpu_tier(store, refs, out: torch.Tensor) -> frozenset:
    """Device-to-device copies of GPU-tier objects; returns the indices it served."""
    if not hasattr(store, "get_tensor"):
        return frozenset()
    offsets, served = _offsets(refs), set()
    tensors = await asyncio.gather(*(store.get_tensor(uri) for uri, _ in refs),
                                   return_exceptions=True)
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            continue  # host tier or missing: the host path decides
        uri, m = refs[i]
        size = tensor.numel() * tensor.element_size()
        if size != m * out.shape[1] * FP32_BYTES:
            raise QRowsUnavailable(uri, _size_reason(size, m, out.shape[1]))
        out[offsets[i]:offsets[i] + m].copy_(tensor.reshape(-1).view(torch.float32)
                                             .view(m, out.shape[1]), non_blocking=True)
        served.add(i)
    return frozenset(served)


def _host_spans(refs, skip: frozenset) -> list[tuple[int, int]]:
    """Row ranges filled through the staging buffer, merged where adjacent."""
    spans: list[tuple[int, int]] = []
    for i, start in enumerate(_offsets(refs)):
        if i in skip:
            continue
        stop = start + refs[i][1]
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], stop)
        else:
            spans.append((start, stop))
    return spans


_staging: torch.Tensor | None = None
_lock: asyncio.Lock | None = None


def _staging_lock() -> asyncio.Lock:
    global _lock
    if _lock is None:
        _lock = asyncio.Lock()
    return _lock


def _rows_of(data: bytes, m: int, vocab: int) -> torch.Tensor:
    """A read-only [m, V] fp32 view of received bytes (no copy; only ever read from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we only read
        return torch.frombuffer(data, dtype=torch.float32).view(m, vocab)


def _drop_staging(buffer: torch.Tensor) -> None:
    global _staging
    if _staging is buffer:
        _staging = None


def _pinned_staging(elements: int) -> torch.Tensor:
    """A pinned fp32 buffer of at least `elements`, grown by doubling and then reused."""
    global _staging
    if _staging is None or _staging.numel() < elements:
        size = max(elements, 2 * (_staging.numel() if _staging is not None else 0))
        _staging = torch.empty(size, dtype=torch.float32, pin_memory=True)
    return _staging
