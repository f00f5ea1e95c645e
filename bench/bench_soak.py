"""Soak: N streaming clients through the front door for D minutes, memory and descriptors
watched, every output checked (issue 21).

A router, a verifier and two drafters run as processes (procs.Cluster, HTTP/2 with mutual
TLS, file commit log, embedded store) on table models (the target's V x V logits table and a
draft table near it). N clients (this process, asyncio + httpx) each stream one generation
after another through POST /v1/generate: rule 1 (the output must be the target's greedy
decoding) and rule 2 with a seed. Every output must be exactly what the session's commit log
holds (its effective commits); rule 1's must also be the greedy decoding. (Rule 2 outputs are
not compared across generations: the draft's HMAC uniforms are keyed by the session id.) The
stream must never show a token twice or skip one. A client whose stream fails, or whose output is wrong, counts an
error and goes on.

One line per window: tokens/s, generations finished, errors, and RSS (MB) and open
descriptors of every process. At the end: memory is flat when every process's RSS is within
10% of its RSS after the first minute (the first window past 60 s, or past a fifth of the
run when it is shorter); every process's log is scanned and a traceback or a 5xx answer
counts as an error. The last line reads

    soak N generations, E errors, rss growth G%

(G: the largest growth of any process since the first minute).

    .venv/bin/python bench/bench_soak.py [--clients 256 | --capacity K] [--minutes 10] [--window 10]
                                         [--settle-minutes 1] [--flat 0.10] [--protocol h2|h3]
                                         [--stock-limits]

Issue 38's soak: `--capacity 32 --minutes 30 --settle-minutes 5 --flat 0.05`: the router
admits 32 generations at once (max_running) and 64 clients keep twice that many coming,
the rest waiting in its admission queue; the verifier plans by cost (the table target is
cheap, so most tokens are self-decoded after each session's first round).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from sdcp_fast.cache import effective_commits, open_log
from sdcp_fast.core.messages import CommitRecord
from sdcp_fast.models import load_backend
from sdcp_fast.models.table import write_table
from sdcp_fast.procs import Cluster
from sdcp_fast.refs import commit_log_name
from sdcp_fast.transport.limits import Limits

V = 64
PROMPTS = 64
SEEDS = 4
FLAT = 0.10
PROBLEMS = re.compile(r"Traceback|\b(?:HTTP|status) 5\d\d\b|\s5\d\d (?:Internal|Service|Bad Gateway)")


# ----------------------------------------------------------------------------- deployment


def deploy(workdir: Path, max_new: int, clients: int, sized: bool, protocol: str,
           capacity: int | None = None) -> tuple[Cluster, str]:
    """`sized`: the deployment made for `clients` sessions at once (the stock limits are
    for 128 or fewer): each drafter takes half of them (DrafterSection.max_sessions, 64),
    and the verifier allows that many streams on one HTTP/2 connection: the router keeps an
    output long poll per session on its connection, each drafter a proposal per session on
    its (transport.limits' max_concurrent_streams, 128; over the peer's limit httpx fails a
    request, "Max outbound streams is 128", instead of queueing it). `capacity`: the router
    admits that many generations at once (max_running) and queues the rest."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(V, V, generator=g) * 3
    write_table(workdir / "target.safetensors", target)
    write_table(workdir / "draft.safetensors", target + torch.randn(V, V, generator=g) * 3)
    target_spec, draft_spec = (f"table:{workdir / n}.safetensors" for n in ("target", "draft"))
    cluster = Cluster(workdir / "cluster", log_level="info", protocol=protocol)
    v1 = cluster.verifier("v1", model=target_spec)
    drafter_options = {}
    if sized:
        streams = max(Limits().max_concurrent_streams, 2 * clients + 64)
        v1.config = dataclasses.replace(v1.config, transport=dataclasses.replace(
            v1.config.transport, max_concurrent_streams=streams))
        drafter_options["max_sessions"] = max(64, clients // 2 + 16)
    digest = load_backend(draft_spec).digest.hex()
    for name in ("d1", "d2"):
        cluster.drafter(name, model=draft_spec, **drafter_options)
    admission = {"max_running": capacity} if capacity else {}
    cluster.router(model=target_spec, drafter_models={"d1": digest, "d2": digest},
                   contract={"rule": 1, "m_max": 6, "max_new": max_new, "low_rounds": 4,
                             "fallback": ["reduce", "switch", "self_decode"], "self_load": 60},
                   **admission)
    return cluster, target_spec


def greedy(spec: str, prompt: list[int], max_new: int) -> list[int]:
    backend = load_backend(spec)
    backend.open(b"ref", prompt)
    out = []
    for _ in range(max_new):
        token = int(torch.argmax(backend.score([(b"ref", [])])[-1]))
        backend.commit(b"ref", [token])
        out.append(token)
    backend.release(b"ref")
    return out


# ----------------------------------------------------------------------------- processes


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


# ----------------------------------------------------------------------------- clients


@dataclass
class Tally:
    finished: int = 0
    tokens: int = 0
    errors: int = 0
    failures: list[str] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)

    def error(self, what: str, kind: str) -> None:
        self.errors += 1
        self.kinds[kind] += 1
        if len(self.failures) < 20:
            self.failures.append(what)


async def one_generation(http: httpx.AsyncClient, base: str, prompt: list[int],
                         fields: dict) -> tuple[str, list[int]]:
    gid, tokens = "", []
    ended = False
    async with http.stream("POST", f"{base}/v1/generate", json={"tokens": prompt, **fields}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        name, data = None, []
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and name is not None:
                event = json.loads("\n".join(data))
                if name == "start":
                    gid = event["id"]
                elif name == "tokens":
                    if event["index"] != len(tokens):
                        raise RuntimeError(f"stream index {event['index']} after {len(tokens)} tokens")
                    tokens += event["tokens"]
                elif name == "end":
                    if event.get("finish") != "finish":
                        raise RuntimeError(f"ended with {event}")
                    ended = True
                name, data = None, []
    if not ended:
        raise RuntimeError(f"stream closed without an end after {len(tokens)} tokens")
    return gid, tokens


async def committed(log, gid: str) -> list[int]:
    entries = await log.read(commit_log_name(bytes.fromhex(gid)))
    return [t for e in effective_commits(entries) for t in CommitRecord.from_cbor(e.record).emitted]


async def client(n: int, base: str, prompts: list[list[int]], references: list[list[int]],
                 max_new: int, stop_at: float, tally: Tally, log) -> None:
    rng = random.Random(n)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as http:
        while time.monotonic() < stop_at:
            k = rng.randrange(len(prompts))
            rule2 = rng.random() < 0.5
            seed = rng.randrange(SEEDS)
            fields = {"max_new": max_new}
            if rule2:
                fields.update(rule=2, sampling={"temperature_milli": 1000, "seed": seed})
            try:
                gid, tokens = await one_generation(http, base, prompts[k], fields)
            except Exception as exc:                               # noqa: BLE001 (counted)
                status = re.match(r"HTTP \d+", str(exc))
                tally.error(f"client {n}: {type(exc).__name__}: {exc}",
                            status.group() if status else type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            if tokens != await committed(log, gid):
                tally.error(f"client {n}: rule {2 if rule2 else 1}: the stream is not the log's ({gid})",
                            "output not the log's")
            elif not rule2 and tokens != references[k]:
                tally.error(f"client {n}: rule 1 output is not greedy (prompt {k})", "rule 1 output not greedy")
            tally.finished += 1
            tally.tokens += len(tokens)


# ----------------------------------------------------------------------------- main


async def soak(cluster: Cluster, target: str, args) -> tuple[Tally, dict[str, list[float]]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(2, 6))] for _ in range(PROMPTS)]
    references = [greedy(target, p, args.max_new) for p in prompts]
    base = cluster.instances["router"].frontdoor_url
    started = time.monotonic()
    stop_at = started + args.minutes * 60
    tally = Tally()
    log = await open_log(cluster.commit_log)
    clients = [asyncio.create_task(client(n, base, prompts, references, args.max_new, stop_at, tally, log))
               for n in range(args.clients)]
    names = list(cluster.instances)
    rss: dict[str, list[float]] = {name: [] for name in names}
    print("  t(s)  tok/s  done  errors  " + "  ".join(f"{n}:MB/fds" for n in names), flush=True)
    last_tokens, last_t = 0, started
    while not all(c.done() for c in clients):
        await asyncio.wait(clients, timeout=args.window)
        now = time.monotonic()
        rate = (tally.tokens - last_tokens) / max(now - last_t, 1e-9)
        last_tokens, last_t = tally.tokens, now
        cells = []
        for name in names:
            pid = cluster.instances[name].pid
            rss[name].append((now - started, rss_mb(pid)))
            cells.append(f"{rss[name][-1][1]:.0f}/{open_fds(pid)}")
        print(f"{now - started:6.0f} {rate:6.0f} {tally.finished:5d} {tally.errors:6d}  " + "  ".join(cells),
              flush=True)
    await log.close()
    return tally, rss


def growth(series: list[tuple[float, float]], minutes: float, settle_minutes: float = 1.0) -> float:
    """RSS at the end over RSS after the first `settle_minutes` (or a fifth of a shorter run)."""
    settle = min(60.0 * settle_minutes, minutes * 60 / 5)
    baseline = next((mb for t, mb in series if t >= settle), series[0][1])
    return series[-1][1] / baseline - 1


def scan_logs(cluster: Cluster) -> list[str]:
    found = []
    for instance in cluster.instances.values():
        for line in instance.log_path.read_text(errors="replace").splitlines():
            if PROBLEMS.search(line):
                found.append(f"{instance.name}: {line.strip()[:200]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=None, help="default 256, or twice --capacity")
    parser.add_argument("--capacity", type=int, default=None,
                        help="the router's max_running (admission); the clients default to twice it")
    parser.add_argument("--settle-minutes", type=float, default=1.0,
                        help="RSS growth is counted from this point of the run")
    parser.add_argument("--flat", type=float, default=FLAT, help="largest RSS growth allowed (0.10: 10%%)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per line")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--keep", action="store_true", help="keep the workdir (logs) and print it")
    parser.add_argument("--protocol", choices=("h2", "h3"), default="h2",
                        help="how router, verifier and drafters call each other")
    parser.add_argument("--stock-limits", action="store_true",
                        help="the stock drafter max_sessions and verifier stream limit, not sized for the clients")
    args = parser.parse_args()
    if args.clients is None:
        args.clients = 2 * args.capacity if args.capacity else 256
    workdir = Path(tempfile.mkdtemp(prefix="sdcp-soak-"))
    cluster, target = deploy(workdir, args.max_new, args.clients, sized=not args.stock_limits,
                             protocol=args.protocol, capacity=args.capacity)
    print(f"soak: {args.clients} clients, {args.minutes} min, max_new {args.max_new}, {args.protocol}, "
          f"{'stock limits' if args.stock_limits else 'limits sized for the clients'}, "
          f"{f'capacity {args.capacity} (router max_running), ' if args.capacity else ''}"
          f"load average {os.getloadavg()[0]:.1f}, workdir {workdir}", flush=True)
    try:
        cluster.start(timeout=120)
        tally, rss = asyncio.run(soak(cluster, target, args))
    finally:
        cluster.stop()
    problems = scan_logs(cluster)
    growths = {name: growth(series, args.minutes, args.settle_minutes) for name, series in rss.items() if series}
    for name, g in growths.items():
        first, last = rss[name][0][1], rss[name][-1][1]
        print(f"  {name}: RSS {first:.0f} -> {last:.0f} MB, growth since minute {args.settle_minutes:g} {100 * g:+.1f}%")
    for line in tally.failures:
        print(f"  client error: {line}")
    if tally.kinds:
        print("  client errors by kind: " + ", ".join(f"{k} {n}" for k, n in tally.kinds.most_common()))
    for line in problems[:20]:
        print(f"  log: {line}")
    worst = max(growths.values(), default=0.0)
    flat = worst <= args.flat
    print(f"memory {'flat' if flat else 'NOT flat'} (largest growth {100 * worst:+.1f}%, limit {100 * args.flat:.0f}%); "
          f"{len(problems)} tracebacks or 5xx in the logs; load average {os.getloadavg()[0]:.1f}")
    if not args.keep:
        import shutil
        shutil.rmtree(workdir, ignore_errors=True)
    errors = tally.errors + len(problems)
    print(f"soak {tally.finished} generations, {errors} errors, rss growth {100 * worst:.1f}%")
    sys.exit(0 if errors == 0 and flat else 1)


if __name__ == "__main__":
    main()
