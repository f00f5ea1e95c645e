"""Faults around the engine: lost append acknowledgements, foreign records in the log,
abandoned requests, refused rounds with waiting retries, a model that refuses one session,
concurrent opens, and bad logits while self-decoding."""

from __future__ import annotations

import asyncio

import torch

from sdcp_fast.cache import StoreTimeout
from sdcp_fast.core.messages import Action, SessionOpen, SessionState, Verdict
from sdcp_fast.core.problems import Kind, Problem
from sdcp_fast.core.session import Job
from sdcp_fast.models.base import KVCapacityError
from sdcp_fast.refs import encode_session_id
from sdcp_fast.verifier.verify_step import self_decode
from tests.verifier.harness import contract_for, harness_test


def greedy(backend, seq, n):
    seq = list(seq)
    for _ in range(n):
        seq.append(int(backend.table[seq[-1]].argmax()))
    return seq[-n:]


async def opened(h, **overrides):
    contract = contract_for(h.backend, **overrides)
    sid, r = await h.open(contract)
    state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
    return contract, sid, state


class LostAck:
    """A commit log whose first append lands and then reports a timeout."""

    def __init__(self, inner, fail_times=1):
        self.inner, self.fail_times = inner, fail_times

    async def append(self, log, record, *, epoch, expected):
        length = await self.inner.append(log, record, epoch=epoch, expected=expected)
        if self.fail_times:
            self.fail_times -= 1
            raise StoreTimeout("the acknowledgement was lost")
        return length

    def __getattr__(self, name):
        return getattr(self.inner, name)


@harness_test
async def test_append_that_landed_despite_a_timeout_counts_as_committed(h):
    contract, sid, state = await opened(h)
    h.service.engine.commit_log = LostAck(h.log)
    r = await h.propose(sid, state, greedy(h.backend, [1, 2, 3], 2))
    assert r.status == 200, r.body
    v = Verdict.from_cbor(r.body)
    entries = await h.log.read(f"log/{sid.hex()}")
    assert [e.kind for e in entries] == ["commit"]
    state = SessionState(sid, 1, v.round, v.committed, v.digest)
    r = await h.propose(sid, state, greedy(h.backend, [1, 2, 3, *v.emitted], 1))
    assert r.status == 200 and Verdict.from_cbor(r.body).round == 2


@harness_test
async def test_a_record_this_verifier_did_not_write_stops_the_session(h):
    contract, sid, state = await opened(h)
    # another writer (a verifier that should have been fenced) took position 0
    await h.log.append(f"log/{sid.hex()}", b"\xa0", epoch=1, expected=0)
    r = await h.propose(sid, state, [1])
    assert r.status == 409 and Problem.from_json(r.body).kind == Kind.STALE_EPOCH
    assert h.service.sessions[sid].machine.state.value == "fenced"
    assert h.service.sessions[sid].machine.committed == 0           # nothing released


@harness_test
async def test_abandoned_request_still_starts_self_decoding_and_sends_events(h):
    contract, sid, state = await opened(h, low_rounds=1, fallback=(Action.SELF_DECODE,), self_load=100,
                                        self_max=2)
    target = greedy(h.backend, [1, 2, 3], 1)[0]
    task = asyncio.create_task(h.propose(sid, state, [(target + 1) % 16]))
    await asyncio.sleep(0)           # the proposal is queued ...
    task.cancel()                    # ... and its client goes away
    session = h.service.sessions[sid].machine
    for _ in range(300):
        if session.state.value == "awaiting-drafter":
            break
        await asyncio.sleep(0.01)
    assert session.state.value == "awaiting-drafter"
    assert session.committed == 3    # the round's token and two self-decoded ones


class SlowQ:
    """An object store whose reads take a while (so that a retry finds the round in flight)."""

    def __init__(self, inner):
        self.inner = inner

    async def get_into(self, uri, out):
        await asyncio.sleep(0.2)
        return await self.inner.get_into(uri, out)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@harness_test
async def test_identical_retry_of_a_refused_round_gets_the_refusal(h):
    contract, sid, state = await opened(h, rule=2)
    q = torch.full((1, 16), 1 / 16)
    q[0, 5] = 0.0
    await h.store.put("mlc:/q/z", q.numpy().tobytes(), lease_ms=60_000)
    h.service.engine.store = SlowQ(h.store)
    first, retry = await asyncio.gather(h.propose(sid, state, [5], q_rows="mlc:/q/z"),
                                        h.propose(sid, state, [5], q_rows="mlc:/q/z"))
    for r in (first, retry):
        assert r.status == 422 and Problem.from_json(r.body).kind == Kind.BAD_PROPOSAL


class RefusesOne:
    """A backend that cannot score one session (as if over its KV cap)."""

    def __init__(self, inner, bad: bytes):
        self.inner, self.bad = inner, bad

    def score(self, items):
        if any(sid == self.bad for sid, _ in items):
            raise KVCapacityError("session over its length cap")
        return self.inner.score(items)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@harness_test
async def test_one_session_the_model_refuses_does_not_fail_the_batch(h):
    contract, good, gstate = await opened(h)
    _, bad, bstate = await opened(h)
    h.service.target.backend = RefusesOne(h.backend, bad)
    rg, rb = await asyncio.gather(h.propose(good, gstate, greedy(h.backend, [1, 2, 3], 2)),
                                  h.propose(bad, bstate, greedy(h.backend, [1, 2, 3], 2)))
    assert rg.status == 200 and Verdict.from_cbor(rg.body).accepted == 2
    assert rb.status == 503
    assert h.service.sessions[bad].machine.round == 0                 # not consumed: may be retried


@harness_test
async def test_concurrent_identical_opens_get_one_session(h):
    contract = contract_for(h.backend)
    sid = h.new_session_id()
    msg = SessionOpen(sid, 1, contract, (1, 2, 3), f"log/{sid.hex()}").to_cbor()
    a, b = await asyncio.gather(h.call("POST", "/sessions", msg), h.call("POST", "/sessions", msg))
    assert a.status == b.status == 200 and a.body == b.body


@harness_test
async def test_open_must_agree_with_the_commit_log(h):
    contract, sid, state = await opened(h)
    await h.propose(sid, state, greedy(h.backend, [1, 2, 3], 1))
    fresh_again = SessionOpen(sid, 2, contract, (1, 2, 3), f"log/{sid.hex()}")
    r = await h.call("POST", "/sessions", fresh_again.to_cbor())
    assert r.status == 409 and Problem.from_json(r.body).kind == Kind.CONFLICT   # needs resume
    other = h.new_session_id()
    await h.log.fence(f"log/{other.hex()}", 3)
    r = await h.call("POST", "/sessions", SessionOpen(other, 2, contract, (1,), f"log/{other.hex()}").to_cbor())
    assert r.status == 409 and Problem.from_json(r.body).kind == Kind.STALE_EPOCH


@harness_test
async def test_policy_sampling_ignores_unknown_keys(h):
    from sdcp_fast.core import cbor
    contract, sid, state = await opened(h, rule=2)
    body = cbor.dumps({"session": sid, "from_round": 5, "sampling": {"temperature_milli": 700, "new_knob": 1}})
    r = await h.call("POST", f"/sessions/{encode_session_id(sid)}/policy", body)
    assert r.status == 200
    assert h.service.sessions[sid].machine.sampling_for(5).temperature_milli == 700
    bad = cbor.dumps({"session": sid, "from_round": 6, "sampling": {"top_p_milli": 1001}})
    r = await h.call("POST", f"/sessions/{encode_session_id(sid)}/policy", bad)
    assert r.status == 400


def test_self_decoding_never_commits_a_token_from_bad_logits():
    def job(rule):
        return Job(b"s" * 16, 1, 2, rule, None, (), (), (0.5,) if rule == 2 else (), None, None, True, None)

    def one(rule, row):
        return self_decode([job(rule)], row[None])[0]

    bad_rows = [torch.tensor([0.0, float("nan"), 1.0, 0.0]), torch.tensor([0.0, float("inf"), 1.0, 0.0]),
                torch.full((4,), float("-inf"))]
    for row in bad_rows:
        for rule in (1, 2):
            outcome = one(rule, row)
            assert outcome.problem is not None and outcome.problem.kind == Kind.UNAVAILABLE
    tied = torch.tensor([1.0, 3.0, 3.0, float("-inf")])
    assert one(1, tied).extra == 1               # ties to the smallest id
    assert one(2, tied).extra in (1, 2)
    # a batch's M = 0 jobs decoded together: each job gets what it gets alone, bad rows
    # refused beside good ones of either rule
    good = [tied, torch.tensor([5.0, 0.0, 0.0, 9.0]), torch.tensor([0.0, 2.0, 0.0, 0.0])]
    rows = [good[0], bad_rows[0], good[1], bad_rows[1], good[2], good[1]]
    rules = [1, 1, 2, 2, 1, 1]
    together = self_decode([job(r) for r in rules], torch.stack(rows))
    assert together == [one(r, row) for r, row in zip(rules, rows, strict=True)]
    assert [o.extra for o in together] == [1, -1, together[2].extra, -1, 1, 3]
    assert [o.problem is None for o in together] == [True, False, True, False, True, True]


def test_rule_2_rows_drawn_together_are_drawn_as_alone():
    """Self-decoded rule-2 rows go through one target_probs and one draw: each row still gets
    its own profile and uniform, exactly the token it gets alone."""
    from sdcp_fast.core.messages import Sampling
    profiles = [None, Sampling(temperature_milli=700), Sampling(temperature_milli=1300, top_k=5),
                Sampling(top_p_milli=600), Sampling(temperature_milli=0), Sampling(temperature_milli=400, top_k=40,
                                                                                    top_p_milli=900)]
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(len(profiles) * 3, 300, generator=gen) * 3
    jobs = [Job(b"s" * 16, 1, 2, 2, profiles[n % len(profiles)], (), (), (float(u),), None, None, True, None)
            for n, u in enumerate(torch.rand(rows.shape[0], generator=gen, dtype=torch.float64))]
    together = self_decode(jobs, rows)
    assert together == [self_decode([job], rows[n:n + 1])[0] for n, job in enumerate(jobs)]
    assert all(o.problem is None and 0 <= o.extra < 300 for o in together)
    assert len({o.extra for o in together}) > 3   # the profiles and uniforms made a difference


class SlowLog:
    """A commit log whose appends take a while, to look at the service mid-append."""

    def __init__(self, inner):
        self.inner, self.started = inner, asyncio.Event()

    async def append(self, log, record, *, epoch, expected):
        self.started.set()
        await asyncio.sleep(1.0)   # longer than the harness's output long-poll (0.5 s)
        return await self.inner.append(log, record, epoch=epoch, expected=expected)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@harness_test
async def test_no_output_before_the_append_completes(h):
    contract, sid, state = await opened(h)
    slow = SlowLog(h.log)
    h.service.engine.commit_log = slow
    proposal = asyncio.create_task(h.propose(sid, state, greedy(h.backend, [1, 2, 3], 2)))
    await slow.started.wait()
    path = f"/sessions/{encode_session_id(sid)}/output"
    from sdcp_fast.core.messages import Output
    early = Output.from_cbor((await h.call("GET", path, query={"from": "0"})).body)
    assert early.tokens == ()                     # waited, then nothing: the append is pending
    assert not proposal.done()                    # and no verdict either
    v = Verdict.from_cbor((await proposal).body)
    late = Output.from_cbor((await h.call("GET", path, query={"from": "0"})).body)
    assert late.tokens == v.emitted


def test_idle_sessions_are_dropped(tmp_path):
    import dataclasses

    from tests.verifier.harness import Harness

    async def main():
        h = await Harness.start(tmp_path)
        h.service.config = dataclasses.replace(h.service.config, idle_s=0.2)
        await h.service.start()       # the janitor picks up the short idle time
        try:
            contract, sid, state = await opened(h)
            served = h.service.sessions[sid]
            for _ in range(100):
                if sid not in h.service.sessions:
                    break
                await asyncio.sleep(0.05)
            assert sid not in h.service.sessions
            assert served.retired            # the record held every per-session entry
        finally:
            await h.close()

    asyncio.run(asyncio.wait_for(main(), 30))


class CommitFailsOnce:
    """A backend that cannot take one commit (as if the accepted tokens hit its cap)."""

    def __init__(self, inner):
        self.inner, self.failed = inner, False

    def commit(self, session, emitted):
        if not self.failed:
            self.failed = True
            raise KVCapacityError("no room for the accepted tokens")
        return self.inner.commit(session, emitted)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@harness_test
async def test_a_durable_round_stands_when_the_model_cannot_follow_it(h):
    contract, sid, state = await opened(h)
    h.service.target.backend = CommitFailsOnce(h.backend)
    tokens = greedy(h.backend, [1, 2, 3], 2)
    r = await h.propose(sid, state, tokens)
    assert r.status == 200                                    # the append happened: verdict stands
    v = Verdict.from_cbor(r.body)
    assert h.backend.committed(sid) == [1, 2, 3, *v.emitted]  # the model was rebuilt from it
    state = SessionState(sid, 1, v.round, v.committed, v.digest)
    r = await h.propose(sid, state, greedy(h.backend, [1, 2, 3, *v.emitted], 1))
    assert r.status == 200 and Verdict.from_cbor(r.body).round == 2
