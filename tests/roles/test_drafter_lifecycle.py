"""How a draft session's loop starts and ends on the drafter, against a scripted verifier:
one loop per session however assignments arrive, leases released however the loop ends,
and retries that give up (so the router can place the session again)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from roles_support import make_tables

from sdcp_fast.cache import NotFound, object_uri, open_store
from sdcp_fast.core.digest import prefix_digest
from sdcp_fast.core.messages import Action, Assignment, Contract
from sdcp_fast.core.problems import PROBLEM_MEDIA_TYPE, Kind, Problem
from sdcp_fast.drafter import DrafterConfig, DrafterService
from sdcp_fast.models import load_backend
from sdcp_fast.transport import ClientResponse, Request, TransportError
from sdcp_fast.transport.http import dispatch

ROUTER, VERIFIER, DRAFTER = "https://router.test/", "https://verifier.test/", "https://drafter.test/"
pytestmark = pytest.mark.timeout(60)


class ScriptedVerifier:
    """`transport.Client`'s interface; every proposal gets `answer()`: a ClientResponse,
    an exception to raise, or "hang" (no answer until cancelled)."""

    def __init__(self, answer):
        self.answer = answer
        self.proposals = 0
        self.arrived = asyncio.Event()

    async def request(self, method, url, body=None, content_type=None, *, idempotent=False,
                      timeout=None) -> ClientResponse:
        assert (method, url) == ("POST", VERIFIER.rstrip("/") + "/proposals")
        self.proposals += 1
        self.arrived.set()
        answer = self.answer()
        if answer == "hang":
            await asyncio.Event().wait()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def close(self) -> None:
        pass


def problem_answer(kind: Kind) -> ClientResponse:
    return ClientResponse(kind.status, {"content-type": PROBLEM_MEDIA_TYPE}, Problem(kind).to_json())


class Drafter:
    def __init__(self, tmp: Path, answer, **options):
        self.tmp, self.verifier, self.options = tmp, ScriptedVerifier(answer), options

    async def __aenter__(self):
        _, draft_spec = make_tables(self.tmp)
        self.backend = load_backend(draft_spec)
        self.store = await open_store(f"embedded:{self.tmp / 'mlc'}")
        config = DrafterConfig(DRAFTER, frozenset({ROUTER}), draft_ahead=False, publish_draft_kv=False,
                               **self.options)
        self.service = DrafterService(config, self.backend, self.store, client=self.verifier)
        await self.service.start()
        return self

    async def __aexit__(self, *exc):
        await self.service.stop()
        await self.store.close()

    def contract(self, **overrides) -> Contract:
        fields = dict(target=bytes(32), tokenizer=self.backend.tokenizer_digest, rule=1, m_max=4,
                      max_new=50, stop=(), low_rounds=3, fallback=(Action.REDUCE,))
        fields.update(overrides)
        return Contract(**fields)

    def assignment(self, sid: bytes, contract: Contract, epoch: int = 1) -> Assignment:
        prompt = (1, 2, 3)
        return Assignment(sid, epoch, contract, VERIFIER, DRAFTER, prompt, 0, 0,
                          prefix_digest(contract.digest, prompt), 4)

    async def assign(self, a: Assignment):
        return await dispatch(self.service, Request("POST", "/assignments", {}, "application/sdcp+cbor",
                                                    a.to_cbor(), ROUTER))


def draft_loops() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks()
            if not t.done() and t.get_coro().__qualname__ == "DraftSession.run"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 50))


def test_concurrent_identical_assignments_start_one_draft_loop(tmp_path):
    """The router retries a POST assignments that timed out: the same epoch-2 assignment
    arriving twice at once must leave exactly one loop (one outstanding proposal, 6.2)."""
    async def main():
        async with Drafter(tmp_path, lambda: "hang") as d:
            contract, sid = d.contract(), os.urandom(16)
            assert (await d.assign(d.assignment(sid, contract, epoch=1))).status == 204
            await d.verifier.arrived.wait()
            first = d.service.sessions[sid]
            again = d.assignment(sid, contract, epoch=2)
            answers = await asyncio.gather(d.assign(again), d.assign(again))
            assert [a.status for a in answers] == [204, 204]
            await asyncio.sleep(0.05)                    # let any second loop get going
            loops = draft_loops()
            assert len(loops) == 1, loops
            session = d.service.sessions[sid]
            assert session is not first and session.epoch == 2 and loops[0] is session.task
            assert first.stopped == "cancelled"
            assert len(d.service._assignment_locks) == 0   # nothing kept once handlers are done
    run(main())


@pytest.mark.parametrize("ending", ["replaced", "refused"])
def test_leases_of_the_proposal_out_are_released_when_the_loop_ends(tmp_path, ending):
    """Rule 2 q rows are leased until the verdict; a loop that ends without one (replaced
    by a newer assignment, or its proposal refused) releases them at once."""
    answers = {"replaced": lambda: "hang", "refused": lambda: problem_answer(Kind.NOT_ASSIGNED)}

    async def main():
        async with Drafter(tmp_path, answers[ending]) as d:
            contract, sid = d.contract(rule=2), os.urandom(16)
            assert (await d.assign(d.assignment(sid, contract))).status == 204
            await d.verifier.arrived.wait()
            session = d.service.sessions[sid]
            q_ref = object_uri(f"q/{sid.hex()}/1/1/1")
            if ending == "replaced":
                rows = await d.store.get(q_ref)               # held while the proposal is out
                assert len(rows) > 0 and len(rows) % (4 * 32) == 0
                assert (await d.assign(d.assignment(sid, contract, epoch=2))).status == 204
            else:
                await asyncio.wait_for(session.task, 10)
                assert session.stopped == "proposal refused: sdcp-not-assigned"
            with pytest.raises(NotFound):
                await d.store.get(q_ref)
    run(main())


def test_verifier_that_never_answers_is_given_up(tmp_path):
    """Transport errors are retried with backoff, but not past give_up_after_s: the loop
    stops (freeing its max_sessions slot) so the router can place the session again."""
    async def main():
        error = TransportError("connection refused", sent=False)
        async with Drafter(tmp_path, lambda: error, give_up_after_s=0.3) as d:
            contract, sid = d.contract(), os.urandom(16)
            await d.assign(d.assignment(sid, contract))
            session = d.service.sessions[sid]
            await asyncio.wait_for(session.task, 10)
            assert session.stopped == "no verdict for 0.3 s: connection refused"
            # 50, 100, 200 ms waits: a handful of attempts, not a busy loop
            assert 2 <= d.verifier.proposals <= 6, d.verifier.proposals
    run(main())


def test_verifier_busy_with_5xx_is_given_up(tmp_path):
    async def main():
        busy = ClientResponse(503, {}, b"")
        async with Drafter(tmp_path, lambda: busy, give_up_after_s=0.3) as d:
            contract, sid = d.contract(), os.urandom(16)
            await d.assign(d.assignment(sid, contract))
            session = d.service.sessions[sid]
            await asyncio.wait_for(session.task, 10)
            assert session.stopped == "no verdict for 0.3 s: HTTP 503"
            assert 2 <= d.verifier.proposals <= 6, d.verifier.proposals
    run(main())


def test_q_rows_republished_a_bounded_number_of_times(tmp_path):
    """sdcp-q-unavailable: the same rows are published again (with backoff) up to
    max_q_republish times per proposal, then the session stops."""
    async def main():
        async with Drafter(tmp_path, lambda: problem_answer(Kind.Q_UNAVAILABLE), max_q_republish=2) as d:
            contract, sid = d.contract(rule=2), os.urandom(16)
            await d.assign(d.assignment(sid, contract))
            session = d.service.sessions[sid]
            await asyncio.wait_for(session.task, 10)
            assert session.stopped == "q rows unavailable to the verifier after 2 republications"
            assert d.verifier.proposals == 3                 # the first send and two more
            with pytest.raises(NotFound):                    # and its rows are released
                await d.store.get(object_uri(f"q/{sid.hex()}/1/1/1"))
    run(main())


def test_two_assignments_arriving_together_both_drop_the_stopped_sessions(tmp_path):
    """Issue 21: both new sessions' handlers forget the stopped ones. The first used to delete
    one, await the model lock to release its KV, and meanwhile the second deleted the next;
    the first then found that one gone (KeyError) and answered 500. Both answer 204 now,
    the stopped sessions are gone and each one's KV is released once."""
    async def main():
        async with Drafter(tmp_path, lambda: problem_answer(Kind.NOT_ASSIGNED)) as d:
            contract, stopped = d.contract(), [os.urandom(16), os.urandom(16)]
            answers = await asyncio.gather(*(d.assign(d.assignment(sid, contract)) for sid in stopped))
            assert [a.status for a in answers] == [204, 204]
            for sid in stopped:
                await asyncio.wait_for(d.service.sessions[sid].task, 10)
            released = []
            release = d.backend.release
            d.backend.release = lambda sid: (released.append(sid), release(sid))[1]
            async with d.service.batcher.model_lock:     # the first handler waits here
                pending = [asyncio.ensure_future(d.assign(d.assignment(os.urandom(16), contract)))
                           for _ in range(2)]
                await asyncio.sleep(0.05)
            answers = await asyncio.gather(*pending)
            assert [a.status for a in answers] == [204, 204], [a.body for a in answers]
            assert not set(stopped) & set(d.service.sessions)
            assert sorted(released) == sorted(stopped)
    run(main())
