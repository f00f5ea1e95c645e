"""What sharing sessions between routers costs: the session-table writes a router makes
before it acts, and how long a dead router's sessions wait for another.

    .venv/bin/python bench/bench_routers.py [--sessions 200] [--ttl 2]

For each backend of the session table (file: a local directory; redis and etcd: servers
started here on loopback) it times, with a real session record (router/stored.py, a
100-token prompt):
- `Ownership.create` (a new session's record) and `Ownership.act` (the write before every
  fence, open, assignment and policy: a session costs one create and about four acts before
  its first token), median and p99 over `--sessions` sessions;
- a takeover: router A holds `--sessions` sessions and dies (its keepalives stop); router B
  scans every ttl / 8 and takes every orphaned record (16 at once, as the router does),
  re-reading each: seconds from A's
  last keepalive until B holds them all (the bound is ttl + ttl / 8, plus etcd's lease
  expiry check).
The last line is the one summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid

from sdcp_fast.cache import NotOwner, open_table
from sdcp_fast.cache.testing import etcd_server, redis_server
from sdcp_fast.core.messages import Action, Contract
from sdcp_fast.refs import commit_log_name
from sdcp_fast.router import RouterSession, stored
from sdcp_fast.router.ownership import Ownership
from sdcp_fast.router.service import TAKEOVERS_AT_ONCE


def session(n: int) -> RouterSession:
    contract = Contract(target=bytes(32), tokenizer=bytes(32), rule=1, m_max=8, max_new=256, stop=(2,),
                        low_rounds=4, fallback=(Action.REDUCE, Action.SWITCH, Action.SELF_DECODE))
    sid = uuid.uuid4().bytes
    return RouterSession(sid, contract, tuple(range(100)), commit_log_name(sid), door={"kind": "generate"})


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(spec: str, sessions: int, ttl: float) -> dict:
    table = await open_table(spec)
    try:
        a = Ownership(table, holder="https://a.bench/", ttl_s=ttl)
        await a.start()
        keeping = asyncio.ensure_future(a.keep())
        created, acted, held = [], [], []
        for n in range(sessions):
            s = session(n)
            t = time.perf_counter()
            await a.create(s)
            created.append(time.perf_counter() - t)
            s.verifier, s.drafter = "https://v.bench/", "https://d.bench/"
            t = time.perf_counter()
            await a.act(s)
            acted.append(time.perf_counter() - t)
            held.append(s)
        # A dies: its keepalives stop after one last one
        keeping.cancel()
        renewed = await table.keepalive(a.lease)
        last_keepalive = time.monotonic()
        assert renewed is not None
        b = Ownership(table, holder="https://b.bench/", ttl_s=ttl)
        await b.start()
        b_keeping = asyncio.ensure_future(b.keep())
        keys = {stored.key_of(s.id) for s in held}
        taken: set[str] = set()
        slots = asyncio.Semaphore(TAKEOVERS_AT_ONCE)       # as the router's scan

        async def take(record) -> None:
            async with slots:
                try:
                    await b.take(record)
                    await table.read(record.key)
                    taken.add(record.key)
                except NotOwner:
                    pass

        while taken != keys:
            await asyncio.sleep(ttl / 8)
            await asyncio.gather(*(take(r) for r in await table.scan(values=False)
                                   if r.key in keys and r.key not in taken and r.orphaned))
        takeover = time.monotonic() - last_keepalive
        b_keeping.cancel()
        return {"create_ms": 1e3 * statistics.median(created), "act_ms": 1e3 * statistics.median(acted),
                "act_p99_ms": 1e3 * pct(acted, 0.99), "takeover_s": takeover, "ttl_s": a.lease.ttl_s}
    finally:
        await table.close()


async def main(args) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["file"] = await measure(f"file:{tmp}/table", args.sessions, args.ttl)
    with redis_server() as server:
        results["redis"] = await measure(server.url, args.sessions, args.ttl)
    with etcd_server() as server:
        results["etcd"] = await measure(server.url, args.sessions, args.ttl)
    print(f"| table | create ms (median) | act ms (median) | act ms (p99) | takeover of {args.sessions} "
          f"sessions, s after the last keepalive | lease ttl s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['create_ms']:.2f} | {r['act_ms']:.2f} | {r['act_p99_ms']:.2f} | "
              f"{r['takeover_s']:.2f} | {r['ttl_s']:g} |")
    print("routers: act ms " + " ".join(f"{n} {r['act_ms']:.2f}" for n, r in results.items())
          + "; takeover s " + " ".join(f"{n} {r['takeover_s']:.2f}" for n, r in results.items())
          + f" (ttl {args.ttl:g} s, {args.sessions} sessions)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--ttl", type=float, default=2.0)
    asyncio.run(main(parser.parse_args()))
