"""Python's cyclic collector in a serving process: what start-up built is frozen out of it.

A role's start-up (imports, torch, the model, TLS contexts, routes) leaves some 10^5-10^6
objects that live as long as the process. Each full collection walks all of them: in a
verifier under load (bench/bench_round.py, 32 sessions) that was a 50-120 ms stop of the
event loop every few seconds, every round in flight waiting behind it. `gc.freeze()` after
start-up moves them to the permanent generation, which no collection walks; the collector
still runs on what serving allocates (cycles among requests, sessions, tasks).

SDCP_GC_FREEZE=0 leaves the collector as Python set it.
"""

from __future__ import annotations

import gc
import logging
import os

log = logging.getLogger("sdcp_fast.gcfreeze")
ENV = "SDCP_GC_FREEZE"


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object left (call when start-up is over); the number
    of objects frozen, 0 where SDCP_GC_FREEZE=0 asked for none."""
    if os.environ.get(ENV, "1").strip() == "0":
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the cyclic collector", frozen)
    return frozen
