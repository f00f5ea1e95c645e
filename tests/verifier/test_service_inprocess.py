"""The verifier's resources through its Handler, on real stores, with the table model."""

from __future__ import annotations

from sdcp_fast.core.digest import extend_digest
from sdcp_fast.core.messages import Action, Output, SessionState, Verdict
from sdcp_fast.core.problems import Problem
from sdcp_fast.refs import encode_session_id
from tests.verifier.harness import DRAFTER, contract_for, harness_test


def greedy_next(backend, tokens):
    return int(backend.table[tokens[-1]].argmax())


@harness_test
async def test_rule1_round_commits_greedy_tokens(harness):
    contract = contract_for(harness.backend)
    sid, resp = await harness.open(contract)
    assert resp.status == 200
    state = SessionState.from_cbor(resp.body)
    assert (state.round, state.committed) == (0, 0)
    state = SessionState.from_cbor((await harness.assign(sid, contract, state)).body)
    # a perfect drafter: the greedy continuation
    seq = [1, 2, 3]
    perfect = []
    for _ in range(3):
        perfect.append(greedy_next(harness.backend, seq + perfect))
    resp = await harness.propose(sid, state, perfect)
    assert resp.status == 200, resp.body
    verdict = Verdict.from_cbor(resp.body)
    extra = greedy_next(harness.backend, seq + perfect)
    assert verdict.accepted == 3
    assert verdict.emitted == (*perfect, extra)
    assert verdict.digest == extend_digest(state.digest, verdict.emitted)
    assert verdict.action == Action.CONTINUE
    out = Output.from_cbor((await harness.call("GET", f"/sessions/{encode_session_id(sid)}/output",
                                               query={"from": "0"})).body)
    assert out.tokens == verdict.emitted and out.start == 0 and not out.final
    entries = await harness.log.read(f"log/{sid.hex()}")
    assert len(entries) == 1 and entries[0].kind == "commit"


@harness_test
async def test_wrong_first_token_gets_the_target_token(harness):
    contract = contract_for(harness.backend)
    sid, resp = await harness.open(contract)
    state = SessionState.from_cbor((await harness.assign(sid, contract, SessionState.from_cbor(resp.body))).body)
    target = greedy_next(harness.backend, [1, 2, 3])
    wrong = (target + 1) % 16
    verdict = Verdict.from_cbor((await harness.propose(sid, state, [wrong, 5])).body)
    assert (verdict.accepted, verdict.emitted) == (0, (target,))


@harness_test
async def test_problem_answers(harness):
    contract = contract_for(harness.backend)
    sid, resp = await harness.open(contract)
    state = SessionState.from_cbor(resp.body)
    r = await harness.propose(sid, state, [1])
    assert r.status == 403 and Problem.from_json(r.body).kind.suffix == "sdcp-not-assigned"
    state = SessionState.from_cbor((await harness.assign(sid, contract, state)).body)
    r = await harness.propose(sid, state, [1] * 9)
    assert r.status == 422 and Problem.from_json(r.body).kind.suffix == "sdcp-limit"
    r = await harness.propose(sid, state, [99])
    assert r.status == 422 and Problem.from_json(r.body).kind.suffix == "sdcp-bad-proposal"
    r = await harness.propose(sid, state, [1], epoch=2)
    assert r.status == 409 and Problem.from_json(r.body).kind.suffix == "sdcp-stale-epoch"
    r = await harness.propose(sid, state, [1], drafter="https://intruder.test/")
    assert r.status == 403
    r = await harness.call("POST", "/sessions", b"\xff", caller=DRAFTER)
    assert r.status == 403          # drafters may not open sessions
    r = await harness.call("POST", "/sessions", b"\xa1\x61")
    assert r.status == 400
    bad_contract = contract_for(harness.backend).replace(target=b"\x00" * 32)
    _, r = await harness.open(bad_contract)
    assert r.status == 422 and Problem.from_json(r.body).kind.suffix == "sdcp-bad-contract"
