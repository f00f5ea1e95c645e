"""Admission at the router (router/admission.py): a bounded first-in-first-out queue past
the capacity, a 503 with Retry-After once it is full, and the AIMD capacity from measured
inter-token latency; unit tests with a fake clock, then one deployment of processes whose
router runs one generation at a time."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from roles_support import build_cluster, parse_sse, wait_until

from sdcp_fast.core.problems import Kind, ProblemError
from sdcp_fast.router.admission import Admission, Full


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def settle():
    """Let every ready task run (a queued acquire, a granted one resuming)."""
    for _ in range(5):
        await asyncio.sleep(0)


def admission(**kw) -> tuple[Admission, Clock, list[float], list[int]]:
    clock, waits, rejected = Clock(), [], []
    a = Admission(clock=clock, on_wait=waits.append, on_reject=lambda: rejected.append(1), **kw)
    return a, clock, waits, rejected


# ---------------------------------------------------------------------- the queue


def test_the_queue_holds_requests_beyond_capacity_and_serves_them_in_order():
    async def main():
        a, clock, waits, _ = admission(max_running=1, max_waiting=10)
        first = await a.acquire()
        granted = []

        async def client(name):
            slot = await a.acquire()
            granted.append(name)
            return slot

        tasks = [asyncio.create_task(client(n)) for n in "bcd"]
        await settle()
        assert (a.running, a.waiting, granted) == (1, 3, [])
        clock.now += 2.0
        first.release()
        await settle()
        assert granted == ["b"] and a.waiting == 2
        clock.now += 1.0
        tasks[0].result().release()
        await settle()
        tasks[1].result().release()
        await settle()
        assert granted == ["b", "c", "d"] and (a.running, a.waiting) == (1, 0)
        assert waits == [0.0, 2.0, 3.0, 3.0]        # each admission observes its wait
        tasks[2].result().release()
        assert a.running == 0
    run(main())


def test_a_full_queue_refuses_at_once_and_queues_nothing():
    async def main():
        a, _, _, rejected = admission(max_running=1, max_waiting=2)
        await a.acquire()
        waiting = [asyncio.create_task(a.acquire()) for _ in range(2)]
        await settle()
        with pytest.raises(Full):
            await a.acquire()
        assert rejected == [1] and a.waiting == 2 and a.running == 1
        for t in waiting:
            t.cancel()
    run(main())


def test_a_waiter_whose_client_goes_away_leaves_the_queue_without_a_slot():
    async def main():
        a, _, waits, _ = admission(max_running=1, max_waiting=4)
        first = await a.acquire()
        gone, next_ = asyncio.create_task(a.acquire()), asyncio.create_task(a.acquire())
        await settle()
        gone.cancel()
        await settle()
        assert gone.cancelled() and a.waiting == 1
        first.release()
        await settle()
        assert next_.done() and a.running == 1 and a.waiting == 0 and len(waits) == 2
    run(main())


def test_a_slot_granted_as_its_client_goes_away_passes_to_the_next():
    async def main():
        a, _, _, _ = admission(max_running=1, max_waiting=4)
        first = await a.acquire()
        late, next_ = asyncio.create_task(a.acquire()), asyncio.create_task(a.acquire())
        await settle()
        first.release()            # grants `late` its slot; it is cancelled before it resumes
        late.cancel()
        await settle()
        assert late.cancelled() and next_.done() and a.running == 1
    run(main())


def test_release_counts_once_and_adopted_sessions_are_never_refused():
    async def main():
        a, _, _, _ = admission(max_running=1, max_waiting=0)
        slot = await a.acquire()
        adopted = a.adopt()                  # at capacity, with no room to wait: counted anyway
        assert a.running == 2
        with pytest.raises(Full):
            await a.acquire()
        slot.release()
        slot.release()
        assert a.running == 1
        adopted.release()
        assert a.running == 0
        assert (await a.acquire()).released is False
    run(main())


# ---------------------------------------------------------------------- the controller


def test_without_a_target_capacity_is_max_running():
    a, _, _, _ = admission(max_running=7)
    a.observe_itl(10.0, 1)
    a.adjust()
    assert a.capacity == 7


def test_aimd_cuts_to_80_percent_of_running_over_target_and_adds_one_while_some_wait():
    async def main():
        a, _, _, _ = admission(max_running=10, max_waiting=10, itl_target_s=0.1)
        slots = [await a.acquire() for _ in range(10)]
        queued = [asyncio.create_task(a.acquire()) for _ in range(2)]
        await settle()
        a.observe_itl(0.6, 3)                # 0.2 s a token: over the target
        a.observe_itl(0.05, 1)
        a.adjust()
        assert a.capacity == 8
        a.observe_itl(0.6, 3)
        a.adjust()
        assert a.capacity == 8               # 80 % of those running, not of the capacity
        a.adjust()
        assert a.capacity == 8               # no tokens measured: kept
        for s in slots[:3]:
            s.release()
        await settle()
        assert a.running == 8 and queued[0].done() and not queued[1].done()
        a.observe_itl(0.09, 1)               # under the target, above 80 % of it: kept
        a.adjust()
        assert a.capacity == 8
        a.observe_itl(0.5, 10)               # 0.05 s a token (the median) ...
        a.observe_itl(0.5, 1)                # ... whatever one slow token says
        a.adjust()
        await settle()
        assert a.capacity == 9 and queued[1].done() and a.running == 9
        a.observe_itl(0.01, 5)
        a.adjust()
        assert a.capacity == 9               # nobody waits: no reason to grow
    run(main())


def test_aimd_never_goes_below_one_nor_above_max_running():
    async def main():
        a, _, _, _ = admission(max_running=2, max_waiting=10, itl_target_s=0.1)
        slot = await a.acquire()
        a.observe_itl(1.0, 1)
        a.adjust()
        assert a.capacity == 1
        waiter = asyncio.create_task(a.acquire())
        await settle()
        for _ in range(3):
            a.observe_itl(0.01, 1)
            a.adjust()
        await settle()
        assert a.capacity == 2 and waiter.done()
        slot.release()
        waiter.result().release()
    run(main())


def test_the_controller_runs_every_interval():
    async def main():
        a = Admission(max_running=4, itl_target_s=0.01, interval_s=0.01)
        slots = [await a.acquire() for _ in range(4)]
        task = asyncio.create_task(a.run())
        a.observe_itl(1.0, 1)
        await asyncio.sleep(0.05)
        task.cancel()
        assert a.capacity == 3
        for s in slots:
            s.release()
    run(main())


# ---------------------------------------------------------------------- the router


def test_a_session_waiter_is_cancelled_even_as_new_output_arrives():
    """A client's wait on its session ends when its task is cancelled, also when the
    session's output arrives at the same moment (wait_for on Python 3.11 would go on)."""
    from sdcp_fast.router.sessions import RouterSession

    async def main():
        s = RouterSession(b"s" * 16, None, (1,), "log")

        async def client():
            while True:
                await s.wait_changed(15)

        task = asyncio.create_task(client())
        await settle()
        s.notify()
        task.cancel()
        await settle()
        assert task.cancelled()
    run(main())


@pytest.mark.parametrize(("member", "value"), [("max_running", 0), ("max_waiting", -1), ("itl_target_ms", -5.0),
                                               ("admission_interval_s", 0.0)])
def test_admission_members_out_of_range_are_refused_by_name(member, value):
    from sdcp_fast.router import RouterConfig

    with pytest.raises(ValueError, match=member):
        RouterConfig("https://router.test/", (), (), **{member: value})


def test_the_router_answers_unavailable_when_full_and_gives_back_a_failed_sessions_slot(tmp_path):
    from roles_support import make_tables

    from sdcp_fast.models import load_backend
    from sdcp_fast.router import RouterConfig, RouterService

    target, _ = make_tables(tmp_path)
    router = RouterService(RouterConfig("https://router.test/", ("https://v1.test/",), (),
                                        max_running=1, max_waiting=0), load_backend(target), None, None,
                           client=None)

    async def main():
        held = router.admission.adopt()
        with pytest.raises(ProblemError) as refused:
            await router.generate([1, 2], router.make_contract())
        assert refused.value.problem.kind == Kind.UNAVAILABLE and "queue is full" in refused.value.problem.detail
        held.release()
        with pytest.raises(ProblemError):        # no session table: the open fails ...
            await router.generate([1, 2], router.make_contract())
        assert router.admission.running == 0 and router._slots == {}   # ... and its slot is back

    run(main())
    assert router.metrics.value("admission_rejected_total") == 1


# ---------------------------------------------------------------------- a deployment


def raw_request(port: int, path: str, body: dict) -> socket.socket:
    """A POST sent on a socket of its own, so that the test decides when its client goes
    away (closing the socket) whatever the machine's speed."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def series(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@pytest.mark.timeout(240)
def test_front_door_queues_in_order_and_refuses_a_full_queue_with_retry_after(tmp_path):
    """max_running 1, max_waiting 3: while one generation runs, three wait (one of them
    leaves when its client goes away); two more are answered 503 + Retry-After, on both
    APIs; then the two left are served in arrival order, one after the other."""
    cluster, _ = build_cluster(tmp_path, drafters=1,
                               router_options={"max_running": 1, "max_waiting": 3})
    cluster.start(timeout=90)
    try:
        base = cluster.instances["router"].frontdoor_url
        http = httpx.Client(timeout=60)
        wait_until(lambda: sum(1 for i in http.get(f"{base}/v1/instances").json()["instances"] if i["live"]) >= 2,
                   30, "instances not live", interval=0.1)
        model = http.get(f"{base}/v1/models").json()["data"][0]["id"]
        at_start = series(base)
        assert at_start["sdcp_admission_waiting"] == 0 and at_start["sdcp_admission_capacity"] == 1
        assert at_start["sdcp_admission_rejected_total"] == 0 and at_start["sdcp_admission_wait_seconds_count"] == 0

        first_token_at: dict[str, float] = {}

        def generate(name: str) -> dict:
            with httpx.Client(timeout=120) as c, \
                    c.stream("POST", f"{base}/v1/generate", json={"tokens": [1, 2, 3], "max_new": 12}) as r:
                r.raise_for_status()
                events = []
                for event in parse_sse(r.iter_lines()):
                    if event[0] == "tokens":
                        first_token_at.setdefault(name, time.monotonic())
                    events.append(event)
            return {name: e for name, e in events if name in ("start", "end")}

        def waiting(n: int) -> bool:
            return series(base)["sdcp_admission_waiting"] == n

        port = int(base.rsplit(":", 1)[1])
        # the running one: an OpenAI completion that runs until its client goes away (or, should
        # the door miss that, until its max_tokens: the test only needs it to end at some point)
        holder = raw_request(port, "/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 5000})
        wait_until(lambda: series(base)["sdcp_generation_tokens_total"] > 0, 60, "the first request did not run")
        with ThreadPoolExecutor(2) as pool:
            second = pool.submit(generate, "second")
            wait_until(lambda: waiting(1), 60, "the second request did not wait")
            third = pool.submit(generate, "third")
            wait_until(lambda: waiting(2), 60, "the third request did not wait")
            gone = raw_request(port, "/v1/generate", {"tokens": [1, 2], "max_new": 4})
            wait_until(lambda: waiting(3), 60, "the client that goes away did not wait")
            now = series(base)
            assert now["sdcp_num_requests_waiting"] == 3 and now["sdcp_num_requests_running"] == 1

            full = http.post(f"{base}/v1/generate", json={"tokens": [1, 2, 3], "max_new": 4})
            assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
            full = http.post(f"{base}/v1/completions", json={"model": model, "prompt": [1, 2], "max_tokens": 4})
            assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
            assert series(base)["sdcp_admission_rejected_total"] == 2

            gone.close()
            wait_until(lambda: waiting(2), 60, "a client gone did not leave the queue")
            assert not second.done() and not third.done()
            holder.close()                             # the running one's client goes away
            served = [second.result(timeout=120), third.result(timeout=120)]
        assert [s["end"]["tokens"] for s in served] == [12, 12]
        assert first_token_at["second"] < first_token_at["third"]
        history = [http.get(f"{base}/v1/generations/{s['start']['id']}").json()["history"] for s in served]
        assert history[0][-1]["t"] <= history[1][0]["t"]     # one at a time: the third began after the second
        end = series(base)
        assert end["sdcp_admission_waiting"] == 0 and end["sdcp_admission_wait_seconds_count"] == 3
        assert end["sdcp_admission_wait_seconds_sum"] > 0
        http.close()
    finally:
        cluster.stop()
