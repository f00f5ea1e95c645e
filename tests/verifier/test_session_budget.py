"""Sessions bounded by memory as well as count: a full verifier answers `capacity` (503, a
problem type the router understands), retires the least recently used idle sessions first
when it needs room, and answers requests for a retired session `session-retired` (its commit
log stays; the router resumes it from there)."""

from __future__ import annotations

import asyncio
import json

from harness import Harness, contract_for, harness_test

from sdcp_fast.core.messages import SessionState
from sdcp_fast.refs import encode_session_id
from sdcp_fast.verifier.service import SESSION_STATE_BYTES, STATE_BYTES_PER_TOKEN

PROMPT = (1, 2, 3)


def _reservation(h: Harness, contract) -> int:
    tokens = len(PROMPT) + contract.max_new + contract.m_max + 1
    return SESSION_STATE_BYTES + STATE_BYTES_PER_TOKEN * tokens + h.backend.bytes_for(tokens)


def _kind(response) -> str:
    return json.loads(response.body)["type"].rsplit(":", 1)[-1]


ROOM_FOR_TWO = 2 * 25_000   # the table model's sessions below reserve about 24.5 KB each


@harness_test(memory_budget_bytes=ROOM_FOR_TWO, retire_idle_s=0.3)
async def test_full_verifier_answers_capacity_then_retires_the_least_recently_used(h: Harness):
    contract = contract_for(h.backend)
    need = _reservation(h, contract)
    assert 2 * need <= ROOM_FOR_TWO < 3 * need
    a, opened_a = await h.open(contract)
    b, opened_b = await h.open(contract)
    assert (opened_a.status, opened_b.status) == (200, 200)
    assert h.service.sessions.reserved_bytes == 2 * need
    c, refused = await h.open(contract)
    assert (refused.status, _kind(refused)) == (503, "capacity")      # nobody idle long enough
    await asyncio.sleep(0.35)
    state_b = SessionState.from_cbor(opened_b.body)
    assert (await h.assign(b, contract, state_b)).status == 200        # b is used again: a is older
    _, opened_c = await h.open(contract, sid=c)
    assert opened_c.status == 200
    assert a not in h.service.sessions and b in h.service.sessions
    output = await h.call("GET", f"/sessions/{encode_session_id(a)}/output", b"", query={"from": "0"})
    assert (output.status, _kind(output)) == (404, "session-retired")
    put = await h.assign(a, contract, SessionState.from_cbor(opened_a.body))
    assert (put.status, _kind(put)) == (404, "session-retired")
    assert h.service.metrics.count("sessions_retired_total", reason="room") == 1
    assert h.service.metrics.count("problems_total", type="capacity") == 1
    # the router resumes it (a new epoch; nothing committed yet): room is made again
    await asyncio.sleep(0.35)
    _, reopened = await h.open(contract, sid=a, epoch=2)
    assert reopened.status == 200
    assert h.service.sessions.reserved_bytes == 2 * need
    assert len(h.service.sessions) == 2


@harness_test(max_sessions=1)
async def test_the_count_bound_answers_capacity_too(h: Harness):
    contract = contract_for(h.backend)
    _, first = await h.open(contract)
    _, second = await h.open(contract)
    assert first.status == 200 and (second.status, _kind(second)) == (503, "capacity")


@harness_test
async def test_what_a_session_holds_stays_within_its_reservation(h: Harness):
    contract = contract_for(h.backend, max_new=20)
    sid, opened = await h.open(contract)
    state = SessionState.from_cbor(opened.body)
    await h.assign(sid, contract, state)
    for _ in range(5):
        verdict = await h.propose(sid, state, [1, 2])
        assert verdict.status == 200
        state = h.service.sessions.get(sid).machine.state_message()
    held = h.backend.session_bytes(sid)
    assert 0 < held <= h.backend.bytes_for(len(PROMPT) + contract.max_new + contract.m_max + 1)
    assert h.service.sessions.get(sid).reserved == _reservation(h, contract)

