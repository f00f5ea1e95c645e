"""A 3-member etcd cluster (Debian's etcd-server, 3.4), one member per test host: the
deployment's commit log and the routers' session table (issue 36).

    etcd = EtcdCluster(net, ["etcd-1", "etcd-2", "etcd-3"], workdir)
    etcd.start()                  # all members, waits until each is healthy and a leader exists
    etcd.url("etcd-2")            # etcd://ADDR:2379, the spec a role's commit log names
    etcd.leader()                 # the host whose member leads
    etcd.kill("etcd-3"); etcd.start_member("etcd-3")    # a crash, and the member back on its data
    etcd.stop()

Members listen on their host's address only (client 2379, peer 2380); this process reaches
them over the client link. Each member dies with this process (procs.die_with_parent) and
with its namespace (netns.Network.down and the reaper kill what is left)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import httpx

from ..cache.testing import ServerUnavailable, _require_binary
from ..procs import die_with_parent
from .netns import Network

CLIENT_PORT = 2379
PEER_PORT = 2380
READY_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 1.0


class EtcdCluster:
    def __init__(self, net: Network, hosts: list[str], workdir: Path, *, token: str = "sdcp-hosts"):
        self.binary = _require_binary("etcd", "etcd-server")
        self.net, self.hosts = net, list(hosts)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.processes: dict[str, subprocess.Popen] = {}
        self._started: set[str] = set()

    def client_url(self, host: str) -> str:
        return f"http://{self.net.address(host)}:{CLIENT_PORT}"

    def peer_url(self, host: str) -> str:
        return f"http://{self.net.address(host)}:{PEER_PORT}"

    def url(self, host: str) -> str:
        """The spec for a commit log or session table on this member."""
        return f"etcd://{self.net.address(host)}:{CLIENT_PORT}"

    def log_path(self, host: str) -> Path:
        return self.workdir / f"{host}.log"

    def _args(self, host: str) -> list[str]:
        cluster = ",".join(f"{h}={self.peer_url(h)}" for h in self.hosts)
        state = "existing" if host in self._started else "new"
        return [*self.net.wrap(host), self.binary, "--name", host,
                "--data-dir", str(self.workdir / f"{host}.data"),
                "--listen-client-urls", self.client_url(host), "--advertise-client-urls", self.client_url(host),
                "--listen-peer-urls", self.peer_url(host), "--initial-advertise-peer-urls", self.peer_url(host),
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", self.token, "--log-level", "error"]

    def start(self) -> None:
        for host in self.hosts:
            self._launch(host)
        self.wait_healthy(self.hosts)

    def start_member(self, host: str) -> None:
        """A member started again on its data (after `kill`)."""
        self._launch(host)
        self.wait_healthy([host])

    def _launch(self, host: str) -> None:
        with open(self.log_path(host), "ab") as out:
            self.processes[host] = subprocess.Popen(self._args(host), stdout=out, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, preexec_fn=die_with_parent())
        self._started.add(host)

    def status(self, host: str) -> dict | None:
        """The member's /v3/maintenance/status (its id, the leader's id, raft term), or None."""
        try:
            r = httpx.post(f"{self.client_url(host)}/v3/maintenance/status", json={}, timeout=HTTP_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def healthy(self, host: str) -> bool:
        try:
            r = httpx.get(f"{self.client_url(host)}/health", timeout=HTTP_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json().get("health") == "true"

    def wait_healthy(self, hosts: list[str], timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        pending = list(hosts)
        while pending:
            for host in list(pending):
                process = self.processes.get(host)
                if process is not None and process.poll() is not None:
                    raise ServerUnavailable(f"etcd member {host} exited with {process.returncode}: "
                                            f"{self._tail(host)}")
                if self.healthy(host):
                    pending.remove(host)
            if pending and time.monotonic() > deadline:
                raise ServerUnavailable(f"etcd members not healthy after {timeout} s: {pending}: "
                                        f"{self._tail(pending[0])}")
            time.sleep(0.1)

    def leader(self) -> str | None:
        """The host whose member is the leader, as the live members see it."""
        ids = {}
        leader_id = None
        for host in self.hosts:
            status = self.status(host)
            if status:
                ids[status["header"]["member_id"]] = host
                leader_id = leader_id or status.get("leader")
        return ids.get(leader_id) if leader_id else None

    def kill(self, host: str) -> None:
        """SIGKILL one member (a crash); its data stays."""
        process = self.processes.get(host)
        if process is not None and process.poll() is None:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(5)

    def _tail(self, host: str) -> str:
        with contextlib.suppress(OSError):
            return self.log_path(host).read_text(errors="replace")[-1500:]
        return ""
