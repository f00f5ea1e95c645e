"""The demo with several routers (`sdcp-fast demo --routers N`): once every prompt is under
way, the router the client streams from is killed (SIGKILL, no goodbye); another router takes
its sessions over when its lease ends, and the client resumes each stream there (client.py).
The report says who took each session over, how long after the kill, and where each stream
resumed."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from ..procs import Cluster
from .client import Generation
from .deployment import LEASE_TTL_S


@dataclass
class Kill:
    router: str
    at: float | None = None                        # wall-clock time of the kill
    tokens: list[int] = field(default_factory=list)  # each generation's tokens then


def kill_first_router(cluster: Cluster, names: list[str], generations: list[Generation], max_new: int) -> Kill:
    """Kill router `names[0]` (in a thread) once every generation has a quarter of its tokens."""
    kill = Kill(names[0])
    enough = max(1, max_new // 4)

    def wait_and_kill() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(g.finish or g.error for g in generations):
                return                         # too late to show anything
            if all(len(g.tokens) >= enough for g in generations):
                kill.tokens = [len(g.tokens) for g in generations]
                cluster.instances[kill.router].kill()
                kill.at = time.time()
                print(f"\n*** killed {kill.router} (SIGKILL) at {kill.tokens} tokens: its lease ends within "
                      f"{LEASE_TTL_S:g} s, then {' or '.join(names[1:])} takes its sessions over ***\n", flush=True)
                return
            time.sleep(0.01)

    threading.Thread(target=wait_and_kill, daemon=True).start()
    return kill


def report(cluster: Cluster, names: list[str], generations: list[Generation], kill: Kill) -> None:
    if kill.at is None:
        print(f"\n{kill.router} was not killed: the generations ended first (try a larger --max-new)")
        return
    print(f"\nrouter failover: {kill.router} killed at {kill.tokens} tokens")
    deadline = time.monotonic() + 3 * LEASE_TTL_S      # streams may end (read from the log) first
    for n, g in enumerate(generations):
        taker, after = None, None
        while taker is None and time.monotonic() < deadline:
            taker, after = _taken_over(cluster, names[1:], g.gid, kill.at)
            if taker is None:
                time.sleep(0.05)
        where = f"resumed at token {g.resumed[0]}" if g.resumed else "did not need to resume"
        took = f"taken over by {taker} {after:.2f} s after the kill" if taker else "not taken over"
        print(f"  [{n + 1}] {took} (lease TTL {LEASE_TTL_S:g} s); the stream {where}")


def _taken_over(cluster: Cluster, names: list[str], gid: str, killed_at: float) -> tuple[str | None, float | None]:
    """(router that owns the generation now, seconds from the kill to its takeover)."""
    for name in names:
        try:
            info = httpx.get(f"{cluster.instances[name].frontdoor_url}/v1/generations/{gid}", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            continue
        takeovers = [h for h in info.get("history", []) if h["what"] == "takeover"]
        if info.get("owned") and takeovers:
            return name, takeovers[0]["t"] - killed_at
    return None, None
