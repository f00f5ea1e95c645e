"""Child processes for the cross-process tests (run as a script, started by the tests).

    cache_workers.py put-qrows STORE_SPEC PREFIX N M V SEED   write N q-row objects, print "done"
    cache_workers.py append-forever LOG_DIR LOG               append rec-i, print i once acknowledged
    cache_workers.py race-append LOG_DIR LOG NAME WINS        append until WINS won, print positions
    cache_workers.py fill STORE_SPEC NAME COUNT SIZE          put COUNT unleased objects, print "done"
"""

from __future__ import annotations

import asyncio
import sys

import torch

from sdcp_fast.cache import Conflict, open_log, open_store


def q_rows(seed: int, index: int, m: int, vocab: int) -> torch.Tensor:
    """Deterministic softmax rows [m, vocab] for object `index` (the tests recompute them)."""
    generator = torch.Generator().manual_seed(seed * 1000 + index)
    return torch.softmax(torch.randn(m, vocab, generator=generator), dim=-1)


async def put_qrows(spec: str, prefix: str, n: int, m: int, vocab: int, seed: int) -> None:
    store = await open_store(spec)
    for i in range(n):
        rows = q_rows(seed, i, m, vocab)
        await store.put(f"{prefix}/{i}", rows.numpy().tobytes(), lease_ms=60_000)
    await store.close()
    print("done", flush=True)


async def append_forever(directory: str, log_name: str) -> None:
    log = await open_log(f"file:{directory}")
    i = len(await log.read(log_name))
    while True:
        await log.append(log_name, b"rec-%d" % i, epoch=1, expected=i)
        print(i, flush=True)
        i += 1


async def race_append(directory: str, log_name: str, name: str, wins: int) -> None:
    log = await open_log(f"file:{directory}")
    won = 0
    while won < wins:
        expected = len(await log.read(log_name))
        try:
            await log.append(log_name, f"{name}-{won}".encode(), epoch=1, expected=expected)
        except Conflict:
            continue
        print(expected, flush=True)
        won += 1


async def fill(spec: str, name: str, count: int, size: int) -> None:
    store = await open_store(spec)
    for i in range(count):
        await store.put(f"mlc:/fill/{name}/{i}", (name.encode() + bytes([i % 256])) * (size // 2))
    await store.close()
    print("done", flush=True)


def main(argv: list[str]) -> None:
    command, args = argv[0], argv[1:]
    if command == "put-qrows":
        spec, prefix, n, m, vocab, seed = args
        asyncio.run(put_qrows(spec, prefix, int(n), int(m), int(vocab), int(seed)))
    elif command == "append-forever":
        asyncio.run(append_forever(*args))
    elif command == "race-append":
        directory, log_name, name, wins = args
        asyncio.run(race_append(directory, log_name, name, int(wins)))
    elif command == "fill":
        spec, name, count, size = args
        asyncio.run(fill(spec, name, int(count), int(size)))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
