"""A session the verifier decodes itself from its first token (its speculation plan says a
drafter would not pay: here speculation "off"), through real processes: the router assigns
no drafter at the open, assigns one when the self-decoding period ends (self_max), and the
streamed output is the target's greedy output, no token lost or repeated."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from roles_support import FrontDoorClient, build_cluster, greedy

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
pytestmark = pytest.mark.timeout(120)


def test_sessions_self_decode_from_the_open_and_get_a_drafter_when_the_period_ends(tmp_path):
    cluster, target = build_cluster(tmp_path, contract={"self_load": 100, "self_max": 10},
                                    verifier_options={"speculation": "off"})
    cluster.start(timeout=60)
    fd = FrontDoorClient(cluster.instances["router"].frontdoor_url)
    try:
        fd.wait_live(len(cluster.instances) - 1)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: fd.generate(p, max_new=30), PROMPTS))
        for prompt, r in zip(PROMPTS, results, strict=True):
            assert r["end"]["finish"] == "finish"
            assert r["tokens"] == greedy(target, prompt, 30)   # FrontDoorClient checks no gap or repeat
            what = [h["what"] for h in fd.info(r["id"])["history"]]
            assert "opened" in what
            # no drafter before the verifier's first self-decoding period ended (10 tokens)
            first_assigned = what.index("assigned") if "assigned" in what else len(what)
            assert "event-self_decode" in what[:first_assigned] and "assigned" in what, what
    finally:
        fd.close()
        cluster.stop()
