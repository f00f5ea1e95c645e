"""Test hosts: Linux network namespaces joined by veth pairs and bridges, each a host with an
address of its own (issue 36).

    net = Network(["router", "verifier-1", "drafter-1"], far=["drafter-1"])
    net.up()                      # namespaces, bridges, veths, addresses; the reaper
    net.address("router")         # "10.36.K.2": exists only inside these namespaces
    net.wrap("router")            # ["ip", "netns", "exec", NS]: a command's prefix to run there
    net.cut("verifier-1")         # the host's link down (a cable pulled); net.restore(...) puts it back
    net.down()                    # every namespace and link gone

Layout: a `switch` namespace holds the bridges. The `near` bridge joins the near hosts (the
data centre: routers, verifiers, the etcd members) and this process's own namespace through
one veth (the client link: the test's HTTP client reaches the router's front door over it;
its address is the subnet's .254). The `far` bridge joins the far hosts (drafters elsewhere).
Without a relay the far hosts hang on the near bridge too; with one (`relay=True`) the two
bridges are separate wires and `relay.py` runs on a relay host between them, which answers
on each wire for the hosts of the other and forwards TCP and UDP after a set delay. Every host
also has `lo` up.

Cleanup on every exit path: `down()` (context manager, fixtures' finally); and a reaper
process started by `up()` in a session of its own that waits on a pipe from this process and,
when the pipe closes (this process ended in any way, SIGKILL included), kills every process
left in the namespaces and deletes them. Namespaces are named `s36-PID-HOST`; `sweep_stale()`
removes those whose creating PID is gone (a machine's leftovers).

`unavailable()` says why namespaces cannot be made here (not root, no `ip`, `ip netns add`
refused); tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

PREFIX = "s36"
CMD_TIMEOUT_S = 20.0


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made on this machine."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip ARGS`, with a timeout; a failure raises with ip's own message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """None where namespaces can be made; otherwise the reason."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not on PATH"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    probe = f"{PREFIX}-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        made = ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` refused: {made.stderr.strip()}"
        veth = ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be made: {veth.stderr.strip()}"
        bridge = ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"bridges cannot be made: {bridge.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` failed: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_namespaces(names: Iterable[str]) -> None:
    """Kill every process in each namespace, then delete it (no error for one already gone)."""
    for name in names:
        pids = ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.kill(int(pid), 9)
        ip("netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces (and client links) of harnesses whose process is gone."""
    stale = []
    for name in list_namespaces():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-.+", name)
        if m and not _pid_alive(int(m.group(1))):
            stale.append(name)
    remove_namespaces(stale)
    return stale


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    segment: str          # "near" or "far"
    link: str             # the host's own end of its veth (inside its namespace)
    port_link: str        # the other end, on the bridge in the switch namespace


class Network:
    """N hosts (one namespace each) on a /24 of 10.36.0.0/16 chosen free of this machine's
    routes. `far`: the hosts on the far wire (the relay's other side). `relay`: make the
    relay host's two namespaces (`relay-far` on the far wire, holding the near hosts'
    addresses; `relay-near` on the near wire, holding the far hosts')."""

    def __init__(self, hosts: Iterable[str], *, far: Iterable[str] = (), relay: bool = False):
        self.names = list(hosts)
        self.far = set(far)
        if not self.far <= set(self.names):
            raise ValueError(f"far hosts {sorted(self.far - set(self.names))} are not hosts")
        if len(self.names) > 200:
            raise ValueError("at most 200 hosts")
        self.relay = relay
        self.pid = os.getpid()
        self.tag = f"{self.pid % 100000}"
        self.subnet = _free_subnet()
        net = ipaddress.ip_network(self.subnet)
        self.client_address = str(net.network_address + 254)
        self.switch = f"{PREFIX}-{self.pid}-switch"
        self.client_link = f"c{self.tag}"
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(self.names):
            self.hosts[name] = Host(name, f"{PREFIX}-{self.pid}-{name}", str(net.network_address + 2 + i),
                                    "far" if name in self.far else "near", "eth0", f"h{self.tag}x{i}")
        self.relay_namespaces = ({"far": f"{PREFIX}-{self.pid}-relay-far", "near": f"{PREFIX}-{self.pid}-relay-near"}
                                 if relay else {})
        self._reaper: subprocess.Popen | None = None
        self._up = False

    # ------------------------------------------------------------------ queries

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def namespace(self, host: str) -> str:
        return self.hosts[host].namespace

    def wrap(self, host: str) -> list[str]:
        """The prefix that runs a command on `host`."""
        return ["ip", "netns", "exec", self.hosts[host].namespace]

    def namespaces(self) -> list[str]:
        return [self.switch, *(h.namespace for h in self.hosts.values()), *self.relay_namespaces.values()]

    # ------------------------------------------------------------------ life

    def up(self) -> Network:
        reason = unavailable()
        if reason:
            raise HostsUnavailable(reason)
        sweep_stale()
        self._start_reaper()
        self._up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        sw = self.switch
        ip("netns", "add", sw)
        ip("-n", sw, "link", "set", "lo", "up")
        bridges = {"near": "brnear", "far": "brfar" if self.relay else "brnear"}
        for bridge in set(bridges.values()):
            ip("-n", sw, "link", "add", bridge, "type", "bridge")
            ip("-n", sw, "link", "set", bridge, "up")
        prefix = self.subnet.split("/")[1]
        for host in self.hosts.values():
            ip("netns", "add", host.namespace)
            ip("-n", host.namespace, "link", "set", "lo", "up")
            ip("-n", sw, "link", "add", host.port_link, "type", "veth", "peer", "name", host.link,
               "netns", host.namespace)
            ip("-n", sw, "link", "set", host.port_link, "master", bridges[host.segment])
            ip("-n", sw, "link", "set", host.port_link, "up")
            ip("-n", host.namespace, "addr", "add", f"{host.address}/{prefix}", "dev", host.link)
            ip("-n", host.namespace, "link", "set", host.link, "up")
        for side, namespace in self.relay_namespaces.items():
            # relay-far answers on the far wire for the near hosts, relay-near on the near
            # wire for the far ones (relay.py forwards between the two)
            ip("netns", "add", namespace)
            ip("-n", namespace, "link", "set", "lo", "up")
            port = f"r{self.tag}{side[0]}"
            ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            ip("-n", sw, "link", "set", port, "master", bridges[side])
            ip("-n", sw, "link", "set", port, "up")
            stands_for = [h for h in self.hosts.values() if (h.segment == "near") == (side == "far")]
            for h in stands_for:
                ip("-n", namespace, "addr", "add", f"{h.address}/{prefix}", "dev", "eth0")
            ip("-n", namespace, "link", "set", "eth0", "up")
        # the client link: this process's namespace on the near wire
        ip("link", "add", self.client_link, "type", "veth", "peer", "name", f"s{self.tag}", "netns", sw)
        ip("-n", sw, "link", "set", f"s{self.tag}", "master", bridges["near"])
        ip("-n", sw, "link", "set", f"s{self.tag}", "up")
        ip("addr", "add", f"{self.client_address}/{prefix}", "dev", self.client_link)
        ip("link", "set", self.client_link, "up")

    def _start_reaper(self) -> None:
        """A process of its own session that deletes the namespaces once this one is gone."""
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "sdcp_fast.hosts.reaper", self.client_link, *self.namespaces()],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True)

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            remove_namespaces(reversed(self.namespaces()))
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            ip("link", "del", self.client_link, check=False)
        if self._reaper is not None:
            with contextlib.suppress(OSError):
                self._reaper.stdin.close()          # the reaper finds nothing left and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(CMD_TIMEOUT_S)

    def __enter__(self) -> Network:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    # ------------------------------------------------------------------ faults

    def cut(self, host: str) -> None:
        """The host's link down (`ip link set ... down` on its veth): nothing in or out."""
        h = self.hosts[host]
        ip("-n", h.namespace, "link", "set", h.link, "down")

    def restore(self, host: str) -> None:
        h = self.hosts[host]
        ip("-n", h.namespace, "link", "set", h.link, "up")

    def link_up(self, host: str) -> bool:
        h = self.hosts[host]
        return "state UP" in ip("-n", h.namespace, "link", "show", h.link).stdout or \
            ",UP" in ip("-n", h.namespace, "link", "show", h.link).stdout


def _free_subnet() -> str:
    """A /24 of 10.36.0.0/16 that no route of this namespace and no other harness uses."""
    taken = []
    for line in ip("-4", "route", "show", check=False).stdout.splitlines():
        dest = line.split()[0]
        if dest != "default":
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(dest, strict=False))
    start = os.getpid() % 250
    for k in range(250):
        candidate = ipaddress.ip_network(f"10.36.{(start + k) % 250}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return str(candidate)
    raise HostsUnavailable("no free /24 in 10.36.0.0/16")
