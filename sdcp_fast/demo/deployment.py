"""The demo's deployment: a router (or several, sharing the sessions), a verifier (the target
model) and two drafters (the draft model) as separate `sdcp-fast serve` processes, speaking
HTTP/2 (or HTTP/3) with mutual TLS on loopback, sharing an embedded object store, a file
commit log and the routers' session table beside it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ..drafter import rounds_from_file
from ..procs import Cluster, free_port

DRAFTERS = ("drafter-1", "drafter-2")
LEASE_TTL_S = 2.0      # a router silent this long loses its sessions to another
UP_MAX_NEW = 256       # `sdcp-fast up`: new tokens of a request that gives no max_tokens


def router_names(routers: int) -> list[str]:
    return ["router"] + [f"router-{n}" for n in range(2, routers + 1)]


def drafter_names(drafters: int) -> list[str]:
    return [f"drafter-{n}" for n in range(1, drafters + 1)]


def plan(cluster: Cluster, target_spec: str, draft_spec: str, draft_digest: str, max_new: int,
         stop: tuple[int, ...] = (), *, verifier_spec: str | None = None, slow: bool = False,
         drafters: int = len(DRAFTERS), rounds_log: bool = True, metrics: bool = False,
         speculation: str = "auto", m_max: int = 8, **router_options) -> None:
    """Add the instances and their configs (as many routers as the cluster was made for);
    `cluster.start()` launches them. `stop`: the
    contract's stop tokens (the real pair's end of turn); `verifier_spec`: the target as the
    verifier loads it (options such as threads; the router's spec names the same weights);
    `slow`: a model whose first load may convert files and whose passes take 100 ms, so
    TTLs and timeouts with room for it. `rounds_log`: the drafters log every verdict (the
    demo's table; a long-running `up` leaves it off); `metrics`: every instance serves
    /metrics and /health on a port of its own; `router_options`: more [router] members
    (`up`'s front door and served name); `speculation`: the verifier's policy (auto, on, off);
    `m_max`: the contract's longest proposal."""
    # TTLs with room for a busy 2-core machine: an instance is declared dead only when silent
    ttl = 8000 if slow else 3000

    def observed() -> dict:
        return {"metrics": f"127.0.0.1:{free_port()}"} if metrics else {}

    cluster.verifier("verifier", model=verifier_spec or target_spec, max_wait_ms=1.0, ttl_ms=ttl,
                     status_interval_s=0.5, speculation=speculation, **observed())
    names = drafter_names(drafters)
    for name in names:
        extra = {"request_timeout_s": 60.0, "give_up_after_s": 120.0} if slow else {}
        if not rounds_log:
            extra["rounds_log"] = None
        cluster.drafter(name, model=draft_spec, ttl_ms=ttl if slow else 2000, status_interval_s=0.4,
                        **extra, **observed())
    # self_max: under "on" a self-decoding period of 16 tokens shows the ladder giving the
    # drafter another chance; under "auto" the verifier ends a period when speculating pays
    # again, and a fixed period would only add drafter catch-ups
    contract = {"rule": 1, "m_max": m_max, "max_new": max_new, "low_rounds": 4,
                "fallback": ["reduce", "switch", "self_decode"], "self_load": 60}
    if speculation == "on":
        contract["self_max"] = 16
    if stop:
        contract["stop"] = list(stop)
    extra = {"stall_s": 60.0, "request_timeout_s": 60.0} if slow else {}
    for router in router_names(len(cluster.router_ports)):
        cluster.router(model=target_spec, drafter_models=dict.fromkeys(names, draft_digest), name=router,
                       contract=contract, lease_ttl_s=LEASE_TTL_S, **extra, **observed(), **router_options)


def rounds(cluster: Cluster) -> list[dict]:
    """Every verdict the drafters received (their rounds logs), in time order."""
    out = []
    for name in [i.name for i in cluster.instances.values() if i.role == "drafter"]:
        for record in rounds_from_file(cluster.workdir / f"{name}.rounds.jsonl"):
            if not record.get("dropped"):
                record["drafter"] = name
                out.append(record)
    return sorted(out, key=lambda r: r["t"])


def fast_tmp() -> str | None:
    """tmpfs for the work directory when there is one: the commit log syncs every record."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


@contextlib.contextmanager
def work_directory(workdir: str | None):
    """The given directory (kept), or a temporary one on tmpfs when there is one (removed)."""
    keep = workdir is not None
    root = Path(workdir) if keep else Path(tempfile.mkdtemp(prefix="sdcp-demo-", dir=fast_tmp()))
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
