"""One deployment on test hosts, for tests and benchmarks (issue 36): the network, the
3-member etcd cluster (commit log and session table), optionally the delay relay, and the
role instances, built and torn down together.

    with Testbed(workdir, roles={"router": "router", "verifier-1": "verifier", "drafter-1": "drafter"},
                 far=["drafter-1"], delay_ms=5.0) as bed:
        cluster = bed.cluster             # a HostCluster: add instances, then bed.start()
        ...

Roles know every etcd member and talk to one, chosen per host (`etcd_of`): spread over the
members, so the log's traffic does not all go through one, and a member that cannot be
reached sends a role to the next. The commit log's and session table's keys live
under a fresh prefix. Teardown: instances (SIGTERM, then SIGKILL), relay, etcd members, then
the namespaces; the reaper does the same if this process dies first. SIGTERM and SIGHUP to a
process that opened a Testbed raise SystemExit, so a benchmark stopped that way unwinds
through the same teardown.
"""

from __future__ import annotations

import contextlib
import signal
import uuid
from collections.abc import Iterable
from pathlib import Path

from .deployment import HostCluster
from .etcd_cluster import CLIENT_PORT, EtcdCluster
from .netns import Network

ETCD_HOSTS = ("etcd-1", "etcd-2", "etcd-3")


def _exit_on_signal(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


class Testbed:
    __test__ = False      # not a pytest class

    def __init__(self, workdir: str | Path, *, hosts: Iterable[str], far: Iterable[str] = (),
                 routers: Iterable[str] = ("router",), delay_ms: float | None = None,
                 protocol: str = "h2", cluster_options: dict | None = None):
        """`hosts`: the role hosts (instance names); `far`: those behind the relay;
        `delay_ms`: None for no relay (every host on one wire), else the relay's one-way delay
        in each direction (RTT = 2 x delay_ms between a far and a near host)."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.role_hosts = list(hosts)
        self.delay_ms = delay_ms
        self.net = Network([*self.role_hosts, *ETCD_HOSTS], far=far, relay=delay_ms is not None)
        self.etcd: EtcdCluster | None = None
        self.relay = None
        self.cluster: HostCluster | None = None
        self.prefix = f"/{uuid.uuid4().hex[:12]}/"
        self._routers = list(routers)
        self._protocol = protocol
        self._cluster_options = dict(cluster_options or {})
        self._old_handlers: dict[int, object] = {}

    def etcd_of(self, host: str) -> str:
        """The commit log spec a role on `host` uses: every member, the first by the host's
        position (so the roles' calls spread over the members; a member that cannot be
        reached sends them to the next: cache/etcd_http.Members)."""
        index = self.role_hosts.index(host) if host in self.role_hosts else 0
        order = [ETCD_HOSTS[(index + k) % len(ETCD_HOSTS)] for k in range(len(ETCD_HOSTS))]
        members = ",".join(f"{self.net.address(h)}:{CLIENT_PORT}" for h in order)
        return f"etcd://{members}?prefix={self.prefix}log/"

    @property
    def commit_log(self) -> str:
        """A spec this process reads the log through (over the client link): every member."""
        return self.etcd_of("")

    def open(self) -> Testbed:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError):      # not the main thread: leave it
                self._old_handlers[signum] = signal.signal(signum, _exit_on_signal)
        try:
            self.net.up()
            self.etcd = EtcdCluster(self.net, list(ETCD_HOSTS), self.workdir / "etcd")
            self.etcd.start()
            if self.delay_ms is not None:
                from .relay import RelayProcess
                self.relay = RelayProcess(self.net, self.delay_ms, self.workdir / "relay.log")
                self.relay.start()
            self.cluster = HostCluster(self.workdir / "cluster", self.net, routers=self._routers,
                                       protocol=self._protocol, commit_log=self.commit_log,
                                       commit_log_of=self.etcd_of, **self._cluster_options)
        except BaseException:
            self.close()
            raise
        return self

    def start(self, timeout: float = 90.0) -> None:
        self.cluster.start(timeout=timeout)

    def close(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.stop()
            if self.relay is not None:
                self.relay.stop()
            if self.etcd is not None:
                self.etcd.stop()
        finally:
            self.net.down()
            for signum, handler in self._old_handlers.items():
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(signum, handler)
            self._old_handlers.clear()

    def __enter__(self) -> Testbed:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
