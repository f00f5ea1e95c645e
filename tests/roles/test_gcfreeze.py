"""Serving processes freeze start-up's objects out of the cyclic collector (sdcp_fast/gcfreeze.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from sdcp_fast import gcfreeze

PROBE = textwrap.dedent("""
    import gc, json
    from sdcp_fast import gcfreeze

    class Node:
        pass

    lived = [[n] for n in range(50_000)]                # start-up's long-lived objects
    garbage = Node(); garbage.me = garbage; del garbage  # a cycle left over from start-up
    frozen = gcfreeze.freeze_startup_objects()
    walked = len(gc.get_objects(generation=2))           # what a full collection walks now
    cycle = Node(); cycle.me = cycle; del cycle          # serving's cycles are still collected
    found = gc.collect()
    print(json.dumps({"frozen": frozen, "count": gc.get_freeze_count(), "walked": walked,
                      "found": found, "lived": len(lived)}))
""")


def probe(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                         check=True, timeout=60).stdout
    return json.loads(out)


def test_start_up_objects_are_frozen_and_new_cycles_still_collected():
    env = {k: v for k, v in os.environ.items() if k != gcfreeze.ENV}
    got = probe(env)
    assert got["frozen"] == got["count"] >= 50_000
    assert got["walked"] < 1_000            # the 50,000 lists are out of the collector's walk
    assert got["found"] >= 1                # the cycle made after the freeze was collected


def test_sdcp_gc_freeze_0_leaves_the_collector_alone():
    got = probe({**os.environ, gcfreeze.ENV: "0"})
    assert got["frozen"] == got["count"] == 0
    assert got["walked"] >= 50_000
