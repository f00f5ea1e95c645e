"""Two sans-IO h2 connections wired together, for the tests of h2_lean's paths."""

from __future__ import annotations

import h2.events


def exchange(client, server) -> tuple[list[h2.events.Event], list[h2.events.Event]]:
    """Move bytes both ways until quiet; (the client's events, the server's events)."""
    client_events: list[h2.events.Event] = []
    server_events: list[h2.events.Event] = []
    while True:
        to_server, to_client = client.data_to_send(), server.data_to_send()
        if not to_server and not to_client:
            return client_events, server_events
        if to_server:
            server_events += server.receive_data(to_server)
        if to_client:
            client_events += client.receive_data(to_client)


def received(events: list[h2.events.Event]) -> list[tuple]:
    """What one end learns of the messages it receives, in order."""
    out = []
    for event in events:
        if isinstance(event, h2.events.RequestReceived | h2.events.ResponseReceived):
            out.append(("headers", event.stream_id, list(event.headers), event.stream_ended is not None))
        elif isinstance(event, h2.events.DataReceived):
            out.append(("data", event.stream_id, event.data))
        elif isinstance(event, h2.events.StreamEnded):
            out.append(("end", event.stream_id))
    return out
