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
from ..procs import die_with_parent

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


class _ServerProcess:
    """A server process that can be killed (SIGKILL: a crash) and started again on the same
    ports and data; it dies with this process (procs.die_with_parent)."""

    process: subprocess.Popen | None = None
    log: Path

    def _launch(self, args: list[str], ready, what: str) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                            preexec_fn=die_with_parent())
        _wait_until(ready, self.process, what, self.log)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)


class RedisProcess(_ServerProcess):
    """A redis-server on 127.0.0.1 with its data and log in `workdir`, on a port of its own:
    `start()`, `kill()` (SIGKILL: a crash), `start()` again on the same port and data,
    `stop()`; the process dies with this one. Durable as a commit log needs it: the
    append-only file fsynced before every answer (`appendfsync always`), so an acknowledged
    append survives kill -9 (Redis's default `everysec` may lose the last second); no RDB."""

    def __init__(self, workdir: Path):
        self.binary = _require_binary("redis-server", "redis-server")
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"   # the spec for open_store / open_log / open_table
        self.log = self.workdir / "redis.log"

    def start(self) -> None:
        data = self.workdir / "redis-data"
        data.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(data),
                "--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        self._launch(args, lambda: _redis_ready(self.port), "redis-server")


class EtcdProcess(_ServerProcess):
    """A single-member etcd (3.4) on 127.0.0.1 with its data and log in `workdir`, on ports
    of its own: `start()`, `kill()` (SIGKILL: a crash), `start()` again on the same ports
    and data, `stop()`. The process dies with this one (procs.die_with_parent)."""

    def __init__(self, workdir: Path, *, name: str = "sdcp-test"):
        self.binary = _require_binary("etcd", "etcd-server")
        self.workdir, self.name = Path(workdir), name
        self.port = free_port()
        self.client_url = f"http://127.0.0.1:{self.port}"
        self.peer_url = f"http://127.0.0.1:{free_port()}"
        self.url = f"etcd://127.0.0.1:{self.port}"   # the spec for open_log / open_table
        self.log = self.workdir / "etcd.log"

    def start(self) -> None:
        args = [self.binary, "--name", self.name, "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", f"{self.name}={self.peer_url}", "--log-level", "error"]
        self._launch(args, lambda: _etcd_ready(self.client_url), "etcd")


@contextlib.contextmanager
def etcd_server() -> Iterator[Server]:
    """A throw-away single-member etcd (3.4) on 127.0.0.1 with its data in a temp dir."""
    with tempfile.TemporaryDirectory(prefix="sdcp-etcd-") as workdir:
        etcd = EtcdProcess(Path(workdir))
        try:
            etcd.start()
            yield Server("etcd", etcd.url, etcd.port, etcd.process)
        finally:
            etcd.stop()
