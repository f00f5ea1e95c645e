"""h2_lean.walk: a stream's state machine moved along a path of h2's transitions ends where
h2's own process_input, input by input, ends it: the same state, the same attributes set by
h2's callbacks, the same events, the same error. From every state, for every input sequence
the lean paths use (sans-IO, state machines alone)."""

from __future__ import annotations

import itertools

import h2.connection
import h2.exceptions
import h2.stream
import pytest

from sdcp_fast.transport.h2_lean import QUIET_CONNECTION_STATES, stream_path, walk

STATES, IN = h2.stream.StreamState, h2.stream.StreamInputs
SEQUENCES = {   # send_whole's (answer, request) and _receive_message's
    "headers, data, end sent": (IN.SEND_HEADERS, IN.SEND_DATA, IN.SEND_END_STREAM),
    "headers, end sent": (IN.SEND_HEADERS, IN.SEND_END_STREAM),
    "headers received": (IN.RECV_HEADERS,),
    "data received": (IN.RECV_DATA,),
    "end received": (IN.RECV_END_STREAM,),
}
# what h2's callbacks set on a machine (client side or not, what was sent or received)
SETUPS = [dict(zip(("client", "headers_sent", "headers_received", "trailers_sent"), values, strict=True))
          for values in itertools.product((None, False, True), (False, True), (False, True), (False, True))]


def _machine(state, setup) -> h2.stream.H2StreamStateMachine:
    machine = h2.stream.H2StreamStateMachine(1)
    machine.state = state
    for name, value in setup.items():
        setattr(machine, name, value)
    return machine


def _outcome(machine, run) -> tuple:
    try:
        events, error = [type(e).__name__ for e in run()], None
    except (h2.exceptions.ProtocolError, ValueError) as exc:   # what process_input raises
        events, error = None, (type(exc).__name__, str(exc))
    return events, error, vars(machine)


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_walk_ends_where_process_input_ends(name):
    inputs = SEQUENCES[name]
    for state, setup in itertools.product(STATES, SETUPS):
        path = stream_path(state, *inputs)
        by_h2 = _machine(state, setup)

        def one_by_one(machine=by_h2):
            events = []
            for input_ in inputs:
                events += machine.process_input(input_)
            return events

        expected = _outcome(by_h2, one_by_one)
        if path is None:   # not allowed from here: the lean paths leave it to process_input
            assert expected[1] is not None
            continue
        lean = _machine(state, setup)
        assert _outcome(lean, lambda machine=lean, path=path: walk(machine, path)) == expected, (state, setup)


def test_quiet_connection_states_leave_the_connection_as_it_is():
    table = h2.connection.H2ConnectionStateMachine._transitions
    assert set(QUIET_CONNECTION_STATES) == {h2.connection.ConnectionState.CLIENT_OPEN,
                                            h2.connection.ConnectionState.SERVER_OPEN}
    for state in QUIET_CONNECTION_STATES:
        for input_ in h2.connection.ConnectionInputs:
            if input_.name in ("SEND_HEADERS", "SEND_DATA", "RECV_HEADERS", "RECV_DATA"):
                machine = h2.connection.H2ConnectionStateMachine()
                machine.state = state
                assert machine.process_input(input_) == [] and machine.state is state
                assert table[state, input_] == (None, state)
