"""What one SDCP round costs between processes, and how many proposals one verifier takes.

One verifier process (`sdcp-fast serve verifier`: table model, so the target costs nothing;
file commit log and embedded store on /dev/shm) answers proposals from drafter processes
(spawned here; each drives its share of the sessions, all on one client connection, with
greedy proposals from the target's own table: every token accepted, so every round is a
full one: check, batch, score, verify, commit-log append, verdict). For each protocol
(HTTP/2 and HTTP/3, mutual TLS 1.3) and each session count it measures proposals per second
through the verifier and the p50/p99 round latency (proposal sent to verdict decoded, as the
drafter sees it), with the CPU time per proposal of the verifier process and of the drafter
processes (their HTTP client's share of a round). A fresh verifier serves each measurement,
so idle sessions of an earlier one never count as company the batcher waits for.

Variants run side by side in the same run (alternating, same machine state):
  before   the verifier as it was: each session's commit record appended on its own (file log:
           one worker-thread call and one fdatasync each); every forward pass and verify launch
           in a worker thread (SDCP_INLINE_BELOW_US=0)
  after    group commit (the batch's records in one worker call, synced before any verdict);
           passes and launches measured cheaper than a thread hop run on the event loop
  after-threads  (on request) group commit, every pass and launch in a worker thread
  after-asyncio  (on request) `after` on asyncio's own event loop (verifier and drafters),
           where `after` runs uvloop when it is installed (sdcp_fast.aio.run)

At one session the table also splits the round into stages: from the drafter's side
(building and encoding the proposal, the HTTP exchange, decoding the verdict) and from the
verifier's metrics (queue wait, forward, verify kernel, commit-log append per round); the
rest of the exchange is transport, parsing, validation and handler code.

    .venv/bin/python bench/bench_round.py [--sessions 1,8,32,128] [--protocols h2,h3]
                                          [--seconds 3] [--drafters 2] [--variants before,after]
                                          [--baseline REV [--pairs N]]

`--baseline REV` runs every row with REV's own bench_round.py on REV's sdcp_fast as well
(`git archive`, with this tree's build of the CBOR fast path where its source is the same,
as bench_verifier_cpu does), in a child process before this tree's, N pairs of them
alternating; the table gets a `tree` column and the last line the medians side by side
with their ratios.

The last line reads `round p50 h2 X.XX ms, h3 X.XX ms (1 session); X proposals/s at 32
sessions (h2), X (h3)` for the last variant.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sdcp_fast import aio, gcfreeze  # noqa: E402
from sdcp_fast.core.digest import prefix_digest  # noqa: E402
from sdcp_fast.core.messages import (  # noqa: E402
    Action,
    Assignment,
    Contract,
    Proposal,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
)
from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.models.table import write_table  # noqa: E402
from sdcp_fast.procs import Cluster  # noqa: E402
from sdcp_fast.refs import commit_log_name, encode_session_id  # noqa: E402
from sdcp_fast.transport import Client, TLSConfig, call, make_certs  # noqa: E402

V = 64
M = 4
DRAFTERS = [f"https://drafter-bench-{n}.example/" for n in range(16)]

# verifier options and environment per variant
VARIANTS = {
    "before": ({"group_commit": False}, {"SDCP_INLINE_BELOW_US": "0"}),
    "after": ({}, {}),
    "after-threads": ({}, {"SDCP_INLINE_BELOW_US": "0"}),   # group commit only: every call in a thread
    "after-asyncio": ({}, {"SDCP_EVENT_LOOP": "asyncio"}),    # asyncio's own loop at both ends, not uvloop
    "after-no-company": ({"company_share": 0.0}, {}),          # a batch waits only max_wait_ms for company
}


# ----------------------------------------------------------------------------- drafter process


class Stages:
    def __init__(self):
        self.build = self.exchange = self.decode = 0.0


class Window:
    """The measured window, the same for every drafter process: set by the parent once every
    session of every process is open and has run a round (spawn and imports take seconds)."""

    def __init__(self, go, times, ready, sessions: int, index: int, out):
        self.go, self.times, self.ready, self.sessions, self.index, self.out = go, times, ready, sessions, index, out
        self.opened = 0
        self.start_at = self.stop_at = math.inf
        self.cpu_start: float | None = None   # this process's CPU seconds at the window's start
        self.cpu_stop: float | None = None    # ... and at its end

    def warmed(self) -> None:
        self.opened += 1
        if self.opened == self.sessions:
            self.out.put(("ready", self.index, None))

    def poll(self) -> None:
        if self.stop_at == math.inf and self.go.is_set():
            self.start_at, self.stop_at = self.times[0], self.times[1]



def table_target(workdir: Path) -> tuple[torch.Tensor, str]:
    """The benchmarks' target: a seeded V x V table model written into `workdir`; (table, spec)."""
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(18)) * 3
    write_table(workdir / "target.safetensors", table)
    return table, f"table:{workdir / 'target.safetensors'}"

def bench_contract(target: bytes, tokenizer: bytes) -> Contract:
    return Contract(target=target, tokenizer=tokenizer, rule=1, m_max=8, max_new=1 << 30, stop=(), low_rounds=4,
                    fallback=(Action.REDUCE,))


async def open_session(verifier: str, router: Client, drafter: str, target: bytes = b"", tokenizer: bytes = b"",
                       *, contract: Contract | None = None) -> tuple[bytes, int, int, bytes, int]:
    """Open a session on the verifier as the router would and assign it to `drafter`:
    (session id, round, committed, digest, last token)."""
    contract = contract or bench_contract(target, tokenizer)
    sid = os.urandom(16)
    prompt = (1, 2, 3)
    opened = SessionOpen(sid, 1, contract, prompt, commit_log_name(sid))
    state = (await call(router, "POST", f"{verifier}sessions", opened, SessionState)).message
    d0 = prefix_digest(contract.digest, prompt)
    assignment = Assignment(sid, 1, contract, verifier, drafter, prompt, 0, 0, d0, 8)
    reply = await call(router, "PUT", f"{verifier}sessions/{encode_session_id(sid)}/drafter", assignment,
                       SessionState)
    assert reply.ok, reply.detail
    return sid, state.round, 0, d0, prompt[-1]


async def _session(verifier: str, router: Client, client: Client, drafter: str, contract: Contract,
                   next_token: list[int], window: Window, latencies: list[float], stages: Stages) -> None:
    sid, round_, committed, digest, last = await open_session(verifier, router, drafter, contract=contract)
    status = Status(drafter, 1, 10, 0, 2000)
    url = f"{verifier}proposals"
    first = True
    m = M   # the verdict's m_cap bounds the next proposal (a loaded verifier lowers it)
    while True:
        window.poll()
        now = time.monotonic()
        if now >= window.stop_at:
            if window.cpu_stop is None:
                window.cpu_stop = time.process_time()
            break
        if window.cpu_start is None and now >= window.start_at:
            window.cpu_start = time.process_time()
        t0 = time.perf_counter()
        tokens, t = [], last
        for _ in range(m):
            t = next_token[t]
            tokens.append(t)
        body = Proposal(sid, 1, round_ + 1, drafter, committed, digest, tuple(tokens), status).to_cbor()
        t1 = time.perf_counter()
        response = await client.request("POST", url, body, idempotent=True)
        t2 = time.perf_counter()
        if response.status != 200:
            raise RuntimeError(f"round refused: {response.status} {response.body[:200]!r}")
        verdict = Verdict.from_cbor(response.body)
        t3 = time.perf_counter()
        round_, committed, digest, last = verdict.round, verdict.committed, verdict.digest, verdict.emitted[-1]
        m = min(M, verdict.m_cap)
        if first:
            first = False
            window.warmed()
        if now >= window.start_at and time.monotonic() < window.stop_at:
            latencies.append(t3 - t0)
            stages.build += t1 - t0
            stages.exchange += t2 - t1
            stages.decode += t3 - t2


async def _drafter(index: int, verifier: str, certs: str, router_uri: str, protocol: str, sessions: int,
                   spec: str, go, times, out) -> tuple[list[float], dict]:
    backend = load_backend(spec)
    table = torch.load(Path(spec.removeprefix("table:")).with_suffix(".pt"))
    next_token = table.argmax(dim=1).tolist()
    contract = bench_contract(backend.digest, backend.tokenizer_digest)
    router = Client(TLSConfig.for_instance(certs, router_uri), protocol, timeout=60.0)
    client = Client(TLSConfig.for_instance(certs, DRAFTERS[index]), protocol, timeout=60.0)
    latencies: list[float] = []
    stages = Stages()
    window = Window(go, times, None, sessions, index, out)
    gcfreeze.freeze_startup_objects()   # as `serve` does for a drafter role
    try:
        await asyncio.gather(*(_session(verifier, router, client, DRAFTERS[index], contract, next_token,
                                        window, latencies, stages) for _ in range(sessions)))
    finally:
        await router.close()
        await client.close()
    cpu = (window.cpu_stop or 0.0) - (window.cpu_start or 0.0)
    return latencies, {"build": stages.build, "exchange": stages.exchange, "decode": stages.decode, "cpu": cpu}


def _drafter_main(index, verifier, certs, router_uri, protocol, sessions, spec, go, times, out):
    try:
        result = aio.run(_drafter(index, verifier, certs, router_uri, protocol, sessions, spec, go, times,
                                      out))
        out.put(("done", index, result))
    except BaseException as exc:  # reported to the parent, which fails the run
        out.put(("failed", index, f"{type(exc).__name__}: {exc}"))


# ----------------------------------------------------------------------------- the verifier


VERIFIER_SERIES = ("queue_wait_seconds", "forward_seconds", "kernel_seconds", "commit_log_append_seconds",
                   "batch_size")


def _scrape(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of the verifier's stage histograms."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in VERIFIER_SERIES:
                if sample.name in (f"sdcp_{name}_sum", f"sdcp_{name}_count"):
                    found.setdefault(name, [0.0, 0.0])[sample.name.endswith("_count")] += sample.value
    return {k: (v[0], v[1]) for k, v in found.items()}


def measure(workdir: Path, spec: str, protocol: str, sessions: int, seconds: float, drafters: int,
            variant: str, py_spy: Path | None = None) -> dict:
    options, env = VARIANTS[variant]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cluster = Cluster(workdir / f"{variant}-{protocol}-{sessions}", protocol=protocol, log_level="warning")
        # no router: the drafters here open sessions with a router's certificate, and status
        # reports to a router that is not there would only cost the verifier retries
        verifier = cluster.verifier("verifier", model=spec, speculation="on", max_wait_ms=2.0, metrics="127.0.0.1:0",
                                    router_uri=None, **options)
        make_certs(cluster.certs, [cluster.router_uri, *DRAFTERS])
        with cluster:
            cluster.start(timeout=60)
            url = f"https://127.0.0.1:{verifier.info['port']}/"
            metrics_port = verifier.info["metrics_port"]
            processes = min(drafters, sessions)
            shares = [sessions // processes + (n < sessions % processes) for n in range(processes)]
            context = mp.get_context("spawn")
            out, go, times = context.Queue(), context.Event(), context.Array("d", 2)
            children = [context.Process(target=_drafter_main, daemon=True, args=(
                n, url, str(cluster.certs), cluster.router_uri, protocol, share, spec, go, times, out))
                for n, share in enumerate(shares)]
            for child in children:
                child.start()
            ready = 0
            while ready < len(children):
                kind, _, detail = out.get(timeout=180)
                if kind == "failed":
                    raise RuntimeError(f"drafter failed: {detail}\nverifier log:\n{verifier.log_tail()}")
                ready += kind == "ready"
            start_at = time.monotonic() + 1.0     # a second of every session running, unmeasured
            stop_at = start_at + seconds
            times[0], times[1] = start_at, stop_at
            go.set()
            time.sleep(max(0.0, start_at - time.monotonic()))
            before = _scrape(metrics_port)
            cpu0 = _cpu_seconds(verifier.pid)
            spy = None
            if py_spy is not None:   # where the verifier's CPU goes (collapsed stacks, for flamegraphs)
                py_spy.mkdir(parents=True, exist_ok=True)
                spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid",
                                        str(verifier.pid), "--duration", str(int(seconds)), "--rate", "250",
                                        "--nonblocking", "--format", "raw", "--output",
                                        str(py_spy / f"{variant}-{protocol}-{sessions}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(max(0.0, stop_at - time.monotonic()))
            after = _scrape(metrics_port)
            cpu = _cpu_seconds(verifier.pid) - cpu0
            if spy is not None:
                spy.wait(30)
            results = []
            while len(results) < len(children):
                kind, _, detail = out.get(timeout=120)
                if kind == "failed":
                    raise RuntimeError(f"drafter failed: {detail}\nverifier log:\n{verifier.log_tail()}")
                results.append(detail)
            for child in children:
                child.join(30)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    latencies = sorted(x for lat, _ in results for x in lat)
    rounds = len(latencies)
    drafter_stages = {k: sum(r[1][k] for r in results) / max(rounds, 1) for k in ("build", "exchange", "decode",
                                                                                   "cpu")}
    verifier_stages = {k: (after[k][0] - before[k][0]) for k in VERIFIER_SERIES if k in after and k in before}
    counts = {k: (after[k][1] - before[k][1]) for k in VERIFIER_SERIES if k in after and k in before}
    return {"variant": variant, "protocol": protocol, "sessions": sessions, "rounds": rounds,
            "per_s": rounds / seconds, "p50": _pct(latencies, 50), "p99": _pct(latencies, 99),
            "verifier_cpu": cpu / seconds, "drafter": drafter_stages,
            "verifier": {k: verifier_stages[k] / max(counts["queue_wait_seconds"], 1)
                         for k in ("queue_wait_seconds", "commit_log_append_seconds") if k in verifier_stages}
            | {k: verifier_stages[k] / max(counts[k], 1) for k in ("forward_seconds", "kernel_seconds")
               if k in verifier_stages}
            | {"jobs_per_batch": verifier_stages.get("batch_size", 0) / max(counts.get("batch_size", 0), 1)}}


def _baseline_row(tree: Path, workdir: Path, args, protocol: str, sessions: int, variant: str) -> dict:
    """One row measured by REV's own bench_round.py on REV's sdcp_fast (in `tree`), in a child
    process whose imports (and its verifier's and drafters') come from there; read from
    the first table it prints."""
    out = subprocess.run([sys.executable, str(tree / "bench" / "bench_round.py"), "--sessions", str(sessions),
                          "--protocols", protocol, "--variants", variant, "--seconds", str(args.seconds),
                          "--drafters", str(args.drafters)],
                         env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:3] == [variant, protocol, str(sessions)] and len(cells) >= 9:
            return {"tree": args.baseline, "variant": variant, "protocol": protocol, "sessions": sessions,
                    "per_s": float(cells[3]), "p50": float(cells[4]) / 1e3, "p99": float(cells[5]) / 1e3,
                    "verifier_cpu": float(cells[6].rstrip("%")) / 100, "drafter": {"cpu": float(cells[8]) / 1e3}}
    raise RuntimeError(f"no row for {variant} {protocol} {sessions} in:\n{out.stdout}\n{out.stderr}")


def _print_pairs(rows: list[dict], baseline: str) -> int:
    """The rows with their tree, then per row the medians of both trees and their ratio."""
    print(f"load average {os.getloadavg()[0]:.1f} (at the end); {os.cpu_count()} cores; table model V={V}, "
          f"M={M}, every token accepted\n")
    print("| tree | variant | protocol | sessions | proposals/s | p50 ms | p99 ms | verifier CPU ms per proposal "
          "| drafter CPU ms per proposal |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tree']} | {r['variant']} | {r['protocol']} | {r['sessions']} | {r['per_s']:.0f} | "
              f"{r['p50'] * 1e3:.2f} | {r['p99'] * 1e3:.2f} | {1e3 * r['verifier_cpu'] / max(r['per_s'], 1e-9):.2f} | "
              f"{r['drafter']['cpu'] * 1e3:.2f} |")
    keys = sorted({(r["variant"], r["protocol"], r["sessions"]) for r in rows}, key=lambda k: (k[1], k[2], k[0]))
    summary = []
    def median(key3, tree, key):
        return statistics.median(r[key] for r in rows if (r["variant"], r["protocol"], r["sessions"]) == key3
                                 and r["tree"] == tree)
    for key3 in keys:
        _, protocol, sessions = key3
        p50, base_p50 = median(key3, "this tree", "p50"), median(key3, baseline, "p50")
        per_s, base_per_s = median(key3, "this tree", "per_s"), median(key3, baseline, "per_s")
        summary.append(f"{protocol} {sessions}: p50 {p50 * 1e3:.2f} ms vs {base_p50 * 1e3:.2f} "
                       f"({p50 / base_p50:.2f}x), {per_s:.0f} vs {base_per_s:.0f} proposals/s "
                       f"({base_per_s / per_s:.2f}x)")
    print(f"\nthis tree vs {baseline} (medians; x: how many times slower): " + "; ".join(summary))
    return 0


def _pct(values: list[float], q: int) -> float:
    if not values:
        return math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1,8,32,128")
    parser.add_argument("--protocols", default="h2,h3")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per row")
    parser.add_argument("--drafters", type=int, default=2, help="drafter processes")
    parser.add_argument("--variants", default="before,after")
    parser.add_argument("--py-spy", type=Path, help="record the verifier with py-spy into this directory")
    parser.add_argument("--baseline", default="", help="git revision to run every row on as well")
    parser.add_argument("--pairs", type=int, default=1, help="with --baseline: alternating pairs per row")
    args = parser.parse_args()
    sessions = [int(s) for s in args.sessions.split(",")]
    protocols = args.protocols.split(",")
    variants = args.variants.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sdcp-round-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                     else None) as tmp:
        workdir = Path(tmp)
        table, spec = table_target(workdir)
        torch.save(table, workdir / "target.pt")
        baseline = None
        if args.baseline:
            from bench_verifier_cpu import _extract

            baseline = _extract(args.baseline, workdir / "baseline")
            archive = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "archive", args.baseline,
                                      "bench"], check=True, stdout=subprocess.PIPE).stdout
            subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive, check=True)
        for protocol in protocols:
            for n in sessions:
                for variant in variants:   # alternating: both see the same machine state
                    for _ in range(args.pairs if baseline else 1):
                        if baseline is not None:
                            row = _baseline_row(baseline, workdir, args, protocol, n, variant)
                            rows.append(row)
                            print(f"{args.baseline} {variant} {protocol} {n}: {row['per_s']:.0f}/s "
                                  f"p50 {row['p50'] * 1e3:.2f} ms", file=sys.stderr)
                        row = measure(workdir, spec, protocol, n, args.seconds, args.drafters, variant, args.py_spy)
                        row["tree"] = "this tree"
                        rows.append(row)
                        print(f"{variant} {protocol} {n}: {row['per_s']:.0f}/s p50 {row['p50'] * 1e3:.2f} ms",
                              file=sys.stderr)
    if baseline is not None:
        return _print_pairs(rows, args.baseline)
    print(f"load average {os.getloadavg()[0]:.1f} (at the end); {os.cpu_count()} cores; table model V={V}, "
          f"M={M}, every token accepted; {args.drafters} drafter processes\n")
    print("| variant | protocol | sessions | proposals/s | p50 ms | p99 ms | verifier CPU | verifier CPU ms "
          "per proposal | drafter CPU ms per proposal | jobs/batch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['protocol']} | {r['sessions']} | {r['per_s']:.0f} | {r['p50'] * 1e3:.2f} | "
              f"{r['p99'] * 1e3:.2f} | {r['verifier_cpu']:.0%} | "
              f"{1e3 * r['verifier_cpu'] / max(r['per_s'], 1e-9):.2f} | {r['drafter']['cpu'] * 1e3:.2f} | "
              f"{r['verifier']['jobs_per_batch']:.1f} |")
    singles = [r for r in rows if r["sessions"] == 1]
    if singles:
        print("\nOne session, mean ms per round by stage (drafter side; verifier metrics per job/batch):\n")
        print("| variant | protocol | round (mean) | build+encode | HTTP exchange | decode verdict | "
              "queue wait | forward | verify kernel | log append | exchange rest |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in singles:
            d, v = r["drafter"], r["verifier"]
            total = d["build"] + d["exchange"] + d["decode"]
            inside = sum(v.get(k, 0.0) for k in ("queue_wait_seconds", "forward_seconds", "kernel_seconds",
                                                 "commit_log_append_seconds"))
            print(f"| {r['variant']} | {r['protocol']} | {total * 1e3:.3f} | {d['build'] * 1e3:.3f} | "
                  f"{d['exchange'] * 1e3:.3f} | {d['decode'] * 1e3:.3f} | "
                  f"{v.get('queue_wait_seconds', 0) * 1e3:.3f} | {v.get('forward_seconds', 0) * 1e3:.3f} | "
                  f"{v.get('kernel_seconds', 0) * 1e3:.3f} | {v.get('commit_log_append_seconds', 0) * 1e3:.3f} | "
                  f"{(d['exchange'] - inside) * 1e3:.3f} |")
    last = variants[-1]

    def pick(protocol, n, key):
        found = [r[key] for r in rows if r["variant"] == last and r["protocol"] == protocol and r["sessions"] == n]
        return found[0] if found else math.nan

    print(f"\nround p50 h2 {pick('h2', 1, 'p50') * 1e3:.2f} ms, h3 {pick('h3', 1, 'p50') * 1e3:.2f} ms (1 session); "
          f"{pick('h2', 32, 'per_s'):.0f} proposals/s at 32 sessions (h2), {pick('h3', 32, 'per_s'):.0f} (h3) "
          f"[{last}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
