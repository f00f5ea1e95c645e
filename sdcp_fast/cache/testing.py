"""Start real Redis and etcd servers on loopback for tests and benchmarks.

The tests never assume a running server: they start Debian's `redis-server` and `etcd`
themselves on free ports with throw-away data, wait until each answers, and stop them by pid.
A missing binary is an error (`ServerUnavailable`), never a reason to skip: a store that is
not tested is a store that does not work.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..ports import free_port

READY_TIMEOUT_S = 20.0


class ServerUnavailable(RuntimeError):
    """A server binary is missing or did not become ready in time."""


@dataclass(frozen=True)
class Server:
    name: str
    url: str  # the spec to hand to open_store / open_log, e.g. "redis://127.0.0.1:6390/0"
    port: int
    process: subprocess.Popen


def _require_binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ServerUnavailable(
            f"`{name}` is not on PATH; install Debian's {package} "
            f"(`apt-get install -y {package}`, or `make system-deps`)"
        )
    return path


def _wait_until(ready, process: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerUnavailable(f"{what} exited with {process.returncode}: {_tail(log)}")
        if ready():
            return
        time.sleep(0.05)
    _stop(process)
    raise ServerUnavailable(f"{what} not ready after {READY_TIMEOUT_S}s: {_tail(log)}")


def _tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-2000:]
    return ""


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _redis_ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _etcd_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def redis_server(extra_args: tuple[str, ...] = ()) -> Iterator[Server]:
    """A throw-away redis-server on 127.0.0.1: no persistence, default `noeviction` policy."""
    binary = _require_binary("redis-server", "redis-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sdcp-redis-") as workdir:
        log = Path(workdir) / "redis.log"
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", workdir, *extra_args]
        with open(log, "wb") as out:
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_until(lambda: _redis_ready(port), process, "redis-server", log)
            yield Server("redis", f"redis://127.0.0.1:{port}/0", port, process)
        finally:
            _stop(process)


@contextlib.contextmanager
def etcd_server() -> Iterator[Server]:
    """A throw-away single-member etcd (3.4) on 127.0.0.1 with its data in a temp dir."""
    binary = _require_binary("etcd", "etcd-server")
    client_port, peer_port = free_port(), free_port()
    client_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    with tempfile.TemporaryDirectory(prefix="sdcp-etcd-") as workdir:
        log = Path(workdir) / "etcd.log"
        args = [binary, "--name", "sdcp-test", "--data-dir", f"{workdir}/data",
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"sdcp-test={peer_url}", "--log-level", "error"]
        with open(log, "wb") as out:
            process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_until(lambda: _etcd_ready(client_url), process, "etcd", log)
            yield Server("etcd", f"etcd://127.0.0.1:{client_port}", client_port, process)
        finally:
            _stop(process)
