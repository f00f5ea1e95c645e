"""The strict CBOR decoder's fast path in C (csrc/cbor/cbor_decode.c) against the Python
reader: whatever the bytes, the C path returns exactly what the Python reader returns (the
same value, of the same types, in the same map order) or hands the input back (Fallback);
it never returns a value where the Python reader refuses. Every message SDCP sends is taken
by the C path whole. Hypothesis, bounded for CI."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdcp_fast.core import cbor
from tests.core.strategies import MESSAGES, streams

_cbor_c = cbor._cbor_c
FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.skipif(_cbor_c is None and os.environ.get("SDCP_REQUIRE_NATIVE") != "1",
                                reason="the CBOR fast path is not built")


def test_the_fast_path_is_built_where_the_native_op_must_be():
    """`make test` (SDCP_REQUIRE_NATIVE=1) runs the C path, not the Python reader alone."""
    assert _cbor_c is not None


def same(a, b) -> bool:
    """Equal and of the same types all the way down (1 == True and 1 == 1.0 are not the same)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(ka, kb) and same(va, vb)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def both(data: bytes, max_depth: int = cbor.DEFAULT_MAX_DEPTH, max_items: int = cbor.DEFAULT_MAX_ITEMS):
    """(what the C path did, what the Python reader did): a value, or the exception type."""
    try:
        fast = ("value", _cbor_c.decode(data, max_depth, max_items))
    except _cbor_c.Fallback:
        fast = ("fallback", None)
    try:
        slow = ("value", cbor.python_loads(data, max_depth=max_depth, max_items=max_items))
    except cbor.DecodeError as exc:
        slow = ("refused", type(exc))
    return fast, slow


def agree(data: bytes, **limits) -> str:
    fast, slow = both(data, **limits)
    if fast[0] == "fallback":
        return "fallback"
    assert slow[0] == "value", f"C took {data.hex()} which the Python reader refuses ({slow[1]})"
    assert same(fast[1], slow[1]), data.hex()
    return "taken"


@FUZZ
@given(data=streams)
def test_arbitrary_bytes_agree_or_fall_back(data):
    agree(data)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 64), (1 << 64) - 1) | st.binary(max_size=40)
    | st.text(max_size=20) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.integers(-(1 << 64), (1 << 64) - 1) | st.text(max_size=8) | st.binary(max_size=8),
                      inner, max_size=6),
    max_leaves=30)


@FUZZ
@given(value=values, cut=st.integers(0, 1 << 16), flip=st.integers(0, 255))
def test_encodings_and_their_mutations_agree_or_fall_back(value, cut, flip):
    """A value's encoding, the same cut short, and one byte changed."""
    data = cbor.dumps(value)
    agree(data)
    agree(data[:cut % (len(data) + 1)])
    at = cut % len(data)
    agree(data[:at] + bytes([data[at] ^ flip]) + data[at + 1:])


@FUZZ
@given(value=values, max_depth=st.integers(0, 4), max_items=st.integers(0, 40))
def test_limits_agree_or_fall_back(value, max_depth, max_items):
    agree(cbor.dumps(value), max_depth=max_depth, max_items=max_items)


def test_what_the_c_path_leaves_to_the_python_reader():
    """Floats, boolean keys and negatives below -2**63 are the Python reader's (the values
    it gives), as is every refusal (its own error)."""
    for value in (1.5, {True: 1}, -(1 << 63) - 1, [0.0]):
        assert agree(cbor.dumps(value)) == "fallback"
        assert same(cbor.loads(cbor.dumps(value)), value)
    assert agree(cbor.dumps(-(1 << 63))) == "taken"
    for data, error in ((b"", cbor.Truncated), (b"\x01\x02", cbor.TrailingBytes), (b"\x9f", cbor.IndefiniteLength),
                        (b"\xa2\x01\x01\x01\x02", cbor.DuplicateKey), (b"\xc1\x00", cbor.Unsupported),
                        (b"\x62\xff\xfe", cbor.DecodeError), (b"\x5a\xff\xff\xff\xff", cbor.Truncated)):
        assert agree(data) == "fallback"
        with pytest.raises(error):
            cbor.loads(data)


def test_limits_are_the_python_readers():
    nested = cbor.dumps([[[[1]]]])      # four arrays, the innermost item at depth 4
    assert agree(nested, max_depth=4) == "taken"
    assert agree(nested, max_depth=3) == "fallback"
    with pytest.raises(cbor.TooDeep):
        cbor.loads(nested, max_depth=3)
    five = cbor.dumps([1, 2, 3, 4])    # five items
    assert agree(five, max_items=5) == "taken"
    assert agree(five, max_items=4) == "fallback"
    with pytest.raises(cbor.TooManyItems):
        cbor.loads(five, max_items=4)
    assert agree(cbor.dumps({}), max_depth=0) == "taken"   # an empty map or array holds nothing deeper


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_is_taken_whole(cls, data):
    """The point of the fast path: SDCP's messages never fall back (they hold no floats)."""
    msg = data.draw(MESSAGES[cls])
    assert agree(msg.to_cbor(), max_items=cls.max_items) == "taken"
    assert cls.from_cbor(msg.to_cbor()) == msg
