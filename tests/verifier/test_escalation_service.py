"""The shared escalation vectors, reproduced through the verifier service: a rule-1 drafter
that gets exactly `accepted` of its `m` tokens right, with the verifier's load pinned to the
vector's value, must see the vector's (action, low) in every verdict."""

from __future__ import annotations

import pytest

from sdcp_fast.core.messages import Action, SessionState, Verdict
from tests.conftest import load_vectors
from tests.verifier.harness import Harness, contract_for, harness_test

CASES = load_vectors()["escalation"]


def proposal_with_accepted(backend, context, m, accepted):
    seq, out = list(context), []
    for n in range(m):
        ranked = backend.table[seq[-1]].argsort(descending=True).tolist()
        token = ranked[0] if n < accepted else ranked[1]
        out.append(token)
        seq.append(token)
    return out


async def replay_vector(h: Harness, case) -> None:
    contract = contract_for(
        h.backend, max_new=100_000, m_max=64, low_rounds=case["low_rounds"],
        low_ratio=case["low_ratio"] or None, fallback=tuple(Action(a) for a in case["fallback"]),
        self_load=case["self_load"], self_max=1 if case["self_load"] is not None else None)
    prompt = [1, 2, 3]
    sid, resp = await h.open(contract, prompt=prompt)
    state = SessionState.from_cbor(resp.body)
    committed: list[int] = []
    for n, step in enumerate(case["rounds"]):
        # a fresh assignment each round: m_cap back to m_init, and a drafter again after
        # switch or a self-decoding period
        state = SessionState.from_cbor((await h.assign(sid, contract, state, m_init=64)).body)
        h.service.engine.load_override = step["load"]
        tokens = proposal_with_accepted(h.backend, prompt + committed, step["m"], step["accepted"])
        r = await h.propose(sid, state, tokens)
        assert r.status == 200, (n, r.body)
        v = Verdict.from_cbor(r.body)
        assert (v.accepted, int(v.action), v.low, v.load) == (step["accepted"], step["action"], step["low"], step["load"]), n
        if v.action == Action.SELF_DECODE:   # self_max = 1: one self-decoded round, then an event
            for _ in range(200):
                if h.service.sessions[sid].machine.state.value == "awaiting-drafter":
                    break
                import asyncio
                await asyncio.sleep(0.01)
            assert h.service.sessions[sid].machine.round == v.round + 1
        out = h.service.sessions[sid].machine
        committed = list(out.output_tokens)
        state = out.state_message()
        if v.action == Action.FAIL:
            assert n == len(case["rounds"]) - 1
            assert out.closed


@pytest.mark.parametrize("index", range(len(CASES)))
def test_escalation_vector_through_service(tmp_path, index):
    @harness_test
    async def body(h):
        await replay_vector(h, CASES[index])
    body(tmp_path)
