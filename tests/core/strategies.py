"""Hypothesis strategies for every SDCP message (valid by construction), and byte streams
that are mostly not CBOR (`streams`)."""

from __future__ import annotations

from hypothesis import strategies as st

from sdcp_fast.core import messages as m

U64 = (1 << 64) - 1
U32 = (1 << 32) - 1

uint = st.integers(0, U64)
small = st.integers(0, 10_000)
u32 = st.integers(0, U32)
token = st.integers(0, U32)
hash32 = st.binary(min_size=32, max_size=32)
sid = st.binary(min_size=16, max_size=16)
ref = st.text(max_size=40)
tokens = st.lists(token, max_size=12).map(tuple)
action = st.sampled_from(list(m.Action))

sampling = st.builds(
    m.Sampling,
    temperature_milli=st.none() | uint,
    top_k=st.none() | uint,
    top_p_milli=st.none() | st.integers(0, 1000),
    seed=st.none() | uint,
)

contract = st.builds(
    m.Contract,
    target=hash32, tokenizer=hash32,
    rule=st.sampled_from([1, 2]),
    m_max=st.integers(1, 64),
    max_new=uint,
    stop=tokens,
    low_rounds=st.integers(1, U64),
    fallback=st.lists(st.sampled_from(sorted(m.LADDER_ACTIONS)), min_size=1, max_size=5).map(tuple),
    drafters=st.none() | st.lists(hash32, min_size=1, max_size=3).map(tuple),
    sampling=st.none() | sampling,
    low_ratio=st.none() | st.integers(0, 100),
    self_load=st.none() | st.integers(0, 100),
    self_max=st.none() | uint,
    scope=st.none() | st.binary(min_size=16, max_size=16),
)

status = st.builds(
    m.Status, instance=ref, role=st.sampled_from([1, 2]), load=st.integers(0, 100), queue=uint,
    ttl_ms=uint, accept_milli=st.none() | st.integers(0, 1000), cache_mbps=st.none() | uint,
)

resume = st.builds(m.Resume, round=u32, committed=uint, digest=hash32, committed_tokens=ref,
                   target_kv=st.none() | ref)

prompt = tokens | ref

MESSAGES = {
    m.SessionOpen: st.builds(m.SessionOpen, session=sid, epoch=uint, contract=contract,
                             prompt=prompt, commit_log=ref, prompt_kv=st.none() | ref,
                             resume=st.none() | resume),
    m.SessionState: st.builds(m.SessionState, session=sid, epoch=uint, round=u32, committed=uint,
                              digest=hash32, state=st.none() | uint),
    m.Assignment: st.builds(m.Assignment, session=sid, epoch=uint, contract=contract, verifier=ref,
                            drafter=ref, prompt=prompt, round=u32, committed=uint, digest=hash32,
                            m_init=uint, sampling=st.none() | sampling,
                            committed_tokens=st.none() | ref),
    m.Proposal: st.builds(m.Proposal, session=sid, epoch=uint, round=u32, drafter=ref, base=uint,
                          base_digest=hash32, tokens=st.lists(token, min_size=1, max_size=12).map(tuple),
                          status=status, q_rows=st.none() | ref, draft_kv=st.none() | ref),
    m.Verdict: st.builds(m.Verdict, session=sid, epoch=uint, round=u32, accepted=uint, emitted=tokens,
                         committed=uint, digest=hash32, action=action, m_cap=uint, low=uint,
                         load=st.integers(0, 100)),
    m.Output: st.builds(m.Output, session=sid, epoch=uint, start=uint, tokens=tokens,
                        final=st.booleans(), finish=st.none() | action),
    m.Status: status,
    m.Event: st.builds(m.Event, session=sid, epoch=uint, kind=action, committed=uint, digest=hash32),
    m.Policy: st.builds(m.Policy, session=sid, from_round=u32, sampling=sampling),
}


def head(major: int, info: int, argument: int) -> bytes:
    """A data item head with any additional information, lies and reserved values included."""
    first = bytes([(major << 5) | info])
    size = {24: 1, 25: 2, 26: 4, 27: 8}.get(info, 0)
    return first + (argument % (1 << (8 * size))).to_bytes(size, "big") if size else first


heads = st.builds(head, st.integers(0, 7), st.integers(0, 31), st.integers(0, (1 << 64) - 1))
payload = st.binary(max_size=24)
# a stream of heads and raw bytes: nesting, lying lengths and counts, tags, breaks, floats
streams = st.lists(st.one_of(heads, payload, st.just(b"\x81" * 20), st.just(b"\xff")),
                   max_size=40).map(b"".join)
