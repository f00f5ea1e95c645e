"""The floor under any round between two processes on this machine: a ping-pong with no work.

A child process echoes every message back; the parent sends one, waits for the echo, and
times the round trip, `--rounds` times, over loopback UDP and TCP, first with blocking
sockets on both ends (the kernel's own cost: two sends, two wake-ups of a process asleep
in recv) and then with both ends on the event loop SDCP runs on (`sdcp_fast.aio.run`:
uvloop when installed; a datagram or stream protocol each side), which adds the loop's
wake-up and dispatch. No TLS, no HTTP, no CBOR: a proposal-sized message (1,200 bytes)
and its echo. An SDCP round between processes pays this floor once (proposal out, verdict
back); what bench_round.py measures above it is the protocol and the work.

It also times one piece of a round's work, the verifier's commit-log append (`file:` log on
/dev/shm, one record, `append_batch` as the engine calls it), back to back and right after
the process slept 0.5 and 2 ms: at one session each end of a round waits that long for the
other, and work that follows an idle gap runs slower than the same work warm (on a VM the
vCPU halts and the host runs other work on its core; on bare metal, deep C-states).

    .venv/bin/python bench/bench_pingpong.py [--rounds 5000]

The last line reads `ping-pong p50 udp X us, tcp X us (blocking); udp X us, tcp X us (event
loop); a commit-log append X us warm, X us after 0.5 ms idle, X us after 2 ms`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdcp_fast import aio  # noqa: E402

MESSAGE = b"x" * 1200


def _udp_pair() -> tuple[socket.socket, socket.socket]:
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind(("127.0.0.1", 0))
    b.bind(("127.0.0.1", 0))
    a.connect(b.getsockname())
    b.connect(a.getsockname())
    return a, b


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def _recv_message(sock: socket.socket, stream: bool) -> None:
    if not stream:
        sock.recv(65536)
        return
    got = 0
    while got < len(MESSAGE):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("peer closed")
        got += len(chunk)


def _blocking_echo(sock: socket.socket, stream: bool, rounds: int) -> None:
    for _ in range(rounds):
        _recv_message(sock, stream)
        sock.sendall(MESSAGE)


def _loop_echo(sock: socket.socket, stream: bool) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        class Echo(asyncio.Protocol, asyncio.DatagramProtocol):
            def connection_made(self, transport):
                self.transport, self.pending = transport, 0

            def datagram_received(self, data, addr):
                self.transport.sendto(data)

            def data_received(self, data):
                self.pending += len(data)
                while self.pending >= len(MESSAGE):
                    self.pending -= len(MESSAGE)
                    self.transport.write(MESSAGE)

            def connection_lost(self, exc):
                if not done.done():
                    done.set_result(None)

            def error_received(self, exc):
                if not done.done():
                    done.set_result(None)

        if stream:
            await loop.connect_accepted_socket(Echo, sock)
        else:
            await loop.create_datagram_endpoint(Echo, sock=sock)
        await done

    aio.run(main())


def _blocking_rounds(sock: socket.socket, stream: bool, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        sock.sendall(MESSAGE)
        _recv_message(sock, stream)
        times.append(time.perf_counter() - started)
    return times


def _loop_rounds(sock: socket.socket, stream: bool, rounds: int) -> list[float]:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        times: list[float] = []
        state = {"echo": None, "pending": 0}

        class Ping(asyncio.Protocol, asyncio.DatagramProtocol):
            def connection_made(self, transport):
                self.transport = transport

            def _arrived(self):
                future, state["echo"] = state["echo"], None
                if future is not None and not future.done():
                    future.set_result(None)

            def datagram_received(self, data, addr):
                self._arrived()

            def data_received(self, data):
                state["pending"] += len(data)
                if state["pending"] >= len(MESSAGE):
                    state["pending"] -= len(MESSAGE)
                    self._arrived()

        if stream:
            transport, _ = await loop.connect_accepted_socket(Ping, sock)
            send = transport.write
        else:
            transport, _ = await loop.create_datagram_endpoint(Ping, sock=sock)
            send = transport.sendto
        for _ in range(rounds):
            state["echo"] = loop.create_future()
            started = time.perf_counter()
            send(MESSAGE)
            await asyncio.wait_for(state["echo"], 5)
            times.append(time.perf_counter() - started)
        transport.close()
        return times

    return aio.run(main())


def measure(kind: str, on_loop: bool, rounds: int) -> list[float]:
    stream = kind == "tcp"
    ours, theirs = _tcp_pair() if stream else _udp_pair()
    pid = os.fork()
    if pid == 0:   # the echo: exits when its rounds are done or the parent goes (or stops it)
        ours.close()
        try:
            if on_loop:
                _loop_echo(theirs, stream)
            else:
                _blocking_echo(theirs, stream, rounds + 200)
        finally:
            os._exit(0)
    theirs.close()
    try:
        run = _loop_rounds if on_loop else _blocking_rounds
        times = run(ours, stream, rounds + 200)[200:]   # the first 200: warm-up
    finally:
        ours.close()
        if on_loop and not stream:   # a datagram echo is not told that its peer has gone
            os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    return times


def append_after_idle(gaps_s: tuple[float, ...], appends: int) -> dict[float, float]:
    """p50 seconds of one commit-log append (FileCommitLog.append_batch of one record on
    /dev/shm), each right after sleeping `gap` seconds, per gap."""
    import tempfile

    from sdcp_fast.cache.api import Append
    from sdcp_fast.cache.file_log import FileCommitLog

    async def run() -> dict[float, float]:
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
            log, record, length, p50 = FileCommitLog(root), b"r" * 90, 0, {}
            for gap in gaps_s:
                times = []
                for _ in range(appends):
                    if gap:
                        time.sleep(gap)
                    started = time.perf_counter()
                    (answer,) = await log.append_batch([Append("log/bench", record, 1, length)])
                    times.append(time.perf_counter() - started)
                    length = answer
                p50[gap] = statistics.median(times)
            return p50

    return aio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5000)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; {len(MESSAGE)}-byte message and echo, "
          f"{args.rounds} rounds each\n")
    print("| ends | transport | p50 us | p99 us | mean us |")
    print("|---|---|---:|---:|---:|")
    p50 = {}
    for on_loop in (False, True):
        for kind in ("udp", "tcp"):
            times = sorted(measure(kind, on_loop, args.rounds))
            ends = "event loop" if on_loop else "blocking"
            p50[ends, kind] = 1e6 * statistics.median(times)
            print(f"| {ends} | {kind} | {p50[ends, kind]:.0f} | {1e6 * times[int(0.99 * len(times))]:.0f} | "
                  f"{1e6 * statistics.fmean(times):.0f} |")
    gaps = (0.0, 0.0005, 0.002)
    append = append_after_idle(gaps, max(200, args.rounds // 5))
    print("\n| commit-log append | p50 us |\n|---|---:|")
    for gap in gaps:
        print(f"| {'back to back' if not gap else f'after {gap * 1e3:g} ms idle'} | {1e6 * append[gap]:.1f} |")
    print()
    print(f"ping-pong p50 udp {p50['blocking', 'udp']:.0f} us, tcp {p50['blocking', 'tcp']:.0f} us (blocking); "
          f"udp {p50['event loop', 'udp']:.0f} us, tcp {p50['event loop', 'tcp']:.0f} us (event loop); "
          f"a commit-log append {1e6 * append[0.0]:.0f} us warm, {1e6 * append[0.0005]:.0f} us after 0.5 ms idle, "
          f"{1e6 * append[0.002]:.0f} us after 2 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
