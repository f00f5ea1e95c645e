"""What the servers remember of request header blocks: the HPACK blocks that decoded without
changing the table (server_h2.RememberingDecoder) and the requests header lists open
(exchange.RequestHeads). Remembering must never change an answer."""

from __future__ import annotations

import hpack
import pytest

from sdcp_fast.core.problems import Problem
from sdcp_fast.transport.exchange import IncomingRequest, Malformed, RequestHeads
from sdcp_fast.transport.hpack_blocks import RememberingDecoder

FIELDS = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"verifier"),
          (b":path", b"/v1/sessions/ab/proposals"), (b"content-type", b"application/sdcp+cbor")]


def test_a_block_that_adds_to_the_table_is_decoded_each_time():
    encoder, decoder = hpack.Encoder(), RememberingDecoder()
    first = encoder.encode(FIELDS)             # literals with incremental indexing
    assert decoder.decode(first, raw=True) == FIELDS
    assert first not in decoder._known
    again = encoder.encode(FIELDS)             # all references now
    assert again != first
    for _ in range(3):
        assert decoder.decode(again, raw=True) == FIELDS
    assert again in decoder._known


def test_the_same_bytes_decode_afresh_once_the_table_changed():
    """b'\\xbe' is "the newest dynamic entry": after another field is added it names that one."""
    encoder, decoder = hpack.Encoder(), RememberingDecoder()
    decoder.decode(encoder.encode([(b"x-one", b"1")]), raw=True)
    assert decoder.decode(b"\xbe", raw=True) == [(b"x-one", b"1")]
    assert decoder.decode(b"\xbe", raw=True) == [(b"x-one", b"1")]   # remembered
    decoder.decode(encoder.encode([(b"x-two", b"2")]), raw=True)
    assert decoder.decode(b"\xbe", raw=True) == [(b"x-two", b"2")]
    decoder.header_table_size = 0              # a size change empties the table
    with pytest.raises(hpack.InvalidTableIndexError):
        decoder.decode(b"\xbe", raw=True)


def test_a_lower_header_list_limit_applies_to_remembered_blocks():
    encoder, decoder = hpack.Encoder(), RememberingDecoder()
    decoder.decode(encoder.encode(FIELDS), raw=True)
    block = encoder.encode(FIELDS)
    decoder.decode(block, raw=True)
    decoder.decode(block, raw=True)
    decoder.max_header_list_size = 16
    with pytest.raises(hpack.OversizedHeaderListError):
        decoder.decode(block, raw=True)


def test_remembered_blocks_are_bounded():
    decoder = RememberingDecoder()
    for n in range(decoder.REMEMBER + 10):
        block = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(b"x-n", str(n).encode())], huffman=False)
        assert decoder.decode(block, raw=True) == [(b"x-n", str(n).encode())]
    assert len(decoder._known) <= decoder.REMEMBER
    long = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(b"x-long", b"v" * 1000)], huffman=False)
    decoder.decode(long, raw=True)
    assert long not in decoder._known


def _heads() -> RequestHeads:
    return RequestHeads(max_header_list=4096, body_limit=lambda method, path: 100)


def test_each_request_gets_its_own_incoming_request():
    heads = _heads()
    fields = [*FIELDS[:3], (b":path", b"/v1/x?a=1"), FIELDS[4]]
    first, second = heads.incoming(fields), heads.incoming(list(fields))
    expected = IncomingRequest.from_headers(fields, max_header_list=4096, body_limit=lambda m, p: 100)
    assert first == expected and second == expected
    assert first is not second and first.query is not second.query and first.body is not second.body
    first.query["b"] = "2"
    first.body += b"x"
    assert heads.incoming(fields) == expected


@pytest.mark.parametrize("fields, kind", [
    ([(b":method", b"POST"), (b":path", b"/x")], Malformed),                              # no :scheme
    ([*FIELDS[:4], (b"content-type", b"text/plain")], Problem),                           # 415
    ([*FIELDS[:4], (b"x-big", b"v" * 5000)], Problem),                                    # 431
])
def test_refusals_stay_refusals(fields, kind):
    heads = _heads()
    expected = IncomingRequest.from_headers(fields, max_header_list=4096, body_limit=lambda m, p: 100)
    assert isinstance(expected, kind)
    assert heads.incoming(fields) == expected and heads.incoming(fields) == expected
    assert not heads._known


def test_remembered_heads_are_bounded():
    heads = _heads()
    for n in range(heads.REMEMBER + 10):
        heads.incoming([*FIELDS[:3], (b":path", f"/v1/{n}".encode()), FIELDS[4]])
    assert len(heads._known) <= heads.REMEMBER
    big = [*FIELDS, (b"x-big", b"v" * 2000)]
    heads.incoming(big)
    assert tuple(big) not in heads._known


@pytest.mark.parametrize("body", [b"", b"x" * 40, b"x" * 100, b"x" * 101])
def test_a_whole_body_makes_the_request_add_body_and_finish_make(body):
    """IncomingRequest.whole on the remembered head (RequestHeads.head, the HTTP/2 server's
    whole requests): the request, or the refusal, add_body + finish give, the head unchanged."""
    heads = _heads()
    fields = [*FIELDS[:3], (b":path", b"/v1/x?a=1"), FIELDS[4]]
    expected = heads.incoming(fields)
    refusal = expected.add_body(body)
    expected = refusal if refusal is not None else expected.finish("caller")
    head = heads.head(fields)
    assert head is heads.head(fields)   # remembered, not a copy
    before = IncomingRequest(head.method, head.path, dict(head.query), head.content_type, head.max_body, head.head)
    whole = head.whole(body, "caller")
    assert whole == expected
    if refusal is None:
        assert whole.query is not head.query
        whole.query["b"] = "2"
    assert head == before and heads.incoming(fields) == before
