"""Helpers of the host tests: recovery times, measured and bounded."""

from __future__ import annotations

import time


def recovery_bound(*timers_s: float) -> float:
    """The most a recovery may take: a few times the timers that drive it (TTLs, stall and
    lease times, election timeouts) plus room for a loaded machine. Loose on purpose: the
    2-core CI machine stretches every step, so the bound catches a hang or a wake-up that
    never comes, not a slow second; the measured times are printed with each test."""
    return 3 * sum(timers_s) + 10.0


def wait_committed_past(fd, gid: str, committed: int, timeout: float, away_from: str | None = None) -> float:
    """Seconds until generation `gid` has committed more than `committed` tokens (or ended);
    with `away_from`, commits drafted by another drafter than that one (a round already at
    the verifier when the drafter was cut off still commits, and is no recovery)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        info = fd.info(gid)
        if info.get("finish") is not None:
            return time.monotonic() - start
        if info["committed"] > committed:
            if away_from is None:
                return time.monotonic() - start
            if info.get("drafter") not in (None, away_from):
                return time.monotonic() - start
            committed = info["committed"]
        time.sleep(0.01)
    raise AssertionError(f"generation {gid}: nothing committed past {committed} in {timeout:g} s")
