"""A verifier or drafter with no room answers `capacity`, and the router places the session on
another one: real processes on loopback (the router's scripted half is in test_router_recovery)."""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from roles_support import FrontDoorClient, build_cluster, greedy

from sdcp_fast.ports import free_port
from sdcp_fast.transport import TLSConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "transport"))
from transport_rawh2 import RawH2  # noqa: E402  (the raw HTTP/2 client of the transport tests)

pytestmark = pytest.mark.timeout(120)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8]]


def test_sessions_refused_for_capacity_are_placed_on_the_other_verifier(tmp_path):
    # v1's budget holds no session at all; v2 has the default
    metrics = free_port()
    cluster, target = build_cluster(tmp_path, verifiers=2, drafters=1,
                                    verifier_options={"v1": {"session_memory_mb": 0},
                                                      "v2": {"metrics": f"127.0.0.1:{metrics}"}})
    cluster.start(timeout=60)
    fd = FrontDoorClient(cluster.instances["router"].frontdoor_url)
    try:
        fd.wait_live(len(cluster.instances) - 1)
        v1, v2 = cluster.instances["v1"].uri, cluster.instances["v2"].uri
        with ThreadPoolExecutor(len(PROMPTS)) as pool:   # a burst: the router spreads it over both
            results = list(pool.map(lambda p: fd.generate(p, max_new=30), PROMPTS))
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result["end"]["finish"] == "finish"
            assert result["tokens"] == greedy(target, prompt, 30)
            assert fd.info(result["id"])["verifier"] == v2
        router_log = cluster.instances["router"].log_path.read_text()
        refusals = [line for line in router_log.splitlines()
                    if f"{v1} refused session-open" in line and "bytes" in line]
        assert refusals, "v1 was never asked"
        # the transport's refusals reach the verifier's metrics page (serve.py wires them)
        asyncio.run(_malformed_request(cluster.instances["v2"].port, TLSConfig.for_instance(
            cluster.certs, cluster.router_uri)))
        page = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5.0).text
        assert 'sdcp_refusals_total{kind="malformed"} 1' in page
        for instance in cluster.instances.values():   # serve.py froze start-up's objects (gcfreeze)
            assert "start-up objects out of the cyclic collector" in instance.log_path.read_text()
    finally:
        fd.close()
        cluster.stop()



def test_sessions_a_full_drafter_refuses_are_placed_on_the_other_drafter(tmp_path):
    # d1's budget holds no session at all; d2 has the default
    cluster, target = build_cluster(tmp_path, verifiers=1, drafters=2,
                                    drafter_options={"d1": {"session_memory_mb": 0}})
    cluster.start(timeout=60)
    fd = FrontDoorClient(cluster.instances["router"].frontdoor_url)
    try:
        fd.wait_live(len(cluster.instances) - 1)
        d1, d2 = cluster.instances["d1"].uri, cluster.instances["d2"].uri
        with ThreadPoolExecutor(len(PROMPTS)) as pool:   # a burst: the router spreads it over both
            results = list(pool.map(lambda p: fd.generate(p, max_new=30), PROMPTS))
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result["end"]["finish"] == "finish"
            assert result["tokens"] == greedy(target, prompt, 30)
            assert fd.info(result["id"])["drafter"] == d2
        router_log = cluster.instances["router"].log_path.read_text()
        refusals = [line for line in router_log.splitlines()
                    if f"drafter {d1} refused the assignment (capacity: " in line]
        assert refusals, "d1 was never asked"
        drafter_log = cluster.instances["d1"].log_path.read_text()
        assert "assigned (epoch" not in drafter_log   # d1 never ran a session
    finally:
        fd.close()
        cluster.stop()


async def _malformed_request(port: int, tls: TLSConfig) -> None:
    client = await RawH2.open(port, tls)
    bad = client.request("GET", "/sessions/x/output", [(b"Upper", b"1")])
    await client.until(lambda c: c.done(bad))
    assert client.streams[bad].reset == 1   # PROTOCOL_ERROR, on that stream only
    await client.close()
