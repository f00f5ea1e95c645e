"""The verifier end to end over real HTTP/2 and HTTP/3 with mutual TLS on loopback.

Under rule 1 the committed output equals greedy decoding of the target model token for
token, whatever the drafter proposes (random, perfect, adversarial); every problem type of
Table 2 comes back from a real request.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from sdcp_fast.core.messages import (
    Action,
    Assignment,
    Output,
    Proposal,
    Sampling,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
)
from sdcp_fast.core.problems import Problem
from sdcp_fast.refs import encode_session_id
from sdcp_fast.transport import Client, TLSConfig, make_certs, serve
from tests.verifier.harness import DRAFTER, ROUTER, VERIFIER, Harness, contract_for

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def certdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    make_certs(root, [VERIFIER, ROUTER, DRAFTER])
    return root


class Net:
    """A served verifier and two clients (router and drafter identities)."""

    def __init__(self, harness: Harness, server, router: Client, drafter: Client):
        self.h, self.server, self.router, self.drafter = harness, server, router, drafter
        self.base = f"https://{HOST}:{server.port}"

    async def post(self, client, path, message):
        return await client.request("POST", self.base + path, message.to_cbor(), idempotent=True)

    async def open(self, contract, prompt=(1, 2, 3), sid=None):
        sid = sid or self.h.new_session_id()
        r = await self.post(self.router, "/sessions",
                            SessionOpen(sid, 1, contract, tuple(prompt), f"log/{sid.hex()}"))
        assert r.status == 200, r.body
        state = SessionState.from_cbor(r.body)
        a = Assignment(sid, 1, contract, VERIFIER, DRAFTER, tuple(prompt), 0, 0, state.digest, 8)
        r = await self.router.request("PUT", f"{self.base}/sessions/{encode_session_id(sid)}/drafter",
                                      a.to_cbor(), idempotent=True)
        assert r.status == 200, r.body
        return sid, SessionState.from_cbor(r.body)

    async def propose(self, sid, state: SessionState, tokens, q_rows=None, round=None, epoch=1):
        p = Proposal(sid, epoch, state.round + 1 if round is None else round, DRAFTER, state.committed,
                     state.digest, tuple(tokens), Status(DRAFTER, 1, 0, 0, 1000), q_rows=q_rows)
        return await self.post(self.drafter, "/proposals", p)

    async def output(self, sid, start=0):
        r = await self.router.request("GET", f"{self.base}/sessions/{encode_session_id(sid)}/output?from={start}",
                                      idempotent=True)
        assert r.status == 200, r.body
        return Output.from_cbor(r.body)


def net_test(fn):
    """Run `async def test(net)` against a served verifier, once per protocol."""

    @pytest.mark.parametrize("protocol", ["h2", "h3"])
    def test(tmp_path, certdir, protocol):
        async def main():
            h = await Harness.start(tmp_path)
            server = await serve(h.service, host=HOST, port=0, tls=TLSConfig.for_instance(certdir, VERIFIER))
            router = Client(TLSConfig.for_instance(certdir, ROUTER), protocol, timeout=10)
            drafter = Client(TLSConfig.for_instance(certdir, DRAFTER), protocol, timeout=10)
            try:
                await fn(Net(h, server, router, drafter))
            finally:
                await router.close()
                await drafter.close()
                await server.stop(grace=1)
                await h.close()
        asyncio.run(asyncio.wait_for(main(), 90))

    test.__name__ = fn.__name__
    return test


def greedy_decode(backend, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(backend.table[seq[-1]].argmax()))
    return seq[len(prompt):]


STRATEGIES = ("random", "perfect", "adversarial")


def draft(strategy, backend, context, m, rng):
    if strategy == "random":
        return [rng.randrange(backend.vocab_size) for _ in range(m)]
    seq = list(context)
    out = []
    for _ in range(m):
        ranked = backend.table[seq[-1]].argsort(descending=True).tolist()
        # adversarial: right for a while, then the runner-up, the likeliest wrong token
        pick = ranked[0] if strategy == "perfect" or (len(out) < m // 2) else ranked[1]
        out.append(pick)
        seq.append(pick)
    return out


@net_test
async def test_rule1_output_is_greedy_whatever_the_drafter(net):
    rng = random.Random(1)
    contract = contract_for(net.h.backend, max_new=24, low_rounds=1000, fallback=(Action.REDUCE,))
    expected = greedy_decode(net.h.backend, [1, 2, 3], 24)
    for strategy in STRATEGIES:
        sid, state = await net.open(contract)
        committed = []
        while True:
            tokens = draft(strategy, net.h.backend, [1, 2, 3, *committed], min(8, 24 - len(committed)) or 1, rng)
            r = await net.propose(sid, state, tokens)
            assert r.status == 200, (strategy, r.body)
            v = Verdict.from_cbor(r.body)
            committed += v.emitted
            state = SessionState(sid, 1, v.round, v.committed, v.digest)
            if v.action == Action.FINISH:
                break
        out = await net.output(sid)
        assert list(out.tokens) == expected == committed, strategy
        assert out.final and out.finish == Action.FINISH and out.epoch == 1


@net_test
async def test_every_problem_type_from_a_real_request(net):
    h = net.h
    contract = contract_for(h.backend, max_new=4)
    sid, state = await net.open(contract)

    async def expect(response, suffix, status):
        assert response.status == status, response.body
        assert response.headers.get("content-type", "").startswith("application/problem+json")
        problem = Problem.from_json(response.body)
        assert problem.type.endswith(suffix) and problem.status == status
        return problem

    await expect(await net.propose(sid, state, [1], epoch=2), "sdcp-stale-epoch", 409)
    p = await expect(await net.propose(sid, state, [1], round=5), "sdcp-stale-base", 409)
    assert p.state["round"] == 0 and p.state["digest"] == state.digest
    await expect(await net.propose(sid, state, [1] * 9), "sdcp-limit", 422)
    await expect(await net.propose(sid, state, []), "sdcp-limit", 422)
    bad = contract.replace(rule=1, m_max=8, target=b"\x01" * 32)
    r = await net.post(net.router, "/sessions", SessionOpen(h.new_session_id(), 1, bad, (1,), "log/x"))
    await expect(r, "sdcp-bad-contract", 422)
    # not assigned: the router's identity is not the drafter's
    p2 = Proposal(sid, 1, 1, DRAFTER, 0, state.digest, (1,), Status(DRAFTER, 1, 0, 0, 1))
    await expect(await net.post(net.router, "/proposals", p2), "sdcp-not-assigned", 403)
    # finish the session, then: closed
    while True:
        v = Verdict.from_cbor((await net.propose(sid, state, [1])).body)
        state = SessionState(sid, 1, v.round, v.committed, v.digest)
        if v.action == Action.FINISH:
            break
    await expect(await net.propose(sid, state, [1]), "sdcp-session-closed", 410)

    # rule 2: q rows missing from the cache, and a zero q value
    c2 = contract_for(h.backend, rule=2, sampling=Sampling(seed=5))
    sid2, state2 = await net.open(c2)
    await expect(await net.propose(sid2, state2, [1, 2], q_rows="mlc:/nowhere"), "sdcp-q-unavailable", 409)
    import torch
    q = torch.full((2, h.backend.vocab_size), 1.0 / h.backend.vocab_size)
    q[1, 2] = 0.0
    await h.store.put("mlc:/q/zero", q.numpy().tobytes(), lease_ms=60_000)
    await expect(await net.propose(sid2, state2, [1, 2], q_rows="mlc:/q/zero"), "sdcp-bad-proposal", 422)
    # nothing was consumed: the same round now goes through
    q[1, 2] = 1.0 / h.backend.vocab_size
    await h.store.put("mlc:/q/ok", q.numpy().tobytes(), lease_ms=60_000)
    r = await net.propose(sid2, state2, [1, 2], q_rows="mlc:/q/ok")
    assert r.status == 200 and Verdict.from_cbor(r.body).round == 1


@net_test
async def test_transport_level_refusals_keep_the_server_serving(net):
    r = await net.router.request("POST", net.base + "/sessions", b"\xff\xff", idempotent=True)
    assert r.status == 400
    r = await net.router.request("POST", net.base + "/sessions", b"{}", content_type="application/json")
    assert r.status == 415
    r = await net.router.request("GET", net.base + "/nowhere")
    assert r.status == 404
    r = await net.router.request("DELETE", net.base + "/proposals")
    assert r.status == 405
    sid, state = await net.open(contract_for(net.h.backend))
    assert state.round == 0
