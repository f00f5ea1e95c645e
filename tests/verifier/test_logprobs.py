"""The target's log-probabilities through the verifier (session-open's `logprobs`, output's
`logprobs`): the table model's log-softmax rows for every committed token, proposed or
self-decoded, aligned with output indices; nothing for sessions that did not ask; a session
resumed here has none before its resume point (the output read splits there)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from sdcp_fast.core.messages import (
    Action,
    LogprobsAsk,
    Output,
    Sampling,
    SessionOpen,
    SessionState,
    TokenLogprobs,
    Verdict,
)
from sdcp_fast.refs import encode_session_id
from sdcp_fast.verifier.logprobs import Committed
from sdcp_fast.verifier.sessions import ServedSession
from tests.verifier.harness import contract_for, harness_test

PROMPT = (1, 2, 3)


async def open_asking(h, contract, ask: LogprobsAsk | None):
    sid = h.new_session_id()
    msg = SessionOpen(sid, 1, contract, PROMPT, f"log/{sid.hex()}", logprobs=ask)
    resp = await h.call("POST", "/sessions", msg.to_cbor())
    assert resp.status == 200, resp.body
    state = SessionState.from_cbor(resp.body)
    state = SessionState.from_cbor((await h.assign(sid, contract, state)).body)
    return sid, state


async def output(h, sid, start=0) -> Output:
    resp = await h.call("GET", f"/sessions/{encode_session_id(sid)}/output", query={"from": str(start)})
    assert resp.status == 200, resp.body
    return Output.from_cbor(resp.body)


def expected(backend, tokens, top):
    """(log p, top alternatives) per token: the table's row of the token before it."""
    seq, out = list(PROMPT), []
    for token in tokens:
        row = torch.log_softmax(backend.table[seq[-1]].double(), dim=-1)
        values, ids = torch.topk(row, top)
        out.append((float(row[token]), list(zip(ids.tolist(), values.tolist(), strict=True))))
        seq.append(token)
    return out


def assert_close(got, want):
    assert len(got) == len(want)
    for (lp, alts), (wlp, walts) in zip(got, want, strict=True):
        assert abs(lp - wlp) < 1e-6
        assert [i for i, _ in alts] == [i for i, _ in walts]
        assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(alts, walts, strict=True))


@harness_test
async def test_committed_tokens_carry_the_targets_logprobs(h):
    contract = contract_for(h.backend)
    sid, state = await open_asking(h, contract, LogprobsAsk(top=3))
    wrong = (int(h.backend.table[3].argmax()) + 1) % 16
    verdict = Verdict.from_cbor((await h.propose(sid, state, [wrong, 5])).body)   # rejected: the target's token
    state = h.service.sessions[sid].machine.state_message()
    nxt = int(h.backend.table[verdict.emitted[-1]].argmax())
    verdict2 = Verdict.from_cbor((await h.propose(sid, state, [nxt])).body)
    tokens = [*verdict.emitted, *verdict2.emitted]
    out = await output(h, sid)
    assert out.tokens == tuple(tokens)
    assert_close(out.logprobs.entries(), expected(h.backend, tokens, 3))
    later = await output(h, sid, 1)    # the resumable read: aligned with output indices
    assert_close(later.logprobs.entries(), expected(h.backend, tokens, 3)[1:])


@harness_test
async def test_processed_logprobs_of_a_greedy_session_are_one_hot(h):
    contract = contract_for(h.backend, sampling=Sampling(temperature_milli=0))
    sid, state = await open_asking(h, contract, LogprobsAsk(top=2, processed=True))
    await h.propose(sid, state, [int(h.backend.table[3].argmax())])
    for lp, alts in (await output(h, sid)).logprobs.entries():
        assert lp == 0.0 and alts[0][1] == 0.0 and alts[1][1] == float("-inf")


@harness_test
async def test_a_session_that_did_not_ask_pays_nothing(h):
    contract = contract_for(h.backend)
    sid, state = await open_asking(h, contract, None)
    await h.propose(sid, state, [int(h.backend.table[3].argmax())])
    served = h.service.sessions[sid]
    assert served.scored is None and served.committed_logprobs is None
    assert (await output(h, sid)).logprobs is None


@harness_test
async def test_self_decoded_tokens_have_logprobs_too(h):
    contract = contract_for(h.backend, low_rounds=1, fallback=(Action.SELF_DECODE,), self_load=100, self_max=3)
    sid, state = await open_asking(h, contract, LogprobsAsk(top=1))
    wrong = (int(h.backend.table[3].argmax()) + 1) % 16
    verdict = Verdict.from_cbor((await h.propose(sid, state, [wrong])).body)
    assert verdict.action == Action.SELF_DECODE
    machine = h.service.sessions[sid].machine
    for _ in range(300):
        if machine.committed >= 4:
            break
        await asyncio.sleep(0.01)
    out = await output(h, sid)
    assert len(out.tokens) == 4        # one round, then three self-decoded rounds
    assert_close(out.logprobs.entries(), expected(h.backend, list(out.tokens), 1))


def test_a_resumed_session_splits_the_read_at_its_resume_point():
    served = ServedSession(SimpleNamespace(committed=3, id=b"s" * 16), log_position=0)
    served.ask_logprobs(LogprobsAsk(top=1))
    served.committed_logprobs.extend([(-0.5, [(7, -0.5)]), (-1.0, [(8, -0.25)])])   # indices 3 and 4
    before = served.with_logprobs(Output(b"s" * 16, 2, 0, (1, 2, 3, 7, 8), True, Action.FINISH))
    assert (before.tokens, before.logprobs, before.final, before.finish) == ((1, 2, 3), None, False, None)
    after = served.with_logprobs(Output(b"s" * 16, 2, 3, (7, 8), True, Action.FINISH))
    assert after.final and after.logprobs.entries() == [(-0.5, [(7, -0.5)]), (-1.0, [(8, -0.25)])]
    assert Committed.bytes_per_token(20) == 248


def test_output_logprobs_cover_exactly_its_tokens():
    import pytest

    from sdcp_fast.core.problems import ProblemError

    lp = TokenLogprobs.pack(1, [(-0.1, [(4, -0.1)])])
    with pytest.raises(ProblemError):
        Output(b"s" * 16, 1, 0, (4, 5), False, logprobs=lp)
    with pytest.raises(ProblemError):
        TokenLogprobs(2, lp.token, lp.ids, lp.values)
    # unknown members of the extension are ignored, as section 5.2 says of unknown keys
    obj = Output(b"s" * 16, 1, 0, (4,), False, logprobs=lp).to_obj()
    obj["logprobs"]["future"] = 1
    assert Output.from_obj(obj).logprobs == lp
    # an open without the extension members encodes as before
    assert "logprobs" not in SessionOpen(b"s" * 16, 1, contract_like(), (1,), "log").to_obj()


def contract_like():
    from sdcp_fast.core.messages import Contract

    return Contract(target=b"t" * 32, tokenizer=b"k" * 32, rule=1, m_max=4, max_new=8, stop=(), low_rounds=1,
                    fallback=(Action.REDUCE,))
