"""The delay relay (issue 36): a host between the far wire (drafters) and the near wire
(router, verifiers, etcd) that forwards TCP and UDP after a set one-way delay. This kernel
has no `netem` qdisc, so the delay is put in the path by a process.

    python -m sdcp_fast.hosts.relay --far NS --near NS --delay-ms D --ports 8443 \\
        --near-hosts A,B,... --far-hosts C,D,...

The relay host is two namespaces (netns.Network with relay=True): `relay-far` is on the far
wire and holds the addresses of the near hosts, `relay-near` is on the near wire and holds
those of the far hosts. A drafter that connects to a verifier's address reaches relay-far,
which connects to the real verifier from relay-near *with the drafter's own address* as its
source; the other way round likewise. So URIs, certificates and the peers' view of who calls
stay exactly as without the relay: it is transparent at the TCP and UDP level (the process
opens each socket in the right namespace with setns(2) on the namespace's file).

Delay: every chunk of a TCP stream, and every datagram, is written out `delay` seconds after
it was read, in order, per direction (RTT between a far and a near host = 2 x delay + the
relay's own cost, which `bench/bench_hosts.py` measures at zero delay). Deadlines are kept by
a timerfd (microseconds, not the event loop's millisecond timeouts). TCP's own handshake and
acknowledgements are the relay's with each side (not delayed), so a connection's first
exchange is one RTT short of a real WAN's; every request and response is delayed in full.
`--loss P` drops that fraction of UDP datagrams (HTTP/3); a TCP stream is never altered.

It prints "ready" once every listener is open, and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import heapq
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

CLONE_NEWNET = 0x40000000
TFD_NONBLOCK = 0o4000
TFD_CLOEXEC = 0o2000000
TFD_TIMER_ABSTIME = 1
CLOCK_MONOTONIC = 1
CHUNK = 256 * 1024

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Namespaces:
    """Open sockets in a named network namespace: `with ns.inside(name): socket.socket(...)`."""

    def __init__(self, names: list[str]):
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)
        self.fds = {n: os.open(f"/var/run/netns/{n}", os.O_RDONLY) for n in names}

    @contextlib.contextmanager
    def inside(self, name: str):
        self._enter(self.fds[name])
        try:
            yield
        finally:
            self._enter(self.home)

    @staticmethod
    def _enter(fd: int) -> None:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")


class Timer:
    """Callbacks at CLOCK_MONOTONIC deadlines (time.monotonic()), from a timerfd the event
    loop watches: precise to microseconds where the loop's own timeouts round to a ms."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.fd = _libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.count = itertools.count()
        self.armed: float | None = None
        loop.add_reader(self.fd, self._fired)

    def at(self, due: float, callback: Callable[[], None]) -> None:
        if due <= time.monotonic():
            self.loop.call_soon(callback)
            return
        heapq.heappush(self.heap, (due, next(self.count), callback))
        if self.armed is None or due < self.armed:
            self._arm(due)

    def _arm(self, due: float) -> None:
        spec = _Itimerspec()
        spec.it_value.tv_sec = int(due)
        spec.it_value.tv_nsec = int((due - int(due)) * 1e9)
        if _libc.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime")
        self.armed = due

    def _fired(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)
        self.armed = None
        now = time.monotonic()
        while self.heap and self.heap[0][0] <= now:
            _, _, callback = heapq.heappop(self.heap)
            callback()
        if self.heap:
            self._arm(self.heap[0][0])


class Relay:
    def __init__(self, namespaces: Namespaces, delay_s: float, loss: float = 0.0, seed: int = 0):
        self.ns = namespaces
        self.delay = delay_s
        self.loss = loss
        self.rng = random.Random(seed)
        self.loop = asyncio.get_running_loop()
        self.timer = Timer(self.loop)
        self.tasks: set[asyncio.Task] = set()
        self.flows: dict[tuple, socket.socket] = {}

    # ------------------------------------------------------------------ TCP

    def listen_tcp(self, listen_ns: str, address: str, port: int, out_ns: str) -> socket.socket:
        with self.ns.inside(listen_ns):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(512)
        sock.setblocking(False)
        self._spawn(self._accept(sock, out_ns))
        return sock

    async def _accept(self, listener: socket.socket, out_ns: str) -> None:
        target = listener.getsockname()
        while True:
            client, peer = await self.loop.sock_accept(listener)
            self._spawn(self._connect(client, peer, target, out_ns))

    async def _connect(self, client: socket.socket, peer: tuple, target: tuple, out_ns: str) -> None:
        with self.ns.inside(out_ns):
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            upstream.bind((peer[0], 0))          # the caller's own address: the relay is transparent
            upstream.setblocking(False)
            client.setblocking(False)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.wait_for(self.loop.sock_connect(upstream, target), 10.0)
        except (OSError, TimeoutError):
            client.close()
            upstream.close()
            return
        done = [0]

        def closed() -> None:
            done[0] += 1
            if done[0] == 2:
                client.close()
                upstream.close()
        self._spawn(self._pipe(client, upstream, closed))
        self._spawn(self._pipe(upstream, client, closed))

    async def _pipe(self, src: socket.socket, dst: socket.socket, closed: Callable[[], None]) -> None:
        queue: deque[tuple[float, bytes | None]] = deque()
        ready = asyncio.Event()

        async def writer() -> None:
            try:
                while True:
                    await ready.wait()
                    ready.clear()
                    now = time.monotonic()
                    while queue and queue[0][0] <= now:
                        _, data = queue.popleft()
                        if data is None:
                            with contextlib.suppress(OSError):
                                dst.shutdown(socket.SHUT_WR)
                            return
                        await self.loop.sock_sendall(dst, data)
            except OSError:
                with contextlib.suppress(OSError):
                    src.shutdown(socket.SHUT_RD)
            finally:
                closed()

        task = self._spawn(writer())
        try:
            while True:
                data = await self.loop.sock_recv(src, CHUNK)
                due = time.monotonic() + self.delay
                queue.append((due, data or None))
                self.timer.at(due, ready.set)
                if not data:
                    break
        except OSError:
            queue.append((time.monotonic(), None))
            self.timer.at(0.0, ready.set)
        await task

    # ------------------------------------------------------------------ UDP

    def listen_udp(self, listen_ns: str, address: str, port: int, out_ns: str) -> socket.socket:
        with self.ns.inside(listen_ns):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((address, port))
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._datagrams, sock, out_ns)
        return sock

    def _datagrams(self, listener: socket.socket, out_ns: str) -> None:
        target = listener.getsockname()
        for _ in range(64):
            try:
                data, peer = listener.recvfrom(65536)
            except BlockingIOError:
                return
            flow = self.flows.get((peer, target))
            if flow is None:
                with self.ns.inside(out_ns):
                    flow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                flow.bind(peer)                 # the caller's address and port, on the other wire
                flow.connect(target)
                flow.setblocking(False)
                self.flows[(peer, target)] = flow
                self.loop.add_reader(flow.fileno(), self._replies, flow, listener, peer)
            self._later(lambda f=flow, d=data: _send(f, d))

    def _replies(self, flow: socket.socket, listener: socket.socket, peer: tuple) -> None:
        for _ in range(64):
            try:
                data = flow.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                return
            self._later(lambda d=data: _sendto(listener, d, peer))

    def _later(self, send: Callable[[], None]) -> None:
        if self.loss and self.rng.random() < self.loss:
            return
        self.timer.at(time.monotonic() + self.delay, send)

    def _spawn(self, coro) -> asyncio.Task:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


def _send(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.send(data)


def _sendto(sock: socket.socket, data: bytes, peer: tuple) -> None:
    with contextlib.suppress(OSError):
        sock.sendto(data, peer)


async def serve(args: argparse.Namespace) -> None:
    namespaces = Namespaces([args.far, args.near])
    relay = Relay(namespaces, args.delay_ms / 1000.0, args.loss)
    ports = [int(p) for p in args.ports.split(",") if p]
    for address in filter(None, args.near_hosts.split(",")):
        for port in ports:
            relay.listen_tcp(args.far, address, port, args.near)
            relay.listen_udp(args.far, address, port, args.near)
    for address in filter(None, args.far_hosts.split(",")):
        for port in ports:
            relay.listen_tcp(args.near, address, port, args.far)
            relay.listen_udp(args.near, address, port, args.far)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        relay.loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdcp_fast.hosts.relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--far", required=True, help="the relay's namespace on the far wire")
    parser.add_argument("--near", required=True, help="the relay's namespace on the near wire")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    parser.add_argument("--loss", type=float, default=0.0, help="fraction of UDP datagrams dropped")
    parser.add_argument("--ports", default="8443")
    parser.add_argument("--near-hosts", default="", help="addresses of the near hosts (comma-separated)")
    parser.add_argument("--far-hosts", default="", help="addresses of the far hosts (comma-separated)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args))
    return 0


class RelayProcess:
    """The relay as a process of this harness: `start()` waits for its "ready", `stop()`."""

    def __init__(self, net, delay_ms: float, log: Path, *, ports: tuple[int, ...] = (8443,), loss: float = 0.0):
        from ..procs import die_with_parent

        self.net, self.delay_ms, self.log = net, delay_ms, Path(log)
        self.args = [sys.executable, "-m", "sdcp_fast.hosts.relay", "--far", net.relay_namespaces["far"],
                     "--near", net.relay_namespaces["near"], "--delay-ms", str(delay_ms), "--loss", str(loss),
                     "--ports", ",".join(map(str, ports)),
                     "--near-hosts", ",".join(h.address for h in net.hosts.values() if h.segment == "near"),
                     "--far-hosts", ",".join(h.address for h in net.hosts.values() if h.segment == "far")]
        self._preexec = die_with_parent()
        self.popen: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> None:
        with open(self.log, "ab") as err:
            self.popen = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                          preexec_fn=self._preexec)
        ready = _readline(self.popen, timeout)
        if ready.strip() != b"ready":
            self.stop()
            raise RuntimeError(f"the relay did not start: {self.log.read_text(errors='replace')[-1500:]}")

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def _readline(popen: subprocess.Popen, timeout: float) -> bytes:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(popen.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return b""
    return popen.stdout.readline()


if __name__ == "__main__":
    sys.exit(main())
