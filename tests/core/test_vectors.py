"""Every entry of ../shared/vectors/sdcp-vectors.json, through the public API and the core."""

from __future__ import annotations

import pytest

import sdcp_fast
from sdcp_fast.core import cbor
from sdcp_fast.core.control import Counters, Escalation, escalate
from sdcp_fast.core.messages import Action, Contract
from tests.conftest import load_vectors

V = load_vectors()


@pytest.mark.parametrize("case", V["contracts"], ids=lambda c: c["contract_digest"][:8])
def test_contract_encoding_and_digest(case):
    expected_cbor = bytes.fromhex(case["cbor"])
    assert sdcp_fast.deterministic_cbor(case["contract"]) == expected_cbor
    assert Contract.from_obj(case["contract"]).to_cbor() == expected_cbor
    assert Contract.from_cbor(expected_cbor).to_cbor() == expected_cbor
    assert sdcp_fast.contract_digest(case["contract"]).hex() == case["contract_digest"]


@pytest.mark.parametrize("case", V["prefix"], ids=lambda c: c["d0"][:8])
def test_prefix_chain(case):
    d0 = sdcp_fast.prefix_digest(bytes.fromhex(case["contract_digest"]), case["prompt"])
    assert d0.hex() == case["d0"]
    digest = d0
    for token, expected in zip(case["output"], case["d"], strict=True):
        digest = sdcp_fast.extend_digest(digest, [token])
        assert digest.hex() == expected
    assert sdcp_fast.extend_digest(d0, case["output"]).hex() == case["d"][-1]


@pytest.mark.parametrize("case", V["uniforms"], ids=lambda c: f"r{c['round']}i{c['i']}p{c['purpose']}")
def test_uniforms(case):
    u = sdcp_fast.verify_uniform(case["seed"], bytes.fromhex(case["session"]), case["round"],
                                 case["i"], case["purpose"])
    assert u == case["u"]  # exact double


@pytest.mark.parametrize("case", V["escalation"], ids=lambda c: f"R{c['low_rounds']}-{c['fallback']}")
def test_escalation_sequences(case):
    policy = Escalation(case["low_rounds"], case["low_ratio"],
                        tuple(Action(a) for a in case["fallback"]), case["self_load"])
    counters = Counters()
    for n, step in enumerate(case["rounds"]):
        counters, action, low = escalate(policy, counters, step["accepted"], step["m"], step["load"])
        assert (int(action), low) == (step["action"], step["low"]), f"round {n}: {step}"
        if action == Action.FAIL:
            assert n == len(case["rounds"]) - 1, "a failed session has no further rounds"


def test_vectors_cover_every_section():
    assert {"contracts", "prefix", "uniforms", "escalation", "target_dist"} <= set(V)
    assert all(len(V[k]) > 0 for k in ("contracts", "prefix", "uniforms", "escalation", "target_dist"))


def test_canonical_order_differs_from_cbor2_for_mixed_keys():
    # RFC 8949 4.2.1 orders keys by the bytes of their encodings: 10 (0a) < -1 (20) < "a" (61 61)
    assert cbor.dumps({"a": 1, 10: 2, -1: 3}) == bytes.fromhex("a3" "0a02" "2003" "616101")
