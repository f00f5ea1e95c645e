"""A deployment on test hosts: `procs.Cluster` with each instance on a host of its own
(issue 36).

    net = Network(["router", "verifier-1", "drafter-1", "etcd-1", ...]).up()
    cluster = HostCluster(workdir, net, commit_log=etcd.url("etcd-1"))
    cluster.verifier("verifier-1", model=...)        # the instance's name is its host's name
    cluster.router(model=..., drafter_models=..., name="router")
    cluster.start()                                   # certificates naming each host's address

Every instance listens on its host's address at PORT (8443; the router's front door at
FRONTDOOR_PORT, 8080), so its URI is `https://ADDR:8443/` and its certificate's SAN is that
address. The process runs inside the host's namespace (`ip netns exec`), started and watched
exactly as `Cluster` does (own session, SIGTERM when this process dies, ready file).
Routers' names must be hosts too: `routers` takes their host names in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import InstanceConfig
from ..procs import Cluster, Instance
from .netns import Network

PORT = 8443
FRONTDOOR_PORT = 8080


@dataclasses.dataclass
class HostInstance(Instance):
    address: str = "127.0.0.1"
    wrap: list[str] = dataclasses.field(default_factory=list)

    @property
    def uri(self) -> str:
        return f"https://{self.address}:{self.port}/"

    @property
    def frontdoor_url(self) -> str:
        return f"http://{self.address}:{self.info['frontdoor_port']}"


class HostCluster(Cluster):
    def __init__(self, workdir: str | Path, net: Network, *, routers: list[str] | tuple[str, ...] = ("router",),
                 commit_log_of: Callable[[str], str] | None = None, **options: Any):
        """`commit_log_of(host)`: the commit log spec of the instance on that host (an etcd
        member of its own, say); by default the cluster's `commit_log`."""
        super().__init__(workdir, routers=len(routers), **options)
        self.net = net
        self.router_hosts = list(routers)
        self.commit_log_of = commit_log_of

    @property
    def router_uris(self) -> list[str]:
        return [f"https://{self.net.address(h)}:{PORT}/" for h in self.router_hosts]

    def router(self, *, model: str, drafter_models: dict[str, str], contract: dict[str, Any] | None = None,
               name: str = "router", **options: Any) -> Instance:
        options.setdefault("frontdoor", f"{self.net.address(name)}:{FRONTDOOR_PORT}")
        return super().router(model=model, drafter_models=drafter_models, contract=contract, name=name, **options)

    def _config(self, role: str, name: str, port: int, model: str, **members: Any) -> InstanceConfig:
        if "commit_log" in members and self.commit_log_of is not None:
            members["commit_log"] = self.commit_log_of(name)
        config = super()._config(role, name, port, model, **members)
        address = self.net.address(name)
        return dataclasses.replace(config, uri=f"https://{address}:{PORT}/", listen=f"{address}:{PORT}")

    def _add(self, instance: Instance) -> Instance:
        if instance.name not in self.net.hosts:
            raise ValueError(f"instance {instance.name!r}: no host of that name")
        fields = {f.name: getattr(instance, f.name) for f in dataclasses.fields(Instance)}
        fields["port"] = PORT
        placed = HostInstance(**fields, address=self.net.address(instance.name), wrap=self.net.wrap(instance.name))
        return super()._add(placed)

    def command_prefix(self, instance: Instance) -> list[str]:
        """Cluster.launch runs each instance inside its host's namespace."""
        assert isinstance(instance, HostInstance)
        return list(instance.wrap)
