"""A raw HTTP/3 client for the hostile-client tests: aioquic's QUIC and H3 layers, sending
what a hostile client would and recording what the server answers, per stream."""

from __future__ import annotations

import asyncio

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, StreamReset
from transport_support import StreamLog, quic_client_configuration

from sdcp_fast.transport import TLSConfig


class RawH3(QuicConnectionProtocol):
    def __init__(self, quic: QuicConnection, **kwargs):
        super().__init__(quic, **kwargs)
        self.h3 = H3Connection(quic)
        self.streams: dict[int, StreamLog] = {}
        self.terminated: ConnectionTerminated | None = None
        self.changed = asyncio.Event()

    @classmethod
    async def open(cls, port: int, tls: TLSConfig, *, max_stream_data: int | None = None) -> RawH3:
        """`max_stream_data`: the flow-control credit the server gets per request stream
        (0: it cannot send even the response's HEADERS frame until `grant` is called)."""
        config = quic_client_configuration(str(tls.ca), str(tls.cert), str(tls.key))
        loop = asyncio.get_running_loop()
        connection = QuicConnection(configuration=config)
        if max_stream_data is not None:   # request streams only: HTTP/3's own streams keep theirs
            connection._local_max_stream_data_bidi_local = max_stream_data   # private in aioquic 1.7.2
        _, protocol = await loop.create_datagram_endpoint(lambda: cls(connection),
                                                                  local_addr=("127.0.0.1", 0))
        protocol.connect(("127.0.0.1", port))
        await asyncio.wait_for(protocol.wait_connected(), 5.0)
        return protocol

    def request(self, method: str, path: str, headers=(), body: bytes | None = None, *,
                end: bool = True) -> int:
        stream_id = self._quic.get_next_available_stream_id()
        block = [(b":method", method.encode()), (b":scheme", b"https"),
                 (b":authority", b"127.0.0.1"), (b":path", path.encode()), *headers]
        self.h3.send_headers(stream_id, block, end_stream=end and body is None)
        if body is not None:
            self.h3.send_data(stream_id, body, end_stream=end)
        self.streams[stream_id] = StreamLog()
        self.transmit()
        return stream_id

    def reset(self, stream_id: int) -> None:
        """Cancel a request (RFC 9114 4.1.1): reset our side, stop the server's."""
        self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self.transmit()

    def grant(self, stream_id: int, credit: int = 1 << 20) -> None:
        """Give the server flow-control credit on one stream (MAX_STREAM_DATA)."""
        self._quic._streams[stream_id].max_stream_data_local = credit   # private in aioquic 1.7.2
        self.transmit()

    def exceed_stream_limit(self) -> None:
        """Ignore the server's MAX_STREAMS: open streams beyond it instead of waiting."""
        self._quic._remote_max_streams_bidi = 1 << 30   # private in aioquic 1.7.2

    def quic_event_received(self, event) -> None:
        if isinstance(event, ConnectionTerminated):
            self.terminated = event
        elif isinstance(event, StreamReset):
            self.streams.setdefault(event.stream_id, StreamLog()).reset = event.error_code
        for h3_event in self.h3.handle_event(event):
            log = self.streams.setdefault(getattr(h3_event, "stream_id", -1), StreamLog())
            if isinstance(h3_event, HeadersReceived):
                log.headers = dict(h3_event.headers)
                log.status = int(log.headers[b":status"])
                log.ended = log.ended or h3_event.stream_ended
            elif isinstance(h3_event, DataReceived):
                log.body += h3_event.data
                log.data_frames += bool(h3_event.data)
                log.ended = log.ended or h3_event.stream_ended
        self.changed.set()

    def done(self, stream_id: int) -> bool:
        log = self.streams.get(stream_id)
        return log is not None and (log.ended or log.reset is not None)

    async def until(self, condition, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition(self):
                if self.terminated is not None:
                    raise AssertionError(f"connection closed: {self.terminated}")
                self.changed.clear()
                await self.changed.wait()

    async def until_closed(self, timeout: float = 30.0) -> ConnectionTerminated:   # a loaded CI machine
        async with asyncio.timeout(timeout):
            while self.terminated is None:
                self.changed.clear()
                await self.changed.wait()
        return self.terminated

    async def aclose(self) -> None:
        self.close()
        await self.wait_closed()
