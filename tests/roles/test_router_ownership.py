"""Two routers in one process sharing a session table, commit log and store, against scripted
verifiers and drafters: who may act after a takeover, which epochs are fenced, how a session
is re-adopted, how a session another router owns is followed. The process tests
(test_routers.py) kill and stop real routers; these check each rule exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from router_bench import D1, D2, PROMPT, V1, V2, Bench, cbor_answer, problem_answer, run

from sdcp_fast.cache import Fenced, LogEntry, NotOwner, open_table
from sdcp_fast.core.digest import prefix_digest
from sdcp_fast.core.messages import (
    Action,
    Assignment,
    CommitRecord,
    Contract,
    Policy,
    Sampling,
    SessionOpen,
)
from sdcp_fast.core.problems import Kind
from sdcp_fast.refs import commit_log_name
from sdcp_fast.router import RouterSession, stored
from sdcp_fast.router.follow import LogTail, follow
from sdcp_fast.router.ownership import Ownership
from sdcp_fast.transport import ClientResponse

RA, RB = "https://ra.test/", "https://rb.test/"
CONTRACT = Contract(target=bytes(32), tokenizer=bytes(32), rule=1, m_max=4, max_new=50, stop=(),
                    low_rounds=3, fallback=(Action.REDUCE,))
pytestmark = pytest.mark.timeout(30)


def routes_that_serve(b: Bench, s: RouterSession, epoch: int | None = None) -> None:
    """V1, V2, D1, D2 answer everything for `s` (V2 and D2 too, for failovers)."""
    for v in (V1, V2):
        b.net.routes[("PUT", v, "/drafter")] = lambda body: cbor_answer(b.state(s, epoch=Assignment.from_cbor(body).epoch))
        b.net.routes[("POST", v, "/sessions")] = lambda body: cbor_answer(b.state(s, epoch=SessionOpen.from_cbor(body).epoch))
    for d in (D1, D2):
        b.net.routes[("POST", d, "/assignments")] = lambda body: ClientResponse(204, {}, b"")


async def take_over(b: Bench, s_id: bytes) -> RouterSession:
    """What b's scan does when it finds the record orphaned; returns once adopted."""
    record = await b.table.read(stored.key_of(s_id))
    assert record.orphaned
    await b.router._take_over(record)
    s = b.router.sessions[s_id]
    while b.router._ops:
        await asyncio.sleep(0.01)
    return s


async def two_routers(tmp_path):
    a, b = Bench(tmp_path, RA), Bench(tmp_path, RB)
    await a.__aenter__()
    await b.__aenter__()
    for bench in (a, b):
        bench.live(V1, V2, D1, D2)
    return a, b


async def close(*benches):
    for bench in benches:
        await bench.__aexit__(None, None, None)


def test_after_a_takeover_the_former_owner_sends_nothing(tmp_path):
    """A's lease ends (in the store) while A still believes in it; B takes the session over.
    Every step A then tries (failover, assignment, policy, cancel) stops at its record: no
    message leaves A, nothing is fenced by A, and A follows the session instead."""
    async def main():
        a, b = await two_routers(tmp_path)
        try:
            s = await a.session(V1, drafter=D1)
            await a.table.revoke(a.router.own.lease)        # A does not know yet
            routes_that_serve(b, s)
            taken = await take_over(b, s.id)
            assert (taken.router_epoch, taken.epoch) == (2, 1)
            a.net.calls.clear()
            a.router.registry.instances[V1].expires = 0      # A's monitor would fail V1 over
            with pytest.raises(NotOwner):
                await a.router.failover.run(s)
            with pytest.raises(NotOwner):
                await a.router.assign(s, why="test")
            with pytest.raises(Exception, match="another router owns"):
                await a.router.update_policy(s, Sampling(temperature_milli=0))
            a.router.cancel(s)                               # A's client went away: not A's to end
            await asyncio.sleep(0.1)
            assert a.net.calls == []
            assert await a.fences(s) == []
            assert s.id not in a.router.sessions and s.id in a.router.followed and not s.done
        finally:
            await close(a, b)
    run(main())


def test_a_router_past_its_lease_deadline_stops_before_writing(tmp_path):
    """A process stopped past its lease (SIGSTOP) wakes with its lease's local deadline gone:
    it stops before any write, even one the store would still take."""
    async def main():
        a = Bench(tmp_path, RA)
        await a.__aenter__()
        try:
            a.live(V1, D1)
            s = await a.session(V1, drafter=D1)
            before = await a.table.read(stored.key_of(s.id))
            own = a.router.own
            own.lease = dataclasses.replace(own.lease, deadline=time.monotonic() - 0.01)
            routes_that_serve(a, s)
            with pytest.raises(NotOwner):
                await a.router.assign(s, why="test")
            assert a.net.calls == []
            assert (await a.table.read(stored.key_of(s.id))).value == before.value
        finally:
            await a.__aexit__(None, None, None)
    run(main())


def test_readoption_keeps_the_epoch_and_names_the_new_router_epoch(tmp_path):
    """The verifier still serves the session: B asks it with PUT drafter at the same epoch
    and router epoch 2 (no fence), then sends the same drafter the assignment."""
    async def main():
        a, b = await two_routers(tmp_path)
        try:
            s = await a.session(V1, drafter=D2)
            await a.router.own.close()                       # A hands over (SIGTERM)
            routes_that_serve(b, s)
            taken = await take_over(b, s.id)
            put = [Assignment.from_cbor(x) for x in b.net.sent("PUT", V1, "/drafter")]
            post = [Assignment.from_cbor(x) for x in b.net.sent("POST", D2, "/assignments")]
            assert [(x.epoch, x.router_epoch, x.drafter) for x in put] == [(1, 2, D2)]
            assert post == put                               # the drafter it had: it carries on
            assert await b.fences(taken) == []
            assert [h["what"] for h in taken.history][-2:] == ["takeover", "assigned"]
            record = stored.decode((await b.table.read(stored.key_of(s.id))).value)
            assert record["drafter"] == D2 and record["history"][-1]["what"] == "assigned"
        finally:
            await close(a, b)
    run(main())


def test_takeover_fences_above_every_epoch_the_former_owner_allocated(tmp_path):
    """A allocated epoch 2 for a failover and died before (or after) fencing with it. B
    cannot know which: it fails over with epoch 3. A fence of A's with 2, however late,
    is then refused by the log (Fenced), so two routers never share an epoch."""
    async def main():
        a, b = await two_routers(tmp_path)
        try:
            s = await a.session(V1, drafter=D1)
            s.allocated = 2
            await a.router.own.act(s)                        # the allocation is written ...
            await a.table.revoke(a.router.own.lease)         # ... and A dies
            routes_that_serve(b, s)
            taken = await take_over(b, s.id)
            assert taken.epoch == 3 and taken.allocated == 3 and taken.verifier in (V1, V2)
            assert await b.fences(taken) == [3]
            opens = [SessionOpen.from_cbor(x) for v in (V1, V2) for x in b.net.sent("POST", v, "/sessions")]
            assert [(o.epoch, o.router_epoch) for o in opens] == [(3, 2)]
            with pytest.raises(Fenced):
                await a.log.fence(s.commit_log, 2)           # A's fence, late: refused
        finally:
            await close(a, b)
    run(main())


def test_a_session_never_opened_is_fenced_before_it_is_opened_again(tmp_path):
    """A recorded the session and died during its open (A may have opened it somewhere):
    B opens it only behind a fence with a new epoch."""
    async def main():
        a, b = await two_routers(tmp_path)
        try:
            s = await a.session(None)
            await a.table.revoke(a.router.own.lease)
            routes_that_serve(b, s)
            taken = await take_over(b, s.id)
            assert (taken.epoch, await b.fences(taken)) == (2, [2])
            assert taken.verifier in (V1, V2) and taken.drafter in (D1, D2)
        finally:
            await close(a, b)
    run(main())


def test_the_verifier_saying_it_lost_the_session_on_takeover_means_a_failover(tmp_path):
    async def main():
        a, b = await two_routers(tmp_path)
        try:
            s = await a.session(V1, drafter=D1)
            await a.router.own.close()
            routes_that_serve(b, s)
            b.net.routes[("PUT", V1, "/drafter")] = lambda body: (
                problem_answer(Kind.NOT_FOUND) if Assignment.from_cbor(body).epoch == 1
                else cbor_answer(b.state(s, epoch=2)))
            taken = await take_over(b, s.id)
            assert taken.verifier_lost or taken.epoch == 2
            if taken.epoch == 1:                             # the monitor's failover step
                await b.router.failover.run(taken)
            assert taken.epoch == 2 and await b.fences(taken) == [2]
        finally:
            await close(a, b)
    run(main())


def test_policy_is_recorded_before_it_is_sent_and_resent_by_the_next_owner(tmp_path):
    async def main():
        a, b = await two_routers(tmp_path)
        try:
            s = await a.session(V1, drafter=D1)
            routes_that_serve(a, s)
            a.net.routes[("POST", V1, "/policy")] = lambda body: cbor_answer(a.state(s))
            profile = Sampling(temperature_milli=0, seed=3)
            await a.router.update_policy(s, profile)
            sent = Policy.from_cbor(a.net.sent("POST", V1, "/policy")[0])
            assert sent.router_epoch == 1 and sent.sampling == profile
            await a.table.revoke(a.router.own.lease)
            routes_that_serve(b, s)
            b.net.routes[("POST", V1, "/policy")] = lambda body: cbor_answer(b.state(s))
            b.router.registry.instances[V1].expires = 0       # V1 silent: B fails over to V2
            taken = await take_over(b, s.id)
            assert taken.sampling == profile and taken.policy_from_round == sent.from_round
            if taken.epoch == 1:
                await b.router.failover.run(taken)
            resent = [Policy.from_cbor(x) for v in (V1, V2) for x in b.net.sent("POST", v, "/policy")]
            assert [(p.sampling, p.router_epoch) for p in resent] == [(profile, 2)]
            assigned = Assignment.from_cbor(b.net.sent("POST", taken.drafter, "/assignments")[-1])
            assert assigned.sampling == profile
        finally:
            await close(a, b)
    run(main())


# ---------------------------------------------------------------------- following


class ScriptedLog:
    def __init__(self, entries):
        self.entries = entries

    async def read(self, log, start=0):
        return self.entries[start:]


def record(epoch: int, round: int, emitted: tuple[int, ...], committed: int) -> bytes:
    return CommitRecord(epoch, round, emitted, committed, bytes(32)).to_cbor()


def test_log_tail_takes_effective_commits_only():
    """A commit after a fence of a higher epoch (a fenced writer's, on a store that only
    checks after appending) is not output; reading on from where it stopped."""
    entries = [LogEntry(0, "commit", 1, record(1, 1, (5, 6), 2)), LogEntry(1, "fence", 2, b""),
               LogEntry(2, "commit", 1, record(1, 2, (7,), 3))]
    log = ScriptedLog(entries)
    tail = LogTail(log, "l")
    assert asyncio.run(tail.read()) == [5, 6]
    entries.append(LogEntry(3, "commit", 2, record(2, 2, (8, 9), 4)))
    assert asyncio.run(tail.read()) == [5, 6, 8, 9]
    assert tail.position == 4


def test_follower_streams_from_the_log_and_ends_with_the_record(tmp_path):
    async def main():
        table = await open_table(f"file:{tmp_path / 'table'}")
        try:
            lease = await table.grant("https://owner.test/", 30)
            owner = RouterSession(bytes(16), CONTRACT, PROMPT, "log", verifier=V1, door={"kind": "generate"})
            owned = await table.create(lease, stored.key_of(owner.id), stored.encode(owner))
            entries = [LogEntry(0, "commit", 1, record(1, 1, (1, 2, 3), 3))]
            s = stored.restore(stored.decode((await table.read(stored.key_of(owner.id))).value))
            task = asyncio.ensure_future(follow(s, ScriptedLog(entries), table, interval_s=0.01,
                                                record_every_s=0.01))
            while len(s.tokens) < 3:
                await asyncio.sleep(0.01)
            owner.tokens = [1, 2, 3, 4]
            owner.end(cancelled="stop")                      # the owner cancelled at 4 tokens ...
            await table.write(owned, stored.encode(owner))
            await asyncio.sleep(0.1)
            assert not s.done and s.tokens == [1, 2, 3]       # ... which the log does not show yet
            entries.append(LogEntry(1, "commit", 1, record(1, 2, (4, 5), 5)))
            await asyncio.wait_for(task, 5)
            assert s.tokens == [1, 2, 3, 4] and s.cancelled == "stop" and s.finish_reason == "stop"
        finally:
            await table.close()
    run(main())


def test_stored_record_round_trip():
    contract = Contract(target=bytes(32), tokenizer=bytes(32), rule=2, m_max=4, max_new=9, stop=(3,),
                        low_rounds=3, fallback=(Action.REDUCE, Action.SWITCH), sampling=Sampling(seed=4))
    s = RouterSession(bytes(range(16)), contract, (1, 2), commit_log_name(bytes(range(16))), epoch=3, allocated=4, verifier=V1,
                      drafter=D1, sampling=Sampling(temperature_milli=5), policy_from_round=7,
                      resume_pending=True, door={"kind": "chat", "stop": ["x"]})
    s.tokens = [9, 9]
    s.place("assigned")
    back = stored.restore(stored.decode(stored.encode(s)))
    for name in ("id", "contract", "prompt", "commit_log", "epoch", "allocated", "verifier", "drafter",
                 "sampling", "policy_from_round", "resume_pending", "door", "history"):
        assert getattr(back, name) == getattr(s, name), name
    assert back.contract.digest == contract.digest and back.tokens == [] and not back.done
    s.end(finish=Action.FINISH)
    back = stored.restore(stored.decode(stored.encode(s)))
    assert back.finish == Action.FINISH and back.final_tokens == 2 and back.done


def test_another_router_streams_a_session_it_does_not_own_then_takes_it_over(tmp_path):
    """B finds A's session in the table and follows it (tokens from the commit log: what a
    client resuming at B gets); when A's lease ends B takes it over, and the session the
    client's stream waits on is the same object, its tokens never shortened."""
    async def main():
        a, b = await two_routers(tmp_path)
        try:
            s = await a.session(V1, drafter=D1)
            digest = prefix_digest(s.contract.digest, PROMPT)
            await a.log.append(s.commit_log, CommitRecord(1, 1, (7, 8), 2, digest).to_cbor(), epoch=1, expected=0)
            followed = await b.router.find(s.id)
            assert followed is not None and followed.owned is None and followed is not s
            while len(followed.tokens) < 2:
                await asyncio.sleep(0.01)
            assert followed.tokens == [7, 8] and not followed.done
            assert await b.router.find(s.id) is followed
            await a.table.revoke(a.router.own.lease)
            routes_that_serve(b, s)
            taken = await take_over(b, s.id)
            assert taken is followed and taken.owned is not None and taken.tokens == [7, 8]
            assert s.id not in b.router.followed
        finally:
            await close(a, b)
    run(main())


def test_a_finished_session_resumes_at_another_router_with_all_its_output(tmp_path):
    async def main():
        a, b = await two_routers(tmp_path)
        try:
            s = await a.session(V1, drafter=D1)
            digest = prefix_digest(s.contract.digest, PROMPT)
            await a.log.append(s.commit_log, CommitRecord(1, 1, (7, 8, 9), 3, digest).to_cbor(), epoch=1, expected=0)
            s.tokens = [7, 8, 9]
            s.end(finish=Action.FINISH)
            await a.router.own.act(s)
            other = await b.router.find(s.id)
            assert other.done and other.tokens == [7, 8, 9] and other.finish == Action.FINISH
            assert other.finish_reason == "stop"
        finally:
            await close(a, b)
    run(main())


def test_an_expired_session_is_not_adopted_back_while_its_record_is_deleted(tmp_path):
    """The monitor drops an expired session from memory, then deletes its record: a scan in
    between sees a record of this router's lease not held in memory, which is what a takeover
    cut short looks like; it must not adopt it back (seen in the soak: a finished session
    "taken over" from its own router, then lost to its own delete)."""
    async def main():
        async with Bench(tmp_path) as b:
            s = await b.session(V1, drafter=D1)
            s.end(finish=Action.FINISH)
            await b.router.own.act(s)
            deleting, release = asyncio.Event(), asyncio.Event()
            delete = b.table.delete

            async def slow_delete(owned):
                deleting.set()
                await release.wait()
                await delete(owned)
            b.table.delete = slow_delete
            del b.router.sessions[s.id]              # what the monitor does at closed_keep_s
            b.router._let_go(s)
            records = await b.table.scan(values=False)
            assert [r.key for r in records] == [stored.key_of(s.id)]
            await deleting.wait()
            await b.router._take_all(records)         # the scan's step, while the delete is pending
            assert s.id not in b.router.sessions and not b.router._ops
            release.set()
            while b.router._forgetting:
                await asyncio.sleep(0.01)
            assert await b.table.read(stored.key_of(s.id)) is None
    run(main())


def test_a_new_session_waits_for_the_next_lease_not_refused_between_two(tmp_path):
    """A lease lost (a keepalive past its deadline, the store's member restarting) and the next
    not yet granted: a new session waits for it, up to one ttl, and is recorded under it;
    refused with NotOwner when none comes in that time, and at once once the router handed
    its sessions over (closed)."""
    async def main():
        table = await open_table(f"file:{tmp_path / 'table'}")
        try:
            await waits_then_refuses(Ownership(table, holder=RA, ttl_s=1.0))
        finally:
            await table.close()

    async def waits_then_refuses(own):
        await own.start()
        first = own.lease
        own.lost_lease("a test")
        assert own.lease is None
        s = RouterSession(b"w" * 16, CONTRACT, PROMPT, "log")
        creating = asyncio.create_task(own.create(s))
        await asyncio.sleep(0.2)
        assert not creating.done()                  # waiting, not refused
        await own.start()                           # what keep() does next
        await asyncio.wait_for(creating, 1.0)
        assert s.owned.lease.id == own.lease.id != first.id

        own.lost_lease("a test")                    # and none comes: refused after one ttl
        started = time.monotonic()
        with pytest.raises(NotOwner):
            await own.create(RouterSession(b"x" * 16, CONTRACT, PROMPT, "log"))
        assert time.monotonic() - started >= own.ttl_s * 0.9

        await own.start()
        await own.close()                           # handed over: refused without waiting
        with pytest.raises(NotOwner):
            await asyncio.wait_for(own.create(RouterSession(b"y" * 16, CONTRACT, PROMPT, "log")), own.ttl_s / 2)
    run(main())
