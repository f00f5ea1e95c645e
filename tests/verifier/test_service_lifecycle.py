"""Commit, fencing, retries, self-decoding, resume and output delivery through the service."""

from __future__ import annotations

import asyncio

from sdcp_fast.core.digest import chain
from sdcp_fast.core.messages import Action, CommitRecord, Output, Resume, SessionState, Verdict
from sdcp_fast.core.problems import Problem
from sdcp_fast.refs import encode_session_id, token_list_bytes
from tests.verifier.harness import contract_for, harness_test


def greedy(backend, seq, n):
    seq = list(seq)
    for _ in range(n):
        seq.append(int(backend.table[seq[-1]].argmax()))
    return seq[-n:]


async def opened(h, **contract_overrides):
    contract = contract_for(h.backend, **contract_overrides)
    sid, r = await h.open(contract)
    state = SessionState.from_cbor((await h.assign(sid, contract, SessionState.from_cbor(r.body))).body)
    return contract, sid, state


@harness_test
async def test_fenced_log_stops_the_session_and_releases_nothing(h):
    contract, sid, state = await opened(h)
    v = Verdict.from_cbor((await h.propose(sid, state, greedy(h.backend, [1, 2, 3], 2))).body)
    state = SessionState(sid, 1, v.round, v.committed, v.digest)
    await h.log.fence(f"log/{sid.hex()}", 2)          # the router failed over to epoch 2
    r = await h.propose(sid, state, [1])
    assert r.status == 409 and Problem.from_json(r.body).kind.suffix == "sdcp-stale-epoch"
    out = await h.call("GET", f"/sessions/{encode_session_id(sid)}/output", query={"from": "0"})
    assert out.status == 409
    entries = await h.log.read(f"log/{sid.hex()}")
    assert [e.kind for e in entries] == ["commit", "fence"]
    assert h.service.sessions[sid].machine.committed == 3       # round 2 was discarded
    assert h.service.metrics.count("fenced_appends") == 1


@harness_test
async def test_identical_retry_in_flight_shares_the_verdict(h):
    contract, sid, state = await opened(h)
    tokens = greedy(h.backend, [1, 2, 3], 3)
    first, second = await asyncio.gather(h.propose(sid, state, tokens), h.propose(sid, state, tokens))
    assert first.status == second.status == 200
    assert first.body == second.body                     # byte-identical verdicts
    third = await h.propose(sid, state, tokens)           # a later retry: replayed unchanged
    assert third.body == first.body
    entries = await h.log.read(f"log/{sid.hex()}")
    assert len(entries) == 1                              # committed once


@harness_test
async def test_output_long_poll_wakes_on_commit(h):
    contract, sid, state = await opened(h)
    path = f"/sessions/{encode_session_id(sid)}/output"
    poll = asyncio.create_task(h.call("GET", path, query={"from": "0"}))
    await asyncio.sleep(0.05)
    assert not poll.done()                                # nothing committed yet: it waits
    await h.propose(sid, state, greedy(h.backend, [1, 2, 3], 1))
    out = Output.from_cbor((await poll).body)
    assert len(out.tokens) == 2 and out.start == 0
    empty = Output.from_cbor((await h.call("GET", path, query={"from": "2"})).body)
    assert empty.tokens == () and not empty.final         # server-chosen wait elapsed
    bad = await h.call("GET", path, query={"from": "-1"})
    assert bad.status == 400


@harness_test
async def test_self_decoding_publishes_greedy_tokens_as_rounds(h):
    contract, sid, state = await opened(h, low_rounds=1, fallback=(Action.SELF_DECODE,), self_load=90,
                                       self_max=5, max_new=50)
    h.service.engine.load_override = 10
    target = greedy(h.backend, [1, 2, 3], 1)[0]
    v = Verdict.from_cbor((await h.propose(sid, state, [(target + 1) % 16])).body)
    assert v.action == Action.SELF_DECODE and v.emitted == (target,)
    session = h.service.sessions[sid].machine
    for _ in range(500):
        if session.state.value == "awaiting-drafter":
            break
        await asyncio.sleep(0.01)
    assert session.round == 6 and session.committed == 6
    assert list(session.output_tokens) == greedy(h.backend, [1, 2, 3], 6)
    entries = await h.log.read(f"log/{sid.hex()}")
    assert [CommitRecord.from_cbor(e.record).round for e in entries] == [1, 2, 3, 4, 5, 6]
    r = await h.propose(sid, session.state_message(), [1])
    assert Problem.from_json(r.body).kind.suffix == "sdcp-not-assigned"


@harness_test
async def test_resume_on_failover_continues_the_digest_chain(h):
    contract, sid, state = await opened(h)
    v = Verdict.from_cbor((await h.propose(sid, state, greedy(h.backend, [1, 2, 3], 3))).body)
    committed = list(h.service.sessions[sid].machine.output_tokens)
    log_ref = f"log/{sid.hex()}"
    await h.log.fence(log_ref, 2)
    await h.store.put("mlc:/out/1", token_list_bytes(committed))
    resume = Resume(v.round, v.committed, v.digest, "mlc:/out/1")
    _, r = await h.open(contract, sid=sid, epoch=2, resume=resume)
    assert r.status == 200, r.body
    st = SessionState.from_cbor(r.body)
    assert (st.epoch, st.round, st.committed, st.digest) == (2, 1, 4, v.digest)
    st = SessionState.from_cbor((await h.assign(sid, contract, st, epoch=2)).body)
    v2 = Verdict.from_cbor((await h.propose(sid, st, greedy(h.backend, [1, 2, 3, *committed], 2), epoch=2)).body)
    assert v2.round == 2 and v2.digest == chain(st.digest, v2.emitted)[-1]
    assert list(h.service.sessions[sid].machine.output_tokens) == greedy(h.backend, [1, 2, 3], 7)
    # a resume that disagrees with the log is refused
    bad = Resume(v.round, v.committed, b"\x00" * 32, "mlc:/out/1")
    _, r = await h.open(contract, sid=sid, epoch=3, resume=bad)
    assert r.status == 409


@harness_test
async def test_metrics_are_served_in_prometheus_format(h):
    from prometheus_client.parser import text_string_to_metric_families

    from sdcp_fast.metrics import Health, StatusPage
    from sdcp_fast.transport.asgi import serve_web
    contract, sid, state = await opened(h)
    await h.propose(sid, state, greedy(h.backend, [1, 2, 3], 2))
    server = await serve_web(StatusPage(h.service.metrics.registry, Health()), host="127.0.0.1", port=0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    raw = (await reader.read()).decode()
    writer.close()
    await server.stop()
    head, _, body = raw.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200")
    assert "content-type: text/plain; version=" in head
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body) for s in family.samples}
    assert samples[("sdcp_verdicts_total", (("action", "continue"),))] == 1
    assert samples[("sdcp_verdicts_total", (("action", "fail"),))] == 0      # every action from the start
    assert samples[("sdcp_proposals_total", ())] == 1
    assert samples[("sdcp_spec_decode_num_draft_tokens_total", ())] == 2
    assert samples[("sdcp_spec_decode_num_accepted_tokens_total", ())] == 2
    assert samples[("sdcp_spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),))] == 1
    assert samples[("sdcp_spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),))] == 0
    assert samples[("sdcp_batch_size_bucket", (("le", "1.0"),))] == 1
    assert samples[("sdcp_forward_seconds_count", ())] == 1
    assert samples[("sdcp_commit_log_append_seconds_count", ())] == 1
    assert samples[("sdcp_sessions", ())] == 1


async def test_published_target_kv_lets_another_verifier_resume(tmp_path):
    """Verifier A publishes the target KV of its committed tokens; verifier B, opened with
    resume and that KV, continues with the same greedy output without a prefill of the prefix."""
    import dataclasses

    from sdcp_fast.refs import target_kv_ref as kv_ref
    from tests.verifier.harness import Harness

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = await Harness.start(tmp_path / "a")
    a.service.config = dataclasses.replace(a.service.config, publish_kv_every=1)
    b = await Harness.start(tmp_path / "b")
    b.service.store, b.service.commit_log = a.store, a.log    # one shared cache and log
    b.service.engine.store, b.service.engine.commit_log = a.store, a.log
    try:
        contract, sid, state = await opened(a)
        v = Verdict.from_cbor((await a.propose(sid, state, greedy(a.backend, [1, 2, 3], 2))).body)
        for _ in range(100):
            try:
                blob = await a.store.get(kv_ref(sid))
                break
            except Exception:
                await asyncio.sleep(0.01)
        assert blob
        committed = list(a.service.sessions[sid].machine.output_tokens)
        await a.log.fence(f"log/{sid.hex()}", 2)
        await a.store.put("mlc:/out/kv", token_list_bytes(committed))
        resume = Resume(v.round, v.committed, v.digest, "mlc:/out/kv", target_kv=kv_ref(sid))
        _, r = await b.open(contract, sid=sid, epoch=2, resume=resume)
        assert r.status == 200, r.body
        assert b.backend.committed(sid) == [1, 2, 3, *committed]
        st = SessionState.from_cbor((await b.assign(sid, contract, SessionState.from_cbor(r.body), epoch=2)).body)
        v2 = Verdict.from_cbor((await b.propose(sid, st, greedy(b.backend, [1, 2, 3, *committed], 3), epoch=2)).body)
        assert v2.accepted == 3 and v2.round == 2
        # verifier A, fenced, can no longer commit
        r = await a.propose(sid, state.replace(round=v.round, committed=v.committed, digest=v.digest), [1])
        assert Problem.from_json(r.body).kind.suffix == "sdcp-stale-epoch"
    finally:
        await b.close()
        await a.close()


def test_published_kv_resume(tmp_path):
    asyncio.run(asyncio.wait_for(test_published_target_kv_lets_another_verifier_resume(tmp_path), 60))


test_published_target_kv_lets_another_verifier_resume.__test__ = False
