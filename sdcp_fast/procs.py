"""Run a router, verifiers and drafters as separate processes on loopback (the demo, tests).

    cluster = Cluster(workdir, protocol="h2")
    v1 = cluster.verifier("v1", model="tiny:demo-target")
    d1 = cluster.drafter("d1", model="tiny:demo-draft")
    r = cluster.router(model="tiny:demo-target", drafter_models={"d1": digest_hex})
    cluster.start()          # certificates, one TOML config each, `sdcp-fast serve ROLE`;
                             # waits until every instance is serving
    ... r.frontdoor_url ...
    cluster.stop()           # SIGTERM, then SIGKILL after a grace period

Every instance gets a fresh port (ports.free_port), a certificate whose URI SAN is
`https://127.0.0.1:PORT/`, the shared embedded store and file commit log of the workdir,
a config written from the schema of config.py (`<name>.toml`, by tomli-w), and a log file
`<name>.log`. Options of `verifier`, `drafter` and `router` are members of the role's table
(config.VerifierSection, DrafterSection, RouterSection); `contract` those of ContractSection. Children are started in their own process group and ask the
kernel to SIGTERM them if this process dies, so nothing outlives the demo or a test.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import config as schema
from .config import (
    ContractSection,
    DrafterEntry,
    DrafterSection,
    InstanceConfig,
    RouterSection,
    VerifierSection,
)
from .ports import free_port

# OpenMP threads spin about 0.1-0.3 ms after a parallel region, then sleep (cores.py says
# why): libgomp counts pause instructions, LLVM/Intel OpenMP's KMP_BLOCKTIME milliseconds
SPIN_ENV = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def spin_env(environ) -> dict[str, str]:
    """The bounded spin for a child process, or nothing where `environ` sets a policy."""
    return {} if any(v in environ for v in WAIT_POLICY_VARS) else dict(SPIN_ENV)

PR_SET_PDEATHSIG = 1


@dataclass
class Instance:
    role: str
    name: str
    port: int
    config: InstanceConfig
    workdir: Path
    popen: subprocess.Popen | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def uri(self) -> str:
        return f"https://127.0.0.1:{self.port}/"

    @property
    def config_path(self) -> Path:
        return self.workdir / f"{self.name}.toml"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def ready_path(self) -> Path:
        return self.workdir / f"{self.name}.ready"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def frontdoor_url(self) -> str:
        return f"http://127.0.0.1:{self.info['frontdoor_port']}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL: the instance dies without a word (a crash)."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)

    def pause(self) -> None:
        """SIGSTOP: the process is alive but silent (a partition)."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def stop(self, grace: float = 5.0) -> None:
        if not self.alive():
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class Cluster:
    """`routers`: how many routers the deployment has (they share the sessions through the
    session table beside the commit log; verifiers and drafters report to each).
    `commit_log`: the commit log spec (default: a file log in the workdir), e.g. etcd://."""

    def __init__(self, workdir: str | Path, *, protocol: str = "h2", threads: int = 1,
                 log_level: str = "info", routers: int = 1, commit_log: str | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.protocol = protocol
        self.threads = threads
        self.log_level = log_level
        self.certs = self.workdir / "certs"
        self.store = f"embedded:{self.workdir / 'mlc'}"
        self.commit_log = commit_log or f"file:{self.workdir / 'commit-log'}"
        self.instances: dict[str, Instance] = {}
        self.router_ports = [free_port() for _ in range(routers)]

    @property
    def router_port(self) -> int:
        return self.router_ports[0]

    @property
    def router_uri(self) -> str:
        return self.router_uris[0]

    @property
    def router_uris(self) -> list[str]:
        return [f"https://127.0.0.1:{port}/" for port in self.router_ports]

    def _reports(self) -> dict[str, Any]:
        """Who may instruct an instance and where its reports go: every router."""
        return {"routers": self.router_uris, "router_uri": self.router_uri,
                "router_uris": self.router_uris if len(self.router_ports) > 1 else []}

    def _config(self, role: str, name: str, port: int, model: str, **members: Any) -> InstanceConfig:
        return InstanceConfig(role=role, uri=f"https://127.0.0.1:{port}/", listen=f"127.0.0.1:{port}",
                              certs=str(self.certs), protocol=self.protocol, model=model,
                              store=self.store, ready_file=str(self.workdir / f"{name}.ready"),
                              log_level=self.log_level, **members)

    def verifier(self, name: str, *, model: str, **options: Any) -> Instance:
        port = free_port()
        section = VerifierSection(**{**self._reports(), "ttl_ms": 1500, "status_interval_s": 0.25, "output_wait_s": 2.0,
                                     **options})
        config = self._config("verifier", name, port, model, commit_log=self.commit_log, verifier=section)
        return self._add(Instance("verifier", name, port, config, self.workdir))

    def drafter(self, name: str, *, model: str, **options: Any) -> Instance:
        port = free_port()
        section = DrafterSection(**{**self._reports(), "ttl_ms": 1000, "status_interval_s": 0.2,
                                    "rounds_log": str(self.workdir / f"{name}.rounds.jsonl"), **options})
        config = self._config("drafter", name, port, model, drafter=section)
        return self._add(Instance("drafter", name, port, config, self.workdir))

    def router(self, *, model: str, drafter_models: dict[str, str], contract: dict[str, Any] | None = None,
               name: str = "router", **options: Any) -> Instance:
        """`drafter_models`: drafter name -> its model's digest (hex). Routers take the
        ports made at construction in order (`routers=` of the Cluster)."""
        taken = {i.port for i in self.instances.values() if i.role == "router"}
        free = [p for p in self.router_ports if p not in taken]
        if not free:
            raise ValueError(f"the cluster was made for {len(self.router_ports)} router(s)")
        port = free[0]
        verifiers = [i.uri for i in self.instances.values() if i.role == "verifier"]
        drafters = [DrafterEntry(self.instances[n].uri, model_digest=d) for n, d in drafter_models.items()]
        section = RouterSection(**{"verifiers": verifiers, "frontdoor": f"127.0.0.1:{free_port()}",
                                   "stall_s": 5.0, **options, "drafters": drafters,
                                   "contract": ContractSection(**(contract or {}))})
        config = self._config("router", name, port, model, commit_log=self.commit_log, router=section)
        return self._add(Instance("router", name, port, config, self.workdir))

    def add(self, name: str, config: InstanceConfig) -> Instance:
        """An instance from a config written elsewhere (`sdcp-fast up DIR`): it runs as
        written, with relative paths relative to the workdir, where its ready file goes."""
        port = urlsplit(config.uri).port or 443
        config = dataclasses.replace(config, ready_file=str(self.workdir / f"{name}.ready"))
        return self._add(Instance(config.role, name, port, config, self.workdir))

    def _add(self, instance: Instance) -> Instance:
        if instance.name in self.instances:
            raise ValueError(f"instance {instance.name!r} exists")
        self.instances[instance.name] = instance
        return instance

    # ------------------------------------------------------------------ processes

    def start(self, timeout: float = 60.0) -> None:
        """Certificates for every instance (from the CA of its certs directory, made there if
        missing; a directory holding a CA certificate without its key is the operator's and is
        used as it is), configs, processes; wait until all serve."""
        from .transport.certs import CA_CERT_FILE, CA_KEY_FILE, make_certs

        by_dir: dict[Path, list[str]] = {}
        for i in self.instances.values():
            by_dir.setdefault(self.workdir / i.config.certs, []).append(i.uri)
        for directory, uris in by_dir.items():
            if (directory / CA_KEY_FILE).is_file() or not (directory / CA_CERT_FILE).is_file():
                make_certs(directory, uris)
        for instance in self.instances.values():
            self.launch(instance)
        self.wait_ready(list(self.instances.values()), timeout)

    def launch(self, instance: Instance) -> None:
        instance.config_path.write_text(schema.dumps(instance.config))
        instance.ready_path.unlink(missing_ok=True)
        # each compute call takes the host's free cores (cores.py); its OpenMP threads spin
        # briefly between the parallel regions of the call, then sleep (cores.py)
        env = {**spin_env(os.environ), **os.environ, "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        log = open(instance.log_path, "ab")  # noqa: SIM115 (the child owns it)
        instance.popen = subprocess.Popen(
            [*self.command_prefix(instance), sys.executable, "-m", "sdcp_fast.cli", "serve", instance.role,
             "--config", str(instance.config_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=self.workdir,
            start_new_session=True, preexec_fn=die_with_parent())
        log.close()

    def command_prefix(self, instance: Instance) -> list[str]:
        """What the instance's command runs under (nothing here; hosts.HostCluster: its host's
        `ip netns exec`)."""
        return []

    def wait_ready(self, instances: list[Instance], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(instances)
        while pending:
            for instance in list(pending):
                if instance.ready_path.is_file():
                    instance.info = json.loads(instance.ready_path.read_text())
                    pending.remove(instance)
                elif not instance.alive():
                    raise RuntimeError(f"{instance.name} exited during start:\n{instance.log_tail()}")
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not serving after {timeout} s: {[i.name for i in pending]}")
            time.sleep(0.05)

    def stop(self) -> None:
        for instance in reversed(list(self.instances.values())):
            instance.signal(signal.SIGCONT)
            instance.signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for instance in self.instances.values():
            if instance.popen is None:
                continue
            try:
                instance.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                instance.kill()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def die_with_parent(parent_pid: int | None = None) -> Callable[[], None]:
    """A `preexec_fn` that makes the child get SIGTERM when its parent dies (Linux prctl).

    Built in the parent: libc is loaded here, since loading a library between fork and exec
    can deadlock on a lock another thread of the parent held at the fork. The child only
    calls prctl, then checks that its parent is still the one that forked it: a parent that
    died before prctl took effect would never deliver the signal. `parent_pid` defaults to
    this process."""
    parent = os.getpid() if parent_pid is None else parent_pid
    prctl = _libc_prctl()

    def in_child() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)    # what the parent's death would have sent
    return in_child


@functools.cache
def _libc_prctl():
    """libc's prctl, or None where there is none (not Linux)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
