"""The verifier reports to its router over mTLS: status at intervals below ttl_ms, and
events (switch, end of self-decoding, finish) as they happen."""

from __future__ import annotations

import asyncio
import dataclasses

from sdcp_fast.core.messages import Action, Event, SessionState, Status, Verdict
from sdcp_fast.refs import encode_instance_id as encode_uri
from sdcp_fast.transport import Client, Response, Router, TLSConfig, make_certs, serve
from sdcp_fast.transport.http import Authorizer
from tests.verifier.harness import DRAFTER, ROUTER, VERIFIER, Harness, contract_for


class FakeRouter:
    def __init__(self):
        self.events: list[Event] = []
        self.status: list[tuple[str, Status]] = []
        self.callers: set[str | None] = set()
        self.router = Router(authorizer=Authorizer({"status": {VERIFIER}, "events": {VERIFIER}}))
        self.router.add("PUT", "/instances/{iid}/status", self.put_status, resource="status")
        self.router.add("POST", "/events", self.post_event, resource="events")

    async def handle(self, request):
        self.callers.add(request.caller)
        return await self.router.handle(request)

    async def put_status(self, request, iid):
        self.status.append((iid, Status.from_cbor(request.body)))
        return Response(204, b"", None)

    async def post_event(self, request):
        self.events.append(Event.from_cbor(request.body))
        return Response(204, b"", None)


def test_status_and_events_reach_the_router(tmp_path):
    async def main():
        make_certs(tmp_path / "pki", [VERIFIER, ROUTER, DRAFTER])
        fake = FakeRouter()
        server = await serve(fake, host="127.0.0.1", port=0, tls=TLSConfig.for_instance(tmp_path / "pki", ROUTER))
        h = await Harness.start(tmp_path)
        client = Client(TLSConfig.for_instance(tmp_path / "pki", VERIFIER), "h2", timeout=5)
        h.service.client = client
        h.service.config = dataclasses.replace(h.service.config, router_uri=f"https://127.0.0.1:{server.port}/",
                                               status_interval_s=0.05, ttl_ms=300)
        await h.service.start()
        try:
            contract = contract_for(h.backend, low_rounds=1, fallback=(Action.SWITCH,), max_new=30)
            sid, r = await h.open(contract)
            state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
            target = int(h.backend.table[3].argmax())
            v = Verdict.from_cbor((await h.propose(sid, state, [(target + 1) % 16])).body)
            assert v.action == Action.SWITCH
            for _ in range(200):
                if fake.events and len(fake.status) >= 3:
                    break
                await asyncio.sleep(0.02)
            [event] = fake.events
            assert (event.session, event.epoch, event.kind, event.committed, event.digest) == (
                sid, 1, Action.SWITCH, 1, v.digest)
            iid, status = fake.status[-1]
            assert iid == encode_uri(VERIFIER)
            assert (status.instance, status.role, status.ttl_ms) == (VERIFIER, 2, 300)
            assert 0 <= status.load <= 100
            assert fake.callers == {VERIFIER}            # the router saw the verifier's certificate
        finally:
            await client.close()
            await h.close()
            await server.stop(grace=1)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_reports_and_events_reach_every_router_and_a_dead_one_delays_none(tmp_path):
    """Several routers (router_uris): each gets every status report and every event; one
    that does not answer (a SIGSTOPped router: it accepts the connection, never replies)
    delays neither the reports nor the events of the others."""
    async def main():
        make_certs(tmp_path / "pki", [VERIFIER, ROUTER, DRAFTER])
        tls = TLSConfig.for_instance(tmp_path / "pki", ROUTER)
        first, second = FakeRouter(), FakeRouter()
        servers = [await serve(r, host="127.0.0.1", port=0, tls=tls) for r in (first, second)]
        silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
        silent_uri = f"https://127.0.0.1:{silent.sockets[0].getsockname()[1]}/"
        h = await Harness.start(tmp_path)
        client = Client(TLSConfig.for_instance(tmp_path / "pki", VERIFIER), "h2", timeout=5)
        h.service.client = client
        uris = (silent_uri, *(f"https://127.0.0.1:{s.port}/" for s in servers))
        h.service.config = dataclasses.replace(h.service.config, router_uris=uris, request_timeout_s=2.0,
                                               status_interval_s=0.05, ttl_ms=300)
        await h.service.start()
        try:
            contract = contract_for(h.backend, low_rounds=1, fallback=(Action.SWITCH,), max_new=30)
            sid, r = await h.open(contract)
            state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
            target = int(h.backend.table[3].argmax())
            await h.propose(sid, state, [(target + 1) % 16])
            loop = asyncio.get_running_loop()
            started = loop.time()
            while not all(r.events and len(r.status) >= 10 for r in (first, second)):
                assert loop.time() - started < 1.5, "a silent router delayed the others"
                await asyncio.sleep(0.02)
            for r in (first, second):
                assert [(e.session, e.kind) for e in r.events] == [(sid, Action.SWITCH)]
        finally:
            await client.close()
            await h.close()
            for s in servers:
                await s.stop(grace=1)
            silent.close()

    asyncio.run(asyncio.wait_for(main(), 60))
