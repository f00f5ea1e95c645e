"""A well-behaved drafter's round latency, quiet and during each attack of issue 22, side by side.

A verifier runs as its own process (`sdcp-fast serve`, table model, file commit log, default
limits). One well-behaved drafter (this process) opens a session and runs proposal rounds
over one HTTP/2 connection; its round latency is measured alone, then while each attack runs
in other processes, every attacker holding a valid client certificate of the deployment (a
compromised or broken peer), all against 127.0.0.1 only, each bounded in count and time:

  rapid reset        two clients open and reset streams (HEADERS + RST_STREAM), reconnecting
                     when told to calm down, up to --resets streams each
  idle connections   --idle TCP connections opened and left idle (no TLS), re-opened when
                     the server drops them
  window-0 streams   clients with INITIAL_WINDOW_SIZE 0 filling their stream limit with
                     requests whose answers can never be sent
  oversized headers  requests with 60 KB header lists (431) and 300 KB ones (connection error)
  slow CBOR          mutated and crafted proposal bodies built to be slow to reject, 8 at a time

On a machine with two or more cores the verifier and the drafter (which mostly waits) are
pinned to core 0 and the attackers to the others, at nice 10: what an attack can take from
the drafter is the verifier's time, as with attackers on other machines, and not the
drafter's own CPU. The verifier's CPU use is printed per phase. The goal is a p50 within 2x of the quiet one
under every attack; the last line reads `worst attack p50 X.XXx quiet (ATTACK)`.

    .venv/bin/python bench/bench_hostile.py [--seconds 6] [--idle 2000] [--resets 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import random
import socket
import ssl
import statistics
import struct
import tempfile
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import torch

from sdcp_fast.core.digest import prefix_digest
from sdcp_fast.core.messages import (
    Action,
    Assignment,
    Contract,
    Proposal,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
)
from sdcp_fast.models import load_backend
from sdcp_fast.models.table import write_table
from sdcp_fast.procs import Cluster
from sdcp_fast.refs import commit_log_name, encode_session_id
from sdcp_fast.transport import Client, TLSConfig, call, make_certs

DRAFTER = "https://drafter-bench.example/"
ATTACKERS = [f"https://attacker-{n}.example/" for n in range(1, 5)]
V = 64
M = 4
CBOR = [(b"content-type", b"application/sdcp+cbor")]
ATTACKS = ["rapid reset", "idle connections", "window-0 streams", "oversized headers", "slow CBOR"]


# ----------------------------------------------------------------------------- the drafter


class Drafter:
    """Greedy proposals from the target table itself (rule 1: every token accepted), so every
    round is a full one: score, verify, commit-log append, verdict."""

    def __init__(self, verifier: str, router_tls: TLSConfig, drafter_tls: TLSConfig, table: torch.Tensor,
                 backend):
        self.verifier = verifier
        self.router = Client(router_tls, "h2", timeout=10.0)
        self.client = Client(drafter_tls, "h2", timeout=10.0)
        self.next_token = table.argmax(dim=1).tolist()
        self.contract = Contract(target=backend.digest, tokenizer=backend.tokenizer_digest, rule=1, m_max=8,
                                 max_new=1 << 30, stop=(), low_rounds=4, fallback=(Action.REDUCE,))

    async def open(self) -> None:
        self.sid = os.urandom(16)
        self.prompt = (1, 2, 3)
        msg = SessionOpen(self.sid, 1, self.contract, self.prompt, commit_log_name(self.sid))
        state = (await call(self.router, "POST", f"{self.verifier}sessions", msg, SessionState)).message
        d0 = prefix_digest(self.contract.digest, self.prompt)
        assignment = Assignment(self.sid, 1, self.contract, self.verifier, DRAFTER, self.prompt, 0, 0, d0, 8)
        path = f"{self.verifier}sessions/{encode_session_id(self.sid)}/drafter"
        assert (await call(self.router, "PUT", path, assignment, SessionState)).ok
        self.round, self.committed, self.digest, self.last = state.round, 0, d0, self.prompt[-1]

    async def rounds(self, seconds: float) -> list[float]:
        latencies = []
        deadline = time.monotonic() + seconds
        status = Status(DRAFTER, 1, 10, 0, 2000)
        while time.monotonic() < deadline:
            tokens, t = [], self.last
            for _ in range(M):
                t = self.next_token[t]
                tokens.append(t)
            proposal = Proposal(self.sid, 1, self.round + 1, DRAFTER, self.committed, self.digest, tuple(tokens),
                                status)
            started = time.perf_counter()
            reply = await call(self.client, "POST", f"{self.verifier}proposals", proposal, Verdict)
            latencies.append(time.perf_counter() - started)
            if not reply.ok:
                raise RuntimeError(f"round refused: {reply.status} {reply.detail}")
            verdict = reply.message
            self.round, self.committed, self.digest = verdict.round, verdict.committed, verdict.digest
            self.last = verdict.emitted[-1]
        return latencies

    async def close(self) -> None:
        await self.router.close()
        await self.client.close()


# ----------------------------------------------------------------------------- attacks


def _context(tls: TLSConfig) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=tls.ca)
    context.load_cert_chain(tls.cert, tls.key)
    context.set_alpn_protocols(["h2"])
    return context


async def _h2(port: int, tls: TLSConfig, settings: dict | None = None):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_context(tls), server_hostname="127.0.0.1")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    if settings:
        conn.update_settings(settings)
    encode = conn.encoder.encode       # pure Python Huffman coding would be the attacker's bottleneck
    conn.encoder.encode = lambda headers, huffman=True: encode(headers, huffman=False)
    writer.write(conn.data_to_send())
    return reader, writer, conn


async def _drain(reader, conn, writer) -> bool:
    """Read what is there; False once the server closed the connection."""
    try:
        data = await asyncio.wait_for(reader.read(65536), 0.001)
    except TimeoutError:
        return True
    except (ConnectionError, ssl.SSLError):
        return False
    if not data:
        return False
    try:
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if isinstance(event, h2.events.ConnectionTerminated):
                return False
        writer.write(conn.data_to_send())
    except Exception:
        return False
    return True


def _request(conn, path: str, headers=(), body: bytes | None = None) -> int:
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"127.0.0.1"),
                            (b":path", path.encode()), *CBOR, *headers], end_stream=body is None)
    if body is not None:
        conn.send_data(sid, body, end_stream=True)
    return sid


async def rapid_reset(port: int, tls: TLSConfig, stop_at: float, budget: int) -> dict:
    sent = connections = 0
    body = b"\xa0"
    while sent < budget and time.monotonic() < stop_at:
        try:
            reader, writer, conn = await _h2(port, tls)
        except (OSError, ssl.SSLError):
            await asyncio.sleep(0.01)
            continue
        connections += 1
        alive = True
        while alive and sent < budget and time.monotonic() < stop_at:
            for _ in range(50):
                try:
                    sid = _request(conn, "/proposals", body=body)
                    conn.reset_stream(sid, 8)
                except Exception:
                    alive = False
                    break
                sent += 1
            writer.write(conn.data_to_send())
            alive = alive and await _drain(reader, conn, writer)
        writer.close()
    return {"streams reset": sent, "connections": connections}


async def idle_connections(port: int, count: int, stop_at: float) -> dict:
    socks: list[socket.socket] = []
    opened = 0
    while time.monotonic() < stop_at:
        alive = []
        for sock in socks:
            try:
                if sock.recv(1) == b"":
                    sock.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                continue
            alive.append(sock)
        socks = alive
        while len(socks) < count and time.monotonic() < stop_at:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=1.0)
            except OSError:
                break
            sock.setblocking(False)
            socks.append(sock)
            opened += 1
        await asyncio.sleep(0.2)
    held = len(socks)
    for sock in socks:
        sock.close()
    return {"opened": opened, "held at the end": held}


async def window_zero(port: int, tls: TLSConfig, stop_at: float) -> dict:
    streams = connections = 0
    conns = []
    while time.monotonic() < stop_at:
        if len(conns) < 4:
            try:
                conns.append(await _h2(port, tls, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}))
                connections += 1
            except (OSError, ssl.SSLError):
                pass
        for reader, writer, conn in list(conns):
            try:
                while conn.open_outbound_streams < 100:
                    _request(conn, "/proposals", body=b"\xa0")
                    streams += 1
            except Exception:
                pass
            writer.write(conn.data_to_send())
            if not await _drain(reader, conn, writer):
                conns.remove((reader, writer, conn))
        await asyncio.sleep(0.05)
    for _, writer, _ in conns:
        writer.close()
    return {"stalled streams opened": streams, "connections": connections}


async def oversized_headers(port: int, tls: TLSConfig, stop_at: float, budget: int) -> dict:
    sent = connections = 0
    pad = (b"x-pad", b"p" * 60_000)
    while sent < budget and time.monotonic() < stop_at:
        try:
            reader, writer, conn = await _h2(port, tls)
        except (OSError, ssl.SSLError):
            await asyncio.sleep(0.01)
            continue
        connections += 1
        alive = True
        while alive and sent < budget and time.monotonic() < stop_at:
            try:
                big = [(b"x-pad", b"p" * 300_000)] if sent % 50 == 49 else [pad]
                _request(conn, "/proposals", big, b"\xa0")
                sent += 1
            except Exception:
                break
            writer.write(conn.data_to_send())
            try:
                await writer.drain()
            except (ConnectionError, ssl.SSLError):
                break
            alive = await _drain(reader, conn, writer)
        writer.close()
    return {"requests": sent, "connections": connections}


def _slow_bodies(rng: random.Random) -> list[bytes]:
    n = 60_000
    crafted = [
        b"\x9a" + struct.pack(">I", n - 6) + b"\x00" * (n - 6) + b"\xff",          # tiny items, bad last
        b"\xba" + struct.pack(">I", n // 4) + b"\x00\x00" * (n // 4 - 1) + b"\x00",  # duplicate keys
        b"\x9a" + struct.pack(">I", n // 2) + b"\xa0" * (n // 2),                   # a list of maps
        b"\x7a" + struct.pack(">I", n - 5) + b"a" * (n - 6) + b"\xff",              # bad UTF-8 at the end
    ]
    base = bytearray(crafted[0])
    for _ in range(12):
        body = bytearray(base)
        for _ in range(8):
            body[rng.randrange(len(body))] = rng.randrange(256)
        crafted.append(bytes(body))
    return crafted


async def slow_cbor(port: int, tls: TLSConfig, stop_at: float, budget: int) -> dict:
    rng = random.Random(22)
    bodies = _slow_bodies(rng)
    client = Client(tls, "h2", timeout=10.0, retries=0)
    url = f"https://127.0.0.1:{port}/proposals"
    sent = [0]
    statuses: dict[int, int] = {}

    async def worker():
        while sent[0] < budget and time.monotonic() < stop_at:
            sent[0] += 1
            try:
                response = await client.request("POST", url, rng.choice(bodies))
                statuses[response.status] = statuses.get(response.status, 0) + 1
            except Exception:
                statuses[0] = statuses.get(0, 0) + 1
    await asyncio.gather(*(worker() for _ in range(8)))
    await client.close()
    return {"requests": sent[0], "answers": statuses}


def _attack_main(name: str, index: int, port: int, certs: str, seconds: float, args, out, ready) -> None:
    os.nice(10)
    if args.attack_cores:   # passed in: a spawned child inherits the parent's pinning
        os.sched_setaffinity(0, args.attack_cores)
    tls = TLSConfig.for_instance(certs, ATTACKERS[index])
    stop_at = time.monotonic() + seconds
    ready.set()   # imports done (seconds on a loaded machine): the measurement may start
    if name == "rapid reset":
        coro = rapid_reset(port, tls, stop_at, args.resets)
    elif name == "idle connections":
        coro = idle_connections(port, args.idle, stop_at)
    elif name == "window-0 streams":
        coro = window_zero(port, tls, stop_at)
    elif name == "oversized headers":
        coro = oversized_headers(port, tls, stop_at, 20_000)
    else:
        coro = slow_cbor(port, tls, stop_at, 50_000)
    try:
        report = asyncio.run(coro)
    except Exception as exc:  # an attacker's own failure is reported, not raised
        report = {"attacker failed": f"{type(exc).__name__}: {exc}"}
    out.put((name, index, report))





# ----------------------------------------------------------------------------- the run


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measured(drafter: Drafter, seconds: float, pid: int) -> tuple[list[float], float]:
    """Round latencies, and the verifier's CPU use meanwhile (cores busy)."""
    cpu, wall = cpu_seconds(pid), time.monotonic()
    latencies = await drafter.rounds(seconds)
    return latencies, (cpu_seconds(pid) - cpu) / (time.monotonic() - wall)


async def run(args, cluster: Cluster, verifier_port: int, verifier_pid: int, table: torch.Tensor,
              backend) -> list[tuple]:
    certs = str(cluster.certs)
    verifier = f"https://127.0.0.1:{verifier_port}/"
    drafter = Drafter(verifier, TLSConfig.for_instance(certs, cluster.router_uri),
                      TLSConfig.for_instance(certs, DRAFTER), table, backend)
    await drafter.open()
    await drafter.rounds(1.0)                                  # warm up: connection, caches
    results = [("quiet", *await measured(drafter, args.seconds, verifier_pid), {})]
    context = mp.get_context("spawn")
    loop = asyncio.get_running_loop()
    for attack in ATTACKS:
        out = context.Queue()
        count = 2 if attack == "rapid reset" else 1
        ready = [context.Event() for _ in range(count)]
        processes = [context.Process(target=_attack_main, args=(attack, i, verifier_port, certs,
                                                                args.seconds + 3.0, args, out, ready[i]),
                                     daemon=True)
                     for i in range(count)]
        for p in processes:
            p.start()
        # a spawned attacker imports torch first: on a loaded machine that alone can take
        # longer than a phase, so the clock starts once every attacker is running
        for event in ready:
            await loop.run_in_executor(None, event.wait, 120)
        await asyncio.sleep(2.0)                                # the attack ramps up
        latencies, cpu = await measured(drafter, args.seconds, verifier_pid)
        reports = []
        for p in processes:
            await loop.run_in_executor(None, p.join, args.seconds + 30)
            if p.is_alive():
                p.kill()
                reports.append({"attacker killed": "no report within the phase"})
        while True:
            try:
                reports.append((await loop.run_in_executor(None, out.get, True, 1.0))[2])
            except queue.Empty:
                break
        results.append((attack, latencies, cpu, reports))
        await asyncio.sleep(1.0)                                # let the verifier settle
    # quiet again: how far the machine itself drifted during the run (it may be shared)
    results.append(("quiet again", *await measured(drafter, args.seconds, verifier_pid), {}))
    await drafter.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per phase")
    parser.add_argument("--idle", type=int, default=2000, help="idle TCP connections")
    parser.add_argument("--resets", type=int, default=20_000, help="streams reset per rapid-reset client")
    parser.add_argument("--no-pin", action="store_true", help="leave processes where the OS puts them")
    args = parser.parse_args()
    # the commit log on tmpfs where there is one: fsync latency of a shared disk is not what
    # this measures
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        workdir = Path(tmp)
        g = torch.Generator().manual_seed(22)
        table = torch.randn(V, V, generator=g) * 3
        write_table(workdir / "target.safetensors", table)
        spec = f"table:{workdir / 'target.safetensors'}"
        backend = load_backend(spec)
        cluster = Cluster(workdir / "cluster", log_level="info")
        verifier = cluster.verifier("v1", model=spec, speculation="on", max_wait_ms=0.5)
        make_certs(cluster.certs, [cluster.router_uri, DRAFTER, *ATTACKERS])
        with cluster:
            cluster.start(timeout=60)
            cores = sorted(os.sched_getaffinity(0))
            args.attack_cores = set(cores[1:]) if len(cores) >= 2 and not args.no_pin else None
            if args.attack_cores:
                os.sched_setaffinity(verifier.popen.pid, {cores[0]})
                os.sched_setaffinity(0, {cores[0]})   # the drafter beside the verifier
            results = asyncio.run(run(args, cluster, verifier.info["port"], verifier.popen.pid, table, backend))
            refusals = [line for line in verifier.log_path.read_text().splitlines() if "refused" in line]
    quiet = statistics.median(results[0][1])
    print(f"{'phase':<20} {'rounds':>7} {'p50 ms':>8} {'p99 ms':>8} {'p50/quiet':>10} {'verifier CPU':>13}  attack")
    worst = (0.0, "")
    for name, latencies, cpu, reports in results:
        p50, p99 = statistics.median(latencies), percentile(latencies, 99)
        ratio = p50 / quiet
        print(f"{name:<20} {len(latencies):>7} {p50 * 1e3:>8.2f} {p99 * 1e3:>8.2f} {ratio:>9.2f}x {cpu:>12.0%}  {reports}")
        if not name.startswith("quiet") and ratio > worst[0]:
            worst = (ratio, name)
    print(f"verifier log: {len(refusals)} lines with 'refused' (rate-limited: once per client, kind and minute)")
    print(f"worst attack p50 {worst[0]:.2f}x quiet ({worst[1]})")


if __name__ == "__main__":
    main()
