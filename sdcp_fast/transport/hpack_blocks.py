"""HPACK header blocks coded once, and decoded once.

SDCP's messages repeat their header fields: every answer has the same status and type, and
a session sends the same fields with each proposal. hpack codes and decodes them field by
field in Python for every message. `header_block` codes fields into a block that means the
same whatever the peer's dynamic table holds, so it can be coded once and sent again;
`RememberingDecoder` decodes a block it has seen, while its table is unchanged, from memory.
"""

from __future__ import annotations

import hpack
import hpack.table

HeaderList = list[tuple[bytes, bytes]]


def header_block(fields: HeaderList) -> bytes:
    """`fields` as an HPACK header block that decodes alike whatever the peer's dynamic table
    holds and leaves it as it was: fields of the static table by index, the others as
    literals never indexed, not Huffman-coded (the peer decodes these bytes with every
    message; a raw literal is a slice). Coded by a fresh hpack encoder, whose own table
    stays empty."""
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(name, value) for name, value in fields],
                                  huffman=False)


class _CountedTable(hpack.table.HeaderTable):
    """hpack's table, counting its changes: entries added, the size set."""

    changes = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.changes += 1
        super().add(name, value)

    def _set_maxsize(self, value: int) -> None:
        self.changes += 1
        hpack.table.HeaderTable.maxsize.fset(self, value)

    maxsize = property(hpack.table.HeaderTable.maxsize.fget, _set_maxsize)


class RememberingDecoder(hpack.Decoder):
    """hpack's decoder, remembering the header blocks that decoded without changing its table.

    Once a session's fields are in the table its client sends the same bytes with each
    request, all references. What a block decodes to depends only on its bytes, the table and
    the decoder's limits, so while none of them changed the same bytes give the same fields;
    hpack decodes field by field in Python (about a twelfth of the verifier's work per
    proposal). A block that added to the table is not remembered: decoding it again would
    add again. Bounded per connection: blocks of at most `REMEMBER_SIZE` bytes (a proposal's
    is about 120), `REMEMBER` of them (forgotten all at once when full), 32 KiB at most
    however many distinct blocks a client sends."""

    REMEMBER = 128
    REMEMBER_SIZE = 256

    def __init__(self) -> None:
        super().__init__()
        self.header_table = _CountedTable()
        self._known: dict[bytes, tuple[tuple[int, int, int, bool], tuple]] = {}

    def decode(self, data: bytes, raw: bool = False):
        state = (self.header_table.changes, self.max_allowed_table_size, self.max_header_list_size, raw)
        data = bytes(data)
        known = self._known.get(data)
        if known is not None and known[0] == state:
            return list(known[1])
        headers = super().decode(data, raw)
        if self.header_table.changes == state[0] and len(data) <= self.REMEMBER_SIZE:
            if len(self._known) >= self.REMEMBER:
                self._known.clear()
            self._known[data] = (state, tuple(headers))
        return headers
