"""The router's control steps against scripted verifiers and drafters (no processes): who is
told what, in which order, when a policy update's drafter refuses, when a failover's open
fails, when a verifier says it lost the session (sdcp-stale-epoch), and how the output
reader waits on output it cannot use."""

from __future__ import annotations

import asyncio

import pytest
from router_bench import D1, D2, PROMPT, V1, V2, Bench, cbor_answer, problem_answer, run

from sdcp_fast.core.digest import prefix_digest
from sdcp_fast.core.messages import (
    ROLE_VERIFIER,
    Action,
    Assignment,
    Output,
    Policy,
    Sampling,
    SessionOpen,
    SessionState,
    Status,
)
from sdcp_fast.core.problems import Kind, ProblemError
from sdcp_fast.transport import ClientResponse

pytestmark = pytest.mark.timeout(30)


def test_policy_update_informs_the_verifier_before_another_drafter(tmp_path):
    """update_policy re-sends the assignment to the session's drafter without PUT drafter
    (the verifier knows it); when that drafter does not answer, the next one is named to
    the verifier first (6.1)."""
    async def main():
        async with Bench(tmp_path) as b:
            b.live(V1, D2)                                   # D1 stopped reporting
            s = await b.session(V1, drafter=D1)
            b.net.routes[("POST", V1, "/policy")] = lambda body: cbor_answer(b.state(s))
            b.net.routes[("PUT", V1, "/drafter")] = lambda body: cbor_answer(b.state(s))
            b.net.routes[("POST", D2, "/assignments")] = lambda body: ClientResponse(204, {}, b"")
            from_round = await b.router.update_policy(s, Sampling(temperature_milli=500))
            assert from_round == 2
            assert b.net.order() == [("POST", V1, "policy"), ("POST", D1, "assignments"),
                                     ("PUT", V1, "drafter"), ("POST", D2, "assignments")]
            named = Assignment.from_cbor(b.net.sent("PUT", V1, "/drafter")[0])
            assert named.drafter == D2 and named.sampling == Sampling(temperature_milli=500)
            assert Assignment.from_cbor(b.net.sent("POST", D2, "/assignments")[0]) == named
            assert s.drafter == D2
    run(main())


def test_failover_whose_open_failed_resumes_even_if_the_old_verifier_returns(tmp_path):
    """The fence is written, then no verifier opens the session; the old verifier reports
    status again but can no longer commit: the next failover step opens the session at the
    fenced epoch (no second fence) instead of leaving it on the old verifier."""
    async def main():
        async with Bench(tmp_path) as b:
            b.live(V2, D1)                                   # V1 (the session's) expired
            s = await b.session(V1, drafter=D1)
            refuse = [True]
            b.net.routes[("POST", V2, "/sessions")] = lambda body: (
                ClientResponse(503, {}, b"") if refuse[0] else cbor_answer(b.state(s)))
            b.net.routes[("PUT", V2, "/drafter")] = lambda body: cbor_answer(b.state(s))
            b.net.routes[("POST", D1, "/assignments")] = lambda body: ClientResponse(204, {}, b"")
            assert b.router.failover.needed(s)
            await b.router.failover.run(s)
            assert (s.epoch, s.verifier, await b.fences(s)) == (2, V1, [2])
            b.live(V1)                                       # the old one is back
            refuse[0] = False
            assert b.router.failover.needed(s)                # still: it was fenced out
            await b.router.failover.run(s)
            assert (s.epoch, s.verifier, s.drafter, await b.fences(s)) == (2, V2, D1, [2])
            assert not b.router.failover.needed(s)
            opens = [SessionOpen.from_cbor(body) for body in b.net.sent("POST", V2, "/sessions")]
            assert [o.epoch for o in opens] == [2, 2]
            assert Assignment.from_cbor(b.net.sent("PUT", V2, "/drafter")[0]).epoch == 2
            assert [h["old_verifier"] for h in s.history if h["what"] == "failover"] == [V1]
    run(main())


def test_stale_epoch_from_the_verifier_resumes_the_session_there(tmp_path):
    """A verifier whose session was fenced answers PUT drafter with sdcp-stale-epoch: the
    router does not retry the PUT forever but fences a new epoch and resumes the session,
    at the same verifier when it is the only one."""
    async def main():
        async with Bench(tmp_path) as b:
            b.live(V1, D1)
            s = await b.session(V1)

            def put_drafter(body):
                if Assignment.from_cbor(body).epoch == 1:
                    return problem_answer(Kind.STALE_EPOCH)
                return cbor_answer(b.state(s, epoch=2))
            b.net.routes[("PUT", V1, "/drafter")] = put_drafter
            b.net.routes[("POST", V1, "/sessions")] = lambda body: cbor_answer(b.state(s, epoch=2))
            b.net.routes[("POST", D1, "/assignments")] = lambda body: ClientResponse(204, {}, b"")
            await b.router.assign(s, why="test")
            assert s.needs_drafter and s.drafter is None
            assert b.router.failover.needed(s)
            await b.router.failover.run(s)
            assert (s.epoch, s.verifier, s.drafter, await b.fences(s)) == (2, V1, D1, [2])
            assert not b.router.failover.needed(s)
            assert [SessionOpen.from_cbor(x).epoch for x in b.net.sent("POST", V1, "/sessions")] == [2]
            assert [Assignment.from_cbor(x).epoch for x in b.net.sent("PUT", V1, "/drafter")] == [1, 2]
            assert Assignment.from_cbor(b.net.sent("POST", D1, "/assignments")[0]).epoch == 2
    run(main())


def test_stale_epoch_on_output_marks_the_session_for_resume(tmp_path):
    async def main():
        async with Bench(tmp_path) as b:
            b.live(V1)
            s = await b.session(V1)

            def output(body):
                s.finish = Action.FAIL                       # one answer is enough: end the reader
                return problem_answer(Kind.STALE_EPOCH)
            b.net.routes[("GET", V1, "/output")] = output
            await b.router.relay.read(s)
            assert s.verifier_lost and b.router.failover.needed(s)
    run(main())


@pytest.mark.parametrize("case", ["older epoch", "ahead of us"])
def test_output_reader_waits_before_asking_again(tmp_path, case):
    """Output it cannot use (an old epoch's verifier during failover, or a start past what
    it holds) is followed by a wait for a placement change, not an immediate new GET."""
    async def main():
        async with Bench(tmp_path) as b:
            s = await b.session(V1, epoch=2)
            epoch, start = (1, 0) if case == "older epoch" else (2, 5)
            waits: list[float] = []

            async def wait_changed(timeout: float) -> None:
                waits.append(timeout)
                await asyncio.sleep(0)
            s.wait_changed = wait_changed

            def output(body):
                if len(b.net.calls) == 5:
                    s.finish = Action.FAIL
                return cbor_answer(Output(s.id, epoch, start, (7,), False))
            b.net.routes[("GET", V1, "/output")] = output
            await b.router.relay.read(s)
            assert len(b.net.calls) == 5 and waits == [0.25] * 5
            assert s.tokens == []
    run(main())


def test_policy_refused_as_stale_epoch_marks_the_session_for_resume(tmp_path):
    async def main():
        async with Bench(tmp_path) as b:
            s = await b.session(V1, drafter=D1)
            b.net.routes[("POST", V1, "/policy")] = lambda body: problem_answer(Kind.STALE_EPOCH)
            with pytest.raises(Exception, match="did not take the policy"):
                await b.router.update_policy(s, Sampling(temperature_milli=500))
            assert len(b.net.sent("POST", V1, "/policy")) == 1      # not retried as a conflict
            assert Policy.from_cbor(b.net.sent("POST", V1, "/policy")[0]).from_round == 2
            assert s.verifier_lost
    run(main())


def test_session_retired_on_output_is_resumed_from_its_log(tmp_path):
    """A verifier that retired the session for room answers session-retired: the router fences
    a new epoch and re-opens the session from its commit log (there or elsewhere)."""
    async def main():
        async with Bench(tmp_path) as b:
            b.live(V1, D1)
            s = await b.session(V1)

            def output(body):
                s.finish = Action.FAIL                       # one answer is enough: end the reader
                return problem_answer(Kind.SESSION_RETIRED)
            b.net.routes[("GET", V1, "/output")] = output
            await b.router.relay.read(s)
            assert s.verifier_lost and b.router.failover.needed(s)
            s.finish = None
            b.net.routes[("POST", V1, "/sessions")] = lambda body: cbor_answer(b.state(s, epoch=2))
            b.net.routes[("PUT", V1, "/drafter")] = lambda body: cbor_answer(b.state(s, epoch=2))
            b.net.routes[("POST", D1, "/assignments")] = lambda body: ClientResponse(204, {}, b"")
            await b.router.failover.run(s)
            assert (s.epoch, s.verifier, s.drafter, await b.fences(s)) == (2, V1, D1, [2])
            assert [SessionOpen.from_cbor(x).epoch for x in b.net.sent("POST", V1, "/sessions")] == [2]
    run(main())


def test_capacity_refusal_places_the_session_on_another_verifier(tmp_path):
    async def main():
        async with Bench(tmp_path) as b:
            b.live(V1, D1)
            b.router.registry.report(Status(V2, ROLE_VERIFIER, 40, 0, 60_000))   # V1 is picked first
            s = await b.session(None)
            b.net.routes[("POST", V1, "/sessions")] = lambda body: problem_answer(Kind.CAPACITY)
            b.net.routes[("POST", V2, "/sessions")] = lambda body: cbor_answer(b.state(s))
            assert await b.router.placement.open(s, exclude=set())
            assert s.verifier == V2
            assert [base for m, base, p, _ in b.net.calls if m == "POST"] == [V1, V2]
    run(main())


def test_a_slow_session_open_is_waited_for_not_refused(tmp_path):
    """A verifier busy enough that its session-open (the prompt's prefill, behind its
    batches) answers after the request timeout is waited for up to open_timeout_s: the
    generation opens there, with one open sent. Given up on after the request timeout
    instead (as before open_timeout_s), the same verifier made the front door answer 503
    "no verifier could open the session" (the 64-client soak under load, bench/RESULTS.md)."""
    async def slow_open(body):
        await asyncio.sleep(0.6)
        msg = SessionOpen.from_cbor(body)
        return cbor_answer(SessionState(msg.session, msg.epoch, 0, 0, prefix_digest(msg.contract.digest, PROMPT)))

    async def main():
        async with Bench(tmp_path / "a", request_timeout_s=0.2, open_timeout_s=5.0) as b:
            b.live(V1, D1)
            b.net.routes[("POST", V1, "/sessions")] = slow_open
            b.net.routes[("PUT", V1, "/drafter")] = lambda body: cbor_answer(b.state(s))
            b.net.routes[("POST", D1, "/assignments")] = lambda body: ClientResponse(204, {}, b"")
            s = await b.router.generate(list(PROMPT), b.contract, wait_for_instances_s=0.1)
            assert (s.verifier, s.epoch) == (V1, 1)
            assert len(b.net.sent("POST", V1, "/sessions")) == 1
            while s.drafter is None:                    # its drafter step ran too
                await asyncio.sleep(0.01)
        async with Bench(tmp_path / "b", request_timeout_s=0.2, open_timeout_s=0.2) as b:
            b.live(V1, D1)
            b.net.routes[("POST", V1, "/sessions")] = slow_open
            with pytest.raises(ProblemError) as refused:
                await b.router.generate(list(PROMPT), b.contract, wait_for_instances_s=0.1)
            assert refused.value.problem.kind == Kind.UNAVAILABLE
            assert "no verifier could open" in refused.value.problem.detail
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    run(main())
