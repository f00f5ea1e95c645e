"""Messages: round trips, CDDL conformance of everything emitted, strict decoding, fuzzing."""

from __future__ import annotations

from importlib import resources

import cbor2
import pycddl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdcp_fast.core import cbor
from sdcp_fast.core import messages as m
from sdcp_fast.core.problems import Kind, ProblemError
from tests.conftest import load_vectors
from tests.core.strategies import MESSAGES, token
from tests.core.strategies import contract as contract_st
from tests.core.strategies import resume as resume_st
from tests.core.strategies import sampling as sampling_st

CDDL_TEXT = resources.files("sdcp_fast").joinpath("sdcp.cddl").read_text()
RULES = {
    m.SessionOpen: "session-open", m.SessionState: "session-state", m.Assignment: "assignment",
    m.Proposal: "proposal", m.Verdict: "verdict", m.Output: "output", m.Status: "status",
    m.Event: "event", m.Policy: "policy", m.Contract: "contract", m.Sampling: "sampling",
}
SCHEMAS = {cls: pycddl.Schema(f"root = {rule}\n{CDDL_TEXT}") for cls, rule in RULES.items()}
record_st = st.builds(m.CommitRecord, epoch=st.integers(0, (1 << 64) - 1), round=st.integers(0, (1 << 32) - 1),
                      emitted=st.lists(token, max_size=12).map(tuple), committed=st.integers(0, (1 << 64) - 1),
                      digest=st.binary(min_size=32, max_size=32))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_round_trip_and_cddl(cls, data):
    msg = data.draw(MESSAGES[cls])
    encoded = msg.to_cbor()
    assert cls.from_cbor(encoded) == msg
    assert cls.from_cbor(encoded).to_cbor() == encoded          # deterministic
    assert cbor.loads(encoded) == cbor2.loads(encoded)          # agrees with an independent decoder
    SCHEMAS[cls].validate_cbor(encoded)                         # everything we emit is valid CDDL
    assert encoded == cbor.dumps(msg.to_obj())                  # the fast encoder is the general one


def test_vector_contracts_validate_against_cddl():
    for case in load_vectors()["contracts"]:
        SCHEMAS[m.Contract].validate_cbor(bytes.fromhex(case["cbor"]))


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
@FAST
@given(data=st.data(), junk=st.binary(max_size=200))
def test_random_bytes_raise_only_typed_errors(cls, data, junk):
    try:
        cls.from_cbor(junk)
    except ProblemError as exc:
        assert exc.problem.kind in (Kind.BAD_REQUEST, Kind.BAD_CONTRACT, Kind.TOO_LARGE)


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_mutated_messages_raise_only_typed_errors(cls, data):
    encoded = bytearray(data.draw(MESSAGES[cls]).to_cbor())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(encoded) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            encoded[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del encoded[pos:]
            if not encoded:
                encoded.append(0)
        else:
            encoded.insert(pos, data.draw(st.integers(0, 255)))
    try:
        cls.from_cbor(bytes(encoded))
    except ProblemError as exc:
        assert exc.problem.kind in (Kind.BAD_REQUEST, Kind.BAD_CONTRACT, Kind.TOO_LARGE)


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, (1 << 64) + 5), st.sampled_from([24, 255, 256, 65536, (1 << 32) - 1,
                                                                            1 << 32, (1 << 64) - 1]),
    st.binary(max_size=40), st.text(max_size=5), st.floats(allow_nan=False), st.sampled_from(list(m.Action)),
    st.lists(st.integers(-2, (1 << 32) + 2), max_size=4), st.lists(st.integers(0, 300), max_size=4).map(tuple),
    st.lists(st.booleans() | st.text(max_size=2), max_size=3), st.just(()), st.just([]), st.just(bytearray(16)),
    st.just(bytearray(32)), st.dictionaries(st.text(max_size=8), st.integers(0, 3), max_size=3),
)


def _outcome(cls, values, check):
    msg = object.__new__(cls)
    msg.__dict__.update(values)
    try:
        check(msg)
    except ProblemError as exc:
        return ("refused", exc.problem.kind, exc.problem.detail)
    return ("ok", {k: (type(v), v) for k, v in msg.__dict__.items()})


@pytest.mark.parametrize("cls", [*MESSAGES, m.Contract, m.Sampling, m.Resume, m.CommitRecord],
                         ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_compiled_checker_and_encoder_are_the_generic_ones(cls, data):
    """Each class's compiled checker (inline tests of the usual case) answers exactly as the
    generic member loop, refusals and their details included, on valid and broken members;
    its compiled encoder writes the generic bytes."""
    others = {m.Contract: contract_st, m.Sampling: sampling_st, m.Resume: resume_st, m.CommitRecord: record_st}
    strategy = MESSAGES[cls] if cls in MESSAGES else others[cls]
    msg = data.draw(strategy)
    values = dict(msg.__dict__)
    for name in data.draw(st.lists(st.sampled_from(list(cls.members)), max_size=3, unique=True)):
        values[name] = data.draw(JUNK)
    compiled = m._compile_checker(cls)
    assert compiled is not m.Message.__post_init__
    assert _outcome(cls, values, compiled) == _outcome(cls, values, m.Message.__post_init__)
    if cls.to_obj is m.Message.to_obj:
        out: list[bytes] = []
        m._compile_encoder(cls)(msg, out)
        assert b"".join(out) == cbor.dumps(msg.to_obj())


# ----------------------------------------------------------------------------- strict decoder

@pytest.mark.parametrize("data, error", [
    (b"", cbor.Truncated),
    (bytes.fromhex("a2616101616102"), cbor.DuplicateKey),          # {"a":1, "a":2}
    (bytes.fromhex("9f01ff"), cbor.IndefiniteLength),               # [_ 1]
    (bytes.fromhex("5f41614162ff"), cbor.IndefiniteLength),         # (_ h'61', h'62')
    (bytes.fromhex("0101"), cbor.TrailingBytes),
    (bytes.fromhex("c249010000000000000000"), cbor.Unsupported),   # tag 2 bignum
    (bytes.fromhex("f7"), cbor.Unsupported),                        # undefined
    (bytes.fromhex("1a0000"), cbor.Truncated),
    (bytes.fromhex("9bffffffffffffffff"), cbor.Truncated),          # absurd count, no allocation
    (bytes.fromhex("a1810101"), cbor.Unsupported),                  # array as a map key
    (bytes.fromhex("62c328"), cbor.DecodeError),                    # invalid UTF-8
    (bytes.fromhex("1c"), cbor.DecodeError),                        # reserved info 28
])
def test_strict_decoder_refusals(data, error):
    with pytest.raises(error):
        cbor.loads(data)


def test_depth_and_size_limits():
    deep = b"\x81" * 40 + b"\x00"
    with pytest.raises(cbor.TooDeep):
        cbor.loads(deep)
    assert cbor.loads(b"\x81" * 5 + b"\x00", max_depth=5) == [[[[[0]]]]]
    with pytest.raises(cbor.TooLarge):
        cbor.loads(b"\x00" * 11, max_size=10)
    with pytest.raises(ProblemError) as exc:
        m.Status.from_cbor(b"\x40" * 2000, max_size=1000)
    assert exc.value.problem.kind == Kind.TOO_LARGE


def test_non_shortest_heads_are_accepted_and_reencoded_shortest():
    assert cbor.loads(bytes.fromhex("1800")) == 0
    assert cbor.dumps(cbor.loads(bytes.fromhex("190001"))) == b"\x01"


def test_float_and_simple_values_encode_shortest():
    assert cbor.dumps(1.5) == bytes.fromhex("f93e00")
    assert cbor.dumps(0.1) == bytes.fromhex("fb3fb999999999999a")
    assert cbor.dumps([True, False, None]) == bytes.fromhex("83f5f4f6")
    assert cbor.loads(cbor.dumps(-(1 << 64))) == -(1 << 64)


# ----------------------------------------------------------------------------- semantics

BASE_CONTRACT = load_vectors()["contracts"][1]["contract"]


@pytest.mark.parametrize("change, reason", [
    ({"extra": 1}, "unknown keys"),
    ({"sampling": {"temperature_milli": 1, "typo": 2}}, "unknown keys"),
    ({"rule": 3}, "not registered"),
    ({"m_max": 0}, "m_max"),
    ({"m_max": 65}, "m_max"),
    ({"low_rounds": 0}, "low_rounds"),
    ({"low_ratio": 101}, "low_ratio"),
    ({"fallback": []}, "fallback"),
    ({"fallback": [1, 4]}, "fallback"),
    ({"fallback": [0]}, "fallback"),
    ({"self_load": 101}, "self_load"),
    ({"target": b"x" * 31}, "target"),
    ({"scope": b"x" * 15}, "scope"),
    ({"sampling": {"top_p_milli": 1001}}, "top_p_milli"),
    ({"stop": [-1]}, "stop"),
    ({"m_max": True}, "m_max"),
])
def test_bad_contracts_are_422(change, reason):
    bad = {**BASE_CONTRACT, **change}
    with pytest.raises(ProblemError) as exc:
        m.Contract.from_obj(bad)
    assert exc.value.problem.kind == Kind.BAD_CONTRACT
    assert exc.value.problem.status == 422
    assert reason in exc.value.problem.detail


def test_missing_contract_key_is_422():
    bad = dict(BASE_CONTRACT)
    del bad["fallback"]
    with pytest.raises(ProblemError) as exc:
        m.Contract.from_obj(bad)
    assert exc.value.problem.kind == Kind.BAD_CONTRACT


def test_unknown_keys_ignored_outside_the_contract():
    status = {"instance": "https://d/", "role": 1, "load": 3, "queue": 0, "ttl_ms": 10, "future": [1]}
    assert m.Status.from_obj(status) == m.Status("https://d/", 1, 3, 0, 10)


def test_unknown_action_values_read_as_fail():
    event = {"session": b"s" * 16, "epoch": 1, "kind": 99, "committed": 0, "digest": b"d" * 32}
    assert m.Event.from_obj(event).kind == m.Action.FAIL
    out = {"session": b"s" * 16, "epoch": 1, "from": 0, "tokens": [], "final": True, "finish": 7}
    assert m.Output.from_obj(out).finish == m.Action.FAIL


def test_output_uses_the_key_from():
    out = m.Output(b"s" * 16, 2, 5, (1, 2), False)
    assert cbor.loads(out.to_cbor())["from"] == 5
    assert m.Output.from_cbor(out.to_cbor()).start == 5


def test_cddl_ranges_enforced_on_decode():
    good = {"instance": "i", "role": 1, "load": 100, "queue": 0, "ttl_ms": 1}
    m.Status.from_obj(good)
    for change in ({"load": 101}, {"role": 3}, {"accept_milli": 1001}, {"queue": -1}, {"ttl_ms": "1"}):
        with pytest.raises(ProblemError) as exc:
            m.Status.from_obj({**good, **change})
        assert exc.value.problem.kind == Kind.BAD_REQUEST
