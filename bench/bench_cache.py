"""q-row loading throughput (GB/s) from each object backend into one fp32 tensor.

    .venv/bin/python bench/bench_cache.py [--vocab 131072] [--rows 8] [--batch 64] [--repeats 5]

One proposal's q rows are M x V x 4 bytes (default 8 x 131072 x 4 = 4 MiB). For each
backend it times `load_q_rows` for one proposal (4 x `--repeats` runs) and for a batch of
`--batch` proposals (distinct objects, `--repeats` runs), after one warm-up, into a fresh
tensor and into a reused one (`out=`), and prints median and best GB/s as a Markdown table. A plain in-memory copy of the same bytes into a tensor is the reference line.
Backends: embedded (shared memory; reads into the destination), embedded through
`get_many` (the generic path a network store takes), redis (a local redis-server started
here on loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
import uuid
from pathlib import Path

import torch

from sdcp_fast.cache import open_store
from sdcp_fast.cache.qrows import load_q_rows
from sdcp_fast.cache.testing import redis_server


class GenericPath:
    """Hides `get_into`, so the loader takes the get_many + frombuffer path."""

    def __init__(self, store):
        self._store = store

    async def get_many(self, uris):
        return await self._store.get_many(uris)


async def measure(store, refs, vocab: int, repeats: int, reuse: bool) -> tuple[float, float]:
    """(median, best) GB/s over `repeats` timed loads after one warm-up."""
    total_rows = sum(m for _, m in refs)
    buffer = torch.empty(total_rows, vocab) if reuse else None
    await load_q_rows(store, refs, vocab, "cpu", out=buffer)  # warm-up: faults, connections
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await load_q_rows(store, refs, vocab, "cpu", out=buffer)
        times.append(time.perf_counter() - start)
    total = sum(m for _, m in refs) * vocab * 4
    return total / statistics.median(times) / 1e9, total / min(times) / 1e9


def parser_name() -> str:
    try:
        import hiredis  # noqa: F401

        return "hiredis"
    except ImportError:
        return "pure Python"


def memcpy_gbps(nbytes: int, repeats: int) -> tuple[float, float]:
    source = bytearray(nbytes)
    out = torch.empty(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out.copy_(torch.frombuffer(source, dtype=torch.float32))
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9, nbytes / min(times[1:]) / 1e9


async def run_backend(name: str, store, args) -> list[tuple[str, str, float]]:
    payload = torch.rand(args.rows, args.vocab).numpy().tobytes()
    uris = [f"mlc:/bench/{uuid.uuid4().hex}" for _ in range(args.batch)]
    for uri in uris:
        await store.put(uri, payload, lease_ms=600_000)
    loader = GenericPath(store) if name.endswith("get_many") else store
    results = []
    for label, chosen, repeats in (("1 proposal", uris[:1], 4 * args.repeats),
                                   (f"batch of {args.batch}", uris, args.repeats)):
        refs = [(uri, args.rows) for uri in chosen]
        for reuse in (False, True):
            gbps = await measure(loader, refs, args.vocab, repeats, reuse)
            results.append((name, label, "reused" if reuse else "fresh", *gbps))
    for uri in uris:
        await store.delete(uri)
    return results


async def main(args) -> None:
    mib = args.rows * args.vocab * 4 / 2**20
    shm = Path(f"/dev/shm/sdcp-fast-bench-{uuid.uuid4().hex[:8]}")
    rows = []
    try:
        cap = 2 * args.batch * args.rows * args.vocab * 4
        embedded = await open_store(f"embedded:{shm}?cap_bytes={cap}&timeout_s=60")
        rows += await run_backend("embedded", embedded, args)
        rows += await run_backend("embedded via get_many", embedded, args)
        await embedded.close()
        with redis_server() as server:
            redis = await open_store(f"{server.url}?timeout_s=60")
            rows += await run_backend("redis (loopback)", redis, args)
            await redis.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    reference = memcpy_gbps(args.batch * args.rows * args.vocab * 4, args.repeats)
    print(f"q rows: M={args.rows} x V={args.vocab} x 4 B = {mib:.1f} MiB per proposal; "
          f"redis parser: {parser_name()}")
    print("| backend | load | destination | GB/s median | GB/s best |\n|---|---|---|---|---|")
    for backend, label, destination, median, best in rows:
        print(f"| {backend} | {label} | {destination} | {median:.2f} | {best:.2f} |")
    print(f"| (reference: bytes -> tensor copy) | batch of {args.batch} | reused | "
          f"{reference[0]:.2f} | {reference[1]:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    asyncio.run(main(parser.parse_args()))
