"""A raw HTTP/2 client for the hostile-client tests: the `h2` package driving a TLS socket.

It sends what a hostile or broken client would (malformed header blocks, resets, a zero
flow-control window, partial frames) and records every event the server sends back, per
stream and for the connection.
"""

from __future__ import annotations

import asyncio
import ssl

import h2.config
import h2.connection
import h2.events
import h2.settings
from transport_support import StreamLog

from sdcp_fast.transport import TLSConfig


class RawH2:
    """One connection. `await RawH2.open(port, tls)`; `request(...)`; `await until(...)`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 conn: h2.connection.H2Connection):
        self.reader, self.writer, self.conn = reader, writer, conn
        self.streams: dict[int, StreamLog] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self.remote_settings: dict[int, int] = {}

    @classmethod
    async def open(cls, port: int, tls: TLSConfig, *, initial_window: int | None = None,
                   preface: bool = True) -> RawH2:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cafile=tls.ca)
        context.load_cert_chain(tls.cert, tls.key)
        context.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context,
                                                       server_hostname="127.0.0.1")
        config = h2.config.H2Configuration(client_side=True, header_encoding=None,
                                           validate_outbound_headers=False,
                                           normalize_outbound_headers=False,
                                           validate_inbound_headers=False)
        conn = h2.connection.H2Connection(config)
        encode = conn.encoder.encode   # no Huffman coding: pure Python Huffman takes seconds on 300 KB
        conn.encoder.encode = lambda headers, huffman=True: encode(headers, huffman=False)
        self = cls(reader, writer, conn)
        self.silent = not preface   # sends nothing at all, not even SETTINGS acknowledgements
        if preface:
            conn.initiate_connection()
            if initial_window is not None:
                conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window})
            self.flush()
        return self

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    def request(self, method: str, path: str, headers: list[tuple[bytes, bytes]] = (),
                body: bytes | None = None, *, end: bool = True) -> int:
        """Open a stream; `end=False` leaves the request open (no body sent yet)."""
        stream_id = self.conn.get_next_available_stream_id()
        block = [(b":method", method.encode()), (b":scheme", b"https"),
                 (b":authority", b"127.0.0.1"), (b":path", path.encode()), *headers]
        self.conn.send_headers(stream_id, block, end_stream=end and body is None)
        if body is not None:
            self.conn.send_data(stream_id, body, end_stream=end)
        self.streams[stream_id] = StreamLog()
        self.flush()
        return stream_id

    def reset(self, stream_id: int, code: int = 8) -> None:  # 8: CANCEL
        self.conn.reset_stream(stream_id, code)
        self.flush()

    def write_raw(self, data: bytes) -> None:
        self.writer.write(data)

    async def until(self, done, timeout: float = 5.0) -> None:
        """Read and record events until `done(self)` holds (or the connection ends)."""
        async with asyncio.timeout(timeout):
            while not done(self):
                if self.closed:
                    raise AssertionError("connection closed before the condition held")
                await self._read()

    async def run_until_closed(self, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not self.closed:
                await self._read()

    async def _read(self) -> None:
        try:
            data = await self.reader.read(65536)
        except (ConnectionError, ssl.SSLError):
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.conn.receive_data(data):
            self._record(event)
        if not self.silent:
            self.flush()

    def _record(self, event) -> None:
        sid = getattr(event, "stream_id", None)
        log = self.streams.setdefault(sid, StreamLog()) if sid else None
        if isinstance(event, h2.events.ResponseReceived):
            log.headers = dict(event.headers)
            log.status = int(log.headers[b":status"])
        elif isinstance(event, h2.events.DataReceived):
            log.body += event.data
            log.data_frames += 1
            self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
        elif isinstance(event, h2.events.StreamEnded):
            log.ended = True
        elif isinstance(event, h2.events.StreamReset):
            log.reset = event.error_code
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            self.remote_settings.update({k: v.new_value for k, v in event.changed_settings.items()})

    def done(self, stream_id: int) -> bool:
        log = self.streams.get(stream_id)
        return log is not None and (log.ended or log.reset is not None)

    async def close(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)
        except (TimeoutError, ConnectionError, ssl.SSLError):
            pass
