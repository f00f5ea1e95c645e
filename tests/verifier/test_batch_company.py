"""How the engine forms a batch: a session of the last batches whose next proposal is a
little late joins the pass instead of costing a pass of its own (`company_share`); one that
does not come is waited for a bounded time and stops counting after two batches; the batch
log has a line per pass."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from sdcp_fast.core.messages import SessionState, Verdict
from sdcp_fast.models import load_backend
from sdcp_fast.verifier import EngineConfig
from tests.verifier.harness import Harness, contract_for, make_table

PASS_S = 0.15    # what every forward pass of the slowed table model costs


class SlowPasses:
    """The table model with every forward pass taking PASS_S (a CPU target's pass)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def score(self, items):
        time.sleep(PASS_S)
        return self._inner.score(items)


def greedy(backend, seq, n):
    seq = list(seq)
    for _ in range(n):
        seq.append(int(backend.table[seq[-1]].argmax()))
    return seq[-n:]


async def start(tmp_path, **engine) -> Harness:
    backend = SlowPasses(load_backend(f"table:{make_table(tmp_path / 'table.safetensors')}"))
    return await Harness.start(tmp_path, backend=backend,
                               engine_config=EngineConfig(**{"max_wait_ms": 1.0, **engine}))


async def two_sessions(h: Harness):
    contract = contract_for(h.backend, max_new=64)
    sessions = []
    for _ in range(2):
        sid, r = await h.open(contract)
        state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
        sessions.append([sid, state, [1, 2, 3]])
    return sessions


async def propose(h: Harness, session, delay: float = 0.0) -> Verdict:
    """The session's next proposal (the greedy continuation: all accepted) after `delay`."""
    sid, state, seq = session
    await asyncio.sleep(delay)
    r = await h.propose(sid, state, greedy(h.backend, seq, 2))
    assert r.status == 200, r.body
    verdict = Verdict.from_cbor(r.body)
    session[1] = SimpleNamespace(round=verdict.round, committed=verdict.committed, digest=verdict.digest)
    session[2] = seq + list(verdict.emitted)
    return verdict


def widths(h: Harness) -> list[int]:
    return [t.jobs for t in h.service.engine.batch_times]


def run(tmp_path, body, **engine):
    async def main():
        h = await start(tmp_path, **engine)
        try:
            return await body(h)
        finally:
            await h.close()
    return asyncio.run(asyncio.wait_for(main(), 60))


async def rounds_with_a_late_session(h: Harness) -> list[int]:
    a, b = await two_sessions(h)
    await asyncio.gather(propose(h, a), propose(h, b))          # one batch of two
    for _ in range(3):   # b's proposal comes 40 ms after a's (its drafter drafted afresh)
        await asyncio.gather(propose(h, a), propose(h, b, delay=0.04))
    return widths(h)


def test_a_late_session_joins_the_pass(tmp_path):
    # waiting up to half a pass (75 ms) covers b's 40 ms: every pass scores both sessions
    assert run(tmp_path, rounds_with_a_late_session, company_share=0.5) == [2, 2, 2, 2]


def test_without_company_share_the_late_session_costs_a_pass_of_its_own(tmp_path):
    assert run(tmp_path, rounds_with_a_late_session, company_share=0.0) == [2, 1, 1, 1, 1, 1, 1]


def test_a_session_that_does_not_come_is_waited_for_briefly_then_not_at_all(tmp_path):
    async def body(h: Harness):
        a, b = await two_sessions(h)
        await asyncio.gather(propose(h, a), propose(h, b))       # both recent
        latencies = []
        for _ in range(4):                                       # b never proposes again
            started = time.perf_counter()
            await propose(h, a)
            latencies.append(time.perf_counter() - started)
        return widths(h), latencies, b[0] in h.service.engine._expected()

    sizes, latencies, b_expected = run(tmp_path, body, company_share=0.5)
    assert sizes == [2, 1, 1, 1, 1]
    # the first two of a's rounds wait for b (at most half a pass each); by the third, b
    # has been in neither of the last two batches and nobody waits for it
    assert all(s < PASS_S * 1.5 + 0.5 for s in latencies[:2])
    assert latencies[2] < latencies[0] and latencies[3] < latencies[0]
    assert not b_expected


def test_the_batch_log_has_a_line_per_pass(tmp_path):
    log = tmp_path / "batches.jsonl"

    async def body(h: Harness):
        a, b = await two_sessions(h)
        await asyncio.gather(propose(h, a), propose(h, b))
        await propose(h, a)
        return [a[0].hex(), b[0].hex()]

    ids = run(tmp_path, body, batch_log=str(log))
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [sorted(line["sessions"]) for line in lines] == [sorted(ids), [ids[0]]]
    assert [sorted(line["rounds"]) for line in lines] == [[1, 1], [2]]
    assert [line["m"] for line in lines] == [[2, 2], [2]]
    for line in lines:
        assert line["end"] >= line["t"] + PASS_S * 0.9
        assert line["forward_ms"] >= PASS_S * 1e3 * 0.9
        assert len(line["waited_ms"]) == len(line["sessions"])


@pytest.mark.parametrize("passes_on_the_loop", [False, True])
def test_a_job_that_came_during_a_pass_does_not_wait_max_wait_again(tmp_path, monkeypatch, passes_on_the_loop):
    """max_wait_ms is the wait of a first job that came to an idle engine: b's proposal,
    which came while a's pass ran (longer than max_wait_ms), starts the next pass when that
    one ends, though a could still propose (before, the window restarted at the end of the
    pass). A pass on the event loop holds it: b's request is only taken in after the pass,
    and still counts as having come during it."""
    if passes_on_the_loop:   # every forward pass measured cheaper than a thread hop
        monkeypatch.setenv("SDCP_INLINE_BELOW_US", str(10**9))
    log = tmp_path / "batches.jsonl"

    async def body(h: Harness):
        a, b = await two_sessions(h)
        await asyncio.gather(propose(h, a), propose(h, b))       # one pass of both
        # a waits out max_wait_ms for company, then its pass runs; b queues during that pass
        await asyncio.gather(propose(h, a), propose(h, b, delay=0.12))
        return [a[0].hex(), b[0].hex()]

    ids = run(tmp_path, body, company_share=0.0, max_wait_ms=100.0, batch_log=str(log))
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["sessions"] for line in lines[1:]] == [[ids[0]], [ids[1]]]
    assert lines[2]["t"] - lines[1]["end"] < 0.05   # not the 100 ms window again
    if not passes_on_the_loop:   # taken in during the pass: it waited there
        assert min(lines[2]["waited_ms"]) >= 100.0


def test_a_session_whose_drafter_takes_longer_than_the_wait_is_not_waited_for(tmp_path):
    """b comes back 120 ms after each answer, past any wait of half a pass (75 ms): once the
    engine has seen that, a's pass starts at once instead of waiting out the window for b."""
    log = tmp_path / "batches.jsonl"

    async def body(h: Harness):
        a, b = await two_sessions(h)
        await asyncio.gather(propose(h, a), propose(h, b))
        for _ in range(4):
            await asyncio.gather(propose(h, a), propose(h, b, delay=0.12))
        return a[0].hex()

    a_id = run(tmp_path, body, company_share=0.5, batch_log=str(log))
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    a_alone = [line for line in lines if line["sessions"] == [a_id]]
    assert len(a_alone) == 4
    assert all(line["waited_ms"][0] < 30 for line in a_alone[1:])   # b's turnaround known by then


def test_a_failing_after_commit_step_keeps_no_answer_of_the_batch_back(tmp_path, caplog):
    """The engine settles each round's request from its own step (Engine.enqueue's `then`):
    one session's after-commit work failing is logged and the batch's other answers still go
    out, in the same pass."""
    async def body(h: Harness):
        a, b = await two_sessions(h)
        after_commit = h.service._after_commit
        failed = []

        def failing_for_a(served):
            if served.id == a[0] and not failed:
                failed.append(served.id)
                raise RuntimeError("after-commit bug")
            after_commit(served)

        h.service._after_commit = failing_for_a
        verdicts = await asyncio.gather(propose(h, a), propose(h, b))   # one batch of two
        assert failed == [a[0]]
        assert [v.round for v in verdicts] == [1, 1]
        assert widths(h) == [2]
        await propose(h, a)   # the session goes on
        return widths(h)

    with caplog.at_level("ERROR", logger="sdcp_fast.verifier.engine"):
        assert run(tmp_path, body, company_share=0.5) == [2, 1]
    assert "settling round 1 failed" in caplog.text
