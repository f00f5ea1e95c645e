"""quic_lean.LeanH3.send_message writes what aioquic's send_headers + send_data write."""

from __future__ import annotations

import pytest
from aioquic.h3.connection import FrameUnexpected
from aioquic.quic.configuration import QuicConfiguration

from sdcp_fast.transport.quic_lean import LeanH3


class RecordingQuic:
    """The QuicConnection calls H3Connection makes when it sends, recorded per stream."""

    def __init__(self, is_client: bool):
        self.configuration = QuicConfiguration(is_client=is_client)
        self._quic_logger = None
        self._next = {False: 0 if is_client else 1, True: 2 if is_client else 3}
        self.sent: dict[int, bytearray] = {}
        self.ended: set[int] = set()

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        stream_id = self._next[is_unidirectional]
        self._next[is_unidirectional] += 4
        return stream_id

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        assert stream_id not in self.ended, "data after the end of the stream"
        self.sent.setdefault(stream_id, bytearray()).extend(data)
        if end_stream:
            self.ended.add(stream_id)


REQUEST = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"v.example:4433"),
           (b":path", b"/proposals"), (b"content-type", b"application/sdcp+cbor"),
           (b"content-length", b"5")]
ANSWER = [(b":status", b"200"), (b"content-type", b"application/sdcp+cbor"), (b"content-length", b"5")]


@pytest.mark.parametrize("is_client, headers", [(True, REQUEST), (False, ANSWER)])
def test_send_message_writes_the_frames_send_headers_and_send_data_write(is_client, headers):
    lean_quic, plain_quic = RecordingQuic(is_client), RecordingQuic(is_client)
    lean, plain = LeanH3(lean_quic), LeanH3(plain_quic)
    for stream_id in (0, 4):   # a second stream: the QPACK state carries over alike
        lean.send_message(stream_id, headers, b"hello")
        plain.send_headers(stream_id, headers)
        plain.send_data(stream_id, b"hello", end_stream=True)
    assert lean_quic.sent == plain_quic.sent
    assert lean_quic.ended == plain_quic.ended == {0, 4}
    assert lean._stream.keys() == plain._stream.keys()


def test_send_message_after_headers_is_aioquics_send_headers_and_send_data():
    lean = LeanH3(RecordingQuic(True))
    lean.send_headers(4, REQUEST)
    with pytest.raises(FrameUnexpected):   # a second header block is trailers: no DATA after them
        lean.send_message(4, REQUEST, b"hello")
