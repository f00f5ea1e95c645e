"""Fuzzing the strict CBOR decoder (hypothesis, bounded for CI): whatever the bytes, the
decoder returns a value or raises a DecodeError, messages raise only their problem, and
the work is bounded by the input (items never exceed bytes; lying heads cost nothing).
Timings live in bench/bench_decode.py, not here."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdcp_fast.core import cbor
from sdcp_fast.core.messages import Contract, Proposal, SessionOpen
from sdcp_fast.core.problems import MAX_DETAIL, ProblemError
from tests.core.strategies import head, streams

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])




@FUZZ
@given(data=streams)
def test_decoder_returns_or_raises_decode_error_only(data):
    try:
        value = cbor.loads(data)
    except cbor.DecodeError:
        return
    assert cbor.loads(cbor.dumps(value)) == value or _has_nan(value)


@FUZZ
@given(data=streams)
def test_items_never_exceed_bytes(data):
    """Every item takes at least one byte, and the decoder knows it: with max_items equal to
    the input length no input is refused for its item count; and a valid input with any
    smaller budget than its item count is refused for that count (TooManyItems), never for
    another reason: the count check comes first."""
    try:
        cbor.loads(data, max_items=len(data))
    except cbor.TooManyItems:
        pytest.fail("more items than bytes")
    except cbor.DecodeError:
        return
    low, high = 0, len(data)        # the smallest budget that decodes it, by bisection
    while low < high:
        budget = (low + high) // 2
        try:
            cbor.loads(data, max_items=budget)
            high = budget
        except cbor.TooManyItems:
            low = budget + 1
        except cbor.DecodeError as exc:
            pytest.fail(f"budget {budget}: refused for {exc!r}, not for its item count")
    if low > 0:
        with pytest.raises(cbor.TooManyItems):
            cbor.loads(data, max_items=low - 1)


@FUZZ
@given(data=streams, kind=st.sampled_from([Proposal, SessionOpen, Contract]))
def test_messages_raise_only_their_problem(data, kind):
    try:
        kind.from_cbor(data)
    except ProblemError as exc:
        assert exc.problem.status in (400, 413, 422)
        assert len(exc.problem.detail) <= MAX_DETAIL


def _has_nan(value) -> bool:
    if isinstance(value, float):
        return value != value
    if isinstance(value, list):
        return any(map(_has_nan, value))
    if isinstance(value, dict):
        return any(map(_has_nan, value.values()))
    return False


@pytest.mark.parametrize(("data", "error"), [
    (b"\x9b" + struct.pack(">Q", 1 << 40) + b"\x00", cbor.Truncated),            # a count that lies
    (b"\xbb" + struct.pack(">Q", 1 << 40) + b"\x00\x00", cbor.Truncated),        # a map count that lies
    (b"\x5b" + struct.pack(">Q", 1 << 62), cbor.Truncated),                      # a length that lies
    (b"\x99\x01\x00" + b"\x00" * 256, cbor.TooManyItems),                         # 256 items, 100 allowed
    (b"\x81" * 17 + b"\x00", cbor.TooDeep),
])
def test_lying_heads_are_refused_before_allocating(data, error):
    with pytest.raises(error):
        cbor.loads(data, max_items=100)


def test_error_details_stay_bounded():
    key = "k" * 100_000
    dup = b"\xa2" + cbor.dumps(key) + b"\x00" + cbor.dumps(key) + b"\x00"
    with pytest.raises(cbor.DuplicateKey) as info:
        cbor.loads(dup)
    assert len(str(info.value)) < 100
    unknown = {f"x{n}": n for n in range(5000)}
    with pytest.raises(ProblemError) as refused:
        Contract.from_obj(unknown)
    assert "and 4992 more" in refused.value.problem.detail
    assert len(refused.value.problem.detail) <= MAX_DETAIL


class _PlainReader(cbor._Reader):
    """The decoder with every map key and value read through `item` (no inline paths): the
    reference the inline reads of `_Reader.map` must agree with."""

    def map(self, count, depth):
        result = {}
        for _ in range(count):
            key = self.item(depth)
            if not isinstance(key, int | str | bytes):
                raise cbor.Unsupported(f"map key of type {type(key).__name__}")
            if key in result:
                raise cbor.DuplicateKey(f"duplicate map key {cbor._short(key)}")
            result[key] = self.item(depth)
        return result


def _decode_with(reader_cls, data, max_items, max_depth):
    reader = reader_cls(data, max_depth, max_items)
    try:
        value = reader.item(0)
    except cbor.DecodeError as exc:
        return type(exc), str(exc)
    return value, reader.pos


map_streams = st.builds(lambda count, body: head(5, *count) + body,
                        st.sampled_from([(1, 0), (2, 0), (3, 0), (5, 0), (24, 3), (31, 0)]), streams)
valid_maps = st.dictionaries(st.text(max_size=30), st.one_of(
    st.integers(0, (1 << 64) - 1), st.binary(max_size=300), st.text(max_size=300),
    st.lists(st.integers(0, 1 << 33), max_size=5)), max_size=6).map(cbor.dumps)


@FUZZ
@given(data=map_streams | valid_maps, budget=st.integers(0, 40), depth=st.integers(0, 3))
def test_inline_map_reads_agree_with_item(data, budget, depth):
    """Whatever the bytes, the item budget and the depth limit, `map`'s inline reads give
    the value, the position and the refusal (its class and text) that `item` gives."""
    assert _decode_with(cbor._Reader, data, budget, depth) == _decode_with(_PlainReader, data, budget, depth)
    assert _decode_with(cbor._Reader, data, 1 << 16, 16) == _decode_with(_PlainReader, data, 1 << 16, 16)
